//! The proxy under attack (SPEC section 8): slowloris, header floods, an HPACK bomb, a
//! CONTINUATION flood, an unfinished header block, rapid reset, and TLS garbage on :15008.
//!
//! Each test runs a real `aether-proxy run` on loopback and asserts three things:
//! (a) the attacker is cut off (connection closed, GOAWAY or an error answer) within a bound,
//! (b) the proxy's resident memory (VmRSS of the process) grows by less than a stated bound,
//! (c) a well-behaved client on its own connection keeps getting answers, with bounded p99.
//! The figures are printed (`--nocapture`) and kept in tests/README.md ("Abuse figures").
//!
//! The proxy runs with shrunk header timers (`AETHER_TEST_TIMERS`) so that each test stays
//! well under 20 s; the code paths are the ones the defaults use.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::inbound::*;
use crate::common::mesh::{FRONTEND, PAYMENTS, TD};
use crate::common::*;
use http::StatusCode;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// The header read timer (ClientHello, request head, HTTP/2 preface) and the HTTP/2 header
/// block timer, shrunk from 10 s.
const HEAD_READ: Duration = Duration::from_secs(3);
const HEADER_BLOCK: Duration = Duration::from_secs(3);
const TIMERS: &str = "head_read=3s,header_block=3s";

/// The well-behaved client's p99 bound during an attack (a loaded 2-core CI machine included).
const P99_BOUND: Duration = Duration::from_millis(1500);

/// A `payments` sidecar: 8080 `auto` (the default port) and 9090 `h2`, an app behind each.
struct Pod {
    net: PodNet,
    certs: Certs,
    proxy: Proxy,
    app8080: HttpApp,
    app9090: HttpApp,
}

impl Pod {
    async fn start() -> Pod {
        let net = Net::fresh().pod(0);
        let certs = Certs::new(TD, &[PAYMENTS, FRONTEND]);
        let app8080 = HttpApp::auto(net.app(8080)).await;
        let app9090 = HttpApp::auto(net.app(9090)).await;
        let ports = [
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: h2 }",
        ];
        let proxy = payments_sidecar(&certs, net, &ports)
            .env("AETHER_TEST_TIMERS", TIMERS)
            // Hundreds of attack connections: debug logs would only measure the logger.
            .env("RUST_LOG", "warn")
            .start()
            .await;
        Pod {
            net,
            certs,
            proxy,
            app8080,
            app9090,
        }
    }

    fn client(&self, sni: &str, alpn: &[&str]) -> TlsClient {
        frontend_peer(&self.certs, sni, alpn)
    }

    async fn tls(&self, client: &TlsClient) -> TlsStream {
        tls_to(client, self.net.inbound()).await
    }

    /// Requests the apps saw other than the well-behaved client's.
    fn attack_traffic(&self) -> usize {
        let mut seen = self.app8080.seen();
        seen.extend(self.app9090.seen());
        seen.iter().filter(|s| !s.uri.contains("/steady")).count()
    }
}

