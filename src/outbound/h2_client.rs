//! Upstream HTTP/2 connections, driven with the h2 crate directly (as ztunnel does).
//!
//! hyper's HTTP/2 client hands every request through a channel to the connection's task, and
//! spawns one more task per request to wait for the response and send it back through a
//! oneshot. Here the request's own future sends the head and waits for the response on the
//! stream; only a request that has a body gets a task, to pump the body while the response
//! comes back (the two directions are independent in HTTP/2).

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::http::body::ReqBody;
use crate::http::limits::{
    H2_CONNECTION_WINDOW, H2_KEEPALIVE, H2_MAX_FRAME, H2_MAX_HEADER_LIST, H2_STREAM_WINDOW,
};
use crate::http::server::Batched;
use crate::http::upstream_body::H2Body;

/// How long a keep-alive ping may wait for its pong before the connection is given up.
const PONG_TIMEOUT: Duration = Duration::from_secs(20);

/// A handle on one upstream HTTP/2 connection; clones share it.
#[derive(Clone)]
pub struct H2 {
    send: h2::client::SendRequest<Bytes>,
    closed: Arc<AtomicBool>,
}

/// Why a request did not get a response head.
pub enum H2SendError<B = ReqBody> {
    /// The connection could take no new stream; the request is untouched.
    NotSent(Box<Request<B>>),
    /// The stream was opened and then failed (refused, reset, or the connection broke).
    Failed(h2::Error),
}

impl H2 {
    /// The connection has ended; it takes no more requests.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Sends `req` and waits for the response head. The request body, when there is one, is
    /// sent by a task of its own, with the peer's flow control.
    pub async fn send<B>(
        &mut self,
        req: Box<Request<B>>,
    ) -> Result<Response<H2Body>, H2SendError<B>>
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: std::fmt::Display + Send,
    {
        if poll_fn(|cx| self.send.poll_ready(cx)).await.is_err() {
            return Err(H2SendError::NotSent(req));
        }
        let (parts, body) = (*req).into_parts();
        let end = body.is_end_stream();
        let head = Request::from_parts(parts, ());
        let (response, stream) = self
            .send
            .send_request(head, end)
            .map_err(H2SendError::Failed)?;
        // Abandoned before the response head (the client went away, or the first-byte timer
        // fired), the body's task ends and the stream is reset: a peer that never grants
        // window would otherwise keep the task, and the body it holds, for good.
        let pump = super::abandon::AbortUnlessAnswered(
            (!end).then(|| tokio::spawn(send_body(body, stream)).abort_handle()),
        );
        let resp = response.await.map_err(H2SendError::Failed)?;
        pump.answered();
        let length = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        Ok(resp.map(|recv| H2Body::new(recv, length)))
    }
}

/// Starts an HTTP/2 client connection on `io`, with Envoy's flow-control windows; `held` lives
/// as long as the connection. The connection pings every [`H2_KEEPALIVE`] and is closed when
/// a pong does not come back.
pub async fn handshake<T, G>(io: T, held: G) -> Result<H2, h2::Error>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    G: Send + 'static,
{
    let (send, mut conn) = h2::client::Builder::new()
        .initial_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .max_header_list_size(H2_MAX_HEADER_LIST)
        // No server push: the proxy has nowhere to send a pushed stream.
        .enable_push(false)
        .handshake::<_, Bytes>(io)
        .await?;
    let closed = Arc::new(AtomicBool::new(false));
    let ended = closed.clone();
    let pings = conn.ping_pong();
    tokio::spawn(async move {
        let keepalive = async move {
            let Some(mut pings) = pings else {
                return std::future::pending().await;
            };
            loop {
                tokio::time::sleep(H2_KEEPALIVE).await;
                let pong = pings.ping(h2::Ping::opaque());
                match tokio::time::timeout(PONG_TIMEOUT, pong).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(_)) => return,
                    Err(_) => {
                        tracing::debug!("upstream h2 connection: no pong in {PONG_TIMEOUT:?}");
                        return;
                    }
                }
            }
        };
        tokio::select! {
            r = Batched::new(&mut conn, None) => if let Err(e) = r {
                tracing::debug!("upstream h2 connection ended: {e}");
            },
            _ = keepalive => {}
        }
        ended.store(true, Ordering::Relaxed);
        drop(held);
    });
    Ok(H2 { send, closed })
}

