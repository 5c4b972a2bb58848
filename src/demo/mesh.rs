//! The demo's mesh: its pods and addresses, the sidecar processes and the apps, and what the
//! chaos soak does to them (stop and restart a sidecar, rewrite the catalog, re-issue the
//! certificates, restart the control plane).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};

use super::{apps, load};
use crate::identity::certgen::{self, Workload};

pub(super) const CLIENT_OUTBOUND: &str = "127.0.0.1:15001";
pub(super) const CLIENT_ADMIN: &str = "127.0.0.1:15000";

pub(super) struct Pod {
    pub(super) name: &'static str,
    pub(super) version: &'static str,
    pub(super) proxy: &'static str,
    pub(super) apps: &'static str,
    pub(super) ports: &'static [u16],
}

pub(super) const PODS: [Pod; 2] = [
    Pod {
        name: "payments-v1",
        version: "v1",
        proxy: "127.0.0.21",
        apps: "127.0.0.31",
        ports: &[8080],
    },
    Pod {
        name: "payments-v2",
        version: "v2",
        proxy: "127.0.0.22",
        apps: "127.0.0.32",
        ports: &[8080, 9090, 5432],
    },
];

/// The port a rollout adds to v2 in the chaos soak: its app listens from the start, the
/// catalog names it only while the rollout lasts.
pub(super) const ROLLOUT_PORT: u16 = 8081;

/// One sidecar process of the demo.
pub(super) struct Sidecar {
    pub(super) name: String,
    pub(super) config: PathBuf,
    pub(super) admin: String,
    pub(super) child: Option<Child>,
}

/// The demo's mesh: sidecar processes, the apps, the files they read. Dropping it stops the
/// sidecars (SIGTERM, then SIGKILL).
pub(super) struct Mesh {
    pub(super) dir: PathBuf,
    pub(super) exe: PathBuf,
    pub(super) sidecars: Vec<Sidecar>,
    pub(super) apps: Vec<apps::App>,
    /// With `chaos`, the sidecars read the catalog from this process (`control-plane`).
    pub(super) control_plane: Option<ControlPlane>,
}

/// The demo's control plane: a child process serving the catalog file over xDS.
pub(super) struct ControlPlane {
    pub(super) args: Vec<String>,
    pub(super) child: Option<Child>,
}

impl Mesh {
    pub(super) fn catalog_path(&self) -> PathBuf {
        self.dir.join("catalog.yaml")
    }

