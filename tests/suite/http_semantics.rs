//! SPEC section 11, second bullet: `Expect: 100-continue`, HTTP/1.0 requests, chunked bodies
//! with trailers across h1 <-> h2, and bodies of any size, through a client pod's sidecar and
//! the payments pod's sidecar to apps written here (raw sockets where the wire matters).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::mesh::rogue::{Misbehaviour, RoguePod};
use crate::common::mesh::*;
use crate::common::*;
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The payments pod's ports: 8080 `auto` to the ordinary recording app; 9001 `http1` to a raw
/// app that answers `Expect: 100-continue` itself; 9002 `h2` to an h2c trailers app; 9003
/// `http1` to an HTTP/1.1 trailers app; 9004 `http1` to the bulk app (1 GiB up and down);
/// 9005 `http1` to an app that streams an answer at the test's pace; 9006 `http1` to an app
/// that answers in HTTP/1.0.
const PORTS: [u16; 7] = [8080, 9001, 9002, 9003, 9004, 9005, 9006];

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

struct Mesh {
    client: Proxy,
    server: Proxy,
    app: HttpApp,
    cont: ContinueApp,
    h2_trailers: TrailersApp,
    h1_trailers: TrailersApp,
    _bulk: BulkApp,
    paced: PacedApp,
    http10: Http10App,
    _certs: Certs,
    client_pod: PodNet,
}

impl Mesh {
    async fn start() -> Mesh {
        let net = Net::fresh();
        let (client_pod, server_pod) = (net.pod(0), net.pod(1));
        let certs = certs();
        let app = HttpApp::auto(server_pod.app(8080)).await;
        let cont = ContinueApp::start(server_pod.app(9001)).await;
        let h2_trailers = TrailersApp::start(server_pod.app(9002), true).await;
        let h1_trailers = TrailersApp::start(server_pod.app(9003), false).await;
        let bulk = BulkApp::start(server_pod.app(9004)).await;
        let paced = PacedApp::start(server_pod.app(9005)).await;
        let http10 = Http10App::start(server_pod.app(9006)).await;
        let server = server_proxy(
            &certs,
            server_pod,
            "payments",
            &[
                "{ port: 8080, protocol: auto }",
                "{ port: 9001, protocol: http1 }",
                "{ port: 9002, protocol: h2 }",
                "{ port: 9003, protocol: http1 }",
                "{ port: 9004, protocol: http1 }",
                "{ port: 9005, protocol: http1 }",
                "{ port: 9006, protocol: http1 }",
            ],
        )
        .await;
        let cat = catalog(&[service(
            "payments",
            &certs.spiffe_id(PAYMENTS),
            "",
            &[endpoint(server_pod.proxy_ip(), &PORTS)],
        )]);
        let client = client_proxy(&certs, client_pod, &cat, "").await;
        Mesh {
            client,
            server,
            app,
            cont,
            h2_trailers,
            h1_trailers,
            _bulk: bulk,
            paced,
            http10,
            _certs: certs,
            client_pod,
        }
    }

    fn outbound(&self) -> SocketAddr {
        self.client_pod.outbound()
    }
}

/// Serves `svc` on every connection of `listener`: h2c only when `h2`, else HTTP/1.1 only.
fn serve<F, Fut>(listener: TcpListener, h2: bool, handler: F) -> tokio::task::JoinHandle<()>
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let handler = handler.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let h = handler.clone();
                    async move { Ok::<_, Infallible>(h(req).await) }
                });
                let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                b = if h2 { b.http2_only() } else { b.http1_only() };
                b.http1().max_headers(1024);
                let _ = b.serve_connection(TokioIo::new(tcp), svc).await;
            });
        }
    })
}

/// A body of `data` then, when not empty, `trailers`.
fn body_with_trailers(data: &'static [u8], trailers: HeaderMap) -> Body {
    let mut frames = vec![Ok::<_, Infallible>(Frame::data(Bytes::from_static(data)))];
    if !trailers.is_empty() {
        frames.push(Ok(Frame::trailers(trailers)));
    }
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

/// `req` over a new h2c connection to the client proxy; the whole 200 answer, trailers
/// included.
async fn h2_call(m: &Mesh, req: Request<Body>) -> http_body_util::Collected<Bytes> {
    let tcp = tcp_connect(m.outbound()).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let resp = within(IO_TIMEOUT, "h2 request", send.send_request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    within(IO_TIMEOUT, "h2 body", resp.into_body().collect())
        .await
        .unwrap()
        .unwrap()
}

fn header_map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, v.parse().unwrap());
    }
    h
}

// ---------------------------------------------------------------------------------------------
// Expect: 100-continue
// ---------------------------------------------------------------------------------------------

/// A raw HTTP/1.1 app that answers `Expect: 100-continue` itself: to `/accept` it waits
/// 300 ms, sends `100 Continue`, reads the body and answers `got <n>`; to `/refuse` it answers
/// 417 at once and closes without reading the body; to `/ignore` it sends no 100 and reads the
/// body. It records when it sent each 100 and how
/// many body bytes ever reached it.
struct ContinueApp {
    sent_100: Arc<Mutex<Vec<Instant>>>,
    body_bytes: Arc<AtomicU64>,
    _task: tokio::task::JoinHandle<()>,
}

const CONTINUE_DELAY: Duration = Duration::from_millis(300);

impl ContinueApp {
    async fn start(addr: SocketAddr) -> ContinueApp {
        let listener = TcpListener::bind(addr).await.unwrap();
        let sent_100 = Arc::new(Mutex::new(Vec::new()));
        let body_bytes = Arc::new(AtomicU64::new(0));
        let (sent, bytes) = (sent_100.clone(), body_bytes.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (sent, bytes) = (sent.clone(), bytes.clone());
                tokio::spawn(async move {
                    let _ = continue_conn(tcp, &sent, &bytes).await;
                });
            }
        });
        ContinueApp {
            sent_100,
            body_bytes,
            _task: task,
        }
    }

    /// When the app sent its first 100; fails the test if it sent none.
    fn first_100(&self) -> Instant {
        *self
            .sent_100
            .lock()
            .unwrap()
            .first()
            .expect("the app sent its 100")
    }
}

/// After the 100: sends the 5-byte body and reads the app's `got 5`.
async fn send_body_and_read_got_5(s: &mut TcpStream) {
    s.write_all(b"hello").await.unwrap();
    let head = read_head(s).await.unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(read_body(s, &head).await, b"got 5");
}

async fn continue_conn(
    mut s: TcpStream,
    sent: &Mutex<Vec<Instant>>,
    bytes: &AtomicU64,
) -> std::io::Result<()> {
    let head = read_request_head(&mut s).await?;
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    if head.starts_with("POST /refuse") {
        s.write_all(
            b"HTTP/1.1 417 Expectation Failed\r\ncontent-length: 7\r\nconnection: close\r\n\r\nrefused",
        )
        .await?;
        // Whatever arrives after the refusal is a body the client should not have sent.
        let (rest, _) = read_to_end_within(&mut s, Duration::from_millis(500)).await;
        bytes.fetch_add(rest.len() as u64, Ordering::SeqCst);
        return Ok(());
    }
    // `/ignore`: an app that never answers the expectation and just reads the body.
    if !head.starts_with("POST /ignore") {
        tokio::time::sleep(CONTINUE_DELAY).await;
        s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
        sent.lock().unwrap().push(Instant::now());
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    bytes.fetch_add(len as u64, Ordering::SeqCst);
    let answer = format!("got {len}");
    let resp = format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
        answer.len()
    );
    s.write_all(resp.as_bytes()).await?;
    Ok(())
}

