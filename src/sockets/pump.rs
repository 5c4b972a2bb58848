//! The byte copy under a splice: both directions of a spliced connection, each through
//! a buffer that starts at one TLS record and grows for bulk transfers.
//!
//! Small buffers keep an idle tunnel cheap, but a bulk stream read 16 KiB at a time costs a
//! `recv`, a window update to the sender and, on the far side, a TCP segment per 16 KiB; Envoy
//! reads up to 128 KiB per `readv` there. A direction whose read fills its whole buffer is
//! moving bulk data, so its buffer grows (once) to [`BULK`]: from then on one read (and, with the
//! TLS stream taking every record already received, one write of plaintext) moves up to
//! 256 KiB. A direction that never fills its buffer keeps the small one, and an idle connection
//! holds two records' worth, as before.
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
/// a GiB through the pair costs about a quarter fewer CPU seconds on the sealing side (fewer
/// `recv`s, window updates and `send`s; README, Benchmarks).
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

/// Copies `a` to `b` and `b` to `a` until both directions have ended, or an error on either.
pub async fn both<A, B>(a: &mut A, b: &mut B) -> io::Result<()>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let (mut ab, mut ba) = (Pump::new(), Pump::new());
    std::future::poll_fn(|cx| {
        let there = ab.poll_direction(cx, a, b)?;
        let back = ba.poll_direction(cx, b, a)?;
        ready!(there);
        ready!(back);
        Poll::Ready(Ok(()))
    })
    .await
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
