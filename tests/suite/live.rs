//! Live updates without loss, end to end: catalog rewrites during a rollout, client- and
//! server-side two-phase drain, identity rotation and bad file writes (SPEC section 1
//! "Per-port endpoint sets" and "Two-phase drain", sections 3 and 4; the design record's
//! Phase 4 rollout test). Real `aether-proxy run` processes, real apps, real mTLS, loopback only.
//!
//! Every test owns a loopback /24 from `Net::fresh()` (see `common`):
//! * pod 0 is the client pod (proxy identity `frontend` on host `.2`) when a test has one, or
//!   the one server pod of the drain/rotation tests;
//! * server pods' proxies listen on host `.(16i+2)`:15008, their apps on `.(16i+1)`:<port>; the
//!   catalog lists them by their proxy address.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::inbound::frontend_peer;
use crate::common::live::*;
use crate::common::mesh::{certs, PAYMENTS, SVC, TD};
use crate::common::*;

const SVC_9091: &str = "payments.aether.internal:9091";

/// How long a catalog or identity reload may take to show (150 ms debounce, 2 s poll fallback).
const RELOAD_TIMEOUT: Duration = Duration::from_secs(5);

/// A server pod's proxy (identity `payments`, default port 8080); `extra` is appended to the
/// config (e.g. a `drain:` section). `identity` overrides the `identity:` block.
async fn server_proxy(
    certs: &Certs,
    pod: PodNet,
    ports: &[&str],
    identity: Option<String>,
    extra: &str,
) -> Proxy {
    let config = format!(
        "trust_domain: {TD}\n{}{}{extra}",
        identity.unwrap_or_else(|| certs.identity_yaml("payments")),
        pod.listeners_yaml(8080, ports)
    );
    Proxy::start(&config, "services: {}\n").await
}