/// Reads a request head byte by byte (nothing after it is consumed).
async fn read_request_head(s: &mut TcpStream) -> std::io::Result<String> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.push(b[0]);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

fn expect_request(path: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {SVC}:9001\r\nContent-Length: {len}\r\nExpect: 100-continue\r\n\r\n"
    )
}

#[tokio::test]
async fn expect_continue_waits_for_the_apps_100() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let started = Instant::now();
    s.write_all(expect_request("/accept", 5).as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut s).await.unwrap();
    let got_100 = Instant::now();
    assert_eq!(head.status, 100, "the client's first answer is the 100");
    let app_sent = m.cont.first_100();
    assert!(
        got_100 >= app_sent && got_100 - started >= CONTINUE_DELAY,
        "the client saw a 100 {:?} after sending, before the app's (sent {:?} after)",
        got_100 - started,
        app_sent.saturating_duration_since(started)
    );
    send_body_and_read_got_5(&mut s).await;
    assert_eq!(m.cont.body_bytes.load(Ordering::SeqCst), 5);
}

/// With `Connection: close` the proxy writes that connection's answers held for the FIN
/// (`http::fin`); the interim 100 is not the last of them, so it must still leave as soon as
/// it is written, not on the kernel's timer (200 ms or more on loopback).
#[tokio::test]
async fn expect_continue_on_a_closing_connection_passes_the_100_on_at_once() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let req = expect_request("/accept", 5).replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    let got_100 = Instant::now();
    assert_eq!(head.status, 100, "the client's first answer is the 100");
    let app_sent = m.cont.first_100();
    let late = got_100.saturating_duration_since(app_sent);
    assert!(
        late < Duration::from_millis(100),
        "the 100 reached the client {late:?} after the app sent it"
    );
    send_body_and_read_got_5(&mut s).await;
    let (_, end) = read_to_end_within(&mut s, IO_TIMEOUT).await;
    assert_eq!(end, ReadEnd::Eof, "the connection closes after the answer");
}

#[tokio::test]
async fn expect_continue_to_an_app_that_ignores_it_sends_the_body_after_a_wait() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let started = Instant::now();
    s.write_all(expect_request("/ignore", 5).as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 100, "a 100 once the proxies stop waiting");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "the 100 came after {waited:?}"
    );
    send_body_and_read_got_5(&mut s).await;
    assert!(m.cont.sent_100.lock().unwrap().is_empty());
}

#[tokio::test]
async fn expect_continue_refused_by_the_app_reaches_the_client_without_the_body() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    s.write_all(expect_request("/refuse", 1_000_000).as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(
        head.status, 417,
        "the app's refusal is the first answer, no 100 from a proxy"
    );
    assert_eq!(read_body(&mut s, &head).await, b"refused");
    // Give a wrongly sent body time to arrive at the app.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        m.cont.body_bytes.load(Ordering::SeqCst),
        0,
        "the body went to the app"
    );
    assert!(m.cont.sent_100.lock().unwrap().is_empty());
}

// ---------------------------------------------------------------------------------------------
// HTTP/1.0
// ---------------------------------------------------------------------------------------------

/// Asserts that no chunked encoding went to an HTTP/1.0 client.
fn assert_http10_framing(head: &RawHead, what: &str) {
    assert!(
        !head
            .header("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked")),
        "{what}: chunked to an HTTP/1.0 client: {:?}",
        head.headers
    );
}

#[tokio::test]
async fn http10_without_keep_alive_gets_a_whole_response_and_a_close() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let req = format!("GET /ten HTTP/1.0\r\nHost: {SVC}:8080\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200);
    assert_http10_framing(&head, "app with a length");
    let (rest, end) = read_to_end_within(&mut s, IO_TIMEOUT).await;
    assert_eq!(
        end,
        ReadEnd::Eof,
        "the connection closes after the response"
    );
    let len: usize = head
        .header("content-length")
        .expect("content-length")
        .parse()
        .unwrap();
    assert_eq!(rest.len(), len, "the body is exactly content-length long");
    let v: serde_json::Value = serde_json::from_slice(&rest).unwrap();
    assert_eq!(v["uri"], "/ten");
    assert_eq!(m.app.seen().len(), 1);
}

#[tokio::test]
async fn http10_with_keep_alive_stays_open() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    for path in ["/one", "/two"] {
        let req =
            format!("GET {path} HTTP/1.0\r\nHost: {SVC}:8080\r\nConnection: keep-alive\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let head = read_head(&mut s).await.unwrap();
        assert_eq!(head.status, 200, "{path}");
        assert_http10_framing(&head, path);
        let body = read_body(&mut s, &head).await;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["uri"], path);
    }
    assert_eq!(paths(&m.app), ["/one", "/two"]);
}

#[tokio::test]
async fn http10_gets_a_streamed_response_close_delimited() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    // The HTTP/1.1 app answers this one chunked, with no length.
    let req = format!("GET /stream HTTP/1.0\r\nHost: {SVC}:9003\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200);
    assert_http10_framing(&head, "streamed answer");
    let (rest, end) = read_to_end_within(&mut s, IO_TIMEOUT).await;
    assert_eq!(end, ReadEnd::Eof, "a close ends the body");
    assert_eq!(rest, STREAMED);
}

/// A raw app that speaks HTTP/1.0, as Python's `http.server` does: each answer has an
/// `HTTP/1.0` status line and the connection closes after it. `/length` is answered with a
/// `Content-Length`, anything else without one (the close ends the body).
struct Http10App {
    connections: Arc<AtomicU64>,
    _task: tokio::task::JoinHandle<()>,
}

const HTTP10_BODY: &[u8] = b"an answer from an HTTP/1.0 app";

impl Http10App {
    async fn start(addr: SocketAddr) -> Http10App {
        let listener = TcpListener::bind(addr).await.unwrap();
        let connections = Arc::new(AtomicU64::new(0));
        let counted = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let head = read_request_head(&mut tcp).await?;
                    let length = if head.starts_with("GET /length ") {
                        format!("Content-Length: {}\r\n", HTTP10_BODY.len())
                    } else {
                        String::new()
                    };
                    let answer =
                        format!("HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n{length}\r\n");
                    tcp.write_all(answer.as_bytes()).await?;
                    tcp.write_all(HTTP10_BODY).await?;
                    tcp.shutdown().await
                });
            }
        });
        Http10App {
            connections,
            _task: task,
        }
    }
}

/// GETs `path` of the service's `port` on `s`, an HTTP/1.1 client connection to the client
/// sidecar, and checks the answer's head: 200, in HTTP/1.1. Each proxy answers in its own
/// version; an HTTP/1.0 status line would end the client's connection after this answer.
async fn get_answered_in_http11(s: &mut TcpStream, path: &str, port: u16) -> RawHead {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {SVC}:{port}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(s).await.unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(head.status, 200, "{path}");
    assert_eq!(head.version, "HTTP/1.1", "{path}: {:?}", head.headers);
    head
}

#[tokio::test]
async fn an_http10_apps_answers_reach_an_http11_client_in_http11_on_one_connection() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    for path in ["/length", "/close-delimited"] {
        let head = get_answered_in_http11(&mut s, path, 9006).await;
        let body = if head.header("content-length").is_some() {
            read_body(&mut s, &head).await
        } else {
            assert_eq!(head.header("transfer-encoding"), Some("chunked"), "{path}");
            read_chunked(&mut s).await.0
        };
        assert_eq!(body, HTTP10_BODY, "{path}");
    }
    // The app closed after each answer; the sidecars' mTLS connection stayed open.
    assert_eq!(m.http10.connections.load(Ordering::Relaxed), 2);
    let handshakes = r#"aether_tls_handshakes_total{listener="inbound",result="ok"}"#;
    assert_eq!(inbound::series_or_zero(&m.server, handshakes).await, 1);
}

