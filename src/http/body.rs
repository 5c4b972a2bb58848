//! Bodies as they cross the proxy: streamed frame by frame (never buffered whole), counted, and
//! with a hook that runs once when the stream ends, fails or is dropped, which is when a
//! request is really over (for the access log, metrics and in-flight counts).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};

/// What runs at the end of a response: it gets whether the body ended cleanly.
pub type OnEnd = Box<dyn FnOnce(bool) + Send + Sync>;

pub struct Metered<B> {
    inner: B,
    bytes: Arc<AtomicU64>,
    on_end: Option<OnEnd>,
}

/// A request body on its way upstream.
pub type ReqBody = Metered<Incoming>;
/// A response body: streamed from a peer, or made here.
pub type RespBody = Metered<Either<Incoming, Full<Bytes>>>;

impl<B> Metered<B> {
    pub fn new(inner: B, bytes: Arc<AtomicU64>) -> Metered<B> {
        Metered {
            inner,
            bytes,
            on_end: None,
        }
    }

    pub fn on_end(mut self, f: OnEnd) -> Metered<B> {
        self.on_end = Some(f);
        self
    }

    fn finish(&mut self, clean: bool) {
        if let Some(f) = self.on_end.take() {
            f(clean);
        }
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    this.bytes.fetch_add(d.len() as u64, Ordering::Relaxed);
                }
                if this.inner.is_end_stream() {
                    this.finish(true);
                }
            }
            Poll::Ready(Some(Err(_))) => this.finish(false),
            Poll::Ready(None) => this.finish(true),
            Poll::Pending => {}
        }
        r
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
        let bytes = Arc::new(AtomicU64::new(0));
        let ended = Arc::new(Mutex::new(Vec::new()));
        let e = ended.clone();
        let body: Metered<Full<Bytes>> =
            Metered::new(Full::new(Bytes::from_static(b"hello")), bytes.clone())
                .on_end(Box::new(move |clean| e.lock().unwrap().push(clean)));
        let collected = body.collect().await.unwrap().to_bytes();
        assert_eq!(&collected[..], b"hello");
        assert_eq!(bytes.load(Ordering::Relaxed), 5);
        assert_eq!(*ended.lock().unwrap(), vec![true]);
    }

    #[test]
    fn dropped_early_ends_unclean() {
        let ended = Arc::new(Mutex::new(Vec::new()));
        let e = ended.clone();
        let body = Metered::new(Full::new(Bytes::from_static(b"x")), Arc::default())
            .on_end(Box::new(move |clean| e.lock().unwrap().push(clean)));
        drop(body);
        assert_eq!(*ended.lock().unwrap(), vec![false]);
    }
}
