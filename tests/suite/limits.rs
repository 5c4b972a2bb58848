//! Caps (SPEC section 8): the per-cluster circuit breakers (requests, upstream connections),
//! one dial per pool key at a time (eight side by side where connections are not shared), the
//! per-listener connection cap and the cap on inbound connections still in their TLS
//! handshake. Every rejection is counted.
//!
//! Real `aether-proxy run` processes and real mTLS on loopback, as in `crate::common::mesh`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::*;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

fn slow(path: &str, ms: u64) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    empty(
        get(path)
            .header("host", SVC)
            .header("x-app-delay-ms", ms.to_string()),
    )
}

/// True when the peer closed `s` (EOF or reset) within `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut b = [0u8; 64];
    match tokio::time::timeout(limit, s.read(&mut b)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        Ok(Ok(_)) => panic!("the proxy sent bytes to a connection that sent nothing"),
        Err(_) => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Circuit breakers
// ---------------------------------------------------------------------------------------------

/// `max_connections: 1` with HTTP/1.1 upstream connections: while the one connection carries a
/// slow request, a second concurrent request would need a second connection: 503 `overflow`,
/// counted. Once the first is done its connection is reused (no new connection needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_breaker_answers_overflow_and_reuses_what_it_has() {
    let m = OnePodMesh::start_with(OnePodExtras {
        service: "    circuit_breakers: { max_connections: 1 }\n",
        ..Default::default()
    })
    .await;
    let out = m.outbound();

    let first = tokio::spawn(async move { h1_to(out).await.send(slow("/slow", 1500)).await });
    // Wait until the slow request holds the one upstream connection.
    let (five_s, pace) = (Duration::from_secs(5), Duration::from_millis(10));
    eventually_every(
        five_s,
        pace,
        "the slow request reaching the app",
        async || holds(!m.app.seen().is_empty()),
    )
    .await;
    let r = get_h1(out, SVC, "/second").await;
    assert_proxy_error(
        &r,
        503,
        "overflow",
        "a second connection is over the breaker",
    );
    let counted = metric(
        &m.client,
        "aether_cluster_overflow_total",
        &["breaker=\"connections\"", "service=\"payments\""],
    )
    .await;
    assert_eq!(counted, 1.0, "the overflow is counted once");

    let r = first.await.unwrap().unwrap();
    assert_app_ok(&r, 8080, "the slow request");
    let r = get_h1(out, SVC, "/third").await;
    assert_app_ok(&r, 8080, "the pooled connection is reused");
    assert_eq!(m.app.connections(), 1, "one upstream connection in all");
}

/// `max_requests: 2`: a third concurrent request is answered 503 `overflow` at once; a
/// finished request frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_breaker_answers_overflow_past_its_limit() {
    let m = OnePodMesh::start_with(OnePodExtras {
        service: "    circuit_breakers: { max_requests: 2 }\n",
        ..Default::default()
    })
    .await;
    let out = m.outbound();

    let mut slow_ones = JoinSet::new();
    for i in 0..2 {
        slow_ones.spawn(async move {
            h2_to(out)
                .await
                .send(empty(
                    get(&format!("http://{SVC}/slow-{i}")).header("x-app-delay-ms", "1500"),
                ))
                .await
        });
    }
    let (five_s, pace) = (Duration::from_secs(5), Duration::from_millis(10));
    eventually_every(
        five_s,
        pace,
        "both slow requests reaching the app",
        async || holds(m.app.seen().len() >= 2),
    )
    .await;
    let t = Instant::now();
    let r = get_h1(out, SVC, "/third").await;
    assert_proxy_error(&r, 503, "overflow", "a third request in flight");
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    let counted = metric(
        &m.client,
        "aether_cluster_overflow_total",
        &["breaker=\"requests\""],
    )
    .await;
    assert_eq!(counted, 1.0);
    while let Some(r) = slow_ones.join_next().await {
        assert_app_ok(&r.unwrap().unwrap(), 8080, "a slow request");
    }
    let r = get_h1(out, SVC, "/fourth").await;
    assert_app_ok(&r, 8080, "places are freed");
}

