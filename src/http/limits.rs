//! Numbers every HTTP connection shares, inbound or outbound, server or client side: defined
//! once so the two directions cannot drift apart.

use std::time::Duration;

/// HTTP/2 flow control and framing, as Envoy sets them: 16 MiB per stream, 24 MiB per
/// connection, 64 KiB frames.
pub const H2_STREAM_WINDOW: u32 = 16 << 20;
pub const H2_CONNECTION_WINDOW: u32 = 24 << 20;
pub const H2_MAX_FRAME: u32 = 64 << 10;
/// Streams a downstream HTTP/2 connection may open at once.
pub const H2_MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Pings on pooled upstream HTTP/2 connections that carry streams.
pub const H2_KEEPALIVE: Duration = Duration::from_secs(60);
/// Rapid reset (CVE-2023-44487): h2's own cap on streams reset before they were accepted, and
/// on streams this side reset for protocol errors.
pub const H2_MAX_PENDING_ACCEPT_RESETS: usize = 200;
pub const H2_MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// hyper's own hard limits, far above ours (`headers::MAX_HEADERS`, `MAX_HEADER_BYTES`) so that
/// our check, which answers with `x-aether-error: headers-too-large`, sees nearly every
/// oversized request. Past these hyper answers a bare 431 (HTTP/1.1) or refuses the stream
/// (HTTP/2).
pub const HYPER_MAX_HEADERS: usize = 1024;
pub const HYPER_MAX_BUF: usize = 1024 * 1024;

/// Slow clients are cut off after this long without a complete header block.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle downstream connections close after this long (SPEC section 8).
pub const DOWNSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Idle pooled upstream connections close after this long (SPEC section 8).
pub const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
