//! The byte copy under a splice: both directions of a spliced connection, each through
//! a buffer that starts at one TLS record and grows for bulk transfers.
//!
//! Small buffers keep an idle tunnel cheap, but a bulk stream read 16 KiB at a time costs a
//! `recv`, a window update to the sender and, on the far side, a TCP segment per 16 KiB; Envoy
//! reads up to 128 KiB per `readv` there. A direction whose read fills its whole buffer is
//! moving bulk data, so its buffer grows (once) to [`BULK`]: from then on one read (and, with the
//! TLS stream taking every record already received, one write of plaintext) moves up to
//! 256 KiB. A direction that never fills its buffer keeps the small one. A grown buffer is kept
//! while bulk keeps coming (growing it for each burst would allocate and zero 256 KiB each
//! time). Once the splice has been quiet for a while, each direction frees its buffer, small or
//! grown ([`Pumps::give_back`], called by `sockets::splice`), and the next read takes a small
//! one again: a quiet tunnel holds no copy buffer at all.
//!
//! The shape follows tokio's `copy_bidirectional`: a direction at end of stream flushes, shuts
//! its writer down (a half-close passes through) and is done; the copy ends when both are.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A direction's buffer at first: one TLS record of plaintext, so a TLS writer seals whole
/// records.
pub const START: usize = super::record::RECORD;

/// What a direction's buffer grows to once a read fills it: sixteen records. Against four,
/// bulk through the pair costs clearly less CPU on the sealing side (fewer `recv`s, window
/// updates and `send`s; benches/README.md, "Splicing bulk").
pub const BULK: usize = 16 * START;

/// One direction: bytes read from one side and not yet written to the other.
struct Pump {
    buf: Box<[u8]>,
    /// `buf[pos..end]` waits to be written.
    pos: usize,
    end: usize,
    /// The reader reached its end.
    eof: bool,
    /// Written since the last flush.
    dirty: bool,
    /// The writer has been shut down after the reader's end: nothing more to do.
    done: bool,
}

impl Pump {
    fn new() -> Pump {
        Pump {
            buf: vec![0; START].into_boxed_slice(),
            pos: 0,
            end: 0,
            eof: false,
            dirty: false,
            done: false,
        }
    }