/// The client sidecar's own part of the same: its peer on the mTLS hop (no aether-proxy)
/// answers in HTTP/1.0 and closes, and the app's client still gets HTTP/1.1 on one connection.
#[tokio::test]
async fn a_peer_answering_in_http10_reaches_an_http11_client_in_http11() {
    let net = Net::fresh();
    let certs = certs();
    let (client_pod, peer) = (net.pod(0), net.pod(1));
    let rogue = RoguePod::start(&certs, peer.inbound(), Misbehaviour::H1AnswerInHttp10).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(peer.proxy_ip(), &[8080])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let mut s = tcp_connect(client_pod.outbound()).await.unwrap();
    for path in ["/one", "/two"] {
        let head = get_answered_in_http11(&mut s, path, 8080).await;
        assert_eq!(read_body(&mut s, &head).await, b"ok", "{path}");
    }
    assert_eq!(rogue.requests(), 2);
}

// ---------------------------------------------------------------------------------------------
// The last response of a connection (`Connection: close`)
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_last_response_leaves_in_one_segment_with_the_fin() {
    let m = Mesh::start().await;
    let segments = LoopbackSegments::from(m.outbound());
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let me = s.local_addr().unwrap();
    let req = format!("GET /last HTTP/1.1\r\nHost: {SVC}:8080\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let (got, end) = read_to_end_within(&mut s, IO_TIMEOUT).await;
    assert_eq!(end, ReadEnd::Eof);
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    let segs = segments.to_fin(me, Duration::from_secs(2));
    let fin = segs.last().filter(|s| s.fin).copied();
    let fin = fin.unwrap_or_else(|| panic!("no FIN among the proxy's segments: {segs:?}"));
    let sent: usize = segs.iter().map(|s| s.payload).sum();
    assert_eq!(
        sent,
        got.len(),
        "every byte read was seen leaving: {segs:?}"
    );
    // One segment fewer per such request (and, captured, one fewer through NAT).
    assert!(
        fin.payload > 0,
        "the response's last bytes leave with the FIN, not before it: {segs:?}"
    );
}

#[tokio::test]
async fn a_last_response_that_streams_is_not_held_back_for_the_fin() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let req = format!("GET /paced HTTP/1.1\r\nHost: {SVC}:9005\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200);
    let mut got = Vec::new();
    let mut waits = Vec::new();
    let mut buf = [0u8; 4096];
    for i in 0..PACED_PARTS {
        let asked = Instant::now();
        m.paced.next();
        let part = format!("part-{i}");
        while !String::from_utf8_lossy(&got).contains(&part) {
            let n = tokio::time::timeout(IO_TIMEOUT, s.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("{part} never arrived"))
                .unwrap();
            assert!(n > 0, "closed before {part}");
            got.extend_from_slice(&buf[..n]);
        }
        waits.push(asked.elapsed());
    }
    m.paced.next();
    let (rest, end) = read_to_end_within(&mut s, IO_TIMEOUT).await;
    assert_eq!(
        end,
        ReadEnd::Eof,
        "the connection closes after the last part"
    );
    got.extend_from_slice(&rest);
    assert!(
        got.ends_with(b"0\r\n\r\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    // A part held back until the kernel's own timer would take 200 ms or more (its floor on
    // loopback); the fastest of three shows whether each leaves when written.
    let fastest = waits.iter().min().unwrap();
    assert!(
        *fastest < Duration::from_millis(100),
        "each part reaches the client when the app sends it: {waits:?}"
    );
}

const PACED_PARTS: usize = 3;

/// A raw HTTP/1.1 app that answers every request chunked, `part-0`, `part-1`, `part-2` and
/// the last chunk, each sent when the test calls [`PacedApp::next`].
struct PacedApp {
    go: Arc<tokio::sync::Notify>,
    _task: tokio::task::JoinHandle<()>,
}

impl PacedApp {
    async fn start(addr: SocketAddr) -> PacedApp {
        let listener = TcpListener::bind(addr).await.unwrap();
        let go = Arc::new(tokio::sync::Notify::new());
        let go2 = go.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let go = go2.clone();
                tokio::spawn(async move {
                    read_request_head(&mut tcp).await?;
                    tcp.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                        .await?;
                    for i in 0..PACED_PARTS {
                        go.notified().await;
                        tcp.write_all(format!("6\r\npart-{i}\r\n").as_bytes())
                            .await?;
                    }
                    go.notified().await;
                    tcp.write_all(b"0\r\n\r\n").await?;
                    std::io::Result::Ok(())
                });
            }
        });
        PacedApp { go, _task: task }
    }

    fn next(&self) {
        self.go.notify_one();
    }
}

// ---------------------------------------------------------------------------------------------
// Chunked bodies and trailers across h1 <-> h2
// ---------------------------------------------------------------------------------------------

/// A request body an app read, and its trailers.
type BodySeen = (Bytes, Option<HeaderMap>);

const STREAMED: &[u8] = b"first part, second part";

/// An app (h2c or HTTP/1.1) that records each request's body and trailers. It answers
/// `/stream` with a streamed body and no trailers; `/grpc` gRPC-style (`application/grpc`,
/// `grpc-status` and `grpc-message` trailers, undeclared as gRPC servers do); anything else
/// with `pong` and an `x-checksum` trailer, declared in a `Trailer` header.
struct TrailersApp {
    seen: Arc<Mutex<Vec<BodySeen>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl TrailersApp {
    async fn start(addr: SocketAddr, h2: bool) -> TrailersApp {
        let listener = TcpListener::bind(addr).await.unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let rec = seen.clone();
        let task = serve(listener, h2, move |req: Request<Incoming>| {
            let rec = rec.clone();
            async move {
                let path = req.uri().path().to_string();
                let collected = req.into_body().collect().await;
                if let Ok(c) = collected {
                    let trailers = c.trailers().cloned();
                    rec.lock().unwrap().push((c.to_bytes(), trailers));
                }
                let resp = Response::builder();
                match path.as_str() {
                    "/stream" => {
                        let frames = [&STREAMED[..11], &STREAMED[11..]]
                            .map(|b| Ok(Frame::data(Bytes::from_static(b))));
                        resp.body(StreamBody::new(futures_util::stream::iter(frames)).boxed())
                    }
                    "/grpc" => {
                        resp.header("content-type", "application/grpc")
                            .body(body_with_trailers(
                                b"\0\0\0\0\0",
                                header_map(&[("grpc-status", "0"), ("grpc-message", "fine")]),
                            ))
                    }
                    _ => resp
                        .header("trailer", "x-checksum")
                        .body(body_with_trailers(
                            b"pong",
                            header_map(&[("x-checksum", "c0ffee")]),
                        )),
                }
                .unwrap()
            }
        });
        TrailersApp { seen, _task: task }
    }

    fn last(&self) -> (Bytes, Option<HeaderMap>) {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the app saw a request")
    }
}

/// A chunked HTTP/1.1 request with a trailer, written by hand; `extra` are more header lines.
fn chunked_request(port: u16, path: &str, extra: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {SVC}:{port}\r\nTransfer-Encoding: chunked\r\n\
         Trailer: x-sum\r\n{extra}\r\n\
         5\r\nhello\r\n6\r\n world\r\n0\r\nx-sum: 42\r\n\r\n"
    )
}

