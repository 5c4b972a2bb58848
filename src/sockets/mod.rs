//! What every TCP socket of the data path shares, HTTP or not: keepalive, so a peer that
//! vanished without a FIN is found (SPEC section 8); under TLS, a socket read ahead
//! ([`read_ahead`]) and a stream that asks the socket before BoringSSL ([`Tls`]); and splicing
//! two streams for tcp chains, CONNECT tunnels and upgraded connections, which end once no byte
//! moves either way for `Timers::tunnel_idle`.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::drain::{Drain, Phase};
use crate::http::body::Activity;
use crate::http::limits::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES};

mod pump;
pub mod read_ahead;
mod record;
/// The splice's bulk buffer size, for the floor bench of raw TCP (`benches/tcp_floor.rs`).
#[cfg(feature = "testing")]
pub use pump::BULK;
pub use read_ahead::{ReadAhead, ReadReady};
pub use record::RECORD;

/// Turns TCP keepalive on (see `limits::KEEPALIVE_IDLE`); also sets `TCP_NODELAY`, which every
/// data socket wants. For connections this proxy dials; accepted ones inherit both from their
/// listener ([`tune_listener`]).
pub fn tune(tcp: &TcpStream) {
    let _ = tcp.set_nodelay(true);
    set_keepalive(socket2::SockRef::from(tcp));
}

/// The same options on a listening socket, before `listen`: Linux copies a listener's socket
/// options (keepalive and its timers, `TCP_NODELAY`) into each connection it accepts, so an
/// accepted connection needs no `setsockopt` of its own (five per connection otherwise, a cost
/// a short connection notices).
pub fn tune_listener(sock: &tokio::net::TcpSocket) {
    let _ = sock.set_nodelay(true);
    set_keepalive(socket2::SockRef::from(sock));
}

fn set_keepalive(sock: socket2::SockRef<'_>) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    if let Err(e) = sock.set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive not set: {e}");
    }
}

/// A TLS stream that asks the socket before asking BoringSSL. hyper polls a connection's read
/// side several times per exchange, mostly when nothing has arrived; each of those polls would
/// run `SSL_read` down to a `WouldBlock` and build an error for it, a real part of a proxied
/// request's cost. With nothing buffered in the TLS layer
/// and a socket not ready, the answer is `Pending` at once; the readiness poll registers the
/// waker as the read would have.
///
/// A read also takes every further record already received (in BoringSSL or the read-ahead
/// below it) while a whole record still fits: `SSL_read` opens one record per call, so a bulk
/// stream would otherwise be written on in 16 KiB pieces, one segment each. An error met after
/// bytes were taken is kept for the next read.
pub struct Tls<S> {
    inner: tokio_boring::SslStream<S>,
    late_error: Option<std::io::Error>,
}

impl<S> Tls<S> {
    pub fn new(inner: tokio_boring::SslStream<S>) -> Tls<S> {
        Tls {
            inner,
            late_error: None,
        }
    }
}

impl<S: ReadReady> Tls<S> {
    /// Whether bytes already received wait to be opened (no socket read needed to start).
    fn has_received(&self) -> bool {
        use foreign_types::ForeignTypeRef;
        // SAFETY: a plain query on a live SSL object owned by the stream.
        let in_tls = unsafe { boring_sys::SSL_has_pending(self.inner.ssl().as_ptr()) } != 0;
        in_tls || self.inner.get_ref().has_buffered()
    }
}

impl<S: AsyncWrite + Unpin> Tls<ReadAhead<S>> {
    /// Sealed records are sent in batches from now on ([`ReadAhead::batch_writes`]): for
    /// splices, which flush whenever they wait.
    pub fn batch_writes(&mut self) {
        self.inner.get_mut().batch_writes();
    }
}

/// A stream a splice copies through, as to the buffers it may grow for a bulk burst: it gives
/// them back when the splice has been quiet for [`QUIET`]; streams that grow none hold nothing
/// to give.
pub trait BulkBuffers {
    /// Frees what was grown for bulk and is empty now; returns whether there was any.
    fn give_back(&mut self) -> bool {
        false
    }
}

