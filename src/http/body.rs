//! Bodies as they cross the proxy: streamed frame by frame (never buffered whole), counted, and
//! with a hook that runs once when the stream ends, fails or is dropped, which is when a
//! request is really over (for the access log, metrics and in-flight counts). A guarded body
//! also holds trailers to the header limits and notes activity for the stream idle timer
//! (SPEC section 8).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{Either, Empty, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};

/// What runs at the end of a response: it gets whether the body ended cleanly and how many
/// bytes of data went through.
pub type OnEnd = Box<dyn FnOnce(bool, u64) + Send + Sync>;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// When bytes last moved, either way: a request's two bodies share one, and so do the two
/// streams of a splice (`sockets::splice`).
#[derive(Clone)]
pub struct Activity {
    base: tokio::time::Instant,
    /// Milliseconds after `base`.
    last: Arc<AtomicU64>,
}

impl Activity {
    pub fn new() -> Activity {
        Activity {
            base: tokio::time::Instant::now(),
            last: Arc::default(),
        }
    }

    pub fn touch(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.last.fetch_max(ms, Ordering::Relaxed);
    }

    pub fn last(&self) -> tokio::time::Instant {
        self.base + Duration::from_millis(self.last.load(Ordering::Relaxed))
    }
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

/// What a request body's reader learns for the rest of the request: the data bytes that went
/// through (the access log's `bytes_received`), and whether the body ended in an error of the
/// client's making: malformed framing, a client that closed or reset mid-body, a stream idle
/// cut, trailers over the limits. Such a failure is never the upstream's (SPEC 11).
#[derive(Debug, Default)]
pub struct Received {
    bytes: AtomicU64,
    failed: std::sync::atomic::AtomicBool,
}

impl Received {
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The request body failed on the client's side.
    pub fn client_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }
}

/// The limits a guarded body enforces.
struct Guard {
    listener: &'static str,
    activity: Activity,
    /// Response bodies only: the stream idle timer, made when the body first waits.
    idle: Option<(Duration, Option<Pin<Box<tokio::time::Sleep>>>)>,
}

pub struct Metered<B> {
    inner: B,
    /// Data bytes so far.
    counted: u64,
    /// The same count and how the body ended, for readers elsewhere (a request body's, read by
    /// the access log when the response ends and by the forwarder when the upstream exchange
    /// broke). A response body's count goes only to its `on_end`, so it has none.
    bytes: Option<Arc<Received>>,
    on_end: Option<OnEnd>,
    guard: Option<Guard>,
    /// A request body not to be read until the next hop's `100 Continue` (`expect.rs`).
    held: Option<super::expect::Held>,
}

/// A request body on its way upstream: the peer's, or none (a body-less request sent again on
/// a retry: hyper's `Incoming` cannot be made anew, and an `Either` costs no allocation).
pub type ReqBody = Metered<Either<Incoming, Empty<Bytes>>>;
/// A request on its way upstream, boxed once where a listener makes it: it passes down several
/// levels of futures to its connection, and each would otherwise copy all of it.
pub type BoxedRequest = Box<http::Request<ReqBody>>;
/// A response body: streamed from a peer, or made here.
pub type RespBody = Metered<Either<UpBody, Full<Bytes>>>;

pub use super::upstream_body::UpBody;

impl<B> Metered<B> {
    pub fn new(inner: B, bytes: Arc<Received>) -> Metered<B> {
        let mut m = Metered::counted_here(inner);
        m.bytes = Some(bytes);
        m
    }

    /// A body whose count only its `on_end` reads.
    pub fn counted_here(inner: B) -> Metered<B> {
        Metered {
            inner,
            counted: 0,
            bytes: None,
            on_end: None,
            guard: None,
            held: None,
        }
    }

    /// For a request that `expects_continue`: the body waits for its gate.
    pub fn held_for_continue(mut self, expects: bool) -> Metered<B> {
        if expects {
            let gate = Arc::new(super::expect::ContinueGate::default());
            self.held = Some(super::expect::Held::new(gate));
        }
        self
    }

    /// The gate a held body waits for, while it waits.
    pub fn continue_gate(&self) -> Option<&Arc<super::expect::ContinueGate>> {
        self.held.as_ref().map(|h| h.gate())
    }

