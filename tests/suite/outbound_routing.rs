//! Outbound routing end to end (SPEC section 1 "Addressing", "Per-port endpoint sets",
//! "Subsets", section 7): the authority table, request forms, the first requests against a cold
//! proxy, the caller's protocol kept to the app, and subsets composed with ports.
//!
//! Real `aether-proxy run` processes: a client pod whose apps (this test) talk plaintext to its
//! outbound listener, server pods with their own proxies and apps, real mTLS between them, all
//! on loopback; the pods and catalogs are those of `crate::common::mesh`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::*;
use tokio::io::AsyncWriteExt;
use tokio::task::JoinSet;

// ---------------------------------------------------------------------------------------------
// The addressing table
// ---------------------------------------------------------------------------------------------

/// SPEC's whole addressing table through a real client proxy. Pod 1 advertises 8080 and 9090;
/// pod 2 advertises only 8080, although its proxy and an app would serve 9090 too (a pod of
/// the old version during a rollout: it must never get 9090 traffic); pod 3 is draining and
/// the only one listing 6060.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authority_table_through_the_client_proxy() {
    let net = Net::fresh();
    let (client_pod, p1, p2, p3) = (net.pod(0), net.pod(1), net.pod(2), net.pod(3));
    let certs = certs();
    let ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 9090, protocol: auto }",
    ];
    let a1_8080 = HttpApp::auto(p1.app(8080)).await;
    let a1_9090 = HttpApp::auto(p1.app(9090)).await;
    let a2_8080 = HttpApp::auto(p2.app(8080)).await;
    let a2_9090 = HttpApp::auto(p2.app(9090)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &ports).await;
    let _s2 = server_proxy(&certs, p2, "payments", &ports).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[
            endpoint(p1.proxy_ip(), &[8080, 9090]),
            endpoint(p2.proxy_ip(), &[8080]),
            draining_endpoint(p3.proxy_ip(), &[6060]),
        ],
    )]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    // The default port, both spellings, share one cluster named without the port.
    let r = get_h1(out, SVC, "/portless").await;
    assert_app_ok(&r, 8080, "portless authority");
    let r = get_h1(out, &format!("{SVC}:8080"), "/explicit").await;
    assert_app_ok(&r, 8080, "explicit default port");
    let cs = clusters(&client).await;
    assert_eq!(cs.len(), 1, "one cluster for both spellings: {cs:?}");
    assert_eq!(
        cs[0].0, SVC,
        "the default port's cluster is named without a port"
    );
    assert_eq!((cs[0].1.as_str(), cs[0].2), ("payments", 8080));
    let mut eps = cs[0].3.clone();
    eps.sort();
    let mut want = vec![p1.inbound().to_string(), p2.inbound().to_string()];
    want.sort();
    assert_eq!(eps, want, "the 8080 set is pods 1 and 2");
    assert_eq!(
        a1_8080.seen().len() + a2_8080.seen().len(),
        2,
        "both requests reached an 8080 app"
    );

    // 9090: only the pod that advertises it, never pod 2.
    for i in 0..20 {
        let r = get_h1(out, &format!("{SVC}:9090"), &format!("/p9090/{i}")).await;
        assert_app_ok(&r, 9090, "port 9090");
    }
    assert_eq!(a1_9090.seen().len(), 20, "pod 1 served every 9090 request");
    assert_eq!(
        a2_9090.seen().len(),
        0,
        "pod 2 does not advertise 9090 and must never get it"
    );
    let cs = clusters(&client).await;
    let c9090: Vec<_> = cs.iter().filter(|c| c.0 == format!("{SVC}:9090")).collect();
    assert_eq!(c9090.len(), 1, "one 9090 cluster: {cs:?}");
    assert_eq!(c9090[0].2, 9090);
    assert_eq!(c9090[0].3, vec![p1.inbound().to_string()], "9090's set");

    // The errors of the table.
    let before = a1_8080.seen().len() + a2_8080.seen().len() + a1_9090.seen().len();
    let cases: &[(&str, u16, &str)] = &[
        ("payments.aether.internal:7777", 503, "port-not-exposed"),
        ("ghost.aether.internal", 503, "unknown-service"),
        ("ghost.aether.internal:9090", 503, "unknown-service"),
        ("evil.com", 404, "no-route"),
        ("evil.com:9090", 404, "no-route"),
        ("payments.aether.internal:0", 400, "bad-authority"),
        ("payments.aether.internal:70000", 400, "bad-authority"),
        ("payments.aether.internal:80a", 400, "bad-authority"),
        ("payments.aether.internal:", 400, "bad-authority"),
        ("payments.aether.internal:6060", 503, "no-endpoints"),
    ];
    for (authority, status, reason) in cases {
        let t = Instant::now();
        let r = get_h1(out, authority, "/err").await;
        assert_proxy_error(&r, *status, reason, authority);
        if *reason == "no-route" {
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "no-route is answered at once, took {:?}",
                t.elapsed()
            );
        }
    }
    // A port the service does not expose is counted under the service (port 0: a
    // client-chosen number must not make a new series). Forwarded requests, answered or not,
    // are counted under the service and the port they went to.
    let metrics = client.admin_get("/metrics").await.unwrap().text();
    let counted = metrics
        .lines()
        .filter(|l| l.starts_with("aether_requests_total"))
        .collect::<Vec<_>>()
        .join("\n");
    for (port, code, n, what) in [
        ("0", "503", 1, "port-not-exposed"),
        ("8080", "200", 2, "the two 8080 requests"),
        ("9090", "200", 20, "the twenty 9090 requests"),
        ("6060", "503", 1, "no-endpoints"),
    ] {
        let line = format!(
            r#"aether_requests_total{{direction="outbound",service="payments",port="{port}",code="{code}"}} {n}"#
        );
        assert!(
            counted.lines().any(|l| l == line),
            "{what} counted as {line}:\n{counted}"
        );
    }

    // Upper case is lower-cased before matching.
    let r = get_h1(out, "PayMents.Aether.Internal:9090", "/upper").await;
    assert_app_ok(&r, 9090, "upper-case authority");

    // No Host at all: HTTP/1.1 without an authority.
    let (head, body) = raw_exchange(out, "GET /nohost HTTP/1.1\r\nConnection: close\r\n\r\n").await;
    assert_raw_proxy_error(&head, &body, 400, "bad-authority", "no Host header");

    assert_eq!(
        a1_8080.seen().len() + a2_8080.seen().len() + a1_9090.seen().len(),
        before + 1,
        "only the upper-case request reached an app"
    );
    assert_eq!(a2_9090.seen().len(), 0);

    // Still exactly one cluster for the default port, none for the refused authorities.
    let cs = clusters(&client).await;
    let names: Vec<&str> = cs.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names.iter().filter(|n| **n == SVC).count(), 1, "{names:?}");
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == format!("{SVC}:9090"))
            .count(),
        1,
        "{names:?}"
    );
    for bad in [
        "payments.aether.internal:8080",
        "payments.aether.internal:7777",
    ] {
        assert!(!names.contains(&bad), "unexpected cluster {bad}: {names:?}");
    }
    assert!(
        !names
            .iter()
            .any(|n| n.contains("ghost") || n.contains("evil")),
        "{names:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Request forms: absolute-form and h2c prior knowledge
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_uri_wins_and_h2c_prior_knowledge() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let a8080 = HttpApp::auto(p1.app(8080)).await;
    let a9090 = HttpApp::auto(p1.app(9090)).await;
    let _s1 = server_proxy(
        &certs,
        p1,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: auto }",
        ],
    )
    .await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(p1.proxy_ip(), &[8080, 9090])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    // Absolute-form: the URI's authority wins over Host, both ways.
    let mut c = h1_to(out).await;
    let r = c
        .send_raw(empty(
            get("http://payments.aether.internal:9090/abs?q=1").header("host", "evil.com"),
        ))
        .await
        .unwrap();
    assert_app_ok(&r, 9090, "absolute-form to 9090 with Host evil.com");
    let seen = a9090.seen();
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].uri.ends_with("/abs?q=1"),
        "path and query kept: {:?}",
        seen[0].uri
    );
    let r = c
        .send_raw(empty(
            get("http://evil.com/abs").header("host", "payments.aether.internal:9090"),
        ))
        .await
        .unwrap();
    assert_proxy_error(
        &r,
        404,
        "no-route",
        "absolute-form evil.com with a mesh Host",
    );
    let r = c
        .send_raw(empty(
            get("http://payments.aether.internal/abs")
                .header("host", "payments.aether.internal:9090"),
        ))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "absolute-form portless with Host :9090");
    assert_eq!(
        a9090.seen().len(),
        1,
        "the Host header did not steer to 9090"
    );

    // The same by raw bytes, so the request line is exactly absolute-form on the wire.
    let (head, body) = raw_exchange(
        out,
        "GET http://payments.aether.internal:9090/x HTTP/1.1\r\nHost: payments.aether.internal\r\n\
         Connection: close\r\n\r\n",
    )
    .await;
    assert_eq!(head.status, 200, "raw absolute-form: {body}");
    assert_eq!(head.header("x-app-port"), Some("9090"));

    // h2c with prior knowledge on the same listener.
    let mut h2 = h2_to(out).await;
    let r = h2
        .get("http://payments.aether.internal:9090/h2")
        .await
        .unwrap();
    assert_app_ok(&r, 9090, "h2c to 9090");
    assert_eq!(r.version, http::Version::HTTP_2);
    assert_eq!(
        a9090.seen().last().unwrap().version,
        "HTTP/2.0",
        "an h2 caller stays h2 on an auto port"
    );
    let r = h2.get("http://payments.aether.internal/h2").await.unwrap();
    assert_app_ok(&r, 8080, "h2c portless");
    let r = h2.get("http://ghost.aether.internal:9090/").await.unwrap();
    assert_proxy_error(&r, 503, "unknown-service", "h2c ghost");
    let r = h2.get("http://evil.com/").await.unwrap();
    assert_proxy_error(&r, 404, "no-route", "h2c evil.com");
    let r = h2
        .get("http://payments.aether.internal:7777/")
        .await
        .unwrap();
    assert_proxy_error(&r, 503, "port-not-exposed", "h2c 7777");
    // The connection survives proxy-made answers.
    let r = h2
        .get("http://payments.aether.internal:9090/again")
        .await
        .unwrap();
    assert_app_ok(&r, 9090, "h2c after errors");
    assert_eq!(a8080.seen().len(), 2);
}