impl<S: AsyncWrite + Unpin> BulkBuffers for Tls<ReadAhead<S>> {
    fn give_back(&mut self) -> bool {
        self.inner.get_mut().give_back_batch()
    }
}

impl BulkBuffers for TcpStream {}

/// hyper's upgraded connection: whatever it holds is hyper's.
impl<T> BulkBuffers for hyper_util::rt::TokioIo<T> {}

impl<S: BulkBuffers + ?Sized> BulkBuffers for Touch<'_, S> {
    fn give_back(&mut self) -> bool {
        self.inner.give_back()
    }
}

#[cfg(test)]
impl BulkBuffers for tokio::io::DuplexStream {}

impl<S> std::ops::Deref for Tls<S> {
    type Target = tokio_boring::SslStream<S>;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl<S> std::ops::DerefMut for Tls<S> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

impl<S: AsyncRead + AsyncWrite + ReadReady + Unpin> AsyncRead for Tls<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(e) = self.late_error.take() {
            return Poll::Ready(Err(e));
        }
        if !self.has_received() && self.inner.get_mut().poll_read_ready(cx).is_pending() {
            return Poll::Pending;
        }
        let start = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        if buf.filled().len() == start {
            return Poll::Ready(Ok(())); // end of stream
        }
        while buf.remaining() >= RECORD && self.has_received() {
            let at = buf.filled().len();
            match Pin::new(&mut self.inner).poll_read(cx, buf) {
                Poll::Ready(Ok(())) if buf.filled().len() > at => {}
                Poll::Ready(Err(e)) => {
                    self.late_error = Some(e);
                    break;
                }
                // The end of stream (seen again by the next read) or a record still partly
                // on the wire (the waker is registered).
                _ => break,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Tls<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    /// Small pieces (hyper's head, then a body chunk) are gathered into one TLS record of up to
    /// [`RECORD`] bytes; a piece at least that large goes out alone. Claiming vectored writes
    /// keeps hyper from flattening every response into a per-connection buffer of its own,
    /// which grew with the largest body a connection carried and stayed that size.
    /// A write BoringSSL could not finish is retried by hyper with the same pieces, so the
    /// gathered bytes start the same way, as `SSL_write`'s retry rule requires.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let mut pieces = bufs.iter().filter(|b| !b.is_empty()).peekable();
        let Some(first) = pieces.next() else {
            return Poll::Ready(Ok(0));
        };
        if first.len() >= RECORD || pieces.peek().is_none() {
            return Pin::new(&mut self.inner).poll_write(cx, first);
        }
        GATHER.with(|g| {
            let mut g = g.borrow_mut();
            g.clear();
            for b in std::iter::once(first).chain(pieces) {
                let room = RECORD - g.len();
                g.extend_from_slice(&b[..b.len().min(room)]);
                if g.len() == RECORD {
                    break;
                }
            }
            Pin::new(&mut self.inner).poll_write(cx, &g)
        })
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

thread_local! {
    /// Where [`Tls::poll_write_vectored`] gathers small pieces: one per thread, not one per
    /// connection.
    static GATHER: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(RECORD));
}

/// Why a spliced connection ended (SPEC section 12's `end_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// Both sides finished (FIN both ways).
    Eof,
    /// A side reset or vanished.
    Reset,
    /// No byte either way for `tunnel_idle`.
    IdleTimeout,
    /// The drain ran out of time with the connection still open.
    Drain,
    Error,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Eof => "eof",
            EndReason::Reset => "reset",
            EndReason::IdleTimeout => "idle-timeout",
            EndReason::Drain => "drain",
            EndReason::Error => "error",
        }
    }

    fn of(e: &std::io::Error) -> EndReason {
        use std::io::ErrorKind::*;
        match e.kind() {
            ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => EndReason::Reset,
            _ => EndReason::Error,
        }
    }
}

/// How a splice went: payload bytes read from each side (`a` is the side that asked for the
/// connection, so its bytes are the ones received) and why it ended.
#[derive(Debug, Clone, Copy)]
pub struct Spliced {
    pub received: u64,
    pub sent: u64,
    pub end: EndReason,
}