/// Reads a chunked body after [`read_head`]: the data and the trailer lines (lowercased names).
async fn read_chunked(s: &mut TcpStream) -> (Vec<u8>, Vec<(String, String)>) {
    let read = async {
        let mut data = Vec::new();
        loop {
            let line = read_line(s).await;
            let size = usize::from_str_radix(line.split(';').next().unwrap().trim(), 16)
                .unwrap_or_else(|_| panic!("bad chunk size line {line:?}"));
            if size == 0 {
                break;
            }
            let mut chunk = vec![0u8; size + 2];
            s.read_exact(&mut chunk).await.unwrap();
            data.extend_from_slice(&chunk[..size]);
        }
        let mut trailers = Vec::new();
        loop {
            let line = read_line(s).await;
            if line.is_empty() {
                break;
            }
            let (k, v) = line.split_once(':').expect("a trailer line");
            trailers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
        (data, trailers)
    };
    within(IO_TIMEOUT, "chunked body", read).await.unwrap()
}

async fn read_line(s: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        assert_ne!(s.read(&mut b).await.unwrap(), 0, "EOF in a chunked body");
        line.push(b[0]);
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).unwrap()
}

#[tokio::test]
async fn h1_chunked_request_trailers_reach_an_h2_app_and_its_trailers_come_back() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let req = chunked_request(9002, "/up", "TE: trailers\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(head.header("transfer-encoding"), Some("chunked"));
    let (data, trailers) = read_chunked(&mut s).await;
    assert_eq!(data, b"pong");
    assert_eq!(trailers, [("x-checksum".to_string(), "c0ffee".to_string())]);
    let (body, app_trailers) = m.h2_trailers.last();
    assert_eq!(&body[..], b"hello world");
    let app_trailers = app_trailers.expect("the h2 app got trailers");
    assert_eq!(app_trailers.get("x-sum").unwrap(), "42");
}

#[tokio::test]
async fn grpc_style_trailers_from_an_h2_app_reach_an_h1_client_that_asked() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let req = chunked_request(
        9002,
        "/grpc",
        "TE: trailers\r\nContent-Type: application/grpc\r\n",
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200);
    let (data, trailers) = read_chunked(&mut s).await;
    assert_eq!(data, b"\0\0\0\0\0");
    let get = |n: &str| {
        trailers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get("grpc-status"), Some("0"), "trailers {trailers:?}");
    assert_eq!(get("grpc-message"), Some("fine"), "trailers {trailers:?}");
}

