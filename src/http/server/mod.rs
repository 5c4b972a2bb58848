//! HTTP server settings shared by the inbound and outbound listeners (SPEC section 8 limits):
//! the hyper builders, and the executor that runs HTTP/2 streams. Serving a connection until
//! it ends or the drain finishes it is `serve.rs`. Every downstream connection is served
//! through [`Guarded`] (`guarded.rs`), which puts together what hyper lacks, one concern per
//! file:
//! * `sniff.rs`: which codec the connection speaks (ALPN, or the HTTP/2 preface);
//! * `h2_frames.rs`: HTTP/2 frame boundaries, for the header-block timer;
//! * `head_lines.rs`: an HTTP/1 head's fields counted, its framing checked, as bytes arrive;
//! * `timers.rs`: the downstream timers;
//! * `refusal.rs`: answers written raw (431, 400), the linger after them, and hyper's own
//!   refusals answered the proxy's way;
//! * `requests.rs`: per-connection request accounting, and the rapid-reset rule.

mod guarded;
mod h2_frames;
mod head_lines;
mod refusal;
mod requests;
pub mod serve;
mod sniff;
mod timers;

pub(crate) use serve::serve_until_drained;
pub use guarded::Guarded;
pub use requests::{ConnRequests, RequestOpen};
pub use serve::{sniff_codec, Batched};
pub use sniff::{Codec, Wire};
// For `crate::fuzzing` only, which wraps them for the fuzz targets.
#[cfg(feature = "testing")]
pub(crate) use self::{h2_frames::Frames, head_lines::HeadLines, sniff::Seen};

use hyper_util::rt::TokioTimer;

use super::limits::{
    H2_CONNECTION_WINDOW, H2_MAX_CONCURRENT_STREAMS, H2_MAX_FRAME, H2_MAX_HEADER_LIST,
    H2_MAX_LOCAL_ERROR_RESETS, H2_MAX_PENDING_ACCEPT_RESETS, H2_STREAM_WINDOW, HYPER_MAX_BUF,
};

/// Server builders, made once and shared by every connection.
pub struct Servers {
    pub h1: hyper::server::conn::http1::Builder,
    pub h2: hyper::server::conn::http2::Builder<StreamExecutor>,
}

impl Servers {
    pub fn new() -> Servers {
        let mut h1 = hyper::server::conn::http1::Builder::new();
        configure_h1(&mut h1);
        let mut h2 = hyper::server::conn::http2::Builder::new(StreamExecutor);
        configure_h2(&mut h2);
        Servers { h1, h2 }
    }
}

/// Runs each HTTP/2 stream hyper hands over as its own task, boxed first. tokio moves the
/// future it is given through each layer of `spawn` and again when the task completes; boxed,
/// those moves are of one pointer. The exchange itself (routing, forwarding and logging
/// state, KiBs) is boxed by each service where it is built, so what is boxed here is hyper's
/// small stream, which unboxed still made each request measurably dearer on both sides.
/// `drain::accept_until_closing` boxes each connection's future for the same reason.
#[derive(Clone, Copy, Debug)]
pub struct StreamExecutor;

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let fut = Box::pin(fut);
        match serve::CONNECTION.try_with(std::sync::Arc::clone) {
            // A stream's task ends with its connection: hyper leaves the tasks running when
            // the connection ends, and one waiting on a stalled upstream would hold its
            // request (and what the connection buffered for it) until a timer fired.
            Ok(conn) => {
                tokio::spawn(async move {
                    tokio::select! {
                        biased;
                        _ = fut => {}
                        _ = conn.gone() => {}
                    }
                });
            }
            Err(_) => {
                tokio::spawn(fut);
            }
        }
    }
}

impl Default for Servers {
    fn default() -> Self {
        Servers::new()
    }
}

fn configure_h1(b: &mut hyper::server::conn::http1::Builder) {
    // hyper answers past its own limits without `x-aether-error`, so `Guarded` refuses heads
    // before they reach them (over 100 fields, over `H1_MAX_HEAD`). hyper's field count stays
    // at its default, which is SPEC's 100: any other value, larger included, makes hyper
    // allocate its two field arrays on the heap for every head it parses (2 x 32 KiB at 1024).
    b.timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(HYPER_MAX_BUF)
        .keep_alive(true);
}

fn configure_h2(b: &mut hyper::server::conn::http2::Builder<StreamExecutor>) {
    b.timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .max_header_list_size(H2_MAX_HEADER_LIST)
        // Rapid reset (CVE-2023-44487): h2 closes connections that reset too many streams.
        .max_pending_accept_reset_streams(Some(H2_MAX_PENDING_ACCEPT_RESETS))
        .max_local_error_reset_streams(Some(H2_MAX_LOCAL_ERROR_RESETS));
}
