//! A downstream HTTP/1 connection's last response leaves in one segment with the FIN.
//!
//! A client that sends `Connection: close` (wrk's and curl's one-shot runs, health checkers,
//! HTTP/1.0 clients) gets its response and then the proxy's FIN: two segments, each a trip
//! through the stack charged to the proxy (and, for a captured connection, through NAT on its
//! way back). Written with `MSG_MORE`, the response waits in the socket for the `shutdown`
//! hyper issues right after it, in the same poll, and the kernel sends both in one segment.
//!
//! Nothing waits past the poll that wrote it: when the connection's future returns without
//! having shut down (a body still streaming, an interim `100 Continue`), `Batched` pushes what
//! a write held back (`Fin::push_held`).

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// A connection's state for its last response, shared by its service (which knows a request
/// asked to close), its socket (which writes) and its poller (which pushes).
#[derive(Default)]
pub struct Fin {
    /// The response being written is the connection's last.
    last: AtomicBool,
    /// A write this poll held back and no FIN has sent yet: the socket's fd + 1 (0 for none).
    held: AtomicI32,
}

impl Fin {
    /// Marks the response about to be written as the connection's last: an HTTP/1 request
    /// that asked to close (never CONNECT or an upgrade, whose socket lives on as a tunnel).
    pub fn last_response(&self) {
        self.last.store(true, Relaxed);
    }

    /// Sends what a write of the poll that just ended held back, when no FIN took it along.
    pub fn push_held(&self) {
        if self.held.load(Relaxed) == 0 {
            return;
        }
        let fd = self.held.swap(0, Relaxed) - 1;
        if fd < 0 {
            return;
        }
        // SAFETY: the fd is the socket of the connection whose future was just polled and is
        // still pending, so the socket is open and stays open for this call.
        let socket = unsafe { BorrowedFd::borrow_raw(fd) };
        // Setting TCP_NODELAY (already on) makes the kernel push the pending segment now.
        if let Err(e) = socket2::SockRef::from(&socket).set_tcp_nodelay(true) {
            tracing::debug!("could not push a held response tail: {e}");
        }
    }
}

/// A downstream TCP socket that holds its last response for the FIN (see the module).
pub struct FinTcp {
    tcp: TcpStream,
    fin: Arc<Fin>,
}

impl FinTcp {
    /// `fin` is the connection's (`ConnRequests::fin`).
    pub fn new(tcp: TcpStream, fin: Arc<Fin>) -> FinTcp {
        FinTcp { tcp, fin }
    }

    fn poll_send_more(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            let tcp = &self.tcp;
            let sent = tcp.try_io(Interest::WRITABLE, || {
                socket2::SockRef::from(tcp)
                    .send_vectored_with_flags(bufs, libc::MSG_MORE | libc::MSG_NOSIGNAL)
            });
            match sent {
                Ok(n) => {
                    self.fin.held.store(tcp.as_raw_fd() + 1, Relaxed);
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncRead for FinTcp {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for FinTcp {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.fin.last.load(Relaxed) {
            return self.poll_send_more(cx, &[IoSlice::new(buf)]);
        }
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.fin.last.load(Relaxed) {
            return self.poll_send_more(cx, bufs);
        }
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    /// The FIN takes along whatever a write held back.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.tcp).poll_shutdown(cx);
        self.fin.held.store(0, Relaxed);
        r
    }
}