    pub fn on_end(mut self, f: OnEnd) -> Metered<B> {
        self.on_end = Some(f);
        self
    }

    /// Holds trailers to the header limits and notes activity on `activity`; cut-offs are
    /// counted for `listener`.
    pub fn guarded(mut self, listener: &'static str, activity: Activity) -> Metered<B> {
        self.guard = Some(Guard {
            listener,
            activity,
            idle: None,
        });
        self
    }

    /// Also ends the body with an error once no bytes moved either way for `after` (the
    /// peer's stream is reset, or its HTTP/1 connection closed).
    pub fn idle_timeout(mut self, after: Duration) -> Metered<B> {
        if let Some(g) = self.guard.as_mut() {
            g.idle = Some((after, None));
        }
        self
    }

    fn finish(&mut self, clean: bool) {
        if let Some(f) = self.on_end.take() {
            f(clean, self.counted);
        }
    }

    /// An error that ends the body, counted as `reason`.
    fn cut(&mut self, reason: &'static str, what: &'static str) -> BoxError {
        if let Some(g) = &self.guard {
            crate::http::metrics::cut_off(g.listener, reason);
        }
        self.failed();
        what.into()
    }

    /// The body ends in an error from its own side (the peer that sends it, or its limits).
    fn failed(&mut self) {
        if let Some(r) = &self.bytes {
            r.failed.store(true, Ordering::Relaxed);
        }
        self.finish(false);
    }

    /// The count and end of a request body, for reading after the body was handed on.
    pub fn received(&self) -> Option<Arc<Received>> {
        self.bytes.clone()
    }
}

impl ReqBody {
    /// A request body from the peer.
    pub fn from_peer(inner: Incoming, bytes: Arc<Received>) -> ReqBody {
        Metered::new(Either::Left(inner), bytes)
    }

