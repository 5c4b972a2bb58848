//! Shared harness for the integration tests: real processes, real sockets, real TLS, loopback only.
//!
//! Include it from a test file with `mod common;` and `use common::*;`.
//!
//! # Loopback addressing
//!
//! Every test owns one /24 of loopback, `127.<suite>.<test>.0/24`, so tests (and test binaries)
//! can run in parallel without ever sharing an address:
//!
//! * `suite` is fixed per test file (see [`suite`]); suite 0 (`127.0.0.x`) is left to the example
//!   configs in `configs/` and to people running the proxy by hand.
//! * `test` is unique per test within its file (1..=254); pick it by hand and keep a list at
//!   the top of the test file.
//! * Inside the /24, pod `i` (0..=15) owns the hosts `16*i + 1 ..= 16*i + 15`:
//!   * `16*i + 1`: the pod's apps (the proxy's `inbound.app_host`), on their real ports;
//!   * `16*i + 2`: the pod's proxy: inbound `:15008`, outbound `:15001`, admin `:15000`;
//!   * `16*i + 3 ..= 16*i + 15`: free for that pod's extras (client source addresses, ...).
//!
//! So test N of the inbound suite runs its proxy on `127.1.N.2:15008`, its apps on
//! `127.1.N.1:<port>` and its admin listener on `127.1.N.2:15000`.
//!
//! # At a glance
//!
//! * [`Net`] / [`PodNet`]: the addresses above; `PodNet::listeners_yaml` writes the three
//!   listener sections of a proxy config.
//! * [`Certs`]: a CA plus workload leaves made by `aether-proxy certs`; `Certs::new` again for a
//!   second CA, `same_ca_other_trust_domain` for a foreign SPIFFE id under the same CA.
//! * [`Proxy`]: `aether-proxy run` in a temp dir; waits for `/readyz` 200; stdout (the access
//!   log) and stderr captured to files; killed on drop; signals and exit status for drain tests.
//! * [`HttpApp`] (HTTP/1.1, h2c or both) and [`TcpEcho`]: apps that record what they saw.
//! * [`TlsClient`]: BoringSSL client with chosen cert, SNI, ALPN; [`TlsFailure`] keeps the raw
//!   bytes the server sent (plaintext alerts).
//! * [`HttpClient`]: HTTP/1.1 or HTTP/2 over any stream; [`http_connect`] for CONNECT tunnels;
//!   [`http_get`] for admin endpoints; [`read_to_end_within`] for raw streams.
//!
//! # Time bounds
//!
//! Every network wait in here is bounded ([`IO_TIMEOUT`], [`READY_TIMEOUT`]); nothing can hang CI.
//! Processes and servers are stopped when their handle is dropped.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use boring::ssl::{SslConnector, SslFiletype, SslMethod, SslVerifyMode};
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// Bound for any single network step (connect, handshake, request, read).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound for a proxy to become ready after it was spawned.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound for an access-log line to show up (the proxy flushes every 50 ms).
pub const LOG_TIMEOUT: Duration = Duration::from_secs(5);

/// The path of the binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_aether-proxy");

/// `await` with a bound; the error names what timed out.
pub async fn within<F: std::future::Future>(
    limit: Duration,
    what: &str,
    f: F,
) -> Result<F::Output, String> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| format!("{what}: timed out after {limit:?}"))
}

// ---------------------------------------------------------------------------------------------
// Addressing
// ---------------------------------------------------------------------------------------------

/// The `suite` octet of each test file (`127.<suite>.<test>.<host>`).
pub mod suite {
    pub const INBOUND: u8 = 1;
    pub const OUTBOUND: u8 = 2;
    pub const DRAIN: u8 = 3;
    pub const READINESS: u8 = 4;
    pub const ADMIN: u8 = 5;
    pub const CLI: u8 = 6;
    pub const LIVE: u8 = 7;
}

/// One test's loopback /24: `127.<suite>.<test>.0/24`.
#[derive(Debug, Clone, Copy)]
pub struct Net {
    suite: u8,
    test: u8,
}

