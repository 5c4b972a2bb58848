//! Test apps behind a proxy: an HTTP app that records what it saw, and a TCP echo server.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use super::{eventually_every, within, IO_TIMEOUT};

/// Which HTTP codec a test app speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppKind {
    /// HTTP/1.1 only (an h2 preface is a protocol error).
    Http1,
    /// HTTP/2 cleartext with prior knowledge only (gRPC-style).
    H2c,
    /// Both: HTTP/1.1, or HTTP/2 when the connection starts with the h2 preface. The most
    /// observant app: whatever the proxy sends, it records the version it saw.
    Auto,
}

/// One request as a test app saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The port the app listens on.
    pub port: u16,
    /// "HTTP/1.1" or "HTTP/2.0".
    pub version: String,
    pub method: String,
    /// The request target as received (origin-form for h1, absolute for h2).
    pub uri: String,
    /// URI authority (h2 `:authority`) or else the `Host` header.
    pub authority: Option<String>,
    /// Every header in arrival order; repeated names appear repeatedly.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl Seen {
    /// All values of header `name` (case-insensitive).
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
    /// The single value of header `name`; panics if it is repeated.
    pub fn header(&self, name: &str) -> Option<&str> {
        let all = self.header_all(name);
        assert!(all.len() <= 1, "header {name} repeated: {all:?}");
        all.first().copied()
    }
}

/// An HTTP test app. It answers every request with 200, headers `x-app-port` and
/// `x-app-version`, and a JSON body
/// `{"port", "version", "method", "uri", "authority", "headers": {name: [values]}, "body"}`,
/// and records the request (see [`HttpApp::seen`]).
///
/// Request headers that steer it: `x-app-status: <code>` answers that status instead of 200,
/// `x-app-delay-ms: <n>` answers after n ms.
pub struct HttpApp {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl HttpApp {
    pub async fn start(kind: AppKind, addr: SocketAddr) -> HttpApp {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("test app cannot bind {addr}: {e}"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let task = {
            let seen = seen.clone();
            let connections = connections.clone();
            tokio::spawn(async move {
                // Connection tasks live in the set, so stopping the app closes them all.
                let mut conns = JoinSet::new();
                loop {
                    tokio::select! {
                        r = listener.accept() => {
                            let Ok((tcp, _)) = r else { continue };
                            connections.fetch_add(1, Ordering::SeqCst);
                            let seen = seen.clone();
                            conns.spawn(serve_app_conn(kind, addr.port(), tcp, seen));
                        }
                        Some(_) = conns.join_next(), if !conns.is_empty() => {}
                    }
                }
            })
        };
        HttpApp {
            addr,
            seen,
            connections,
            task,
        }
    }
    pub async fn http1(addr: SocketAddr) -> HttpApp {
        HttpApp::start(AppKind::Http1, addr).await
    }
    pub async fn h2c(addr: SocketAddr) -> HttpApp {
        HttpApp::start(AppKind::H2c, addr).await
    }
    pub async fn auto(addr: SocketAddr) -> HttpApp {
        HttpApp::start(AppKind::Auto, addr).await
    }

    /// Requests seen so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
    /// Stops listening and closes every connection; returns once the port refuses connections.
    pub async fn stop(self) {
        let addr = self.addr;
        drop(self);
        wait_refused(addr, IO_TIMEOUT).await;
    }
}

impl Drop for HttpApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_app_conn(kind: AppKind, port: u16, tcp: TcpStream, seen: Arc<Mutex<Vec<Seen>>>) {
    let _ = tcp.set_nodelay(true);
    let svc = service_fn(move |req: Request<Incoming>| {
        let seen = seen.clone();
        async move { Ok::<_, Infallible>(app_answer(port, req, &seen).await) }
    });
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    b = match kind {
        AppKind::Http1 => b.http1_only(),
        AppKind::H2c => b.http2_only(),
        AppKind::Auto => b,
    };
    // Apps behind the proxy see the client's headers plus the ones the proxy adds
    // (x-request-id, x-forwarded-client-cert); don't let hyper's default of 100 refuse them.
    b.http1().max_headers(1024);
    let _ = b.serve_connection(TokioIo::new(tcp), svc).await;
}

async fn app_answer(
    port: u16,
    req: Request<Incoming>,
    seen: &Mutex<Vec<Seen>>,
) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = match within(IO_TIMEOUT, "app reading body", body.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        _ => Bytes::new(),
    };
    let version = format!("{:?}", parts.version);
    let authority = parts.uri.authority().map(|a| a.to_string()).or_else(|| {
        parts
            .headers
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_string)
    });
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let rec = Seen {
        port,
        version: version.clone(),
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        authority: authority.clone(),
        headers: headers.clone(),
        body: body.clone(),
    };
    seen.lock().unwrap().push(rec);

