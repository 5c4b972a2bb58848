//! Response bodies as they come from the next hop, before the proxy meters them: hyper's
//! `Incoming` for HTTP/1.1, an h2 stream for HTTP/2 (`outbound::h2_client`).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body from the next hop: an HTTP/1.1 connection's (through hyper) or an HTTP/2
/// stream's (through h2, `outbound::h2_client`).
pub enum UpBody {
    H1(H1Body),
    H2(H2Body),
}

impl UpBody {
    /// A body whose connection is not pooled (or is back in its pool already).
    pub fn h1(body: Incoming) -> UpBody {
        UpBody::H1(H1Body { body, back: None })
    }

    /// A body that puts its pooled connection back when it ends (`outbound::pool`).
    pub fn h1_pooled(body: Incoming, back: Option<ReturnToPool>) -> UpBody {
        UpBody::H1(H1Body { body, back })
    }
}

/// Puts a pooled HTTP/1.1 connection back once the response it carried has been read whole.
pub type ReturnToPool = Box<dyn FnOnce() + Send + Sync>;

/// A response body from an HTTP/1.1 connection. When it comes from a pooled one, it returns
/// the connection as its last byte is taken: the connection is free before the response is
/// written downstream, so the client's next request finds it in the pool.
pub struct H1Body {
    body: Incoming,
    back: Option<ReturnToPool>,
}

impl H1Body {
    fn return_to_pool(&mut self) {
        if let Some(back) = self.back.take() {
            back();
        }
    }
}

impl Drop for H1Body {
    /// A body that is complete may never be polled to its end (hyper stops at a known
    /// length; HEAD and 204 answers have none).
    fn drop(&mut self) {
        if self.back.is_some() && self.body.is_end_stream() {
            self.return_to_pool();
        }
    }
}

impl Body for H1Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = std::task::ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &polled {
            Some(Ok(_)) if this.body.is_end_stream() => this.return_to_pool(),
            None => this.return_to_pool(),
            // A broken body's connection is not reused.
            Some(Err(_)) => this.back = None,
            Some(Ok(_)) => {}
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpBody::H1(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            UpBody::H2(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpBody::H1(b) => b.is_end_stream(),
            UpBody::H2(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpBody::H1(b) => b.size_hint(),
            UpBody::H2(b) => b.size_hint(),
        }
    }
}

/// A response body read from an HTTP/2 stream. Window is given back as data is taken, so the
/// peer's sending is paced by the reader downstream, not by what is buffered here.
pub struct H2Body {
    recv: h2::RecvStream,
    data_done: bool,
    /// What `content-length` says is still to come (h2 itself holds the peer to it).
    left: Option<u64>,
}

impl H2Body {
    pub fn new(recv: h2::RecvStream, length: Option<u64>) -> H2Body {
        H2Body {
            recv,
            data_done: false,
            left: length,
        }
    }
}

impl Body for H2Body {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if !this.data_done {
            match std::task::ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    if let Some(left) = this.left.as_mut() {
                        *left = left.saturating_sub(data.len() as u64);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => this.data_done = true,
            }
        }
        match std::task::ready!(this.recv.poll_trailers(cx)) {
            Ok(Some(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.left {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}
