//! The downstream timers (SPEC section 8): which one applies to a connection at each moment,
//! and one sleep armed for it. hyper's own `header_read_timeout` would also run between
//! keep-alive requests, closing pooled peer connections after 10 s, so the timers live here.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

use super::sniff::Seen;
use crate::http::limits::Timers;

/// Which timer is armed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timer {
    Head,
    HeaderBlock,
    ConnectionIdle,
    StreamIdle,
}

impl Timer {
    /// (error message, `aether_http_protocol_errors_total` reason)
    fn describe(self) -> (&'static str, &'static str) {
        match self {
            Timer::Head => ("request head not complete in time", "head_timeout"),
            Timer::HeaderBlock => (
                "HTTP/2 header block not complete in time",
                "header_block_timeout",
            ),
            Timer::ConnectionIdle => ("connection idle too long", "connection_idle"),
            Timer::StreamIdle => ("request moved no bytes for too long", "stream_idle"),
        }
    }
}

/// A connection's timers:
/// * a request head (or the HTTP/2 preface) must be complete within `head_read` of its first
///   byte;
/// * an HTTP/2 header block must be complete within `header_block` of its HEADERS frame;
/// * a connection with nothing in flight closes after `connection_idle`;
/// * an HTTP/1 request that moves no bytes either way for `stream_idle` ends its connection
///   (HTTP/2 streams have the same timer on their bodies, `body::Metered`).
pub(super) struct Clock {
    timers: Timers,
    /// (finished requests, when) the next request's head began.
    pub(super) head_since: Option<(u64, Instant)>,
    /// (finished requests, when) the connection fell idle.
    idle_since: Option<(u64, Instant)>,
    /// The last byte read or written.
    pub(super) last_io: Instant,
    armed: Option<(Timer, Instant)>,
    sleep: Pin<Box<Sleep>>,
}

impl Clock {
    pub(super) fn new(timers: Timers) -> Clock {
        Clock {
            timers,
            head_since: None,
            idle_since: None,
            last_io: Instant::now(),
            armed: None,
            sleep: Box::pin(tokio::time::sleep(timers.connection_idle)),
        }
    }

    /// Whether the head of the request after `n` finished ones has begun.
    pub(super) fn head_began(&self, n: u64) -> bool {
        matches!(self.head_since, Some((m, _)) if m == n)
    }

    /// The timer that applies now, if any: `between` requests (`n` finished so far) or inside
    /// one; none once the connection is `tunnelled`.
    fn wanted(
        &mut self,
        tunnelled: bool,
        seen: &Seen,
        between: bool,
        n: u64,
    ) -> Option<(Timer, Instant)> {
        if tunnelled {
            return None;
        }
        let t = self.timers;
        if let Some(since) = seen.header_block_since() {
            return Some((Timer::HeaderBlock, since + t.header_block));
        }
        if between {
            if let Some((m, since)) = self.head_since {
                if m == n && !seen.is_h2() {
                    return Some((Timer::Head, since + t.head_read));
                }
            }
            let since = match self.idle_since {
                Some((m, since)) if m == n => since,
                _ => {
                    let now = Instant::now();
                    self.idle_since = Some((n, now));
                    now
                }
            };
            return Some((Timer::ConnectionIdle, since + t.connection_idle));
        }
        if seen.is_h2() {
            // Streams carry their own timers.
            return None;
        }
        Some((Timer::StreamIdle, self.last_io + t.stream_idle))
    }

    /// Polls the timer that applies (see `wanted`); an error once it ran out, counted for
    /// `listener`.
    pub(super) fn expired(
        &mut self,
        cx: &mut Context<'_>,
        listener: &'static str,
        tunnelled: bool,
        seen: &Seen,
        between: bool,
        n: u64,
    ) -> Option<std::io::Error> {
        let want = self.wanted(tunnelled, seen, between, n)?;
        loop {
            match self.armed {
                // The same timer, pushed later by activity: let the armed one fire first and
                // look again then, instead of re-arming on every read.
                Some((kind, at)) if kind == want.0 && at <= want.1 => {}
                _ => {
                    self.armed = Some(want);
                    self.sleep.as_mut().reset(want.1);
                }
            }
            if self.sleep.as_mut().poll(cx).is_pending() {
                return None;
            }
            if Instant::now() >= want.1 {
                break;
            }
            self.armed = None;
        }
        let (what, reason) = want.0.describe();
        crate::http::metrics::cut_off(listener, reason);
        Some(std::io::Error::new(std::io::ErrorKind::TimedOut, what))
    }

    /// Takes the sleep over until `at` for something other than the timers (a refusal's
    /// linger); the timers re-arm it if they run again.
    pub(super) fn sleep_until(&mut self, at: Instant) {
        self.sleep.as_mut().reset(at);
        self.armed = None;
    }

    /// Polls the sleep set by [`Clock::sleep_until`].
    pub(super) fn poll_sleep(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.sleep.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::http::server::guarded::tests::{
        guarded, guarded_with, time_to_error, HEAD, IDLE, STREAM,
    };
    use crate::http::server::sniff::tests::starts_with_g;
    use crate::http::server::sniff::Wire;

    #[tokio::test]
    async fn an_idle_keep_alive_connection_outlives_the_head_timeout() {
        let (mut io, _client, _) = guarded();
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
        let (mut io, mut client, _) = guarded();
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
        let (mut io, mut client, requests) = guarded();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let _ = io.read(&mut buf).await.unwrap();
        // The head is complete: the service has the request for longer than both timeouts.
        let open = requests.start();
        let waited = tokio::time::timeout(STREAM / 2, io.read(&mut buf)).await;
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
    async fn a_connection_that_must_speak_first_gets_the_head_timer_from_the_start() {
        let (io, _client, _) = guarded();
        let mut io = io.first_bytes(starts_with_g);
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(
            took < IDLE && took >= HEAD - Duration::from_millis(20),
            "took {took:?}"
        );
    }

    #[tokio::test]
    async fn http2_gets_only_the_idle_timer() {
        let (mut io, mut client, _) = guarded();
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(took >= IDLE - Duration::from_millis(20), "took {took:?}");
    }

    #[tokio::test]
    async fn a_partial_preface_is_a_head_and_gets_the_head_timer() {
        // Four bytes that look like HTTP/2 are not the preface: a slow client cannot dodge the
        // head timer with them.
        let (mut io, mut client, _) = guarded();
        client.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(took < IDLE, "took {took:?}");
    }

    #[tokio::test]
    async fn alpn_http1_is_timed_as_http1_whatever_the_bytes() {
        let (mut io, mut client, _) = guarded_with(Wire::H1, 1024);
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(took < IDLE, "took {took:?}");
    }

    #[tokio::test]
    async fn an_http1_request_that_moves_no_bytes_times_out() {
        let (mut io, mut client, requests) = guarded_with(Wire::H1, 1024);
        client.write_all(b"POST / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let _ = io.read(&mut buf).await.unwrap();
        let _open = requests.start();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("no bytes"), "{e}");
        assert!(took >= STREAM - Duration::from_millis(20), "took {took:?}");
    }
}