impl Net {
    pub fn new(suite: u8, test: u8) -> Net {
        assert!(
            suite >= 1,
            "suite 0 (127.0.x.x) is reserved for configs/ and manual runs"
        );
        assert!(
            (1..=254).contains(&test),
            "test number {test} is not in 1..=254"
        );
        Net { suite, test }
    }

    /// `127.<suite>.<test>.<host>`.
    pub fn ip(&self, host: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, self.suite, self.test, host))
    }

    /// Pod `i` (0..=15) of this test.
    pub fn pod(&self, i: u8) -> PodNet {
        assert!(i < 16, "pod index {i} is not in 0..=15");
        PodNet {
            net: *self,
            base: 16 * i,
        }
    }
}

/// The addresses of one pod: its apps, its proxy's three listeners and spare hosts.
#[derive(Debug, Clone, Copy)]
pub struct PodNet {
    net: Net,
    base: u8,
}

impl PodNet {
    /// Where the pod's apps listen; the proxy's `inbound.app_host`.
    pub fn app_host(&self) -> IpAddr {
        self.net.ip(self.base + 1)
    }
    pub fn app(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.app_host(), port)
    }
    /// The proxy's address (all three of its listeners).
    pub fn proxy_ip(&self) -> IpAddr {
        self.net.ip(self.base + 2)
    }
    pub fn inbound(&self) -> SocketAddr {
        SocketAddr::new(self.proxy_ip(), 15008)
    }
    pub fn outbound(&self) -> SocketAddr {
        SocketAddr::new(self.proxy_ip(), 15001)
    }
    pub fn admin(&self) -> SocketAddr {
        SocketAddr::new(self.proxy_ip(), 15000)
    }
    /// Spare host `k` (0..=12) of this pod, e.g. a client's source address.
    pub fn extra(&self, k: u8) -> IpAddr {
        assert!(k <= 12, "extra host {k} is not in 0..=12");
        self.net.ip(self.base + 3 + k)
    }
    /// The `inbound:`, `outbound:` and `admin:` sections for this pod, as YAML: every listener
    /// on [`PodNet::proxy_ip`], `inbound.app_host` = [`PodNet::app_host`], and `inbound.ports`
    /// from `ports`, each a YAML flow mapping such as `"{ port: 9090, protocol: h2 }"` (empty:
    /// the key is left out, so the proxy's default applies).
    pub fn listeners_yaml(&self, default_port: u16, ports: &[&str]) -> String {
        let mut y = format!(
            "inbound:\n  listen: {}\n  app_host: {}\n  default_port: {default_port}\n",
            self.inbound(),
            self.app_host()
        );
        if !ports.is_empty() {
            y.push_str("  ports:\n");
            for p in ports {
                y.push_str(&format!("    - {p}\n"));
            }
        }
        y.push_str(&format!(
            "outbound:\n  listen: {}\nadmin:\n  listen: {}\n",
            self.outbound(),
            self.admin()
        ));
        y
    }
}

// ---------------------------------------------------------------------------------------------
// Certificates
// ---------------------------------------------------------------------------------------------

/// A temp dir holding a CA (`ca.crt`, `ca.key`) and workload certificates made by the real
/// binary (`aether-proxy certs`). A workload `ns/sa` is written as `<sa>.crt` + `<sa>.key`
/// (the "stem" is the service account, as long as no two workloads share one).
pub struct Certs {
    dir: tempfile::TempDir,
    trust_domain: String,
}

impl Certs {
    /// A new CA for `trust_domain` and one leaf per workload (`"default/payments"`, ...).
    pub fn new(trust_domain: &str, workloads: &[&str]) -> Certs {
        let dir = tempfile::Builder::new()
            .prefix("aether-certs-")
            .tempdir()
            .expect("temp dir");
        let certs = Certs {
            dir,
            trust_domain: trust_domain.to_string(),
        };
        certs.issue(workloads);
        certs
    }

    /// More leaves from the same CA, same trust domain.
    pub fn issue(&self, workloads: &[&str]) {
        run_certs(self.dir.path(), &self.trust_domain, workloads);
    }