    /// Starts sidecar `i` (again); its log goes to `<name>.log` in the demo directory.
    pub(super) fn spawn(&mut self, i: usize) -> std::io::Result<()> {
        let sc = &mut self.sidecars[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", sc.name)));
        let mut cmd = Command::new(&self.exe);
        // The sidecars die with the demo, however it ends.
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd
            .args(["run", "--config"])
            .arg(&sc.config)
            .arg("--concurrency")
            .arg("1")
            .stdout(Stdio::null())
            .stderr(log.map(Stdio::from).unwrap_or(Stdio::null()))
            .spawn()?;
        sc.child = Some(child);
        Ok(())
    }

    /// SIGTERM to sidecar `i`, then its exit status once its drain ends (SIGKILL after
    /// `limit`, and `None`).
    pub(super) async fn stop(&mut self, i: usize, limit: Duration) -> Option<ExitStatus> {
        let mut child = self.sidecars[i].child.take()?;
        // SAFETY: signalling our own child by pid.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// The pid of sidecar `i`, while it runs.
    pub(super) fn pid(&self, i: usize) -> Option<u32> {
        self.sidecars[i].child.as_ref().map(|c| c.id())
    }

    /// Writes the catalog: both pods, and with `rollout` v2 serving [`ROLLOUT_PORT`] too while
    /// v1 is gone (a new version takes over, the old one drains).
    pub(super) fn write_catalog(&self, rollout: bool) -> std::io::Result<()> {
        let mut cat = String::from(
            "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    protocols: { 5432: tcp }\n    endpoints:\n",
        );
        for p in &PODS {
            let mut ports = p.ports.to_vec();
            if rollout {
                if p.version == "v1" {
                    continue;
                }
                ports.push(ROLLOUT_PORT);
            }
            cat.push_str(&format!(
                "      - {{ address: {}, ports: {:?}, locality: local/zone-a, labels: {{ version: {} }} }}\n",
                p.proxy, ports, p.version
            ));
        }
        // Written whole then renamed, as a config map update lands.
        let tmp = self.dir.join("catalog.yaml.new");
        std::fs::write(&tmp, cat)?;
        std::fs::rename(tmp, self.catalog_path())
    }

    /// Starts the control plane (again).
    pub(super) fn spawn_control_plane(&mut self) -> std::io::Result<()> {
        let Some(cp) = self.control_plane.as_mut() else {
            return Ok(());
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("control-plane.log"));
        let mut cmd = Command::new(&self.exe);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        cp.child = Some(
            cmd.args(&cp.args)
                .stdout(Stdio::null())
                .stderr(log.map(Stdio::from).unwrap_or(Stdio::null()))
                .spawn()?,
        );
        Ok(())
    }

    /// SIGKILLs the control plane (it gets no chance to say goodbye), waits `down`, starts
    /// it again; false when the sidecars have none.
    pub(super) async fn restart_control_plane(&mut self, down: Duration) -> Result<bool, String> {
        let Some(cp) = self.control_plane.as_mut() else {
            return Ok(false);
        };
        if let Some(mut c) = cp.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        tokio::time::sleep(down).await;
        self.spawn_control_plane()
            .map_err(|e| format!("starting the control plane: {e}"))?;
        Ok(true)
    }

    /// New leaf certificates from the same CA, written over the old ones.
    pub(super) fn rotate_certs(&self) -> Result<(), String> {
        certgen::generate(&self.dir.join("certs"), "aether.local", &workloads()).map(|_| ())
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        if let Some(c) = self.control_plane.as_mut().and_then(|cp| cp.child.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
        let children: Vec<&mut Child> = self
            .sidecars
            .iter_mut()
            .filter_map(|s| s.child.as_mut())
            .collect();
        for c in &children {
            // SAFETY: signalling our own child by pid.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
        }
        for c in children {
            for _ in 0..100 {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn workloads() -> Vec<Workload> {
    ["default/payments", "default/frontend"]
        .iter()
        .filter_map(|w| Workload::parse(w).ok())
        .collect()
}

pub(super) async fn start(dir: &Path, chaos: bool) -> Result<Mesh, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    certgen::generate(&dir.join("certs"), "aether.local", &workloads())
        .map_err(|e| format!("making demo certificates: {e}"))?;
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("aether-proxy"));
    let mut mesh = Mesh {
        dir: dir.to_path_buf(),
        exe,
        sidecars: Vec::new(),
        apps: Vec::new(),
        control_plane: None,
    };
    for pod in &PODS {
        let mut ports = pod.ports.to_vec();
        if chaos && pod.version == "v2" {
            ports.push(ROLLOUT_PORT);
        }
        for port in ports {
            let addr = SocketAddr::new(pod.apps.parse().expect("a literal address"), port);
            let app = apps::App::start(addr, pod.name)
                .await
                .map_err(|e| format!("demo app on {addr}: {e}"))?;
            mesh.apps.push(app);
        }
    }
    mesh.write_catalog(false)
        .map_err(|e| format!("writing the demo catalog: {e}"))?;
    if chaos {
        let catalog = mesh.catalog_path();
        mesh.control_plane = Some(ControlPlane {
            args: vec![
                "control-plane".into(),
                "--catalog".into(),
                catalog.display().to_string(),
                "--listen".into(),
                format!("unix://{}", xds_socket(dir).display()),
            ],
            child: None,
        });
        mesh.spawn_control_plane()
            .map_err(|e| format!("starting the control plane: {e}"))?;
    }
    for (name, config, admin) in
        write_configs(dir, chaos).map_err(|e| format!("writing demo configs: {e}"))?
    {
        mesh.sidecars.push(Sidecar {
            name,
            config,
            admin,
            child: None,
        });
    }
    for i in 0..mesh.sidecars.len() {
        mesh.spawn(i)
            .map_err(|e| format!("starting the {} sidecar: {e}", mesh.sidecars[i].name))?;
    }
    for i in 0..mesh.sidecars.len() {
        if !wait_ready(&mesh.sidecars[i].admin, Duration::from_secs(15)).await {
            let mut why = format!(
                "a sidecar did not become ready on {}; logs in {}",
                mesh.sidecars[i].admin,
                dir.display()
            );
            for sc in &mut mesh.sidecars {
                if let Some(Ok(Some(status))) = sc.child.as_mut().map(|c| c.try_wait()) {
                    why.push_str(&format!("\n  sidecar {} exited: {status}", sc.name));
                }
            }
            return Err(why);
        }
    }
    Ok(mesh)
}

/// Where the demo's control plane serves xDS (a socket file: no port to collide with).
fn xds_socket(dir: &Path) -> PathBuf {
    dir.join("xds.sock")
}

/// Each sidecar's config: (name, path, admin address).
fn write_configs(dir: &Path, chaos: bool) -> std::io::Result<Vec<(String, PathBuf, String)>> {
    let certs = dir.join("certs");
    // With chaos the catalog comes over xDS from the demo's control plane, which serves the
    // same file; without, each sidecar reads the file.
    let source = if chaos {
        format!(
            "discovery: {{ xds: {{ address: \"unix://{}\" }} }}",
            xds_socket(dir).display()
        )
    } else {
        format!(
            "catalog: {{ path: {} }}",
            dir.join("catalog.yaml").display()
        )
    };
    let identity = |sa: &str| {
        format!(
            "identity: {{ cert: {c}/{sa}.crt, key: {c}/{sa}.key, ca: {c}/ca.crt }}\n",
            c = certs.display()
        )
    };
    let mut files = Vec::new();
    let client = format!(
        "{}locality: local/zone-a\ninbound: {{ listen: 127.0.0.20:15008, app_host: 127.0.0.30, default_port: 8080 }}\noutbound: {{ listen: {CLIENT_OUTBOUND} }}\nadmin: {{ listen: {CLIENT_ADMIN} }}\n{source}\ndrain: {{ notify: 1s, timeout: 5s }}\n",
        identity("frontend"),
    );
    let path = dir.join("frontend.yaml");
    std::fs::write(&path, client)?;
    files.push(("frontend".to_string(), path, CLIENT_ADMIN.to_string()));
    for p in &PODS {
        let mut ports: Vec<String> = p
            .ports
            .iter()
            .map(|&port| {
                let proto = match port {
                    9090 => "h2",
                    5432 => "tcp",
                    _ => "auto",
                };
                format!("{{ port: {port}, protocol: {proto} }}")
            })
            .collect();
        if chaos && p.version == "v2" {
            ports.push(format!("{{ port: {ROLLOUT_PORT}, protocol: auto }}"));
        }
        let cfg = format!(
            "{}locality: local/zone-a\ninbound:\n  listen: {}:15008\n  app_host: {}\n  default_port: 8080\n  ports: [{}]\noutbound: {{ listen: {}:15001 }}\nadmin: {{ listen: {}:15000 }}\n{}\ndrain: {{ notify: 1s, timeout: 5s }}\n",
            identity("payments"),
            p.proxy,
            p.apps,
            ports.join(", "),
            p.proxy,
            p.proxy,
            source
        );
        let path = dir.join(format!("{}.yaml", p.name));
        std::fs::write(&path, cfg)?;
        files.push((p.name.to_string(), path, format!("{}:15000", p.proxy)));
    }
    Ok(files)
}

pub(super) async fn wait_ready(admin: &str, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if let Ok(r) = get(admin, "/readyz", admin).await {
            if r.0 == 200 {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A plain HTTP/1.1 GET; returns status, x-aether-error and body.
pub(super) async fn get(
    addr: &str,
    path: &str,
    host: &str,
) -> Result<(u16, String, String), String> {
    let mut send = load::h1_connect(addr).await?;
    let req = Request::get(path)
        .header("host", host)
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(5), send.send_request(req))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let reason = resp
        .headers()
        .get("x-aether-error")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).trim().to_string())
        .unwrap_or_default();
    Ok((status, reason, body))
}