/// Samples the proxy's RSS every 50 ms; keeps the peak.
struct RssWatch {
    before: u64,
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl RssWatch {
    fn start(pod: &Pod) -> RssWatch {
        let before = pod.proxy.rss_kib();
        let peak = Arc::new(AtomicU64::new(before));
        let stop = Arc::new(AtomicBool::new(false));
        let pid = pod.proxy.pid().unwrap();
        let (p, s) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(kib) = rss_kib_of(pid) {
                    p.fetch_max(kib, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        RssWatch { before, peak, stop }
    }

    /// Peak growth in KiB.
    fn growth(&self) -> u64 {
        self.peak
            .load(Ordering::Relaxed)
            .saturating_sub(self.before)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A well-behaved HTTP/2 client on its own connection: a GET every 20 ms, latencies recorded.
struct Steady {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(Vec<Duration>, Vec<String>)>,
}

impl Steady {
    async fn start(pod: &Pod) -> Steady {
        let tls = pod.tls(&pod.client("9090", &["h2"])).await;
        let mut c = HttpClient::h2(tls).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let (mut lat, mut failures) = (Vec::new(), Vec::new());
            while !s.load(Ordering::Relaxed) {
                let start = Instant::now();
                match within(IO_TIMEOUT, "steady GET", c.get("http://payments/steady")).await {
                    Ok(Ok(r)) if r.status == StatusCode::OK => lat.push(start.elapsed()),
                    Ok(Ok(r)) => failures.push(format!("{} {}", r.status, r.text())),
                    Ok(Err(e)) | Err(e) => failures.push(e),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (lat, failures)
        });
        Steady { stop, task }
    }

    /// (requests answered, p99); panics if any failed.
    async fn finish(self) -> (usize, Duration) {
        self.stop.store(true, Ordering::Relaxed);
        let (mut lat, failures) = self.task.await.unwrap();
        assert!(
            failures.is_empty(),
            "the well-behaved client failed during the attack: {failures:?}"
        );
        assert!(
            lat.len() >= 10,
            "the well-behaved client got only {} answers",
            lat.len()
        );
        lat.sort();
        let p99 = lat[(lat.len() * 99 / 100).min(lat.len() - 1)];
        (lat.len(), p99)
    }
}

/// Checks and prints one test's figures.
fn report(
    name: &str,
    rss: &RssWatch,
    rss_bound_mib: u64,
    cut_off: Duration,
    steady: (usize, Duration),
) {
    let growth = rss.growth();
    eprintln!(
        "abuse figures | {name} | RSS +{:.1} MiB (bound {rss_bound_mib} MiB) | cut off within {:.2} s | \
         well-behaved p99 {:.1} ms over {} requests",
        growth as f64 / 1024.0,
        cut_off.as_secs_f64(),
        steady.1.as_secs_f64() * 1000.0,
        steady.0
    );
    assert!(
        growth < rss_bound_mib * 1024,
        "{name}: RSS grew by {growth} KiB (bound {rss_bound_mib} MiB)"
    );
    assert!(
        steady.1 < P99_BOUND,
        "{name}: the well-behaved p99 was {:?}",
        steady.1
    );
}

/// Reads until EOF, an error or `limit`; returns how long that took and what was read.
async fn until_closed<S: AsyncRead + Unpin>(
    s: &mut S,
    limit: Duration,
) -> (Duration, Vec<u8>, ReadEnd) {
    let start = Instant::now();
    let (got, end) = read_to_end_within(s, limit).await;
    (start.elapsed(), got, end)
}

// ---------------------------------------------------------------------------------------------
// HTTP/1
// ---------------------------------------------------------------------------------------------

/// Hundreds of connections trickle a head a byte at a time. A quarter of them offer no ALPN and
/// start with the first line of the HTTP/2 preface, which must not buy them the idle timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_cut_off_by_the_head_timer() {
    const CONNECTIONS: usize = 200;
    let pod = Pod::start().await;
    let steady = Steady::start(&pod).await;
    let rss = RssWatch::start(&pod);
    let h1 = pod.client("8080", &["http/1.1"]);
    let sniffed = pod.client("8080", &[]);
    let mut conns = Vec::new();
    let pod_ref = &pod;
    for batch in 0..CONNECTIONS / 20 {
        let mut handshakes = Vec::new();
        for i in 0..20 {
            let preface_like = (batch * 20 + i) % 4 == 0;
            let client = if preface_like { &sniffed } else { &h1 };
            handshakes.push(async move { (preface_like, pod_ref.tls(client).await) });
        }
        conns.extend(futures_util::future::join_all(handshakes).await);
    }
    let start = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|(preface_like, tls)| {
            tokio::spawn(async move {
                let (mut r, mut w) = tokio::io::split(tls);
                // All but the last two bytes of the HTTP/2 preface, then silence.
                let first: &[u8] = if preface_like {
                    b"PRI * HTTP/2.0\r\n\r\nSM\r\n"
                } else {
                    b"GET / HTTP/1.1\r\nhost: payments\r\nx-slow: "
                };
                let began = Instant::now();
                let trickle = async move {
                    if w.write_all(first).await.is_err() || preface_like {
                        return;
                    }
                    loop {
                        tokio::time::sleep(Duration::from_millis(250)).await;
                        if w.write_all(b"x").await.is_err() {
                            return;
                        }
                    }
                };
                tokio::spawn(trickle);
                let (_, got, end) = until_closed(&mut r, HEAD_READ * 3).await;
                (began.elapsed(), got, end)
            })
        })
        .collect();
    let mut worst = Duration::ZERO;
    for t in tasks {
        let (took, got, end) = t.await.unwrap();
        assert_ne!(
            end,
            ReadEnd::TimedOut,
            "a slowloris connection is still open after {took:?}"
        );
        assert!(
            got.is_empty(),
            "a slowloris connection got an answer: {:?}",
            String::from_utf8_lossy(&got)
        );
        worst = worst.max(took);
    }
    assert!(
        worst < HEAD_READ + Duration::from_secs(3),
        "slowloris connections held for {worst:?}"
    );
    assert!(start.elapsed() >= HEAD_READ - Duration::from_millis(500));
    let counted = cut_offs_at_least(&pod.proxy, "head_timeout", CONNECTIONS as u64).await;
    assert!(
        counted >= CONNECTIONS as u64,
        "only {counted} head timeouts counted for {CONNECTIONS} slowloris connections"
    );
    let figures = steady.finish().await;
    report("slowloris (200 conns)", &rss, 64, worst, figures);
    assert!(
        pod.app8080.seen().is_empty(),
        "a trickled head reached the app"
    );
}

/// Huge heads (1 MiB of header lines) and many tiny headers, from 20 connections at once:
/// each is answered 431 and closed; the proxy never holds much more than the head limit each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_floods_are_answered_431_and_closed() {
    let pod = Pod::start().await;
    let steady = Steady::start(&pod).await;
    let rss = RssWatch::start(&pod);
    let client = pod.client("8080", &["http/1.1"]);
    let mut tasks = Vec::new();
    for i in 0..20 {
        let tls = pod.tls(&client).await;
        tasks.push(tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(tls);
            let many_small = i % 2 == 1;
            let began = Instant::now();
            tokio::spawn(async move {
                let _ = w.write_all(b"GET / HTTP/1.1\r\nhost: payments\r\n").await;
                let line: Vec<u8> = if many_small {
                    b"a: b\r\n".to_vec()
                } else {
                    let mut l = b"x-flood: ".to_vec();
                    l.resize(1022, b'f');
                    l.extend_from_slice(b"\r\n");
                    l
                };
                let mut sent = 0;
                while sent < 1 << 20 {
                    let chunk: Vec<u8> =
                        line.iter().copied().cycle().take(line.len() * 16).collect();
                    if w.write_all(&chunk).await.is_err() {
                        return;
                    }
                    sent += chunk.len();
                }
                let _ = w.write_all(b"\r\n").await;
            });
            let (_, got, end) = until_closed(&mut r, IO_TIMEOUT).await;
            (
                many_small,
                began.elapsed(),
                String::from_utf8_lossy(&got).into_owned(),
                end,
            )
        }));
    }
    let mut worst = Duration::ZERO;
    for t in tasks {
        let (many_small, took, answer, end) = t.await.unwrap();
        assert_ne!(
            end,
            ReadEnd::TimedOut,
            "a flooding connection is still open: {answer}"
        );
        assert!(
            answer.starts_with("HTTP/1.1 431 "),
            "many_small={many_small}: {answer:?}"
        );
        // The proxy's own answer (SPEC section 7), not the codec's, for too many bytes and
        // for too many fields alike.
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("x-aether-error: headers-too-large"),
            "many_small={many_small}: {answer}"
        );
        worst = worst.max(took);
    }
    assert!(cut_offs_at_least(&pod.proxy, "headers_too_large", 20).await >= 20);
    let figures = steady.finish().await;
    report(
        "header flood (20 conns x 1 MiB heads)",
        &rss,
        64,
        worst,
        figures,
    );
    assert_eq!(pod.attack_traffic(), 0);
}

