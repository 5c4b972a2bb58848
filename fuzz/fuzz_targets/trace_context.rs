//! Trace context from request headers, which any client sets: a `traceparent` value parses to a
//! context that encodes back to the same fields, or to nothing; and after the tracer has run on
//! any set of `traceparent` values, the request carries at most one, and a valid one whenever
//! it came in valid or the client side started the trace. `tracestate` and B3 pass untouched.
#![no_main]

use std::sync::Arc;

use aether_proxy::trace::context::TraceParent;
use aether_proxy::trace::export::Exporter;
use aether_proxy::trace::{Side, Tracer};
use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    value: Vec<u8>,
    /// Further `traceparent` values on the same request.
    more: Vec<Vec<u8>>,
    tracestate: Vec<u8>,
    b3: Vec<u8>,
    client_side: bool,
    /// Whether spans are recorded (an exporter with a queue and no collector).
    exporting: bool,
}

fuzz_target!(|input: Input| {
    if let Some(tp) = TraceParent::parse(&input.value) {
        let again = TraceParent::parse(&tp.encode()).expect("an encoded context parses");
        assert_eq!(
            (again.trace_id, again.parent_id, again.flags),
            (tp.trace_id, tp.parent_id, tp.flags)
        );
        let child = tp.child([7; 8]);
        assert_eq!((child.trace_id, child.parent_id), (tp.trace_id, [7; 8]));
    }

    let mut headers = HeaderMap::new();
    let mut values = vec![input.value.clone()];
    values.extend(input.more.iter().take(3).cloned());
    for v in &values {
        if let Ok(v) = HeaderValue::from_bytes(v) {
            headers.append("traceparent", v);
        }
    }
    let single_valid = match headers.get_all("traceparent").iter().collect::<Vec<_>>()[..] {
        [v] => TraceParent::parse(v.as_bytes()),
        _ => None,
    };
    let others: Vec<_> = [("tracestate", &input.tracestate), ("b3", &input.b3)]
        .into_iter()
        .filter_map(|(n, v)| HeaderValue::from_bytes(v).ok().map(|v| (n, v)))
        .collect();
    for (n, v) in &others {
        headers.insert(*n, v.clone());
    }
    let exporter = input
        .exporting
        .then(|| Arc::new(Exporter::with_queue(4).0));
    let side = if input.client_side { Side::Client } else { Side::Server };
    let trace = Tracer::new(1.0, exporter).start(&mut headers, side);

    let out: Vec<_> = headers.get_all("traceparent").iter().collect();
    if single_valid.is_some() || input.client_side {
        assert_eq!(out.len(), 1, "one traceparent leaves");
        let tp = TraceParent::parse(out[0].as_bytes()).expect("a valid traceparent leaves");
        assert_eq!(Some(tp.trace_id), trace.trace_id);
        if let Some(incoming) = single_valid {
            assert_eq!(tp.trace_id, incoming.trace_id, "the trace is kept");
        }
    } else {
        assert!(trace.trace_id.is_none());
    }
    for (n, v) in &others {
        assert_eq!(headers.get(*n), Some(v), "{n} untouched");
    }
});