    /// For a request that has no body: an empty body that counts and notes activity where this
    /// one does, to send the request again after this one was consumed by an attempt. `None`
    /// when the body has content (or may have): that cannot be sent twice.
    pub fn empty_twin(&self) -> Option<ReqBody> {
        if !self.inner.is_end_stream() {
            return None;
        }
        Some(Metered {
            inner: Either::Right(Empty::new()),
            counted: 0,
            bytes: self.bytes.clone(),
            on_end: None,
            guard: self.guard.as_ref().map(|g| Guard {
                listener: g.listener,
                activity: g.activity.clone(),
                idle: None,
            }),
            held: None,
        })
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        use std::future::Future;
        let this = &mut *self;
        if let Some(held) = this.held.as_mut() {
            if held.poll_open(cx).is_pending() {
                return Poll::Pending;
            }
            this.held = None;
        }
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match r {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(g) = &this.guard {
                    g.activity.touch();
                    if frame.trailers_ref().is_some_and(super::headers::too_large) {
                        let e = this.cut("headers_too_large", "trailers over the header limits");
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                if let Some(d) = frame.data_ref() {
                    this.counted += d.len() as u64;
                    if let Some(b) = &this.bytes {
                        b.bytes.fetch_add(d.len() as u64, Ordering::Relaxed);
                    }
                }
                if this.inner.is_end_stream() {
                    this.finish(true);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.failed();
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                this.finish(true);
                Poll::Ready(None)
            }
            Poll::Pending => {
                let Some(Guard {
                    activity,
                    idle: Some((after, sleep)),
                    ..
                }) = this.guard.as_mut()
                else {
                    return Poll::Pending;
                };
                // The deadline follows the last activity of either body; the timer is moved
                // only when it fires early, not on every chunk.
                loop {
                    let deadline = activity.last() + *after;
                    let sleep =
                        sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                    sleep.as_mut().reset(deadline);
                }
                let e = this.cut("stream_idle", "the stream moved no bytes for too long");
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for Metered<B> {
    fn drop(&mut self) {
        // A body dropped before its end: the client went away or the exchange was cut.
        self.finish(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::Mutex;

    #[tokio::test]
    async fn counts_bytes_and_ends_once() {
        let bytes = Arc::new(Received::default());
        let ended = Arc::new(Mutex::new(Vec::new()));
        let e = ended.clone();
        let body: Metered<Full<Bytes>> =
            Metered::new(Full::new(Bytes::from_static(b"hello")), bytes.clone())
                .on_end(Box::new(move |clean, n| e.lock().unwrap().push((clean, n))));
        let collected = body.collect().await.unwrap().to_bytes();
        assert_eq!(&collected[..], b"hello");
        assert_eq!(bytes.bytes(), 5);
        assert!(!bytes.client_failed());
        assert_eq!(*ended.lock().unwrap(), vec![(true, 5)]);

        // A response body's count goes to its end hook alone.
        let ended = Arc::new(Mutex::new(Vec::new()));
        let e = ended.clone();
        let body = Metered::counted_here(Full::new(Bytes::from_static(b"hello, world")))
            .on_end(Box::new(move |clean, n| e.lock().unwrap().push((clean, n))));
        body.collect().await.unwrap();
        assert_eq!(*ended.lock().unwrap(), vec![(true, 12)]);
    }

    #[tokio::test]
    async fn a_guarded_body_ends_when_no_bytes_move_and_activity_postpones_it() {
        let idle = Duration::from_millis(300);
        let activity = Activity::new();
        let (mut tx, rx) = futures_channel_body();
        let body = Metered::new(rx, Arc::default())
            .guarded("inbound", activity.clone())
            .idle_timeout(idle);
        let start = std::time::Instant::now();
        let reader = tokio::spawn(async move { body.collect().await.map(|_| ()) });
        // Activity on the other body of the request (here: touched directly) keeps it open.
        for _ in 0..4 {
            tokio::time::sleep(idle / 2).await;
            activity.touch();
        }
        tx.send(Bytes::from_static(b"x")).await;
        let r = reader.await.unwrap();
        let took = start.elapsed();
        let e = r.expect_err("an idle body must end with an error");
        assert!(e.to_string().contains("no bytes"), "{e}");
        assert!(
            took >= idle * 3 - Duration::from_millis(5),
            "ended after {took:?}"
        );
    }

    #[tokio::test]
    async fn trailers_over_the_header_limits_end_the_body() {
        let mut trailers = http::HeaderMap::new();
        for i in 0..=super::super::headers::MAX_HEADERS {
            trailers.insert(
                http::HeaderName::from_bytes(format!("x-t{i}").as_bytes()).unwrap(),
                http::HeaderValue::from_static("v"),
            );
        }
        let body = http_body_util::StreamBody::new(futures_util::stream::iter([
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"x"))),
            Ok(Frame::trailers(trailers)),
        ]));
        let body = Metered::new(body, Arc::default()).guarded("inbound", Activity::new());
        let e = body.collect().await.expect_err("too many trailers");
        assert!(e.to_string().contains("trailers"), "{e}");
    }

    /// A body fed by hand: each sent chunk is one data frame.
    fn futures_channel_body() -> (
        ChunkSender,
        http_body_util::StreamBody<tokio_stream_like::Receiver>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        (
            ChunkSender(tx),
            http_body_util::StreamBody::new(tokio_stream_like::Receiver(rx)),
        )
    }

    struct ChunkSender(tokio::sync::mpsc::Sender<Bytes>);

    impl ChunkSender {
        async fn send(&mut self, b: Bytes) {
            let _ = self.0.send(b).await;
        }
    }

    mod tokio_stream_like {
        use super::*;

        pub struct Receiver(pub tokio::sync::mpsc::Receiver<Bytes>);

        impl futures_util::Stream for Receiver {
            type Item = Result<Frame<Bytes>, std::convert::Infallible>;

            fn poll_next(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Self::Item>> {
                self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
            }
        }
    }

    #[test]
    fn dropped_early_ends_unclean() {
        let ended = Arc::new(Mutex::new(Vec::new()));
        let e = ended.clone();
        let body = Metered::new(Full::new(Bytes::from_static(b"x")), Arc::default())
            .on_end(Box::new(move |clean, _| e.lock().unwrap().push(clean)));
        drop(body);
        assert_eq!(*ended.lock().unwrap(), vec![false]);
    }
}
