//! Helpers of the outbound tests (`tests/outbound_*.rs`): a client pod whose apps (the test)
//! talk plaintext to its outbound listener, server pods with their own proxies and apps, real
//! mTLS between them, all on loopback.
//!
//! Every test owns a loopback /24 from `Net::fresh()` (see `common`):
//! * pod 0 is the client pod: its proxy (identity `frontend`) on host `.2` (outbound :15001,
//!   admin :15000); the test's client sockets bind to its spare hosts when the source address
//!   matters (`source_identities`);
//! * pods 1.. are server pods: proxy on host `.(16i+2)`:15008, apps on `.(16i+1)`:<port>. The
//!   catalog lists them by their proxy address.
//!
//! * catalogs: [`service`], [`catalog`], [`endpoint`] and [`draining_endpoint`] write the YAML;
//!   [`server_proxy`] and [`client_proxy`] start the pods' proxies; [`OnePodMesh`] is the
//!   smallest whole mesh (a client pod, one `payments` pod);
//! * answers: [`assert_proxy_error`] (a proxy-made error) and [`assert_app_ok`] (an app's 200);
//! * raw HTTP/1.1 ([`raw_exchange`], [`read_head`]) for CONNECT and requests hyper's client will
//!   not write;
//! * [`grpc`]: a gRPC echo service and client; [`wire`]: a fake server pod that records what
//!   the client proxy puts on the wire; [`rogue`]: a fake server pod that refuses, resets or
//!   closes requests on purpose (`tests/retries.rs`).
//!
//! Not re-exported by `common`: a test file imports it with `use common::mesh::*;`.

pub mod grpc;
pub mod rogue;
pub mod wire;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use http::StatusCode;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

pub const TD: &str = "aether.local";
pub const PAYMENTS: &str = "default/payments";
pub const FRONTEND: &str = "default/frontend";
pub const ORDERS: &str = "default/orders";
pub const BATCH: &str = "default/batch";

/// The service every test calls, in its portless spelling.
pub const SVC: &str = "payments.aether.internal";

pub fn certs() -> Certs {
    Certs::new(TD, &[PAYMENTS, FRONTEND, ORDERS, BATCH])
}

// ---------------------------------------------------------------------------------------------
// Pods and catalogs
// ---------------------------------------------------------------------------------------------

/// A server pod's proxy: identity `stem`, default port 8080, `inbound.ports` as given.
pub async fn server_proxy(certs: &Certs, pod: PodNet, stem: &str, ports: &[&str]) -> Proxy {
    server_proxy_with(certs, pod, stem, ports, "").await
}

/// [`server_proxy`] whose config ends with `extra` (e.g. a `limits:` section).
pub async fn server_proxy_with(
    certs: &Certs,
    pod: PodNet,
    stem: &str,
    ports: &[&str],
    extra: &str,
) -> Proxy {
    let config = format!(
        "trust_domain: {TD}\n{}{}{extra}",
        certs.identity_yaml(stem),
        pod.listeners_yaml(8080, ports)
    );
    Proxy::start(&config, "services: {}\n").await
}

/// The client pod's proxy (identity `frontend`) with `catalog`; `extra` is appended to the
/// config (e.g. `source_identities`).
pub async fn client_proxy(certs: &Certs, pod: PodNet, catalog: &str, extra: &str) -> Proxy {
    client_proxy_builder(certs, pod, catalog, extra)
        .start()
        .await
}

pub fn client_proxy_builder(
    certs: &Certs,
    pod: PodNet,
    catalog: &str,
    extra: &str,
) -> ProxyBuilder {
    let config = format!(
        "trust_domain: {TD}\n{}{}{extra}",
        certs.identity_yaml("frontend"),
        pod.listeners_yaml(8080, &[])
    );
    Proxy::builder(&config, catalog)
}

/// One catalog endpoint line: the pod's proxy address and the ports it advertises.
pub fn endpoint(addr: IpAddr, ports: &[u16]) -> String {
    format!("      - {{ address: \"{addr}\", ports: {ports:?} }}\n")
}

pub fn draining_endpoint(addr: IpAddr, ports: &[u16]) -> String {
    format!("      - {{ address: \"{addr}\", ports: {ports:?}, draining: true }}\n")
}

/// One service of a catalog: default port 8080, pinned to `identity`; `extra` holds more
/// service fields, each a line indented by four spaces.
pub fn service(name: &str, identity: &str, extra: &str, endpoints: &[String]) -> String {
    format!(
        "  {name}:\n    default_port: 8080\n    identity: {identity}\n{extra}    endpoints:\n{}",
        endpoints.concat()
    )
}

pub fn catalog(services: &[String]) -> String {
    format!("services:\n{}", services.concat())
}

/// A payments pod serving 8080 (`auto`) and 5432 (`tcp`), its proxy started, and the catalog
/// that lists it with 5432 marked `tcp`. The apps behind the ports are the caller's.
pub async fn payments_with_tcp_port(certs: &Certs, pod: PodNet) -> (Proxy, String) {
    let proxy = server_proxy(
        certs,
        pod,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 5432, protocol: tcp }",
        ],
    )
    .await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    protocols: { 5432: tcp }\n",
        &[endpoint(pod.proxy_ip(), &[8080, 5432])],
    )]);
    (proxy, cat)
}

