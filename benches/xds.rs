//! Control-plane figures (SPEC section 9, "Performance"), measured with real processes on
//! loopback and the test control plane of `tests/suite/common/xds`:
//!
//! * cold first request through xDS (on-demand Cluster + its assignment, then the request);
//! * a 1,000-endpoint assignment pushed until `/clusters` shows it;
//! * RSS of 1,000 services x 2 ports x 10 endpoints subscribed, over an idle sidecar;
//! * client-proxy CPU per request in steady state, catalog from a file vs over xDS.
//!
//! `cargo bench --bench xds` prints them; `cargo bench --bench xds -- rss` (or `cold`, `push`,
//! `cpu`) runs only the parts whose name holds the word. Figures, not pass/fail: the tests
//! check behaviour.

// The test suite's harness, of which this bench uses a part: the rest is dead code here.
#[path = "../tests/suite/common/mod.rs"]
#[allow(dead_code, unused_imports)]
mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use common::mesh::{catalog, certs, endpoint, h1_to, server_proxy, service, PAYMENTS};
use common::xds::{xds_client_config, ControlPlane, Endpoint, Fixture, Listen, Server, Service};
use common::*;

const QUIET: &str = "warn";
const SETTLE: Duration = Duration::from_secs(3);

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

async fn run() {
    let net = Net::fresh();
    let certs = certs();
    let server_pod = net.pod(1);
    let _app8080 = HttpApp::auto(server_pod.app(8080)).await;
    let _app9090 = HttpApp::auto(server_pod.app(9090)).await;
    let _server = server_proxy(
        &certs,
        server_pod,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: auto }",
        ],
    )
    .await;
    let id = certs.spiffe_id(PAYMENTS);
    let live = || Endpoint::new(server_pod.proxy_ip(), &[8080, 9090]);

    if wanted("cold") {
        cold_first_requests(&net, &certs, &id, live()).await;
    }
    if wanted("push") {
        push_1000_endpoints(&net, &certs, &id, live()).await;
    }
    if wanted("rss") {
        rss_of_subscriptions(&certs, &id).await;
    }
    if wanted("cpu") {
        steady_state_cpu(&net, &certs, &id, server_pod, live()).await;
    }
}

/// Whether the command line asks for the part `name`: all parts when it names none (cargo
/// passes `--bench` and other flags, which name none).
fn wanted(name: &str) -> bool {
    let words: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    words.is_empty() || words.iter().any(|w| name.contains(w.as_str()))
}

async fn xds_pod(certs: &Certs, pod: PodNet, cp: &ControlPlane) -> Proxy {
    let config = xds_client_config(certs, pod, "frontend", &cp.address(), &[], "");
    Proxy::builder(&config, "")
        .env("RUST_LOG", QUIET)
        .start()
        .await
}

fn cp_listen(pod: PodNet) -> Listen {
    Listen::Tcp(SocketAddr::new(pod.extra(3), 18000))
}