    /// A new directory with this CA (copied) and leaves for `workloads` in another trust domain:
    /// certificates that chain to the same CA but carry a foreign SPIFFE id.
    pub fn same_ca_other_trust_domain(&self, trust_domain: &str, workloads: &[&str]) -> Certs {
        let dir = tempfile::Builder::new()
            .prefix("aether-certs-")
            .tempdir()
            .expect("temp dir");
        for f in ["ca.crt", "ca.key"] {
            fs::copy(self.dir.path().join(f), dir.path().join(f)).expect("copy CA");
        }
        run_certs(dir.path(), trust_domain, workloads);
        Certs {
            dir,
            trust_domain: trust_domain.to_string(),
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }
    /// The CA certificate (the trust bundle).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }
    pub fn cert(&self, stem: &str) -> PathBuf {
        self.dir.path().join(format!("{stem}.crt"))
    }
    pub fn key(&self, stem: &str) -> PathBuf {
        self.dir.path().join(format!("{stem}.key"))
    }
    /// `spiffe://<td>/ns/<ns>/sa/<sa>` for a workload written `"ns/sa"`.
    pub fn spiffe_id(&self, workload: &str) -> String {
        let (ns, sa) = workload.split_once('/').expect("workload is ns/sa");
        format!("spiffe://{}/ns/{ns}/sa/{sa}", self.trust_domain)
    }
    /// The `identity:` block of a proxy config for the leaf `stem`.
    pub fn identity_yaml(&self, stem: &str) -> String {
        format!(
            "identity:\n  cert: {}\n  key: {}\n  ca: {}\n",
            self.cert(stem).display(),
            self.key(stem).display(),
            self.ca().display()
        )
    }
    /// DER of the leaf `stem` (the first certificate of its PEM file).
    pub fn leaf_der(&self, stem: &str) -> Vec<u8> {
        let pem = fs::read(self.cert(stem)).expect("read cert");
        boring::x509::X509::from_pem(&pem)
            .expect("PEM certificate")
            .to_der()
            .expect("DER")
    }
}

fn run_certs(out: &Path, trust_domain: &str, workloads: &[&str]) {
    let mut cmd = Command::new(BIN);
    cmd.arg("certs")
        .arg("--out")
        .arg(out)
        .arg(format!("--trust-domain={trust_domain}"));
    for w in workloads {
        cmd.arg(format!("--workload={w}"));
    }
    let o = cmd.output().expect("spawn aether-proxy certs");
    assert!(
        o.status.success(),
        "aether-proxy certs failed: {:?}\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Lower-case hex SHA-256.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(boring::sha::sha256(data))
}

/// The SPIFFE URI SANs of a DER certificate, in order.
pub fn spiffe_ids_of(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) if u.starts_with("spiffe://") => {
                Some(u.to_string())
            }
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The proxy process
// ---------------------------------------------------------------------------------------------

/// A running `aether-proxy run`, killed (SIGKILL) and reaped on drop.
///
/// Its config and catalog live in a temp dir next to `stdout.log` (the JSON access log) and
/// `stderr.log` (its logs). When a test panics, dropping the proxy prints the tail of its stderr.
pub struct Proxy {
    child: Option<Child>,
    dir: tempfile::TempDir,
    admin: SocketAddr,
    exit: Option<ExitStatus>,
}

/// Options for [`Proxy`]; [`Proxy::start`] is `Proxy::builder(..).start()`.
pub struct ProxyBuilder {
    config: String,
    catalog: String,
    env: Vec<(String, String)>,
    args: Vec<String>,
    wait_ready: bool,
}

impl ProxyBuilder {
    /// Sets an environment variable (default: `RUST_LOG=info,aether_proxy=debug`).
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }
    /// Extra arguments after `run --config <file>` (e.g. `--concurrency 1`).
    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.into());
        self
    }
    /// Do not wait for `/readyz` 200 (readiness tests wait themselves).
    pub fn no_wait(mut self) -> Self {
        self.wait_ready = false;
        self
    }

    pub async fn start(self) -> Proxy {
        let dir = tempfile::Builder::new()
            .prefix("aether-proxy-")
            .tempdir()
            .expect("temp dir");
        let catalog_path = dir.path().join("catalog.yaml");
        fs::write(&catalog_path, &self.catalog).expect("write catalog");

        // The harness owns three things in the config: the catalog path (unless the test set
        // one), and it insists on explicit listen addresses, so two tests never share a port.
        let mut cfg: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&self.config).expect("config is YAML");
        let map = cfg.as_mapping_mut().expect("config is a YAML mapping");
        let get = |map: &serde_yaml_ng::Mapping, a: &str, b: &str| {
            map.get(a)
                .and_then(|v| v.get(b))
                .and_then(|v| v.as_str())
                .map(str::to_string)
        };
        for section in ["inbound", "outbound", "admin"] {
            assert!(
                get(map, section, "listen").is_some(),
                "test configs must set {section}.listen (the default is shared by every test)"
            );
        }
        let admin: SocketAddr = get(map, "admin", "listen")
            .unwrap()
            .parse()
            .expect("admin.listen is host:port");
        if get(map, "catalog", "path").is_none() {
            let mut c = serde_yaml_ng::Mapping::new();
            c.insert(
                "path".into(),
                catalog_path.to_string_lossy().into_owned().into(),
            );
            map.insert("catalog".into(), c.into());
        }
        let config_path = dir.path().join("config.yaml");
        fs::write(&config_path, serde_yaml_ng::to_string(&cfg).unwrap()).expect("write config");

        let stdout = fs::File::create(dir.path().join("stdout.log")).expect("stdout.log");
        let stderr = fs::File::create(dir.path().join("stderr.log")).expect("stderr.log");
        let mut cmd = Command::new(BIN);
        cmd.arg("run")
            .arg("--config")
            .arg(&config_path)
            .args(&self.args)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .env("RUST_LOG", "info,aether_proxy=debug");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn aether-proxy run");
        let mut proxy = Proxy {
            child: Some(child),
            dir,
            admin,
            exit: None,
        };
        if self.wait_ready {
            proxy.wait_ready(READY_TIMEOUT).await;
        }
        proxy
    }
}

