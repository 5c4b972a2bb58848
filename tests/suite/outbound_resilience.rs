//! The outbound side under failure and load (SPEC section 1 "Upstream connection", "Timeouts",
//! "Outlier detection", section 8): retries onto a live endpoint, load spread, request and
//! connect timeouts, outlier ejection and rapid reset.
//!
//! Real `aether-proxy run` processes: a client pod whose apps (this test) talk plaintext to its
//! outbound listener, server pods with their own proxies and apps, real mTLS between them, all
//! on loopback; the pods and catalogs are those of `crate::common::mesh`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::*;
use http::{Request, StatusCode};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

// ---------------------------------------------------------------------------------------------
// Retries
// ---------------------------------------------------------------------------------------------

/// One endpoint with nothing listening, one live: every request succeeds (a refused connect is
/// retried on the other endpoint). Only dead endpoints: 503 `upstream-connect-failure`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_endpoint_is_retried_onto_a_live_one() {
    let net = Net::fresh();
    let (client_pod, live, dead, dead2) = (net.pod(0), net.pod(1), net.pod(2), net.pod(3));
    let certs = certs();
    let app = HttpApp::auto(live.app(8080)).await;
    let _s1 = server_proxy(
        &certs,
        live,
        "payments",
        &["{ port: 8080, protocol: auto }"],
    )
    .await;
    let id = certs.spiffe_id(PAYMENTS);
    let cat = catalog(&[
        service(
            "payments",
            &id,
            "",
            &[
                endpoint(dead.proxy_ip(), &[8080]),
                endpoint(live.proxy_ip(), &[8080]),
            ],
        ),
        service(
            "ledger",
            &id,
            "",
            &[
                endpoint(dead.proxy_ip(), &[8080]),
                endpoint(dead2.proxy_ip(), &[8080]),
            ],
        ),
    ]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();
    let dead_addr = dead.inbound().to_string();

    // Each request picks the dead endpoint with p = 1/2 (until outlier detection ejects it),
    // so 20 requests all but surely try it; every one must still succeed.
    let n = 20;
    for k in 0..n {
        let r = get_h1(out, SVC, &format!("/r/{k}")).await;
        assert_app_ok(&r, 8080, &format!("request {k}"));
    }
    let tried_dead = plain_stderr(&client)
        .lines()
        .any(|l| l.contains("upstream connect failed") && l.contains(&dead_addr));
    assert!(
        tried_dead,
        "no 'upstream connect failed' log line names {dead_addr}: the retry was not exercised"
    );
    assert_eq!(app.seen().len(), n, "every request reached the live app");
    // The access log names the live endpoint as the upstream of every one of them.
    let live_addr = live.inbound().to_string();
    let lines = eventually(LOG_TIMEOUT, "an access-log line per request", async || {
        let lines: Vec<_> = client
            .access_log()
            .into_iter()
            .filter(|l| l["path"].as_str().is_some_and(|p| p.starts_with("/r/")))
            .collect();
        if lines.len() == n {
            Ok(lines)
        } else {
            Err(format!("{} of {n} access-log lines", lines.len()))
        }
    })
    .await;
    for l in &lines {
        assert_eq!(l["status"], 200, "{l}");
        assert_eq!(l["upstream"].as_str(), Some(live_addr.as_str()), "{l}");
        // The identity pinned on the upstream connection.
        assert_eq!(l["peer_identity"].as_str(), Some(id.as_str()), "{l}");
    }

    // Only dead endpoints.
    let t = Instant::now();
    let r = get_h1(out, "ledger.aether.internal", "/dead").await;
    assert_proxy_error(&r, 503, "upstream-connect-failure", "only dead endpoints");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "refused connects fail fast"
    );
    let r = get_h1(out, "ledger.aether.internal", "/dead-again").await;
    assert_proxy_error(
        &r,
        503,
        "upstream-connect-failure",
        "only dead endpoints, again",
    );
}

