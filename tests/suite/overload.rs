//! Overload (SPEC section 13): a sidecar near its memory limit sheds new work, keeps admin and
//! the health listener, reports it, and is never killed for memory.
//!
//! The cgroup test puts a real sidecar in a memory cgroup (v1, as these machines have; needs
//! root) with a 64 MiB limit, created here and removed at the end, and floods it with mTLS
//! connections that each hold a half-sent request with large headers.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use boring::ssl::SslConnector;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::inbound::*;
use crate::common::mesh::*;
use crate::common::*;

/// A `payments` sidecar with a health listener; `extra` is appended to its config.
fn sidecar(certs: &Certs, pod: PodNet, extra: &str) -> ProxyBuilder {
    sidecar_with_ports(certs, pod, &[], extra)
}

fn sidecar_with_ports(certs: &Certs, pod: PodNet, ports: &[&str], extra: &str) -> ProxyBuilder {
    let config = format!(
        "trust_domain: {}\n{}{}health:\n  listen: {}\n{extra}",
        certs.trust_domain(),
        certs.identity_yaml("payments"),
        pod.listeners_yaml(8080, ports),
        health(pod),
    );
    Proxy::builder(&config, "services: {}\n")
}

/// A pod's network, with an app on 8080 behind its sidecar-to-be and the mesh certificates.
async fn payments_pod() -> (Net, PodNet, Certs, HttpApp) {
    let net = Net::fresh();
    let pod = net.pod(1);
    let app = HttpApp::auto(pod.app(8080)).await;
    (net, pod, certs(), app)
}

fn health(pod: PodNet) -> SocketAddr {
    SocketAddr::new(pod.proxy_ip(), 15021)
}

/// True when the peer closes `s` at once, having sent nothing.
async fn closed_at_once(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 16];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// With a configured limit below what the process needs to run, the sidecar is in step 2
/// from its first measurement: both data listeners close new connections at accept (counted),
/// `/readyz` and the health listener's `/healthz/ready` say `overloaded`, liveness and admin
/// keep answering, and the state is in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_its_configured_limit_a_sidecar_sheds_but_keeps_admin_and_health() {
    let (_net, pod, certs, _app) = payments_pod().await;
    let p = sidecar(&certs, pod, "overload:\n  memory_limit: 4Mi\n")
        .no_wait()
        .start()
        .await;

    let ready = eventually(
        Duration::from_secs(10),
        "/readyz says overloaded",
        async || {
            let r = p.admin_get("/readyz").await?;
            let body: serde_json::Value =
                serde_json::from_slice(&r.body).map_err(|e| e.to_string())?;
            holds(r.status == 503 && body["reason"] == "overloaded")
                .map(|_| body)
                .map_err(|_| format!("{} {}", r.status, r.text()))
        },
    )
    .await;
    assert_eq!(ready["status"], "not ready");
    let probe = http_get(health(pod), "/healthz/ready").await;
    assert_eq!(probe.status, 503);
    assert!(probe.text().contains("\"overloaded\""), "{}", probe.text());
    assert_eq!(http_get(health(pod), "/healthz").await.status, 200);

    for (listener, addr) in [("inbound", pod.inbound()), ("outbound", pod.outbound())] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_at_once(&mut s).await,
            "{listener}: a new connection stays open"
        );
        let labels = [&*format!("listener=\"{listener}\""), "reason=\"overload\""];
        wait_metric(
            &p,
            "aether_connections_rejected_total",
            &labels,
            FIVE_S,
            |v| v >= 1.0,
        )
        .await;
    }
    assert_eq!(metric(&p, "aether_overload_state", &[]).await, 2.0);
    assert_eq!(
        metric(&p, "aether_memory_limit_bytes", &[]).await,
        4194304.0
    );
    assert!(metric(&p, "aether_memory_used_bytes", &[]).await > 4194304.0);
    assert_eq!(metric(&p, "aether_ready", &[]).await, 0.0);
    let refused = ["action=\"refuse-connection\""];
    assert!(metric(&p, "aether_overload_actions_total", &refused).await >= 2.0);
    let released = ["action=\"release-idle\""];
    assert!(metric(&p, "aether_overload_actions_total", &released).await >= 1.0);
}