/// The client pod's proxy (identity `frontend`) and where its catalog lives.
struct Client {
    proxy: Proxy,
    catalog: PathBuf,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Client {
    type Target = Proxy;
    fn deref(&self) -> &Proxy {
        &self.proxy
    }
}

impl Client {
    fn catalog_path(&self) -> PathBuf {
        self.catalog.clone()
    }
}

/// The client pod's proxy (identity `frontend`) with `catalog`.
/// The catalog lives in a directory of its own (as a mounted ConfigMap would), not next to
/// the proxy's logs: see `catalog_reload_is_not_starved_by_a_busy_directory`.
async fn client_proxy(certs: &Certs, pod: PodNet, catalog: &str) -> Client {
    let dir = tempfile::Builder::new()
        .prefix("aether-live-catalog-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("catalog.yaml");
    std::fs::write(&path, catalog).unwrap();
    let config = format!(
        "trust_domain: {TD}\n{}{}catalog:\n  path: {}\n",
        certs.identity_yaml("frontend"),
        pod.listeners_yaml(8080, &[]),
        path.display()
    );
    Client {
        proxy: Proxy::start(&config, catalog).await,
        catalog: path,
        _dir: dir,
    }
}

/// One endpoint of `payments` in a catalog.
#[derive(Clone, Debug)]
struct Ep {
    addr: IpAddr,
    ports: Vec<u16>,
    version: &'static str,
    draining: bool,
}

impl Ep {
    fn new(pod: PodNet, ports: &[u16], version: &'static str) -> Ep {
        Ep {
            addr: pod.proxy_ip(),
            ports: ports.to_vec(),
            version,
            draining: false,
        }
    }
    fn address(&self) -> String {
        format!("{}:15008", self.addr)
    }
}

/// The catalog: service `payments` (default port 8080, pinned to the payments identity) with
/// `eps`; `extra` holds more endpoint fields appended to every endpoint's flow mapping.
fn payments_catalog(certs: &Certs, eps: &[Ep]) -> String {
    let mut s = format!(
        "services:\n  payments:\n    default_port: 8080\n    identity: {}\n    endpoints:",
        certs.spiffe_id(PAYMENTS)
    );
    if eps.is_empty() {
        s.push_str(" []\n");
        return s;
    }
    s.push('\n');
    for e in eps {
        s.push_str(&format!(
            "      - {{ address: \"{}\", ports: {:?}, labels: {{ version: {} }}, draining: {} }}\n",
            e.addr, e.ports, e.version, e.draining
        ));
    }
    s
}

/// Rewrites the client's catalog atomically and waits until `/config_dump` shows the new
/// version; returns (written, seen).
async fn publish(client: &Client, catalog: &str, version: u64) -> (Instant, Instant) {
    let written = Instant::now();
    write_atomic(&client.catalog_path(), catalog.as_bytes());
    let seen = wait_catalog_version(client, version, RELOAD_TIMEOUT).await;
    (written, seen)
}

/// The endpoints (address, draining) `/clusters` shows for a cluster, sorted; `None` if the
/// cluster is not materialized.
async fn cluster_endpoints(p: &Proxy, name: &str) -> Option<Vec<(String, bool)>> {
    clusters(p).await.get(name).map(|eps| {
        eps.iter()
            .map(|e| (e.address.clone(), e.draining))
            .collect()
    })
}

/// The endpoints of `eps` that advertise `port`, as `/clusters` should show them.
fn expected_endpoints(eps: &[Ep], port: u16) -> Vec<(String, bool)> {
    let mut v: Vec<_> = eps
        .iter()
        .filter(|e| e.ports.contains(&port))
        .map(|e| (e.address(), e.draining))
        .collect();
    v.sort();
    v
}

/// An HTTP/1.1 connection through mTLS to a server proxy's inbound port-8080 chain.
async fn h1_over_tls(certs: &Certs, inbound: SocketAddr) -> (HttpClient, String) {
    let tls = frontend_peer(certs, "8080", &["http/1.1"])
        .connect(inbound)
        .await
        .unwrap_or_else(|e| panic!("TLS to {inbound}: {e:?}"));
    let serial = peer_serial(&tls);
    (HttpClient::h1(tls).await.unwrap(), serial)
}

/// Polls `/readyz` until it answers `status`; returns when.
async fn wait_readyz(p: &Proxy, status: u16, limit: Duration) -> Instant {
    let what = format!("/readyz answering {status}");
    eventually_every(limit, Duration::from_millis(10), &what, async || {
        match p.admin_get("/readyz").await {
            Ok(r) if r.status.as_u16() == status => Ok(Instant::now()),
            r => Err(format!("{r:?}")),
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// 1. Rollout safety
// ---------------------------------------------------------------------------------------------

/// The design record's rollout test: `payments` runs three v1 pods serving 8080 only; three v2
/// pods serving 8080 and 9091 are listed one at a time, then the v1 pods are marked draining
/// and removed one at a time (and their proxies get SIGTERM), all while a load generator drives
/// both `payments:9091` and the default port through the client proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_adds_a_port_without_loss() {
    let net = Net::fresh();
    let certs = certs();
    let ledger = Ledger::default();
    let client_pod = net.pod(0);
    let v1_pods: Vec<PodNet> = (1..=3).map(|i| net.pod(i)).collect();
    let v2_pods: Vec<PodNet> = (4..=6).map(|i| net.pod(i)).collect();

    let mut apps = Vec::new();
    for (i, pod) in v1_pods.iter().enumerate() {
        let name = format!("v1-{}", i + 1);
        apps.push(PodApp::start(pod.app(8080), &name, "v1", &ledger).await);
        // A trap: a 9091 app inside a v1 pod. Its proxy does not serve 9091, so nothing may
        // ever reach it; if anything does, the ledger counts it.
        apps.push(PodApp::start(pod.app(9091), &name, "v1", &ledger).await);
    }
    for (i, pod) in v2_pods.iter().enumerate() {
        let name = format!("v2-{}", i + 1);
        apps.push(PodApp::start(pod.app(8080), &name, "v2", &ledger).await);
        apps.push(PodApp::start(pod.app(9091), &name, "v2", &ledger).await);
    }

    let v1_drain = "drain:\n  notify: 200ms\n  timeout: 5s\n";
    let v1_ports = ["{ port: 8080, protocol: auto }"];
    let v2_ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 9091, protocol: h2 }",
    ];
    let mut v1_proxies = futures_util::future::join_all(
        v1_pods
            .iter()
            .map(|p| server_proxy(&certs, *p, &v1_ports, None, v1_drain)),
    )
    .await;
    let _v2_proxies = futures_util::future::join_all(
        v2_pods
            .iter()
            .map(|p| server_proxy(&certs, *p, &v2_ports, None, "")),
    )
    .await;

    let mut eps: Vec<Ep> = v1_pods.iter().map(|p| Ep::new(*p, &[8080], "v1")).collect();
    let client = client_proxy(&certs, client_pod, &payments_catalog(&certs, &eps)).await;
    let mut version = catalog_version(&client).await;

    let load = LoadGen::start(
        client_pod.outbound(),
        &[("9091", SVC_9091), ("default", SVC)],
        2,
        Duration::from_millis(4),
    );
    let mut timeline: Vec<String> = Vec::new();
    let t0 = Instant::now();
    let stage = |what: String, seen: Instant, timeline: &mut Vec<String>| {
        timeline.push(format!("{:>6} ms  {what}", (seen - t0).as_millis()));
    };

    // Stage 0: v1 only; 9091 does not exist yet.
    let_traffic_flow(&load).await;

    // Roll in v2, one pod at a time.
    let mut first_v2_seen: Option<Instant> = None;
    for (i, pod) in v2_pods.iter().enumerate() {
        eps.push(Ep::new(*pod, &[8080, 9091], "v2"));
        version += 1;
        let (_, seen) = publish(&client, &payments_catalog(&certs, &eps), version).await;
        first_v2_seen.get_or_insert(seen);
        stage(
            format!("v2-{} listed (8080, 9091)", i + 1),
            seen,
            &mut timeline,
        );
        let_traffic_flow(&load).await;
        assert_eq!(
            cluster_endpoints(&client, SVC_9091).await,
            Some(expected_endpoints(&eps, 9091)),
            "the 9091 cluster after v2-{} was listed",
            i + 1
        );
        assert_eq!(
            cluster_endpoints(&client, SVC).await,
            Some(expected_endpoints(&eps, 8080)),
            "the default cluster after v2-{} was listed",
            i + 1
        );
    }

    // Roll out v1: mark draining, then remove (and stop the pod), one at a time.
    let mut draining_seen: BTreeMap<String, Instant> = BTreeMap::new();
    let mut v1_refused_handshakes: BTreeMap<String, f64> = BTreeMap::new();
    for (i, pod) in v1_pods.iter().enumerate() {
        let name = format!("v1-{}", i + 1);
        let ip = pod.proxy_ip();
        eps.iter_mut()
            .filter(|e| e.addr == ip)
            .for_each(|e| e.draining = true);
        version += 1;
        let (_, seen) = publish(&client, &payments_catalog(&certs, &eps), version).await;
        draining_seen.insert(name.clone(), seen);
        stage(format!("{name} draining"), seen, &mut timeline);
        let_traffic_flow(&load).await;
        assert_eq!(
            cluster_endpoints(&client, SVC).await,
            Some(expected_endpoints(&eps, 8080)),
            "the default cluster after {name} was marked draining"
        );

        eps.retain(|e| e.addr != ip);
        version += 1;
        let (_, seen) = publish(&client, &payments_catalog(&certs, &eps), version).await;
        stage(
            format!("{name} removed; SIGTERM to its proxy"),
            seen,
            &mut timeline,
        );
        // A 9091 attempt at a v1 pod would die in its TLS handshake (SNI 9091 is not served
        // there) and be retried elsewhere, invisible to the apps: count refused handshakes.
        let refused = metric(
            &v1_proxies[i],
            "aether_tls_handshakes_total",
            &["listener=\"inbound\"", "result=\"error\""],
        )
        .await;
        v1_refused_handshakes.insert(name.clone(), refused);
        v1_proxies[i].signal(libc::SIGTERM);
        let_traffic_flow(&load).await;
        assert_eq!(
            cluster_endpoints(&client, SVC).await,
            Some(expected_endpoints(&eps, 8080)),
            "the default cluster after {name} was removed"
        );
    }
    let shots = load.stop().await;
    let client_stderr = client.stderr();
    let upstream_failures: Vec<&str> = client_stderr
        .lines()
        .filter(|l| l.contains("upstream connect failed") || l.contains("upstream broke"))
        .collect();
    let first_v2_seen = first_v2_seen.unwrap();

    // ---- Counts ----
    let mut by_answer: BTreeMap<String, usize> = BTreeMap::new();
    let mut errors: Vec<String> = Vec::new();
    let mut server_errors: BTreeMap<String, usize> = BTreeMap::new();
    let mut violations: Vec<String> = Vec::new();
    let mut pnx_before = 0usize;
    for s in &shots {
        let at = (s.started - t0).as_millis();
        match &s.result {
            Err(e) => errors.push(format!("{} at {at} ms: {e}", s.target)),
            Ok(r) => {
                let key = format!(
                    "{:<7} -> {} {}{}",
                    s.target,
                    r.status,
                    r.version.as_deref().or(r.reason.as_deref()).unwrap_or("-"),
                    r.pod
                        .as_deref()
                        .map(|p| format!(" ({p}:{})", r.port.as_deref().unwrap_or("?")))
                        .unwrap_or_default()
                );
                *by_answer.entry(key).or_default() += 1;
                if r.status >= 500 {
                    *server_errors
                        .entry(format!(
                            "{} {} {}",
                            s.target,
                            r.status,
                            r.reason.as_deref().unwrap_or("(app)")
                        ))
                        .or_default() += 1;
                }
                let ok_from = |version: &str, port: &str| {
                    r.status == 200
                        && r.version.as_deref() == Some(version)
                        && r.port.as_deref() == Some(port)
                };
                match s.target {
                    "9091" => {
                        let pnx =
                            r.status == 503 && r.reason.as_deref() == Some("port-not-exposed");
                        if pnx && s.started < first_v2_seen {
                            pnx_before += 1;
                        } else if !ok_from("v2", "9091") {
                            violations.push(format!("9091 at {at} ms: {r:?}"));
                        }
                    }
                    _ => {
                        if !(ok_from("v1", "8080") || ok_from("v2", "8080")) {
                            violations.push(format!("default at {at} ms: {r:?}"));
                        }
                    }
                }
            }
        }
    }
    let hits = ledger.hits();
    let mut app_counts: BTreeMap<String, usize> = BTreeMap::new();
    for h in &hits {
        *app_counts
            .entry(format!("{} port {} ({})", h.version, h.port, h.pod))
            .or_default() += 1;
    }
    let v1_saw_9091: Vec<&Hit> = hits
        .iter()
        .filter(|h| h.version == "v1" && (h.port == 9091 || h.authority.ends_with(":9091")))
        .collect();
    let late_v1: Vec<String> = hits
        .iter()
        .filter(|h| {
            draining_seen
                .get(&h.pod)
                .is_some_and(|t| h.at > *t + Duration::from_millis(500))
        })
        .map(|h| format!("{} {} at {} ms", h.pod, h.path, (h.at - t0).as_millis()))
        .collect();

    let mut summary = String::from("\n==== rollout: payments v1 (8080) -> v2 (8080, 9091) ====\n");
    summary.push_str("timeline (as seen at the client proxy):\n");
    for l in &timeline {
        summary.push_str(&format!("  {l}\n"));
    }
    summary.push_str(&format!(
        "load generator: {} requests, {} transport errors (resets)\n",
        shots.len(),
        errors.len()
    ));
    summary.push_str("answers (target -> status version|reason (pod:port)):\n");
    for (k, n) in &by_answer {
        summary.push_str(&format!("  {k:<40} {n}\n"));
    }
    summary.push_str(&format!("5xx by reason: {server_errors:?}\n"));
    summary.push_str("requests seen by the apps (pod version, port, pod):\n");
    for (k, n) in &app_counts {
        summary.push_str(&format!("  {k:<28} {n}\n"));
    }
    summary.push_str(&format!(
        "9091 requests at v1 pods: {}; v1 requests > 500 ms after the client saw the pod draining: {}\n",
        v1_saw_9091.len(),
        late_v1.len()
    ));
    summary.push_str(&format!(
        "refused inbound TLS handshakes at v1 pods: {v1_refused_handshakes:?}; upstream failures \
         logged by the client proxy: {}\n",
        upstream_failures.len()
    ));
    println!("{summary}");

    assert!(
        errors.is_empty(),
        "transport errors at the load generator: {:?}{summary}",
        &errors[..errors.len().min(20)]
    );
    assert!(
        v1_refused_handshakes.values().all(|n| *n == 0.0),
        "v1 pods refused handshakes (a 9091 attempt reached them): {v1_refused_handshakes:?}{summary}"
    );
    assert!(
        upstream_failures.is_empty(),
        "the client proxy failed upstream attempts (hidden by retries): {upstream_failures:#?}{summary}"
    );
    assert!(
        v1_saw_9091.is_empty(),
        "requests for 9091 reached v1 pods: {v1_saw_9091:?}{summary}"
    );
    assert!(
        violations.is_empty(),
        "{} unexpected answers, first ones: {:?}{summary}",
        violations.len(),
        &violations[..violations.len().min(20)]
    );
    assert!(
        late_v1.is_empty(),
        "v1 pods got new requests after being marked draining: {late_v1:?}{summary}"
    );
    assert!(
        pnx_before >= 5,
        "too few 9091 requests before the first v2 pod ({pnx_before}); the stage did not run{summary}"
    );
    for i in 1..=3 {
        let pod = format!("v2-{i}");
        let n = hits
            .iter()
            .filter(|h| h.pod == pod && h.port == 9091)
            .count();
        assert!(n > 0, "{pod} never got a 9091 request{summary}");
    }
    for i in 1..=3 {
        let pod = format!("v1-{i}");
        let n = hits
            .iter()
            .filter(|h| h.pod == pod && h.port == 8080)
            .count();
        assert!(n > 0, "{pod} never got an 8080 request{summary}");
    }
    // The removed v1 pods drained and exited cleanly.
    for (i, p) in v1_proxies.iter_mut().enumerate() {
        let st = p.wait_exit(Duration::from_secs(10)).await;
        assert!(
            st.is_some_and(|s| s.code() == Some(0)),
            "v1-{} proxy after SIGTERM: {st:?}",
            i + 1
        );
    }
    drop(apps);
}

/// Lets traffic flow at the current rollout stage: 400 ms, and at least 20 more answers per
/// target.
async fn let_traffic_flow(load: &LoadGen) {
    let mut before = targets_so_far(load);
    for t in ["9091", "default"] {
        before.entry(t).or_insert(0);
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    await_progress(load, &before).await;
}

/// Shots per target so far.
fn targets_so_far(load: &LoadGen) -> BTreeMap<&'static str, usize> {
    let mut m = BTreeMap::new();
    for s in load.shots() {
        *m.entry(s.target).or_default() += 1;
    }
    m
}

/// Waits (bounded) until each target answered at least 20 more requests than in `before`.
async fn await_progress(load: &LoadGen, before: &BTreeMap<&str, usize>) {
    let ten_s = Duration::from_secs(10);
    eventually_every(
        ten_s,
        Duration::from_millis(10),
        "load progress",
        async || {
            let shots = load.shots();
            let behind: Vec<_> = before
                .iter()
                .filter(|(t, n)| shots.iter().filter(|s| s.target == **t).count() < **n + 20)
                .collect();
            if behind.is_empty() {
                Ok(())
            } else {
                Err(format!("the load generator stalled: {behind:?}"))
            }
        },
    )
    .await
}

// ---------------------------------------------------------------------------------------------
// 2, 3. Server-side two-phase drain
// ---------------------------------------------------------------------------------------------

const DRAIN_NOTIFY: Duration = Duration::from_secs(1);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
const DRAIN_YAML: &str = "drain:\n  notify: 1s\n  timeout: 10s\n";

/// A server pod with a slow-capable app on 8080 (auto) and a streaming app on 9090 (h2).
async fn drain_pod(certs: &Certs, pod: PodNet, ledger: &Ledger) -> (Proxy, Vec<PodApp>) {
    let apps = vec![
        PodApp::start(pod.app(8080), "server", "v1", ledger).await,
        PodApp::start(pod.app(9090), "server", "v1", ledger).await,
    ];
    let proxy = server_proxy(
        certs,
        pod,
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: h2 }",
        ],
        None,
        DRAIN_YAML,
    )
    .await;
    (proxy, apps)
}

/// After the drain started at `start`: `/readyz` turns 503 at once, a new connection is still
/// served during notify, then new TCP connections are refused. Returns when they were refused.
async fn check_notify_then_close(
    certs: &Certs,
    proxy: &Proxy,
    inbound: SocketAddr,
    start: Instant,
) {
    let not_ready = wait_readyz(proxy, 503, Duration::from_millis(800)).await;
    let health = proxy.admin_get("/healthz").await.unwrap();
    assert_eq!(
        health.status.as_u16(),
        200,
        "liveness during drain: {health:?}"
    );

    // A new connection during notify is served.
    let (mut c, _) = h1_over_tls(certs, inbound).await;
    let r = c
        .send(empty(get("/during-notify").header("host", SVC)))
        .await
        .expect("a new connection during notify is served");
    let served = Instant::now();
    assert_eq!(r.status.as_u16(), 200, "request during notify: {r:?}");
    assert_eq!(r.header("x-app-port"), Some("8080"), "{r:?}");
    assert!(
        served < start + DRAIN_NOTIFY,
        "test too slow: the request during notify finished {:?} after the drain started",
        served - start
    );
    drop(c);

    // After notify: refused.
    let refused = wait_refused(inbound, DRAIN_NOTIFY + Duration::from_secs(2)).await;
    assert!(
        refused >= start + DRAIN_NOTIFY - Duration::from_millis(50),
        "the listener closed {:?} after the drain started, before notify ({DRAIN_NOTIFY:?}) ended",
        refused - start
    );
    println!(
        "drain: /readyz 503 after {:?}, new connection served after {:?}, refused after {:?}",
        not_ready - start,
        served - start,
        refused - start
    );
}

/// SIGTERM with a slow HTTP/1.1 request and an h2 stream in flight: /readyz 503 during notify
/// while new connections are still served, then the listener closes, both in-flight exchanges
/// complete (h1 with `Connection: close`, h2 after GOAWAY), and the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_work_then_exits() {
    let pod = Net::fresh().pod(0);
    let certs = certs();
    let ledger = Ledger::default();
    let (mut proxy, _apps) = drain_pod(&certs, pod, &ledger).await;
    let inbound = pod.inbound();