impl Proxy {
    /// Writes `config_yaml` and `catalog_yaml` into a temp dir, runs the proxy and waits until
    /// its `/readyz` answers 200. The config must set `inbound.listen`, `outbound.listen` and
    /// `admin.listen`; `catalog.path` is filled in unless the config names one.
    pub async fn start(config_yaml: &str, catalog_yaml: &str) -> Proxy {
        Proxy::builder(config_yaml, catalog_yaml).start().await
    }

    pub fn builder(config_yaml: &str, catalog_yaml: &str) -> ProxyBuilder {
        ProxyBuilder {
            config: config_yaml.to_string(),
            catalog: catalog_yaml.to_string(),
            env: Vec::new(),
            args: Vec::new(),
            wait_ready: true,
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("config.yaml")
    }
    pub fn catalog_path(&self) -> PathBuf {
        self.dir.path().join("catalog.yaml")
    }
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Polls `GET /readyz` until 200; panics (with the proxy's stderr) if the process exits or
    /// the deadline passes.
    pub async fn wait_ready(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut last;
        loop {
            if let Some(status) = self.try_exit() {
                panic!(
                    "aether-proxy exited before it was ready ({status}); stderr:\n{}",
                    self.stderr()
                );
            }
            match http_get(self.admin, "/readyz").await {
                Ok(r) if r.status == StatusCode::OK => return,
                Ok(r) => last = format!("{} {}", r.status, r.text()),
                Err(e) => last = e,
            }
            if Instant::now() >= deadline {
                panic!(
                    "aether-proxy not ready after {limit:?} (last /readyz: {last}); stderr:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `GET` on the admin listener.
    pub async fn admin_get(&self, path: &str) -> Result<Reply, String> {
        http_get(self.admin, path).await
    }

    /// `POST` on the admin listener.
    pub async fn admin_post(&self, path: &str) -> Result<Reply, String> {
        let tcp = tcp_connect(self.admin).await?;
        let req = Request::post(path)
            .header(http::header::HOST, self.admin.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap();
        HttpClient::h1(tcp).await?.send(req).await
    }

    /// Everything the proxy wrote to stdout so far, line by line.
    pub fn stdout_lines(&self) -> Vec<String> {
        fs::read_to_string(self.dir.path().join("stdout.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The stdout lines that are JSON objects (the access log).
    pub fn access_log(&self) -> Vec<serde_json::Value> {
        self.stdout_lines()
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.is_object())
            .collect()
    }

    /// Polls the access log until a line matches `pred`; returns it, or panics after `limit`.
    pub async fn wait_access_log(
        &self,
        limit: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = self.access_log().into_iter().find(|v| pred(v)) {
                return v;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no matching access-log line after {limit:?}; stdout:\n{}",
                    self.stdout_lines().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Everything the proxy wrote to stderr so far.
    pub fn stderr(&self) -> String {
        fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// Sends a signal (e.g. `libc::SIGTERM`) to the process.
    pub fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) with our own child's pid; no memory is involved.
            unsafe {
                libc::kill(pid as i32, sig);
            }
        }
    }

    /// The exit status if the process has exited (non-blocking).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            if let Some(c) = self.child.as_mut() {
                self.exit = c.try_wait().ok().flatten();
            }
        }
        self.exit
    }

    /// Polls until the process exits; `None` if it is still running after `limit`.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.try_exit() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            let err = self.stderr();
            let tail: Vec<&str> = err.lines().rev().take(60).collect();
            eprintln!(
                "---- aether-proxy stderr (last {} lines, {}) ----",
                tail.len(),
                self.dir.path().display()
            );
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Test apps
// ---------------------------------------------------------------------------------------------

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
    kind: AppKind,
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
            kind,
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

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    pub fn kind(&self) -> AppKind {
        self.kind
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
        wait_refused(addr).await;
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
    addr: SocketAddr,
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
            addr,
            connections,
            received,
            task,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
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

/// Polls until connecting to `addr` is refused (after stopping a server), bounded.
pub async fn wait_refused(addr: SocketAddr) {
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await {
            Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => return,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "{addr} still accepts connections"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// TLS client
// ---------------------------------------------------------------------------------------------

/// A TCP stream that keeps a copy of the first bytes it read (up to 64 KiB), so a test can see
/// exactly what the server sent, e.g. a plaintext alert before any TLS state exists.
pub struct Tap<S> {
    inner: S,
    read: Arc<Mutex<Vec<u8>>>,
}

const TAP_LIMIT: usize = 64 * 1024;

impl<S> Tap<S> {
    pub fn new(inner: S) -> Tap<S> {
        Tap {
            inner,
            read: Arc::new(Mutex::new(Vec::new())),
        }
    }
    /// The bytes read so far (up to 64 KiB).
    pub fn received(&self) -> Vec<u8> {
        self.read.lock().unwrap().clone()
    }
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tap<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let mut rec = this.read.lock().unwrap();
            let new = &buf.filled()[before..];
            let room = TAP_LIMIT.saturating_sub(rec.len());
            rec.extend_from_slice(&new[..new.len().min(room)]);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A client-side TLS connection made by [`TlsClient`].
pub type TlsStream = tokio_boring::SslStream<Tap<TcpStream>>;

/// Why a TLS connection attempt failed.
#[derive(Debug)]
pub struct TlsFailure {
    /// BoringSSL's error, or the I/O error / timeout.
    pub error: String,
    /// The raw bytes the server sent before the failure.
    pub received: Vec<u8>,
}

impl TlsFailure {
    /// The description of the fatal alert the server sent in plaintext as its first record
    /// (e.g. 112 = `unrecognized_name`), if it did.
    pub fn plaintext_alert(&self) -> Option<u8> {
        alert_description(&self.received)
    }
}

/// If `bytes` starts with a complete TLS alert record, its description byte.
pub fn alert_description(bytes: &[u8]) -> Option<u8> {
    match bytes {
        [0x15, 0x03, _, 0x00, 0x02, _level, desc, ..] => Some(*desc),
        _ => None,
    }
}

/// The TLS alert number of `unrecognized_name` (RFC 6066).
pub const ALERT_UNRECOGNIZED_NAME: u8 = 112;

/// A BoringSSL client: chosen client certificate (or none), SNI (or none), ALPN list; the server
/// is verified against the given CA, hostname verification is off (the mesh pins SPIFFE ids;
/// see [`peer_spiffe_id`]).
#[derive(Debug, Clone)]
pub struct TlsClient {
    ca: PathBuf,
    cert: Option<(PathBuf, PathBuf)>,
    sni: Option<String>,
    alpn: Vec<String>,
}

impl TlsClient {
    /// Trusts `ca` for the server; no client certificate, no SNI, no ALPN.
    pub fn new(ca: &Path) -> TlsClient {
        TlsClient {
            ca: ca.to_path_buf(),
            cert: None,
            sni: None,
            alpn: Vec::new(),
        }
    }
    /// Trusts `certs`' CA and presents its leaf `stem`.
    pub fn with_identity(certs: &Certs, stem: &str) -> TlsClient {
        TlsClient::new(&certs.ca()).cert(&certs.cert(stem), &certs.key(stem))
    }
    /// Presents this certificate chain and key.
    pub fn cert(mut self, cert: &Path, key: &Path) -> TlsClient {
        self.cert = Some((cert.to_path_buf(), key.to_path_buf()));
        self
    }
    /// Presents no certificate.
    pub fn no_cert(mut self) -> TlsClient {
        self.cert = None;
        self
    }
    /// The SNI to send; `None` sends no server_name extension at all.
    pub fn sni(mut self, sni: Option<&str>) -> TlsClient {
        self.sni = sni.map(str::to_string);
        self
    }
    /// ALPN protocols to offer, in preference order; empty offers no ALPN extension.
    pub fn alpn(mut self, protos: &[&str]) -> TlsClient {
        self.alpn = protos.iter().map(|p| p.to_string()).collect();
        self
    }

    fn config(&self) -> Result<boring::ssl::ConnectConfiguration, String> {
        fn e(what: &'static str) -> impl Fn(boring::error::ErrorStack) -> String {
            move |err| format!("{what}: {err}")
        }
        let mut b = SslConnector::builder(SslMethod::tls()).map_err(e("connector"))?;
        b.set_ca_file(&self.ca).map_err(e("CA file"))?;
        b.set_verify(SslVerifyMode::PEER);
        if let Some((cert, key)) = &self.cert {
            b.set_certificate_chain_file(cert)
                .map_err(e("client certificate"))?;
            b.set_private_key_file(key, SslFiletype::PEM)
                .map_err(e("client key"))?;
        }
        if !self.alpn.is_empty() {
            let mut wire = Vec::new();
            for p in &self.alpn {
                wire.push(p.len() as u8);
                wire.extend_from_slice(p.as_bytes());
            }
            b.set_alpn_protos(&wire).map_err(e("ALPN"))?;
        }
        Ok(b.build()
            .configure()
            .map_err(e("configure"))?
            .verify_hostname(false)
            .use_server_name_indication(self.sni.is_some()))
    }

    /// TCP connect plus TLS handshake, each bounded by [`IO_TIMEOUT`].
    ///
    /// With TLS 1.3 the server checks the client certificate after the client has finished, so
    /// a refused client certificate usually shows up on the first read, not here.
    pub async fn connect(&self, addr: SocketAddr) -> Result<TlsStream, TlsFailure> {
        let fail = |error: String| TlsFailure {
            error,
            received: Vec::new(),
        };
        let cfg = self.config().map_err(fail)?;
        let tcp = tcp_connect(addr).await.map_err(fail)?;
        let tap = Tap::new(tcp);
        let received = tap.read.clone();
        let domain = self.sni.clone().unwrap_or_else(|| "no-sni.invalid".into());
        match within(
            IO_TIMEOUT,
            "TLS handshake",
            tokio_boring::connect(cfg, &domain, tap),
        )
        .await
        {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(TlsFailure {
                error: e.to_string(),
                received: received.lock().unwrap().clone(),
            }),
            Err(e) => Err(TlsFailure {
                error: e,
                received: received.lock().unwrap().clone(),
            }),
        }
    }
}

/// The ALPN protocol the server selected, if any.
pub fn negotiated_alpn(tls: &TlsStream) -> Option<String> {
    tls.ssl()
        .selected_alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned())
}

/// The SPIFFE ids in the server's leaf certificate.
pub fn peer_spiffe_ids(tls: &TlsStream) -> Vec<String> {
    tls.ssl()
        .peer_certificate()
        .and_then(|c| c.to_der().ok())
        .map(|d| spiffe_ids_of(&d))
        .unwrap_or_default()
}

/// The server's single SPIFFE id, if it has exactly one.
pub fn peer_spiffe_id(tls: &TlsStream) -> Option<String> {
    let ids = peer_spiffe_ids(tls);
    (ids.len() == 1).then(|| ids[0].clone())
}

// ---------------------------------------------------------------------------------------------
// Plain TCP helpers
// ---------------------------------------------------------------------------------------------

pub async fn tcp_connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let tcp = within(
        IO_TIMEOUT,
        &format!("connect {addr}"),
        TcpStream::connect(addr),
    )
    .await?
    .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// TCP connect from a chosen local address (e.g. a pod's [`PodNet::extra`] host, for
/// `source_identities`), bounded by [`IO_TIMEOUT`].
pub async fn tcp_connect_from(local: IpAddr, addr: SocketAddr) -> Result<TcpStream, String> {
    let sock = match local {
        IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(|e| format!("socket: {e}"))?;
    sock.bind(SocketAddr::new(local, 0))
        .map_err(|e| format!("bind {local}: {e}"))?;
    let tcp = within(IO_TIMEOUT, &format!("connect {addr}"), sock.connect(addr))
        .await?
        .map_err(|e| format!("connect {addr} from {local}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// How a read-until-end ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadEnd {
    /// Clean end of stream.
    Eof,
    /// A read error (reset, TLS alert, ...), with its text.
    Error(String),
    /// Still open when the bound passed.
    TimedOut,
}

/// Reads until EOF, an error or `limit`; returns what was read and how it ended.
pub async fn read_to_end_within<S: AsyncRead + Unpin>(
    s: &mut S,
    limit: Duration,
) -> (Vec<u8>, ReadEnd) {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return (out, ReadEnd::TimedOut),
            Ok(Ok(0)) => return (out, ReadEnd::Eof),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => return (out, ReadEnd::Error(e.to_string())),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP client
// ---------------------------------------------------------------------------------------------

/// A response, fully read.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// The `x-aether-error` reason, if the proxy answered itself.
    pub fn aether_error(&self) -> Option<&str> {
        self.header("x-aether-error")
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The body as JSON; panics with the body if it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.text()))
    }
}

/// An HTTP client connection (hyper's `client::conn`) over any stream: TLS, plain TCP, ...
/// Each request is bounded by [`IO_TIMEOUT`].
pub enum HttpClient {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl HttpClient {
    /// HTTP/1.1 over `io`.
    pub async fn h1<S>(io: S) -> Result<HttpClient, String>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (send, conn) = within(
            IO_TIMEOUT,
            "h1 handshake",
            hyper::client::conn::http1::handshake(TokioIo::new(io)),
        )
        .await?
        .map_err(|e| format!("h1 handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(HttpClient::H1(send))
    }

    /// HTTP/2 (prior knowledge, or after ALPN h2) over `io`.
    pub async fn h2<S>(io: S) -> Result<HttpClient, String>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (send, conn) = within(
            IO_TIMEOUT,
            "h2 handshake",
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)),
        )
        .await?
        .map_err(|e| format!("h2 handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(HttpClient::H2(send))
    }

    pub fn is_h2(&self) -> bool {
        matches!(self, HttpClient::H2(_))
    }

    /// Sends `req` and reads the whole response.
    ///
    /// The URI may be absolute (`http://payments.aether.internal/x`) or origin-form with a
    /// `Host` header; it is put in the form the protocol wants: origin-form plus `Host` for
    /// HTTP/1.1, absolute (`:authority`) for HTTP/2. An absolute-form HTTP/1.1 request can be
    /// sent with [`HttpClient::send_raw`].
    pub async fn send(&mut self, req: Request<Full<Bytes>>) -> Result<Reply, String> {
        let req = if self.is_h2() {
            to_h2_form(req)?
        } else {
            to_h1_form(req)?
        };
        self.send_raw(req).await
    }

    /// Sends `req` exactly as given.
    pub async fn send_raw(&mut self, req: Request<Full<Bytes>>) -> Result<Reply, String> {
        let fut = async {
            let resp = match self {
                HttpClient::H1(s) => {
                    s.ready().await.map_err(|e| format!("h1 not ready: {e}"))?;
                    s.send_request(req).await
                }
                HttpClient::H2(s) => {
                    s.ready().await.map_err(|e| format!("h2 not ready: {e}"))?;
                    s.send_request(req).await
                }
            }
            .map_err(|e| format!("request failed: {e}"))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| format!("reading the response body: {e}"))?
                .to_bytes();
            Ok(Reply {
                status: parts.status,
                version: parts.version,
                headers: parts.headers,
                body,
            })
        };
        within(IO_TIMEOUT, "HTTP request", fut).await?
    }

    /// `GET uri` with no extra headers.
    pub async fn get(&mut self, uri: &str) -> Result<Reply, String> {
        self.send(Request::get(uri).body(Full::new(Bytes::new())).unwrap())
            .await
    }
}

/// Why [`http_connect`] got no tunnel.
#[derive(Debug)]
pub enum TunnelError {
    /// The proxy answered, but not with 2xx (e.g. 400 `not-a-tcp-port`).
    Refused(Reply),
    /// No answer, or the upgrade failed.
    Failed(String),
}

/// An HTTP/1.1 `CONNECT authority` over `io`; on a 2xx answer, the raw tunnel.
pub async fn http_connect<S>(
    io: S,
    authority: &str,
) -> Result<TokioIo<hyper::upgrade::Upgraded>, TunnelError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let fail = TunnelError::Failed;
    let (mut send, conn) = within(
        IO_TIMEOUT,
        "h1 handshake",
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(io)),
    )
    .await
    .map_err(fail)?
    .map_err(|e| fail(format!("h1 handshake: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let req = Request::connect(authority)
        .header(http::header::HOST, authority)
        .body(Full::new(Bytes::new()))
        .map_err(|e| fail(format!("CONNECT request: {e}")))?;
    let resp = within(IO_TIMEOUT, "CONNECT", send.send_request(req))
        .await
        .map_err(fail)?
        .map_err(|e| fail(format!("CONNECT: {e}")))?;
    if !resp.status().is_success() {
        let (parts, body) = resp.into_parts();
        let body = within(IO_TIMEOUT, "CONNECT answer body", body.collect())
            .await
            .map_err(fail)?
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err(TunnelError::Refused(Reply {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body,
        }));
    }
    let upgraded = within(IO_TIMEOUT, "CONNECT upgrade", hyper::upgrade::on(resp))
        .await
        .map_err(fail)?
        .map_err(|e| fail(format!("CONNECT upgrade: {e}")))?;
    Ok(TokioIo::new(upgraded))
}

fn to_h1_form(mut req: Request<Full<Bytes>>) -> Result<Request<Full<Bytes>>, String> {
    if let Some(auth) = req.uri().authority().cloned() {
        if !req.headers().contains_key(http::header::HOST) {
            req.headers_mut().insert(
                http::header::HOST,
                auth.as_str().parse().map_err(|e| format!("host: {e}"))?,
            );
        }
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        *req.uri_mut() = pq.parse().map_err(|e| format!("uri: {e}"))?;
    }
    *req.version_mut() = Version::HTTP_11;
    Ok(req)
}

fn to_h2_form(mut req: Request<Full<Bytes>>) -> Result<Request<Full<Bytes>>, String> {
    if req.uri().authority().is_none() {
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("localhost")
            .to_string();
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        *req.uri_mut() = Uri::builder()
            .scheme("http")
            .authority(host)
            .path_and_query(pq)
            .build()
            .map_err(|e| format!("uri: {e}"))?;
    }
    req.headers_mut().remove(http::header::HOST);
    *req.version_mut() = Version::HTTP_2;
    Ok(req)
}

/// One plaintext HTTP/1.1 `GET` on a fresh connection (admin endpoints and the like).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<Reply, String> {
    let tcp = tcp_connect(addr).await?;
    let req = Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    HttpClient::h1(tcp).await?.send(req).await
}

/// A request builder result with an empty body; shorthand for tests.
pub fn get(uri: &str) -> http::request::Builder {
    Request::get(uri)
}

/// Finishes a builder with an empty body.
pub fn empty(b: http::request::Builder) -> Request<Full<Bytes>> {
    b.body(Full::new(Bytes::new())).expect("valid request")
}