const FIVE_S: Duration = Duration::from_secs(5);

async fn http_get(addr: SocketAddr, path: &str) -> Reply {
    let mut c = h1_to(addr).await;
    c.get(&format!("http://{addr}{path}"))
        .await
        .unwrap_or_else(|e| panic!("GET {addr}{path}: {e}"))
}

/// A memory cgroup (v1) below this process's own, removed when dropped (after the processes
/// in it are gone).
struct MemoryCgroup(PathBuf);

impl MemoryCgroup {
    fn new(limit: u64) -> MemoryCgroup {
        let own = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let rel = own
            .lines()
            .find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, ctl, path) = (parts.next()?, parts.next()?, parts.next()?);
                ctl.split(',')
                    .any(|c| c == "memory")
                    .then(|| path.trim_start_matches('/'))
            })
            .expect("a cgroup v1 memory controller (this test needs one, and root)");
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let name = format!("aether-overload-test-{}-{n}", std::process::id());
        let dir = Path::new("/sys/fs/cgroup/memory").join(rel).join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let cg = MemoryCgroup(dir);
        cg.write("memory.limit_in_bytes", &limit.to_string());
        cg
    }

    fn write(&self, file: &str, v: &str) {
        std::fs::write(self.0.join(file), v)
            .unwrap_or_else(|e| panic!("{}/{file}: {e}", self.0.display()));
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.0.join(file)).unwrap_or_default()
    }

    /// Processes the kernel killed in this cgroup for memory (`oom_kill` in `oom_control`).
    fn oom_kills(&self) -> u64 {
        self.read("memory.oom_control")
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// `proxy` run through a wrapper that moves it into this cgroup before it starts, so it
    /// reads the limit as a pod's sidecar would.
    fn confine(&self, proxy: ProxyBuilder) -> ProxyBuilder {
        let procs = self.0.join("cgroup.procs");
        let procs = procs.to_string_lossy();
        proxy.wrap(&["sh", "-c", "echo $$ > \"$0\" && exec \"$@\"", &procs])
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // The proxy is dropped (killed) before this; its exit may take a moment to land.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("could not remove {}", self.0.display());
    }
}

/// One flood connection: mTLS as a real peer, then a request head of about 90 KiB that never
/// ends, so the sidecar must hold it (up to its head limit and header timeout).
async fn half_sent_request(
    client: &TlsClient,
    connector: &SslConnector,
    addr: SocketAddr,
) -> Result<TlsStream, String> {
    let mut tls = client
        .connect_using(connector, addr)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let mut head = b"GET /flood HTTP/1.1\r\nhost: payments.aether.internal\r\n".to_vec();
    let filler = "x".repeat(1000);
    for i in 0..88 {
        head.extend_from_slice(format!("x-fill-{i}: {filler}\r\n").as_bytes());
    }
    tls.write_all(&head).await.map_err(|e| e.to_string())?;
    tls.flush().await.map_err(|e| e.to_string())?;
    Ok(tls)
}