// ---------------------------------------------------------------------------------------------
// The smallest mesh: one client pod, one payments pod
// ---------------------------------------------------------------------------------------------

/// The client pod (pod 0, `frontend`) whose catalog lists one service, `payments`, with one
/// endpoint: pod 1 (identity `payments`, 8080 `auto`, an `Auto` app behind it).
///
/// Fields drop in order: the client proxy first, then the server pod, the certificates last.
pub struct OnePodMesh {
    pub client: Proxy,
    pub server: Proxy,
    pub app: HttpApp,
    pub certs: Certs,
    pub client_pod: PodNet,
    pub server_pod: PodNet,
}

/// What a [`OnePodMesh`] adds to the plain setup; each part is empty by default.
#[derive(Default, Clone, Copy)]
pub struct OnePodExtras<'a> {
    /// Appended to the server pod's config (e.g. `limits:`).
    pub server_config: &'a str,
    /// More fields of the `payments` service, each a line indented by four spaces.
    pub service: &'a str,
    /// Appended to the client pod's config (e.g. `limits:`).
    pub client_config: &'a str,
}

impl OnePodMesh {
    pub async fn start() -> OnePodMesh {
        OnePodMesh::start_with(OnePodExtras::default()).await
    }

    pub async fn start_with(extras: OnePodExtras<'_>) -> OnePodMesh {
        let net = Net::fresh();
        let (client_pod, server_pod) = (net.pod(0), net.pod(1));
        let certs = certs();
        let app = HttpApp::auto(server_pod.app(8080)).await;
        let server = server_proxy_with(
            &certs,
            server_pod,
            "payments",
            &["{ port: 8080, protocol: auto }"],
            extras.server_config,
        )
        .await;
        let cat = catalog(&[service(
            "payments",
            &certs.spiffe_id(PAYMENTS),
            extras.service,
            &[endpoint(server_pod.proxy_ip(), &[8080])],
        )]);
        let client = client_proxy(&certs, client_pod, &cat, extras.client_config).await;
        OnePodMesh {
            client,
            server,
            app,
            certs,
            client_pod,
            server_pod,
        }
    }

    /// The client pod's outbound listener.
    pub fn outbound(&self) -> SocketAddr {
        self.client_pod.outbound()
    }

    /// Sends `req` through the client pod's outbound listener over HTTP/1.1.
    pub async fn send(&self, req: http::Request<http_body_util::Full<bytes::Bytes>>) -> Reply {
        h1_to(self.outbound())
            .await
            .send(req)
            .await
            .expect("request through the mesh")
    }

    /// The request the app saw whose path ends with `suffix`.
    pub fn seen(&self, suffix: &str) -> Seen {
        self.app
            .seen()
            .into_iter()
            .find(|s| s.uri.ends_with(suffix))
            .unwrap_or_else(|| panic!("the app never saw {suffix}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Client side helpers
// ---------------------------------------------------------------------------------------------

pub async fn h1_to(addr: SocketAddr) -> HttpClient {
    HttpClient::h1(tcp_connect(addr).await.unwrap())
        .await
        .unwrap()
}

pub async fn h2_to(addr: SocketAddr) -> HttpClient {
    HttpClient::h2(tcp_connect(addr).await.unwrap())
        .await
        .unwrap()
}

/// `GET path` with `Host: authority` on a fresh HTTP/1.1 connection to the outbound listener.
pub async fn get_h1(outbound: SocketAddr, authority: &str, path: &str) -> Reply {
    let req = empty(get(path).header("host", authority));
    h1_to(outbound)
        .await
        .send(req)
        .await
        .unwrap_or_else(|e| panic!("GET {path} (Host: {authority}): {e}"))
}

/// Asserts a proxy-made error answer: status, `x-aether-error` and a one-line text body.
#[track_caller]
pub fn assert_proxy_error(r: &Reply, status: u16, reason: &str, what: &str) {
    assert_eq!(
        r.status.as_u16(),
        status,
        "{what}: status; reply {r:?} body {:?}",
        r.text()
    );
    assert_eq!(
        r.aether_error(),
        Some(reason),
        "{what}: x-aether-error; reply {r:?}"
    );
    let body = r.text();
    let line = body.strip_suffix('\n').unwrap_or(&body);
    assert!(
        !line.trim().is_empty() && !line.contains('\n') && !line.contains('\r'),
        "{what}: the body is not one line of text: {body:?}"
    );
    assert!(
        r.header("x-app-port").is_none(),
        "{what}: an app answered, not the proxy: {r:?}"
    );
}

/// Asserts an app's answer: 200, from the app on `port`, no `x-aether-error`.
#[track_caller]
pub fn assert_app_ok(r: &Reply, port: u16, what: &str) {
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{what}: status; reply {r:?} body {:?}",
        r.text()
    );
    assert_eq!(r.aether_error(), None, "{what}: {r:?}");
    assert_eq!(
        r.header("x-app-port"),
        Some(port.to_string().as_str()),
        "{what}: answered by the wrong app port: {r:?}"
    );
}

/// The `/clusters` view of a proxy: (name, service, port, endpoint addresses) per cluster.
pub async fn clusters(p: &Proxy) -> Vec<(String, String, u64, Vec<String>)> {
    let r = p.admin_get("/clusters").await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "/clusters: {r:?}");
    let v = r.json();
    v["clusters"]
        .as_array()
        .unwrap_or_else(|| panic!("/clusters has no \"clusters\" array: {v}"))
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or_default().to_string(),
                c["service"].as_str().unwrap_or_default().to_string(),
                c["port"].as_u64().unwrap_or_default(),
                c["endpoints"]
                    .as_array()
                    .map(|eps| {
                        eps.iter()
                            .map(|e| e["address"].as_str().unwrap_or_default().to_string())
                            .collect()
                    })
                    .unwrap_or_default(),
            )
        })
        .collect()
}