// ---------------------------------------------------------------------------------------------
// One dial per pool key
// ---------------------------------------------------------------------------------------------

/// Twenty concurrent first requests from HTTP/2 callers to a cold endpoint open ONE upstream
/// connection (the others wait for it and share it), not twenty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_first_requests_dials_once() {
    let m = OnePodMesh::start().await;
    let out = m.outbound();

    let mut callers = Vec::new();
    for _ in 0..20 {
        callers.push(h2_to(out).await);
    }
    let mut set = JoinSet::new();
    for (i, mut c) in callers.into_iter().enumerate() {
        set.spawn(async move { c.send(empty(get(&format!("http://{SVC}/burst-{i}")))).await });
    }
    while let Some(r) = set.join_next().await {
        assert_app_ok(&r.unwrap().unwrap(), 8080, "a burst request");
    }
    let handshakes = metric(
        &m.server,
        "aether_tls_handshakes_total",
        &["listener=\"inbound\"", "result=\"ok\""],
    )
    .await;
    assert_eq!(
        handshakes, 1.0,
        "one upstream connection for the whole burst"
    );
}

/// Sends `n` concurrent requests and asserts that each is answered 503
/// `upstream-connect-failure`.
async fn all_fail_to_connect(out: SocketAddr, n: usize, why: &str) {
    let mut set = JoinSet::new();
    for i in 0..n {
        set.spawn(async move { get_h1(out, SVC, &format!("/doomed-{i}")).await });
    }
    while let Some(r) = set.join_next().await {
        assert_proxy_error(&r.unwrap(), 503, "upstream-connect-failure", why);
    }
}

/// An endpoint that accepts TCP and never answers TLS: ten concurrent requests wait for ONE
/// dial and fail with it (503 `upstream-connect-failure` after about one connect timeout),
/// instead of dialling one after the other (ten timeouts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dial_fails_the_requests_that_waited_for_it() {
    let net = Net::fresh();
    let client_pod = net.pod(0);
    let black_hole = net.pod(1);
    let certs = certs();
    let silent = TcpListener::bind(black_hole.inbound()).await.unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let held = {
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                conns.push(s);
            }
        })
    };
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    connect_timeout: 500ms\n",
        &[endpoint(black_hole.proxy_ip(), &[8080])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    let t = Instant::now();
    all_fail_to_connect(out, 10, "the endpoint never completes TLS").await;
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(2500),
        "ten waiters took {took:?}: they dialled one after the other"
    );
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one dial for ten concurrent requests"
    );
    held.abort();
}

// ---------------------------------------------------------------------------------------------
// Listener caps
// ---------------------------------------------------------------------------------------------

/// `limits.max_connections_per_listener: 5`: a sixth connection to the outbound listener is
/// closed at accept and counted; the five keep working, and a place freed is a place usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_closes_connections_past_its_cap() {
    let m = OnePodMesh::start_with(OnePodExtras {
        client_config: "limits:\n  max_connections_per_listener: 5\n",
        ..Default::default()
    })
    .await;
    let out = m.outbound();

    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(h1_to(out).await);
    }
    // The listener counts a connection once its task runs: give the five a moment.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut sixth = TcpStream::connect(out).await.unwrap();
    assert!(
        closed_within(&mut sixth, Duration::from_secs(2)).await,
        "the sixth connection must be closed"
    );
    assert_eq!(
        metric(
            &m.client,
            "aether_connections_rejected_total",
            &["listener=\"outbound\"", "reason=\"limit\""]
        )
        .await,
        1.0
    );
    for (i, c) in held.iter_mut().enumerate() {
        let r = c
            .send(empty(get(&format!("/held-{i}")).header("host", SVC)))
            .await
            .unwrap();
        assert_app_ok(&r, 8080, "a connection under the cap");
    }
    held.pop();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = get_h1(out, SVC, "/after").await;
    assert_app_ok(&r, 8080, "a freed place admits a new connection");
}