/// Floods a sidecar in a 64 MiB memory cgroup with 2,560 mTLS connections each holding a
/// 90 KiB half-sent request head, several hundred MiB had the sidecar taken them all, while a
/// kept connection sends a request every 100 ms. The sidecar is never OOM-killed; the kept
/// connection stays open, each answer 200 or 503 `overloaded`; the flood is refused and
/// counted; once the flood is gone the sidecar is ready again and the kept connection and new
/// ones are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_64_mib_cgroup_a_flood_is_shed_and_the_sidecar_never_killed() {
    let cgroup = MemoryCgroup::new(64 << 20);
    let (_net, pod, certs, _app) = payments_pod().await;
    let mut p = cgroup.confine(sidecar(&certs, pod, "")).start().await;
    let pid = p.pid().expect("the proxy's pid").to_string();
    assert!(
        cgroup.read("cgroup.procs").lines().any(|l| l == pid),
        "the proxy runs in the test's cgroup"
    );
    assert_eq!(
        metric(&p, "aether_memory_limit_bytes", &[]).await,
        (64u64 << 20) as f64
    );
    assert_eq!(metric(&p, "aether_overload_state", &[]).await, 0.0);

    let peer = frontend_peer(&certs, "payments.aether.internal", &["http/1.1"]);
    let mut kept = HttpClient::h1(tls_to(&peer, pod.inbound()).await)
        .await
        .unwrap();
    let url = "http://payments.aether.internal/kept";
    assert_eq!(kept.get(url).await.unwrap().status, 200);

    // The kept connection keeps asking while the flood runs.
    let stop = Arc::new(AtomicBool::new(false));
    let asker = tokio::spawn({
        let stop = stop.clone();
        async move {
            let (mut ok, mut shed) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                let r = kept.get(url).await.expect("the kept connection stays open");
                match (r.status.as_u16(), r.aether_error()) {
                    (200, _) => ok += 1,
                    (503, Some("overloaded")) => shed += 1,
                    other => panic!("the kept connection got {other:?}: {}", r.text()),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (kept, ok, shed)
        }
    });

    let t = std::time::Instant::now();
    let flood = flood(&p, &peer, pod.inbound()).await;
    assert!(
        p.try_exit().is_none(),
        "the sidecar died: {}",
        p.stderr_tail(20)
    );
    assert_eq!(cgroup.oom_kills(), 0, "the kernel killed for memory");
    assert!(
        flood.peak >= 1.0,
        "the flood never brought the sidecar to shed"
    );
    let rejected = ["listener=\"inbound\"", "reason=\"overload\""];
    let refused_by_proxy = metric(&p, "aether_connections_rejected_total", &rejected).await;
    assert!(
        refused_by_proxy >= 1.0,
        "no flood connection was refused at accept"
    );
    let closed = ["action=\"close-connection\""];
    eprintln!(
        "flood in {:?}: {} held, {} refused at the client, {refused_by_proxy} refused by the \
         proxy, peak step {}, {} closed by step 2",
        t.elapsed(),
        flood.held.len(),
        flood.refused,
        flood.peak,
        metric(&p, "aether_overload_actions_total", &closed).await,
    );

    // The flood ends; the sidecar comes back on its own.
    drop(flood);
    let t = std::time::Instant::now();
    eventually(
        Duration::from_secs(30),
        "/readyz 200 after the flood",
        async || {
            let r = p.admin_get("/readyz").await?;
            holds(r.status == 200).map_err(|_| r.text())
        },
    )
    .await;
    eprintln!("ready again {:?} after the flood", t.elapsed());
    stop.store(true, Ordering::Relaxed);
    let (mut kept, ok, shed) = asker.await.unwrap();
    eprintln!("the kept connection: {ok} answered, {shed} shed");
    // SPEC 13 step 1: new requests on a connection already open are answered 503 `overloaded`.
    assert!(
        shed >= 1,
        "no request on the kept connection was shed ({ok} answered)"
    );
    assert_eq!(
        kept.get(url).await.unwrap().status,
        200,
        "the kept connection after"
    );
    let mut fresh = HttpClient::h1(tls_to(&peer, pod.inbound()).await)
        .await
        .unwrap();
    assert_eq!(
        fresh.get(url).await.unwrap().status,
        200,
        "a new connection after"
    );
    assert_eq!(metric(&p, "aether_overload_state", &[]).await, 0.0);
    assert!(p.try_exit().is_none());
    assert_eq!(cgroup.oom_kills(), 0);
    drop(p);
}

