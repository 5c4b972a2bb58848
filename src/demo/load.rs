//! `aether-proxy demo --load SECONDS`: the demo's mesh under steady traffic of each kind the
//! sidecars carry, for a set time, with a count of what came back. It shows a new user the
//! mesh at work, and it is the workload a profile-guided build trains on (`.ci/pgo-build`):
//! every path the benchmark measures, through real sidecar processes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::Request;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::apps;

/// One kind of traffic; each of its workers loops until the deadline.
#[derive(Clone, Copy)]
enum Kind {
    /// HTTP/1.1 GETs of `path`, on a keep-alive connection or (`close`) a new one each time;
    /// `len`, the body length every answer must have.
    H1 {
        path: &'static str,
        close: bool,
        len: Option<usize>,
    },
    /// h2c to the gRPC-style port, every worker a stream on one shared connection.
    H2,
    /// gRPC-style calls on one h2c connection to :9090: `messages` messages each, sent one at
    /// a time, each echo awaited before the next (1: a unary call).
    Grpc { messages: usize },
    /// WebSocket sessions to :8080, each echoing [`WS_MESSAGES`] messages, then closing.
    WebSocket,
    /// Raw TCP through a CONNECT tunnel to the echo app, checked byte for byte.
    Tcp,
}

/// What runs at once: the kind, its line in the summary, how many workers.
const KINDS: [(Kind, &str, usize); 8] = [
    (
        Kind::H1 {
            path: "/",
            close: false,
            len: None,
        },
        "h1 GET /, 8 keep-alive connections",
        8,
    ),
    (
        Kind::H1 {
            path: "/16k",
            close: false,
            len: Some(16 * 1024),
        },
        "h1 GET /16k, 4 keep-alive connections",
        4,
    ),
    (
        Kind::H1 {
            path: "/",
            close: true,
            len: None,
        },
        "h1 GET /, a new connection each (2 at once)",
        2,
    ),
    (Kind::H2, "h2c :9090, 32 streams on one connection", 32),
    (
        Kind::Grpc { messages: 1 },
        "grpc unary :9090, 8 calls at once",
        8,
    ),
    (
        Kind::Grpc { messages: 10 },
        "grpc streaming :9090, 2 calls of 10 messages",
        2,
    ),
    (
        Kind::WebSocket,
        "websocket :8080, 2 sessions of 20 messages",
        2,
    ),
    (
        Kind::Tcp,
        "tcp :5432 echo through CONNECT, 16 MiB a tunnel",
        1,
    ),
];

/// Bytes one tunnel sends (and must get back).
const TUNNEL_BYTES: usize = 16 << 20;
/// Messages one WebSocket session echoes.
const WS_MESSAGES: usize = 20;
/// At most this many failures are kept per kind (each is counted either way).
const KEEP_FAILURES: usize = 100_000;

/// Why something failed: `class` groups failures for the tables (the proxy's
/// `x-aether-error` reason when it answered, else what the client saw), `detail` is the text.
#[derive(Debug, Clone)]
pub struct Fail {
    pub class: String,
    pub detail: String,
}

impl Fail {
    fn new(class: impl Into<String>, detail: impl Into<String>) -> Fail {
        Fail {
            class: class.into(),
            detail: detail.into(),
        }
    }

    /// A broken connection or stream, as the client's library reports it.
    fn net(e: impl std::fmt::Display) -> Fail {
        Fail::new("connection error", e.to_string())
    }

    fn timeout(what: impl Into<String>) -> Fail {
        Fail::new("timeout", what)
    }

    /// An answer that is not the one expected: the proxy's reason when it gave one.
    fn status(status: http::StatusCode, headers: &http::HeaderMap) -> Fail {
        let reason = headers
            .get(crate::http::answer::X_AETHER_ERROR)
            .and_then(|v| v.to_str().ok());
        match reason {
            Some(r) => Fail::new(
                format!("{} {r}", status.as_u16()),
                format!("status {status}"),
            ),
            None => Fail::new(format!("{}", status.as_u16()), format!("status {status}")),
        }
    }
}

/// A failure, when it happened.
#[derive(Debug, Clone)]
pub struct Failure {
    pub at: Instant,
    pub fail: Fail,
}

#[derive(Default)]
pub struct Tally {
    pub ok: AtomicU64,
    pub bytes: AtomicU64,
    pub failed: AtomicU64,
    failures: Mutex<Vec<Failure>>,
}