/// The data listeners' accept queues are as long as the node allows (`net.core.somaxconn`, as
/// Envoy's are), so a burst of connects waits there instead of overflowing into SYN cookies.
/// Read with `ss`, whose Send-Q column is a listening socket's queue length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_queue_as_many_connections_as_the_node_allows() {
    let m = OnePodMesh::start().await;
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    for addr in [m.outbound(), m.server_pod.inbound()] {
        let out = std::process::Command::new("ss")
            .args(["-Hltn", "src", &addr.to_string()])
            .output()
            .expect("ss (iproute2) runs");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let queue: u32 = text
            .split_whitespace()
            .nth(2)
            .and_then(|q| q.parse().ok())
            .unwrap_or_else(|| panic!("{addr}: no listening socket in {text:?}"));
        assert_eq!(queue, somaxconn.min(65535), "{addr}: {text}");
    }
}

/// `limits.max_pending_handshakes: 4` on a server pod: a fifth silent connection to :15008
/// closes the OLDEST silent one (not the newest, not the others); a real peer still gets
/// through while silent connections keep arriving; each eviction is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_unfinished_handshake_makes_room_for_a_new_connection() {
    let m = OnePodMesh::start_with(OnePodExtras {
        server_config: "limits:\n  max_pending_handshakes: 4\n",
        ..Default::default()
    })
    .await;
    let out = m.outbound();
    let inbound: SocketAddr = m.server_pod.inbound();

    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(TcpStream::connect(inbound).await.unwrap());
        // Admission order is accept order: keep them apart.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _fifth = TcpStream::connect(inbound).await.unwrap();
    assert!(
        closed_within(&mut silent[0], Duration::from_secs(2)).await,
        "the oldest silent connection is closed"
    );
    for s in silent.iter_mut().skip(1) {
        assert!(
            !closed_within(s, Duration::from_millis(100)).await,
            "younger silent connections stay"
        );
    }
    assert_eq!(
        metric(
            &m.server,
            "aether_connections_rejected_total",
            &["listener=\"inbound\"", "reason=\"handshake-evicted\""]
        )
        .await,
        1.0
    );
    // A real peer, with the pending set full of silent connections, gets through.
    let r = get_h1(out, SVC, "/real").await;
    assert_app_ok(&r, 8080, "a real peer behind a full pending set");
}