// ---------------------------------------------------------------------------------------------
// Concurrent first requests
// ---------------------------------------------------------------------------------------------

/// 300 requests released at once against a cold proxy, half `svc`, half `svc:8080`, over
/// 200 HTTP/1.1 connections and 4 h2c connections: one cluster, built once.
///
/// To give a racy build a real chance to show, the service also lists 3000 draining
/// endpoints (kept in the cluster, never picked, never contacted), which makes each build
/// take a while, and the client proxy runs 4 worker threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_requests_build_one_cluster() {
    const H1: usize = 200;
    const H2_CONNS: usize = 4;
    const H2_STREAMS: usize = 25;
    const TOTAL: usize = H1 + H2_CONNS * H2_STREAMS;
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    const DRAINING: u16 = 3000;
    let mut eps = vec![endpoint(p1.proxy_ip(), &[8080])];
    let parked = net.pod(15).extra(12);
    for k in 0..DRAINING {
        eps.push(format!(
            "      - {{ address: \"{parked}:{}\", ports: [8080], draining: true }}\n",
            20000 + k
        ));
    }
    let cat = catalog(&[service("payments", &certs.spiffe_id(PAYMENTS), "", &eps)]);
    let client = client_proxy_builder(&certs, client_pod, &cat, "")
        .arg("--concurrency")
        .arg("4")
        .start()
        .await;
    let out = client_pod.outbound();
    assert!(clusters(&client).await.is_empty(), "no cluster before use");

    // Connect everything first and send every HTTP/1.1 request but its last byte; then
    // release the h2c streams and write the 200 last bytes in one tight loop, so the requests
    // reach the proxy as close together as a client can make them.
    let authority = |i: usize| {
        if i.is_multiple_of(2) {
            SVC.to_string()
        } else {
            format!("{SVC}:8080")
        }
    };
    let mut h1s = Vec::new();
    for i in 0..H1 {
        let mut s = tcp_connect(out).await.unwrap();
        let head = format!("GET /c/{i} HTTP/1.1\r\nHost: {}\r\n\r", authority(i));
        s.write_all(head.as_bytes()).await.unwrap();
        h1s.push(s);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(H2_CONNS * H2_STREAMS + 1));
    let mut tasks: JoinSet<Result<(u16, Option<String>), String>> = JoinSet::new();
    for k in 0..H2_CONNS {
        let c = h2_to(out).await;
        let HttpClient::H2(send) = c else {
            unreachable!()
        };
        for j in 0..H2_STREAMS {
            let i = H1 + k * H2_STREAMS + j;
            let mut c = HttpClient::H2(send.clone());
            let b = barrier.clone();
            let uri = format!("http://{}/c/{i}", authority(i));
            tasks.spawn(async move {
                b.wait().await;
                let r = c.get(&uri).await?;
                Ok((
                    r.status.as_u16(),
                    r.header("x-app-port").map(str::to_string),
                ))
            });
        }
    }
    barrier.wait().await;
    for s in h1s.iter_mut() {
        s.write_all(b"\n").await.unwrap();
    }
    for mut s in h1s {
        tasks.spawn(async move {
            let head = read_head(&mut s).await?;
            let _ = read_body(&mut s, &head).await;
            Ok((head.status, head.header("x-app-port").map(str::to_string)))
        });
    }
    let mut ok = 0;
    let mut failures = Vec::new();
    while let Some(r) = within(Duration::from_secs(60), "300 requests", tasks.join_next())
        .await
        .unwrap()
    {
        match r.unwrap() {
            Ok((200, Some(port))) if port == "8080" => ok += 1,
            other => failures.push(format!("{other:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {TOTAL} failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    assert_eq!(ok, TOTAL);
    assert_eq!(app.seen().len(), TOTAL);

    let cs = clusters(&client).await;
    assert_eq!(cs.len(), 1, "exactly one cluster: {cs:?}");
    assert_eq!(cs[0].0, SVC);
    assert_eq!(cs[0].2, 8080);
    assert_eq!(cs[0].3.len(), 1 + DRAINING as usize);
    let log = wait_log(&client, LOG_TIMEOUT, "cluster materialized", |l| {
        l.contains("cluster materialized")
    })
    .await;
    let built: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cluster materialized"))
        .collect();
    assert_eq!(built.len(), 1, "built more than once: {built:#?}");
    assert!(built[0].contains(SVC), "{built:?}");
}

// ---------------------------------------------------------------------------------------------
// Protocol kept end to end
// ---------------------------------------------------------------------------------------------

/// 8080 is `auto` on the server pod (an app that records the version it sees); 9090 is `h2`
/// with an h2c-only app. Alternating callers also check that pooled upstream connections are
/// not mixed up between protocols.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_is_kept_end_to_end() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let a8080 = HttpApp::auto(p1.app(8080)).await;
    let a9090 = HttpApp::h2c(p1.app(9090)).await;
    let _s1 = server_proxy(
        &certs,
        p1,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: h2 }",
        ],
    )
    .await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(p1.proxy_ip(), &[8080, 9090])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();
    let mut h1 = h1_to(out).await;
    let mut h2 = h2_to(out).await;

    for round in 0..3 {
        // HTTP/1.1 to an auto port arrives as HTTP/1.1.
        let r = h1
            .send(empty(get(&format!("/h1/{round}")).header("host", SVC)))
            .await
            .unwrap();
        assert_app_ok(&r, 8080, "h1 to auto");
        assert_eq!(r.version, http::Version::HTTP_11);
        let s = a8080.seen().last().unwrap().clone();
        assert_eq!(
            s.version, "HTTP/1.1",
            "round {round}: an h1 caller must stay h1"
        );
        assert_eq!(s.uri, format!("/h1/{round}"));

        // h2c to an auto port arrives as HTTP/2.
        let r = h2.get(&format!("http://{SVC}/h2/{round}")).await.unwrap();
        assert_app_ok(&r, 8080, "h2c to auto");
        assert_eq!(r.version, http::Version::HTTP_2);
        let s = a8080.seen().last().unwrap().clone();
        assert_eq!(
            s.version, "HTTP/2.0",
            "round {round}: an h2 caller must stay h2"
        );
        assert!(s.uri.ends_with(&format!("/h2/{round}")), "{}", s.uri);

        // HTTP/1.1 to an h2 port reaches the h2c app (translated), and back as HTTP/1.1.
        let r = h1
            .send(empty(
                get(&format!("/h1-to-h2/{round}")).header("host", format!("{SVC}:9090")),
            ))
            .await
            .unwrap();
        assert_app_ok(&r, 9090, "h1 to an h2 port");
        assert_eq!(r.version, http::Version::HTTP_11);
        let s = a9090.seen().last().unwrap().clone();
        assert!(s.uri.ends_with(&format!("/h1-to-h2/{round}")), "{}", s.uri);
        assert_eq!(s.version, "HTTP/2.0");

        // And h2c to the h2 port, of course.
        let r = h2
            .get(&format!("http://{SVC}:9090/h2-to-h2/{round}"))
            .await
            .unwrap();
        assert_app_ok(&r, 9090, "h2c to an h2 port");
    }
    let versions: Vec<String> = a8080.seen().iter().map(|s| s.version.clone()).collect();
    assert_eq!(
        versions.iter().filter(|v| *v == "HTTP/1.1").count(),
        3,
        "{versions:?}"
    );
    assert_eq!(
        versions.iter().filter(|v| *v == "HTTP/2.0").count(),
        3,
        "{versions:?}"
    );
    assert_eq!(a9090.seen().len(), 6);
}