// ---------------------------------------------------------------------------------------------
// HTTP/2, raw frames
// ---------------------------------------------------------------------------------------------

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ENHANCE_YOUR_CALM: u32 = 0xb;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A GET's pseudo-headers: `:method GET`, `:scheme http`, `:path /` (static table), and
/// `:authority payments` (literal, not indexed).
fn get_block() -> Vec<u8> {
    let mut b = vec![0x82, 0x86, 0x84, 0x01, 8];
    b.extend_from_slice(b"payments");
    b
}

/// How a raw HTTP/2 connection ended.
#[derive(Debug)]
enum H2End {
    GoAway(u32),
    Closed,
    Open,
}

/// Reads frames until a GOAWAY, the end of the connection, or `limit`.
async fn h2_end<S: AsyncRead + Unpin>(r: &mut S, limit: Duration) -> (H2End, Duration) {
    let start = Instant::now();
    let read = async {
        let mut head = [0u8; 9];
        loop {
            if r.read_exact(&mut head).await.is_err() {
                return H2End::Closed;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            if r.read_exact(&mut payload).await.is_err() {
                return H2End::Closed;
            }
            if head[3] == GOAWAY && payload.len() >= 8 {
                return H2End::GoAway(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
            }
        }
    };
    let end = tokio::time::timeout(limit, read)
        .await
        .unwrap_or(H2End::Open);
    (end, start.elapsed())
}

/// mTLS with ALPN h2 to the h2 port, then the client preface and empty SETTINGS.
async fn raw_h2(pod: &Pod) -> TlsStream {
    let mut tls = pod.tls(&pod.client("9090", &["h2"])).await;
    tls.write_all(PREFACE).await.unwrap();
    tls.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    tls
}

/// One small header block that decodes to `refs` x 4 KiB: a 4000-byte value entered in the
/// HPACK table once, then referenced `refs` times by its one-byte index.
fn hpack_bomb(refs: usize) -> Vec<u8> {
    let mut b = get_block();
    // Literal with incremental indexing, new name "x-bomb", value of 4000 bytes.
    b.push(0x40);
    b.push(6);
    b.extend_from_slice(b"x-bomb");
    b.extend([0x7f, 0xa1, 0x1e]); // 127 + 3873 = 4000
    b.extend(std::iter::repeat_n(b'a', 4000));
    // Index 62: the newest dynamic entry.
    b.extend(std::iter::repeat_n(0xbe, refs));
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hpack_bomb_is_cut_off_where_it_is_decoded() {
    const BOMBS: usize = 30;
    let pod = Pod::start().await;
    let steady = Steady::start(&pod).await;
    let rss = RssWatch::start(&pod);
    // 48 MB decoded from 16 KiB, and 1.2 MB from 5 KiB: the second is over four times the
    // 64 KiB list limit (h2's abuse threshold) but under four times a 1 MiB one.
    let huge = frame(HEADERS, END_HEADERS | END_STREAM, 1, &hpack_bomb(12000));
    let small = frame(HEADERS, END_HEADERS | END_STREAM, 1, &hpack_bomb(300));
    assert!(huge.len() < 16384 + 9, "one frame of the default size");
    let mut worst = Duration::ZERO;
    for i in 0..BOMBS {
        let mut tls = raw_h2(&pod).await;
        tls.write_all(if i % 2 == 0 { &huge } else { &small })
            .await
            .unwrap();
        let (end, took) = h2_end(&mut tls, IO_TIMEOUT).await;
        match end {
            H2End::GoAway(code) => assert_eq!(code, ENHANCE_YOUR_CALM, "GOAWAY code"),
            H2End::Closed => {}
            H2End::Open => panic!("the bomb's connection is still open after {took:?}"),
        }
        worst = worst.max(took);
    }
    assert!(cut_offs_at_least(&pod.proxy, "h2_too_much", BOMBS as u64).await >= BOMBS as u64);
    let figures = steady.finish().await;
    report(
        "HPACK bomb (30 conns, 1.2-48 MB decoded each)",
        &rss,
        32,
        worst,
        figures,
    );
    assert_eq!(pod.attack_traffic(), 0, "a bomb reached the app");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_flood_is_cut_off() {
    let pod = Pod::start().await;
    let steady = Steady::start(&pod).await;
    let rss = RssWatch::start(&pod);
    let mut worst = Duration::ZERO;
    let mut most_frames = 0;
    for _ in 0..20 {
        let tls = raw_h2(&pod).await;
        let (mut r, mut w) = tokio::io::split(tls);
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let flood = tokio::spawn(async move {
            let _ = w
                .write_all(&frame(HEADERS, END_STREAM, 1, &get_block()))
                .await;
            // Endless CONTINUATION frames, never END_HEADERS: `accept-encoding` from the
            // static table, over and over.
            let cont = frame(CONTINUATION, 0, 1, &[0x90; 64]);
            let batch: Vec<u8> = cont.iter().copied().cycle().take(cont.len() * 16).collect();
            while w.write_all(&batch).await.is_ok() {
                counter.fetch_add(16, Ordering::Relaxed);
            }
        });
        let (end, took) = h2_end(&mut r, IO_TIMEOUT).await;
        assert!(
            !matches!(end, H2End::Open),
            "the flood's connection is still open after {took:?}"
        );
        flood.abort();
        worst = worst.max(took);
        most_frames = most_frames.max(sent.load(Ordering::Relaxed));
    }
    eprintln!(
        "continuation flood: at most {most_frames} CONTINUATION frames written before the cut"
    );
    assert!(cut_offs_at_least(&pod.proxy, "h2_too_much", 20).await >= 20);
    let figures = steady.finish().await;
    report("CONTINUATION flood (20 conns)", &rss, 32, worst, figures);
    assert_eq!(pod.attack_traffic(), 0);
}

/// HEADERS without END_HEADERS, then silence: the header block timer ends it (without it, only
/// the one-hour idle timer would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_header_block_is_cut_off_in_time() {
    let pod = Pod::start().await;
    let steady = Steady::start(&pod).await;
    let rss = RssWatch::start(&pod);
    let mut conns = Vec::new();
    for _ in 0..50 {
        let mut tls = raw_h2(&pod).await;
        tls.write_all(&frame(HEADERS, END_STREAM, 1, &get_block()))
            .await
            .unwrap();
        conns.push(tls);
    }
    let waits = conns.iter_mut().map(|tls| h2_end(tls, HEADER_BLOCK * 3));
    let ends = futures_util::future::join_all(waits).await;
    let mut worst = Duration::ZERO;
    for (end, took) in ends {
        assert!(!matches!(end, H2End::Open), "still open after {took:?}");
        worst = worst.max(took);
    }
    assert!(
        worst >= HEADER_BLOCK - Duration::from_millis(500),
        "cut off early: {worst:?}"
    );
    assert!(
        worst < HEADER_BLOCK + Duration::from_secs(3),
        "cut off late: {worst:?}"
    );
    assert!(cut_offs_at_least(&pod.proxy, "header_block_timeout", 50).await >= 50);
    let figures = steady.finish().await;
    report(
        "unfinished header block (50 conns)",
        &rss,
        32,
        worst,
        figures,
    );
}

/// CVE-2023-44487: HEADERS then RST_STREAM, over and over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_closes_the_connection() {
    let pod = Pod::start().await;
    let steady = Steady::start(&pod).await;
    let rss = RssWatch::start(&pod);
    let mut worst = Duration::ZERO;
    let mut most_streams = 0;
    let (start, mut connections) = (Instant::now(), 0);
    // Connection after connection for two seconds.
    while start.elapsed() < Duration::from_secs(2) {
        connections += 1;
        let tls = raw_h2(&pod).await;
        let (mut r, mut w) = tokio::io::split(tls);
        let streams = Arc::new(AtomicU64::new(0));
        let counter = streams.clone();
        let attack = tokio::spawn(async move {
            let block = get_block();
            let mut id = 1u32;
            loop {
                let mut batch = Vec::new();
                for _ in 0..50 {
                    batch.extend(frame(HEADERS, END_HEADERS | END_STREAM, id, &block));
                    batch.extend(frame(RST_STREAM, 0, id, &8u32.to_be_bytes()));
                    id += 2;
                }
                if w.write_all(&batch).await.is_err() {
                    return;
                }
                counter.fetch_add(50, Ordering::Relaxed);
                if id > 2_000_000 {
                    return;
                }
            }
        });
        let (end, took) = h2_end(&mut r, IO_TIMEOUT).await;
        attack.abort();
        assert!(
            !matches!(end, H2End::Open),
            "the rapid-reset connection is still open after {took:?}"
        );
        worst = worst.max(took);
        most_streams = most_streams.max(streams.load(Ordering::Relaxed));
    }
    eprintln!("rapid reset: at most {most_streams} streams written before the cut");
    let rapid = cut_offs(&pod.proxy, "rapid_reset").await;
    let counted = cut_offs_at_least(
        &pod.proxy,
        "h2_too_much",
        connections - rapid.min(connections),
    )
    .await
        + rapid;
    assert!(
        counted >= connections,
        "{counted} cut-offs counted for {connections} rapid-reset connections"
    );
    let figures = steady.finish().await;
    report(
        &format!("rapid reset ({connections} conns in 2 s)"),
        &rss,
        32,
        worst,
        figures,
    );
    let reached = pod.attack_traffic();
    assert!(
        reached < 1000,
        "{reached} reset streams still reached the app"
    );
}

// ---------------------------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------------------------

/// Garbage instead of a ClientHello is refused at once; a truncated ClientHello is cut off by
/// the hello timeout; the handshake failures are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_garbage_and_truncated_hellos_are_cut_off() {
    let pod = Pod::start().await;
    let steady = Steady::start(&pod).await;
    let rss = RssWatch::start(&pod);
    let errors_before = series_or_zero(
        &pod.proxy,
        "aether_tls_handshakes_total{listener=\"inbound\",result=\"error\"}",
    )
    .await;
    let times = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..100u32 {
        let addr = pod.net.inbound();
        let times = times.clone();
        tasks.push(tokio::spawn(async move {
            let mut tcp = tcp_connect(addr).await.unwrap();
            let truncated = i % 2 == 0;
            let bytes: Vec<u8> = if truncated {
                // A handshake record announcing 512 bytes, a ClientHello header, 40 bytes.
                let mut b = vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];
                b.extend(std::iter::repeat_n(0x03, 40));
                b
            } else {
                (0..4096u32)
                    .map(|k| (k.wrapping_mul(2654435761).wrapping_add(i) >> 13) as u8)
                    .collect()
            };
            let start = Instant::now();
            let _ = tcp.write_all(&bytes).await;
            let (_, end) = read_to_end_within(&mut tcp, HEAD_READ * 3).await;
            assert_ne!(end, ReadEnd::TimedOut, "truncated={truncated}: still open");
            times.lock().unwrap().push((truncated, start.elapsed()));
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let times = times.lock().unwrap().clone();
    let garbage_worst = times.iter().filter(|t| !t.0).map(|t| t.1).max().unwrap();
    let truncated_worst = times.iter().filter(|t| t.0).map(|t| t.1).max().unwrap();
    assert!(
        garbage_worst < Duration::from_secs(2),
        "garbage held for {garbage_worst:?}"
    );
    assert!(
        truncated_worst < HEAD_READ + Duration::from_secs(3),
        "truncated hellos held for {truncated_worst:?}"
    );
    let errors = series_or_zero(
        &pod.proxy,
        "aether_tls_handshakes_total{listener=\"inbound\",result=\"error\"}",
    )
    .await;
    assert!(
        errors - errors_before >= 100,
        "{} handshake errors counted",
        errors - errors_before
    );
    eprintln!(
        "tls: garbage refused within {:.2} s, truncated hellos cut off within {:.2} s",
        garbage_worst.as_secs_f64(),
        truncated_worst.as_secs_f64()
    );
    let figures = steady.finish().await;
    report(
        "TLS garbage + truncated ClientHellos (100 conns)",
        &rss,
        32,
        truncated_worst,
        figures,
    );
}
