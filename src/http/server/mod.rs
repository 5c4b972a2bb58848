//! HTTP server settings shared by the inbound and outbound listeners (SPEC section 8 limits),
//! and serving a connection until it ends or the drain finishes it. Every downstream
//! connection is served through [`Guarded`] (`guarded.rs`), which puts together what hyper
//! lacks, one concern per file:
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
mod sniff;
mod timers;

pub use guarded::Guarded;
pub use requests::{ConnRequests, GoneOnDrop, RequestOpen};
pub use sniff::{Codec, Wire};
// For `crate::fuzzing` only, which wraps them for the fuzz targets.
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

tokio::task_local! {
    /// The downstream connection whose future is being polled, while `serve_until_drained`
    /// polls it: the streams hyper spawns then belong to it.
    pub static CONNECTION: std::sync::Arc<ConnRequests>;
}

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let fut = Box::pin(fut);
        match CONNECTION.try_with(std::sync::Arc::clone) {
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

/// Serves one HTTP connection until it ends, is cut for rapid-reset abuse, or is finished
/// gracefully once the drain closes. Cut-offs are counted for `$listener`.
#[macro_export]
#[doc(hidden)]
macro_rules! __serve_until_drained {
    ($conn:expr, $drain:expr, $requests:expr, $listener:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let closing = $crate::drain::Drain::reached($drain.watch(), $crate::drain::Phase::Closing);
        let _gone = $crate::http::server::GoneOnDrop($requests.clone());
        let serving = async { tokio::select! {
            r = $crate::http::server::Batched::new(conn.as_mut(), Some(&*$requests)) => r.map_err(|e| {
                let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                $crate::http::server::count_codec_error($listener, &*e);
                e.to_string()
            }),
            _ = $requests.abused() => {
                $crate::http::metrics::cut_off($listener, "rapid_reset");
                Err("closed: the peer resets most of its streams early (rapid reset)".to_string())
            }
            _ = closing => {
                conn.as_mut().graceful_shutdown();
                $crate::http::server::Batched::new(conn.as_mut(), Some(&*$requests))
                    .await
                    .map_err(|e| e.to_string())
            }
        }};
        let r: Result<(), String> =
            $crate::http::server::CONNECTION.scope($requests.clone(), serving).await;
        r
    }};
}

/// Polls an HTTP/2 connection one scheduler turn after it was woken. A stream's task wakes
/// its connection as soon as it queues a head or data; polled at once (tokio runs a task woken
/// by the running one next), the connection writes and flushes that frame alone: one syscall,
/// and on TLS one record, per response or request. One turn later, the other streams that were
/// ready have queued theirs too, and one write carries them all.
///
/// `downstream` is the state of a downstream connection (`None` for an upstream HTTP/2
/// connection, which is always batched). For a downstream one, batching starts once it is
/// known to be HTTP/2 (HTTP/1.1 has one exchange at a time and nothing to gain from the wait),
/// and each poll that leaves it pending pushes what an HTTP/1 write held back for a FIN that
/// did not follow (`fin`).
pub struct Batched<'a, F> {
    inner: F,
    waited: bool,
    downstream: Option<&'a ConnRequests>,
}

impl<'a, F> Batched<'a, F> {
    pub fn new(inner: F, downstream: Option<&'a ConnRequests>) -> Batched<'a, F> {
        Batched {
            inner,
            waited: false,
            downstream,
        }
    }
}

impl<F: std::future::Future + Unpin> std::future::Future for Batched<'_, F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let batch = self.downstream.is_none_or(ConnRequests::multiplexed);
        if batch && !self.waited {
            self.waited = true;
            // A task that wakes itself goes to the back of the run queue.
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        self.waited = false;
        let r = std::pin::Pin::new(&mut self.inner).poll(cx);
        if r.is_pending() {
            if let Some(requests) = self.downstream {
                requests.push_held_fin();
            }
        }
        r
    }
}

/// Counts a connection the HTTP/2 codec ended with a GOAWAY of its own (a header list far over
/// the limit, a CONTINUATION flood, too many resets, malformed frames).
pub fn count_codec_error(listener: &'static str, e: &(dyn std::error::Error + 'static)) {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h2e) = err.downcast_ref::<h2::Error>() {
            if !(h2e.is_go_away() && h2e.is_library()) {
                return;
            }
            let reason = match h2e.reason() {
                None | Some(h2::Reason::NO_ERROR) => return,
                Some(
                    h2::Reason::ENHANCE_YOUR_CALM
                    | h2::Reason::COMPRESSION_ERROR
                    | h2::Reason::FRAME_SIZE_ERROR,
                ) => "h2_too_much",
                Some(_) => "h2_protocol_error",
            };
            crate::http::metrics::cut_off(listener, reason);
            return;
        }
        cur = err.source();
    }
}

pub use crate::__serve_until_drained as serve_until_drained;

/// Which codec a plaintext (or ALPN-less) connection speaks (`Guarded::sniff`); `None` when it
/// ended first, failed, ran out its timer, or the drain closed while it was still silent.
pub async fn sniff_codec<S>(conn: &mut Guarded<S>, drain: &crate::drain::Drain) -> Option<Codec>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let closing = crate::drain::Drain::reached(drain.watch(), crate::drain::Phase::Closing);
    tokio::select! {
        r = conn.sniff() => r.unwrap_or_else(|e| {
            tracing::debug!("connection ended before its first request: {e}");
            None
        }),
        _ = closing => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;

    use super::guarded::tests::{guarded, IDLE};

    #[tokio::test]
    async fn a_silent_connection_stops_waiting_for_its_first_bytes_when_the_drain_closes() {
        let (mut io, _client, _) = guarded();
        let drain = crate::drain::Drain::default();
        let closer = drain.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            closer.advance(crate::drain::Phase::Closing);
        });
        let start = std::time::Instant::now();
        assert_eq!(sniff_codec(&mut io, &drain).await, None);
        assert!(start.elapsed() < IDLE / 2, "took {:?}", start.elapsed());
        // While serving, bytes tell the codec.
        let (mut io, mut client, _) = guarded();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let serving = crate::drain::Drain::default();
        assert_eq!(sniff_codec(&mut io, &serving).await, Some(Codec::H1));
    }
}
