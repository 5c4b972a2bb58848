//! A stream that first replays bytes already read from it.
//!
//! The inbound listener reads the ClientHello itself (to pick a chain by SNI) and then hands the
//! connection to BoringSSL; `Prefixed` gives the TLS stack those bytes back, then the socket.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Reads yield `prefix` first, then `inner`; writes, flush and shutdown go straight to `inner`.
///
/// The inner stream must be `Unpin` (a `TcpStream` is; pin anything else in a `Box`), which keeps
/// this type free of unsafe pin projection. `Prefixed<S>` is `Unpin` whenever `S` is.
#[derive(Debug)]
pub struct Prefixed<S> {
    prefix: Bytes,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(prefix: Bytes, inner: S) -> Self {
        Prefixed { prefix, inner }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: crate::sockets::ReadReady> crate::sockets::ReadReady for Prefixed<S> {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.prefix.has_remaining() {
            return Poll::Ready(Ok(()));
        }
        self.inner.poll_read_ready(cx)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.prefix.has_remaining() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbound::chain::{classify_sni, SniKind};
    use crate::inbound::clienthello;
    use boring::pkey::PKey;
    use boring::ssl::{select_next_proto, AlpnError, NameType, SslAcceptor, SslConnector};
    use boring::ssl::{SslMethod, SslVerifyMode};
    use boring::x509::X509;
    use bytes::BytesMut;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn reads_yield_the_prefix_then_the_inner_stream() {
        let inner: &[u8] = b" world";
        let mut s = Prefixed::new(Bytes::from_static(b"hello"), inner);
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
        let mut s = Prefixed::new(Bytes::new(), inner);
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"abc");
        assert!(s.get_ref().is_empty());
    }

    #[tokio::test]
    async fn writes_flush_and_shutdown_go_to_inner() {
        let (near, mut far) = tokio::io::duplex(1024);
        let mut s = Prefixed::new(Bytes::from_static(b"unread prefix"), near);
        s.write_all(b"reply").await.unwrap();
        s.flush().await.unwrap();
        s.shutdown().await.unwrap();
        let mut got = Vec::new();
        far.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"reply");
    }

    fn self_signed_acceptor() -> SslAcceptor {
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

        let replayed = Prefixed::new(buf.freeze(), tcp);
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
}
