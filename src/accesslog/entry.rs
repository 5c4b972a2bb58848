//! The access-log lines as data: one struct per kind of line, whose serde schema is the line's
//! JSON. A request's line is written by hand from the same struct (`encode.rs`), checked
//! against this schema by a test.

use serde::Serialize;

use super::time::Rfc3339;

/// A request's line.
#[derive(Serialize)]
pub struct Entry<'a> {
    pub time: Rfc3339,
    pub direction: &'a str,
    pub method: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    pub status: u16,
    pub error: Option<&'a str>,
    pub upstream: Option<std::net::SocketAddr>,
    pub duration_ms: f64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub peer_identity: Option<&'a str>,
    pub request_id: Option<&'a str>,
    /// The trace the request was forwarded in (hex), when it has one.
    pub trace_id: Option<&'a str>,
    /// This proxy's span for the request (hex), when it recorded one.
    pub span_id: Option<&'a str>,
}

/// The line a spliced connection leaves when it closes.
#[derive(Serialize)]
pub(super) struct ConnEntry<'a> {
    pub time: Rfc3339,
    pub direction: &'a str,
    /// `tcp` (an inbound tcp chain), `connect`, `upgrade`, `capture` (a captured connection
    /// tunnelled to a service's tcp port), `egress` (a captured connection leaving the mesh).
    pub protocol: &'a str,
    pub authority: &'a str,
    pub upstream: Option<std::net::SocketAddr>,
    pub duration_ms: f64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub end_reason: &'a str,
    /// Why the proxy closed a captured connection itself (an `x-aether-error` reason, or
    /// `egress-denied`); absent on every other line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'a str>,
    pub peer_identity: Option<&'a str>,
    pub request_id: Option<&'a str>,
}