/// The proxy's stderr without ANSI colour escapes.
pub fn plain_stderr(p: &Proxy) -> String {
    let s = p.stderr();
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Polls the proxy's log until `pred` holds for it; returns it, or panics after `limit`.
pub async fn wait_log(
    p: &Proxy,
    limit: Duration,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    let log = poll_until(limit, PACE, async || {
        let log = plain_stderr(p);
        if pred(&log) {
            Ok(log)
        } else {
            Err(log)
        }
    })
    .await;
    log.unwrap_or_else(|log| panic!("{what}: not in the proxy log after {limit:?}; log:\n{log}"))
}

/// The paths an app was asked for, in order (h1 origin-form and h2 absolute URIs alike).
pub fn paths(app: &HttpApp) -> Vec<String> {
    app.seen()
        .iter()
        .map(|s| {
            s.uri
                .parse::<http::Uri>()
                .map(|u| u.path().to_string())
                .unwrap_or_else(|_| s.uri.clone())
        })
        .collect()
}

/// The values of one header in an app's JSON echo body.
pub fn echoed_header(r: &Reply, name: &str) -> Vec<String> {
    r.json()["headers"][name]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The XFCC value a server proxy with identity `server` sets for a peer with leaf `client`.
pub fn expected_xfcc(certs: &Certs, server: &str, client_stem: &str, client: &str) -> String {
    format!(
        "By={};Hash={};URI={}",
        certs.spiffe_id(server),
        sha256_hex(&certs.leaf_der(client_stem)),
        certs.spiffe_id(client)
    )
}

// ---------------------------------------------------------------------------------------------
// Raw HTTP/1.1 (CONNECT and requests hyper's client will not write)
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
pub struct RawHead {
    /// The status line's version, as written (`HTTP/1.1`).
    pub version: String,
    pub status: u16,
    pub headers: Vec<(String, String)>,
}

impl RawHead {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one response head (up to the blank line) byte by byte, so nothing after it is
/// consumed; bounded by [`IO_TIMEOUT`].
pub async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> Result<RawHead, String> {
    let read = async {
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(0) => return Err(format!("EOF inside the response head: {head:?}")),
                Ok(_) => head.push(b[0]),
                Err(e) => return Err(format!("reading the response head: {e}")),
            }
            if head.len() > 64 * 1024 {
                return Err("response head over 64 KiB".into());
            }
        }
        Ok(head)
    };
    let head = within(IO_TIMEOUT, "response head", read).await??;
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split(' ');
    let version = parts.next().unwrap_or_default().to_string();
    let status = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(RawHead {
        version,
        status,
        headers,
    })
}

/// Reads a body of `content-length` bytes after [`read_head`].
pub async fn read_body(s: &mut TcpStream, head: &RawHead) -> Vec<u8> {
    let n: usize = head
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; n];
    within(IO_TIMEOUT, "response body", s.read_exact(&mut body))
        .await
        .unwrap()
        .unwrap();
    body
}

/// Writes `raw` on a fresh connection to `addr` and reads one full response.
pub async fn raw_exchange(addr: SocketAddr, raw: &str) -> (RawHead, String) {
    let mut s = tcp_connect(addr).await.unwrap();
    s.write_all(raw.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await.unwrap();
    let body = read_body(&mut s, &head).await;
    (head, String::from_utf8_lossy(&body).into_owned())
}

#[track_caller]
pub fn assert_raw_proxy_error(head: &RawHead, body: &str, status: u16, reason: &str, what: &str) {
    assert_eq!(head.status, status, "{what}: status; body {body:?}");
    assert_eq!(head.header("x-aether-error"), Some(reason), "{what}");
    let line = body.strip_suffix('\n').unwrap_or(body);
    assert!(
        !line.trim().is_empty() && !line.contains('\n'),
        "{what}: the body is not one line: {body:?}"
    );
}