    // A slow HTTP/1.1 request (2.5 s at the app).
    let (mut slow_c, _) = h1_over_tls(&certs, inbound).await;
    let slow = tokio::spawn(async move {
        let r = slow_c
            .send(empty(
                get("/slow")
                    .header("host", SVC)
                    .header("x-app-delay-ms", "2500"),
            ))
            .await;
        (r, Instant::now())
    });
    // An h2 stream on the 9090 chain whose body ends ~2 s after it started.
    let tls = frontend_peer(&certs, "9090", &["h2"])
        .connect(inbound)
        .await
        .unwrap_or_else(|e| panic!("TLS 9090: {e:?}"));
    assert_eq!(negotiated_alpn(&tls).as_deref(), Some("h2"));
    let mut h2c = HttpClient::h2(tls).await.unwrap();
    let stream = tokio::spawn(async move {
        let r = h2c
            .send(empty(
                get("http://payments.aether.internal:9090/stream").header("x-stream-ms", "2000"),
            ))
            .await;
        (r, h2c, Instant::now())
    });
    ledger
        .wait_for(IO_TIMEOUT, "slow request", |h| h.path == "/slow")
        .await;
    ledger
        .wait_for(IO_TIMEOUT, "stream", |h| h.path == "/stream")
        .await;

    let start = Instant::now();
    proxy.signal(libc::SIGTERM);
    check_notify_then_close(&certs, &proxy, inbound, start).await;