/// Pumps a request body into its stream: data as the peer's window allows, then trailers or
/// the end of the stream. A body that fails resets the stream; a stream the peer reset stops
/// the pump (and drops the body, which tells the client's side).
async fn send_body<B>(mut body: B, mut stream: h2::SendStream<Bytes>)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    loop {
        let frame = poll_fn(|cx| {
            if let Poll::Ready(reset) = stream.poll_reset(cx) {
                return Poll::Ready(Err(reset.ok()));
            }
            Pin::new(&mut body).poll_frame(cx).map(Ok)
        })
        .await;
        let frame = match frame {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) => {
                tracing::debug!("request body failed: {e}");
                stream.send_reset(h2::Reason::INTERNAL_ERROR);
                return;
            }
            Ok(None) => {
                let _ = stream.send_data(Bytes::new(), true);
                return;
            }
            Err(reset) => {
                tracing::debug!(?reset, "upstream reset the stream while the body was sent");
                if reset == Some(h2::Reason::NO_ERROR) {
                    // The upstream answered in full and wants no more of the body (RFC 9113
                    // section 8.1). Dropping the body would reset the downstream stream at
                    // once, and that reset can overtake the response still on its way there
                    // (the client sees a reset, no answer); so the rest is read and dropped.
                    discard(body).await;
                }
                return;
            }
        };
        let frame = match frame.into_data() {
            Ok(mut data) => {
                while !data.is_empty() {
                    stream.reserve_capacity(data.len());
                    let granted = match poll_fn(|cx| stream.poll_capacity(cx)).await {
                        Some(Ok(n)) => n,
                        // The stream ended or the connection broke.
                        _ => return,
                    };
                    if granted == 0 {
                        continue;
                    }
                    let chunk = data.split_to(granted.min(data.len()));
                    let end = data.is_empty() && body.is_end_stream();
                    if stream.send_data(chunk, end).is_err() {
                        return;
                    }
                    if end {
                        return;
                    }
                }
                continue;
            }
            Err(frame) => frame,
        };
        if let Ok(trailers) = frame.into_trailers() {
            let _ = stream.send_trailers(trailers);
            return;
        }
    }
}

/// How much of a request body the upstream declined is read and dropped before the downstream
/// stream is reset after all: enough for the response to get ahead, not a whole upload.
const DISCARD_BYTES: usize = 1 << 20;
const DISCARD_TIME: Duration = Duration::from_secs(10);