impl Spliced {
    /// A connection closed before any byte was spliced (not allowed, nothing to connect to).
    pub fn refused() -> Spliced {
        Spliced {
            received: 0,
            sent: 0,
            end: EndReason::Error,
        }
    }
}

/// How long a splice stays without a byte either way before it frees its copy buffers (the
/// next byte takes a small one again) and gives back what a bulk burst grew in its streams
/// ([`BulkBuffers`]). A quiet tunnel then holds no copy buffer and nothing of what a bulk burst
/// grew (both directions' buffers and, on a sealing side, the write batch), which a pool of
/// tunnels would otherwise hold for good after one large answer each. Bulk that pauses for
/// less keeps its buffers, so a stream does not reallocate (and zero) 256 KiB for every burst;
/// freeing at most once a second is too rare to cost anything.
pub const QUIET: Duration = Duration::from_secs(1);

/// Copies bytes both ways until both sides are done (half-close respected: each write side is
/// shut down when the other side's read ends), an error, `idle` without a byte either way
/// (counted for `listener`), or the end of the drain (`Phase::Cut`). Buffers are given back
/// after [`QUIET`].
pub async fn splice<A, B>(
    a: &mut A,
    b: &mut B,
    idle: Duration,
    listener: &'static str,
    drain: &Drain,
) -> Spliced
where
    A: AsyncRead + AsyncWrite + BulkBuffers + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + BulkBuffers + Unpin + ?Sized,
{
    let activity = Activity::new();
    let mut a = Touch {
        inner: a,
        activity: activity.clone(),
        read: 0,
    };
    let mut b = Touch {
        inner: b,
        activity: activity.clone(),
        read: 0,
    };
    let mut pumps = pump::Pumps::new();
    let cut = Drain::reached(drain.watch(), Phase::Cut);
    tokio::pin!(cut);
    // One timer for both the idle end and the quiet give-back. It may fire early (bytes moved
    // since it was set): then it is set again from the latest activity, so bytes moving never
    // touch it.
    let timer = tokio::time::sleep_until(activity.last() + idle);
    tokio::pin!(timer);
    // The activity at the last give-back: nothing to give again until bytes move.
    let mut given_back_at = None;
    let end = std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = pumps.poll(cx, &mut a, &mut b) {
            return Poll::Ready(match r {
                Ok(()) => EndReason::Eof,
                Err(e) => EndReason::of(&e),
            });
        }
        if cut.as_mut().poll(cx).is_ready() {
            return Poll::Ready(EndReason::Drain);
        }
        loop {
            let last = activity.last();
            let quiet = (pumps.holding() && given_back_at != Some(last)).then(|| last + QUIET);
            let wake = quiet.map_or(last + idle, |q| q.min(last + idle));
            if wake < timer.deadline() {
                timer.as_mut().reset(wake);
            }
            ready!(timer.as_mut().poll(cx));
            let now = Instant::now();
            if last + idle <= now {
                crate::http::metrics::cut_off(listener, "tunnel_idle");
                return Poll::Ready(EndReason::IdleTimeout);
            }
            if quiet.is_some_and(|q| q <= now) {
                // Not `||`: every one gives back.
                let bulk = [pumps.give_back(), a.give_back(), b.give_back()];
                if bulk.contains(&true) {
                    // Blocks of 256 KiB stay in glibc's heap, resident, until a trim.
                    crate::memory::trim_soon();
                }
                given_back_at = Some(last);
            }
            // Set again from the latest activity.
            timer.as_mut().reset(activity.last() + idle);
        }
    })
    .await;
    Spliced {
        received: a.read,
        sent: b.read,
        end,
    }
}

/// A stream that notes on `activity` when bytes move through it.
struct Touch<'a, S: ?Sized> {
    inner: &'a mut S,
    activity: Activity,
    /// Bytes read from this side.
    read: u64,
}