/// The abuse case: 600 silent connections flood a server pod's :15008 (pending cap 64, about
/// 500 new connections a second) while a real client keeps calling through its own proxy,
/// every request a new mTLS handshake. The flood is cut down to the cap, the real
/// client's requests all succeed with bounded latency, and the server proxy's memory stays
/// bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_silent_connections_cannot_lock_out_real_peers() {
    let m = OnePodMesh::start_with(OnePodExtras {
        server_config: "limits:\n  max_pending_handshakes: 64\n",
        service: "    max_requests_per_connection: 1\n",
        ..Default::default()
    })
    .await;
    let out = m.outbound();
    let inbound = m.server_pod.inbound();
    let rss_before = m.server.rss_kib();

    // The real client: every request a new upstream handshake, so each must pass the flood.
    let caller = tokio::spawn(async move {
        let mut latencies = Vec::new();
        for i in 0..60 {
            let t = Instant::now();
            let r = get_h1(out, SVC, &format!("/during-{i}")).await;
            assert_app_ok(&r, 8080, "a real request during the flood");
            latencies.push(t.elapsed());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        latencies
    });
    let t = Instant::now();
    let mut flood = Vec::new();
    // About 500 new connections a second: at that rate a real handshake (milliseconds) is
    // never the oldest of 64.
    for _ in 0..600 {
        if let Ok(s) = TcpStream::connect(inbound).await {
            flood.push(s);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut latencies = caller.await.unwrap();
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100 - 1];
    // Once the proxy has accepted the whole flood, all but the newest 64 were evicted.
    let evicted = wait_metric(
        &m.server,
        "aether_connections_rejected_total",
        &["reason=\"handshake-evicted\""],
        Duration::from_secs(10),
        |v| v >= (flood.len() - 64) as f64,
    )
    .await;
    let cut_off = t.elapsed();
    let mut open = 0;
    for s in flood.iter_mut() {
        if !closed_within(s, Duration::from_millis(20)).await {
            open += 1;
        }
    }
    let rss_after = m.server.rss_kib();
    eprintln!(
        "silent flood: {} connections, {evicted} evicted, {open} still open (cap 64), real p99 \
         {p99:?}, server RSS {rss_before} -> {rss_after} KiB, flood cut down after {cut_off:?}",
        flood.len()
    );
    assert!(open <= 64, "{open} silent connections still open");
    assert!(p99 < Duration::from_millis(500), "real client p99 {p99:?}");
    assert!(
        rss_after < rss_before + 32 * 1024,
        "RSS grew from {rss_before} to {rss_after} KiB"
    );
}

/// A relay on another address of the pod that holds every new connection for `delay` before
/// passing it on to `target`, counting the connections it was given and how many it held at
/// once.
struct DelayRelay {
    total: Arc<AtomicUsize>,
    most_held: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl DelayRelay {
    async fn start(at: SocketAddr, target: SocketAddr, delay: Duration) -> DelayRelay {
        let relay = TcpListener::bind(at).await.unwrap();
        let (total, most_held) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let held = Arc::new(AtomicUsize::new(0));
        let (t, m) = (total.clone(), most_held.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut down, _)) = relay.accept().await {
                t.fetch_add(1, Ordering::SeqCst);
                let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                let held = held.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    held.fetch_sub(1, Ordering::SeqCst);
                    if let Ok(mut up) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
            }
        });
        DelayRelay {
            total,
            most_held,
            task,
        }
    }
}

impl Drop for DelayRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client pod whose catalog sends `payments` (with the service lines `extra`) to a
/// `DelayRelay` that holds each new connection for 300 ms in front of the server pod's proxy.
struct Relayed {
    out: SocketAddr,
    relay: DelayRelay,
    _running: (HttpApp, Proxy, Proxy, Certs),
}

async fn behind_a_slow_relay(extra: &str) -> Relayed {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let server = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let relay_ip = p1.extra(3);
    let at = SocketAddr::new(relay_ip, 15008);
    let relay = DelayRelay::start(at, p1.inbound(), Duration::from_millis(300)).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        extra,
        &[endpoint(relay_ip, &[8080])],
    )]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    Relayed {
        out: client_pod.outbound(),
        relay,
        _running: (app, server, client, certs),
    }
}

/// A burst of requests for a key whose connections are not shared dials at most
/// `PARALLEL_DIALS` (8) connections at once; the rest wait for a free dial. Behind a relay that
/// holds each new connection for 300 ms, 30 concurrent requests that each need their own
/// connection (one request per connection) all succeed, and the relay never holds more than
/// 8 handshakes at once (without the bound it held all 30).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_dials_at_most_eight_connections_at_once() {
    let m = behind_a_slow_relay("    max_requests_per_connection: 1\n").await;
    let (out, relay) = (m.out, &m.relay);

    assert_app_ok(&get_h1(out, SVC, "/first").await, 8080, "the first request");
    let mut set = JoinSet::new();
    for i in 0..30 {
        set.spawn(async move { get_h1(out, SVC, &format!("/burst-{i}")).await });
    }
    while let Some(r) = set.join_next().await {
        assert_app_ok(&r.unwrap(), 8080, "a request of the burst");
    }
    let (total, most) = (
        relay.total.load(Ordering::SeqCst),
        relay.most_held.load(Ordering::SeqCst),
    );
    assert_eq!(total, 31, "one connection per request");
    assert!(
        most <= 8,
        "{most} connections were being dialled at once (at most 8)"
    );
}