impl Tally {
    fn fail(&self, fail: Fail) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut kept = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < KEEP_FAILURES {
            kept.push(Failure {
                at: Instant::now(),
                fail,
            });
        }
    }

    pub fn failures(&self) -> Vec<Failure> {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn done(&self) {
        self.ok.fetch_add(1, Ordering::Relaxed);
    }
}

/// Traffic of every kind, running until its deadline.
pub struct Load {
    pub secs: u64,
    pub kinds: Vec<(&'static str, bool, Arc<Tally>)>,
    tasks: tokio::task::JoinSet<()>,
}

impl Load {
    /// Starts every kind for `secs` seconds through the outbound listener `to`.
    pub fn start(to: &'static str, secs: u64) -> Load {
        let until = Instant::now() + Duration::from_secs(secs);
        let mut kinds = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        for (kind, what, workers) in KINDS {
            let tally = Arc::new(Tally::default());
            kinds.push((what, matches!(kind, Kind::Tcp), tally.clone()));
            match kind {
                Kind::H1 { path, close, len } => {
                    for _ in 0..workers {
                        tasks.spawn(h1_requests(to, path, close, len, tally.clone(), until));
                    }
                }
                // One connection carries all the h2 streams.
                Kind::H2 => {
                    tasks.spawn(h2_streams(to, workers, tally, until));
                }
                Kind::Grpc { messages } => {
                    tasks.spawn(grpc_calls(to, workers, messages, tally, until));
                }
                Kind::WebSocket => {
                    for _ in 0..workers {
                        tasks.spawn(websockets(to, tally.clone(), until));
                    }
                }
                Kind::Tcp => {
                    for _ in 0..workers {
                        tasks.spawn(tunnels(to, tally.clone(), until));
                    }
                }
            }
        }
        Load { secs, kinds, tasks }
    }

    /// Waits for every worker to pass its deadline.
    pub async fn finish(&mut self) {
        while self.tasks.join_next().await.is_some() {}
    }

