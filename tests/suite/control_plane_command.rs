//! `aether-proxy control-plane`: a catalog file served over delta ADS, as a real child process.
//! A sidecar in xDS mode fed by it routes to the file's pods and follows rewrites of the file
//! (endpoint and port added, endpoint removed); a killed control plane leaves the sidecar
//! serving what it had, and once restarted is reconnected to and serves a change made while it
//! was down; a broken or emptied rewrite changes nothing. Envoy, an independent client, accepts what it
//! serves and routes through it.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::common::envoy::{envoy_bin, sock, xds_cluster, Envoy};
use crate::common::mesh::*;
use crate::common::xds::{cp_addr, try_get, xds_client, PaymentsPod};
use crate::common::*;

const HOST: &str = "payments.aether.internal";
const LIMIT: Duration = Duration::from_secs(10);
/// The sidecar's reconnect backoff reaches 5 s; a reconnect is waited for longer than that.
const RECONNECT: Duration = Duration::from_secs(20);

/// The catalog: `payments` with endpoints (pod proxy address, ports).
fn catalog(certs: &Certs, endpoints: &[(IpAddr, &[u16])]) -> String {
    let mut y = format!(
        "services:\n  payments:\n    default_port: 8080\n    identity: {}\n    endpoints:\n",
        certs.spiffe_id(PAYMENTS)
    );
    if endpoints.is_empty() {
        y = y.replace("    endpoints:\n", "    endpoints: []\n");
    }
    for (ip, ports) in endpoints {
        y.push_str(&format!("      - {{ address: {ip}, ports: {ports:?} }}\n"));
    }
    y
}

/// Replaces the file as tools do: a new file renamed over the old one.
fn write_catalog(path: &Path, yaml: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The `control-plane` child process, its catalog file and its stderr.
struct ControlPlane {
    child: Option<Child>,
    dir: tempfile::TempDir,
    listen: String,
}

impl ControlPlane {
    async fn start(listen: &str, yaml: &str) -> ControlPlane {
        let dir = tempfile::Builder::new().prefix("cp-").tempdir().unwrap();
        let mut cp = ControlPlane {
            child: None,
            dir,
            listen: listen.to_string(),
        };
        write_catalog(&cp.catalog(), yaml);
        cp.spawn().await;
        cp
    }

    fn catalog(&self) -> PathBuf {
        self.dir.path().join("catalog.yaml")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("control-plane.log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Starts the process (again) and waits until its listener accepts.
    async fn spawn(&mut self) {
        assert!(self.child.is_none());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let child = Command::new(BIN)
            .arg("control-plane")
            .arg("--catalog")
            .arg(self.catalog())
            .args(["--listen", &self.listen])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn control-plane");
        self.child = Some(child);
        let listen = self.listen.clone();
        eventually(LIMIT, "the control plane listening", async || {
            if let Some(status) = self.try_exit() {
                panic!("control-plane exited ({status}); log:\n{}", self.log());
            }
            match listen.strip_prefix("unix://") {
                Some(path) => tokio::net::UnixStream::connect(path)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string()),
                None => tcp_connect(listen.parse::<SocketAddr>().unwrap())
                    .await
                    .map(drop),
            }
        })
        .await;
    }

    fn try_exit(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().unwrap()
    }

    fn kill(&mut self) {
        let mut c = self.child.take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// SIGTERM, and the exit status within 5 s.
    async fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.as_ref().expect("running").id();
        // SAFETY: a plain kill(2) of our own child.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        let status = eventually(Duration::from_secs(5), "exit after SIGTERM", async || {
            self.try_exit().ok_or_else(String::new)
        })
        .await;
        self.child = None;
        status
    }

    async fn wait_log(&self, what: &str) {
        eventually(
            LIMIT,
            &format!("{what:?} in the control plane's log"),
            async || holds(self.log().contains(what)),
        )
        .await
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- control-plane log ----\n{}", self.log());
        }
    }
}

