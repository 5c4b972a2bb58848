//! HTTP server settings shared by the inbound and outbound listeners (SPEC section 8 limits),
//! and serving a connection until it ends or the drain finishes it.

use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::limits::{
    DOWNSTREAM_IDLE_TIMEOUT, H2_CONNECTION_WINDOW, H2_MAX_CONCURRENT_STREAMS, H2_MAX_FRAME,
    H2_MAX_LOCAL_ERROR_RESETS, H2_MAX_PENDING_ACCEPT_RESETS, H2_STREAM_WINDOW, HEADER_READ_TIMEOUT,
    HYPER_MAX_BUF, HYPER_MAX_HEADERS,
};

/// Server builders, made once and shared by every connection.
pub struct Servers {
    pub h1: hyper::server::conn::http1::Builder,
    pub h2: hyper::server::conn::http2::Builder<TokioExecutor>,
    pub auto: hyper_util::server::conn::auto::Builder<TokioExecutor>,
}

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
            // Our `Timed` IO runs the header-read and idle timers (see there).
            .header_read_timeout(None)
            .max_headers(HYPER_MAX_HEADERS)
            .max_buf_size(HYPER_MAX_BUF)
            .keep_alive(true);
        auto.http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            .max_frame_size(H2_MAX_FRAME)
            .max_header_list_size(HYPER_MAX_BUF as u32)
            .max_pending_accept_reset_streams(Some(H2_MAX_PENDING_ACCEPT_RESETS))
            .max_local_error_reset_streams(Some(H2_MAX_LOCAL_ERROR_RESETS));
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
        .header_read_timeout(None)
        .max_headers(HYPER_MAX_HEADERS)
        .max_buf_size(HYPER_MAX_BUF)
        .keep_alive(true);
}

fn configure_h2(b: &mut hyper::server::conn::http2::Builder<TokioExecutor>) {
    b.timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .max_header_list_size(HYPER_MAX_BUF as u32)
        // Rapid reset (CVE-2023-44487): h2 closes connections that reset too many streams.
        .max_pending_accept_reset_streams(Some(H2_MAX_PENDING_ACCEPT_RESETS))
        .max_local_error_reset_streams(Some(H2_MAX_LOCAL_ERROR_RESETS));
}

/// Serves one HTTP connection until it ends, is cut for rapid-reset abuse, or is finished
/// gracefully once the drain closes.
#[macro_export]
#[doc(hidden)]
macro_rules! __serve_until_drained {
    ($conn:expr, $drain:expr, $requests:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let closing = $crate::drain::Drain::reached($drain.watch(), $crate::drain::Phase::Closing);
        tokio::select! {
            r = conn.as_mut() => r.map_err(|e| e.to_string()),
            _ = $requests.abused() => {
                Err("closed: the peer resets most of its streams early (rapid reset)".to_string())
            }
            _ = closing => {
                conn.as_mut().graceful_shutdown();
                conn.await.map_err(|e| e.to_string())
            }
        }
    }};
}

pub use crate::__serve_until_drained as serve_until_drained;

/// Rapid reset (CVE-2023-44487), Envoy's rule: once a connection has carried this many
/// requests, it is closed when more than half of them were reset before their response and
/// within `PREMATURE_RESET`.
pub const RAPID_RESET_MIN_STREAMS: u64 = 500;
pub const PREMATURE_RESET: Duration = Duration::from_secs(1);

/// Per-connection request accounting shared between a connection's IO and its service: the
/// service counts requests in and out, the IO knows from it whether the connection is between
/// requests (waiting for a head) or inside one, and resets are counted for abuse.
#[derive(Default)]
pub struct ConnRequests {
    started: std::sync::atomic::AtomicU64,
    finished: std::sync::atomic::AtomicU64,
    premature: std::sync::atomic::AtomicU64,
    abusive: tokio::sync::Notify,
}

impl ConnRequests {
    /// Called when a request's head is complete; the returned guard ends it when dropped (at
    /// the end of its response).
    pub fn start(self: &std::sync::Arc<Self>) -> RequestOpen {
        self.started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        RequestOpen {
            conn: self.clone(),
            since: std::time::Instant::now(),
            answered: false,
        }
    }

    /// Resolves when the peer is resetting streams abusively.
    pub async fn abused(&self) {
        self.abusive.notified().await
    }

    /// (between requests, number of requests finished)
    fn between(&self) -> (bool, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let finished = self.finished.load(Relaxed);
        (self.started.load(Relaxed) == finished, finished)
    }
}

/// One open request of a connection.
pub struct RequestOpen {
    conn: std::sync::Arc<ConnRequests>,
    since: std::time::Instant,
    answered: bool,
}

impl RequestOpen {
    /// Marks that a response was produced: from here on an early end is not a reset.
    pub fn answered(mut self) -> RequestOpen {
        self.answered = true;
        self
    }
}