/// Requests waiting for a dial take a connection handed back to the pool instead: behind a
/// relay that holds each new connection for 300 ms, a burst of 20 HTTP/1.1 requests finds one
/// pooled connection, eight of them dial, and the other eleven are served one after another
/// on the connections that come back, long before any dial ends. Nine connections in all, not
/// one per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_take_connections_handed_back() {
    let m = behind_a_slow_relay("").await;
    let (out, relay) = (m.out, &m.relay);

    // The first request learns that this key's (HTTP/1.1) connections are not shared, and
    // leaves its connection in the pool.
    assert_app_ok(&get_h1(out, SVC, "/first").await, 8080, "the first request");
    let t = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..20 {
        set.spawn(async move {
            let r = get_h1(out, SVC, &format!("/burst-{i}")).await;
            (r, t.elapsed())
        });
    }
    let mut early = 0;
    while let Some(r) = set.join_next().await {
        let (r, took) = r.unwrap();
        assert_app_ok(&r, 8080, "a request of the burst");
        early += usize::from(took < Duration::from_millis(250));
    }
    let total = relay.total.load(Ordering::SeqCst);
    assert!(
        total <= 9,
        "{total} connections for 21 requests: waiting requests dialled instead of taking the \
         connections handed back (at most 1 + 8)"
    );
    assert!(
        early >= 10,
        "only {early} of 20 requests were answered before the dials could end"
    );
}

/// The bound does not turn a dead endpoint into rounds of timeouts: once the endpoint stops
/// completing TLS, 20 concurrent requests for a key whose connections are not shared make 8
/// dials, and when those fail the 12 requests waiting for a place fail with them (503
/// `upstream-connect-failure`) instead of dialling in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_parallel_dial_fails_the_requests_waiting_for_a_place() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let _app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    // Passes its first connection on to the server proxy, then accepts and holds the rest.
    let relay_ip = p1.extra(3);
    let relay = TcpListener::bind(SocketAddr::new(relay_ip, 15008))
        .await
        .unwrap();
    let silent = Arc::new(AtomicUsize::new(0));
    let target = p1.inbound();
    let relaying = {
        let silent = silent.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            let mut first = true;
            while let Ok((mut down, _)) = relay.accept().await {
                if std::mem::take(&mut first) {
                    tokio::spawn(async move {
                        let mut up = TcpStream::connect(target).await.unwrap();
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    });
                } else {
                    silent.fetch_add(1, Ordering::SeqCst);
                    held.push(down);
                }
            }
        })
    };
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    max_requests_per_connection: 1\n    connect_timeout: 500ms\n",
        &[endpoint(relay_ip, &[8080])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    assert_app_ok(&get_h1(out, SVC, "/first").await, 8080, "the first request");
    all_fail_to_connect(out, 20, "the endpoint no longer completes TLS").await;
    assert_eq!(
        silent.load(Ordering::SeqCst),
        8,
        "eight dials for twenty requests: the ones waiting for a place failed with them"
    );
    relaying.abort();
}

/// Once a key's connections turn out not to be shareable (HTTP/1.1 callers, one request per
/// connection), concurrent requests dial at once instead of taking turns: behind a relay that
/// holds every new connection for 300 ms, five concurrent requests take about one delay, not
/// five in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unshared_connections_are_dialled_in_parallel() {
    let m = behind_a_slow_relay("    max_requests_per_connection: 1\n").await;
    let out = m.out;

    // The first request learns that this key's connections are not shared.
    assert_app_ok(&get_h1(out, SVC, "/first").await, 8080, "the first request");
    let t = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..5 {
        set.spawn(async move { get_h1(out, SVC, &format!("/parallel-{i}")).await });
    }
    while let Some(r) = set.join_next().await {
        assert_app_ok(&r.unwrap(), 8080, "a concurrent request");
    }
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(1200),
        "five requests needing five connections took {took:?}: their dials took turns"
    );
}
