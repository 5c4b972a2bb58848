//! Per-connection request accounting, shared by a downstream connection's IO and its service:
//! which requests are open (the timers need to know), whether the connection tunnels or
//! multiplexes, and the rapid-reset rule that closes a connection resetting most of its streams.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::http::fin::Fin;

/// Rapid reset (CVE-2023-44487), Envoy's rule: once a connection has carried this many
/// requests, it is closed when more than half of them were reset before their response and
/// within `PREMATURE_RESET`.
const RAPID_RESET_MIN_STREAMS: u64 = 500;
const PREMATURE_RESET: Duration = Duration::from_secs(1);

/// Per-connection request accounting shared between a connection's IO and its service: the
/// service counts requests in and out, the IO knows from it whether the connection is between
/// requests (waiting for a head) or inside one, and resets are counted for abuse.
#[derive(Default)]
pub struct ConnRequests {
    started: AtomicU64,
    finished: AtomicU64,
    premature: AtomicU64,
    abusive: tokio::sync::Notify,
    /// The connection became a tunnel (CONNECT, an upgrade): the splice's idle timer governs
    /// it from then on, not the HTTP timers.
    tunnelled: AtomicBool,
    /// The HTTP/2 preface arrived: the connection multiplexes streams.
    multiplexed: AtomicBool,
    /// The last response and the FIN in one segment (`FinTcp`).
    fin: Arc<Fin>,
    /// The connection ended or was dropped: its HTTP/2 streams' tasks stop (`StreamExecutor`).
    gone: AtomicBool,
    gone_notify: tokio::sync::Notify,
}

/// Marks its connection gone when dropped: when the connection's future ends, or is dropped
/// unfinished (overload closing it).
pub struct GoneOnDrop(pub Arc<ConnRequests>);

impl Drop for GoneOnDrop {
    fn drop(&mut self) {
        self.0.gone.store(true, Ordering::Release);
        self.0.gone_notify.notify_waiters();
    }
}

impl ConnRequests {
    /// Called when a request's head is complete; the returned guard ends it when dropped (at
    /// the end of its response).
    pub fn start(self: &Arc<Self>) -> RequestOpen {
        self.started.fetch_add(1, Ordering::Relaxed);
        RequestOpen {
            conn: self.clone(),
            since: Instant::now(),
            answered: false,
        }
    }

    /// The state a [`crate::http::fin::FinTcp`] for this connection shares.
    pub fn fin(&self) -> Arc<Fin> {
        self.fin.clone()
    }

    /// Resolves once the connection is gone ([`GoneOnDrop`]).
    pub async fn gone(&self) {
        loop {
            let notified = self.gone_notify.notified();
            tokio::pin!(notified);
            // Registered before the flag is read, so a notification in between is not lost.
            notified.as_mut().enable();
            if self.gone.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Resolves when the peer is resetting streams abusively.
    pub async fn abused(&self) {
        self.abusive.notified().await
    }

    pub(super) fn tunnelled(&self) -> bool {
        self.tunnelled.load(Ordering::Relaxed)
    }

    /// Whether the HTTP/2 preface arrived.
    pub(super) fn multiplexed(&self) -> bool {
        self.multiplexed.load(Ordering::Relaxed)
    }

    /// The HTTP/2 preface arrived (the connection's IO saw it).
    pub(super) fn set_multiplexed(&self) {
        self.multiplexed.store(true, Ordering::Relaxed);
    }

    /// Sends what an HTTP/1 write held back for a FIN that did not follow (`Fin::push_held`).
    pub(super) fn push_held_fin(&self) {
        self.fin.push_held();
    }

    /// (between requests, number of requests finished)
    pub(super) fn between(&self) -> (bool, u64) {
        let finished = self.finished.load(Ordering::Relaxed);
        (self.started.load(Ordering::Relaxed) == finished, finished)
    }
}

/// One open request of a connection.
pub struct RequestOpen {
    conn: Arc<ConnRequests>,
    since: Instant,
    answered: bool,
}

impl RequestOpen {
    /// Marks that a response was produced: from here on an early end is not a reset.
    pub fn answered(mut self) -> RequestOpen {
        self.answered = true;
        self
    }

    /// Marks this request's response as its HTTP/1 connection's last (the request asked to
    /// close; not CONNECT or an upgrade): a `FinTcp` sends it along with its FIN.
    pub fn last_on_connection(&self) {
        self.conn.fin.last_response();
    }

    /// Marks that the connection carries a tunnel from now on: its HTTP timers stop (the
    /// tunnel has its own idle timer, `sockets::splice`). Hold the result as long as the tunnel.
    pub fn tunnel(self) -> RequestOpen {
        self.conn.tunnelled.store(true, Ordering::Relaxed);
        self.answered()
    }
}

impl Drop for RequestOpen {
    fn drop(&mut self) {
        let c = &self.conn;
        let finished = c.finished.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.answered && self.since.elapsed() < PREMATURE_RESET {
            let premature = c.premature.fetch_add(1, Ordering::Relaxed) + 1;
            if finished >= RAPID_RESET_MIN_STREAMS && premature * 2 > finished {
                c.abusive.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