impl Drop for RequestOpen {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.conn;
        let finished = c.finished.fetch_add(1, Relaxed) + 1;
        if !self.answered && self.since.elapsed() < PREMATURE_RESET {
            let premature = c.premature.fetch_add(1, Relaxed) + 1;
            if finished >= RAPID_RESET_MIN_STREAMS && premature * 2 > finished {
                c.abusive.notify_one();
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Deadline {
    None,
    /// Bytes of a new request head arrived (after `n` finished requests).
    Head(u64),
    /// Nothing in flight since `n` finished requests.
    Idle(u64),
}

/// The downstream timers hyper lacks. hyper's `header_read_timeout` also runs while a
/// keep-alive connection sits idle, which would close pooled peer connections after 10 s;
/// here a request head must be complete within `HEADER_READ_TIMEOUT` of its first byte, and a
/// connection with nothing in flight closes after `IDLE_TIMEOUT`. HTTP/2 connections
/// (recognised by their preface) get only the idle timer: pings are not request heads.
pub struct Timed<S> {
    inner: S,
    requests: std::sync::Arc<ConnRequests>,
    deadline: Deadline,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// None until the first bytes tell HTTP/1 from HTTP/2.
    h2: Option<bool>,
    head_timeout: Duration,
    idle_timeout: Duration,
}

impl<S> Timed<S> {
    pub fn new(inner: S, requests: std::sync::Arc<ConnRequests>) -> Timed<S> {
        Timed::with_timeouts(
            inner,
            requests,
            HEADER_READ_TIMEOUT,
            DOWNSTREAM_IDLE_TIMEOUT,
        )
    }

    pub fn with_timeouts(
        inner: S,
        requests: std::sync::Arc<ConnRequests>,
        head_timeout: Duration,
        idle_timeout: Duration,
    ) -> Timed<S> {
        Timed {
            inner,
            requests,
            deadline: Deadline::None,
            sleep: Box::pin(tokio::time::sleep(idle_timeout)),
            h2: None,
            head_timeout,
            idle_timeout,
        }
    }

    fn arm(&mut self, d: Deadline, after: Duration) {
        self.deadline = d;
        self.sleep
            .as_mut()
            .reset(tokio::time::Instant::now() + after);
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Timed<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        use std::task::Poll;
        let this = &mut *self;
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        let (between, n) = this.requests.between();
        if !between {
            // Inside a request: its own timeouts apply, not ours.
            this.deadline = Deadline::None;
            return r;
        }
        match &r {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                let got = &buf.filled()[before..];
                if this.h2.is_none() {
                    this.h2 = Some(got.starts_with(b"PRI "));
                }
                if this.h2 == Some(false) && this.deadline != Deadline::Head(n) {
                    let t = this.head_timeout;
                    this.arm(Deadline::Head(n), t);
                }
                r
            }
            Poll::Pending => {
                if !matches!(this.deadline, Deadline::Head(m) | Deadline::Idle(m) if m == n) {
                    let t = this.idle_timeout;
                    this.arm(Deadline::Idle(n), t);
                }
                if this.sleep.as_mut().poll(cx).is_ready() {
                    let what = match this.deadline {
                        Deadline::Head(_) => "request head not complete in time",
                        _ => "connection idle too long",
                    };
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        what,
                    )));
                }
                r
            }
            _ => r,
        }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Timed<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HEAD: Duration = Duration::from_millis(100);
    const IDLE: Duration = Duration::from_millis(400);

    fn timed() -> (
        Timed<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Arc<ConnRequests>,
    ) {
        let (server, client) = tokio::io::duplex(1024);
        let requests = Arc::new(ConnRequests::default());
        (
            Timed::with_timeouts(server, requests.clone(), HEAD, IDLE),
            client,
            requests,
        )
    }

    /// Reads until an error; returns how long that took.
    async fn time_to_error(io: &mut Timed<tokio::io::DuplexStream>) -> (Duration, std::io::Error) {
        let start = std::time::Instant::now();
        let mut buf = [0u8; 64];
        loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(_) => continue,
                Err(e) => return (start.elapsed(), e),
            }
        }
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_outlives_the_head_timeout() {
        let (mut io, _client, _) = timed();
        let (took, e) = time_to_error(&mut io).await;
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(
            took >= IDLE - Duration::from_millis(20),
            "closed after {took:?}"
        );
    }

    #[tokio::test]
    async fn a_started_head_must_complete_in_time() {
        let (mut io, mut client, _) = timed();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n")
            .await
            .unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(
            took < IDLE && took >= HEAD - Duration::from_millis(20),
            "took {took:?}"
        );
    }

    #[tokio::test]
    async fn nothing_times_out_inside_a_request_and_the_clock_restarts_after_it() {
        let (mut io, mut client, requests) = timed();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let _ = io.read(&mut buf).await.unwrap();
        // The head is complete: the service has the request for longer than both timeouts.
        let open = requests.start();
        let waited = tokio::time::timeout(IDLE + HEAD, io.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "a request in progress must not be timed out"
        );
        drop(open.answered());
        // Between requests again: the idle clock starts afresh.
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(took >= IDLE - Duration::from_millis(20), "took {took:?}");
    }

    #[tokio::test]
    async fn http2_gets_only_the_idle_timer() {
        let (mut io, mut client, _) = timed();
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(took >= IDLE - Duration::from_millis(20), "took {took:?}");
    }

    #[test]
    fn most_streams_reset_early_is_abuse_and_answered_ones_are_not() {
        let requests = Arc::new(ConnRequests::default());
        for _ in 0..RAPID_RESET_MIN_STREAMS {
            drop(requests.start().answered());
        }
        // Answered requests never count, however many.
        let notified = requests.abusive.notified();
        tokio::pin!(notified);
        assert!(futures_util::FutureExt::now_or_never(notified.as_mut()).is_none());
        // A burst of early resets past half of all streams is.
        for _ in 0..RAPID_RESET_MIN_STREAMS + 1 {
            drop(requests.start());
        }
        assert!(futures_util::FutureExt::now_or_never(notified).is_some());
    }
}
