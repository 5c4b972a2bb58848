//! Trace context and spans (SPEC section 12): `context` reads and writes W3C `traceparent`,
//! this file decides per request whether to keep, create or continue it, `span` is what a
//! finished span carries, and `export` sends the spans of sampled requests to an OTLP collector.
//!
//! The per-request work on an unsampled request is a parse of one header (no allocation) and,
//! on the client side of a request that came without one, one new header value.

pub mod context;
pub mod export;
pub mod metrics;
pub mod span;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::HeaderMap;

use crate::identity::SpiffeId;
use context::{TraceParent, SAMPLED, TRACEPARENT};
use export::Exporter;
pub use span::{Finished, Side, SpanInfo};

/// The tracing settings in use, with the exporter when `tracing.otlp` is set.
pub struct Tracer {
    sample_rate: f64,
    exporter: Option<Arc<Exporter>>,
}

impl Tracer {
    pub fn new(sample_rate: f64, exporter: Option<Arc<Exporter>>) -> Tracer {
        Tracer {
            sample_rate,
            exporter,
        }
    }

    /// Applies the trace context rules to a request's headers before it is forwarded:
    /// a valid `traceparent` keeps its trace (continued by this proxy's span when it records
    /// one); without a valid one, the client side starts a trace, sampled at the configured
    /// rate, and the server side leaves the headers as they are. `tracestate` and B3 headers
    /// are never touched.
    pub fn start(&self, headers: &mut HeaderMap, side: Side) -> RequestTrace {
        // One lookup for reading and marking it (this runs on every request).
        let incoming = match headers.entry(TRACEPARENT) {
            http::header::Entry::Occupied(mut e) => {
                let tp = TraceParent::from_values(e.iter());
                if tp.is_some() {
                    crate::http::headers::never_indexed(e.get_mut());
                }
                tp
            }
            http::header::Entry::Vacant(_) => None,
        };
        let (tp, created) = match (incoming, side) {
            (Some(tp), _) => (tp, false),
            (None, Side::Server) => return RequestTrace::default(),
            (None, Side::Client) => {
                let sampled = fastrand::f64() < self.sample_rate;
                let tp = TraceParent {
                    trace_id: context::new_trace_id(),
                    parent_id: context::new_span_id(),
                    flags: if sampled { SAMPLED } else { 0 },
                };
                (tp, true)
            }
        };
        let recording = match &self.exporter {
            Some(exporter) if tp.sampled() => {
                let span_id = context::new_span_id();
                headers.insert(TRACEPARENT, tp.child(span_id).to_header());
                Some(Recording {
                    span_id,
                    parent_id: incoming.map(|t| t.parent_id),
                    flags: tp.flags,
                    side,
                    start: SystemTime::now(),
                    exporter: exporter.clone(),
                })
            }
            _ => {
                if created {
                    // `insert` also removes any invalid or repeated values that came in.
                    headers.insert(TRACEPARENT, tp.to_header());
                }
                None
            }
        };
        RequestTrace {
            trace_id: Some(tp.trace_id),
            recording,
        }
    }
}

/// What a request carries of its trace until its access-log line is written.
#[derive(Default)]
pub struct RequestTrace {
    /// The trace the request was forwarded in; `None` on the server side without a valid
    /// `traceparent`.
    pub trace_id: Option<[u8; 16]>,
    /// Set when this proxy records a span for the request.
    pub recording: Option<Recording>,
}

pub struct Recording {
    pub span_id: [u8; 8],
    /// The incoming parent id; `None` for a trace this proxy started.
    pub parent_id: Option<[u8; 8]>,
    flags: u8,
    side: Side,
    start: SystemTime,
    exporter: Arc<Exporter>,
}

impl RequestTrace {
    /// This proxy's span id, when it records one.
    pub fn span_id(&self) -> Option<[u8; 8]> {
        self.recording.as_ref().map(|r| r.span_id)
    }

    /// Ends the span (when one is recorded) `elapsed` after it started and queues it for
    /// export; never waits.
    pub fn finish(self, elapsed: Duration, info: impl FnOnce() -> SpanInfo) {
        let (Some(trace_id), Some(rec)) = (self.trace_id, self.recording) else {
            return;
        };
        let start = unix_nanos(rec.start);
        rec.exporter.push(Finished {
            trace_id,
            span_id: rec.span_id,
            parent_id: rec.parent_id,
            flags: rec.flags,
            side: rec.side,
            start_unix_nanos: start,
            end_unix_nanos: start.saturating_add(elapsed.as_nanos().min(u64::MAX.into()) as u64),
            info: info(),
        });
    }
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos().min(u64::MAX.into()) as u64)
}