// ---------------------------------------------------------------------------------------------
// Subsets
// ---------------------------------------------------------------------------------------------

/// SPEC "Subsets": a subset composes with a port: the endpoints are those of the port's set
/// that match the labels; a split sends traffic by weight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subsets_compose_with_the_port() {
    let net = Net::fresh();
    let (client_pod, v1, v2a, v2b) = (net.pod(0), net.pod(1), net.pod(2), net.pod(3));
    let certs = certs();
    let ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 9090, protocol: auto }",
    ];
    let mut apps = Vec::new();
    let mut proxies = Vec::new();
    for pod in [v1, v2a, v2b] {
        apps.push((
            HttpApp::auto(pod.app(8080)).await,
            HttpApp::auto(pod.app(9090)).await,
        ));
        proxies.push(server_proxy(&certs, pod, "payments", &ports).await);
    }
    let ep = |pod: PodNet, ports: &str, v: &str| {
        format!(
            "      - {{ address: \"{}\", ports: {ports}, labels: {{ version: {v} }} }}\n",
            pod.proxy_ip()
        )
    };
    let routes = "    routes:\n      - match: { header: x-canary, value: \"1\" }\n        subset: { version: v2 }\n      - split:\n          - { subset: { version: v1 }, weight: 100 }\n";
    // v2a serves 9090, v2b does not advertise it.
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        routes,
        &[
            ep(v1, "[8080, 9090]", "v1"),
            ep(v2a, "[8080, 9090]", "v2"),
            ep(v2b, "[8080]", "v2"),
        ],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();
    for k in 0..12 {
        let req = empty(
            get(&format!("/c/{k}"))
                .header("host", "payments.aether.internal:9090")
                .header("x-canary", "1"),
        );
        let r = h1_to(out).await.send(req).await.unwrap();
        assert_app_ok(&r, 9090, "canary on 9090");
    }
    for k in 0..12 {
        let r = get_h1(out, SVC, &format!("/d/{k}")).await;
        assert_app_ok(&r, 8080, "default route");
    }
    let seen = |i: usize| (apps[i].0.seen().len(), apps[i].1.seen().len());
    // Canary on 9090: the v2 pods that advertise 9090 (v2a only); default: the v1 split.
    assert_eq!(seen(1), (0, 12), "v2a serves every canary request on 9090");
    assert_eq!(seen(2), (0, 0), "v2b does not advertise 9090 and is not v1");
    assert_eq!(
        seen(0),
        (12, 0),
        "the 100% v1 split takes the default route"
    );
}

