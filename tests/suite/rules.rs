//! SPEC section 8's header and identity rules, input validation, the access log's bound, the
//! client session cache, the ClientHello reader's linear work, and SPEC section 12's admin
//! rules: real `aether-proxy` processes, real mTLS, real apps, all on loopback.

use std::time::{Duration, Instant};

use crate::common::inbound::{assert_refused, frontend_peer, tls_to};
use crate::common::mesh::wire::Observer;
use crate::common::mesh::*;
use crate::common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn req_to(path: &str) -> http::request::Builder {
    get(path).header("host", SVC)
}

// ---------------------------------------------------------------------------------------------
// Headers (SPEC section 8)
// ---------------------------------------------------------------------------------------------

/// `te` survives only when every value of every `te` header is `trailers`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn te_is_kept_only_when_every_value_is_trailers() {
    let m = OnePodMesh::start().await;
    let cases: [(&str, &[&str], bool); 5] = [
        ("/te-one", &["trailers"], true),
        ("/te-two-trailers", &["trailers", "trailers"], true),
        ("/te-list", &["trailers, gzip"], false),
        ("/te-second-header", &["trailers", "deflate"], false),
        ("/te-other", &["gzip"], false),
    ];
    for (path, values, kept) in cases {
        let mut b = req_to(path);
        for v in values {
            b = b.header("te", *v);
        }
        let r = m.send(empty(b)).await;
        assert_app_ok(&r, 8080, path);
        let seen = m.seen(path);
        let te = seen.header_all("te");
        if kept {
            assert!(
                !te.is_empty()
                    && te
                        .iter()
                        .all(|v| v.split(',').all(|t| t.trim() == "trailers")),
                "{path}: te {te:?}"
            );
        } else {
            assert!(te.is_empty(), "{path}: te {te:?} should have been removed");
        }
    }
}

/// `Connection` may name headers away, but never `x-request-id` (it keeps the request's value
/// end to end) nor XFCC (the server side sets it after the removal); checked through both
/// proxies, and on the server side alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cannot_remove_the_request_id_or_xfcc() {
    let m = OnePodMesh::start().await;
    let r = m
        .send(empty(
            req_to("/through-both")
                .header(
                    "connection",
                    "x-request-id, x-forwarded-client-cert, x-gone",
                )
                .header("x-request-id", "keep-me-1")
                .header("x-gone", "1")
                .header("x-kept", "1"),
        ))
        .await;
    assert_app_ok(&r, 8080, "through both proxies");
    let seen = m.seen("/through-both");
    assert_eq!(seen.header_all("x-request-id"), ["keep-me-1"]);
    let xfcc = expected_xfcc(&m.certs, PAYMENTS, "frontend", FRONTEND);
    assert_eq!(seen.header_all("x-forwarded-client-cert"), [xfcc.as_str()]);
    assert!(seen.header("x-gone").is_none(), "{:?}", seen.headers);
    assert_eq!(seen.header("x-kept"), Some("1"));
    assert!(seen.header("connection").is_none());

    // The server side alone: a peer proxy (here, the test) naming them in `Connection`.
    let tls = tls_to(
        &frontend_peer(&m.certs, "8080", &["http/1.1"]),
        m.server_pod.inbound(),
    )
    .await;
    let mut c = HttpClient::h1(tls).await.unwrap();
    let r = c
        .send(empty(
            get("http://payments.aether.internal/inbound-only")
                .header("connection", "x-request-id, x-forwarded-client-cert")
                .header("x-request-id", "keep-me-2")
                .header("x-forwarded-client-cert", "By=forged"),
        ))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);
    let seen = m.seen("/inbound-only");
    assert_eq!(seen.header_all("x-request-id"), ["keep-me-2"]);
    assert_eq!(seen.header_all("x-forwarded-client-cert"), [xfcc.as_str()]);
}

