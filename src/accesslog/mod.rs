//! One JSON line per request on stdout (SPEC section 6), and one per spliced connection (tcp
//! chain, CONNECT tunnel, upgrade) when it closes (SPEC section 12).
//!
//! Lines are queued and written by a background thread every 50 ms, or sooner once 32 KiB wait
//! (and at exit), so the data path never waits on a stdout write.
//!
//! The lines as data (`entry.rs`), a request's line written by hand (`encode.rs`), timestamps
//! (`time.rs`), the queue and its writer thread (`writer.rs`), the request families counted as
//! each line is recorded (`metrics.rs`).

mod encode;
mod entry;
pub mod metrics;
mod time;
mod writer;

pub use entry::Entry;
pub use time::Rfc3339;
pub use writer::flush_at_exit;

use std::sync::Arc;

use hyper::body::Incoming;
use serde::Serialize;

use crate::http::answer::Reason;
use crate::http::body::{Metered, RespBody};
use crate::identity::SpiffeId;
use crate::metrics::Direction;
use crate::trace::{context::hex_into, RequestTrace, SpanInfo};
use entry::ConnEntry;

/// A spliced connection's record, started when it opens; `finish` writes its line.
pub struct ConnLog {
    pub start: std::time::Instant,
    pub direction: Direction,
    pub protocol: &'static str,
    pub authority: String,
    pub upstream: Option<std::net::SocketAddr>,
    pub peer_identity: Option<SpiffeId>,
    pub request_id: Option<http::HeaderValue>,
    /// See `ConnEntry::error`.
    pub error: Option<&'static str>,
}

impl ConnLog {
    pub fn new(direction: Direction, protocol: &'static str, authority: String) -> ConnLog {
        ConnLog {
            start: std::time::Instant::now(),
            direction,
            protocol,
            authority,
            upstream: None,
            peer_identity: None,
            request_id: None,
            error: None,
        }
    }

    pub fn finish(self, s: &crate::sockets::Spliced) {
        log(&ConnEntry {
            time: Rfc3339::now(),
            direction: match self.direction {
                Direction::inbound => "inbound",
                Direction::outbound => "outbound",
            },
            protocol: self.protocol,
            authority: &self.authority,
            upstream: self.upstream,
            duration_ms: self.start.elapsed().as_secs_f64() * 1000.0,
            bytes_received: s.received,
            bytes_sent: s.sent,
            end_reason: s.end.as_str(),
            error: self.error,
            peer_identity: self.peer_identity.as_ref().map(SpiffeId::as_str),
            request_id: self.request_id.as_ref().and_then(|v| v.to_str().ok()),
        });
    }
}

/// One request's record, started when its headers arrive and finished when its response body
/// ends: the access-log line and the request metrics.
pub struct RequestLog {
    pub start: std::time::Instant,
    pub direction: Direction,
    pub method: http::Method,
    pub authority: String,
    pub path: String,
    pub request_id: http::HeaderValue,
    pub peer_identity: Option<SpiffeId>,
    /// Request body bytes, counted as they go upstream.
    pub received: Arc<crate::http::body::Received>,
    /// The request's trace; its span (when recorded) ends with the log line.
    pub trace: RequestTrace,
}

/// What the routing decided, known once the response headers are ready.
pub struct Decided {
    pub status: u16,
    pub reason: Option<Reason>,
    pub upstream: Option<std::net::SocketAddr>,
    /// Metric labels (catalog names only). Shared, not copied: every request of a service
    /// carries the same name.
    pub service: Option<Arc<str>>,
    pub port: u16,
    /// Outbound: the identity pinned on the upstream connection (inbound logs the client's).
    pub peer: Option<SpiffeId>,
}

impl RequestLog {
    pub fn new(
        direction: Direction,
        req: &http::Request<Incoming>,
        authority: String,
        request_id: http::HeaderValue,
        peer_identity: Option<SpiffeId>,
    ) -> RequestLog {
        RequestLog {
            start: std::time::Instant::now(),
            direction,
            method: req.method().clone(),
            authority,
            path: req.uri().path().to_string(),
            request_id,
            peer_identity,
            received: Default::default(),
            trace: RequestTrace::default(),
        }
    }

    /// Records the request; `sent` is the response body bytes.
    pub fn finish(self, d: &Decided, sent: u64) {
        let elapsed = self.start.elapsed();
        let m = metrics::metrics();
        let service = d.service.as_deref().unwrap_or_default();
        metrics::count_request(self.direction, service, d.port, d.status);
        if let Some(r) = d.reason {
            m.errors
                .get_or_create(&metrics::ErrorLabels {
                    direction: self.direction,
                    reason: r.as_str(),
                })
                .inc();
        }
        m.duration(self.direction).observe(elapsed.as_secs_f64());
        let (mut trace_hex, mut span_hex) = ([0u8; 32], [0u8; 16]);
        let trace_id = self.trace.trace_id.map(|t| {
            hex_into(&t, &mut trace_hex);
            std::str::from_utf8(&trace_hex).unwrap_or_default()
        });
        let span_id = self.trace.span_id().map(|s| {
            hex_into(&s, &mut span_hex);
            std::str::from_utf8(&span_hex).unwrap_or_default()
        });
        log_request(&Entry {
            time: Rfc3339::now(),
            direction: match self.direction {
                Direction::inbound => "inbound",
                Direction::outbound => "outbound",
            },
            method: self.method.as_str(),
            authority: &self.authority,
            path: &self.path,
            status: d.status,
            error: d.reason.map(Reason::as_str),
            upstream: d.upstream,
            duration_ms: elapsed.as_secs_f64() * 1000.0,
            bytes_received: self.received.bytes(),
            bytes_sent: sent,
            peer_identity: self
                .peer_identity
                .as_ref()
                .or(d.peer.as_ref())
                .map(SpiffeId::as_str),
            request_id: self.request_id.to_str().ok(),
            trace_id,
            span_id,
        });
        // The span ends with the line: same end, same status and reason.
        let peer = self.peer_identity.or_else(|| d.peer.clone());
        self.trace.finish(elapsed, || SpanInfo {
            method: self.method,
            authority: self.authority,
            path: self.path,
            status: d.status,
            error: d.reason.map(Reason::as_str),
            peer,
        });
    }
}

/// Wraps a response so that, when its body ends, the request is logged and counted and
/// `guard` (in-flight counters and the like) is released.
pub fn finish_with<G: Send + Sync + 'static>(
    resp: http::Response<crate::http::answer::Body>,
    log: RequestLog,
    decided: Decided,
    guard: G,
) -> http::Response<RespBody> {
    resp.map(move |b| {
        Metered::counted_here(b).on_end(Box::new(move |_clean, sent| {
            drop(guard);
            log.finish(&decided, sent);
        }))
    })
}

fn log(entry: &impl Serialize) {
    let mut line = Vec::with_capacity(512);
    if serde_json::to_writer(&mut line, entry).is_err() {
        return;
    }
    writer::push_line(line);
}

/// An HTTP request's line: the same JSON `serde_json` makes of `Entry`, written by hand because
/// this runs once per request and serde's per-byte string escaping was the largest single cost
/// of it.
fn log_request(e: &Entry<'_>) {
    thread_local! {
        // Each line is built here and copied into the queue, so no line allocates.
        static LINE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    LINE.with_borrow_mut(|out| {
        out.clear();
        out.reserve(512);
        e.write_json(out);
        out.push(b'\n');
        writer::queue_line(out);
        out.truncate(0);
        out.shrink_to(2048);
    });
}
