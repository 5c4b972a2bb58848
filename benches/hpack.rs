//! One request and its answer over an h2 connection (both ends in this process, an in-memory
//! pipe between them), with the header block a proxied request carries: the repeating headers
//! and two values new on every request, `x-request-id` and `traceparent`. Once as an app sends
//! them (HPACK indexes every value), once as the sidecar forwards them (those two never indexed,
//! `headers::never_indexed`): indexed, each unique value takes a slot in both ends' tables and
//! pushes out the repeating headers, which then go out again as literals.

use aether_proxy::http::headers::{self, X_REQUEST_ID};
use aether_proxy::trace::context::TRACEPARENT;
use aether_proxy::trace::{Side, Tracer};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderValue, Request, Response};

/// An h2 server answering every request 200 with no body, and a client connected to it.
async fn pair() -> h2::client::SendRequest<Bytes> {
    let (c, s) = tokio::io::duplex(256 * 1024);
    tokio::spawn(async move {
        let mut conn = h2::server::handshake(s).await.unwrap();
        while let Some(Ok((_req, mut respond))) = conn.accept().await {
            respond.send_response(Response::new(()), true).unwrap();
        }
    });
    let (send, conn) = h2::client::handshake(c).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    send.ready().await.unwrap()
}

fn request(sidecar: bool) -> Request<()> {
    let mut req = Request::get("http://payments.aether.internal:9090/small")
        .header("user-agent", "h2load nghttp2/1.52.0")
        .header("accept", "*/*")
        .header("x-forwarded-proto", "http")
        .body(())
        .unwrap();
    let h = req.headers_mut();
    headers::ensure_request_id(h);
    Tracer::new(0.0, None).start(h, Side::Client);
    // The same copy either way; only the flag differs.
    for name in [X_REQUEST_ID, TRACEPARENT] {
        let mut v = HeaderValue::from_bytes(h[&name].as_bytes()).unwrap();
        if sidecar {
            headers::never_indexed(&mut v);
        }
        h.insert(name, v);
    }
    req
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for (name, sidecar) in [
        ("h2 request, unique values indexed", false),
        ("h2 request, unique values never indexed", true),
    ] {
        let mut send = rt.block_on(pair());
        c.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(async {
                    let (resp, _) = send.send_request(request(sidecar), true).unwrap();
                    assert_eq!(resp.await.unwrap().status(), 200);
                    send = send.clone().ready().await.unwrap();
                })
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