impl<S: AsyncRead + Unpin + ?Sized> AsyncRead for Touch<'_, S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut *self.inner).poll_read(cx, buf);
        let got = buf.filled().len() - before;
        if got > 0 {
            self.read += got as u64;
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

    /// A real TLS pair over loopback: our `Tls` on the writing side, a plain BoringSSL stream on
    /// the reading side.
    async fn tls_pair() -> (
        Tls<ReadAhead<TcpStream>>,
        tokio_boring::SslStream<TcpStream>,
    ) {
        use boring::ssl::{SslConnector, SslMethod, SslVerifyMode};
        let acceptor = read_ahead::tests::self_signed_acceptor();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut b = SslConnector::builder(SslMethod::tls()).unwrap();
            b.set_verify(SslVerifyMode::NONE);
            let cfg = b.build().configure().unwrap().verify_hostname(false);
            let tcp = TcpStream::connect(addr).await.unwrap();
            tokio_boring::connect(cfg, "9090", tcp).await.unwrap()
        });
        let (tcp, _) = listener.accept().await.unwrap();
        let server = tokio_boring::accept(&acceptor, ReadAhead::new(tcp))
            .await
            .unwrap();
        (Tls::new(server), client.await.unwrap())
    }

    /// Waits until `n` bytes have been read ahead under `tls` (they have all arrived).
    async fn until_received(tls: &Tls<ReadAhead<TcpStream>>, n: usize) {
        for _ in 0..500 {
            let mut probe = vec![0u8; n];
            if tls.get_ref().get_ref().peek(&mut probe).await.unwrap() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("{n} bytes never arrived");
    }

    #[tokio::test]
    async fn a_read_takes_every_record_already_received() {
        let (mut tls, mut peer) = tls_pair().await;
        let blob: Vec<u8> = (0..3 * RECORD as u32).map(|i| (i % 253) as u8).collect();
        peer.write_all(&blob).await.unwrap();
        peer.flush().await.unwrap();
        // Three records and their framing, all on our socket before the first read.
        until_received(&tls, blob.len() + 3 * 22).await;
        let mut buf = vec![0u8; 4 * RECORD];
        let n = tls.read(&mut buf).await.unwrap();
        assert_eq!(
            n,
            blob.len(),
            "one read, every record (SSL_read alone opens one)"
        );
        assert!(buf[..n] == blob[..]);

        // Room for less than a record: the read stops at what fits whole.
        peer.write_all(&blob[..2 * RECORD]).await.unwrap();
        peer.flush().await.unwrap();
        let mut small = vec![0u8; RECORD + 100];
        let n = tls.read(&mut small).await.unwrap();
        assert_eq!(n, RECORD);
    }

    #[tokio::test]
    async fn an_error_after_received_records_comes_after_their_bytes() {
        let (mut tls, mut peer) = tls_pair().await;
        peer.write_all(b"good record").await.unwrap();
        peer.flush().await.unwrap();
        // Then a record that cannot be opened (application data, its tag wrong).
        let mut bad = vec![23u8, 3, 3, 0, 40];
        bad.extend_from_slice(&[0x5a; 40]);
        peer.get_mut().write_all(&bad).await.unwrap();
        until_received(&tls, 11 + 22 + bad.len()).await;
        let mut buf = vec![0u8; 4 * RECORD];
        let n = tls.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"good record");
        let e = tls.read(&mut buf).await;
        assert!(e.is_err(), "the bad record is reported next: {e:?}");
    }

    #[tokio::test]
    async fn splice_writes_go_out_in_batches_at_flush() {
        let (mut tls, mut peer) = tls_pair().await;
        tls.batch_writes();
        assert!(
            !tls.get_ref().is_write_vectored(),
            "batched: one slice at a time"
        );
        let blob: Vec<u8> = (0..3 * RECORD as u32).map(|i| (i % 241) as u8).collect();
        tls.write_all(&blob).await.unwrap();
        // Three sealed records wait in the batch: nothing has reached the socket.
        let mut probe = [0u8; 1];
        let peeked =
            tokio::time::timeout(Duration::from_millis(100), peer.get_ref().peek(&mut probe)).await;
        assert!(peeked.is_err(), "a batch went out before the flush");
        tls.flush().await.unwrap();
        let mut got = vec![0u8; blob.len()];
        peer.read_exact(&mut got).await.unwrap();
        assert!(got == blob, "the bytes arrive whole and in order");

        // More than a batch holds goes out as the batch fills; the rest at shutdown, then
        // the close.
        let big_len = read_ahead::WRITE_BATCH + 3 * RECORD;
        let big: Vec<u8> = (0..big_len as u32).map(|i| (i % 239) as u8).collect();
        let reader = tokio::spawn(async move {
            let mut all = Vec::new();
            peer.read_to_end(&mut all).await.unwrap();
            all
        });
        tls.write_all(&big).await.unwrap();
        tls.shutdown().await.unwrap();
        assert!(reader.await.unwrap() == big);
    }

    #[tokio::test]
    async fn vectored_writes_gather_small_pieces_into_one_record() {
        use std::io::IoSlice;
        let (mut tls, mut peer) = tls_pair().await;
        assert!(
            tls.is_write_vectored(),
            "hyper queues instead of flattening"
        );
        let head = vec![b'h'; 100];
        let body: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();

        // Head and the start of the body share the first record, filled to the brim.
        let n = tls
            .write_vectored(&[IoSlice::new(&head), IoSlice::new(&body)])
            .await
            .unwrap();
        assert_eq!(n, RECORD);
        // A piece of a record or more goes out alone; empty pieces are skipped.
        let rest = &body[RECORD - head.len()..];
        let m = tls
            .write_vectored(&[IoSlice::new(&[]), IoSlice::new(rest), IoSlice::new(b"tail")])
            .await
            .unwrap();
        assert!(m > 0 && m <= rest.len(), "{m}");
        let mut left = rest[m..].to_vec();
        left.extend_from_slice(b"tail");
        tls.write_all(&left).await.unwrap();
        tls.flush().await.unwrap();
        assert_eq!(tls.write_vectored(&[]).await.unwrap(), 0);

        let mut want = head.clone();
        want.extend_from_slice(&body);
        want.extend_from_slice(b"tail");
        let mut got = vec![0u8; want.len()];
        peer.read_exact(&mut got).await.unwrap();
        assert!(got == want, "the bytes arrive whole and in order");
    }

    #[tokio::test]
    async fn a_splice_ends_after_idle_and_bytes_either_way_keep_it_open() {
        let idle = Duration::from_millis(300);
        let (mut a, mut a_peer) = tokio::io::duplex(1024);
        let (mut b, mut b_peer) = tokio::io::duplex(1024);
        let start = std::time::Instant::now();
        let drain = Drain::default();
        let task =
            tokio::spawn(async move { splice(&mut a, &mut b, idle, "inbound", &drain).await });
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
        assert_eq!(r.end, EndReason::IdleTimeout);
        assert_eq!((r.received, r.sent), (3, 3));
        assert!(took >= idle * 3 + idle, "took {took:?}");
    }

    #[tokio::test]
    async fn a_quiet_splice_gives_back_what_bulk_grew() {
        // Bulk from a plain socket through a splice into our TLS stream, which seals it in
        // batches. Stopped right after the bulk, the TLS side's batch still holds the block it
        // grew (bulk may go on); left quiet for `QUIET`, the splice has given it back.
        for quiet in [false, true] {
            let (mut tls, mut peer) = tls_pair().await;
            tls.batch_writes();
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let mut app = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
            let (mut near, _) = l.accept().await.unwrap();
            let blob = vec![5u8; 4 * read_ahead::WRITE_BATCH];
            let n = blob.len();
            // Both ends stay open after the bulk, so the splice does not end.
            let sender = tokio::spawn(async move {
                app.write_all(&blob).await.unwrap();
                app
            });
            let reader = tokio::spawn(async move {
                let mut got = vec![0u8; n];
                peer.read_exact(&mut got).await.unwrap();
                (got, peer)
            });
            let drain = Drain::default();
            let idle = Duration::from_secs(30);
            let _peer = {
                let spliced = splice(&mut near, &mut tls, idle, "inbound", &drain);
                tokio::pin!(spliced);
                let (got, peer) = tokio::select! {
                    r = &mut spliced => panic!("the splice ended: {r:?}"),
                    r = reader => r.unwrap(),
                };
                assert!(got.iter().all(|&b| b == 5), "the bulk arrives whole");
                let wait = if quiet {
                    QUIET + Duration::from_millis(300)
                } else {
                    Duration::from_millis(10)
                };
                tokio::select! {
                    r = &mut spliced => panic!("the splice ended: {r:?}"),
                    _ = tokio::time::sleep(wait) => {}
                }
                peer
            };
            let kept = read_ahead::tests::batch_capacity(tls.get_ref());
            if quiet {
                assert_eq!(kept, 0, "given back after a quiet second");
            } else {
                assert!(
                    kept >= read_ahead::WRITE_BATCH,
                    "grown for the bulk: {kept}"
                );
            }
            drop(sender.await.unwrap());
        }
    }

    #[tokio::test]
    async fn the_idle_end_comes_on_time_after_a_quiet_give_back() {
        // An idle time longer than QUIET, as every real one is: the quiet give-back comes
        // first and must neither end the splice nor push its idle end away.
        let idle = QUIET + Duration::from_millis(500);
        let (mut a, mut a_peer) = tokio::io::duplex(1024);
        let (mut b, mut b_peer) = tokio::io::duplex(1024);
        let drain = Drain::default();
        let start = std::time::Instant::now();
        let task =
            tokio::spawn(async move { splice(&mut a, &mut b, idle, "inbound", &drain).await });
        a_peer.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        b_peer.read_exact(&mut one).await.unwrap();
        tokio::time::sleep(QUIET + Duration::from_millis(200)).await;
        assert!(!task.is_finished(), "ended at the give-back");
        // Bytes still move after the give-back, on new buffers.
        b_peer.write_all(b"y").await.unwrap();
        a_peer.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"y");
        let moved = start.elapsed();
        let r = tokio::time::timeout(idle * 2, task).await.unwrap().unwrap();
        let took = start.elapsed() - moved;
        assert_eq!(r.end, EndReason::IdleTimeout);
        assert_eq!((r.received, r.sent), (1, 1));
        assert!(took >= idle - Duration::from_millis(50), "took {took:?}");
    }

    #[tokio::test]
    async fn a_splice_reports_bytes_and_why_it_ended() {
        let idle = Duration::from_secs(30);
        // Both sides finish: eof, with the payload counted per side.
        let (mut a, mut a_peer) = tokio::io::duplex(1024);
        let (mut b, mut b_peer) = tokio::io::duplex(1024);
        let drain = Drain::default();
        let task =
            tokio::spawn(async move { splice(&mut a, &mut b, idle, "inbound", &drain).await });
        a_peer.write_all(b"hello").await.unwrap();
        a_peer.shutdown().await.unwrap();
        let mut got = Vec::new();
        b_peer.write_all(b"hi").await.unwrap();
        b_peer.shutdown().await.unwrap();
        b_peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello");
        let r = task.await.unwrap();
        assert_eq!((r.received, r.sent, r.end), (5, 2, EndReason::Eof));

        // The drain's end cuts what is still open.
        let (mut a, _a_peer) = tokio::io::duplex(1024);
        let (mut b, _b_peer) = tokio::io::duplex(1024);
        let drain = Drain::default();
        let d = drain.clone();
        let task = tokio::spawn(async move { splice(&mut a, &mut b, idle, "inbound", &d).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!task.is_finished());
        drain.advance(Phase::Cut);
        let r = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.end, EndReason::Drain);

        // A side that vanishes mid-stream: reset.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut near = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (peer, _) = l.accept().await.unwrap();
        let (mut b, mut b_peer) = tokio::io::duplex(1024);
        let drain = Drain::default();
        let task =
            tokio::spawn(async move { splice(&mut near, &mut b, idle, "inbound", &drain).await });
        b_peer.write_all(b"unread").await.unwrap();
        // Closing with unread bytes (or SO_LINGER 0) makes the kernel send a RST.
        socket2::SockRef::from(&peer)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(peer);
        let r = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.end, EndReason::Reset, "{r:?}");
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

    #[tokio::test]
    async fn accepted_connections_inherit_the_listeners_options() {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        tune_listener(&sock);
        sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let l = sock.listen(8).unwrap();
        let _c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (accepted, _) = l.accept().await.unwrap();
        assert!(accepted.nodelay().unwrap());
        let s = socket2::SockRef::from(&accepted);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(s.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(s.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
    }
}