    /// Copies until the reader's end, then flushes and shuts the writer down (a half-close
    /// passes through): `Ready` once this direction is finished.
    fn poll_direction<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        r: &mut R,
        w: &mut W,
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        while !self.eof {
            if self.pos == self.end {
                if self.buf.is_empty() {
                    // Given back while the connection was quiet.
                    self.buf = vec![0; START].into_boxed_slice();
                }
                let mut into = ReadBuf::new(&mut self.buf);
                match Pin::new(&mut *r).poll_read(cx, &mut into) {
                    Poll::Pending => {
                        // Nothing more to read for now: what was written goes out.
                        if self.dirty {
                            ready!(Pin::new(&mut *w).poll_flush(cx))?;
                            self.dirty = false;
                        }
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Ready(Ok(())) => {
                        let n = into.filled().len();
                        (self.pos, self.end) = (0, n);
                        self.eof = n == 0;
                        if n == self.buf.len() && n < BULK {
                            self.grow();
                        }
                    }
                }
            }
            while self.pos < self.end {
                let n = ready!(Pin::new(&mut *w).poll_write(cx, &self.buf[self.pos..self.end]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.pos += n;
                self.dirty = true;
            }
        }
        if !self.done {
            ready!(Pin::new(&mut *w).poll_flush(cx))?;
            ready!(Pin::new(&mut *w).poll_shutdown(cx))?;
            self.done = true;
            // The buffer is not needed any more; the other direction may run for long.
            self.buf = Box::default();
        }
        Poll::Ready(Ok(()))
    }

    /// Frees the buffer if nothing waits in it (the next read takes a new one of one record);
    /// returns whether it had grown for bulk.
    fn give_back(&mut self) -> bool {
        if self.pos != self.end {
            return false;
        }
        let grown = self.buf.len() > START;
        (self.buf, self.pos, self.end) = (Box::default(), 0, 0);
        grown
    }

    /// The bytes waiting to be written move to a buffer of [`BULK`] bytes.
    fn grow(&mut self) {
        let mut bigger = vec![0; BULK].into_boxed_slice();
        let waiting = self.end - self.pos;
        bigger[..waiting].copy_from_slice(&self.buf[self.pos..self.end]);
        (self.buf, self.pos, self.end) = (bigger, 0, waiting);
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.buf.len()
    }
}

/// Both directions of a splice: `a` to `b` ("there") and `b` to `a` ("back").
pub struct Pumps {
    there: Pump,
    back: Pump,
}

impl Pumps {
    pub fn new() -> Pumps {
        Pumps {
            there: Pump::new(),
            back: Pump::new(),
        }
    }

    /// Copies `a` to `b` and `b` to `a`: `Ready` once both directions have ended, or at an
    /// error on either.
    pub fn poll<A, B>(&mut self, cx: &mut Context<'_>, a: &mut A, b: &mut B) -> Poll<io::Result<()>>
    where
        A: AsyncRead + AsyncWrite + Unpin + ?Sized,
        B: AsyncRead + AsyncWrite + Unpin + ?Sized,
    {
        let there = self.there.poll_direction(cx, a, b)?;
        let back = self.back.poll_direction(cx, b, a)?;
        ready!(there);
        ready!(back);
        Poll::Ready(Ok(()))
    }

    /// Whether a direction holds a buffer.
    pub fn holding(&self) -> bool {
        !self.there.buf.is_empty() || !self.back.buf.is_empty()
    }

    /// Each direction frees its buffer unless bytes still wait in it; returns whether one of
    /// them had grown for bulk.
    pub fn give_back(&mut self) -> bool {
        let there = self.there.give_back();
        let back = self.back.give_back();
        there || back
    }
}

impl Default for Pumps {
    fn default() -> Self {
        Pumps::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_buffer_grows_only_when_a_read_fills_it() {
        // A small message keeps the small buffer.
        let (mut src, mut near) = tokio::io::duplex(BULK * 2);
        let (mut far, mut dst) = tokio::io::duplex(BULK * 2);
        let mut p = Pump::new();
        src.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        let copied = std::future::poll_fn(|cx| {
            let _ = p.poll_direction(cx, &mut near, &mut far);
            Poll::Ready(())
        });
        copied.await;
        dst.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        assert_eq!(p.capacity(), START);

        // A read that fills the buffer: bulk, so it grows, and every byte still arrives in
        // order.
        let blob: Vec<u8> = (0..(3 * BULK) as u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let blob = blob.clone();
            tokio::spawn(async move {
                src.write_all(&blob).await.unwrap();
                src.shutdown().await.unwrap();
            })
        };
        let reader = tokio::spawn(async move {
            let mut all = Vec::new();
            dst.read_to_end(&mut all).await.unwrap();
            all
        });
        std::future::poll_fn(|cx| p.poll_direction(cx, &mut near, &mut far))
            .await
            .unwrap();
        drop(far);
        writer.await.unwrap();
        assert!(
            reader.await.unwrap() == blob,
            "bytes arrive whole and in order"
        );
        assert_eq!(p.capacity(), 0, "a finished direction gives its buffer up");
    }

    #[tokio::test]
    async fn a_buffer_is_given_back_only_when_empty_and_taken_again_by_the_next_read() {
        let (mut src, mut near) = tokio::io::duplex(BULK * 4);
        // The far side takes one record, so most of a bulk read waits in the buffer.
        let (mut far, mut dst) = tokio::io::duplex(START);
        src.write_all(&vec![3u8; 2 * START]).await.unwrap();
        let mut p = Pumps::new();
        let mut poll_once = |p: &mut Pumps| {
            let cx = &mut Context::from_waker(std::task::Waker::noop());
            let _ = p.there.poll_direction(cx, &mut near, &mut far);
        };
        poll_once(&mut p);
        assert_eq!(p.there.capacity(), BULK, "a full read grows the buffer");
        assert!(!p.give_back(), "bytes wait in the grown one");
        assert_eq!(p.there.capacity(), BULK, "so it is kept");
        assert_eq!(p.back.capacity(), 0, "the unused direction's is freed");

        // Once the far side has taken everything, the grown buffer is freed too.
        let mut got = vec![0u8; 2 * START];
        let reader = tokio::spawn(async move {
            dst.read_exact(&mut got).await.unwrap();
            (got, dst)
        });
        while p.there.pos != p.there.end {
            poll_once(&mut p);
            tokio::task::yield_now().await;
        }
        let (got, mut dst) = reader.await.unwrap();
        assert!(got.iter().all(|&b| b == 3));
        assert!(p.give_back(), "it had grown for bulk");
        assert!(!p.holding());

        // The next bytes are read into a new buffer of one record.
        src.write_all(b"again").await.unwrap();
        poll_once(&mut p);
        assert_eq!(p.there.capacity(), START);
        let mut again = [0u8; 5];
        dst.read_exact(&mut again).await.unwrap();
        assert_eq!(&again, b"again");
    }

    #[tokio::test]
    async fn a_full_small_buffer_grows_to_bulk() {
        let (mut src, mut near) = tokio::io::duplex(BULK * 4);
        let (mut far, mut dst) = tokio::io::duplex(BULK * 4);
        src.write_all(&vec![7u8; START * 2]).await.unwrap();
        let mut p = Pump::new();
        std::future::poll_fn(|cx| {
            let _ = p.poll_direction(cx, &mut near, &mut far);
            Poll::Ready(())
        })
        .await;
        assert_eq!(p.capacity(), BULK);
        let mut got = vec![0u8; START * 2];
        dst.read_exact(&mut got).await.unwrap();
        assert!(got.iter().all(|&b| b == 7));
    }
}