async fn discard<B>(mut body: B)
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut left = DISCARD_BYTES;
    let _ = tokio::time::timeout(DISCARD_TIME, async {
        while let Some(Ok(frame)) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            let n = frame.data_ref().map_or(0, |d| d.len());
            match left.checked_sub(n) {
                Some(l) => left = l,
                None => return,
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};
    use hyper::body::Frame;
    use std::sync::atomic::AtomicUsize;
    use std::task::Context;
    use tokio::net::{TcpListener, TcpStream};

    /// An h2c server (hyper's) that answers with the request's body and, after it, the
    /// request's trailers plus `x-seen`; `x-ended-with-head` says whether the request's
    /// HEADERS frame carried END_STREAM; its stream window is small, so a body of any size
    /// has to wait for window updates.
    async fn echo_server(window: u32) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        |req: Request<hyper::body::Incoming>| async move {
                            let head_only = req.body().is_end_stream();
                            let collected = req.into_body().collect().await.unwrap();
                            let mut trailers = collected.trailers().cloned().unwrap_or_default();
                            trailers.insert("x-seen", http::HeaderValue::from_static("yes"));
                            let data = collected.to_bytes();
                            let frames = vec![
                                Ok::<_, std::convert::Infallible>(Frame::data(data)),
                                Ok(Frame::trailers(trailers)),
                            ];
                            let mut resp =
                                Response::new(StreamBody::new(futures_util::stream::iter(frames)));
                            let v = if head_only { "yes" } else { "no" };
                            resp.headers_mut()
                                .insert("x-ended-with-head", http::HeaderValue::from_static(v));
                            Ok::<_, std::convert::Infallible>(resp)
                        },
                    );
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .initial_stream_window_size(window)
                    .initial_connection_window_size(window)
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                    .await;
                });
            }
        });
        addr
    }

    async fn connect(addr: std::net::SocketAddr) -> H2 {
        handshake(TcpStream::connect(addr).await.unwrap(), ())
            .await
            .unwrap()
    }

    async fn exchange<B>(h2: &mut H2, body: B) -> Response<H2Body>
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: std::fmt::Display + Send,
    {
        match h2.send(request(body)).await {
            Ok(r) => r,
            Err(_) => panic!("the exchange must succeed"),
        }
    }

    fn request<B>(body: B) -> Box<Request<B>> {
        Box::new(
            Request::builder()
                .method("POST")
                .uri("http://app.test/echo")
                .body(body)
                .unwrap(),
        )
    }

    /// A body far larger than the peer's window arrives whole, in order, with its trailers;
    /// the response's own body and trailers come back through `H2Body`.
    #[tokio::test]
    async fn a_body_is_paced_by_the_peers_window_and_trailers_go_both_ways() {
        let mut h2 = connect(echo_server(1024).await).await;
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let chunks: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = payload
            .chunks(30_000)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .chain(std::iter::once(Ok(Frame::trailers(trailers))))
            .collect();
        let body = StreamBody::new(futures_util::stream::iter(chunks));
        let resp = exchange(&mut h2, body).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-ended-with-head"], "no");
        let got = resp.into_body().collect().await.unwrap();
        let t = got.trailers().cloned().expect("the response's trailers");
        assert_eq!(
            t["grpc-status"], "0",
            "the request's trailers reached the peer"
        );
        assert_eq!(t["x-seen"], "yes");
        assert_eq!(got.to_bytes(), Bytes::from(payload));
    }

    /// An upstream that answers without reading the body resets the stream with NO_ERROR
    /// (RFC 9113 section 8.1). The pump keeps reading the downstream body to its end instead of
    /// dropping it, since dropping it resets the downstream stream, which could overtake the
    /// response on its way there.
    #[tokio::test]
    async fn a_body_the_upstream_declined_is_read_to_its_end() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| {
                drop(req);
                async { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new()))) }
            });
            let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                .await;
        });
        let mut h2 = connect(addr).await;
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
        let chunks = futures_util::stream::unfold(rx, |mut rx| async move {
            let chunk = rx.recv().await?;
            Some((Ok::<_, std::convert::Infallible>(Frame::data(chunk)), rx))
        });
        tx.send(Bytes::from_static(b"first")).await.unwrap();
        let resp = exchange(&mut h2, StreamBody::new(Box::pin(chunks))).await;
        assert_eq!(resp.status(), 200);
        // Time for the upstream's reset to reach the pump.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for _ in 0..3 {
            let sent =
                tokio::time::timeout(Duration::from_secs(2), tx.send(Bytes::from_static(b"more")))
                    .await;
            assert!(
                matches!(sent, Ok(Ok(()))),
                "the rest of the body is still read after the upstream's NO_ERROR reset"
            );
        }
    }

    /// What is read of a declined body is bounded: at most `DISCARD_BYTES` (the chunk that
    /// crosses it is the last one pulled), so a client that keeps uploading cannot keep the
    /// task reading.
    #[tokio::test]
    async fn a_declined_body_is_read_for_a_mebibyte_at_most() {
        const CHUNK: usize = 64 * 1024;
        let pulled = Arc::new(AtomicUsize::new(0));
        let counter = pulled.clone();
        let endless = futures_util::stream::repeat_with(move || {
            counter.fetch_add(1, Ordering::Relaxed);
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(vec![0u8; CHUNK])))
        });
        tokio::time::timeout(Duration::from_secs(10), discard(StreamBody::new(endless)))
            .await
            .expect("an endless body is given up");
        assert_eq!(pulled.load(Ordering::Relaxed), DISCARD_BYTES / CHUNK + 1);
    }

    /// ... and in time: a body that stops sending is given up after `DISCARD_TIME`.
    #[tokio::test(start_paused = true)]
    async fn a_declined_body_that_stalls_is_given_up_in_time() {
        let stalled =
            futures_util::stream::pending::<Result<Frame<Bytes>, std::convert::Infallible>>();
        let start = tokio::time::Instant::now();
        discard(StreamBody::new(stalled)).await;
        let waited = start.elapsed();
        assert!(
            waited >= DISCARD_TIME && waited < DISCARD_TIME + Duration::from_secs(1),
            "{waited:?}"
        );
    }

    /// A request without a body goes out as one HEADERS frame with END_STREAM (no task, no
    /// empty DATA frame): the peer sees an empty body that is at its end.
    #[tokio::test]
    async fn a_bodyless_request_ends_with_its_head() {
        let mut h2 = connect(echo_server(65_535).await).await;
        let resp = exchange(&mut h2, http_body_util::Empty::<Bytes>::new()).await;
        assert_eq!(
            resp.headers()["x-ended-with-head"],
            "yes",
            "END_STREAM must be on the HEADERS frame"
        );
        let got = resp.into_body().collect().await.unwrap();
        assert!(got.to_bytes().is_empty());
    }

    /// When the peer goes away, the handle says so and a request on it is given back unsent.
    #[tokio::test]
    async fn a_closed_connection_is_seen_and_takes_no_request() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(tcp).await.unwrap();
            // Settle the handshake, then close the connection.
            conn.graceful_shutdown();
            while conn.accept().await.is_some() {}
        });
        let mut h2 = handshake(TcpStream::connect(addr).await.unwrap(), ())
            .await
            .unwrap();
        server.await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !h2.is_closed() {
            assert!(tokio::time::Instant::now() < deadline, "never seen closed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        match h2.send(request(Full::new(Bytes::from_static(b"x")))).await {
            Err(H2SendError::NotSent(r)) => assert_eq!(r.uri().path(), "/echo"),
            Err(H2SendError::Failed(e)) => panic!("must come back unsent, got {e}"),
            Ok(_) => panic!("a closed connection cannot answer"),
        }
    }

    /// Writes counted on their way to the socket.
    struct CountingIo {
        inner: TcpStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for CountingIo {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for CountingIo {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.writes.fetch_add(1, Ordering::Relaxed);
            Pin::new(&mut self.inner).poll_write(cx, buf)
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    /// Requests made at the same moment by different tasks share writes: the connection is
    /// polled after they all queued their heads, not once per head (tokio would run it right
    /// after the first, as the task that first woke it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn heads_queued_together_leave_in_one_write() {
        let addr = echo_server(65_535).await;
        let writes = Arc::new(AtomicUsize::new(0));
        let io = CountingIo {
            inner: TcpStream::connect(addr).await.unwrap(),
            writes: writes.clone(),
        };
        let h2 = handshake(io, ()).await.unwrap();
        // One exchange first, so the handshake's own writes are over.
        let mut first = h2.clone();
        let _ = first
            .send(request(http_body_util::Empty::<Bytes>::new()))
            .await;
        let before = writes.load(Ordering::Relaxed);
        let go = Arc::new(tokio::sync::Barrier::new(17));
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (mut h2, go) = (h2.clone(), go.clone());
            tasks.push(tokio::spawn(async move {
                go.wait().await;
                h2.send(request(http_body_util::Empty::<Bytes>::new()))
                    .await
                    .is_ok()
            }));
        }
        go.wait().await;
        for t in tasks {
            assert!(t.await.unwrap());
        }
        let used = writes.load(Ordering::Relaxed) - before;
        assert!(used <= 4, "16 request heads took {used} writes");
    }
}