/// Header names with `_` are dropped from requests on both sides, and counted per side.
/// Responses are not touched (Envoy's `headers_with_underscores_action` is about requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn underscored_request_headers_are_dropped_on_both_sides() {
    let m = OnePodMesh::start().await;
    let r = m
        .send(empty(
            req_to("/underscores")
                .header("x_forwarded_client_cert", "By=forged")
                .header("x_custom", "1")
                .header("x-custom", "2"),
        ))
        .await;
    assert_app_ok(&r, 8080, "through both proxies");
    let seen = m.seen("/underscores");
    assert!(
        seen.headers.iter().all(|(k, _)| !k.contains('_')),
        "{:?}",
        seen.headers
    );
    assert_eq!(seen.header("x-custom"), Some("2"));
    let dropped = r#"aether_request_headers_dropped_total{direction="outbound"}"#;
    assert_eq!(metric_value(&m.client, dropped).await, 2.0);

    // Straight to the server side: its own rule, its own count.
    let tls = tls_to(
        &frontend_peer(&m.certs, "8080", &["h2"]),
        m.server_pod.inbound(),
    )
    .await;
    let mut c = HttpClient::h2(tls).await.unwrap();
    let r = c
        .send(empty(
            get("http://payments.aether.internal/inbound-underscores")
                .header("x_request_id", "forged"),
        ))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);
    let seen = m.seen("/inbound-underscores");
    assert!(seen.header("x_request_id").is_none(), "{:?}", seen.headers);
    let dropped = r#"aether_request_headers_dropped_total{direction="inbound"}"#;
    assert_eq!(metric_value(&m.server, dropped).await, 1.0);
}

/// The value of one exact series (`name{labels}` as the exposition writes it).
async fn metric_value(p: &Proxy, series: &str) -> f64 {
    let r = p.admin_get("/metrics").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    let text = r.text();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

// ---------------------------------------------------------------------------------------------
// Identities (SPEC section 8)
// ---------------------------------------------------------------------------------------------

/// Inbound: a client leaf whose URI SANs are not exactly one strict SPIFFE id is refused at
/// the handshake (never a request with an empty or odd XFCC); each refusal is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_refuses_leaves_that_are_not_one_strict_spiffe_id() {
    let m = OnePodMesh::start().await;
    let odd = m.certs.same_ca();
    let td = TD;
    let frontend = m.certs.spiffe_id(FRONTEND);
    let orders = m.certs.spiffe_id(ORDERS);
    let bad: Vec<(&str, Vec<String>)> = vec![
        (
            "semicolon",
            vec![format!("spiffe://{td}/ns/default/sa/a;URI=x")],
        ),
        ("comma", vec![format!("spiffe://{td}/ns/default/sa/a,b")]),
        ("quote", vec![format!("spiffe://{td}/ns/default/sa/\"a\"")]),
        ("empty-segment", vec![format!("spiffe://{td}/ns//sa/a")]),
        ("dot-dot", vec![format!("spiffe://{td}/ns/../sa/a")]),
        (
            "percent",
            vec![format!("spiffe://{td}/ns/default/sa/a%2Fb")],
        ),
        ("two-ids", vec![frontend.clone(), orders.clone()]),
        (
            "id-and-other-td",
            vec![frontend.clone(), "spiffe://other.local/ns/x/sa/y".into()],
        ),
        (
            "id-and-https",
            vec![frontend.clone(), "https://frontend.example/".into()],
        ),
        ("https-only", vec!["https://frontend.example/".into()]),
    ];
    for (stem, uris) in &bad {
        let uris: Vec<&str> = uris.iter().map(String::as_str).collect();
        odd.mint(stem, &uris, &[]);
    }
    // Positive control: one strict id plus a DNS SAN (X509-SVIDs may carry those).
    odd.mint("good", &[&frontend], &["frontend.example"]);

    for (stem, _) in &bad {
        let client = TlsClient::new(&m.certs.ca())
            .cert(&odd.cert(stem), &odd.key(stem))
            .sni(Some("8080"))
            .alpn(&["http/1.1"]);
        assert_refused(m.server_pod.inbound(), &client, stem).await;
    }
    assert!(m.app.seen().is_empty(), "a refused client reached the app");
    // This pod has refused nobody else.
    let refused = r#"aether_peer_identity_refused_total{listener="inbound"}"#;
    let counted = metric_value(&m.server, refused).await;
    assert!(counted >= bad.len() as f64, "refusals counted: {counted}");

    let tls = TlsClient::new(&m.certs.ca())
        .cert(&odd.cert("good"), &odd.key("good"))
        .sni(Some("8080"))
        .alpn(&["http/1.1"])
        .connect(m.server_pod.inbound())
        .await
        .expect("the good leaf connects");
    let mut c = HttpClient::h1(tls).await.unwrap();
    let r = c.get("http://payments.aether.internal/good").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    let seen = m.seen("/good");
    let xfcc = format!(
        "By={};Hash={};URI={frontend}",
        m.certs.spiffe_id(PAYMENTS),
        sha256_hex(&odd.leaf_der("good"))
    );
    assert_eq!(seen.header_all("x-forwarded-client-cert"), [xfcc.as_str()]);
}