    let (slow_r, slow_done) = within(IO_TIMEOUT, "slow request", slow)
        .await
        .unwrap()
        .unwrap();
    let slow_r = slow_r.expect("the slow request in flight at SIGTERM completes");
    assert_eq!(slow_r.status.as_u16(), 200, "{slow_r:?}");
    assert_eq!(slow_r.text(), "server v1 8080\n");
    assert!(
        slow_done > start + DRAIN_NOTIFY,
        "the slow request should outlive notify"
    );
    assert_eq!(
        slow_r.header("connection"),
        Some("close"),
        "an HTTP/1.1 answer after the listener closed carries Connection: close: {slow_r:?}"
    );

    let (stream_r, mut h2c, stream_done) = within(IO_TIMEOUT, "h2 stream", stream)
        .await
        .unwrap()
        .unwrap();
    let stream_r = stream_r.expect("the h2 stream open at SIGTERM completes");
    assert_eq!(stream_r.status.as_u16(), 200, "{stream_r:?}");
    assert_eq!(stream_r.text(), "first\nlast\n", "the whole streamed body");
    assert!(stream_done > start + DRAIN_NOTIFY);
    // GOAWAY: the connection takes no new stream.
    let again = h2c.get("http://payments.aether.internal:9090/again").await;
    assert!(
        again.is_err(),
        "a new stream on the drained h2 connection was served: {again:?}"
    );

    let status = proxy.wait_exit(DRAIN_NOTIFY + DRAIN_TIMEOUT).await;
    let exited = Instant::now();
    assert!(
        status.is_some_and(|s| s.code() == Some(0)),
        "exit after drain: {status:?}; stderr:\n{}",
        proxy.stderr_tail(30)
    );
    println!(
        "drain: slow h1 done after {:?}, h2 stream done after {:?}, exit 0 after {:?}",
        slow_done - start,
        stream_done - start,
        exited - start
    );
    // Nothing was left in flight, so the proxy need not wait out drain.timeout.
    assert!(
        exited < start + DRAIN_NOTIFY + Duration::from_secs(5),
        "the proxy waited {:?} although nothing was in flight",
        exited - start
    );
}