#[tokio::test]
async fn grpc_style_trailers_cross_h2_end_to_end() {
    let m = Mesh::start().await;
    let req = Request::post(format!("http://{SVC}:9002/grpc"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body_with_trailers(
            b"\0\0\0\0\x01x",
            header_map(&[("x-client-trailer", "yes")]),
        ))
        .unwrap();
    let c = h2_call(&m, req).await;
    let t = c.trailers().cloned().expect("response trailers");
    assert_eq!(t.get("grpc-status").unwrap(), "0");
    assert_eq!(t.get("grpc-message").unwrap(), "fine");
    let (body, app_trailers) = m.h2_trailers.last();
    assert_eq!(&body[..], b"\0\0\0\0\x01x");
    assert_eq!(
        app_trailers
            .expect("the app got trailers")
            .get("x-client-trailer")
            .unwrap(),
        "yes"
    );
}

#[tokio::test]
async fn h2_client_trailers_reach_an_h1_app_and_its_chunked_trailers_come_back() {
    let m = Mesh::start().await;
    // The h2 client declares its trailer, which the HTTP/1.1 hops need to write it.
    let req = Request::post(format!("http://{SVC}:9003/up"))
        .header("te", "trailers")
        .header("trailer", "x-sum")
        .body(body_with_trailers(
            b"hello world",
            header_map(&[("x-sum", "42")]),
        ))
        .unwrap();
    let c = h2_call(&m, req).await;
    let t = c.trailers().cloned().expect("the h1 app's trailers");
    assert_eq!(t.get("x-checksum").unwrap(), "c0ffee");
    assert_eq!(&c.to_bytes()[..], b"pong");
    let (body, app_trailers) = m.h1_trailers.last();
    assert_eq!(&body[..], b"hello world");
    assert_eq!(
        app_trailers
            .expect("the h1 app got trailers")
            .get("x-sum")
            .unwrap(),
        "42"
    );
}

#[tokio::test]
async fn h1_chunked_trailers_cross_h1_hops() {
    let m = Mesh::start().await;
    let mut s = tcp_connect(m.outbound()).await.unwrap();
    let req = chunked_request(9003, "/up", "TE: trailers\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200);
    let (data, trailers) = read_chunked(&mut s).await;
    assert_eq!(data, b"pong");
    assert_eq!(trailers, [("x-checksum".to_string(), "c0ffee".to_string())]);
    let (body, app_trailers) = m.h1_trailers.last();
    assert_eq!(&body[..], b"hello world");
    assert_eq!(
        app_trailers
            .expect("the h1 app got trailers")
            .get("x-sum")
            .unwrap(),
        "42"
    );
}

// ---------------------------------------------------------------------------------------------
// 1 GiB up and down with flat memory
// ---------------------------------------------------------------------------------------------

const GIB: u64 = 1 << 30;
const CHUNK: usize = 64 * 1024;
/// How much either proxy's resident memory may grow while 1 GiB streams through it.
const RSS_GROWTH_LIMIT_KIB: u64 = 64 * 1024;
const BULK_TIMEOUT: Duration = Duration::from_secs(180);

/// An HTTP/1.1 app: `POST /upload` counts the body's bytes and answers the count; `GET
/// /download` streams 1 GiB made on the fly.
struct BulkApp {
    _task: tokio::task::JoinHandle<()>,
}

impl BulkApp {
    async fn start(addr: SocketAddr) -> BulkApp {
        let listener = TcpListener::bind(addr).await.unwrap();
        let task = serve(listener, false, |req: Request<Incoming>| async move {
            if req.uri().path() == "/download" {
                return Response::new(gib_body());
            }
            let mut body = req.into_body();
            let mut n = 0u64;
            while let Some(Ok(f)) = body.frame().await {
                if let Some(d) = f.data_ref() {
                    n += d.len() as u64;
                }
            }
            Response::new(http_body_util::Full::new(Bytes::from(n.to_string())).boxed())
        });
        BulkApp { _task: task }
    }
}

/// 1 GiB in 64 KiB frames of one shared buffer, with its length declared.
fn gib_body() -> Body {
    let chunk = Bytes::from(vec![b'x'; CHUNK]);
    let frames = (0..GIB / CHUNK as u64).map(move |_| Ok(Frame::data(chunk.clone())));
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

/// Samples both proxies' RSS every 100 ms until `stop`; returns the highest of each.
fn sample_rss(m: &Mesh, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(u64, u64)> {
    let pids = (m.client.pid().unwrap(), m.server.pid().unwrap());
    tokio::spawn(async move {
        let (mut c, mut s) = (0, 0);
        while !stop.load(Ordering::SeqCst) {
            c = c.max(rss_kib_of(pids.0).unwrap_or(0));
            s = s.max(rss_kib_of(pids.1).unwrap_or(0));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (c, s)
    })
}

async fn bulk_client(m: &Mesh) -> hyper::client::conn::http1::SendRequest<Body> {
    let tcp = tcp_connect(m.outbound()).await.unwrap();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    send
}

/// Runs `transfer` while sampling; asserts both proxies' RSS grew less than the limit.
async fn with_flat_memory<F: std::future::Future<Output = ()>>(m: &Mesh, what: &str, transfer: F) {
    // A warm-up request so both proxies have their connections and buffers before the baseline.
    let r = get_h1(m.outbound(), &format!("{SVC}:8080"), "/warm").await;
    assert_eq!(r.status, 200);
    let base = (m.client.rss_kib(), m.server.rss_kib());
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_rss(m, stop.clone());
    let started = Instant::now();
    within(BULK_TIMEOUT, what, transfer).await.unwrap();
    let took = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let (c, s) = sampler.await.unwrap();
    eprintln!(
        "{what}: 1 GiB in {took:?}; client proxy RSS {} -> max {} KiB, server proxy {} -> max {} KiB",
        base.0, c, base.1, s
    );
    assert!(
        c.saturating_sub(base.0) < RSS_GROWTH_LIMIT_KIB,
        "{what}: the client proxy grew from {} to {c} KiB",
        base.0
    );
    assert!(
        s.saturating_sub(base.1) < RSS_GROWTH_LIMIT_KIB,
        "{what}: the server proxy grew from {} to {s} KiB",
        base.1
    );
}

#[tokio::test]
async fn one_gib_upload_streams_with_flat_memory() {
    let m = Mesh::start().await;
    let mut send = bulk_client(&m).await;
    with_flat_memory(&m, "upload", async {
        let req = Request::post("/upload")
            .header("host", format!("{SVC}:9004"))
            .header("content-length", GIB.to_string())
            .body(gib_body())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, GIB.to_string(), "the app counted every byte");
    })
    .await;
}

#[tokio::test]
async fn one_gib_download_streams_with_flat_memory() {
    let m = Mesh::start().await;
    let mut send = bulk_client(&m).await;
    with_flat_memory(&m, "download", async {
        let req = Request::get("/download")
            .header("host", format!("{SVC}:9004"))
            .body(http_body_util::Empty::new().boxed())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut n = 0u64;
        while let Some(f) = body.frame().await {
            if let Some(d) = f.unwrap().data_ref() {
                n += d.len() as u64;
            }
        }
        assert_eq!(n, GIB, "every byte arrived");
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Framing (SPEC 11): never ambiguous, never silently altered
// ---------------------------------------------------------------------------------------------

/// One row of the framing table: a raw HTTP/1.1 request and what must come of it.
struct Case {
    name: &'static str,
    /// Method and target.
    line: &'static str,
    /// Header fields after `Host`, each ending in CRLF.
    fields: &'static str,
    body: &'static [u8],
    /// Status and `x-aether-error` (None: the app's own answer).
    answer: (u16, Option<&'static str>),
    /// The connection closes after the answer.
    closes: bool,
    /// The exact bytes the app read (`{host}` stands for the authority), apart from the three
    /// fields the sidecars add, which [`sidecar_fields`] checks and takes out; None: the app read
    /// no whole request.
    app: Option<&'static str>,
}

const CHUNKED_HELLO: &[u8] = b"5\r\nhello\r\n0\r\n\r\n";
/// `hello` as the sidecars send it on: the coding field, then one chunk.
const CHUNKED_TAIL: &str = "transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";

const FRAMING: &[Case] = &[
    Case {
        name: "Content-Length then Transfer-Encoding",
        line: "POST /cl-te",
        fields: "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        body: CHUNKED_HELLO,
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "Transfer-Encoding then Content-Length",
        line: "POST /te-cl",
        fields: "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        body: CHUNKED_HELLO,
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "two equal Content-Length fields",
        line: "POST /cl-cl",
        fields: "Content-Length: 5\r\nContent-Length: 5\r\n",
        body: b"hello",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "gzip, chunked",
        line: "POST /gzip",
        fields: "Transfer-Encoding: gzip, chunked\r\n",
        body: CHUNKED_HELLO,
        answer: (501, Some("unsupported-transfer-coding")),
        closes: true,
        app: None,
    },
    Case {
        name: "identity, chunked",
        line: "POST /identity",
        fields: "Transfer-Encoding: identity, chunked\r\n",
        body: CHUNKED_HELLO,
        answer: (501, Some("unsupported-transfer-coding")),
        closes: true,
        app: None,
    },
    Case {
        name: "gzip and chunked in two fields",
        line: "POST /two-te",
        fields: "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
        body: CHUNKED_HELLO,
        answer: (501, Some("unsupported-transfer-coding")),
        closes: true,
        app: None,
    },
    Case {
        name: "obs-fold",
        line: "GET /obs-fold",
        fields: "X-A: a\r\n b\r\n",
        body: b"",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "a bare CR in a value",
        line: "GET /bare-cr",
        fields: "X-A: a\rb\r\n",
        body: b"",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "a NUL in a value",
        line: "GET /nul",
        fields: "X-A: a\0b\r\n",
        body: b"",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "a request target of 70 KB",
        line: "GET /{long}",
        fields: "",
        body: b"",
        answer: (414, Some("uri-too-long")),
        closes: true,
        app: None,
    },
    Case {
        name: "leading zeros in a chunk size",
        line: "POST /zeros",
        fields: "Transfer-Encoding: chunked\r\n",
        body: b"0005\r\nhello\r\n0\r\n\r\n",
        answer: (200, None),
        closes: false,
        app: Some("POST /zeros HTTP/1.1\r\nhost: {host}\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
    },
    Case {
        name: "an absolute-form target",
        line: "GET http://{host}/absolute",
        fields: "",
        body: b"",
        answer: (200, None),
        closes: false,
        app: Some("GET /absolute HTTP/1.1\r\nhost: {host}\r\n\r\n"),
    },
    Case {
        name: "a websocket upgrade the app answers 426",
        line: "GET /ws-426",
        fields: "Connection: Upgrade\r\nUpgrade: websocket\r\nx-app-status: 426\r\n",
        body: b"",
        answer: (426, None),
        closes: false,
        app: Some("GET /ws-426 HTTP/1.1\r\nhost: {host}\r\nx-app-status: 426\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"),
    },
    Case {
        name: "a DEL byte in a value",
        line: "GET /del",
        fields: "X-A: a\x7fb\r\n",
        body: b"",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "a GET with a chunked body keeps it",
        line: "GET /get-body",
        fields: "Transfer-Encoding: chunked\r\n",
        body: CHUNKED_HELLO,
        answer: (200, None),
        closes: false,
        app: Some("GET /get-body HTTP/1.1\r\nhost: {host}\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
    },
    Case {
        name: "a GET with a length keeps its body",
        line: "GET /get-length",
        fields: "Content-Length: 5\r\n",
        body: b"hello",
        answer: (200, None),
        closes: false,
        app: Some("GET /get-length HTTP/1.1\r\nhost: {host}\r\ncontent-length: 5\r\n\r\nhello"),
    },
    Case {
        name: "a chunk extension",
        line: "POST /ext",
        fields: "Transfer-Encoding: chunked\r\n",
        body: b"5;name=value\r\nhello\r\n0\r\n\r\n",
        answer: (200, None),
        closes: false,
        app: Some("POST /ext HTTP/1.1\r\nhost: {host}\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
    },
    Case {
        name: "an upper-case chunk size and an undeclared trailer (dropped, as Envoy does)",
        line: "POST /trailer",
        fields: "Transfer-Encoding: chunked\r\n",
        body: b"A\r\n0123456789\r\n0\r\nx-t: 1\r\n\r\n",
        answer: (200, None),
        closes: false,
        app: Some("POST /trailer HTTP/1.1\r\nhost: {host}\r\ntransfer-encoding: chunked\r\n\r\nA\r\n0123456789\r\n0\r\n\r\n"),
    },
    Case {
        name: "a declared trailer",
        line: "POST /declared-trailer",
        fields: "Transfer-Encoding: chunked\r\nTrailer: x-t\r\n",
        body: b"5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
        answer: (200, None),
        closes: false,
        app: Some("POST /declared-trailer HTTP/1.1\r\nhost: {host}\r\ntrailer: x-t\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n"),
    },
    Case {
        name: "a chunk size that is not hex",
        line: "POST /not-hex",
        fields: "Transfer-Encoding: chunked\r\n",
        body: b"5g\r\nhello\r\n0\r\n\r\n",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "a chunk size past 64 bits",
        line: "POST /overflow",
        fields: "Transfer-Encoding: chunked\r\n",
        body: b"10000000000000005\r\nhello\r\n0\r\n\r\n",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "chunk data without its CRLF",
        line: "POST /no-crlf",
        fields: "Transfer-Encoding: chunked\r\n",
        body: b"5\r\nhelloX0\r\n\r\n",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "Content-Length with a sign",
        line: "POST /plus",
        fields: "Content-Length: +5\r\n",
        body: b"hello",
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "Transfer-Encoding in HTTP/1.1 with a space before the colon",
        line: "POST /space",
        fields: "Transfer-Encoding : chunked\r\n",
        body: CHUNKED_HELLO,
        answer: (400, Some("bad-request")),
        closes: true,
        app: None,
    },
    Case {
        name: "Upgrade: h2c on a plain request",
        line: "GET /h2c",
        fields:
            "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n",
        body: b"",
        answer: (200, None),
        closes: false,
        app: Some("GET /h2c HTTP/1.1\r\nhost: {host}\r\n\r\n"),
    },
    Case {
        name: "an upgrade token the port does not list",
        line: "GET /unknown-upgrade",
        fields: "Connection: Upgrade\r\nUpgrade: x-unknown\r\n",
        body: b"",
        answer: (200, None),
        closes: false,
        app: Some("GET /unknown-upgrade HTTP/1.1\r\nhost: {host}\r\n\r\n"),
    },
];

/// A payments pod's sidecar serving `ports` (config entries) and a client pod's sidecar whose
/// catalog has the payments pod advertise `advertised`: (server, client).
async fn payments_and_client(
    certs: &Certs,
    client_pod: PodNet,
    server_pod: PodNet,
    ports: &[&str],
    advertised: &[u16],
) -> (Proxy, Proxy) {
    let server = server_proxy(certs, server_pod, "payments", ports).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(server_pod.proxy_ip(), advertised)],
    )]);
    (server, client_proxy(certs, client_pod, &cat, "").await)
}

/// The pods of the table tests: on the server pod an `auto` app on 8080 and a [`WireApp`] on
/// 8081 (`http1`) behind its sidecar, and the client pod's sidecar, whose catalog lists both
/// ports: (app, wire, server, client).
async fn table_pods(
    certs: &Certs,
    client_pod: PodNet,
    server_pod: PodNet,
) -> (HttpApp, WireApp, Proxy, Proxy) {
    let app = HttpApp::auto(server_pod.app(8080)).await;
    let wire = WireApp::start(server_pod.app(8081)).await;
    let ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 8081, protocol: http1 }",
    ];
    let (server, client) =
        payments_and_client(certs, client_pod, server_pod, &ports, &[8080, 8081]).await;
    (app, wire, server, client)
}

/// Sends `case` on `s` (a fresh connection to `host`'s side) and checks the answer.
async fn run_case<S>(s: &mut S, host: &str, case: &Case, side: &str)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let what = format!("{side}: {}", case.name);
    let line = case
        .line
        .replace("{long}", &"a".repeat(70_000))
        .replace("{host}", host);
    let mut req = format!("{line} HTTP/1.1\r\nHost: {host}\r\n{}\r\n", case.fields).into_bytes();
    req.extend_from_slice(case.body);
    s.write_all(&req).await.unwrap();
    let head = read_head(s).await.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        (head.status, head.header("x-aether-error")),
        case.answer,
        "{what}: {head:?}"
    );
    assert_eq!(
        head.header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close")),
        case.closes,
        "{what}: whether the answer closes the connection: {head:?}"
    );
    let len: usize = head
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{what}: a length on the answer: {head:?}"));
    let mut body = vec![0u8; len];
    within(IO_TIMEOUT, "the answer's body", s.read_exact(&mut body))
        .await
        .unwrap()
        .unwrap();
    if case.closes {
        // A refusal lingers while the client still sends; this client is done.
        let _ = s.shutdown().await;
        let mut rest = [0u8; 64];
        let n = within(IO_TIMEOUT, "the close", s.read(&mut rest))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .unwrap_or(0);
        assert_eq!(n, 0, "{what}: the connection closes after the answer");
    }
}

/// The framing table, through the client pod's sidecar and straight at the server pod's sidecar
/// over mTLS: each row's answer and what the app got.
#[tokio::test]
async fn the_framing_table_on_both_sidecars() {
    let net = Net::fresh();
    let (client_pod, server_pod) = (net.pod(0), net.pod(1));
    let certs = certs();
    let (app, wire, _server, _client) = table_pods(&certs, client_pod, server_pod).await;
    let host = format!("{SVC}:8081");
    // An h2 GET with DATA keeps its body, to an h2 app and to an HTTP/1.1 one.
    for port in [8080, 8081] {
        let tcp = tcp_connect(client_pod.outbound()).await.unwrap();
        let (mut h2, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let req = Request::get(format!("http://{SVC}:{port}/h2-get-body"))
            .body(())
            .unwrap();
        let (resp, mut body) = h2.send_request(req, false).unwrap();
        body.send_data(Bytes::from_static(b"hello"), true).unwrap();
        let resp = within(IO_TIMEOUT, "the h2 answer", resp)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200, "h2 GET with DATA to {port}");
    }
    let seen = app.seen();
    assert_eq!(
        &seen.last().expect("the h2 app got it").body[..],
        b"hello",
        "h2 GET with DATA to an h2 app"
    );
    let got = wire.got();
    let what = "h2 GET with DATA to an HTTP/1.1 app";
    assert_eq!(got.len(), 1, "{what}");
    assert_eq!(
        String::from_utf8_lossy(&sidecar_fields(&got[0], true, what)),
        format!("GET /h2-get-body HTTP/1.1\r\nhost: {host}\r\n{CHUNKED_TAIL}"),
        "{what}"
    );
    let tls = TlsClient::with_identity(&certs, "frontend")
        .sni(Some("8081"))
        .alpn(&["http/1.1"]);
    for case in FRAMING {
        for side in ["client sidecar", "server sidecar"] {
            let before = wire.got().len();
            if side == "client sidecar" {
                let mut s = tcp_connect(client_pod.outbound()).await.unwrap();
                run_case(&mut s, &host, case, side).await;
            } else {
                let mut s = tls.connect(server_pod.inbound()).await.unwrap();
                run_case(&mut s, &host, case, side).await;
            }
            let got = wire.got();
            let new = &got[before..];
            let what = format!("{side}: {}", case.name);
            match case.app {
                None => assert!(new.is_empty(), "{what}: the app got {new:?}"),
                Some(expected) => {
                    assert_eq!(new.len(), 1, "{what}: {new:?}");
                    let rest = sidecar_fields(&new[0], side == "client sidecar", &what);
                    assert_eq!(
                        String::from_utf8_lossy(&rest),
                        expected.replace("{host}", &host),
                        "{what}"
                    );
                }
            }
        }
    }
}

/// Takes the fields the sidecars add out of a request the app read, checking each is there once
/// and well formed: `x-request-id` (a UUID), `x-forwarded-client-cert` (this pod's identity, the
/// caller's and a certificate hash) and, from the client sidecar only, `traceparent`.
fn sidecar_fields(request: &[u8], via_client: bool, what: &str) -> Vec<u8> {
    let head_end = request
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a whole head")
        + 2;
    let head = std::str::from_utf8(&request[..head_end]).expect("an ASCII head");
    let mut out = Vec::new();
    let (mut ids, mut certs, mut traces) = (0, 0, 0);
    for line in head.split_inclusive("\r\n") {
        let (name, value) = line.trim_end().split_once(": ").unwrap_or((line, ""));
        match name {
            "x-request-id" => {
                ids += 1;
                let groups: Vec<usize> = value.split('-').map(str::len).collect();
                assert_eq!(groups, [8, 4, 4, 4, 12], "{what}: x-request-id {value}");
            }
            "x-forwarded-client-cert" => {
                certs += 1;
                let (by_hash, uri) = value.split_once(";URI=").expect("a URI");
                let (by, hash) = by_hash.split_once(";Hash=").expect("a hash");
                assert_eq!(
                    by, "By=spiffe://aether.local/ns/default/sa/payments",
                    "{what}"
                );
                assert_eq!(
                    uri, "spiffe://aether.local/ns/default/sa/frontend",
                    "{what}"
                );
                assert!(
                    hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                    "{what}: hash {hash}"
                );
            }
            "traceparent" => {
                traces += 1;
                let parts: Vec<usize> = value.split('-').map(str::len).collect();
                assert_eq!(parts, [2, 32, 16, 2], "{what}: traceparent {value}");
            }
            _ => out.extend_from_slice(line.as_bytes()),
        }
    }
    assert_eq!(
        (ids, certs, traces),
        (1, 1, usize::from(via_client)),
        "{what}: the added fields, once each"
    );
    out.extend_from_slice(&request[head_end..]);
    out
}

/// An answer with a transfer coding other than chunked cannot be passed on (the hop-by-hop
/// field goes, and the client would read coded bytes as plain): 502 on both sidecars, from an
/// app behind the server sidecar and from a peer on the client sidecar's mTLS hop.
#[tokio::test]
async fn an_answer_coded_other_than_chunked_is_502_on_both_sidecars() {
    use crate::common::mesh::rogue::CODED_ANSWER;
    let net = Net::fresh();
    let (client_pod, server_pod, rogue_pod) = (net.pod(0), net.pod(1), net.pod(2));
    let certs = certs();
    // The app behind the server sidecar answers every request with the coded answer.
    let listener = TcpListener::bind(server_pod.app(8080)).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if read_http_head(&mut tcp, &mut buf).await.is_some() {
                    let _ = tcp.write_all(CODED_ANSWER).await;
                }
            });
        }
    });
    let _server = server_proxy(
        &certs,
        server_pod,
        "payments",
        &["{ port: 8080, protocol: http1 }"],
    )
    .await;
    let _rogue = RoguePod::start(&certs, rogue_pod.inbound(), Misbehaviour::H1AnswerCoded).await;
    let cat = catalog(&[
        service(
            "payments",
            &certs.spiffe_id(PAYMENTS),
            "",
            &[endpoint(server_pod.proxy_ip(), &[8080])],
        ),
        service(
            "orders",
            &certs.spiffe_id(PAYMENTS),
            "",
            &[endpoint(rogue_pod.proxy_ip(), &[8080])],
        ),
    ]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    for (authority, via) in [
        (SVC, "the server sidecar (its app)"),
        ("orders.aether.internal", "the client sidecar (its peer)"),
    ] {
        let r = get_h1(client_pod.outbound(), authority, "/coded").await;
        assert_eq!(r.status.as_u16(), 502, "{via}: {r:?}");
        assert_eq!(r.aether_error(), Some("upstream-protocol-error"), "{via}");
    }
}