/// Outbound: the pin needs the server's leaf to carry exactly one SPIFFE id, the service's.
/// A leaf that also names another id (or any other URI) is a mismatch, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbound_pin_requires_exactly_one_id_equal_to_the_service() {
    let net = Net::fresh();
    let client_net = net.pod(0);
    let certs = certs();
    let payments = certs.spiffe_id(PAYMENTS);
    let orders = certs.spiffe_id(ORDERS);
    // Three fake server pods (BoringSSL servers recording what arrives), each with its leaf.
    let leaves: [(&str, Vec<&str>, bool); 3] = [
        ("two-ids", vec![payments.as_str(), orders.as_str()], false),
        (
            "id-and-https",
            vec![payments.as_str(), "https://payments.example/"],
            false,
        ),
        ("exact", vec![payments.as_str()], true),
    ];
    let mut observers = Vec::new();
    let mut services = Vec::new();
    for (i, (name, uris, _)) in leaves.iter().enumerate() {
        let pod = net.pod(1 + i as u8);
        let dir = certs.same_ca();
        dir.mint("payments", uris, &["payments.example"]);
        observers.push((Observer::start(&dir, pod.inbound()).await, dir));
        services.push(service(
            name,
            &payments,
            "",
            &[endpoint(pod.proxy_ip(), &[8080])],
        ));
    }
    let client = client_proxy(&certs, net.pod(0), &catalog(&services), "").await;
    for (i, (name, _, ok)) in leaves.iter().enumerate() {
        let authority = format!("{name}.aether.internal");
        let r = get_h1(client_net.outbound(), &authority, "/pin").await;
        if *ok {
            assert_eq!(r.status, StatusCode::OK, "{name}: {r:?}");
            assert_eq!(r.text(), "observed\n");
        } else {
            assert_proxy_error(&r, 503, "upstream-identity-mismatch", name);
            let sent: usize = observers[i]
                .0
                .conns()
                .iter()
                .map(|c| c.requests.len())
                .sum();
            assert_eq!(sent, 0, "{name}: a request reached a wrongly pinned server");
        }
    }
    let refused = r#"aether_peer_identity_refused_total{listener="outbound"}"#;
    assert!(metric_value(&client, refused).await >= 2.0);
}

// ---------------------------------------------------------------------------------------------
// Catalog validation (SPEC section 8)
// ---------------------------------------------------------------------------------------------