/// `POST /drain` starts the same sequence as SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_drain_starts_the_same_sequence() {
    let pod = Net::fresh().pod(0);
    let certs = certs();
    let ledger = Ledger::default();
    let (mut proxy, _apps) = drain_pod(&certs, pod, &ledger).await;
    let inbound = pod.inbound();

    let (mut slow_c, _) = h1_over_tls(&certs, inbound).await;
    let slow = tokio::spawn(async move {
        slow_c
            .send(empty(
                get("/slow")
                    .header("host", SVC)
                    .header("x-app-delay-ms", "2000"),
            ))
            .await
    });
    ledger
        .wait_for(IO_TIMEOUT, "slow request", |h| h.path == "/slow")
        .await;

    let start = Instant::now();
    let r = proxy.admin_post("/drain").await.unwrap();
    assert_eq!(r.status.as_u16(), 200, "POST /drain: {r:?}");
    check_notify_then_close(&certs, &proxy, inbound, start).await;

    let slow_r = within(IO_TIMEOUT, "slow request", slow)
        .await
        .unwrap()
        .unwrap()
        .expect("the slow request in flight at POST /drain completes");
    assert_eq!(slow_r.status.as_u16(), 200, "{slow_r:?}");
    assert_eq!(slow_r.header("connection"), Some("close"), "{slow_r:?}");

    let status = proxy.wait_exit(DRAIN_NOTIFY + DRAIN_TIMEOUT).await;
    assert!(
        status.is_some_and(|s| s.code() == Some(0)),
        "exit after POST /drain: {status:?}; stderr:\n{}",
        proxy.stderr_tail(30)
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Client-side drain
// ---------------------------------------------------------------------------------------------

/// A slow request is in flight on endpoint A when the catalog marks A draining: it completes,
/// `/clusters` shows A draining with the request still counted, and every new request (on new
/// connections and on a keep-alive connection opened before) goes to B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_endpoint_gets_no_new_requests() {
    let net = Net::fresh();
    let certs = certs();
    let ledger = Ledger::default();
    let (client_pod, a_pod, b_pod) = (net.pod(0), net.pod(1), net.pod(2));
    let _apps = [
        PodApp::start(a_pod.app(8080), "A", "v1", &ledger).await,
        PodApp::start(b_pod.app(8080), "B", "v1", &ledger).await,
    ];
    let (_a, _b) = tokio::join!(
        server_proxy(&certs, a_pod, &[], None, ""),
        server_proxy(&certs, b_pod, &[], None, "")
    );
    let mut eps = vec![Ep::new(a_pod, &[8080], "v1"), Ep::new(b_pod, &[8080], "v1")];
    let client = client_proxy(&certs, client_pod, &payments_catalog(&certs, &eps)).await;
    let outbound = client_pod.outbound();
    let mut version = catalog_version(&client).await;

    // A keep-alive connection opened (and used) before the drain.
    let mut keep = HttpClient::h1(tcp_connect(outbound).await.unwrap())
        .await
        .unwrap();
    let r = keep
        .send(empty(get("/warm").header("host", SVC)))
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 200, "{r:?}");

    // Slow requests until one is in flight on A (the balancer spreads them).
    let mut slow = Vec::new();
    let five_s = Duration::from_secs(5);
    eventually_every(
        five_s,
        Duration::ZERO,
        "a slow request reaching A",
        async || {
            let mut c = HttpClient::h1(tcp_connect(outbound).await.unwrap())
                .await
                .unwrap();
            slow.push(tokio::spawn(async move {
                let started = Instant::now();
                let r = c
                    .send(empty(
                        get("/slow")
                            .header("host", SVC)
                            .header("x-app-delay-ms", "2000"),
                    ))
                    .await;
                (r, started.elapsed())
            }));
            // Until it reached an app, for 1 s at most.
            let n = slow.len();
            let (one_s, pace) = (Duration::from_secs(1), Duration::from_millis(5));
            let _ = poll_until(one_s, pace, async || {
                holds(ledger.count(|h| h.path == "/slow") >= n)
            })
            .await;
            holds(ledger.count(|h| h.pod == "A" && h.path == "/slow") > 0)
        },
    )
    .await;

    eps[0].draining = true;
    version += 1;
    let (_, seen) = publish(&client, &payments_catalog(&certs, &eps), version).await;
    let a_addr = eps[0].address();
    let view = clusters_json(&client).await;
    let a_view = view["clusters"][0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["address"] == a_addr.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("A missing from /clusters: {view}"));
    assert_eq!(a_view["draining"], true, "{view}");
    assert!(
        a_view["active_requests"].as_u64().unwrap_or(0) >= 1,
        "the request in flight on A must still count after the rebuild: {view}"
    );

    // New requests: all to B, on fresh connections and on the old keep-alive one.
    for i in 0..40 {
        let r = if i % 2 == 0 {
            keep.send(empty(get("/after").header("host", SVC))).await
        } else {
            let mut c = HttpClient::h1(tcp_connect(outbound).await.unwrap())
                .await
                .unwrap();
            c.send(empty(get("/after").header("host", SVC))).await
        }
        .unwrap_or_else(|e| panic!("request {i} after the drain mark: {e}"));
        assert_eq!(r.status.as_u16(), 200, "request {i}: {r:?}");
        assert_eq!(r.header("x-pod"), Some("B"), "request {i} went to {r:?}");
    }
    assert_eq!(
        ledger.count(|h| h.pod == "A" && h.at > seen),
        0,
        "A got requests after it was marked draining: {:?}",
        ledger.hits()
    );

    // The in-flight ones complete.
    let mut on_a = 0;
    for t in slow {
        let (r, took) = within(IO_TIMEOUT, "slow request", t)
            .await
            .unwrap()
            .unwrap();
        let r = r.expect("a slow request in flight across the drain mark completes");
        assert_eq!(r.status.as_u16(), 200, "{r:?}");
        assert!(
            took >= Duration::from_secs(2),
            "answered too early: {took:?}"
        );
        if r.header("x-pod") == Some("A") {
            on_a += 1;
        }
    }
    assert!(on_a >= 1, "no slow request completed on A");
}

// ---------------------------------------------------------------------------------------------
// 5. Identity rotation
// ---------------------------------------------------------------------------------------------

