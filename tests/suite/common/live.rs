//! Helpers for the live-update tests (`tests/live.rs`: live catalog/identity updates and
//! drain): apps that know which pod and version they belong to, a keep-alive load generator,
//! atomic file writes, and small admin-endpoint readers.
//!
//! Not re-exported by `common`: its names (`clusters`, `config_dump`, ...) are too general to share
//! a glob with other topic modules, so a test file imports it itself with
//! `use common::live::*;`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use super::*;

// ---------------------------------------------------------------------------------------------
// Pod apps
// ---------------------------------------------------------------------------------------------

/// One request as a [`PodApp`] saw it.
#[derive(Debug, Clone)]
pub struct Hit {
    pub pod: String,
    pub version: String,
    /// The port the app listens on.
    pub port: u16,
    /// `Host` or `:authority` as received.
    pub authority: String,
    pub path: String,
    pub at: Instant,
}

/// Every request seen by a set of apps, shared so a test can count over all pods at once.
#[derive(Clone, Default)]
pub struct Ledger(Arc<Mutex<Vec<Hit>>>);

impl Ledger {
    pub fn hits(&self) -> Vec<Hit> {
        self.0.lock().unwrap().clone()
    }
    pub fn count(&self, pred: impl Fn(&Hit) -> bool) -> usize {
        self.0.lock().unwrap().iter().filter(|h| pred(h)).count()
    }
    /// Polls until a hit matches `pred`, bounded by `limit`.
    pub async fn wait_for(&self, limit: Duration, what: &str, pred: impl Fn(&Hit) -> bool) -> Hit {
        let hit = poll_until(limit, Duration::from_millis(10), async || {
            let hits = self.0.lock().unwrap();
            hits.iter().find(|h| pred(h)).cloned().ok_or(())
        })
        .await;
        hit.unwrap_or_else(|()| {
            panic!(
                "{what}: no such request reached an app within {limit:?}; hits: {:?}",
                self.hits()
            )
        })
    }
}

/// An HTTP app (HTTP/1.1 and h2c prior knowledge on one port) that belongs to a pod with a
/// version. It answers 200 with headers `x-pod`, `x-pod-version`, `x-app-port` and the body
/// `"<pod> <version> <port>\n"`, and records every request in its [`Ledger`].
///
/// Steering headers: `x-app-delay-ms: n` answers after n ms. A path starting with `/stream`
/// answers at once with the first chunk `"first\n"` and sends `"last\n"` and the end of the body
/// `x-stream-ms` ms later (default 2000).
pub struct PodApp {
    task: JoinHandle<()>,
}