// ---------------------------------------------------------------------------------------------
// Header limits on the outbound listener
// ---------------------------------------------------------------------------------------------

/// SPEC sections 7 and 8 on the client side: a request with more than 100 header fields is
/// answered by the proxy (431 `headers-too-large`, one line of text), never by the HTTP codec's
/// bare 431, on a kept-alive connection as on a fresh one, however far over. 98 reach the app:
/// the client side adds `x-request-id` and `traceparent`, and the server side holds what
/// arrives to the same 100 (the limits are per hop, as Envoy's are).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_100_headers_get_the_proxys_431_on_the_outbound_listener() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(p1.proxy_ip(), &[8080])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();
    // `n` fields in all, Host included.
    let with = |path: &str, n: usize| {
        let mut b = get(path).header("host", SVC);
        for i in 0..n - 1 {
            b = b.header(format!("x-h{i}"), "v");
        }
        empty(b)
    };
    let mut c = h1_to(out).await;
    let r = c.send(with("/ninety-eight", 98)).await.unwrap();
    assert_app_ok(&r, 8080, "98 fields");
    let seen = app.seen();
    let ours = seen
        .last()
        .map(|s| s.headers.iter().filter(|(k, _)| k.starts_with("x-h")));
    assert_eq!(
        ours.map(Iterator::count),
        Some(97),
        "the fields the app sent"
    );
    let r = c.send(with("/ninety-nine", 99)).await.unwrap();
    assert_proxy_error(
        &r,
        431,
        "headers-too-large",
        "99 fields, 101 at the server side",
    );
    let r = c.send(with("/hundred-and-one", 101)).await.unwrap();
    assert_proxy_error(&r, 431, "headers-too-large", "101 fields, kept-alive");
    let r = h1_to(out).await.send(with("/far", 600)).await.unwrap();
    assert_proxy_error(&r, 431, "headers-too-large", "600 fields, fresh");
    let paths: Vec<String> = app.seen().into_iter().map(|s| s.uri).collect();
    assert_eq!(
        paths,
        ["/ninety-eight"],
        "an over-limit request reached the app"
    );
}
