//! Which codec a downstream connection speaks: what ALPN (or the chain) said, else its first
//! bytes, where only the full 24-byte HTTP/2 preface means HTTP/2. What sniffing reads is kept
//! for the codec's first read.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::Instant;

use super::h2_frames::Frames;

/// What a downstream connection speaks, as far as is known before its first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// ALPN (or the chain) said HTTP/1.1.
    H1,
    /// ALPN (or the chain) said HTTP/2; the preface must still arrive, in time.
    H2,
    /// Plaintext, or TLS without ALPN: the full 24-byte HTTP/2 preface decides, never a
    /// shorter guess.
    Sniff,
}

pub(super) const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a sniffed connection speaks (`Guarded::sniff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    H1,
    H2,
}

/// What the bytes so far say the connection speaks.
pub(crate) enum Seen {
    /// This many bytes of the HTTP/2 preface matched so far.
    Preface(usize),
    H1,
    H2(Frames),
}

impl Seen {
    pub(crate) fn new(wire: Wire) -> Seen {
        match wire {
            Wire::H1 => Seen::H1,
            Wire::H2 | Wire::Sniff => Seen::Preface(0),
        }
    }

    pub(crate) fn is_h2(&self) -> bool {
        matches!(self, Seen::H2(_))
    }

    /// When the open HTTP/2 header block began, if one is open.
    pub(crate) fn header_block_since(&self) -> Option<Instant> {
        match self {
            Seen::H2(frames) => frames.block_since(),
            _ => None,
        }
    }

    /// Notes bytes that arrived: the preface as it matches, then HTTP/2 frames. True when
    /// these bytes completed the preface.
    pub(crate) fn arrived(&mut self, got: &[u8], now: Instant) -> bool {
        let mut rest = got;
        let mut completed = false;
        if let Seen::Preface(matched) = *self {
            let k = (PREFACE.len() - matched).min(rest.len());
            if rest[..k] != PREFACE[matched..matched + k] {
                *self = Seen::H1;
            } else if matched + k == PREFACE.len() {
                *self = Seen::H2(Frames::default());
                completed = true;
                rest = &rest[k..];
            } else {
                *self = Seen::Preface(matched + k);
            }
        }
        if let Seen::H2(frames) = self {
            frames.feed(rest, now);
        }
        completed
    }
}

/// How much one read while sniffing fetches: a whole ordinary request head, or an HTTP/2
/// client's first flight.
pub(super) const FIRST_READ: usize = 4096;

/// What sniffing read ahead of the codec, and the check a connection's first bytes must pass.
#[derive(Default)]
pub(super) struct Fetched {
    /// Judges the connection's first bytes when they are sniffed (`Guarded::first_bytes`).
    pub(super) first_check: Option<fn(&[u8]) -> bool>,
    /// What sniffing read, not yet handed to the codec.
    bytes: Option<Bytes>,
}

/// What one read while sniffing brought.
pub(super) enum Fetch {
    /// Bytes, kept for the codec.
    More,
    /// The end of the stream; the codec that answers what came before it, if anything did.
    Ended(Option<Codec>),
}

impl Fetched {
    /// The codec the bytes fetched so far decide, if they do: the full HTTP/2 preface, or
    /// anything that departs from it (HTTP/1).
    pub(super) fn decided(&self) -> Option<Codec> {
        let have = self.bytes.as_deref().unwrap_or_default();
        let k = have.len().min(PREFACE.len());
        if have[..k] != PREFACE[..k] {
            return Some(Codec::H1);
        }
        if k == PREFACE.len() {
            return Some(Codec::H2);
        }
        None
    }

    /// Reads up to [`FIRST_READ`] more bytes and keeps them for the codec; the first bytes
    /// must pass `first_check` (an `InvalidData` error when they do not).
    pub(super) fn poll_fetch<S: AsyncRead + Unpin>(
        &mut self,
        inner: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<Fetch>> {
        let mut ahead = [std::mem::MaybeUninit::<u8>::uninit(); FIRST_READ];
        let mut ahead = ReadBuf::uninit(&mut ahead);
        std::task::ready!(Pin::new(inner).poll_read(cx, &mut ahead))?;
        let got = ahead.filled();
        if got.is_empty() {
            // A partial preface, then the end: HTTP/1's codec answers or closes.
            return Poll::Ready(Ok(Fetch::Ended(self.bytes.is_some().then_some(Codec::H1))));
        }
        if let Some(check) = self.first_check.take() {
            if !check(got) {
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "not the protocol this port serves",
                )));
            }
        }
        self.bytes = Some(match self.bytes.take() {
            None => Bytes::copy_from_slice(got),
            Some(before) => [&before[..], got].concat().into(),
        });
        Poll::Ready(Ok(Fetch::More))
    }

    /// Reads what sniffing fetched, then the stream: the codec's first read gets the whole
    /// head that arrived, not just the preface-sized part the sniff looked at.
    pub(super) fn poll_read<S: AsyncRead + Unpin>(
        &mut self,
        inner: &mut S,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        use bytes::Buf;
        let Some(fetched) = &mut self.bytes else {
            return Pin::new(inner).poll_read(cx, buf);
        };
        let k = fetched.len().min(buf.remaining());
        buf.put_slice(&fetched[..k]);
        fetched.advance(k);
        if fetched.is_empty() {
            self.bytes = None;
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::http::server::guarded::tests::{guarded, guarded_over, IDLE};
    use crate::http::server::guarded::Guarded;

    /// A stream that counts the reads that reached it.
    struct Counted {
        inner: tokio::io::DuplexStream,
        reads: usize,
    }

    impl tokio::io::AsyncRead for Counted {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
            if r.is_ready() {
                self.reads += 1;
            }
            r
        }
    }

    impl tokio::io::AsyncWrite for Counted {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
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

    fn counted(wire: Wire) -> (Guarded<Counted>, tokio::io::DuplexStream) {
        let (server, client) = tokio::io::duplex(1 << 16);
        let inner = Counted {
            inner: server,
            reads: 0,
        };
        (guarded_over(inner, wire).0, client)
    }

    #[tokio::test]
    async fn what_the_sniff_fetched_serves_small_reads_without_asking_the_stream() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let head = b"GET / HTTP/1.1\r\nHost: payments.aether.internal\r\nUser-Agent: x\r\n\r\n";
        client.write_all(head).await.unwrap();
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        // Even a codec that reads 24 bytes first, then a large read, gets the rest of the head
        // from what the sniff fetched.
        let mut first = [0u8; 24];
        io.read_exact(&mut first).await.unwrap();
        let mut rest = vec![0u8; 16 << 10];
        let n = io.read(&mut rest).await.unwrap();
        assert_eq!([&first[..], &rest[..n]].concat(), head);
        assert_eq!(
            io.inner().reads,
            1,
            "the rest of the head came from the first read"
        );
        // Then the stream again, in order.
        client.write_all(b"more").await.unwrap();
        let n = io.read(&mut rest).await.unwrap();
        assert_eq!(&rest[..n], b"more");
        assert_eq!(io.inner().reads, 2);
    }

    #[tokio::test]
    async fn sniffing_an_http1_head_hands_the_codec_all_of_it_in_one_read() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let head = b"GET / HTTP/1.1\r\nHost: payments.aether.internal\r\n\r\n";
        client.write_all(head).await.unwrap();
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        let mut buf = vec![0u8; 8 << 10];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], head);
        assert_eq!(io.inner().reads, 1);
    }

    #[tokio::test]
    async fn sniffing_waits_for_the_whole_preface_across_reads() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let mut bytes = PREFACE.to_vec();
        bytes.extend_from_slice(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00");
        client.write_all(&bytes[..10]).await.unwrap();
        let sniffed = tokio::spawn(async move {
            let codec = io.sniff().await.unwrap();
            (io, codec)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&bytes[10..]).await.unwrap();
        let (mut io, codec) = sniffed.await.unwrap();
        assert_eq!(codec, Some(Codec::H2));
        let mut buf = vec![0u8; 1024];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], &bytes[..]);
        assert!(
            io.is_h2(),
            "the preface went through the timers' accounting once"
        );
    }

    #[tokio::test]
    async fn sniffing_a_connection_that_ends_at_once_or_mid_preface() {
        let (mut io, client) = counted(Wire::Sniff);
        drop(client);
        assert_eq!(io.sniff().await.unwrap(), None);
        let (mut io, mut client) = counted(Wire::Sniff);
        client.write_all(b"PRI * HTTP/2").await.unwrap();
        drop(client);
        // HTTP/1's codec then answers the fragment (or closes).
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
    }

    #[tokio::test]
    async fn sniffing_runs_the_idle_timer_then_the_head_timer_once_bytes_begin() {
        let (mut io, _client, _) = guarded();
        let start = std::time::Instant::now();
        let e = io.sniff().await.unwrap_err();
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(start.elapsed() >= IDLE - Duration::from_millis(20));
        let (mut io, mut client, _) = guarded();
        client.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let start = std::time::Instant::now();
        let e = io.sniff().await.unwrap_err();
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(start.elapsed() < IDLE, "took {:?}", start.elapsed());
    }

    #[tokio::test]
    async fn what_the_sniff_fetched_is_handed_out_in_order_in_small_pieces() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let sent: Vec<u8> = (0..3 * FIRST_READ).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).await.unwrap();
        drop(client);
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        let mut got = Vec::new();
        let mut piece = [0u8; 100];
        loop {
            let n = io.read(&mut piece).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&piece[..n]);
        }
        assert_eq!(got, sent);
    }

    #[tokio::test]
    async fn a_connection_whose_codec_is_known_reads_only_what_is_asked() {
        // Under TLS (ALPN said which codec) the stream below has its own read-ahead.
        let (mut io, mut client) = counted(Wire::H1);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut first = [0u8; 4];
        io.read_exact(&mut first).await.unwrap();
        let mut rest = [0u8; 64];
        let n = io.read(&mut rest).await.unwrap();
        assert_eq!(&rest[..n], b"/ HTTP/1.1\r\n\r\n");
        assert_eq!(io.inner().reads, 2);
    }

    pub(in crate::http::server) fn starts_with_g(first: &[u8]) -> bool {
        first.starts_with(b"G")
    }

    #[tokio::test]
    async fn first_bytes_the_check_refuses_fail_the_sniff_and_hand_over_nothing() {
        let (io, mut client, _) = guarded();
        let mut io = io.first_bytes(starts_with_g);
        client.write_all(b"\x00\x00\x00\x08GET").await.unwrap();
        let e = io.sniff().await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(io.fetched().bytes.is_none(), "nothing is kept for a codec");
    }

    #[tokio::test]
    async fn first_bytes_the_check_accepts_pass_through_and_are_judged_once() {
        let (io, mut client, _) = guarded();
        let mut io = io.first_bytes(starts_with_g);
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        let mut buf = [0u8; 64];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"GET / HTTP/1.1\r\n");
        // Later bytes are the codec's business, whatever they are.
        client.write_all(b"\x00x: y\r\n").await.unwrap();
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"\x00x: y\r\n");
    }
}