// ---------------------------------------------------------------------------------------------
// Load spread
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_spreads_over_three_pods() {
    const WORKERS: usize = 10;
    const PER_WORKER: usize = 30;
    const TOTAL: usize = WORKERS * PER_WORKER;
    let net = Net::fresh();
    let client_pod = net.pod(0);
    let certs = certs();
    let mut apps = Vec::new();
    let mut servers = Vec::new();
    let mut eps = Vec::new();
    for i in 1..=3 {
        let pod = net.pod(i);
        apps.push(HttpApp::auto(pod.app(8080)).await);
        servers
            .push(server_proxy(&certs, pod, "payments", &["{ port: 8080, protocol: auto }"]).await);
        eps.push(endpoint(pod.proxy_ip(), &[8080]));
    }
    let cat = catalog(&[service("payments", &certs.spiffe_id(PAYMENTS), "", &eps)]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    let mut tasks = JoinSet::new();
    for w in 0..WORKERS {
        let mut c = h1_to(out).await;
        tasks.spawn(async move {
            for k in 0..PER_WORKER {
                let r = c
                    .send(empty(get(&format!("/w{w}/{k}")).header("host", SVC)))
                    .await?;
                if r.status != StatusCode::OK {
                    return Err(format!("{r:?}"));
                }
            }
            Ok::<_, String>(())
        });
    }
    while let Some(r) = within(Duration::from_secs(60), "load", tasks.join_next())
        .await
        .unwrap()
    {
        r.unwrap().unwrap();
    }
    let counts: Vec<usize> = apps.iter().map(|a| a.seen().len()).collect();
    assert_eq!(counts.iter().sum::<usize>(), TOTAL, "{counts:?}");
    for (i, c) in counts.iter().enumerate() {
        assert!(
            *c * 100 >= TOTAL * 15,
            "pod {} served {c} of {TOTAL} (< 15%): {counts:?}",
            i + 1
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Timeouts
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_gives_504() {
    let m = OnePodMesh::start_with(OnePodExtras {
        service: "    request_timeout: 500ms\n",
        ..Default::default()
    })
    .await;
    let out = m.outbound();

    // Warm up (connection set up is not what is timed), and a control under the limit.
    let r = get_h1(out, SVC, "/fast").await;
    assert_app_ok(&r, 8080, "fast");
    let r = h1_to(out)
        .await
        .send(empty(
            get("/a-bit-slow")
                .header("host", SVC)
                .header("x-app-delay-ms", "100"),
        ))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "under the timeout");

    let t = Instant::now();
    let r = h1_to(out)
        .await
        .send(empty(
            get("/slow")
                .header("host", SVC)
                .header("x-app-delay-ms", "3000"),
        ))
        .await
        .unwrap();
    let took = t.elapsed();
    assert_proxy_error(&r, 504, "upstream-timeout", "app sleeps 3 s");
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_millis(2000),
        "answered after {took:?}, want about 500 ms"
    );
    assert_eq!(m.app.seen().len(), 3, "the slow request did reach the app");

    // h2 callers get the same answer.
    let t = Instant::now();
    let r = h2_to(out)
        .await
        .send(empty(
            get(&format!("http://{SVC}/slow-h2")).header("x-app-delay-ms", "3000"),
        ))
        .await
        .unwrap();
    assert_proxy_error(&r, 504, "upstream-timeout", "h2 caller, app sleeps 3 s");
    assert!(
        t.elapsed() < Duration::from_millis(2000),
        "{:?}",
        t.elapsed()
    );
}

/// SPEC "Timeouts": the catalog's `connect_timeout` bounds connecting (TCP + TLS) to an endpoint;
/// an endpoint that accepts TCP but never completes TLS costs at most that, per attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_timeout_is_the_catalogs() {
    let net = Net::fresh();
    let client_pod = net.pod(0);
    let hole = TcpListener::bind(SocketAddr::new(net.pod(1).proxy_ip(), 15008))
        .await
        .unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hole.accept().await {
            held.push(s);
        }
    });
    let certs = certs();
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    connect_timeout: 300ms\n",
        &[endpoint(net.pod(1).proxy_ip(), &[8080])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let start = Instant::now();
    let r = get_h1(client_pod.outbound(), SVC, "/").await;
    let took = start.elapsed();
    assert_proxy_error(
        &r,
        503,
        "upstream-connect-failure",
        "a TLS handshake that never ends",
    );
    // One endpoint: one attempt (never retried onto the same endpoint), bounded by 300 ms.
    assert!(
        took >= Duration::from_millis(280) && took < Duration::from_secs(3),
        "answered after {took:?}"
    );
    holder.abort();
}

// ---------------------------------------------------------------------------------------------
// Outlier detection
// ---------------------------------------------------------------------------------------------