/// GET `authority` through the client's outbound listener: the app's port, or the proxy's
/// status and reason.
async fn answer(out: SocketAddr, authority: &str) -> Result<u16, String> {
    let r = try_get(out, authority, "/").await?;
    match r.header("x-app-port") {
        Some(p) if r.status.as_u16() == 200 => Ok(p.parse().unwrap()),
        _ => Err(format!("{} {:?}", r.status, r.aether_error())),
    }
}

async fn wait_answer(out: SocketAddr, authority: &str, port: u16) {
    eventually(
        LIMIT,
        &format!("{authority} answered by the app on {port}"),
        async || match answer(out, authority).await {
            Ok(p) if p == port => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .await
}

/// The endpoint addresses `/clusters` shows for `cluster`, sorted.
async fn endpoints_of(p: &Proxy, cluster: &str) -> Vec<String> {
    let v = p.admin_get("/clusters").await.unwrap().json();
    let mut eps: Vec<String> = v["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["name"] == cluster)
        .flat_map(|c| c["endpoints"].as_array().cloned().unwrap_or_default())
        .map(|e| e["address"].as_str().unwrap_or_default().to_string())
        .collect();
    eps.sort();
    eps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_follows_the_catalog_file_it_serves() {
    let net = Net::fresh();
    let certs = certs();
    let (s1, s2) = (
        PaymentsPod::start(&certs, net.pod(1)).await,
        PaymentsPod::start(&certs, net.pod(2)).await,
    );
    let (ip1, ip2) = (net.pod(1).proxy_ip(), net.pod(2).proxy_ip());
    let listen = cp_addr(&net).to_string();
    let mut cp = ControlPlane::start(&listen, &catalog(&certs, &[(ip1, &[8080])])).await;
    let client = xds_client(&certs, net.pod(0), &listen, &[], "").await;
    let out = net.pod(0).outbound();

    assert_eq!(answer(out, HOST).await, Ok(8080));
    assert_eq!(s1.app8080.seen().len(), 1);
    // The file lists every port: one no endpoint serves does not exist.
    let nine = format!("{HOST}:9090");
    assert_eq!(
        answer(out, &nine).await,
        Err("503 Service Unavailable Some(\"port-not-exposed\")".into())
    );

    // A port added to the endpoint.
    write_catalog(&cp.catalog(), &catalog(&certs, &[(ip1, &[8080, 9090])]));
    wait_answer(out, &nine, 9090).await;
    assert_eq!(s1.app9090.seen().len(), 1);

    // An endpoint added: the second pod gets requests too.
    write_catalog(
        &cp.catalog(),
        &catalog(&certs, &[(ip1, &[8080, 9090]), (ip2, &[8080])]),
    );
    eventually(LIMIT, "a request reaching the second pod", async || {
        answer(out, HOST).await?;
        holds(!s2.app8080.seen().is_empty())
    })
    .await;

    // The first endpoint removed: nothing goes to it any more.
    write_catalog(&cp.catalog(), &catalog(&certs, &[(ip2, &[8080])]));
    let only = vec![format!("{ip2}:15008")];
    eventually(LIMIT, "the first pod gone from the cluster", async || {
        let eps = endpoints_of(&client, HOST).await;
        (eps == only).then_some(()).ok_or(format!("{eps:?}"))
    })
    .await;
    let before = s1.app8080.seen().len();
    for _ in 0..10 {
        assert_eq!(answer(out, HOST).await, Ok(8080));
    }
    assert_eq!(s1.app8080.seen().len(), before);
    // And with it port 9090.
    eventually(LIMIT, ":9090 gone", async || {
        match answer(out, &nine).await {
            Err(e) if e.contains("port-not-exposed") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    assert!(!cp.log().contains("NACK"), "{}", cp.log());
    let status = cp.terminate().await;
    assert_eq!(status.code(), Some(0), "{}", cp.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_control_plane_costs_no_request_and_its_restart_is_picked_up() {
    let net = Net::fresh();
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, net.pod(1)).await;
    let ip1 = net.pod(1).proxy_ip();
    let sock_dir = tempfile::tempdir().unwrap();
    let listen = format!("unix://{}", sock_dir.path().join("xds.sock").display());
    let mut cp = ControlPlane::start(&listen, &catalog(&certs, &[(ip1, &[8080])])).await;
    let client = xds_client(&certs, net.pod(0), &listen, &[], "").await;
    let out = net.pod(0).outbound();
    let nine = format!("{HOST}:9090");

    assert_eq!(answer(out, HOST).await, Ok(8080));
    wait_metric(&client, "aether_xds_connected", &[], LIMIT, |v| v == 1.0).await;

    // SIGKILL: no goodbye; the socket file stays behind.
    cp.kill();
    wait_metric(&client, "aether_xds_connected", &[], LIMIT, |v| v == 0.0).await;
    for _ in 0..5 {
        assert_eq!(answer(out, HOST).await, Ok(8080), "what the sidecar had");
    }
    // A change made while nobody serves.
    write_catalog(&cp.catalog(), &catalog(&certs, &[(ip1, &[8080, 9090])]));
    cp.spawn().await;
    wait_metric(&client, "aether_xds_connected", &[], RECONNECT, |v| {
        v == 1.0
    })
    .await;
    wait_answer(out, &nine, 9090).await;
    assert_eq!(s1.app9090.seen().len(), 1);

    // A broken rewrite: logged, and the last good catalog stays served.
    std::fs::write(cp.catalog(), "services: [\n").unwrap();
    cp.wait_log("catalog reload failed").await;
    cp.wait_log("expected a map at line 1").await;
    // A truncated file, as a writer leaves it before writing: not an empty mesh.
    std::fs::write(cp.catalog(), "").unwrap();
    cp.wait_log("catalog.yaml: empty file").await;
    assert_eq!(cp.try_exit(), None);
    assert_eq!(answer(out, HOST).await, Ok(8080));
    assert_eq!(answer(out, &nine).await, Ok(9090));
    // A new stream now gets the last good catalog too.
    let other = xds_client(&certs, net.pod(3), &listen, &[], "").await;
    assert_eq!(answer(net.pod(3).outbound(), &nine).await, Ok(9090));
    drop(other);
    // The next good file is served again.
    write_catalog(&cp.catalog(), &catalog(&certs, &[(ip1, &[8080])]));
    eventually(LIMIT, ":9090 gone", async || {
        match answer(out, &nine).await {
            Err(e) if e.contains("port-not-exposed") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        metric(&client, "aether_xds_updates_total", &["result=\"error\""]).await,
        0.0
    );

    let status = cp.terminate().await;
    assert_eq!(status.code(), Some(0), "{}", cp.log());
    assert!(
        !sock_dir.path().join("xds.sock").exists(),
        "the socket is removed on exit"
    );
}

/// Envoy 1.40, with a static listener and every Cluster from the control plane (delta ADS,
/// wildcard CDS), accepts all of them with their endpoints and routes through one to a pod.
/// The certificate and trust bundle the Clusters name (`default`, `ROOTCA`) are its bootstrap's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_accepts_what_it_serves() {
    let (bin, version) = envoy_bin();
    let net = Net::fresh();
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, net.pod(1)).await;
    let (ip1, ip2) = (net.pod(1).proxy_ip(), net.pod(2).proxy_ip());
    let yaml = format!(
        "services:\n  payments:\n    default_port: 8080\n    identity: {}\n\
         \x20   protocols: {{ 5432: tcp }}\n    connect_timeout: 2s\n    request_timeout: 1500ms\n\
         \x20   max_requests_per_connection: 100\n    circuit_breakers: {{ max_requests: 50 }}\n\
         \x20   routes:\n      - {{ match: {{ header: x-canary, value: \"1\" }}, subset: {{ version: v2 }} }}\n\
         \x20   endpoints:\n\
         \x20     - {{ address: {ip1}, ports: [8080, 9090, 5432], locality: r1/z1, labels: {{ version: v1 }}, weight: 3 }}\n\
         \x20     - {{ address: {ip2}, locality: r1/z2, labels: {{ version: v2 }}, draining: true }}\n",
        certs.spiffe_id(PAYMENTS)
    );
    let cp_at = cp_addr(&net);
    let mut cp = ControlPlane::start(&cp_at.to_string(), &yaml).await;
    let (admin, outbound) = (net.pod(0).admin(), net.pod(0).outbound());
    let envoy = Envoy::start_with(&bin, &version, admin, |access_log| {
        envoy_bootstrap(&certs, cp_at, admin, outbound, access_log)
    })
    .await;

    let clusters = [
        HOST,
        "payments.aether.internal:9090",
        "payments.aether.internal:5432",
    ];
    eventually(
        LIMIT,
        "Envoy's /clusters with every Cluster and its pod",
        async || {
            let text = http_get(admin, "/clusters").await?.text();
            for c in clusters {
                let line = format!("{c}::{ip1}:15008::health_flags::healthy");
                if !text.contains(&line) {
                    return Err(format!("no {line:?} in:\n{text}"));
                }
            }
            // The draining pod is there, as draining (Envoy's EDS health flag).
            let draining = format!("{HOST}::{ip2}:15008::health_flags::/eds_status_draining");
            holds(text.contains(&draining)).map_err(|_| format!("no {draining:?} in:\n{text}"))
        },
    )
    .await;
    let stats = http_get(admin, "/stats?filter=update_rejected")
        .await
        .unwrap()
        .text();
    for line in stats.lines().filter(|l| l.contains("update_rejected")) {
        assert!(
            line.ends_with(": 0"),
            "Envoy rejected an update: {line}\n{stats}"
        );
    }
    assert!(!cp.log().contains("NACK"), "{}", cp.log());

    // Through Envoy's listener, upstream TLS pinned to the pod's identity.
    let r = try_get(outbound, HOST, "/via-envoy").await.unwrap();
    assert_eq!(r.status.as_u16(), 200, "{r:?}\n{}", envoy.log());
    assert_eq!(r.header("x-app-port"), Some("8080"));
    assert!(s1.app8080.seen().iter().any(|s| s.uri == "/via-envoy"));

    assert_eq!(cp.terminate().await.code(), Some(0));
}

fn envoy_bootstrap(
    certs: &Certs,
    cp: SocketAddr,
    admin: SocketAddr,
    outbound: SocketAddr,
    access_log: &Path,
) -> serde_json::Value {
    use serde_json::json;
    let file = |p: PathBuf| json!({ "filename": p.to_string_lossy() });
    json!({
        "node": { "id": "envoy~test", "cluster": "frontend" },
        "admin": { "address": sock(admin) },
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{ "envoy_grpc": { "cluster_name": "xds" } }]
            },
            "cds_config": { "ads": {}, "resource_api_version": "V3" }
        },
        "static_resources": {
            "secrets": [
                { "name": "default", "tls_certificate": {
                    "certificate_chain": file(certs.cert("frontend")),
                    "private_key": file(certs.key("frontend"))
                } },
                { "name": "ROOTCA", "validation_context": { "trusted_ca": file(certs.ca()) } }
            ],
            "clusters": [xds_cluster(cp)],
            "listeners": [{
                "name": "outbound",
                "address": sock(outbound),
                "filter_chains": [{ "filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "outbound",
                        "access_log": [{
                            "name": "envoy.access_loggers.file",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                                "path": access_log.to_string_lossy()
                            }
                        }],
                        "route_config": {
                            "name": "outbound",
                            "validate_clusters": false,
                            "virtual_hosts": [{
                                "name": "payments",
                                "domains": [HOST],
                                "routes": [{ "match": { "prefix": "/" }, "route": { "cluster": HOST } }]
                            }]
                        },
                        "http_filters": [{
                            "name": "envoy.filters.http.router",
                            "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" }
                        }]
                    }
                }] }]
            }]
        }
    })
}