/// hyper's own refusals are answered with `x-aether-error` (the table above); an app's own
/// empty 400, shaped exactly like them once hyper re-encodes it, is passed on untouched, on a
/// connection that stays open.
#[tokio::test]
async fn an_apps_own_empty_400_is_passed_on_untouched() {
    let net = Net::fresh();
    let (client_pod, server_pod) = (net.pod(0), net.pod(1));
    let certs = certs();
    let listener = TcpListener::bind(server_pod.app(8080)).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                loop {
                    let mut buf = Vec::new();
                    if read_http_head(&mut tcp, &mut buf).await.is_none() {
                        return;
                    }
                    let empty = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n";
                    if tcp.write_all(empty).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let (_server, _client) = payments_and_client(
        &certs,
        client_pod,
        server_pod,
        &["{ port: 8080, protocol: http1 }"],
        &[8080],
    )
    .await;
    let mut s = tcp_connect(client_pod.outbound()).await.unwrap();
    for i in 0..3 {
        let req = format!("GET /own-400/{i} HTTP/1.1\r\nHost: {SVC}\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let head = read_head(&mut s).await.unwrap();
        assert_eq!(head.status, 400, "request {i}: {head:?}");
        assert_eq!(head.header("x-aether-error"), None, "request {i}: {head:?}");
        assert_eq!(head.header("content-length"), Some("0"), "request {i}");
    }
}

/// HTTP/2 field rules (RFC 9113 8.2 and 8.3), sent as raw frames so that nothing in between
/// corrects them: a malformed request is reset and never reaches the app; a well-formed one
/// is answered. `extra` is HPACK after `:method GET`, `:scheme http` and `:authority`.
struct H2Case {
    name: &'static str,
    extra: &'static [u8],
    /// Ends with `:path /` (0x84) after `extra`, else `:path /` comes first.
    path_last: bool,
    /// The exact bytes an HTTP/1.1 app read, as in [`Case::app`]; None: the stream was reset
    /// and the app read nothing.
    app: Option<&'static str>,
}

const H2_FIELDS: &[H2Case] = &[
    H2Case {
        name: "a plain GET",
        extra: b"",
        path_last: false,
        app: Some("GET / HTTP/1.1\r\nhost: {host}\r\n\r\n"),
    },
    H2Case {
        name: "te: trailers",
        extra: b"\x00\x02te\x08trailers",
        path_last: false,
        app: Some("GET / HTTP/1.1\r\nte: trailers\r\nhost: {host}\r\n\r\n"),
    },
    H2Case {
        name: "a connection-specific field",
        extra: b"\x00\x0aconnection\x0akeep-alive",
        path_last: false,
        app: None,
    },
    H2Case {
        name: "te other than trailers",
        extra: b"\x00\x02te\x04gzip",
        path_last: false,
        app: None,
    },
    H2Case {
        name: "an upper-case field name",
        extra: b"\x00\x07X-Upper\x011",
        path_last: false,
        app: None,
    },
    H2Case {
        name: "a pseudo-header after a field",
        extra: b"\x00\x03x-a\x011",
        path_last: true,
        app: None,
    },
    H2Case {
        name: "an unknown pseudo-header",
        extra: b"\x00\x04:foo\x011",
        path_last: false,
        app: None,
    },
];

fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Sends `case` as stream 1 on a fresh HTTP/2 connection `s`; true when stream 1 got a
/// response head, false when it was reset (or the connection went away).
async fn h2_case<S>(s: &mut S, authority: &str, case: &H2Case) -> bool
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    const HEADERS: u8 = 0x1;
    const RST_STREAM: u8 = 0x3;
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    // `:method GET`, `:scheme http`, then `:authority` as a literal with an indexed name.
    let mut block = vec![0x82, 0x86, 0x01, authority.len() as u8];
    block.extend_from_slice(authority.as_bytes());
    if !case.path_last {
        block.push(0x84);
    }
    block.extend_from_slice(case.extra);
    if case.path_last {
        block.push(0x84);
    }
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&h2_frame(SETTINGS, 0, 0, &[])).await.unwrap();
    s.write_all(&h2_frame(HEADERS, 0x4 | 0x1, 1, &block))
        .await
        .unwrap();
    let read = async {
        let mut head = [0u8; 9];
        loop {
            if s.read_exact(&mut head).await.is_err() {
                return false;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            if s.read_exact(&mut payload).await.is_err() {
                return false;
            }
            let stream = u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff;
            match head[3] {
                HEADERS if stream == 1 => return true,
                RST_STREAM if stream == 1 => return false,
                GOAWAY => return false,
                _ => {}
            }
        }
    };
    within(IO_TIMEOUT, case.name, read).await.unwrap()
}

/// The HTTP/2 field rules on both sidecars: what the table says, and the app sees only the
/// well-formed requests.
#[tokio::test]
async fn the_h2_field_rules_on_both_sidecars() {
    let net = Net::fresh();
    let (client_pod, server_pod) = (net.pod(0), net.pod(1));
    let certs = certs();
    // The server sidecar takes HTTP/2 only on `auto` and `h2` ports, and passes it on as
    // HTTP/2: its app records the fields in arrival order. Through the client sidecar the
    // same rows reach an HTTP/1.1 app, which records the bytes.
    let (app, wire, _server, _client) = table_pods(&certs, client_pod, server_pod).await;
    let host = format!("{SVC}:8081");
    let tls = TlsClient::with_identity(&certs, "frontend")
        .sni(Some("8080"))
        .alpn(&["h2"]);
    for case in H2_FIELDS {
        let what = format!("client sidecar: {}", case.name);
        let before = wire.got().len();
        let mut s = tcp_connect(client_pod.outbound()).await.unwrap();
        let answered = h2_case(&mut s, &host, case).await;
        assert_eq!(answered, case.app.is_some(), "{what}: answered");
        let got = wire.got();
        let new = &got[before..];
        match case.app {
            None => assert!(new.is_empty(), "{what}: the app got {new:?}"),
            Some(expected) => {
                assert_eq!(new.len(), 1, "{what}: {new:?}");
                let rest = sidecar_fields(&new[0], true, &what);
                assert_eq!(
                    String::from_utf8_lossy(&rest),
                    expected.replace("{host}", &host),
                    "{what}"
                );
            }
        }

        let what = format!("server sidecar: {}", case.name);
        let before = app.seen().len();
        let mut s = tls.connect(server_pod.inbound()).await.unwrap();
        let authority = format!("{SVC}:8080");
        let answered = h2_case(&mut s, &authority, case).await;
        assert_eq!(answered, case.app.is_some(), "{what}: answered");
        let seen = app.seen();
        let new = &seen[before..];
        match case.app {
            None => assert!(new.is_empty(), "{what}: the app got {new:?}"),
            Some(expected) => {
                assert_eq!(new.len(), 1, "{what}: {new:?}");
                let r = &new[0];
                assert_eq!(
                    (r.version.as_str(), r.authority.as_deref()),
                    ("HTTP/2.0", Some(authority.as_str())),
                    "{what}"
                );
                // The row's fields but `host` (`:authority` here), in order; the sidecar's own aside.
                let fields: Vec<(String, String)> = r
                    .headers
                    .iter()
                    .filter(|(k, _)| {
                        !["x-request-id", "x-forwarded-client-cert"].contains(&k.as_str())
                    })
                    .cloned()
                    .collect();
                let head = expected.split("\r\n\r\n").next().unwrap();
                let want: Vec<(String, String)> = head
                    .split("\r\n")
                    .skip(1)
                    .filter(|l| !l.starts_with("host: "))
                    .map(|l| {
                        let (k, v) = l.split_once(": ").unwrap();
                        (k.to_string(), v.to_string())
                    })
                    .collect();
                assert_eq!(fields, want, "{what}: the fields the app got");
                assert_eq!(r.header_all("x-request-id").len(), 1, "{what}");
                assert_eq!(r.header_all("x-forwarded-client-cert").len(), 1, "{what}");
            }
        }
    }
}

/// An HTTP/1.1 app that keeps the exact bytes of every request it reads, head and body as they
/// came off the wire, and answers each with the status `x-app-status` asks for (200 without).
struct WireApp {
    got: Arc<Mutex<Vec<Vec<u8>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl WireApp {
    async fn start(addr: SocketAddr) -> WireApp {
        let listener = TcpListener::bind(addr).await.unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let got = got.clone();
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    tokio::spawn(wire_app_conn(tcp, got.clone()));
                }
            })
        };
        WireApp { got, task }
    }

    fn got(&self) -> Vec<Vec<u8>> {
        self.got.lock().unwrap().clone()
    }
}

