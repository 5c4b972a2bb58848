//! Serving one downstream connection: until it ends, is cut for rapid-reset abuse, or is
//! finished once the drain closes (`serve_until_drained!`); its codec sniffed first when ALPN
//! did not name one (`sniff_codec`); HTTP/2 polled a scheduler turn late so streams share
//! writes (`Batched`); and the connections the HTTP/2 codec ended itself counted
//! (`count_codec_error`). The paths `serve_until_drained!` expands to are this module's.

use super::guarded::Guarded;
use super::requests::ConnRequests;
pub use super::requests::GoneOnDrop;
use super::sniff::Codec;

tokio::task_local! {
    /// The downstream connection whose future is being polled, while `serve_until_drained`
    /// polls it: the streams hyper spawns then belong to it.
    pub static CONNECTION: std::sync::Arc<ConnRequests>;
}

/// Serves one HTTP connection until it ends, is cut for rapid-reset abuse, or is finished
/// gracefully once the drain closes. Cut-offs are counted for `$listener`.
macro_rules! serve_until_drained {
    ($conn:expr, $drain:expr, $requests:expr, $listener:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let closing = $crate::drain::Drain::reached($drain.watch(), $crate::drain::Phase::Closing);
        let _gone = $crate::http::server::serve::GoneOnDrop($requests.clone());
        let serving = async { tokio::select! {
            r = $crate::http::server::serve::Batched::new(conn.as_mut(), Some(&*$requests)) => r.map_err(|e| {
                let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                $crate::http::server::serve::count_codec_error($listener, &*e);
                e.to_string()
            }),
            _ = $requests.abused() => {
                $crate::http::metrics::cut_off($listener, "rapid_reset");
                Err("closed: the peer resets most of its streams early (rapid reset)".to_string())
            }
            _ = closing => {
                conn.as_mut().graceful_shutdown();
                $crate::http::server::serve::Batched::new(conn.as_mut(), Some(&*$requests))
                    .await
                    .map_err(|e| e.to_string())
            }
        }};
        let r: Result<(), String> =
            $crate::http::server::serve::CONNECTION.scope($requests.clone(), serving).await;
        r
    }};
}
pub(crate) use serve_until_drained;

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

    use crate::http::server::guarded::tests::{guarded, IDLE};

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
