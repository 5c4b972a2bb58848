//! What every TCP socket of the data path shares, HTTP or not: keepalive, so a peer that
//! vanished without a FIN is found (SPEC section 8), and splicing two streams for tcp chains,
//! CONNECT tunnels and upgraded connections, which end once no byte moves either way for
//! `Timers::tunnel_idle`.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::http::body::Activity;
use crate::http::limits::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES};

/// Turns TCP keepalive on (see `limits::KEEPALIVE_IDLE`); also sets `TCP_NODELAY`, which every
/// data socket wants.
pub fn tune(tcp: &TcpStream) {
    let _ = tcp.set_nodelay(true);
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive not set: {e}");
    }
}

/// Copies bytes both ways until both sides are done (half-close respected: each write side is
/// shut down when the other side's read ends), an error, or `idle` without a byte either way.
/// An idle end is counted for `listener`. Returns the bytes copied (a to b, b to a).
pub async fn splice<A, B>(
    a: &mut A,
    b: &mut B,
    idle: Duration,
    listener: &'static str,
) -> std::io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let activity = Activity::new();
    let mut a = Touch {
        inner: a,
        activity: activity.clone(),
    };
    let mut b = Touch {
        inner: b,
        activity: activity.clone(),
    };
    let copy = tokio::io::copy_bidirectional(&mut a, &mut b);
    tokio::pin!(copy);
    loop {
        let deadline = activity.last() + idle;
        tokio::select! {
            r = &mut copy => return r,
            _ = tokio::time::sleep_until(deadline) => {
                if activity.last() + idle <= Instant::now() {
                    crate::metrics::get().cut_off(listener, "tunnel_idle");
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no bytes either way for too long",
                    ));
                }
            }
        }
    }
}

/// A stream that notes on `activity` when bytes move through it.
struct Touch<'a, S: ?Sized> {
    inner: &'a mut S,
    activity: Activity,
}

impl<S: AsyncRead + Unpin + ?Sized> AsyncRead for Touch<'_, S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut *self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin + ?Sized> AsyncWrite for Touch<'_, S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut *self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(k)) if k > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_splice_ends_after_idle_and_bytes_either_way_keep_it_open() {
        let idle = Duration::from_millis(300);
        let (mut a, mut a_peer) = tokio::io::duplex(1024);
        let (mut b, mut b_peer) = tokio::io::duplex(1024);
        let start = std::time::Instant::now();
        let task = tokio::spawn(async move { splice(&mut a, &mut b, idle, "inbound").await });
        // Bytes one way, then the other, each within the idle time: still open at 3x idle.
        let mut buf = [0u8; 8];
        for i in 0..6 {
            tokio::time::sleep(idle / 2).await;
            if i % 2 == 0 {
                a_peer.write_all(b"x").await.unwrap();
                b_peer.read_exact(&mut buf[..1]).await.unwrap();
            } else {
                b_peer.write_all(b"y").await.unwrap();
                a_peer.read_exact(&mut buf[..1]).await.unwrap();
            }
        }
        assert!(!task.is_finished(), "closed while bytes moved");
        let r = task.await.unwrap();
        let took = start.elapsed();
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        assert!(took >= idle * 3 + idle, "took {took:?}");
    }

    #[tokio::test]
    async fn keepalive_is_on_for_tuned_sockets() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        tune(&c);
        let s = socket2::SockRef::from(&c);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(s.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(s.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
    }
}
