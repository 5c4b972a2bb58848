//! A socket read through a buffer, under the TLS layer.
//!
//! BoringSSL asks its transport for exactly what it needs next: the 5-byte record header, then
//! the record body. Read straight from the socket, that is two `recv`s per record, and a third
//! that finds nothing once the last record is in (tokio only learns the socket is drained from
//! a short read). Reading ahead into a buffer makes it one `recv` for a small message and one
//! per several 16 KiB records in bulk, at the cost of copying the bytes once more.
//!
//! A spliced connection also batches its writes here ([`ReadAhead::batch_writes`]): BoringSSL
//! hands over one sealed record at a time, and sent one `send` each, a bulk stream of 16 KiB
//! records leaves as 16 KiB segments, each costing both kernels a trip through TCP. Gathered
//! up to [`WRITE_BATCH`] and sent at once (or when the splice flushes: whenever it has
//! nothing more to read), they leave in one `send` per 64-256 KiB. HTTP connections write
//! through: hyper flushes after every write anyway, so a batch would only add a copy.
//!
//! The inbound listener also reads the ClientHello itself (to pick a chain by SNI) before
//! BoringSSL exists; those bytes start the buffer, so the TLS stack sees them again.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::pump;
use super::record::SEALED_RECORD;

/// A socket that can say whether a read would find bytes, without reading (`&mut`: a buffered
/// stream frees its buffer when the answer is no).
pub trait ReadReady {
    fn poll_read_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;

    /// Whether bytes taken from the socket wait here.
    fn has_buffered(&self) -> bool {
        false
    }
}

impl ReadReady for TcpStream {
    fn poll_read_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        TcpStream::poll_read_ready(self, cx)
    }
}

/// How much one `recv` may take: four full TLS records, so a bulk stream needs about one
/// syscall per 64 KiB.
pub const READ_AHEAD: usize = 4 * SEALED_RECORD;

/// Reads come from the buffer first, then from `inner` through the buffer; writes, flush and
/// shutdown go straight to `inner`.
///
/// The buffer exists only while bytes wait in it or a read is under way: whenever the socket
/// has nothing more (a read would block) and the buffer is empty, the connection gives it up
/// (to its thread's spares, for the next read there), so an idle connection holds no
/// read-ahead memory. The inner stream must be `Unpin` (a `TcpStream` is),
/// which keeps this type free of unsafe pin projection.
#[derive(Debug)]
pub struct ReadAhead<S> {
    buf: BytesMut,
    inner: S,
    /// Writes waiting to go out together, `Some` once [`ReadAhead::batch_writes`] was asked.
    batch: Option<Batch>,
}

/// Sealed records gathered for one `send`; `out[sent..]` is still to go.
#[derive(Debug, Default)]
struct Batch {
    out: BytesMut,
    sent: usize,
}

/// The most a write batch gathers: the records the splice's bulk buffer (`pump::BULK`) seals
/// in one write, sixteen. A batch starts in a read-ahead block (four records) and grows past
/// it only when a burst brings more before the splice flushes, which only a bulk stream does;
/// it then keeps its grown block while bulk keeps coming, as the splice keeps its bulk buffer,
/// and gives it back when the splice goes quiet ([`ReadAhead::give_back_batch`]).
pub const WRITE_BATCH: usize = pump::BULK / pump::START * SEALED_RECORD;

impl<S> ReadAhead<S> {
    pub fn new(inner: S) -> Self {
        Self::with_prefix(BytesMut::new(), inner)
    }

    /// Reads yield `prefix` first (bytes already taken from `inner`).
    pub fn with_prefix(prefix: BytesMut, inner: S) -> Self {
        ReadAhead {
            buf: prefix,
            inner,
            batch: None,
        }
    }

    /// From now on, writes are gathered and sent together, when [`WRITE_BATCH`] bytes wait or
    /// at a flush or shutdown. For splices, which flush whenever their reader waits.
    pub fn batch_writes(&mut self) {
        self.batch.get_or_insert_with(Batch::default);
    }

    /// Frees a write batch's block grown for bulk, unless bytes still wait in it: called by the
    /// splice once it has been quiet for a while, so a tunnel that moved bulk once does not keep
    /// 256 KiB for the rest of its life. Returns whether it did.
    pub fn give_back_batch(&mut self) -> bool {
        match self.batch.as_mut() {
            Some(b) if b.out.is_empty() && b.out.capacity() >= WRITE_BATCH => {
                b.out = BytesMut::new();
                true
            }
            _ => false,
        }
    }

    /// Gives the buffer up when nothing waits in it: called whenever the socket has nothing
    /// more.
    fn release_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            put_spare(std::mem::take(&mut self.buf));
        }
    }
}