impl Drop for WireApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads until `buf[from..]` holds `end`, returning the index just past it.
async fn read_past(
    tcp: &mut TcpStream,
    buf: &mut Vec<u8>,
    from: usize,
    end: &[u8],
) -> Option<usize> {
    loop {
        if let Some(i) = buf[from..].windows(end.len()).position(|w| w == end) {
            return Some(from + i + end.len());
        }
        read_more(tcp, buf).await?;
    }
}

/// Reads until `buf` holds at least `len` bytes; `None` when the peer closed first.
async fn read_to_len(tcp: &mut TcpStream, buf: &mut Vec<u8>, len: usize) -> Option<()> {
    while buf.len() < len {
        read_more(tcp, buf).await?;
    }
    Some(())
}

async fn read_more(tcp: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 4096];
    match tcp.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

/// Serves one connection until the peer closes it (`None`).
async fn wire_app_conn(mut tcp: TcpStream, got: Arc<Mutex<Vec<Vec<u8>>>>) -> Option<()> {
    let mut buf = Vec::new();
    loop {
        let head_end = read_http_head(&mut tcp, &mut buf).await?;
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let field = |name: &str| {
            head.lines().find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(':')
                    .map(|v| v.trim().to_string())
            })
        };
        let mut end = head_end;
        if field("transfer-encoding").is_some_and(|v| v.ends_with("chunked")) {
            loop {
                let line_end = read_past(&mut tcp, &mut buf, end, b"\r\n").await?;
                let line = String::from_utf8_lossy(&buf[end..line_end - 2]).to_string();
                let size =
                    usize::from_str_radix(line.split(';').next().unwrap().trim(), 16).unwrap();
                end = line_end;
                if size == 0 {
                    end = read_past(&mut tcp, &mut buf, end - 2, b"\r\n\r\n").await?;
                    break;
                }
                read_to_len(&mut tcp, &mut buf, end + size + 2).await?;
                end += size + 2;
            }
        } else if let Some(len) = field("content-length").and_then(|v| v.parse::<usize>().ok()) {
            read_to_len(&mut tcp, &mut buf, head_end + len).await?;
            end = head_end + len;
        }
        got.lock().unwrap().push(buf[..end].to_vec());
        buf.drain(..end);
        let status = field("x-app-status").unwrap_or_else(|| "200".into());
        let answer = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n");
        tcp.write_all(answer.as_bytes()).await.ok()?;
    }
}
