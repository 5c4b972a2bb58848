//! `Expect: 100-continue` relayed hop by hop (SPEC section 11): the client is told to send its
//! body when the app says so, not when a proxy first reads.
//!
//! hyper's HTTP/1.1 server writes `100 Continue` the first time the request body is polled.
//! So a request that expects one carries a closed [`ContinueGate`] in its body, and the body
//! is not read from the client until the gate opens: when the next hop's own `100` arrives
//! (hyper's client reports it through `on_informational`), or the next hop is HTTP/2, which
//! relays no `100` here, or [`crate::http::limits::EXPECT_CONTINUE_WAIT`] passes without an
//! answer (for apps that ignore the expectation, as curl does). A final answer that comes
//! first (e.g. 417) goes back with the body never read, and hyper then closes the client's
//! connection instead of reading a body nobody wants.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;
use http::{HeaderValue, Request, StatusCode, Version};

/// Opened once; the body waiting on it is woken.
#[derive(Default)]
pub struct ContinueGate {
    open: AtomicBool,
    waker: AtomicWaker,
}

impl ContinueGate {
    pub fn open(&self) {
        self.open.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// True for an HTTP/1.1 request that asks for `100 Continue` before its body. (HTTP/1.0 has
/// no 100, and hyper answers no expectation on HTTP/2.)
pub fn expects_continue<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req
            .headers()
            .get(http::header::EXPECT)
            .is_some_and(|v: &HeaderValue| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The body's side of a gate: whether the body may be read yet.
pub struct Held {
    gate: Arc<ContinueGate>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Held {
    pub fn new(gate: Arc<ContinueGate>) -> Held {
        Held { gate, wait: None }
    }

    pub fn gate(&self) -> &Arc<ContinueGate> {
        &self.gate
    }

    /// Ready once the gate is open or the wait has passed; the wait starts at the first poll,
    /// which is when the request has been sent on.
    pub fn poll_open(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.gate.waker.register(cx.waker());
        if self.gate.open.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        let wait = self.wait.get_or_insert_with(|| {
            Box::pin(tokio::time::sleep(
                crate::http::limits::EXPECT_CONTINUE_WAIT,
            ))
        });
        wait.as_mut().poll(cx)
    }
}

/// Before `req` goes to its next hop: the `gate` its body waits for, if any, is opened by that
/// hop's `100` (HTTP/1.1), or at once (HTTP/2).
pub fn arm<B>(req: &mut Request<B>, gate: Option<Arc<ContinueGate>>, to_h2: bool) {
    let Some(gate) = gate else {
        return;
    };
    if to_h2 {
        gate.open();
        return;
    }
    hyper::ext::on_informational(req, move |res| {
        if res.status() == StatusCode::CONTINUE {
            gate.open();
        }
    });
}