/// SPEC "Outlier detection": five consecutive 5xx eject an endpoint; `/clusters` shows it,
/// the metric counts it, and new requests go to the healthy endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outlier_detection_ejects_a_failing_endpoint() {
    let net = Net::fresh();
    let (client_pod, bad, good) = (net.pod(0), net.pod(1), net.pod(2));
    let certs = certs();
    // The bad pod's app answers 500 to everything: it sees the header the test sets below only
    // on requests it is sent, so a dedicated service routes them there first.
    let bad_app = HttpApp::auto(bad.app(8080)).await;
    let good_app = HttpApp::auto(good.app(8080)).await;
    let _s1 = server_proxy(&certs, bad, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let _s2 = server_proxy(
        &certs,
        good,
        "payments",
        &["{ port: 8080, protocol: auto }"],
    )
    .await;
    let id = certs.spiffe_id(PAYMENTS);
    let labelled = |pod: PodNet, v: &str| {
        format!(
            "      - {{ address: \"{}\", ports: [8080], labels: {{ health: {v} }} }}\n",
            pod.proxy_ip()
        )
    };
    let routes = "    routes:\n      - match: { header: x-fail, value: \"1\" }\n        subset: { health: bad }\n";
    let cat = catalog(&[service(
        "payments",
        &id,
        routes,
        &[labelled(bad, "bad"), labelled(good, "good")],
    )]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();
    // Five 5xx in a row from the bad endpoint (routed there by the subset).
    for k in 0..5 {
        let req = empty(
            get(&format!("/fail/{k}"))
                .header("host", SVC)
                .header("x-fail", "1")
                .header("x-app-status", "500"),
        );
        let r = h1_to(out).await.send(req).await.unwrap();
        assert_eq!(r.status.as_u16(), 500, "the app's own 500 passes through");
    }
    assert_eq!(bad_app.seen().len(), 5);
    let view = client.admin_get("/clusters").await.unwrap().json();
    let eps = &view["clusters"][0]["endpoints"];
    // /config_dump carries the same clusters, ejections included.
    let dump = client.admin_get("/config_dump").await.unwrap().json();
    assert_eq!(dump["clusters"], view["clusters"], "{dump}");
    let state: Vec<(String, bool)> = eps
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["address"].as_str().unwrap().to_string(),
                e["ejected"].as_bool().unwrap(),
            )
        })
        .collect();
    assert!(
        state.contains(&(bad.inbound().to_string(), true)),
        "the failing endpoint is ejected: {state:?}"
    );
    assert!(
        state.contains(&(good.inbound().to_string(), false)),
        "{state:?}"
    );
    let ejections = metric(
        &client,
        "aether_outlier_ejections_total",
        &["service=\"payments\""],
    )
    .await;
    assert_eq!(ejections, 1.0);
    // New requests for the bad subset find only an ejected endpoint; the rest go to the good one.
    let r = get_h1(out, SVC, "/after").await;
    assert_app_ok(&r, 8080, "the healthy endpoint");
    assert_eq!(good_app.seen().len(), 1);
    let req = empty(
        get("/subset-after")
            .header("host", SVC)
            .header("x-fail", "1"),
    );
    let r = h1_to(out).await.send(req).await.unwrap();
    assert_proxy_error(
        &r,
        503,
        "no-healthy-upstream",
        "the bad subset while ejected",
    );
    assert_eq!(
        bad_app.seen().len(),
        5,
        "an ejected endpoint gets no new request"
    );
}

/// What came back on a raw connection: a status with its `x-aether-error`, or nothing.
async fn raw_answer(s: &mut TcpStream) -> Option<(u16, Option<String>)> {
    let h = tokio::time::timeout(Duration::from_secs(5), read_head(s))
        .await
        .ok()?
        .ok()?;
    Some((h.status, h.header("x-aether-error").map(str::to_string)))
}