/// What a flood left: the connections still open, those refused, the highest step seen.
struct Flood {
    held: Vec<TlsStream>,
    refused: usize,
    peak: f64,
}

/// 2,560 flood connections, 32 at a time, each a half-sent request of about 90 KiB; the
/// sidecar's overload step is sampled meanwhile (while its admin answers).
async fn flood(p: &Proxy, peer: &TlsClient, addr: SocketAddr) -> Flood {
    let held = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let refused = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let (peer, held, refused) = (peer.clone(), held.clone(), refused.clone());
        let connector = peer.connector().expect("the peer's TLS connector");
        tasks.spawn(async move {
            for _ in 0..80 {
                match half_sent_request(&peer, &connector, addr).await {
                    Ok(tls) => held.lock().await.push(tls),
                    Err(_) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
    }
    // Read from the text, not `metric`: the sidecar may be gone (the control test).
    let step = async || {
        let text = p
            .admin_get("/metrics")
            .await
            .map(|r| r.text())
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("aether_overload_state "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let mut peak = 0.0f64;
    while !tasks.is_empty() {
        tokio::select! {
            _ = tasks.join_next() => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => peak = peak.max(step().await),
        }
    }
    peak = peak.max(step().await);
    let held = std::mem::take(&mut *held.lock().await);
    Flood {
        held,
        refused: refused.load(Ordering::Relaxed),
        peak,
    }
}

/// The control: the same flood on a sidecar with overload off is killed by the kernel, so
/// the test above would fail without shedding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_64_mib_cgroup_the_same_flood_kills_a_sidecar_that_does_not_shed() {
    let cgroup = MemoryCgroup::new(64 << 20);
    let (_net, pod, certs, _app) = payments_pod().await;
    let off = "overload:\n  enabled: false\n";
    let mut p = cgroup.confine(sidecar(&certs, pod, off)).start().await;
    let peer = frontend_peer(&certs, "payments.aether.internal", &["http/1.1"]);
    let flood = flood(&p, &peer, pod.inbound()).await;
    assert_eq!(flood.peak, 0.0);
    let gone = p.wait_exit(Duration::from_secs(10)).await;
    eprintln!(
        "without shedding: {gone:?}, {} oom kills",
        cgroup.oom_kills()
    );
    assert!(
        gone.is_some(),
        "the sidecar survived the flood without shedding"
    );
    assert!(
        cgroup.oom_kills() >= 1,
        "the sidecar exited but was not killed for memory"
    );
}

/// Step 2. New connections are refused from step 1 on, so what grows past `close_at` grows on
/// connections already open: here uploads over HTTP/2 to an app that stops reading, which the
/// sidecar holds within its stream windows. Only closing connections brings use down: the ones
/// idle longest go first (24 keep-alive connections idle since their one request), the kept
/// connection asking every 100 ms stays and is served once use is down. Thresholds at 50% and
/// 60% of 64 MiB, so three uploads of 12 MiB reach step 2 well inside the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_64_mib_cgroup_step_2_closes_the_idlest_connections_first() {
    let cgroup = MemoryCgroup::new(64 << 20);
    let (_net, pod, certs, _app) = payments_pod().await;
    // The upload port's app accepts and never reads, with a small receive buffer, so what
    // the uploads send stays in the sidecar rather than in the kernel.
    let stalled = tokio::net::TcpSocket::new_v4().unwrap();
    stalled.set_recv_buffer_size(4096).unwrap();
    stalled.bind(pod.app(9090)).unwrap();
    let stalled = stalled.listen(16).unwrap();
    let stalled = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = stalled.accept().await {
            held.push(s);
        }
    });
    let ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 9090, protocol: auto }",
    ];
    let thresholds = "overload: { shed_at: 0.5, close_at: 0.6 }\n";
    let mut p = cgroup
        .confine(sidecar_with_ports(&certs, pod, &ports, thresholds))
        .start()
        .await;

    let peer = frontend_peer(&certs, "8080", &["http/1.1"]);
    let request = b"GET /idle HTTP/1.1\r\nhost: payments.aether.internal\r\n\r\n";
    let mut idle = Vec::new();
    for _ in 0..24 {
        let mut tls = tls_to(&peer, pod.inbound()).await;
        tls.write_all(request).await.unwrap();
        let mut b = [0u8; 4096];
        let n = tls.read(&mut b).await.unwrap();
        assert!(
            b[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&b[..n])
        );
        idle.push(tls);
    }
    let url = "http://payments.aether.internal/kept";
    let mut kept = HttpClient::h1(tls_to(&peer, pod.inbound()).await)
        .await
        .unwrap();
    assert_eq!(kept.get(url).await.unwrap().status, 200);
    let stop = Arc::new(AtomicBool::new(false));
    let asker = tokio::spawn({
        let stop = stop.clone();
        async move {
            while !stop.load(Ordering::Relaxed) {
                let r = match kept.get(url).await {
                    Ok(r) => r,
                    Err(e) => return Err(e),
                };
                match (r.status.as_u16(), r.aether_error()) {
                    (200, _) | (503, Some("overloaded")) => {}
                    other => panic!("the kept connection got {other:?}: {}", r.text()),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(kept)
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;

    let uploader = frontend_peer(&certs, "9090", &["h2"]);
    let mut uploads = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let mut c = HttpClient::h2(tls_to(&uploader, pod.inbound()).await)
            .await
            .unwrap();
        let body = bytes::Bytes::from(vec![b'u'; 12 << 20]);
        let req = http::Request::post("http://payments.aether.internal/upload")
            .body(http_body_util::Full::new(body))
            .unwrap();
        uploads.spawn(async move { c.send(req).await });
    }

    let mut peak = 0.0f64;
    eventually(
        Duration::from_secs(20),
        "every idle connection closed",
        async || {
            peak = peak.max(metric(&p, "aether_overload_state", &[]).await);
            let mut open = 0;
            for tls in idle.iter_mut() {
                let mut b = [0u8; 16];
                let r = tokio::time::timeout(Duration::from_millis(5), tls.read(&mut b)).await;
                if r.is_err() {
                    open += 1;
                }
            }
            if asker.is_finished() {
                return Err(format!("the kept connection broke: {}", p.stderr_tail(60)));
            }
            holds(open == 0).map_err(|_| format!("{open} still open, step {peak}"))
        },
    )
    .await;
    assert_eq!(peak, 2.0, "step 2 was never reached");
    eventually(
        Duration::from_secs(20),
        "/readyz 200 after step 2",
        async || {
            let r = p.admin_get("/readyz").await?;
            let used = metric(&p, "aether_memory_used_bytes", &[]).await;
            let closed = ["action=\"close-connection\""];
            let closed = metric(&p, "aether_overload_actions_total", &closed).await;
            let active = ["listener=\"inbound\""];
            let active = metric(&p, "aether_connections_active", &active).await;
            let diag = format!(
                "{} used {used} closed {closed} active {active}, kept connection ended {}",
                r.text(),
                asker.is_finished()
            );
            holds(r.status == 200).map_err(|_| diag)
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut kept = asker
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the kept connection broke: {e}\n{}", p.stderr_tail(60)));
    assert_eq!(
        kept.get(url).await.unwrap().status,
        200,
        "the kept connection after"
    );
    let closed = ["action=\"close-connection\""];
    let closed = metric(&p, "aether_overload_actions_total", &closed).await;
    assert!(closed >= 24.0, "{closed} closed");
    assert!(
        p.try_exit().is_none(),
        "the sidecar died: {}",
        p.stderr_tail(20)
    );
    assert_eq!(cgroup.oom_kills(), 0);
    eprintln!("step 2 closed {closed} connections");
    uploads.abort_all();
    stalled.abort();
}
