//! Answers written raw on a downstream HTTP/1 connection, before or instead of hyper's: the
//! 431 for an oversized head and the 400 for ambiguous framing (hyper never parses those
//! heads), the linger after them, and recognising hyper's own refusals so that the proxy's
//! answer, with `x-aether-error` (SPEC section 7), goes out in their place.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::timers::Clock;
use crate::http::answer::{Reason, X_AETHER_ERROR};

/// After the 431 for an oversized head, what the client still sends is read and dropped for up
/// to this long or this much, so that closing with unread bytes (a TCP reset) does not destroy
/// the answer before the client reads it.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 4 << 20;

/// A raw refusal (the 431 or the 400), on its way out.
pub(super) enum Refusal {
    Writing(Bytes, usize),
    Lingering(usize),
}

impl Refusal {
    /// Writes the answer, reads what the client still sends for a moment, then fails the read
    /// so that hyper closes the connection without answering again. The linger takes over
    /// `clock`'s sleep.
    pub(super) fn poll<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        inner: &mut S,
        clock: &mut Clock,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let done = || {
            Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "request head too large",
            )))
        };
        loop {
            match self {
                Refusal::Writing(answer, sent) => {
                    while *sent < answer.len() {
                        match Pin::new(&mut *inner).poll_write(cx, &answer[*sent..]) {
                            Poll::Ready(Ok(0)) => return done(),
                            Poll::Ready(Ok(k)) => *sent += k,
                            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                            Poll::Pending => return Poll::Pending,
                        }
                    }
                    std::task::ready!(Pin::new(&mut *inner).poll_flush(cx))?;
                    *self = Refusal::Lingering(0);
                    clock.sleep_until(tokio::time::Instant::now() + LINGER);
                }
                Refusal::Lingering(dropped) => {
                    let mut scratch = [0u8; 8192];
                    let mut b = ReadBuf::new(&mut scratch);
                    match Pin::new(&mut *inner).poll_read(cx, &mut b) {
                        Poll::Ready(Ok(())) if !b.filled().is_empty() => {
                            *dropped += b.filled().len();
                            if *dropped >= LINGER_BYTES {
                                return done();
                            }
                        }
                        Poll::Ready(_) => return done(),
                        Poll::Pending => {
                            if clock.poll_sleep(cx).is_ready() {
                                return done();
                            }
                            return Poll::Pending;
                        }
                    }
                }
            }
        }
    }
}

/// The 431 `headers-too-large` answer (SPEC section 7), written raw: hyper never parsed the
/// request.
pub(super) fn head_too_large_answer() -> Bytes {
    refusal_answer(
        Reason::HeadersTooLarge,
        "431 Request Header Fields Too Large",
    )
}

/// An error answer written raw, before hyper parsed the request, with a close.
pub(super) fn refusal_answer(reason: Reason, status: &str) -> Bytes {
    let body = reason.body_line();
    Bytes::from(format!(
        "HTTP/1.1 {status}\r\n{}: {}\r\ncontent-type: text/plain\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        X_AETHER_ERROR,
        reason.as_str(),
        body.len()
    ))
}

/// The reason for `buf` when it is an answer hyper wrote on its own: shaped exactly as hyper's
/// refusals are (a `4xx` status line, `connection: close`, `content-length: 0` and `date`,
/// nothing else). Written after the bytes of a new head began, with no request started for
/// them (the caller checks), it is hyper refusing a head it could not parse: obs-fold, a bare
/// CR or NUL in a field, a request target over its limit. SPEC 7 wants every such answer to
/// carry `x-aether-error`. An app's own empty 400 has other fields and is written before the
/// next head begins.
pub(super) fn library_answer(buf: &[u8]) -> Option<(Reason, &'static str)> {
    let head = buf.strip_prefix(b"HTTP/1.1 ")?.strip_suffix(b"\r\n\r\n")?;
    let mut lines = head.split(|b| *b == b'\n');
    let status = lines.next()?;
    let only_hypers_fields = lines.all(|l| {
        l.eq_ignore_ascii_case(b"content-length: 0\r")
            || l.eq_ignore_ascii_case(b"connection: close\r")
            || l.starts_with(b"date: ")
    });
    if !only_hypers_fields {
        return None;
    }
    match status.get(..3)? {
        b"400" => Some((Reason::BadRequest, "400 Bad Request")),
        b"414" => Some((Reason::UriTooLong, "414 URI Too Long")),
        b"431" => Some((
            Reason::HeadersTooLarge,
            "431 Request Header Fields Too Large",
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::http::limits::H1_MAX_HEAD;
    use crate::http::server::guarded::tests::guarded_with;
    use crate::http::server::head_lines::tests::head_with;
    use crate::http::server::sniff::Wire;

    #[tokio::test]
    async fn a_head_over_the_limit_is_answered_431_before_the_codec_sees_it_all() {
        let (mut io, mut client, _) = guarded_with(Wire::H1, 512 << 10);
        let mut head = b"GET / HTTP/1.1\r\nx-big: ".to_vec();
        head.resize(H1_MAX_HEAD + 4096, b'a');
        client.write_all(&head).await.unwrap();
        let mut handed = 0;
        let mut buf = vec![0u8; 200 << 10];
        let e = loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(k) => handed += k,
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(handed, H1_MAX_HEAD, "the codec got more than the limit");
        let mut answer = vec![0u8; 1024];
        let k = client.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..k]);
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        assert!(
            answer.contains("x-aether-error: headers-too-large"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn a_head_with_a_field_too_many_is_answered_431_and_the_codec_never_sees_it() {
        let (mut io, mut client, _) = guarded_with(Wire::Sniff, 64 << 10);
        let head = head_with(101);
        let cut = head_with(100).len() - 2;
        // The first 100 fields in one write, the rest (the 101st field and the end) in another.
        client.write_all(&head[..cut]).await.unwrap();
        let mut handed = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let k = io.read(&mut buf).await.unwrap();
        handed.extend_from_slice(&buf[..k]);
        client.write_all(&head[cut..]).await.unwrap();
        let e = loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(k) => handed.extend_from_slice(&buf[..k]),
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(handed, &head[..cut], "the codec got the field too many");
        let mut answer = vec![0u8; 1024];
        let k = client.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..k]);
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        assert!(
            answer.contains("x-aether-error: headers-too-large"),
            "{answer}"
        );
    }
}
