//! What a recorded span carries from the data path to the export task.

use crate::identity::SpiffeId;

/// Which proxy of the exchange this is: the client side (outbound) starts traces, the server
/// side (inbound) only continues them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// What the finished request's span says, besides its ids and times.
pub struct SpanInfo {
    pub method: http::Method,
    pub authority: String,
    pub path: String,
    pub status: u16,
    /// The `x-aether-error` reason.
    pub error: Option<&'static str>,
    pub peer: Option<SpiffeId>,
}

/// A finished span as the data path hands it over; turned into protobuf by the export task.
pub struct Finished {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_id: Option<[u8; 8]>,
    pub flags: u8,
    pub side: Side,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    pub info: SpanInfo,
}