    /// A line per kind: what came back, how many failed.
    pub fn print(&self) {
        let secs = self.secs.max(1) as f64;
        for (what, tcp, t) in &self.kinds {
            let ok = t.ok.load(Ordering::Relaxed);
            let failed = t.failed.load(Ordering::Relaxed);
            let rate = if *tcp {
                let bytes = t.bytes.load(Ordering::Relaxed);
                format!(
                    "{} MiB echoed, {:.0} MiB/s",
                    bytes >> 20,
                    bytes as f64 / (1 << 20) as f64 / secs
                )
            } else {
                format!("{ok} requests, {:.0}/s", ok as f64 / secs)
            };
            println!("  {what:<50} {rate}, {failed} failed");
        }
    }
}

/// Runs every kind at once for `secs` seconds through the outbound listener `to`, prints a
/// line per kind; true when nothing failed.
pub async fn run(to: &'static str, secs: u64) -> bool {
    println!("\nLoad for {secs} s through the frontend sidecar ({to}):");
    let mut load = Load::start(to, secs);
    load.finish().await;
    load.print();
    let mut clean = true;
    for (what, _, t) in &load.kinds {
        clean &= t.failed.load(Ordering::Relaxed) == 0 && t.ok.load(Ordering::Relaxed) > 0;
        if let Some(f) = t.failures().first() {
            println!(
                "    {what}: first failure: {}: {}",
                f.fail.class, f.fail.detail
            );
        }
    }
    clean
}

/// CONNECT tunnels one after another until the deadline.
async fn tunnels(to: &'static str, tally: Arc<Tally>, until: Instant) {
    while Instant::now() < until {
        match tunnel(to).await {
            Ok(n) => {
                tally.done();
                tally.bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => {
                tally.fail(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// HTTP/1.1 GETs one after another on one connection (a new one after each if `close`).
async fn h1_requests(
    to: &'static str,
    path: &'static str,
    close: bool,
    len: Option<usize>,
    tally: Arc<Tally>,
    until: Instant,
) {
    let mut send = None;
    while Instant::now() < until {
        if send.is_none() {
            match h1_connect(to).await {
                Ok(s) => send = Some(s),
                Err(e) => {
                    tally.fail(Fail::net(e));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        let Some(s) = send.as_mut() else { continue };
        // A connection the proxy closed between two requests is not a failure: a new one is.
        if s.ready().await.is_err() {
            send = None;
            continue;
        }
        let mut req = Request::get(path).header("host", "payments.aether.internal");
        if close {
            req = req.header("connection", "close");
        }
        let req = req.body(Empty::<Bytes>::new()).expect("static request");
        match answer(s.send_request(req), len).await {
            Ok(()) => {
                tally.done();
                if close {
                    send = None;
                }
            }
            Err(e) => {
                tally.fail(e);
                send = None;
            }
        }
    }
}

/// An HTTP/1.1 client connection to `to` (Nagle off), driven by a task of its own; also the
/// first requests' (`get`).
pub(super) async fn h1_connect(
    to: &str,
) -> Result<hyper::client::conn::http1::SendRequest<Empty<Bytes>>, String> {
    let tcp = TcpStream::connect(to).await.map_err(|e| e.to_string())?;
    let _ = tcp.set_nodelay(true);
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(send)
}

/// Waits for the answer and reads its body: Ok only for a 200 with a body (of `len` bytes,
/// if given), all within 5 s.
async fn answer<F>(sent: F, len: Option<usize>) -> Result<(), Fail>
where
    F: std::future::Future<Output = hyper::Result<http::Response<hyper::body::Incoming>>>,
{
    let whole = async {
        let step = Duration::from_secs(5);
        let resp = tokio::time::timeout(step, sent)
            .await
            .map_err(|_| Fail::timeout("no answer head within 5 s"))?
            .map_err(Fail::net)?;
        let status = resp.status();
        if status != http::StatusCode::OK {
            return Err(Fail::status(status, resp.headers()));
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| Fail::new("body cut", e.to_string()))?;
        let got = body.to_bytes().len();
        if got == 0 || len.is_some_and(|want| got != want) {
            return Err(Fail::new("short body", format!("a body of {got} bytes")));
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(5), whole)
        .await
        .map_err(|_| Fail::timeout("no whole answer within 5 s"))?
}

type H2Send<B> = hyper::client::conn::http2::SendRequest<B>;

/// An h2c connection to `to`, driven by a task of its own.
async fn h2_connect<B>(to: &str) -> Result<H2Send<B>, Fail>
where
    B: hyper::body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = TcpStream::connect(to).await.map_err(Fail::net)?;
    let _ = tcp.set_nodelay(true);
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .map_err(Fail::net)?;
    tokio::spawn(conn);
    Ok(send)
}

/// `streams` requests in flight on one h2c connection, each stream sent again when answered.
async fn h2_streams(to: &'static str, streams: usize, tally: Arc<Tally>, until: Instant) {
    while Instant::now() < until {
        let send = match h2_connect::<Empty<Bytes>>(to).await {
            Ok(s) => s,
            Err(e) => {
                tally.fail(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let mut streams_set = tokio::task::JoinSet::new();
        for _ in 0..streams {
            let mut send = send.clone();
            let tally = tally.clone();
            streams_set.spawn(async move {
                while Instant::now() < until {
                    // A connection the proxy ended (GOAWAY) is not a failure: a new one follows.
                    if send.ready().await.is_err() {
                        return;
                    }
                    let req = Request::get("http://payments.aether.internal:9090/")
                        .body(Empty::<Bytes>::new())
                        .expect("static request");
                    match answer(send.send_request(req), None).await {
                        Ok(()) => tally.done(),
                        Err(e) => tally.fail(e),
                    }
                }
            });
        }
        while streams_set.join_next().await.is_some() {}
    }
}

type GrpcBody = BoxBody<Bytes, std::convert::Infallible>;

/// `calls` gRPC-style calls at a time on one h2c connection, each of `messages` messages.
async fn grpc_calls(
    to: &'static str,
    calls: usize,
    messages: usize,
    tally: Arc<Tally>,
    until: Instant,
) {
    while Instant::now() < until {
        let send = match h2_connect::<GrpcBody>(to).await {
            Ok(s) => s,
            Err(e) => {
                tally.fail(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let mut set = tokio::task::JoinSet::new();
        for worker in 0..calls {
            let mut send = send.clone();
            let tally = tally.clone();
            set.spawn(async move {
                let mut n = 0u64;
                while Instant::now() < until {
                    if send.ready().await.is_err() {
                        return;
                    }
                    n += 1;
                    match grpc_call(&mut send, messages, worker as u64 * 1_000_000 + n).await {
                        Ok(()) => tally.done(),
                        Err(e) => tally.fail(e),
                    }
                }
            });
        }
        while set.join_next().await.is_some() {}
    }
}

/// One call: each message sent once the previous one came back, then the end of the request;
/// Ok when every echo matches and the trailers say `grpc-status: 0`. The answer's head and
/// each echo must come within 5 s.
async fn grpc_call(send: &mut H2Send<GrpcBody>, messages: usize, id: u64) -> Result<(), Fail> {
    let message = |i: usize| {
        let text = format!("call {id} message {i}");
        let mut m = vec![0u8];
        m.extend_from_slice(&(text.len() as u32).to_be_bytes());
        m.extend_from_slice(text.as_bytes());
        Bytes::from(m)
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::convert::Infallible>>(1);
    let body = if messages == 1 {
        Full::new(message(0)).boxed()
    } else {
        BodyExt::boxed(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    };
    let path = if messages == 1 { "Unary" } else { "Stream" };
    let req = Request::post(format!(
        "http://payments.aether.internal:9090/demo.Echo/{path}"
    ))
    .header(http::header::CONTENT_TYPE, "application/grpc")
    .header("te", "trailers")
    .body(body)
    .expect("static request");
    let sent = send.send_request(req);
    if messages > 1 {
        let _ = tx.send(Ok(Frame::data(message(0)))).await;
    }
    let step = Duration::from_secs(5);
    let resp = tokio::time::timeout(step, sent)
        .await
        .map_err(|_| Fail::timeout("no answer head within 5 s"))?
        .map_err(Fail::net)?;
    if resp.status() != http::StatusCode::OK {
        return Err(Fail::status(resp.status(), resp.headers()));
    }
    let mut body = resp.into_body();
    let mut buf = BytesMut::new();
    let mut next = 0;
    let mut tx = Some(tx);
    loop {
        let frame = tokio::time::timeout(step, body.frame())
            .await
            .map_err(|_| Fail::timeout(format!("no echo of message {next} within 5 s")))?;
        let Some(frame) = frame else {
            return Err(Fail::new(
                "grpc no trailers",
                "the answer ended without trailers",
            ));
        };
        let frame = frame.map_err(|e| Fail::new("body cut", e.to_string()))?;
        let frame = match frame.into_data() {
            Ok(data) => {
                buf.extend_from_slice(&data);
                while let Some(len) = apps::grpc_message_len(&buf) {
                    let got = buf.split_to(len);
                    if got[..] != message(next)[..] {
                        return Err(Fail::new("grpc echo differs", format!("message {next}")));
                    }
                    next += 1;
                    if next < messages {
                        if let Some(tx) = &tx {
                            let _ = tx.send(Ok(Frame::data(message(next)))).await;
                        }
                    } else {
                        // All echoed: end the request.
                        tx = None;
                    }
                }
                continue;
            }
            Err(frame) => frame,
        };
        let Ok(trailers) = frame.into_trailers() else {
            continue;
        };
        let status = trailers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none");
        if status != "0" {
            return Err(Fail::new(
                format!("grpc-status {status}"),
                "a call that did not succeed",
            ));
        }
        if next != messages {
            return Err(Fail::new(
                "grpc echo short",
                format!("{next} of {messages} messages"),
            ));
        }
        return Ok(());
    }
}

/// WebSocket sessions one after another until the deadline; each message echoed counts.
async fn websockets(to: &'static str, tally: Arc<Tally>, until: Instant) {
    while Instant::now() < until {
        let session = tokio::time::timeout(Duration::from_secs(10), websocket(to, &tally));
        match session.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tally.fail(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => tally.fail(Fail::timeout("no whole session within 10 s")),
        }
    }
}

/// One session: the upgrade through the proxy, [`WS_MESSAGES`] masked messages each echoed
/// back the same, then the close handshake.
async fn websocket(to: &str, tally: &Tally) -> Result<(), Fail> {
    let mut tcp = TcpStream::connect(to).await.map_err(Fail::net)?;
    let _ = tcp.set_nodelay(true);
    let key = boring::base64::encode_block(&fastrand::u128(..).to_be_bytes());
    let head = format!(
        "GET /chat HTTP/1.1\r\nHost: payments.aether.internal\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.map_err(Fail::net)?;
    let answer = read_head(&mut tcp).await?;
    let text = String::from_utf8_lossy(&answer);
    if !text.starts_with("HTTP/1.1 101") {
        return Err(head_fail(&text));
    }
    let accept = apps::websocket_accept(key.as_bytes());
    if !text.lines().any(|l| {
        l.to_ascii_lowercase() == format!("sec-websocket-accept: {}", accept.to_ascii_lowercase())
    }) {
        return Err(Fail::new(
            "websocket bad accept",
            "Sec-WebSocket-Accept is wrong",
        ));
    }
    for i in 0..WS_MESSAGES {
        let payload = format!("message {i} of session {key}");
        let mask: [u8; 4] = fastrand::u32(..).to_be_bytes();
        let mut frame = apps::frame_head(0x2, payload.len(), true);
        frame.extend_from_slice(&mask);
        frame.extend(payload.bytes().enumerate().map(|(j, b)| b ^ mask[j % 4]));
        tcp.write_all(&frame)
            .await
            .map_err(|e| Fail::new("websocket cut", e.to_string()))?;
        let (opcode, echo) = apps::read_frame(&mut tcp)
            .await
            .map_err(|e| Fail::new("websocket cut", e.to_string()))?;
        if opcode != 0x2 || echo != payload.as_bytes() {
            return Err(Fail::new("websocket echo differs", format!("message {i}")));
        }
        tally.done();
    }
    let mask = [1u8, 2, 3, 4];
    let mut close = apps::frame_head(0x8, 0, true);
    close.extend_from_slice(&mask);
    tcp.write_all(&close)
        .await
        .map_err(|e| Fail::new("websocket cut", e.to_string()))?;
    let (opcode, _) = apps::read_frame(&mut tcp)
        .await
        .map_err(|e| Fail::new("websocket cut", e.to_string()))?;
    if opcode != 0x8 {
        return Err(Fail::new("websocket no close", format!("opcode {opcode}")));
    }
    Ok(())
}

/// Reads an HTTP/1.1 answer head to its blank line, byte by byte (what follows is not ours).
async fn read_head(tcp: &mut TcpStream) -> Result<Vec<u8>, Fail> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let b = tcp
            .read_u8()
            .await
            .map_err(|e| Fail::new("connection error", format!("answer head: {e}")))?;
        head.push(b);
        if head.len() > 4096 {
            return Err(Fail::new("bad answer", "answer head too long"));
        }
    }
    Ok(head)
}

/// A refused upgrade or CONNECT: the status and the proxy's reason, from the head's text.
fn head_fail(text: &str) -> Fail {
    let status = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?");
    let reason = text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case(crate::http::answer::X_AETHER_ERROR)
            .then(|| value.trim().to_string())
    });
    let first = text.lines().next().unwrap_or("").to_string();
    match reason {
        Some(r) => Fail::new(format!("{status} {r}"), first),
        None => Fail::new(status.to_string(), first),
    }
}

/// One CONNECT tunnel to the echo app: sends [`TUNNEL_BYTES`] while reading the echo, checks
/// every byte; returns how many came back.
async fn tunnel(to: &str) -> Result<usize, Fail> {
    let attempt = async {
        let mut tcp = TcpStream::connect(to).await.map_err(Fail::net)?;
        tcp.write_all(
            b"CONNECT payments.aether.internal:5432 HTTP/1.1\r\nHost: payments.aether.internal:5432\r\n\r\n",
        )
        .await
        .map_err(Fail::net)?;
        // The proxy's answer is a bare head with no body.
        let head = read_head(&mut tcp).await?;
        if !head.starts_with(b"HTTP/1.1 200") {
            return Err(head_fail(&String::from_utf8_lossy(&head)));
        }
        let (mut r, mut w) = tcp.into_split();
        let writer = tokio::spawn(async move {
            let chunk: Vec<u8> = (0..64 * 1024).map(pattern).collect();
            for _ in 0..TUNNEL_BYTES / chunk.len() {
                w.write_all(&chunk).await?;
            }
            w.shutdown().await
        });
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0usize;
        loop {
            let n = r
                .read(&mut buf)
                .await
                .map_err(|e| Fail::new("tunnel cut", e.to_string()))?;
            if n == 0 {
                break;
            }
            if let Some(i) = (0..n).find(|&i| buf[i] != pattern((got + i) % (64 * 1024))) {
                return Err(Fail::new(
                    "tunnel echo differs",
                    format!("at byte {}", got + i),
                ));
            }
            got += n;
        }
        writer
            .await
            .map_err(|e| Fail::new("tunnel cut", e.to_string()))?
            .map_err(|e| Fail::new("tunnel cut", e.to_string()))?;
        if got != TUNNEL_BYTES {
            return Err(Fail::new(
                "tunnel cut",
                format!("echoed {got} of {TUNNEL_BYTES} bytes"),
            ));
        }
        Ok(got)
    };
    tokio::time::timeout(Duration::from_secs(30), attempt)
        .await
        .map_err(|_| Fail::timeout("tunnel: no end within 30 s"))?
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}