/// Emptied buffers kept for the next read on this thread, at most this many. A connection
/// takes a buffer when its socket has bytes and gives it up when the socket has nothing more,
/// so on a keep-alive connection that is once per request: a 64 KiB block allocated and freed
/// each time costs glibc its large-bin search and, on the free, a consolidation of its fast
/// bins, on each TLS side of every request. A worker runs one connection at a time, so a
/// couple of spares serve all of them (a spliced connection's write batches take theirs from
/// here too); idle connections still hold none.
const SPARES: usize = 2;

thread_local! {
    static SPARE: std::cell::RefCell<Vec<BytesMut>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn put_spare(mut buf: BytesMut) {
    buf.clear();
    // Only a whole read-ahead block, unshared (not a ClientHello prefix).
    if !buf.try_reclaim(READ_AHEAD) {
        return;
    }
    let _ = SPARE.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < SPARES {
            s.push(buf);
        }
    });
}

fn take_spare() -> BytesMut {
    SPARE
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl<S: ReadReady> ReadReady for ReadAhead<S> {
    fn has_buffered(&self) -> bool {
        !self.buf.is_empty()
    }

    fn poll_read_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.buf.is_empty() {
            return Poll::Ready(Ok(()));
        }
        let r = self.inner.poll_read_ready(cx);
        if r.is_pending() {
            self.release_if_empty();
        }
        r
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadAhead<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        dst: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.buf.is_empty() {
            // A read as large as the buffer gains nothing from it.
            if dst.remaining() >= READ_AHEAD {
                let r = Pin::new(&mut this.inner).poll_read(cx, dst);
                if r.is_pending() {
                    this.release_if_empty();
                }
                return r;
            }
            if this.buf.capacity() == 0 {
                this.buf = take_spare();
            }
            this.buf.clear();
            this.buf.reserve(READ_AHEAD);
            let mut into = ReadBuf::uninit(this.buf.spare_capacity_mut());
            match Pin::new(&mut this.inner).poll_read(cx, &mut into) {
                Poll::Pending => {
                    this.release_if_empty();
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let n = into.filled().len();
                    // SAFETY: the first `n` bytes of the spare capacity were written by the
                    // read (`ReadBuf::filled` counts only initialised bytes), and `n` is at
                    // most the capacity reserved above.
                    unsafe { this.buf.set_len(n) };
                    if n == 0 {
                        return Poll::Ready(Ok(())); // end of stream
                    }
                }
            }
        }
        let n = this.buf.len().min(dst.remaining());
        dst.put_slice(&this.buf[..n]);
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl Batch {
    /// Sends what the batch holds to `to`; `Ready(Ok)` once it is empty. Its block then goes
    /// to the thread's spares, which read-aheads share: a batch holds memory only while a
    /// burst is being written, without an allocation per batch.
    fn poll_send<S: AsyncWrite + Unpin>(
        &mut self,
        cx: &mut Context<'_>,
        to: &mut S,
    ) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut *to).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        // A block grown to a whole batch (bulk, see `poll_write`) is kept for the next burst;
        // a spare's is handed back.
        if self.out.capacity() >= WRITE_BATCH {
            self.out.clear();
        } else if self.out.capacity() > 0 {
            put_spare(std::mem::take(&mut self.out));
        }
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> ReadAhead<S> {
    /// Sends the batch, if writes are batched.
    fn poll_send_batch(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.batch.as_mut() {
            Some(b) => b.poll_send(cx, &mut self.inner),
            None => Poll::Ready(Ok(())),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadAhead<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let Some(b) = this.batch.as_mut() else {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        };
        if b.out.len() + buf.len() > WRITE_BATCH {
            ready!(b.poll_send(cx, &mut this.inner))?;
        }
        if b.out.is_empty() && buf.len() >= WRITE_BATCH {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        if b.out.capacity() == 0 {
            b.out = take_spare();
            b.out.reserve(READ_AHEAD);
        }
        if b.out.len() + buf.len() > b.out.capacity() {
            // Only a bulk burst outgrows a read-ahead block: grow once, to a whole batch.
            b.out.reserve(WRITE_BATCH - b.out.len());
        }
        b.out.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.batch.is_some() {
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &**b);
            return Pin::new(this).poll_write(cx, first);
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.batch.is_none() && self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_batch(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_batch(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
impl<S> ReadAhead<S> {
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Bytes read from the socket and not yet handed on.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::inbound::chain::{classify_sni, SniKind};
    use crate::inbound::clienthello;
    use boring::pkey::PKey;
    use boring::ssl::{select_next_proto, AlpnError, NameType, SslAcceptor, SslConnector};
    use boring::ssl::{SslMethod, SslVerifyMode};
    use boring::x509::X509;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn reads_yield_the_prefix_then_the_inner_stream() {
        let inner: &[u8] = b" world";
        let mut s = ReadAhead::with_prefix(BytesMut::from(&b"hello"[..]), inner);
        // A tiny read buffer: the prefix comes out in pieces, never mixed with inner bytes.
        let mut small = [0u8; 3];
        assert_eq!(s.read(&mut small).await.unwrap(), 3);
        assert_eq!(&small, b"hel");
        assert_eq!(s.read(&mut small).await.unwrap(), 2);
        assert_eq!(&small[..2], b"lo");
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b" world");
    }

    #[tokio::test]
    async fn empty_prefix_reads_straight_from_inner() {
        let inner: &[u8] = b"abc";
        let mut s = ReadAhead::new(inner);
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"abc");
        assert!(s.get_ref().is_empty());
    }

    #[tokio::test]
    async fn writes_flush_and_shutdown_go_to_inner() {
        let (near, mut far) = tokio::io::duplex(1024);
        let mut s = ReadAhead::with_prefix(BytesMut::from(&b"unread prefix"[..]), near);
        s.write_all(b"reply").await.unwrap();
        s.flush().await.unwrap();
        s.shutdown().await.unwrap();
        let mut got = Vec::new();
        far.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"reply");
    }

    /// A connected loopback pair: (the far end, our end read ahead).
    async fn tcp_pair() -> (tokio::net::TcpStream, ReadAhead<tokio::net::TcpStream>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let far = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (near, _) = listener.accept().await.unwrap();
        (far, ReadAhead::new(near))
    }

    /// Polls `f` once, with a waker that does nothing.
    fn poll_once<T>(f: impl FnOnce(&mut Context<'_>) -> Poll<T>) -> Poll<T> {
        f(&mut Context::from_waker(std::task::Waker::noop()))
    }

    /// What BoringSSL does: a 5-byte header, then the body it announces. One read from the
    /// socket serves both records here; the second record waits in the buffer, and the socket,
    /// drained, must not be what decides whether a read would find bytes.
    #[tokio::test]
    async fn records_come_from_one_socket_read_and_buffered_bytes_count_as_ready() {
        let (mut far, mut near) = tcp_pair().await;
        let record = |fill: u8| {
            let mut r = vec![23, 3, 3, 0, 100];
            r.extend([fill; 100]);
            r
        };
        far.write_all(&[record(b'a'), record(b'b')].concat())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        for fill in [b'a', b'b'] {
            let mut head = [0u8; 5];
            near.read_exact(&mut head).await.unwrap();
            assert_eq!(head, [23, 3, 3, 0, 100]);
            if fill == b'a' {
                assert_eq!(near.buffered(), 100 + 105, "both records came in one read");
            }
            let mut body = [0u8; 100];
            near.read_exact(&mut body).await.unwrap();
            assert_eq!(body, [fill; 100]);
            if fill == b'a' {
                let ready = poll_once(|cx| near.poll_read_ready(cx));
                assert!(ready.is_ready(), "the next record waits in the buffer");
                let socket_ready = poll_once(|cx| near.inner.poll_read_ready(cx));
                assert!(socket_ready.is_pending(), "the socket itself is drained");
            }
        }
        assert_eq!(near.buffered(), 0);
    }

    /// An idle connection keeps no read-ahead buffer: once the socket has nothing more and
    /// the buffer is empty, it is freed; the next bytes get a new one.
    #[tokio::test]
    async fn the_buffer_is_freed_when_the_socket_has_nothing_more() {
        let (mut far, mut near) = tcp_pair().await;
        far.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        near.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        assert!(near.buf.capacity() > 0, "read through the buffer");
        // Readiness asked (what the TLS layer does first) and refused: the buffer goes.
        assert!(poll_once(|cx| near.poll_read_ready(cx)).is_pending());
        assert_eq!(near.buf.capacity(), 0);
        // A read that would block frees it too.
        far.write_all(b"again").await.unwrap();
        near.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"again");
        let mut more = [0u8; 8];
        let pending =
            poll_once(|cx| Pin::new(&mut near).poll_read(cx, &mut ReadBuf::new(&mut more)));
        assert!(pending.is_pending());
        assert_eq!(near.buf.capacity(), 0);
        // End of stream still reads as end of stream.
        far.shutdown().await.unwrap();
        assert_eq!(near.read(&mut more).await.unwrap(), 0);
    }

    /// What a connection gives up, the next read on the thread takes: no new 64 KiB block per
    /// request. At most `SPARES` wait, and a buffer that is not a whole read-ahead block (a
    /// replayed ClientHello) is not kept.
    #[tokio::test]
    async fn given_up_buffers_are_reused_on_the_thread_and_bounded() {
        SPARE.with(|s| s.borrow_mut().clear());
        let spares = || SPARE.with(|s| s.borrow().len());
        let (mut far, mut near) = tcp_pair().await;
        let mut got = [0u8; 3];
        let mut more = [0u8; 8];
        let mut blocks = Vec::new();
        for _ in 0..3 {
            far.write_all(b"one").await.unwrap();
            near.read_exact(&mut got).await.unwrap();
            blocks.push(near.buf.as_ptr());
            let pending =
                poll_once(|cx| Pin::new(&mut near).poll_read(cx, &mut ReadBuf::new(&mut more)));
            assert!(pending.is_pending());
            assert_eq!(near.buf.capacity(), 0, "given up");
            assert_eq!(spares(), 1);
        }
        assert!(blocks.iter().all(|b| *b == blocks[0]), "{blocks:?}");
        // Several connections give theirs up at once: only SPARES are kept.
        let mut pairs = Vec::new();
        for _ in 0..SPARES + 2 {
            let (mut far, mut near) = tcp_pair().await;
            far.write_all(b"one").await.unwrap();
            near.read_exact(&mut got).await.unwrap();
            pairs.push((far, near));
        }
        for (_, near) in &mut pairs {
            assert!(poll_once(|cx| near.poll_read_ready(cx)).is_pending());
        }
        assert_eq!(spares(), SPARES);
        SPARE.with(|s| s.borrow_mut().clear());
        let mut prefix = BytesMut::from(&b"hi"[..]);
        prefix.advance(2);
        put_spare(prefix);
        assert_eq!(spares(), 0, "a prefix buffer was kept");
    }

    /// A read as large as the buffer goes straight to the socket.
    #[tokio::test]
    async fn large_reads_skip_the_buffer() {
        let (mut far, mut near) = tcp_pair().await;
        far.write_all(b"bulk").await.unwrap();
        let mut big = vec![0u8; READ_AHEAD];
        let n = near.read(&mut big).await.unwrap();
        assert_eq!(&big[..n], b"bulk");
        assert_eq!(near.buf.capacity(), 0, "no buffer was taken");
    }

    /// A server context with a fresh self-signed leaf (also used by `sockets`' own tests).
    pub(in crate::sockets) fn self_signed_acceptor() -> SslAcceptor {
        let ck =
            rcgen::generate_simple_self_signed(vec!["payments.aether.internal".into()]).unwrap();
        let cert = X509::from_der(ck.cert.der()).unwrap();
        let key = PKey::private_key_from_pkcs8(&ck.signing_key.serialize_der()).unwrap();
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
        b.set_certificate(&cert).unwrap();
        b.set_private_key(&key).unwrap();
        b.check_private_key().unwrap();
        // What an `h2` chain would offer.
        b.set_alpn_select_callback(|_, client| {
            select_next_proto(b"\x02h2", client).ok_or(AlpnError::NOACK)
        });
        b.build()
    }

    /// The whole inbound path in small: read the ClientHello ourselves, classify its SNI, then
    /// replay the bytes into BoringSSL and finish a real handshake and an exchange.
    #[tokio::test]
    async fn real_tls_handshake_over_the_replayed_hello() {
        let acceptor = self_signed_acceptor();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();

        let client = tokio::spawn(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut b = SslConnector::builder(SslMethod::tls()).unwrap();
            b.set_verify(SslVerifyMode::NONE);
            b.set_alpn_protos(b"\x08http/1.1\x02h2").unwrap();
            b.set_curves_list("X25519MLKEM768:X25519:P-256").unwrap();
            let cfg = b.build().configure().unwrap().verify_hostname(false);
            let mut tls = tokio_boring::connect(cfg, "9090", tcp).await.unwrap();
            assert_eq!(tls.ssl().selected_alpn_protocol(), Some(&b"h2"[..]));
            tls.write_all(b"ping").await.unwrap();
            let mut pong = [0u8; 4];
            tls.read_exact(&mut pong).await.unwrap();
            assert_eq!(&pong, b"pong");
            tls.shutdown().await.unwrap();
        });

        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut buf = BytesMut::new();
        let hello = clienthello::read(&mut tcp, &mut buf, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(hello.sni.as_deref(), Some("9090"));
        assert_eq!(hello.alpn, vec![b"http/1.1".to_vec(), b"h2".to_vec()]);
        assert_eq!(classify_sni(hello.sni.as_deref()), SniKind::Port(9090));

        let replayed = ReadAhead::with_prefix(buf, tcp);
        let mut tls = tokio_boring::accept(&acceptor, replayed).await.unwrap();
        // BoringSSL saw exactly the SNI we routed on.
        assert_eq!(tls.ssl().servername(NameType::HOST_NAME), Some("9090"));
        assert_eq!(tls.ssl().selected_alpn_protocol(), Some(&b"h2"[..]));
        assert!(tls.get_ref().get_ref().peer_addr().is_ok());
        let mut ping = [0u8; 4];
        tls.read_exact(&mut ping).await.unwrap();
        assert_eq!(&ping, b"ping");
        tls.write_all(b"pong").await.unwrap();
        tls.flush().await.unwrap();
        let mut end = Vec::new();
        tls.read_to_end(&mut end).await.unwrap();
        assert!(end.is_empty());
        client.await.unwrap();
    }

    /// The batch's block as it stands: its capacity, 0 when it went back to the spares.
    pub(in crate::sockets) fn batch_capacity<S>(s: &ReadAhead<S>) -> usize {
        s.batch.as_ref().map_or(0, |b| b.out.capacity())
    }

    #[tokio::test]
    async fn a_batch_keeps_a_block_grown_for_bulk_and_gives_back_a_small_one() {
        let (near, mut far) = tokio::io::duplex(4 * WRITE_BATCH);
        let mut s = ReadAhead::new(near);
        s.batch_writes();
        // One full TLS 1.3 record as BoringSSL hands it over: plaintext, header and tag.
        let record: Vec<u8> = (0..crate::sockets::RECORD + 22)
            .map(|i| (i % 251) as u8)
            .collect();

        // A small burst fits the read-ahead block it borrowed, which goes back after the send.
        s.write_all(&record[..1000]).await.unwrap();
        assert!(batch_capacity(&s) >= READ_AHEAD && batch_capacity(&s) < 2 * READ_AHEAD);
        s.flush().await.unwrap();
        assert_eq!(
            batch_capacity(&s),
            0,
            "a small batch holds nothing after its send"
        );
        let mut got = vec![0u8; 1000];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(got, record[..1000]);

        // Five records before a flush, more than a read-ahead block holds: the block grows at
        // once to a whole batch (doubling would stop at half of one), sends nothing before the
        // flush, and stays with the connection after it.
        for _ in 0..5 {
            s.write_all(&record).await.unwrap();
        }
        assert!(batch_capacity(&s) >= WRITE_BATCH, "{}", batch_capacity(&s));
        let mut probe = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(50), far.read(&mut probe)).await;
        assert!(early.is_err(), "the batch went out before the flush");
        s.flush().await.unwrap();
        let kept = batch_capacity(&s);
        assert!(kept >= WRITE_BATCH, "{kept}");
        let mut got = vec![0u8; 5 * record.len()];
        far.read_exact(&mut got).await.unwrap();
        assert!(
            got.chunks(record.len()).all(|c| c == record),
            "bytes whole and in order"
        );

        // Past WRITE_BATCH, a full batch goes out before the next record joins; the block is
        // never reallocated past WRITE_BATCH.
        for _ in 0..40 {
            s.write_all(&record).await.unwrap();
            assert_eq!(batch_capacity(&s), kept);
        }
        s.shutdown().await.unwrap();
        let mut all = Vec::new();
        far.read_to_end(&mut all).await.unwrap();
        assert_eq!(all.len(), 40 * record.len());
        assert!(all.chunks(record.len()).all(|c| c == record));
    }

    #[tokio::test]
    async fn a_grown_batch_is_given_back_once_sent() {
        let (near, mut far) = tokio::io::duplex(4 * WRITE_BATCH);
        let mut s = ReadAhead::new(near);
        s.batch_writes();
        let record = vec![9u8; crate::sockets::RECORD + 22];
        for _ in 0..5 {
            s.write_all(&record).await.unwrap();
        }
        assert!(batch_capacity(&s) >= WRITE_BATCH);
        assert!(!s.give_back_batch());
        assert!(
            batch_capacity(&s) >= WRITE_BATCH,
            "records still wait in it: kept"
        );
        s.flush().await.unwrap();
        assert!(s.give_back_batch());
        assert_eq!(batch_capacity(&s), 0, "sent: given back");
        // Writes go on as before, from a read-ahead block.
        s.write_all(&record).await.unwrap();
        s.flush().await.unwrap();
        let mut got = vec![0u8; 6 * record.len()];
        far.read_exact(&mut got).await.unwrap();
        assert!(got.iter().all(|&b| b == 9));
    }
}
