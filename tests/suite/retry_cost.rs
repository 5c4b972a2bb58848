//! What being able to retry costs a request that is not retried: the allocations made for the
//! copy of a body-less request's head (and none for a request with a body), counted by a
//! counting allocator around `Resend::of` on requests hyper really parsed. Run with
//! `--nocapture` to see the figures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use crate::common::*;
use aether_proxy::http::body::ReqBody;
use aether_proxy::http::headers;
use aether_proxy::outbound::retry::Resend;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Counts the allocations of the current thread.
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

/// (allocations of the copy, whether a copy was made) for one request hyper parsed from `raw`.
async fn copy_cost(raw: &'static [u8]) -> (u64, bool) {
    let net = Net::fresh();
    let addr = std::net::SocketAddr::new(net.ip(3), 8080);
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Arc::new(std::sync::Mutex::new(Some(tx)));
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
            let tx = tx.clone();
            async move {
                let mut req = req.map(|b| ReqBody::from_peer(b, Arc::default()));
                // As the client proxy does before an attempt on an HTTP/2 connection.
                headers::strip_hop_by_hop(req.headers_mut());
                headers::retarget(&mut req, true, "payments.aether.internal").unwrap();
                let before = allocs();
                let copy = Resend::of(&req);
                let cost = allocs() - before;
                if let Some(tx) = tx.lock().unwrap().take() {
                    let _ = tx.send((cost, copy.is_some()));
                }
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<
                    bytes::Bytes,
                >::new()))
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(tcp), svc)
            .await;
    });
    let mut c = tcp_connect(addr).await.unwrap();
    c.write_all(raw).await.unwrap();
    let mut buf = [0u8; 256];
    let _ = within(IO_TIMEOUT, "response", c.read(&mut buf)).await;
    let r = within(IO_TIMEOUT, "the server's measure", rx)
        .await
        .unwrap()
        .unwrap();
    server.abort();
    r
}

#[tokio::test(flavor = "current_thread")]
async fn a_body_less_requests_copy_costs_a_few_allocations_a_bodied_one_none() {
    let (get, copied) = copy_cost(
        b"GET /orders/42?x=1 HTTP/1.1\r\nhost: payments.aether.internal\r\nuser-agent: curl/8.5.0\r\naccept: */*\r\nx-request-id: 7d1c2f6e-4f6b-4d0e-9a51-1f0c2b8e5a11\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\n",
    )
    .await;
    assert!(copied, "a GET without a body is copied");
    let (post, copied_post) = copy_cost(
        b"POST /orders HTTP/1.1\r\nhost: payments.aether.internal\r\ncontent-length: 5\r\n\r\nhello",
    )
    .await;
    assert!(!copied_post, "a request with a body is never copied");
    println!(
        "retry copy: GET with 5 headers: {get} allocations; POST with a body: {post}; \
         size of a request body: {} bytes (a peer's body alone: {})",
        std::mem::size_of::<ReqBody>(),
        std::mem::size_of::<aether_proxy::http::body::Metered<Incoming>>()
    );
    assert_eq!(
        post, 0,
        "nothing is allocated for a request that cannot be copied"
    );
    // Measured: 6 (the header map's two tables, and the URI's and header values' byte buffers
    // turning shared when first cloned).
    assert!(get <= 8, "the head copy allocates {get} times");
}