impl PodApp {
    pub async fn start(addr: SocketAddr, pod: &str, version: &str, ledger: &Ledger) -> PodApp {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("pod app cannot bind {addr}: {e}"));
        let (pod, version, ledger) = (pod.to_string(), version.to_string(), ledger.clone());
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    r = listener.accept() => {
                        let Ok((tcp, _)) = r else { continue };
                        let _ = tcp.set_nodelay(true);
                        let (pod, version, ledger) = (pod.clone(), version.clone(), ledger.clone());
                        conns.spawn(async move {
                            let svc = service_fn(move |req: Request<Incoming>| {
                                let (pod, version, ledger) =
                                    (pod.clone(), version.clone(), ledger.clone());
                                async move {
                                    Ok::<_, Infallible>(
                                        answer(&pod, &version, addr.port(), &ledger, req).await,
                                    )
                                }
                            });
                            let _ = hyper_util::server::conn::auto::Builder::new(
                                TokioExecutor::new(),
                            )
                            .serve_connection(TokioIo::new(tcp), svc)
                            .await;
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        PodApp { task }
    }
}

impl Drop for PodApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A response body fed from a channel: each message is one data frame; the end of the channel
/// ends the body.
pub struct ChanBody(tokio::sync::mpsc::Receiver<Bytes>);

impl Body for ChanBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.0.poll_recv(cx) {
            Poll::Ready(Some(b)) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

type AppBody = Either<Full<Bytes>, ChanBody>;

async fn answer(
    pod: &str,
    version: &str,
    port: u16,
    ledger: &Ledger,
    req: Request<Incoming>,
) -> Response<AppBody> {
    let (parts, body) = req.into_parts();
    let _ = within(IO_TIMEOUT, "app reading the body", body.collect()).await;
    let authority = parts
        .uri
        .authority()
        .map(|a| a.to_string())
        .or_else(|| {
            parts
                .headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })
        .unwrap_or_default();
    let path = parts.uri.path().to_string();
    ledger.0.lock().unwrap().push(Hit {
        pod: pod.to_string(),
        version: version.to_string(),
        port,
        authority,
        path: path.clone(),
        at: Instant::now(),
    });
    let num = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(ms) = num("x-app-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let builder = Response::builder()
        .status(StatusCode::OK)
        .header("x-pod", pod)
        .header("x-pod-version", version)
        .header("x-app-port", port.to_string());
    if path.starts_with("/stream") {
        let gap = Duration::from_millis(num("x-stream-ms").unwrap_or(2000));
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let _ = tx.send(Bytes::from_static(b"first\n")).await;
            tokio::time::sleep(gap).await;
            let _ = tx.send(Bytes::from_static(b"last\n")).await;
        });
        return builder.body(Either::Right(ChanBody(rx))).unwrap();
    }
    builder
        .body(Either::Left(Full::new(Bytes::from(format!(
            "{pod} {version} {port}\n"
        )))))
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Load generator
// ---------------------------------------------------------------------------------------------

/// One request of the load generator and how it ended.
#[derive(Debug, Clone)]
pub struct Shot {
    /// The label of the target (e.g. `"9091"`, `"default"`).
    pub target: &'static str,
    pub started: Instant,
    /// `Err` is a transport failure: reset, closed connection, timeout.
    pub result: Result<ShotReply, String>,
}

#[derive(Debug, Clone)]
pub struct ShotReply {
    pub status: u16,
    pub reason: Option<String>,
    pub pod: Option<String>,
    pub version: Option<String>,
    pub port: Option<String>,
}

/// A few tokio tasks, each with its own keep-alive HTTP/1.1 connection to a proxy's outbound
/// listener, sending `GET /load` with a fixed `Host` back to back (paced) until stopped. A
/// transport error is recorded and the task reconnects.
pub struct LoadGen {
    stop: Arc<AtomicBool>,
    shots: Arc<Mutex<Vec<Shot>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl LoadGen {
    /// `targets`: (label, authority); `per_target` connections each; `pace` between requests.
    pub fn start(
        outbound: SocketAddr,
        targets: &[(&'static str, &str)],
        per_target: usize,
        pace: Duration,
    ) -> LoadGen {
        let stop = Arc::new(AtomicBool::new(false));
        let shots = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (label, authority) in targets {
            for _ in 0..per_target {
                let (stop, shots) = (stop.clone(), shots.clone());
                let (label, authority) = (*label, authority.to_string());
                tasks.push(tokio::spawn(async move {
                    let mut client: Option<HttpClient> = None;
                    while !stop.load(Ordering::SeqCst) {
                        let started = Instant::now();
                        if client.is_none() {
                            let connected = match tcp_connect(outbound).await {
                                Ok(tcp) => HttpClient::h1(tcp).await,
                                Err(e) => Err(e),
                            };
                            match connected {
                                Ok(c) => client = Some(c),
                                Err(e) => {
                                    shots.lock().unwrap().push(Shot {
                                        target: label,
                                        started,
                                        result: Err(format!("connect: {e}")),
                                    });
                                    tokio::time::sleep(pace).await;
                                    continue;
                                }
                            }
                        }
                        let req = empty(get("/load").header("host", authority.as_str()));
                        let r = client.as_mut().unwrap().send(req).await;
                        let result = match r {
                            Ok(reply) => {
                                let h = |n: &str| reply.header(n).map(str::to_string);
                                if reply
                                    .header("connection")
                                    .is_some_and(|v| v.eq_ignore_ascii_case("close"))
                                {
                                    client = None;
                                }
                                Ok(ShotReply {
                                    status: reply.status.as_u16(),
                                    reason: h("x-aether-error"),
                                    pod: h("x-pod"),
                                    version: h("x-pod-version"),
                                    port: h("x-app-port"),
                                })
                            }
                            Err(e) => {
                                client = None;
                                Err(e)
                            }
                        };
                        shots.lock().unwrap().push(Shot {
                            target: label,
                            started,
                            result,
                        });
                        tokio::time::sleep(pace).await;
                    }
                }));
            }
        }
        LoadGen { stop, shots, tasks }
    }

    pub fn shots(&self) -> Vec<Shot> {
        self.shots.lock().unwrap().clone()
    }

    /// Stops every task (each finishes its current request, bounded) and returns all shots.
    pub async fn stop(self) -> Vec<Shot> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            let _ = within(IO_TIMEOUT + Duration::from_secs(1), "load task", t).await;
        }
        let shots = self.shots.lock().unwrap().clone();
        shots
    }
}

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------

/// Writes `content` to a temp file next to `path` and renames it over `path` (atomic, as a
/// control plane or kubelet would).
pub fn write_atomic(path: &Path, content: &[u8]) {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, content).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename onto {}: {e}", path.display()));
}

// ---------------------------------------------------------------------------------------------
// Admin readers
// ---------------------------------------------------------------------------------------------

/// The `/config_dump` JSON.
pub async fn config_dump(p: &Proxy) -> serde_json::Value {
    let r = p.admin_get("/config_dump").await.expect("GET /config_dump");
    assert_eq!(r.status, StatusCode::OK, "/config_dump: {r:?}");
    r.json()
}

/// The catalog version `/config_dump` reports.
pub async fn catalog_version(p: &Proxy) -> u64 {
    let v = config_dump(p).await;
    v["catalog"]["version"]
        .as_u64()
        .unwrap_or_else(|| panic!("/config_dump has no catalog.version: {v}"))
}

/// Polls `/config_dump` until the catalog version reaches `at_least`; returns the instant it
/// was seen.
pub async fn wait_catalog_version(p: &Proxy, at_least: u64, limit: Duration) -> Instant {
    let seen = poll_until(limit, Duration::from_millis(10), async || {
        let v = catalog_version(p).await;
        if v >= at_least {
            Ok(Instant::now())
        } else {
            Err(v)
        }
    })
    .await;
    seen.unwrap_or_else(|v| {
        panic!(
            "catalog version still {v} (want {at_least}) after {limit:?}; stderr tail:\n{}",
            p.stderr_tail(20)
        )
    })
}

/// One endpoint as `/clusters` shows it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct EpView {
    pub address: String,
    pub draining: bool,
    pub labels: String,
}

/// `/clusters` as name -> endpoints (sorted); `active_requests` is read separately.
pub async fn clusters(p: &Proxy) -> BTreeMap<String, Vec<EpView>> {
    let v = clusters_json(p).await;
    let mut out = BTreeMap::new();
    for c in v["clusters"].as_array().expect("clusters array") {
        let mut eps: Vec<EpView> = c["endpoints"]
            .as_array()
            .expect("endpoints array")
            .iter()
            .map(|e| EpView {
                address: e["address"].as_str().unwrap_or_default().to_string(),
                draining: e["draining"].as_bool().unwrap_or(false),
                labels: e["labels"].to_string(),
            })
            .collect();
        eps.sort();
        out.insert(c["name"].as_str().unwrap_or_default().to_string(), eps);
    }
    out
}

pub async fn clusters_json(p: &Proxy) -> serde_json::Value {
    let r = p.admin_get("/clusters").await.expect("GET /clusters");
    assert_eq!(r.status, StatusCode::OK, "/clusters: {r:?}");
    r.json()
}

// ---------------------------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------------------------

/// Hex serial of a PEM certificate file's first certificate.
pub fn serial_of_pem_file(path: &Path) -> String {
    let pem = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let c = boring::x509::X509::from_pem(&pem).expect("PEM certificate");
    serial_of(&c)
}

pub fn serial_of(c: &boring::x509::X509Ref) -> String {
    c.serial_number()
        .to_bn()
        .expect("serial")
        .to_hex_str()
        .expect("hex")
        .to_string()
}

/// Hex serial of the server's leaf on a TLS connection.
pub fn peer_serial(tls: &TlsStream) -> String {
    let c = tls.ssl().peer_certificate().expect("server certificate");
    serial_of(&c)
}