/// The server's cert and key are replaced by rename with a new leaf from the same CA: new
/// handshakes see the new serial within 2 s, connections opened before keep working, and
/// `aether_identity_reloads_total{result="ok"}` grows. Then a truncated cert file keeps the
/// current identity and counts `result="error"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_rotation_keeps_old_connections() {
    let pod = Net::fresh().pod(0);
    let certs = certs();
    let ledger = Ledger::default();
    let _app = PodApp::start(pod.app(8080), "server", "v1", &ledger).await;

    let id = IdentityDir::new(&certs);
    let (crt, key) = (id.crt.clone(), id.key.clone());
    let proxy = server_proxy(&certs, pod, &[], Some(id.yaml()), "").await;
    let inbound = pod.inbound();
    let ok = ["result=\"ok\""];
    let err = ["result=\"error\""];
    let name = "aether_identity_reloads_total";

    let old_serial = serial_of_pem_file(&crt);
    let (mut old_h1, serial) = h1_over_tls(&certs, inbound).await;
    assert_eq!(serial, old_serial);
    let r = old_h1
        .send(empty(get("/before").header("host", SVC)))
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 200, "{r:?}");
    let tls = frontend_peer(&certs, "8080", &["h2"])
        .connect(inbound)
        .await
        .unwrap();
    let mut old_h2 = HttpClient::h2(tls).await.unwrap();
    let r = old_h2
        .get("http://payments.aether.internal/before")
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 200, "{r:?}");

    // A second leaf for the same workload from the same CA.
    let next = certs.same_ca_other_trust_domain(TD, &[PAYMENTS]);
    let new_serial = serial_of_pem_file(&next.cert("payments"));
    assert_ne!(new_serial, old_serial, "the new leaf has its own serial");
    let ok_before = metric(&proxy, name, &ok).await;

    let swapped = Instant::now();
    write_atomic(&key, &std::fs::read(next.key("payments")).unwrap());
    write_atomic(&crt, &std::fs::read(next.cert("payments")).unwrap());
    let two_s = Duration::from_secs(2).saturating_sub(swapped.elapsed());
    let (Ok(seen) | Err(seen)) = poll_until(two_s, PACE, async || {
        let (_, seen) = h1_over_tls(&certs, inbound).await;
        if seen == new_serial {
            Ok(seen)
        } else {
            Err(seen)
        }
    })
    .await;
    assert_eq!(
        seen,
        new_serial,
        "a handshake 2 s after the swap still shows serial {seen} (old {old_serial}); stderr:\n{}",
        proxy.stderr_tail(20)
    );
    println!("rotation: new serial seen after {:?}", swapped.elapsed());
    let ok_after = wait_metric(&proxy, name, &ok, RELOAD_TIMEOUT, |v| v >= ok_before + 1.0).await;
    assert!(ok_after > ok_before);
    let dump = config_dump(&proxy).await;
    assert_eq!(
        dump["config"]["identity"]["serial"]
            .as_str()
            .map(str::to_ascii_uppercase),
        Some(new_serial.to_ascii_uppercase()),
        "/config_dump identity serial: {}",
        dump["config"]["identity"]
    );

    // Connections from before the swap keep working.
    let r = old_h1.send(empty(get("/after").header("host", SVC))).await;
    assert!(
        matches!(&r, Ok(r) if r.status.as_u16() == 200),
        "HTTP/1.1 keep-alive connection opened before the rotation: {r:?}"
    );
    let r = old_h2.get("http://payments.aether.internal/after").await;
    assert!(
        matches!(&r, Ok(r) if r.status.as_u16() == 200),
        "h2 connection opened before the rotation: {r:?}"
    );

    // A half-written cert file: the current identity stays.
    let err_before = metric(&proxy, name, &err).await;
    let logged_before = proxy
        .stderr()
        .lines()
        .filter(|l| l.contains("identity reload failed"))
        .count();
    let full = std::fs::read(next.cert("payments")).unwrap();
    std::fs::write(&crt, &full[..full.len() / 2]).unwrap();
    wait_metric(&proxy, name, &err, RELOAD_TIMEOUT, |v| {
        v >= err_before + 1.0
    })
    .await;
    for i in 0..5 {
        let (mut c, s) = h1_over_tls(&certs, inbound).await;
        assert_eq!(s, new_serial, "handshake {i} after a truncated cert file");
        let r = c
            .send(empty(get("/truncated").header("host", SVC)))
            .await
            .unwrap();
        assert_eq!(r.status.as_u16(), 200, "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let failures = proxy
        .stderr()
        .lines()
        .filter(|l| l.contains("identity reload failed"))
        .count();
    assert_eq!(
        failures,
        logged_before + 1,
        "the reload error is logged once; stderr:\n{}",
        proxy.stderr_tail(20)
    );
    assert_eq!(
        metric(&proxy, name, &ok).await,
        ok_after,
        "no ok reload from a bad file"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Bad catalog writes
// ---------------------------------------------------------------------------------------------

/// A catalog truncated mid-token and one with invalid YAML change nothing: requests keep
/// succeeding, `/clusters` and the catalog version stay, `result="error"` grows once per bad
/// write and each error is logged once (not once per poll). A valid catalog is then picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_catalog_writes_keep_the_last_good_one() {
    let net = Net::fresh();
    let certs = certs();
    let ledger = Ledger::default();
    let (client_pod, server_pod) = (net.pod(0), net.pod(1));
    let _app = PodApp::start(server_pod.app(8080), "server", "v1", &ledger).await;
    let _server = server_proxy(&certs, server_pod, &[], None, "").await;
    let eps = vec![Ep::new(server_pod, &[8080], "v1")];
    let good = payments_catalog(&certs, &eps);
    let client = client_proxy(&certs, client_pod, &good).await;
    let name = "aether_catalog_reloads_total";
    let (ok, err) = (["result=\"ok\""], ["result=\"error\""]);

    let load = LoadGen::start(
        client_pod.outbound(),
        &[("default", SVC)],
        1,
        Duration::from_millis(10),
    );
    let progress = |load: &LoadGen| {
        let mut m = targets_so_far(load);
        m.entry("default").or_insert(0);
        m
    };
    await_progress(&load, &progress(&load)).await;
    let clusters0 = clusters(&client).await;
    assert!(clusters0.contains_key(SVC), "{clusters0:?}");
    let version0 = catalog_version(&client).await;
    let ok0 = metric(&client, name, &ok).await;
    let err0 = metric(&client, name, &err).await;

    // 1. Truncated in place, half-way, inside a token (the endpoint's flow mapping is cut open).
    let cut = good.find("ports:").expect("an endpoint line") + 3;
    assert!(cut > good.len() / 3);
    std::fs::write(client.catalog_path(), &good[..cut]).unwrap();
    wait_metric(&client, name, &err, RELOAD_TIMEOUT, |v| v >= err0 + 1.0).await;
    await_progress(&load, &progress(&load)).await;
    assert_eq!(
        clusters(&client).await,
        clusters0,
        "/clusters after a truncated catalog"
    );
    assert_eq!(catalog_version(&client).await, version0);

    // 2. Invalid YAML, written atomically.
    // (A tab where indentation is expected and an unclosed flow sequence: a syntax error.)
    let bad_yaml = "services:\n\tpayments: [unclosed\n";
    write_atomic(&client.catalog_path(), bad_yaml.as_bytes());
    wait_metric(&client, name, &err, RELOAD_TIMEOUT, |v| v >= err0 + 2.0).await;
    // Longer than the 2 s fallback poll: the errors are neither re-counted nor re-logged.
    let until = Instant::now() + Duration::from_millis(2500);
    while Instant::now() < until {
        await_progress(&load, &progress(&load)).await;
    }
    assert_eq!(
        clusters(&client).await,
        clusters0,
        "/clusters after invalid YAML"
    );
    assert_eq!(catalog_version(&client).await, version0);
    assert_eq!(
        metric(&client, name, &err).await,
        err0 + 2.0,
        "one error per bad write"
    );
    assert_eq!(
        metric(&client, name, &ok).await,
        ok0,
        "no ok reload from a bad write"
    );
    let stderr = client.stderr();
    let logged: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("catalog reload failed"))
        .collect();
    assert_eq!(
        logged.len(),
        2,
        "each bad write is logged once, not once per poll: {logged:#?}"
    );

    // 3. A valid catalog again (with a visible change: a label).
    let next = good.replace("version: v1", "version: v1b");
    write_atomic(&client.catalog_path(), next.as_bytes());
    wait_catalog_version(&client, version0 + 1, RELOAD_TIMEOUT).await;
    wait_metric(&client, name, &ok, RELOAD_TIMEOUT, |v| v >= ok0 + 1.0).await;
    let c = clusters(&client).await;
    assert!(
        c[SVC].iter().all(|e| e.labels.contains("v1b")),
        "the new catalog's labels in /clusters: {c:?}"
    );
    await_progress(&load, &progress(&load)).await;

    let shots = load.stop().await;
    let failed: Vec<&Shot> = shots
        .iter()
        .filter(|s| !matches!(&s.result, Ok(r) if r.status == 200 && r.pod.as_deref() == Some("server")))
        .collect();
    println!(
        "bad catalog writes: {} requests, {} failed; catalog errors logged: {}\n  {}",
        shots.len(),
        failed.len(),
        logged.len(),
        logged.join("\n  ")
    );
    assert!(
        failed.is_empty(),
        "{} of {} requests failed across the bad writes: {:?}",
        failed.len(),
        shots.len(),
        &failed[..failed.len().min(10)]
    );
}

// ---------------------------------------------------------------------------------------------
// 7. A busy catalog directory
// ---------------------------------------------------------------------------------------------

/// The catalog's directory also holds a file that is written every 40 ms (a log next to it, as
/// in the harness's default layout where `stdout.log` takes the access log): a catalog rewrite
/// is still picked up within a few seconds (the 150 ms debounce must not wait for a quiet
/// directory forever, and the 2 s poll must still run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_reload_is_not_starved_by_a_busy_directory() {
    let net = Net::fresh();
    let certs = certs();
    let pod = net.pod(0);
    let eps = vec![Ep::new(net.pod(1), &[8080], "v1")];
    let client = client_proxy(&certs, pod, &payments_catalog(&certs, &eps)).await;
    let version0 = catalog_version(&client).await;

    // Another writer in the same directory.
    let sibling = client.catalog_path().with_file_name("sibling.log");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                n += 1;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&sibling)
                    .unwrap();
                std::io::Write::write_all(&mut f, format!("line {n}\n").as_bytes()).unwrap();
                drop(f);
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    let next = format!(
        "{}  orders:\n    default_port: 8080\n    identity: {}\n",
        payments_catalog(&certs, &eps),
        certs.spiffe_id("default/orders")
    );
    let written = Instant::now();
    write_atomic(&client.catalog_path(), next.as_bytes());
    let limit = RELOAD_TIMEOUT.saturating_sub(written.elapsed());
    let reloaded = poll_until(limit, PACE, async || {
        let version = catalog_version(&client).await;
        if version > version0 {
            Ok(())
        } else {
            Err(version)
        }
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = writer.await;
    if let Err(version) = reloaded {
        panic!(
            "catalog rewrite not picked up within {RELOAD_TIMEOUT:?} while another file in its \
             directory is written every 40 ms (version still {version}); stderr tail:\n{}",
            client.stderr_tail(10)
        );
    }
    println!(
        "busy directory: catalog reloaded after {:?}",
        written.elapsed()
    );
    let dump = config_dump(&client).await;
    assert_eq!(
        dump["catalog"]["services"],
        serde_json::json!(["orders", "payments"]),
        "{dump}"
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Trust bundle rotation
// ---------------------------------------------------------------------------------------------

/// Rotating the CA the way operators do: add the new CA to the bundle, move the leaf to it,
/// then retire the old CA. Clients of the new CA get in once it is in the bundle; clients of
/// the old one are refused once it is gone. No restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trust_bundle_rotation_adds_and_retires_a_ca() {
    let pod = Net::fresh().pod(0);
    let (old, new) = (certs(), certs());
    let ledger = Ledger::default();
    let _app = PodApp::start(pod.app(8080), "server", "v1", &ledger).await;
    let id = IdentityDir::new(&old);
    let (crt, key, ca) = (id.crt.clone(), id.key.clone(), id.ca.clone());
    let _proxy = server_proxy(&old, pod, &[], Some(id.yaml()), "").await;
    let inbound = pod.inbound();

    // The clients trust both CAs for the server (its leaf moves from one to the other).
    let both = [
        std::fs::read(old.ca()).unwrap(),
        std::fs::read(new.ca()).unwrap(),
    ]
    .concat();
    let client_dir = tempfile::tempdir().unwrap();
    let client_ca = client_dir.path().join("both.crt");
    std::fs::write(&client_ca, &both).unwrap();
    let works = |certs| accepted(&client_ca, certs, inbound);
    assert!(works(&old).await, "the old CA's client before any rotation");
    assert!(!works(&new).await, "the new CA is not trusted yet");

    // 1. Add the new CA to the bundle.
    write_atomic(&ca, &both);
    assert!(
        becomes(&client_ca, &new, inbound, true).await,
        "a client of the added CA is accepted within 2 s"
    );
    assert!(works(&old).await, "the old CA is still trusted");

    // 2. Move the leaf to the new CA and retire the old one.
    write_atomic(&key, &std::fs::read(new.key("payments")).unwrap());
    write_atomic(&crt, &std::fs::read(new.cert("payments")).unwrap());
    write_atomic(&ca, &std::fs::read(new.ca()).unwrap());
    assert!(
        becomes(&client_ca, &old, inbound, false).await,
        "a client of the retired CA is refused within 2 s"
    );
    assert!(works(&new).await, "the new CA's client keeps working");
}

/// Whether a client with `certs`' frontend leaf (trusting `client_ca` for the server) gets a
/// 200 through the inbound 8080 chain.
async fn accepted(client_ca: &std::path::Path, certs: &Certs, inbound: SocketAddr) -> bool {
    let client = TlsClient::new(client_ca)
        .cert(&certs.cert("frontend"), &certs.key("frontend"))
        .sni(Some("8080"))
        .alpn(&["http/1.1"]);
    let Ok(tls) = client.connect(inbound).await else {
        return false;
    };
    let Ok(mut h1) = HttpClient::h1(tls).await else {
        return false;
    };
    matches!(
        h1.send(empty(get("/ca").header("host", SVC))).await,
        Ok(r) if r.status.as_u16() == 200
    )
}

/// Polls `accepted` until it answers `want`, for at most 2 s.
async fn becomes(
    client_ca: &std::path::Path,
    certs: &Certs,
    inbound: SocketAddr,
    want: bool,
) -> bool {
    let two_s = Duration::from_secs(2);
    poll_until(two_s, Duration::from_millis(50), async || {
        holds(accepted(client_ca, certs, inbound).await == want)
    })
    .await
    .is_ok()
}

/// A server's identity files in a directory of their own, as a mounted secret would be, starting
/// as a copy of `certs`' payments leaf and CA; tests rewrite them to rotate.
struct IdentityDir {
    _dir: tempfile::TempDir,
    crt: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl IdentityDir {
    fn new(certs: &Certs) -> IdentityDir {
        let dir = tempfile::Builder::new()
            .prefix("aether-live-id-")
            .tempdir()
            .unwrap();
        let (crt, key, ca) = (
            dir.path().join("tls.crt"),
            dir.path().join("tls.key"),
            dir.path().join("ca.crt"),
        );
        std::fs::copy(certs.cert("payments"), &crt).unwrap();
        std::fs::copy(certs.key("payments"), &key).unwrap();
        std::fs::copy(certs.ca(), &ca).unwrap();
        IdentityDir {
            _dir: dir,
            crt,
            key,
            ca,
        }
    }

    fn yaml(&self) -> String {
        format!(
            "identity:\n  cert: {}\n  key: {}\n  ca: {}\n",
            self.crt.display(),
            self.key.display(),
            self.ca.display()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// 9. What admin shows of the certificates
// ---------------------------------------------------------------------------------------------

/// Unix seconds of a PEM certificate's not-after.
fn not_after_of(path: &std::path::Path) -> i64 {
    let pem = std::fs::read(path).unwrap();
    let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
    pem.parse_x509().unwrap().validity().not_after.timestamp()
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// `GET /certs` lists the workload and trust certificates with serial, SANs and not-after, and
/// `aether_certificate_expiry_seconds` counts down to the earliest of each kind; both follow a
/// rotation to a leaf that expires in two days.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_and_their_expiry_follow_rotation() {
    let pod = Net::fresh().pod(0);
    let certs = certs();
    let id = IdentityDir::new(&certs);
    let proxy = server_proxy(&certs, pod, &[], Some(id.yaml()), "").await;

    let listed = |v: serde_json::Value, kind: &str| -> Vec<serde_json::Value> {
        v["certificates"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["kind"] == kind)
            .cloned()
            .collect()
    };
    let view = proxy.admin_get("/certs").await.unwrap().json();
    let workload = listed(view.clone(), "workload");
    let trust = listed(view.clone(), "trust");
    assert_eq!((workload.len(), trust.len()), (1, 1), "{view}");
    assert_eq!(
        workload[0]["serial"].as_str().unwrap().to_ascii_uppercase(),
        serial_of_pem_file(&id.crt).to_ascii_uppercase()
    );
    assert_eq!(
        workload[0]["sans"],
        serde_json::json!([certs.spiffe_id(PAYMENTS)])
    );
    assert_eq!(
        trust[0]["serial"].as_str().unwrap().to_ascii_uppercase(),
        serial_of_pem_file(&id.ca).to_ascii_uppercase()
    );
    let not_after = |c: &serde_json::Value| {
        time::OffsetDateTime::parse(
            c["not_after"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap_or_else(|e| panic!("not RFC 3339: {c}: {e}"))
        .unix_timestamp()
    };
    assert_eq!(not_after(&workload[0]), not_after_of(&id.crt));
    assert_eq!(not_after(&trust[0]), not_after_of(&id.ca));

    let expiry = "aether_certificate_expiry_seconds";
    let left = metric(&proxy, expiry, &["cert=\"workload\""]).await as i64;
    let want = not_after_of(&id.crt) - now_secs();
    assert!((left - want).abs() <= 60, "{left} vs {want}");
    let left = metric(&proxy, expiry, &["cert=\"trust\""]).await as i64;
    let want = not_after_of(&id.ca) - now_secs();
    assert!((left - want).abs() <= 60, "{left} vs {want}");

    // A leaf from the same CA that expires in two days, made with openssl.
    let dir = tempfile::tempdir().unwrap();
    let (key, csr, crt, ext) = (
        dir.path().join("k.pem"),
        dir.path().join("r.csr"),
        dir.path().join("c.pem"),
        dir.path().join("ext.cnf"),
    );
    std::fs::write(
        &ext,
        format!("subjectAltName=URI:{}\n", certs.spiffe_id(PAYMENTS)),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    let p = |p: &std::path::Path| p.to_str().unwrap().to_string();
    run(&[
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        &p(&key),
        "-subj",
        "/CN=payments",
        "-out",
        &p(&csr),
    ]);
    let ca_key = certs.dir().join("ca.key");
    run(&[
        "x509",
        "-req",
        "-in",
        &p(&csr),
        "-CA",
        &p(&certs.ca()),
        "-CAkey",
        &p(&ca_key),
        "-set_serial",
        "0x5eed",
        "-days",
        "2",
        "-extfile",
        &p(&ext),
        "-out",
        &p(&crt),
    ]);
    write_atomic(&id.key, &std::fs::read(&key).unwrap());
    write_atomic(&id.crt, &std::fs::read(&crt).unwrap());

    let rotated = poll_until(RELOAD_TIMEOUT, Duration::from_millis(50), async || {
        let view = proxy.admin_get("/certs").await.unwrap().json();
        let w = listed(view, "workload");
        match w.first() {
            Some(c) if c["serial"] == "5eed" => Ok(c.clone()),
            _ => Err(w),
        }
    })
    .await;
    let rotated = rotated.unwrap_or_else(|w| {
        panic!(
            "/certs still shows {w:?}; stderr:\n{}",
            proxy.stderr_tail(20)
        )
    });
    assert_eq!(not_after(&rotated), not_after_of(&crt));
    let left = metric(&proxy, expiry, &["cert=\"workload\""]).await as i64;
    assert!(
        (left - 2 * 86400).abs() <= 120,
        "two days left after the rotation, not {left}"
    );
}