/// `aether-proxy check` on a `frontend` config (with `extra_config` after the identity) and
/// `catalog_yaml`: the exit code and stderr.
fn run_check(certs: &Certs, extra_config: &str, catalog_yaml: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let cat = dir.path().join("catalog.yaml");
    std::fs::write(&cat, catalog_yaml).unwrap();
    let cfg = dir.path().join("config.yaml");
    std::fs::write(
        &cfg,
        format!(
            "trust_domain: {TD}\n{}{extra_config}catalog:\n  path: {}\n",
            certs.identity_yaml("frontend"),
            cat.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether `aether-proxy check` accepts `catalog_yaml`, and its stderr.
fn check_catalog(certs: &Certs, catalog_yaml: &str) -> (bool, String) {
    let (code, stderr) = run_check(certs, "", catalog_yaml);
    (code == Some(0), stderr)
}

/// Weights that overflow u32, ports outside 1..65535 and durations past their bounds refuse the
/// catalog whole, with the field named.
#[test]
fn catalog_input_out_of_bounds_is_refused_with_the_field_named() {
    let certs = Certs::new(TD, &[FRONTEND, PAYMENTS]);
    let id = certs.spiffe_id(PAYMENTS);
    let svc = |extra: &str, endpoints: &str| {
        format!(
            "services:\n  payments:\n    default_port: 8080\n    identity: {id}\n{extra}    endpoints:\n{endpoints}"
        )
    };
    let ep = "      - { address: 10.0.0.1, ports: [8080] }\n";
    let cases = [
        (
            svc(
                "",
                "      - { address: 10.0.0.1, weight: 4294967295 }\n      - { address: 10.0.0.2, weight: 1 }\n",
            ),
            "services.payments.endpoints: endpoint weights add up to more than 4294967295",
        ),
        (
            svc(
                "    routes:\n      - split:\n          - { subset: { v: a }, weight: 4294967295 }\n          - { subset: { v: b }, weight: 2 }\n",
                ep,
            ),
            "services.payments.routes[0].split: weights add up to more than 4294967295",
        ),
        (svc("", "      - { address: 10.0.0.1, ports: [0] }\n"), "services.payments.endpoints[0].ports[0]"),
        (svc("", "      - { address: 10.0.0.1, ports: [65536] }\n"), "endpoints[0].ports[0]"),
        (svc("    protocols: { 70000: tcp }\n", ep), "services.payments.protocols"),
        (
            svc("    connect_timeout: 10m\n", ep),
            "services.payments.connect_timeout: 10m is over the limit of 5m",
        ),
        (
            svc("    request_timeout: 2h\n", ep),
            "services.payments.request_timeout: 2h is over the limit of 1h",
        ),
        (svc("    request_timeout: 400d\n", ep), "request_timeout"),
    ];
    for (yaml, want) in &cases {
        let (ok, stderr) = check_catalog(&certs, yaml);
        assert!(!ok, "accepted:\n{yaml}");
        assert!(stderr.contains(want), "want {want:?} in:\n{stderr}");
    }
    // At the bounds: accepted.
    let fine = svc(
        "    connect_timeout: 5m\n    request_timeout: 1h\n",
        "      - { address: 10.0.0.1, weight: 4294967294 }\n      - { address: 10.0.0.2, weight: 1 }\n",
    );
    let (ok, stderr) = check_catalog(&certs, &fine);
    assert!(ok, "refused:\n{fine}\n{stderr}");
}

// ---------------------------------------------------------------------------------------------
// The access log never blocks the data path (SPEC section 8)
// ---------------------------------------------------------------------------------------------

/// Stdout is a pipe nobody reads: requests still complete promptly, and the lines that do not
/// fit the bounded buffer are dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_access_log_drops_and_counts_instead_of_blocking() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = Certs::new(TD, &[FRONTEND]);
    let client = client_proxy_builder(&certs, net.pod(0), "services: {}\n", "")
        .stdout_stuck()
        .start()
        .await;
    // ~4 KiB lines: the 64 KiB pipe and the 1 MiB buffer hold about 270 of them.
    let path = format!("/{}", "p".repeat(4000));
    let mut c = h1_to(pod.outbound()).await;
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for _ in 0..800 {
        let t = Instant::now();
        let r = within(
            Duration::from_secs(5),
            "a request while stdout is stuck",
            c.send(empty(get(&path).header("host", "evil.com"))),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(r.status.as_u16(), 404);
        slowest = slowest.max(t.elapsed());
    }
    let total = started.elapsed();
    eprintln!("800 requests with stdout stuck: {total:?}, slowest {slowest:?}");
    assert!(slowest < Duration::from_secs(1), "slowest {slowest:?}");
    let dropped = metric_value(&client, "aether_access_log_dropped_total").await;
    assert!(dropped >= 400.0, "dropped {dropped}");
    // The admin side is unaffected too.
    let r = client.admin_get("/readyz").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
}

// ---------------------------------------------------------------------------------------------
// The client TLS session cache follows the catalog (SPEC section 8)
// ---------------------------------------------------------------------------------------------

/// How long a catalog reload and the session cache's answer to it may take to show.
const SESSIONS_TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_sessions_of_endpoints_that_left_the_catalog_are_forgotten() {
    let m = OnePodMesh::start().await;
    let sessions = "aether_tls_client_sessions";
    let r = m.send(empty(req_to("/first"))).await;
    assert_app_ok(&r, 8080, "first request");
    // After a first handshake.
    wait_metric(&m.client, sessions, &[], SESSIONS_TIMEOUT, |v| v == 1.0).await;

    // A new catalog that keeps the endpoint keeps its session.
    let id = m.certs.spiffe_id(PAYMENTS);
    let other = m.server_pod.extra(0);
    let (reloads, ok) = ("aether_catalog_reloads_total", [r#"result="ok""#]);
    let write = |eps: &[String]| {
        std::fs::write(
            m.client.catalog_path(),
            catalog(&[service("payments", &id, "", eps)]),
        )
        .unwrap()
    };
    let n = metric(&m.client, reloads, &ok).await;
    write(&[
        endpoint(m.server_pod.proxy_ip(), &[8080]),
        endpoint(other, &[8080]),
    ]);
    wait_metric(&m.client, reloads, &ok, SESSIONS_TIMEOUT, |v| v == n + 1.0).await;
    assert_eq!(metric_value(&m.client, sessions).await, 1.0);

    // One without it forgets the session.
    write(&[endpoint(other, &[8080])]);
    wait_metric(&m.client, reloads, &ok, SESSIONS_TIMEOUT, |v| v == n + 2.0).await;
    // After the endpoint left.
    wait_metric(&m.client, sessions, &[], SESSIONS_TIMEOUT, |v| v == 0.0).await;
}

// ---------------------------------------------------------------------------------------------
// The ClientHello reader does linear work (SPEC section 8)
// ---------------------------------------------------------------------------------------------

/// A real ClientHello (BoringSSL's, SNI "8080", ALPN http/1.1, X25519MLKEM768 key share):
/// the first flight a client sends, captured from the socket.
async fn real_client_hello(certs: &Certs, at: std::net::SocketAddr) -> Vec<u8> {
    let listener = TcpListener::bind(at).await.unwrap();
    let client = TlsClient::with_identity(certs, "frontend")
        .sni(Some("8080"))
        .alpn(&["http/1.1"]);
    let connecting = tokio::spawn(async move { client.connect(at).await.is_ok() });
    let (mut s, _) = listener.accept().await.unwrap();
    let hello = read_record(&mut s).await;
    drop(s);
    connecting.abort();
    hello
}

/// One whole TLS record from `s`.
async fn read_record(s: &mut TcpStream) -> Vec<u8> {
    let mut rec = vec![0u8; 5];
    within(IO_TIMEOUT, "record header", s.read_exact(&mut rec))
        .await
        .unwrap()
        .unwrap();
    let len = u16::from_be_bytes([rec[3], rec[4]]) as usize;
    rec.resize(5 + len, 0);
    within(IO_TIMEOUT, "record body", s.read_exact(&mut rec[5..]))
        .await
        .unwrap()
        .unwrap();
    rec
}

/// The handshake bytes of `record` re-sent as 1-byte handshake records.
fn one_byte_records(record: &[u8]) -> Vec<Vec<u8>> {
    record[5..]
        .iter()
        .map(|b| vec![22, record[1], record[2], 0, 1, *b])
        .collect()
}

/// The reader fed one 1-byte record at a time (the worst fragmentation there is): it finds
/// the hello, fast, looking at each byte once.
#[tokio::test]
async fn client_hello_in_one_byte_records_is_read_with_linear_work() {
    use aether_proxy::inbound::clienthello::HelloReader;
    let net = Net::fresh();
    let certs = Certs::new(TD, &[FRONTEND]);
    let hello = real_client_hello(&certs, net.pod(0).app(4433)).await;
    let records = one_byte_records(&hello);
    assert!(records.len() > 1000, "{} records", records.len());

    let started = Instant::now();
    let mut reader = HelloReader::default();
    let mut wire = Vec::new();
    let mut found = None;
    for (i, r) in records.iter().enumerate() {
        wire.extend_from_slice(r);
        if let Some(h) = reader.feed(&wire).expect("a valid hello") {
            assert_eq!(i, records.len() - 1, "found before the last record");
            found = Some(h);
        }
    }
    let took = started.elapsed();
    let hello = found.expect("the hello is complete after the last record");
    assert_eq!(hello.sni.as_deref(), Some("8080"));
    assert_eq!(hello.alpn, vec![b"http/1.1".to_vec()]);
    // Linear: every byte (record headers included) looked at once, though the reader was
    // called once per record. Walking from the start each time would examine ~n²/2 bytes.
    let n = wire.len();
    eprintln!(
        "{} one-byte records ({n} bytes): examined {} bytes in {took:?}",
        records.len(),
        reader.examined()
    );
    assert!(
        reader.examined() <= n,
        "examined {} of {n}",
        reader.examined()
    );
    assert!(took < Duration::from_millis(500), "took {took:?}");
}

/// End to end: a real client's hello reaches the proxy as 1-byte records, each its own write;
/// the handshake completes and the request is answered promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_hello_in_one_byte_records_reaches_the_chain() {
    let m = OnePodMesh::start().await;
    let relay_at = std::net::SocketAddr::new(m.client_pod.extra(0), 4433);
    let relay = TcpListener::bind(relay_at).await.unwrap();
    let upstream = m.server_pod.inbound();
    let relaying = tokio::spawn(async move {
        let (mut down, _) = relay.accept().await.unwrap();
        let mut up = TcpStream::connect(upstream).await.unwrap();
        up.set_nodelay(true).unwrap();
        let hello = read_record(&mut down).await;
        for r in one_byte_records(&hello) {
            up.write_all(&r).await.unwrap();
        }
        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
    });
    let started = Instant::now();
    let tls = TlsClient::with_identity(&m.certs, "frontend")
        .sni(Some("8080"))
        .alpn(&["http/1.1"])
        .connect(relay_at)
        .await
        .expect("handshake through 1-byte records");
    let mut c = HttpClient::h1(tls).await.unwrap();
    let r = c
        .get("http://payments.aether.internal/fragmented")
        .await
        .unwrap();
    let took = started.elapsed();
    eprintln!("handshake and request with a 1-byte-record hello: {took:?}");
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(m.seen("/fragmented").port, 8080);
    assert!(took < Duration::from_secs(3), "took {took:?}");
    relaying.abort();
}

// ---------------------------------------------------------------------------------------------
// Admin (SPEC section 12)
// ---------------------------------------------------------------------------------------------

/// One raw HTTP/1.1 exchange with the admin listener.
async fn admin_raw(p: &Proxy, raw: &str) -> (RawHead, String) {
    raw_exchange(p.admin_addr(), raw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_posts_with_an_origin_or_a_body_are_refused() {
    let net = Net::fresh();
    let certs = Certs::new(TD, &[FRONTEND]);
    let p = client_proxy(&certs, net.pod(0), "services: {}\n", "").await;
    let host = p.admin_addr();
    // Two with an Origin, three with a body.
    let refusals = [
        format!("POST /drain HTTP/1.1\r\nHost: {host}\r\nOrigin: http://evil.example\r\nContent-Length: 0\r\n\r\n"),
        format!("POST /drain HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n\r\n{{}}"),
        format!("POST /drain HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"),
        format!("POST /logging?level=trace HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 11\r\n\r\nlevel=trace"),
        format!("POST /logging?level=trace HTTP/1.1\r\nHost: {host}\r\nOrigin: null\r\n\r\n"),
    ];
    for raw in &refusals {
        let (head, body) = admin_raw(&p, raw).await;
        assert_eq!(head.status, 403, "{raw:?}: {body}");
        assert!(body.contains("refused"), "{body}");
    }
    // Nothing happened: still ready (not draining).
    let r = p.admin_get("/readyz").await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "a refused POST started the drain");
    assert_eq!(
        metric_value(
            &p,
            r#"aether_admin_requests_refused_total{reason="origin"}"#
        )
        .await,
        2.0
    );
    assert_eq!(
        metric_value(&p, r#"aether_admin_requests_refused_total{reason="body"}"#).await,
        3.0
    );
    // A plain POST still works, and GETs with an Origin are not POSTs.
    let (head, _) = admin_raw(
        &p,
        &format!("POST /logging?level=info HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n"),
    )
    .await;
    assert_eq!(head.status, 200);
    let (head, _) = admin_raw(
        &p,
        &format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\nOrigin: http://x\r\n\r\n"),
    )
    .await;
    assert_eq!(head.status, 200);
    let r = p.admin_post("/drain").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    let r = p.admin_get("/readyz").await.unwrap();
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
}

#[test]
fn check_warns_when_admin_listens_beyond_loopback() {
    let certs = Certs::new(TD, &[FRONTEND]);
    let run = |admin: &str| {
        run_check(
            &certs,
            &format!("admin:\n  listen: \"{admin}\"\n"),
            "services: {}\n",
        )
    };
    for wide in ["0.0.0.0:15000", "10.1.2.3:15000", "[::]:15000"] {
        let (code, stderr) = run(wide);
        assert_eq!(code, Some(0), "{wide}: {stderr}");
        assert!(
            stderr.contains("warning") && stderr.contains("not a loopback"),
            "{wide}: {stderr:?}"
        );
    }
    for lo in ["127.0.0.1:15000", "127.9.9.9:15000", "[::1]:15000"] {
        let (code, stderr) = run(lo);
        assert_eq!(code, Some(0), "{lo}: {stderr}");
        assert!(!stderr.contains("warning"), "{lo}: {stderr:?}");
    }
}
