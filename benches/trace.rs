//! The per-request cost of trace context: reading a `traceparent`, writing one, and the whole
//! decision a proxy makes per request (`Tracer::start`) on the unsampled and sampled paths.

use std::hint::black_box;
use std::sync::Arc;

use aether_proxy::trace::context::{new_span_id, new_trace_id, TraceParent, TRACEPARENT};
use aether_proxy::trace::export::Exporter;
use aether_proxy::trace::{Side, Tracer};
use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderMap, HeaderValue};

const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const UNSAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

fn headers(tp: Option<&'static str>) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("host", HeaderValue::from_static("payments.aether.internal"));
    h.insert("user-agent", HeaderValue::from_static("bench"));
    if let Some(tp) = tp {
        h.insert(TRACEPARENT, HeaderValue::from_static(tp));
    }
    h
}

fn bench(c: &mut Criterion) {
    c.bench_function("traceparent/parse", |b| {
        b.iter(|| TraceParent::parse(black_box(GOOD.as_bytes())))
    });
    c.bench_function("traceparent/generate", |b| {
        b.iter(|| {
            TraceParent {
                trace_id: new_trace_id(),
                parent_id: new_span_id(),
                flags: 0,
            }
            .to_header()
        })
    });

    let unsampled = Tracer::new(0.0, None);
    c.bench_function("start/unsampled, traceparent came in", |b| {
        let mut h = headers(Some(UNSAMPLED));
        b.iter(|| unsampled.start(black_box(&mut h), Side::Client))
    });
    c.bench_function("start/unsampled, client side creates one", |b| {
        b.iter_batched_ref(
            || headers(None),
            |h| unsampled.start(h, Side::Client),
            criterion::BatchSize::SmallInput,
        )
    });
    // The queue is never read here: `start` only decides and rewrites, spans are queued at
    // the end of the request.
    let (exporter, _queue) = Exporter::with_queue(16);
    let sampled = Tracer::new(1.0, Some(Arc::new(exporter)));
    c.bench_function("start/sampled, span recorded", |b| {
        let mut h = headers(Some(GOOD));
        b.iter(|| sampled.start(black_box(&mut h), Side::Server))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