    let h = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(ms) = h("x-app-delay-ms").and_then(|v| v.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = h("x-app-status")
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, v) in headers {
        map.entry(k).or_default().push(v);
    }
    let json = serde_json::json!({
        "port": port,
        "version": version,
        "method": parts.method.as_str(),
        "uri": parts.uri.to_string(),
        "authority": authority,
        "headers": map,
        "body": String::from_utf8_lossy(&body),
    });
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-app-port", port.to_string())
        .header("x-app-version", version)
        .body(Full::new(Bytes::from(serde_json::to_vec(&json).unwrap())))
        .unwrap()
}

/// What [`TcpEcho`] writes after the peer half-closed, just before it closes its side.
pub const ECHO_EOF_MARKER: &[u8] = b"<<echo: peer closed its write side>>";

/// A TCP echo server: echoes every byte until the peer half-closes, then writes
/// [`ECHO_EOF_MARKER`] and closes. So a client that shuts down its write side and still reads
/// the marker proves half-close travelled end to end.
pub struct TcpEcho {
    connections: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<u8>>>,
    task: JoinHandle<()>,
}

impl TcpEcho {
    pub async fn start(addr: SocketAddr) -> TcpEcho {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("echo server cannot bind {addr}: {e}"));
        let connections = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let connections = connections.clone();
            let received = received.clone();
            tokio::spawn(async move {
                let mut conns = JoinSet::new();
                loop {
                    tokio::select! {
                        r = listener.accept() => {
                            let Ok((mut tcp, _)) = r else { continue };
                            connections.fetch_add(1, Ordering::SeqCst);
                            let received = received.clone();
                            conns.spawn(async move {
                                let mut buf = vec![0u8; 16 * 1024];
                                loop {
                                    match tcp.read(&mut buf).await {
                                        Ok(0) => break,
                                        Ok(n) => {
                                            received.lock().unwrap().extend_from_slice(&buf[..n]);
                                            if tcp.write_all(&buf[..n]).await.is_err() {
                                                return;
                                            }
                                        }
                                        Err(_) => return,
                                    }
                                }
                                let _ = tcp.write_all(ECHO_EOF_MARKER).await;
                                let _ = tcp.shutdown().await;
                            });
                        }
                        Some(_) = conns.join_next(), if !conns.is_empty() => {}
                    }
                }
            })
        };
        TcpEcho {
            connections,
            received,
            task,
        }
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
    /// Every byte received so far, over all connections.
    pub fn received(&self) -> Vec<u8> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for TcpEcho {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Polls until connecting to `addr` is refused (after stopping a server); returns when, or
/// panics after `limit`.
pub async fn wait_refused(addr: SocketAddr, limit: Duration) -> Instant {
    let what = format!("{addr} refusing TCP connections");
    eventually_every(
        limit,
        Duration::from_millis(10),
        &what,
        async || match tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr))
            .await
        {
            Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(Instant::now()),
            Ok(Ok(_)) => Err("a connection was accepted".to_string()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("connect timed out".to_string()),
        },
    )
    .await
}
