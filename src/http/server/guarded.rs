//! The IO wrapper every downstream HTTP connection is served through: it sniffs the codec,
//! runs the timers and refuses heads hyper must not see, all on the bytes as they pass.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::head_lines::HeadLines;
use super::refusal::{self, Refusal};
use super::requests::ConnRequests;
use super::sniff::{Codec, Fetch, Fetched, Seen, Wire};
use super::timers::Clock;
use crate::http::answer::Reason;
use crate::http::limits::{timers, Timers, H1_MAX_HEAD};

/// A downstream connection, guarded: what hyper lacks for SPEC sections 8 and 11, done on the
/// bytes as they pass between the socket and the codec. Named for the whole of what it does,
/// not just the timers:
/// * it sniffs the codec ([`Guarded::sniff`]) and keeps what it read for the codec;
/// * it runs the downstream timers (`timers.rs`);
/// * an HTTP/1 head over `H1_MAX_HEAD`, or with more than 100 fields, is answered 431
///   `headers-too-large` here, before hyper buffers more or parses the field too many (hyper's
///   own limits would answer without `x-aether-error`), and a head with ambiguous framing 400
///   (`head_lines.rs`, `refusal.rs`);
/// * hyper's own refusals of heads it could not parse go out as the proxy's answer.
pub struct Guarded<S> {
    inner: S,
    requests: Arc<ConnRequests>,
    listener: &'static str,
    clock: Clock,
    seen: Seen,
    /// The current head's bytes so far (its start is `clock.head_since`).
    head_bytes: usize,
    head_lines: HeadLines,
    /// The 431 answer to an oversized HTTP/1 head, once there is one.
    refusal: Option<Refusal>,
    /// What sniffing read, not yet handed to the codec (see [`Guarded::sniff`]).
    fetched: Fetched,
    /// The answer written instead of one hyper made itself, and how much of it went out.
    replacing: Option<(bytes::Bytes, usize)>,
}

impl<S> Guarded<S> {
    pub fn new(
        inner: S,
        requests: Arc<ConnRequests>,
        listener: &'static str,
        wire: Wire,
    ) -> Guarded<S> {
        Guarded::with_timers(inner, requests, listener, wire, *timers())
    }

    pub fn with_timers(
        inner: S,
        requests: Arc<ConnRequests>,
        listener: &'static str,
        wire: Wire,
        timers: Timers,
    ) -> Guarded<S> {
        Guarded {
            inner,
            requests,
            listener,
            clock: Clock::new(timers),
            seen: Seen::new(wire),
            head_bytes: 0,
            head_lines: HeadLines::default(),
            refusal: None,
            fetched: Fetched::default(),
            replacing: None,
        }
    }

    /// A connection that must begin with bytes `check` accepts, within the head timer counted
    /// from now rather than from the first byte: a captured connection to an HTTP port, which
    /// is closed (without an answer) when it speaks something else. Judged on the bytes
    /// [`Guarded::sniff`] reads anyway, so no extra `peek` per connection.
    pub fn first_bytes(mut self, check: fn(&[u8]) -> bool) -> Guarded<S> {
        self.fetched.first_check = Some(check);
        self.clock.head_since = Some((0, Instant::now()));
        self
    }

    /// Notes bytes that arrived: the preface, HTTP/2 frames, the HTTP/1 head's size and fields.
    /// True when the HTTP/1 head now has more fields than SPEC allows.
    fn arrived(&mut self, got: &[u8], between: bool, n: u64) -> bool {
        let now = Instant::now();
        self.clock.last_io = now;
        if self.seen.arrived(got, now) {
            self.requests.set_multiplexed();
        }
        if self.seen.is_h2() {
            return false;
        }
        if between {
            if !self.clock.head_began(n) {
                self.clock.head_since = Some((n, now));
                self.head_bytes = 0;
                self.head_lines = HeadLines::default();
            }
            self.head_bytes += got.len();
            return self.head_lines.feed(got);
        }
        false
    }