fn percentile(v: &mut [Duration], p: usize) -> Duration {
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

/// 200 services, each asked for once: the first request of each subscribes its cluster.
async fn cold_first_requests(net: &Net, certs: &Certs, id: &str, live: Endpoint) {
    let pod = net.pod(2);
    let mut fx = Fixture::new();
    for i in 0..200 {
        fx = fx.service(
            &format!("cold-{i}"),
            Service::new(id).endpoint(live.clone()),
        );
    }
    let cp = ControlPlane::start(Server::Tonic, cp_listen(pod), fx).await;
    let client = xds_pod(certs, pod, &cp).await;
    let out = pod.outbound();
    let mut c = h1_to(out).await;
    let mut times = Vec::new();
    for i in 0..200 {
        let host = format!("cold-{i}.aether.internal");
        let t = Instant::now();
        let r = c.send(empty(get("/").header("host", &host))).await.unwrap();
        times.push(t.elapsed());
        assert_eq!(r.status.as_u16(), 200, "{host}: {r:?}");
    }
    let first = times[0];
    let warm = {
        let t = Instant::now();
        for _ in 0..200 {
            let r = c
                .send(empty(get("/").header("host", "cold-0.aether.internal")))
                .await
                .unwrap();
            assert_eq!(r.status.as_u16(), 200);
        }
        t.elapsed() / 200
    };
    println!(
        "cold first request via xDS: first (with the upstream TLS handshake) {first:?}; \
         p50 {:?}, p90 {:?}, p99 {:?} over 200 services; a warm request {warm:?}",
        percentile(&mut times, 50),
        percentile(&mut times, 90),
        percentile(&mut times, 99),
    );
    drop(client);
}

/// Addresses for `n` endpoints that are never dialled: 127.0.0.0/8 hosts outside any test's
/// /24 claim range (the allocator hands out 127.100-199.x.x).
fn far_endpoint(i: usize, ports: &[u16]) -> Endpoint {
    let ip = Ipv4Addr::new(127, 250, (i / 250) as u8, (i % 250 + 1) as u8);
    Endpoint::new(IpAddr::V4(ip), ports)
}

/// One service's assignment goes from 1,000 to 999 endpoints and back, ten times; each push is
/// timed until `/clusters` shows the new count.
async fn push_1000_endpoints(net: &Net, certs: &Certs, id: &str, live: Endpoint) {
    let pod = net.pod(3);
    let mut svc = Service::new(id).endpoint(live);
    for i in 0..999 {
        svc = svc.endpoint(far_endpoint(i, &[8080, 9090]));
    }
    let cp = ControlPlane::start(
        Server::Tonic,
        cp_listen(pod),
        Fixture::new().service("big", svc),
    )
    .await;
    let client = xds_pod(certs, pod, &cp).await;
    let out = pod.outbound();
    // Subscribe (the request itself may land on any endpoint; most are not there).
    let _ = h1_to(out)
        .await
        .send(empty(get("/").header("host", "big.aether.internal")))
        .await;
    wait_endpoints(&client, 1000, Duration::from_secs(10)).await;
    let mut times = Vec::new();
    for round in 0..10 {
        let (want, t) = if round % 2 == 0 {
            let t = Instant::now();
            cp.update(|f| {
                f.svc("big").endpoints.pop();
            });
            (999, t)
        } else {
            let t = Instant::now();
            cp.update(|f| {
                f.svc("big")
                    .endpoints
                    .push(far_endpoint(998, &[8080, 9090]));
            });
            (1000, t)
        };
        wait_endpoints(&client, want, Duration::from_secs(10)).await;
        times.push(t.elapsed());
    }
    println!(
        "1,000-endpoint assignment pushed until visible in /clusters: p50 {:?}, max {:?} (10 pushes)",
        percentile(&mut times, 50),
        percentile(&mut times, 100),
    );
}

async fn wait_endpoints(p: &Proxy, want: usize, limit: Duration) {
    let what = format!("{want} endpoints in /clusters");
    eventually_every(limit, Duration::from_millis(1), &what, async || {
        let v = p.admin_get("/clusters").await.unwrap().json();
        let n = v["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["name"].as_str() == Some("big.aether.internal"))
            .map(|c| c["endpoints"].as_array().map_or(0, Vec::len))
            .sum::<usize>();
        if n == want {
            Ok(())
        } else {
            Err(format!("{n} endpoints"))
        }
    })
    .await
}

/// 1,000 services with 10 endpoints each on ports 8080 and 9090; one request to each port of
/// each subscribes both clusters. The endpoints are not there (the requests fail fast); what is
/// measured is the proxy's memory holding the subscriptions, once settled (the allocator's
/// free pages are handed back a second after the catalog last changed: `memory::trim_soon`).
async fn rss_of_subscriptions(certs: &Certs, id: &str) {
    let net = Net::fresh();
    let pod = net.pod(0);
    let mut fx = Fixture::new();
    for s in 0..1000 {
        let mut svc = Service::new(id);
        for e in 0..10 {
            svc = svc.endpoint(far_endpoint(s * 10 + e, &[8080, 9090]));
        }
        fx = fx.service(&format!("s{s}"), svc);
    }
    let cp = ControlPlane::start(Server::Tonic, cp_listen(pod), fx).await;
    let client = xds_pod(certs, pod, &cp).await;
    tokio::time::sleep(SETTLE).await;
    let idle = client.rss_kib();
    let out = pod.outbound();
    let mut c = h1_to(out).await;
    for s in 0..1000 {
        for host in [
            format!("s{s}.aether.internal"),
            format!("s{s}.aether.internal:9090"),
        ] {
            let r = match c.send(empty(get("/").header("host", &host))).await {
                Ok(r) => r,
                Err(_) => {
                    c = h1_to(out).await;
                    c.send(empty(get("/").header("host", &host))).await.unwrap()
                }
            };
            assert_eq!(r.status.as_u16(), 503, "{host}: {r:?}");
        }
    }
    let clusters = client.admin_get("/clusters").await.unwrap().json()["clusters"]
        .as_array()
        .map_or(0, Vec::len);
    tokio::time::sleep(SETTLE).await;
    let full = client.rss_kib();
    println!(
        "1,000 services x 2 ports x 10 endpoints subscribed ({clusters} clusters): RSS {idle} KiB idle -> {full} KiB, +{:.1} MiB",
        (full.saturating_sub(idle)) as f64 / 1024.0
    );
}

fn cpu_ticks(p: &Proxy) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", p.pid().unwrap())).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Requests from 8 keep-alive connections; returns requests done.
async fn load(out: SocketAddr, host: &str, per_conn: usize) -> usize {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let host = host.to_string();
        set.spawn(async move {
            let mut c = h1_to(out).await;
            for _ in 0..per_conn {
                let r = c.send(empty(get("/").header("host", &host))).await.unwrap();
                assert_eq!(r.status.as_u16(), 200);
            }
            per_conn
        });
    }
    let mut n = 0;
    while let Some(r) = set.join_next().await {
        n += r.unwrap();
    }
    n
}

/// The same service from a catalog file (pod 4) and over xDS (pod 5); alternating rounds of
/// 16,000 requests each, CPU time of the client proxy per request.
async fn steady_state_cpu(net: &Net, certs: &Certs, id: &str, server: PodNet, live: Endpoint) {
    let (file_pod, xds_pod_net) = (net.pod(4), net.pod(5));
    let cat = catalog(&[service(
        "payments",
        id,
        "",
        &[endpoint(server.proxy_ip(), &[8080, 9090])],
    )]);
    let config = format!(
        "trust_domain: {}\n{}{}",
        certs.trust_domain(),
        certs.identity_yaml("frontend"),
        file_pod.listeners_yaml(8080, &[])
    );
    let from_file = Proxy::builder(&config, &cat)
        .env("RUST_LOG", QUIET)
        .arg("--concurrency")
        .arg("1")
        .start()
        .await;
    let cp = ControlPlane::start(
        Server::Tonic,
        cp_listen(xds_pod_net),
        Fixture::new().service("payments", Service::new(id).endpoint(live)),
    )
    .await;
    let config = xds_client_config(certs, xds_pod_net, "frontend", &cp.address(), &[], "");
    let from_xds = Proxy::builder(&config, "")
        .env("RUST_LOG", QUIET)
        .arg("--concurrency")
        .arg("1")
        .start()
        .await;
    let host = "payments.aether.internal";
    // Warm both (connections, clusters).
    load(file_pod.outbound(), host, 200).await;
    load(xds_pod_net.outbound(), host, 200).await;
    let tick_us = 1_000_000.0 / 100.0; // USER_HZ is 100 on Linux
    let (mut file_us, mut xds_us) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        for (p, out, acc) in [
            (&from_file, file_pod.outbound(), &mut file_us),
            (&from_xds, xds_pod_net.outbound(), &mut xds_us),
        ] {
            let before = cpu_ticks(p);
            let n = load(out, host, 2000).await;
            let ticks = cpu_ticks(p) - before;
            acc.push(ticks as f64 * tick_us / n as f64);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (f, x) = (med(&mut file_us), med(&mut xds_us));
    println!(
        "steady-state client-proxy CPU per request (median of 3 rounds of 16,000): file {f:.1} us, xDS {x:.1} us (xDS/file {:.2})",
        x / f
    );
}
