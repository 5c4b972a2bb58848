//! `aether-proxy demo --load SECONDS`: the demo's mesh under steady traffic of each kind the
//! sidecars carry, for a set time, with a count of what came back. It shows a new user the
//! mesh at work, and it is the workload a profile-guided build trains on (`.ci/pgo-build`):
//! every path the benchmark measures, through real sidecar processes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

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
    /// Raw TCP through a CONNECT tunnel to the echo app, checked byte for byte.
    Tcp,
}

/// What runs at once: the kind, its line in the summary, how many workers.
const KINDS: [(Kind, &str, usize); 5] = [
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
        Kind::Tcp,
        "tcp :5432 echo through CONNECT, 16 MiB a tunnel",
        1,
    ),
];

/// Bytes one tunnel sends (and must get back).
const TUNNEL_BYTES: usize = 16 << 20;

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Tally {
    fn fail(&self, e: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(e);
    }
}

/// Runs every kind at once for `secs` seconds through the outbound listener `to`, prints a
/// line per kind; true when nothing failed.
pub async fn run(to: &'static str, secs: u64) -> bool {
    let until = Instant::now() + Duration::from_secs(secs);
    println!("\nLoad for {secs} s through the frontend sidecar ({to}):");
    let mut tallies = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (kind, _, workers) in KINDS {
        let tally = Arc::new(Tally::default());
        tallies.push(tally.clone());
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
            Kind::Tcp => {
                for _ in 0..workers {
                    tasks.spawn(tunnels(to, tally.clone(), until));
                }
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    let mut clean = true;
    for ((kind, what, _), t) in KINDS.iter().zip(&tallies) {
        let ok = t.ok.load(Ordering::Relaxed);
        let failed = t.failed.load(Ordering::Relaxed);
        clean &= failed == 0 && ok > 0;
        let rate = match kind {
            Kind::Tcp => format!(
                "{} MiB echoed, {:.0} MiB/s",
                t.bytes.load(Ordering::Relaxed) >> 20,
                t.bytes.load(Ordering::Relaxed) as f64 / (1 << 20) as f64 / secs as f64
            ),
            _ => format!("{ok} requests, {:.0}/s", ok as f64 / secs as f64),
        };
        println!("  {what:<50} {rate}, {failed} failed");
        if let Some(e) = t
            .first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            println!("    first failure: {e}");
        }
    }
    clean
}

/// CONNECT tunnels one after another until the deadline.
async fn tunnels(to: &'static str, tally: Arc<Tally>, until: Instant) {
    while Instant::now() < until {
        match tunnel(to).await {
            Ok(n) => {
                tally.ok.fetch_add(1, Ordering::Relaxed);
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
                    tally.fail(e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        let Some(s) = send.as_mut() else { continue };
        let mut req = Request::get(path).header("host", "payments.aether.internal");
        if close {
            req = req.header("connection", "close");
        }
        let req = req.body(Empty::<Bytes>::new()).expect("static request");
        match answer(s.send_request(req), len).await {
            Ok(()) => {
                tally.ok.fetch_add(1, Ordering::Relaxed);
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
async fn answer<F>(sent: F, len: Option<usize>) -> Result<(), String>
where
    F: std::future::Future<Output = hyper::Result<http::Response<hyper::body::Incoming>>>,
{
    let whole = async {
        let resp = sent.await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?;
        if status != http::StatusCode::OK {
            return Err(format!("status {status}"));
        }
        let got = body.to_bytes().len();
        if got == 0 || len.is_some_and(|want| got != want) {
            return Err(format!("a body of {got} bytes"));
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(5), whole)
        .await
        .map_err(|_| "no whole answer within 5 s".to_string())?
}

/// `streams` requests in flight on one h2c connection, each stream sent again when answered.
async fn h2_streams(to: &'static str, streams: usize, tally: Arc<Tally>, until: Instant) {
    while Instant::now() < until {
        let send = async {
            let tcp = TcpStream::connect(to).await.map_err(|e| e.to_string())?;
            let _ = tcp.set_nodelay(true);
            let (send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                    .await
                    .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            Ok::<_, String>(send)
        };
        let send = match send.await {
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
                    let req = Request::get("http://payments.aether.internal:9090/")
                        .body(Empty::<Bytes>::new())
                        .expect("static request");
                    match answer(send.send_request(req), None).await {
                        Ok(()) => {
                            tally.ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            tally.fail(e);
                            // A broken connection: this stream's loop ends, the others follow.
                            if send.ready().await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
        while streams_set.join_next().await.is_some() {}
    }
}

/// One CONNECT tunnel to the echo app: sends [`TUNNEL_BYTES`] while reading the echo, checks
/// every byte; returns how many came back.
async fn tunnel(to: &str) -> Result<usize, String> {
    let attempt = async {
        let mut tcp = TcpStream::connect(to).await.map_err(|e| e.to_string())?;
        tcp.write_all(
            b"CONNECT payments.aether.internal:5432 HTTP/1.1\r\nHost: payments.aether.internal:5432\r\n\r\n",
        )
        .await
        .map_err(|e| e.to_string())?;
        // The proxy's answer is a bare head with no body; read it to its blank line.
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let b = tcp
                .read_u8()
                .await
                .map_err(|e| format!("CONNECT head: {e}"))?;
            head.push(b);
            if head.len() > 4096 {
                return Err("CONNECT answer head too long".to_string());
            }
        }
        if !head.starts_with(b"HTTP/1.1 200") {
            let line = String::from_utf8_lossy(&head);
            return Err(format!("CONNECT: {}", line.lines().next().unwrap_or("")));
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
            let n = r.read(&mut buf).await.map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            if let Some(i) = (0..n).find(|&i| buf[i] != pattern((got + i) % (64 * 1024))) {
                return Err(format!("echo differs at byte {}", got + i));
            }
            got += n;
        }
        writer
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        if got != TUNNEL_BYTES {
            return Err(format!("echoed {got} of {TUNNEL_BYTES} bytes"));
        }
        Ok(got)
    };
    tokio::time::timeout(Duration::from_secs(30), attempt)
        .await
        .map_err(|_| "tunnel: no end within 30 s".to_string())?
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}