    /// Polls the timer that applies; an error once it ran out.
    fn expired(&mut self, cx: &mut Context<'_>, between: bool, n: u64) -> Option<std::io::Error> {
        let tunnelled = self.requests.tunnelled();
        self.clock
            .expired(cx, self.listener, tunnelled, &self.seen, between, n)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Guarded<S> {
    /// Reads until the first bytes say which codec the connection speaks: the full HTTP/2
    /// preface, or anything that departs from it (HTTP/1). `None` when the peer closed without
    /// a byte. What was read stays here for the codec's first read, so the codec gets the
    /// whole head at once (hyper-util's auto codec hands hyper's HTTP/1 codec the 24 bytes it
    /// sniffed on their own; hyper then grows its 8 KiB read buffer to 16 KiB, copying it, on
    /// every new connection). Runs the connection's timers as reads do, and the check of
    /// [`Guarded::first_bytes`] on the first bytes (an `InvalidData` error when it refuses them).
    pub async fn sniff(&mut self) -> std::io::Result<Option<Codec>> {
        std::future::poll_fn(|cx| self.poll_sniff(cx)).await
    }

    fn poll_sniff(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<Option<Codec>>> {
        loop {
            if let Some(codec) = self.fetched.decided() {
                return Poll::Ready(Ok(Some(codec)));
            }
            match self.fetched.poll_fetch(&mut self.inner, cx) {
                Poll::Ready(Ok(Fetch::Ended(codec))) => return Poll::Ready(Ok(codec)),
                Poll::Ready(Ok(Fetch::More)) => {
                    // Bytes have begun: the head timer runs from here, as for any head.
                    let now = Instant::now();
                    self.clock.head_since.get_or_insert((0, now));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    return match self.expired(cx, true, 0) {
                        Some(e) => Poll::Ready(Err(e)),
                        None => Poll::Pending,
                    }
                }
            }
        }
    }

    /// Answers an oversized HTTP/1 head 431 (see [`Refusal::poll`]).
    fn refuse_head(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        crate::http::metrics::cut_off(self.listener, "headers_too_large");
        self.refusal = Some(Refusal::Writing(refusal::head_too_large_answer(), 0));
        self.poll_refusal(cx)
    }

    /// Answers an HTTP/1 head with ambiguous framing 400 `bad-request` and closes: after it,
    /// where the next request would begin is unknown.
    fn refuse_framing(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        crate::http::metrics::cut_off(self.listener, "ambiguous_framing");
        let answer = refusal::refusal_answer(Reason::BadRequest, "400 Bad Request");
        self.refusal = Some(Refusal::Writing(answer, 0));
        self.poll_refusal(cx)
    }

    fn poll_refusal(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let refusal = self.refusal.as_mut().expect("a refusal is under way");
        refusal.poll(&mut self.inner, &mut self.clock, cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.refusal.is_some() {
            return this.poll_refusal(cx);
        }
        let (between, n) = this.requests.between();
        // Bytes of an HTTP/1 head (or of what may still become the HTTP/2 preface).
        let in_head = between && !this.seen.is_h2();
        let head_bytes = if this.clock.head_began(n) && in_head {
            this.head_bytes
        } else {
            0
        };
        if in_head && head_bytes >= H1_MAX_HEAD {
            return this.refuse_head(cx);
        }
        let before = buf.filled().len();
        let r = if in_head && buf.remaining() > H1_MAX_HEAD - head_bytes {
            // Never hand the codec more of a head than the limit.
            let room = H1_MAX_HEAD - head_bytes;
            let mut part = ReadBuf::new(buf.initialize_unfilled_to(room));
            let r = this.fetched.poll_read(&mut this.inner, cx, &mut part);
            let k = part.filled().len();
            buf.advance(k);
            r
        } else {
            this.fetched.poll_read(&mut this.inner, cx, buf)
        };
        match r {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && this.arrived(&buf.filled()[before..], between, n)
                {
                    // The field too many (or the contradicting one) never reaches hyper, which
                    // would answer its own 431 (or pass the request on).
                    buf.set_filled(before);
                    if this.head_lines.ambiguous {
                        return this.refuse_framing(cx);
                    }
                    return this.refuse_head(cx);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.expired(cx, between, n) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
            r => r,
        }
    }
}

impl<S: AsyncWrite + Unpin> Guarded<S> {
    /// Writes count as activity; a write that cannot go out (the peer reads nothing) runs the
    /// HTTP/1 stream idle timer.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<std::io::Result<usize>>,
    ) -> Poll<std::io::Result<usize>> {
        match r {
            Poll::Ready(Ok(k)) if k > 0 => {
                self.clock.last_io = Instant::now();
                r
            }
            Poll::Pending => {
                let (between, n) = self.requests.between();
                if between || self.seen.is_h2() {
                    return r;
                }
                match self.expired(cx, between, n) {
                    Some(e) => Poll::Ready(Err(e)),
                    None => Poll::Pending,
                }
            }
            r => r,
        }
    }

    /// The reason for an answer hyper wrote on its own ([`refusal::library_answer`]). The
    /// proxy writes nothing of its own for a head that never became a request, so only an
    /// answer written after the bytes of a new head began, with no request started for them,
    /// can be one.
    fn library_answer(&self, buf: &[u8]) -> Option<(Reason, &'static str)> {
        if self.seen.is_h2() || buf.len() > 256 || self.requests.tunnelled() {
            return None;
        }
        let (between, n) = self.requests.between();
        if !between || !self.clock.head_began(n) {
            return None;
        }
        refusal::library_answer(buf)
    }

    /// Writes the proxy's answer in place of hyper's (`buf`), reporting `buf` as written once
    /// the replacement is out.
    fn poll_replace(
        &mut self,
        cx: &mut Context<'_>,
        buf_len: usize,
    ) -> Poll<std::io::Result<usize>> {
        let (answer, sent) = self.replacing.as_mut().expect("a replacement is under way");
        while *sent < answer.len() {
            match Pin::new(&mut self.inner).poll_write(cx, &answer[*sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(0)),
                Poll::Ready(Ok(k)) => *sent += k,
                r @ (Poll::Ready(Err(_)) | Poll::Pending) => return self.wrote(cx, r),
            }
        }
        self.replacing = None;
        self.clock.last_io = Instant::now();
        Poll::Ready(Ok(buf_len))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        if this.replacing.is_none() {
            if let Some((reason, status)) = this.library_answer(buf) {
                crate::http::metrics::cut_off(this.listener, "malformed_request");
                this.replacing = Some((refusal::refusal_answer(reason, status), 0));
            }
        }
        if this.replacing.is_some() {
            return this.poll_replace(cx, buf.len());
        }
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        // hyper's own answers are one buffer, with nothing after it.
        let mut filled = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(first), None) = (filled.next(), filled.next()) {
            if self.replacing.is_some() || self.library_answer(first).is_some() {
                return self.poll_write(cx, first);
            }
        }
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
pub(super) mod tests {
    //! Guarded connections over in-memory streams, for the tests of each concern.
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    pub(in crate::http::server) const HEAD: Duration = Duration::from_millis(100);
    pub(in crate::http::server) const IDLE: Duration = Duration::from_millis(400);
    pub(in crate::http::server) const BLOCK: Duration = Duration::from_millis(150);
    pub(in crate::http::server) const STREAM: Duration = Duration::from_millis(1000);

    /// What the tests of the other files look at inside.
    impl<S> Guarded<S> {
        pub(in crate::http::server) fn inner(&self) -> &S {
            &self.inner
        }

        pub(in crate::http::server) fn fetched(&self) -> &Fetched {
            &self.fetched
        }

        pub(in crate::http::server) fn is_h2(&self) -> bool {
            self.seen.is_h2()
        }
    }

    pub(in crate::http::server) fn guarded_with(
        wire: Wire,
        capacity: usize,
    ) -> (
        Guarded<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Arc<ConnRequests>,
    ) {
        let (server, client) = tokio::io::duplex(capacity);
        let (io, requests) = guarded_over(server, wire);
        (io, client, requests)
    }

    /// `inner` behind `Guarded`, with the short timers above.
    pub(in crate::http::server) fn guarded_over<S>(
        inner: S,
        wire: Wire,
    ) -> (Guarded<S>, Arc<ConnRequests>) {
        let requests = Arc::new(ConnRequests::default());
        let timers = Timers {
            head_read: HEAD,
            header_block: BLOCK,
            connection_idle: IDLE,
            stream_idle: STREAM,
            ..Timers::default()
        };
        let io = Guarded::with_timers(inner, requests.clone(), "outbound", wire, timers);
        (io, requests)
    }

    pub(in crate::http::server) fn guarded() -> (
        Guarded<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Arc<ConnRequests>,
    ) {
        guarded_with(Wire::Sniff, 1024)
    }

    /// Reads until an error; returns how long that took.
    pub(in crate::http::server) async fn time_to_error(
        io: &mut Guarded<tokio::io::DuplexStream>,
    ) -> (Duration, std::io::Error) {
        let start = std::time::Instant::now();
        let mut buf = [0u8; 64];
        loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(_) => continue,
                Err(e) => return (start.elapsed(), e),
            }
        }
    }
}