/// The service name spans are reported under: the last segment of the workload's SPIFFE id
/// (`spiffe://td/ns/default/sa/payments` is `payments`), the service account, as the
/// metrics' `service` label.
pub fn service_name(id: &SpiffeId) -> String {
    id.last_segment().to_string()
}

static TRACER: OnceLock<Tracer> = OnceLock::new();

/// Installs the tracer `cfg` describes for the workload `id`, starting the export task when a
/// collector is set. Needs a running tokio runtime.
pub fn start(cfg: &crate::config::TracingConfig, id: &SpiffeId) {
    let exporter = cfg
        .otlp
        .as_ref()
        .map(|addr| Arc::new(Exporter::spawn(addr.as_str(), &service_name(id))));
    install(Tracer::new(cfg.sample_rate, exporter));
}

/// Sets the process's tracer; the first call wins (`run` calls it once at start-up).
pub fn install(tracer: Tracer) {
    let _ = TRACER.set(tracer);
}

/// Sends the spans still queued, waiting at most `limit`; false when they could not all go
/// in time. Without a collector there is nothing to send.
pub async fn flush(limit: std::time::Duration) -> bool {
    match &tracer().exporter {
        Some(e) => e.flush(limit).await,
        None => true,
    }
}

/// The process's tracer: the installed one, or the defaults (sample rate 0.01, no export).
pub fn tracer() -> &'static Tracer {
    TRACER.get_or_init(|| Tracer::new(crate::config::DEFAULT_SAMPLE_RATE, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(tp: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in tp {
            h.append(TRACEPARENT, HeaderValue::from_static(v));
        }
        h.insert("tracestate", HeaderValue::from_static("a=b"));
        h
    }

    #[test]
    fn without_an_exporter_a_valid_header_passes_unchanged() {
        for side in [Side::Client, Side::Server] {
            let mut h = headers(&[GOOD]);
            let t = Tracer::new(1.0, None).start(&mut h, side);
            assert_eq!(h.get(TRACEPARENT).unwrap(), GOOD);
            assert_eq!(h.get("tracestate").unwrap(), "a=b");
            assert!(t.recording.is_none());
            assert_eq!(t.trace_id.unwrap()[0], 0x4b);
        }
    }

    #[test]
    fn the_client_side_starts_a_trace_at_the_sample_rate() {
        for (rate, flags) in [(0.0, "00"), (1.0, "01")] {
            let mut h = headers(&[]);
            Tracer::new(rate, None).start(&mut h, Side::Client);
            let v = h.get(TRACEPARENT).unwrap().to_str().unwrap();
            assert!(TraceParent::parse(v.as_bytes()).is_some(), "{v}");
            assert!(v.ends_with(flags), "{v}");
        }
        // Invalid or repeated headers are replaced by one new value.
        let mut h = headers(&["00-xyz", GOOD]);
        Tracer::new(0.0, None).start(&mut h, Side::Client);
        assert_eq!(h.get_all(TRACEPARENT).iter().count(), 1);
        let made = TraceParent::from_headers(&h).expect("one valid traceparent");
        assert_ne!(made, TraceParent::parse(GOOD.as_bytes()).unwrap());
    }

    #[test]
    fn forwarded_values_stay_out_of_hpack_tables() {
        // Passed on (either side), or written here: each request's own value, never indexed.
        for (side, incoming) in [
            (Side::Client, &[GOOD][..]),
            (Side::Server, &[GOOD][..]),
            (Side::Client, &[][..]),
        ] {
            let mut h = headers(incoming);
            Tracer::new(0.0, None).start(&mut h, side);
            assert!(h.get(TRACEPARENT).unwrap().is_sensitive(), "{side:?}");
        }
        // A value this proxy does not pass on as a trace is left as it came.
        let mut h = headers(&["00-xyz"]);
        Tracer::new(1.0, None).start(&mut h, Side::Server);
        assert!(!h.get(TRACEPARENT).unwrap().is_sensitive());
    }

    #[test]
    fn the_server_side_never_starts_one() {
        let mut h = headers(&["00-xyz"]);
        let t = Tracer::new(1.0, None).start(&mut h, Side::Server);
        assert_eq!(h.get(TRACEPARENT).unwrap(), "00-xyz");
        assert!(t.trace_id.is_none() && t.recording.is_none());
    }
}
