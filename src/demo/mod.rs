//! `aether-proxy demo`: a complete mesh on loopback. Two `payments` pods (v1 serves 8080; v2
//! serves 8080, gRPC-style h2c on 9090 and raw TCP on 5432), a `frontend` client pod, their
//! sidecars as real child processes, demo apps served by this process, and a first round of
//! requests through the mesh so the addressing table is visible at once. With `--load`, traffic
//! of every kind for a set time after that (`load`), then the demo ends.

mod load;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::identity::certgen::{self, Workload};

const CLIENT_OUTBOUND: &str = "127.0.0.1:15001";
const CLIENT_ADMIN: &str = "127.0.0.1:15000";

struct Pod {
    name: &'static str,
    version: &'static str,
    proxy: &'static str,
    apps: &'static str,
    ports: &'static [u16],
}

const PODS: [Pod; 2] = [
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

/// Child processes, stopped (SIGTERM, then SIGKILL) when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // SAFETY: signalling our own child by pid.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
        }
        for c in &mut self.0 {
            for _ in 0..50 {
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

/// `load`: seconds of traffic after the first requests, then stop (instead of waiting for
/// Ctrl-C); the exit status says whether every request and tunnel succeeded.
pub fn main(load: Option<u64>) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dir = std::env::temp_dir().join(format!("aether-demo-{}", std::process::id()));
    let code = rt.block_on(run(&dir, load));
    let _ = std::fs::remove_dir_all(&dir);
    code
}

async fn run(dir: &Path, load: Option<u64>) -> ExitCode {
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("error: {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let workloads: Vec<Workload> = ["default/payments", "default/frontend"]
        .iter()
        .filter_map(|w| Workload::parse(w).ok())
        .collect();
    if let Err(e) = certgen::generate(&dir.join("certs"), "aether.local", &workloads) {
        eprintln!("error: making demo certificates: {e}");
        return ExitCode::FAILURE;
    }
    for pod in &PODS {
        for &port in pod.ports {
            let addr = SocketAddr::new(pod.apps.parse().unwrap(), port);
            if let Err(e) = start_app(addr, pod.name, port).await {
                eprintln!("error: demo app on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let files = match write_files(dir) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: writing demo configs: {e}");
            return ExitCode::FAILURE;
        }
    };
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("aether-proxy"));
    let mut children = Children(Vec::new());
    for (name, cfg) in &files {
        let log = std::fs::File::create(dir.join(format!("{name}.log")));
        let mut cmd = Command::new(&exe);
        // The sidecars die with the demo, however it ends.
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let spawned = cmd
            .args(["run", "--config"])
            .arg(cfg)
            .arg("--concurrency")
            .arg("1")
            .stdout(Stdio::null())
            .stderr(log.map(Stdio::from).unwrap_or(Stdio::null()))
            .spawn();
        match spawned {
            Ok(c) => children.0.push(c),
            Err(e) => {
                eprintln!("error: starting the {name} sidecar: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let admins: Vec<String> = std::iter::once(CLIENT_ADMIN.to_string())
        .chain(PODS.iter().map(|p| format!("{}:15000", p.proxy)))
        .collect();
    for admin in &admins {
        if !wait_ready(admin, Duration::from_secs(15)).await {
            eprintln!(
                "error: a sidecar did not become ready on {admin}; logs in {}",
                dir.display()
            );
            for (i, c) in children.0.iter_mut().enumerate() {
                if let Ok(Some(status)) = c.try_wait() {
                    eprintln!("  sidecar {} exited: {status}", files[i].0);
                }
            }
            return ExitCode::FAILURE;
        }
    }
    // Listening before saying "Ctrl-C stops the demo": a signal sent on reading that line
    // must stop the demo, not kill it.
    let stop = stop_signals();
    println!("aether-proxy demo: a frontend pod calls two payments pods through their sidecars.\n");
    println!("  frontend sidecar   outbound {CLIENT_OUTBOUND}   admin http://{CLIENT_ADMIN}");
    for p in &PODS {
        println!(
            "  {} sidecar  inbound {}:15008   apps {} ports {:?}",
            p.name, p.proxy, p.apps, p.ports
        );
    }
    println!("\nFirst requests through the mesh:");
    for (host, path) in [
        ("payments.aether.internal", "/"),
        ("payments.aether.internal:8080", "/"),
        ("payments.aether.internal:9090", "/"),
        ("payments.aether.internal:7777", "/"),
        ("ghost.aether.internal", "/"),
        ("evil.com", "/"),
    ] {
        println!("  {:<34} {}", host, probe(host, path).await);
    }
    println!(
        "  {:<34} {}",
        "CONNECT payments...:5432 (echo)",
        connect_probe().await
    );
    if let Some(secs) = load {
        let clean = load::run(CLIENT_OUTBOUND, secs).await;
        drop(children);
        return if clean {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    println!(
        "\nTry it yourself:\n  curl -H 'Host: payments.aether.internal:9090' http://{CLIENT_OUTBOUND}/\n  curl --http2-prior-knowledge http://{CLIENT_OUTBOUND}/ -H 'Host: payments.aether.internal:9090'\n  curl http://{CLIENT_ADMIN}/clusters\n  curl http://{CLIENT_ADMIN}/metrics\n  openssl s_client -connect {}:15008 -servername 9090 -alpn h2 -cert {c}/frontend.crt -key {c}/frontend.key -CAfile {c}/ca.crt\n\nCtrl-C stops the demo.",
        PODS[1].proxy,
        c = dir.join("certs").display()
    );
    wait_for_stop(stop).await;
    println!("stopping");
    drop(children);
    ExitCode::SUCCESS
}

type Signals = Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>;

/// SIGINT and SIGTERM, listened for from now on.
fn stop_signals() -> Signals {
    use tokio::signal::unix::{signal, SignalKind};
    Some((
        signal(SignalKind::interrupt()).ok()?,
        signal(SignalKind::terminate()).ok()?,
    ))
}

async fn wait_for_stop(signals: Signals) {
    match signals {
        Some((mut int, mut term)) => tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        },
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

fn write_files(dir: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let certs = dir.join("certs");
    let catalog = dir.join("catalog.yaml");
    let mut cat = String::from(
        "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    protocols: { 5432: tcp }\n    endpoints:\n",
    );
    for p in &PODS {
        cat.push_str(&format!(
            "      - {{ address: {}, ports: {:?}, locality: local/zone-a, labels: {{ version: {} }} }}\n",
            p.proxy, p.ports, p.version
        ));
    }
    std::fs::write(&catalog, cat)?;
    let identity = |sa: &str| {
        format!(
            "identity: {{ cert: {c}/{sa}.crt, key: {c}/{sa}.key, ca: {c}/ca.crt }}\n",
            c = certs.display()
        )
    };
    let mut files = Vec::new();
    let client = format!(
        "{}locality: local/zone-a\ninbound: {{ listen: 127.0.0.20:15008, app_host: 127.0.0.30, default_port: 8080 }}\noutbound: {{ listen: {CLIENT_OUTBOUND} }}\nadmin: {{ listen: {CLIENT_ADMIN} }}\ncatalog: {{ path: {} }}\ndrain: {{ notify: 1s, timeout: 5s }}\n",
        identity("frontend"),
        catalog.display()
    );
    let path = dir.join("frontend.yaml");
    std::fs::write(&path, client)?;
    files.push(("frontend".to_string(), path));
    for p in &PODS {
        let ports: Vec<String> = p
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
        let cfg = format!(
            "{}locality: local/zone-a\ninbound:\n  listen: {}:15008\n  app_host: {}\n  default_port: 8080\n  ports: [{}]\noutbound: {{ listen: {}:15001 }}\nadmin: {{ listen: {}:15000 }}\ncatalog: {{ path: {} }}\ndrain: {{ notify: 1s, timeout: 5s }}\n",
            identity("payments"),
            p.proxy,
            p.apps,
            ports.join(", "),
            p.proxy,
            p.proxy,
            catalog.display()
        );
        let path = dir.join(format!("{}.yaml", p.name));
        std::fs::write(&path, cfg)?;
        files.push((p.name.to_string(), path));
    }
    Ok(files)
}

/// The demo apps: HTTP on 8080 (h1 or h2c; `/16k` answers 16 KiB), h2c on 9090, a TCP echo on
/// 5432.
async fn start_app(addr: SocketAddr, pod: &'static str, port: u16) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                if port == 5432 {
                    let (mut r, mut w) = tcp.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                    return;
                }
                let svc = service_fn(move |req: Request<Incoming>| async move {
                    if req.uri().path() == "/16k" {
                        return Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                            &[b'x'; 16 * 1024],
                        ))));
                    }
                    let body = format!(
                        "hello from {pod}, port {port}, {:?}, x-forwarded-client-cert: {}\n",
                        req.version(),
                        req.headers()
                            .get("x-forwarded-client-cert")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("-")
                    );
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    Ok(())
}

async fn wait_ready(admin: &str, limit: Duration) -> bool {
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
async fn get(addr: &str, path: &str, host: &str) -> Result<(u16, String, String), String> {
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

async fn probe(host: &str, path: &str) -> String {
    match get(CLIENT_OUTBOUND, path, host).await {
        Ok((status, reason, _)) if !reason.is_empty() => format!("-> {status} {reason}"),
        Ok((status, _, body)) => {
            let short = body
                .split(", x-forwarded")
                .next()
                .unwrap_or(&body)
                .to_string();
            format!("-> {status} {short}")
        }
        Err(e) => format!("-> failed: {e}"),
    }
}

async fn connect_probe() -> String {
    let attempt = async {
        let mut tcp = TcpStream::connect(CLIENT_OUTBOUND).await?;
        tcp.write_all(
            b"CONNECT payments.aether.internal:5432 HTTP/1.1\r\nHost: payments.aether.internal:5432\r\n\r\n",
        )
        .await?;
        let mut head = [0u8; 1024];
        let n = tcp.read(&mut head).await?;
        let head = String::from_utf8_lossy(&head[..n]).to_string();
        if !head.starts_with("HTTP/1.1 200") {
            return Ok::<_, std::io::Error>(format!("-> {}", head.lines().next().unwrap_or("")));
        }
        tcp.write_all(b"ping through the tunnel").await?;
        tcp.shutdown().await?;
        let mut echo = String::new();
        tcp.read_to_string(&mut echo).await?;
        Ok(format!("-> 200, echoed {echo:?}"))
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => format!("-> failed: {e}"),
        Err(_) => "-> timed out".into(),
    }
}
