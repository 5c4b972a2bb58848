//! Per-request header and access-log work on both sides of a proxy: the hop-by-hop rules on a
//! request that carries none, on a response that says `Connection: keep-alive` (nginx does), and
//! on a gRPC request (`te: trailers`), adding an `x-request-id` to a request without one, and
//! writing one access-log line.

use std::hint::black_box;

use aether_proxy::accesslog::{Entry, Rfc3339};
use aether_proxy::http::headers::{ensure_request_id, strip_hop_by_hop};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use http::{HeaderMap, HeaderValue};

fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, HeaderValue::from_static(v));
    }
    h
}

fn bench(c: &mut Criterion) {
    let cases = [
        (
            "request, none present",
            map(&[
                ("host", "payments.aether.internal"),
                ("user-agent", "wrk"),
                ("accept", "*/*"),
                ("x-request-id", "9608f6c5-8b4b-4794-a97a-e008c54da785"),
                (
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
                ),
            ]),
        ),
        (
            "request, connection: close",
            map(&[
                ("host", "payments.aether.internal"),
                ("user-agent", "h2load"),
                ("accept", "*/*"),
                ("connection", "close"),
            ]),
        ),
        (
            "response, connection: keep-alive",
            map(&[
                ("server", "nginx"),
                ("date", "Tue, 01 Dec 2026 23:11:55 GMT"),
                ("content-type", "text/plain"),
                ("content-length", "64"),
                ("connection", "keep-alive"),
            ]),
        ),
        (
            "grpc request, te: trailers",
            map(&[
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", "1S"),
                ("user-agent", "grpc-python"),
            ]),
        ),
    ];
    // The client side of every request that comes without an id (wrk, h2load, most apps).
    let bare = map(&[("host", "payments.aether.internal"), ("accept", "*/*")]);
    c.bench_function("ensure_request_id/absent", |b| {
        b.iter_batched_ref(
            || bare.clone(),
            |h| ensure_request_id(black_box(h)),
            BatchSize::SmallInput,
        )
    });
    for (name, h) in cases {
        c.bench_function(&format!("strip_hop_by_hop/{name}"), |b| {
            b.iter_batched_ref(
                || h.clone(),
                |h| strip_hop_by_hop(black_box(h)),
                BatchSize::SmallInput,
            )
        });
    }

    let entry = Entry {
        time: Rfc3339(std::time::UNIX_EPOCH + std::time::Duration::new(1_796_166_715, 123_456_789)),
        direction: "inbound",
        method: "GET",
        authority: "payments.aether.internal",
        path: "/",
        status: 200,
        error: None,
        upstream: Some("127.0.0.1:8080".parse().unwrap()),
        duration_ms: 0.412,
        bytes_received: 0,
        bytes_sent: 64,
        peer_identity: Some("spiffe://aether.local/ns/default/sa/frontend"),
        request_id: Some("9608f6c5-8b4b-4794-a97a-e008c54da785"),
        trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
        span_id: None,
    };
    c.bench_function("access log line", |b| {
        b.iter(|| {
            let mut out = Vec::with_capacity(512);
            black_box(&entry).write_json(&mut out);
            out
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