/// A client's broken request is the client's (SPEC 11): malformed chunked bodies, a close in
/// the middle of a body, an h2 stream reset mid-body. Each is answered 400 `bad-request` when
/// the client can still hear it, and none counts against the endpoint: after a burst of them
/// (more than the five consecutive failures that eject), the single endpoint still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_broken_requests_never_eject_the_endpoint() {
    use tokio::io::AsyncWriteExt;
    let net = Net::fresh();
    let (client_pod, pod) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(pod.app(8080)).await;
    let _server = server_proxy(&certs, pod, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(pod.proxy_ip(), &[8080])],
    )]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();
    let head =
        format!("POST /broken HTTP/1.1\r\nHost: {SVC}\r\nTransfer-Encoding: chunked\r\n\r\n");
    let bad_chunks: [(&str, &[u8]); 5] = [
        ("non-hex size", b"zz\r\nhello\r\n0\r\n\r\n"),
        (
            "overflowing size",
            b"fffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
        ),
        ("a bare LF in an extension", b"5;ext\nhello\r\n0\r\n\r\n"),
        ("missing CRLF", b"5\r\nhelloXX0\r\n\r\n"),
        ("obs-fold in a trailer", b"0\r\nx-t: a\r\n b\r\n\r\n"),
    ];
    for round in 0..2 {
        for (what, chunk) in bad_chunks {
            let mut s = tcp_connect(out).await.unwrap();
            s.write_all(head.as_bytes()).await.unwrap();
            // The head goes upstream before the body is read.
            tokio::time::sleep(Duration::from_millis(30)).await;
            s.write_all(b"5\r\nfirst\r\n").await.unwrap();
            tokio::time::sleep(Duration::from_millis(30)).await;
            s.write_all(chunk).await.unwrap();
            let got = raw_answer(&mut s).await;
            assert!(
                matches!(&got, Some((400, Some(r))) if r == "bad-request"),
                "round {round}, {what}: {got:?}"
            );
        }
        // A close in the middle of a body (a length, half of it sent).
        let mut s = tcp_connect(out).await.unwrap();
        let req = format!("POST /gone HTTP/1.1\r\nHost: {SVC}\r\nContent-Length: 100\r\n\r\nhalf");
        s.write_all(req.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(s);
        // An h2 stream reset (CANCEL) in the middle of a body.
        let tcp = tcp_connect(out).await.unwrap();
        let (mut h2, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let req = Request::post(format!("http://{SVC}/cancel"))
            .body(())
            .unwrap();
        let (resp, mut body) = h2.send_request(req, false).unwrap();
        body.send_data(bytes::Bytes::from_static(b"part of it"), false)
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        body.send_reset(h2::Reason::CANCEL);
        let _ = tokio::time::timeout(Duration::from_secs(2), resp).await;
    }
    // Straight at the server sidecar, as a peer: the same 400, not the app's fault.
    let tls = TlsClient::with_identity(&certs, "frontend")
        .sni(Some("8080"))
        .alpn(&["http/1.1"]);
    let mut s = tls.connect(pod.inbound()).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    s.write_all(b"zz\r\n").await.unwrap();
    let h = tokio::time::timeout(Duration::from_secs(5), read_head(&mut s))
        .await
        .expect("an answer")
        .unwrap();
    assert_eq!(
        (h.status, h.header("x-aether-error")),
        (400, Some("bad-request")),
        "the server sidecar"
    );

    tokio::time::sleep(Duration::from_millis(200)).await;
    let ejections = metric(&client, "aether_outlier_ejections_total", &[]).await;
    assert_eq!(ejections, 0.0, "a client's mistakes ejected the endpoint");
    for i in 0..5 {
        let r = get_h1(out, SVC, &format!("/after/{i}")).await;
        assert_app_ok(&r, 8080, "the endpoint after the client's mistakes");
    }
    assert!(app.seen().iter().any(|s| s.uri.contains("/after/")));
}

// ---------------------------------------------------------------------------------------------
// Rapid reset
// ---------------------------------------------------------------------------------------------

/// Rapid reset (CVE-2023-44487, SPEC section 8): a client that opens streams and resets them at
/// once gets its connection closed, as Envoy does (over half of 500+ streams reset early);
/// the proxy keeps serving other connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_closes_the_connection() {
    let net = Net::fresh();
    let client_pod = net.pod(0);
    // An endpoint that accepts TCP and never answers: requests stay pending until reset.
    let hole = TcpListener::bind(SocketAddr::new(net.pod(1).proxy_ip(), 15008))
        .await
        .unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hole.accept().await {
            held.push(s);
        }
    });
    let certs = certs();
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(net.pod(1).proxy_ip(), &[8080])],
    )]);
    let proxy = client_proxy(&certs, client_pod, &cat, "").await;

    let tcp = TcpStream::connect(client_pod.outbound()).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut sent = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while sent < 1500 && Instant::now() < deadline {
        let ready = tokio::time::timeout(Duration::from_secs(5), h2.clone().ready()).await;
        let Ok(Ok(mut ready)) = ready else { break };
        let req = Request::get("http://payments.aether.internal/")
            .body(())
            .unwrap();
        match ready.send_request(req, true) {
            Ok((resp, mut stream)) => {
                // Let the proxy take the request (so h2's own cap on streams reset before
                // they are accepted is not what fires), then cancel it.
                tokio::time::sleep(Duration::from_millis(2)).await;
                stream.send_reset(h2::Reason::CANCEL);
                drop(resp);
                sent += 1;
            }
            Err(_) => break,
        }
    }
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    assert!(
        matches!(ended, Ok(Ok(_))),
        "the connection must be closed by the proxy after {sent} reset streams: {ended:?}"
    );
    assert!((500..1500).contains(&sent), "closed after {sent} streams");
    // Other connections are served as before.
    let r = get_h1(client_pod.outbound(), "evil.com", "/").await;
    assert_proxy_error(&r, 404, "no-route", "after the abusive connection");
    drop(proxy);
    holder.abort();
}
