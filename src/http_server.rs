//! HTTP server settings shared by the inbound and outbound listeners (SPEC section 8 limits),
//! and serving a connection until it ends or the drain finishes it.

use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Server builders, made once and shared by every connection.
pub struct Servers {
    pub h1: hyper::server::conn::http1::Builder,
    pub h2: hyper::server::conn::http2::Builder<TokioExecutor>,
    pub auto: hyper_util::server::conn::auto::Builder<TokioExecutor>,
}

/// hyper's own hard limits, far above ours (100 headers, 60 KiB) so that our check, which
/// answers with `x-aether-error: headers-too-large`, sees nearly every oversized request.
/// Past these hyper answers a bare 431 (HTTP/1.1) or refuses the stream (HTTP/2).
pub const HYPER_MAX_HEADERS: usize = 1024;
pub const HYPER_MAX_BUF: usize = 1024 * 1024;

/// Slow clients are cut off after this long without a complete header block.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle downstream connections close after this long (SPEC section 8).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

impl Servers {
    pub fn new() -> Servers {
        let mut h1 = hyper::server::conn::http1::Builder::new();
        configure_h1(&mut h1);
        let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        configure_h2(&mut h2);
        let mut auto = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        // The auto builder wraps the same settings behind its own types.
        auto.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .max_headers(HYPER_MAX_HEADERS)
            .max_buf_size(HYPER_MAX_BUF)
            .keep_alive(true);
        auto.http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(1024)
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(24 << 20)
            .max_frame_size(64 << 10)
            .max_header_list_size(HYPER_MAX_BUF as u32)
            .max_pending_accept_reset_streams(Some(200))
            .max_local_error_reset_streams(Some(1024));
        Servers { h1, h2, auto }
    }
}

impl Default for Servers {
    fn default() -> Self {
        Servers::new()
    }
}

fn configure_h1(b: &mut hyper::server::conn::http1::Builder) {
    // hyper answers past its own limits; ours (100 headers, 60 KiB) are checked per request so
    // the answer carries `x-aether-error`.
    b.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_headers(HYPER_MAX_HEADERS)
        .max_buf_size(HYPER_MAX_BUF)
        .keep_alive(true);
}

fn configure_h2(b: &mut hyper::server::conn::http2::Builder<TokioExecutor>) {
    b.timer(TokioTimer::new())
        .max_concurrent_streams(1024)
        .initial_stream_window_size(16 << 20)
        .initial_connection_window_size(24 << 20)
        .max_frame_size(64 << 10)
        .max_header_list_size(HYPER_MAX_BUF as u32)
        // Rapid reset (CVE-2023-44487): h2 closes connections that reset too many streams.
        .max_pending_accept_reset_streams(Some(200))
        .max_local_error_reset_streams(Some(1024));
}

/// Serves one HTTP connection until it ends, or finishes it gracefully once the drain closes.
#[macro_export]
#[doc(hidden)]
macro_rules! __serve_until_drained {
    ($conn:expr, $drain:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let closing = $crate::drain::Drain::reached($drain.watch(), $crate::drain::Phase::Closing);
        tokio::select! {
            r = conn.as_mut() => r.map_err(|e| e.to_string()),
            _ = closing => {
                conn.as_mut().graceful_shutdown();
                conn.await.map_err(|e| e.to_string())
            }
        }
    }};
}

pub use crate::__serve_until_drained as serve_until_drained;
