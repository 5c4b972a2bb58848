//! The outbound side end to end (SPEC section 1 "Addressing", "Per-port endpoint sets",
//! "Upstream connection", section 7): real `aether-proxy run` processes, a client pod whose
//! apps (this test) talk plaintext to its outbound listener, server pods with their own
//! proxies and apps, real mTLS between them, all on loopback.
//!
//! Every test owns a loopback /24 from `Net::fresh()` (see `common`):
//! * pod 0 is the client pod: its proxy (identity `frontend`) on host `.2` (outbound :15001,
//!   admin :15000); the test's client sockets bind to its spare hosts when the source address
//!   matters (`source_identities`);
//! * pods 1.. are server pods: proxy on host `.(16i+2)`:15008, apps on `.(16i+1)`:<port>. The
//!   catalog lists them by their proxy address.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mesh::*;
use common::*;
use http::{Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinSet;

/// A TCP connection to `dst` from the source address `src`, bounded. (It shadows the harness's
/// `tcp_connect_from`, which returns a `Result`; this one panics with the addresses.)
async fn tcp_connect_from(src: IpAddr, dst: SocketAddr) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(src, 0))
        .unwrap_or_else(|e| panic!("bind {src}: {e}"));
    let tcp = within(IO_TIMEOUT, "connect", sock.connect(dst))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("connect {src} -> {dst}: {e}"));
    let _ = tcp.set_nodelay(true);
    tcp
}

// ---------------------------------------------------------------------------------------------
// 1. The addressing table
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
// 2. Request forms: absolute-form and h2c prior knowledge
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
// 3. Concurrent first requests
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
        if i % 2 == 0 {
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
// 4. gRPC
// ---------------------------------------------------------------------------------------------

/// A tonic client dials the client proxy's outbound listener with `:authority`
/// `payments.aether.internal:9090`; the call travels through both proxies to a tonic server on
/// the server pod's 9090 (chain `h2`): unary, server streaming, and non-OK statuses whose
/// custom metadata survive both as a trailers-only answer and as real trailers after data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_unary_and_server_streaming_end_to_end() {
    use grpc::*;
    use tonic::Code;

    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let server = GrpcServer::start(p1.app(9090), "pod-1").await;
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
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let xfcc = expected_xfcc(&certs, PAYMENTS, "frontend", FRONTEND);

    let mut g = grpc::client(
        client_pod.outbound(),
        "http://payments.aether.internal:9090",
    )
    .await;
    let path = http::uri::PathAndQuery::from_static;

    // Unary, OK, request and response metadata intact.
    let mut req = tonic::Request::new(EchoRequest {
        message: "hello mesh".into(),
        count: 0,
        fail_at_end: false,
    });
    req.metadata_mut()
        .insert("x-caller", "frontend-test".parse().unwrap());
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let resp = within(IO_TIMEOUT, "unary", g.unary(req, path(UNARY), codec()))
        .await
        .unwrap()
        .unwrap_or_else(|s| panic!("unary call failed: {s:?}"));
    assert_eq!(
        resp.metadata().get("x-served-by").unwrap(),
        "pod-1",
        "response headers intact"
    );
    assert_eq!(
        resp.metadata().get("x-echo-caller").unwrap(),
        "frontend-test"
    );
    let reply = resp.into_inner();
    assert_eq!(reply.message, "hello mesh");
    assert_eq!(reply.served_by, "pod-1");
    assert_eq!(
        reply.xfcc, xfcc,
        "the server app sees the server proxy's XFCC"
    );

    // Unary, non-OK: status, message and custom metadata (a trailers-only answer).
    let req = tonic::Request::new(EchoRequest {
        message: "decline".into(),
        count: 0,
        fail_at_end: false,
    });
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let status = within(IO_TIMEOUT, "unary", g.unary(req, path(UNARY), codec()))
        .await
        .unwrap()
        .expect_err("the server declines");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(status.message(), "card declined: insufficient funds");
    assert_eq!(status.metadata().get("x-decline-code").unwrap(), "51");
    assert_eq!(
        status
            .metadata()
            .get_bin("x-detail-bin")
            .expect("binary metadata kept")
            .to_bytes()
            .unwrap()
            .as_ref(),
        &[0u8, 1, 2, 255]
    );

    // Server streaming, OK: every message in order, then grpc-status 0 in the trailers.
    let req = tonic::Request::new(EchoRequest {
        message: "tick".into(),
        count: 25,
        fail_at_end: false,
    });
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let resp = within(
        IO_TIMEOUT,
        "server streaming",
        g.server_streaming(req, path(STREAM), codec()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(resp.metadata().get("x-served-by").unwrap(), "pod-1");
    let mut stream = resp.into_inner();
    let mut got = Vec::new();
    while let Some(m) = within(IO_TIMEOUT, "stream message", stream.message())
        .await
        .unwrap()
        .unwrap_or_else(|s| panic!("stream failed: {s:?}"))
    {
        got.push(m);
    }
    assert_eq!(got.len(), 25);
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.seq, i as u32);
        assert_eq!(m.message, format!("tick#{i}"));
    }
    let trailers = within(IO_TIMEOUT, "trailers", stream.trailers())
        .await
        .unwrap()
        .unwrap();
    // The trailers arrived (grpc-status 0, or the stream would have ended in an error above).
    assert!(trailers.is_some(), "the OK stream's trailers were lost");

    // Server streaming ending in a non-OK status: real trailers after data.
    let req = tonic::Request::new(EchoRequest {
        message: "burst".into(),
        count: 3,
        fail_at_end: true,
    });
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let mut stream = within(
        IO_TIMEOUT,
        "server streaming",
        g.server_streaming(req, path(STREAM), codec()),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner();
    let mut n = 0;
    let status = loop {
        match within(IO_TIMEOUT, "stream message", stream.message())
            .await
            .unwrap()
        {
            Ok(Some(m)) => {
                assert_eq!(m.message, format!("burst#{n}"));
                n += 1;
            }
            Ok(None) => panic!("the stream ended OK; the server ended it with an error"),
            Err(s) => break s,
        }
    };
    assert_eq!(n, 3, "every message before the error arrived");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "quota exhausted");
    assert_eq!(
        status
            .metadata()
            .get("x-quota-left")
            .map(|v| v.to_str().unwrap()),
        Some("0"),
        "custom trailer kept: {:?}",
        status.metadata()
    );

    assert_eq!(
        server.calls.load(Ordering::SeqCst),
        4,
        "four calls reached the server"
    );
    let cs = clusters(&client).await;
    assert_eq!(
        cs.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        vec!["payments.aether.internal:9090"]
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Protocol kept end to end
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
// 6. CONNECT tunnels
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_tunnels_to_tcp_ports_only() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let echo = TcpEcho::start(p1.app(5432)).await;
    let _s1 = server_proxy(
        &certs,
        p1,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 5432, protocol: tcp }",
        ],
    )
    .await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    protocols: { 5432: tcp }\n",
        &[endpoint(p1.proxy_ip(), &[8080, 5432])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    // CONNECT to the tcp port: a tunnel to the echo server, half-close included.
    let mut s = tcp_connect(out).await.unwrap();
    s.write_all(
        b"CONNECT payments.aether.internal:5432 HTTP/1.1\r\nHost: payments.aether.internal:5432\r\n\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200, "CONNECT answer: {:?}", head.headers);
    assert_eq!(head.header("x-aether-error"), None);
    let mut payload = Vec::new();
    for i in 0..2000u32 {
        payload.extend_from_slice(format!("row {i};").as_bytes());
    }
    s.write_all(&payload).await.unwrap();
    let mut back = vec![0u8; payload.len()];
    within(IO_TIMEOUT, "echo", s.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, payload, "echoed through the tunnel");
    s.shutdown().await.unwrap();
    let (rest, end) = read_to_end_within(&mut s, IO_TIMEOUT).await;
    assert_eq!(
        rest, ECHO_EOF_MARKER,
        "half-close reached the app and its last words came back"
    );
    assert_eq!(end, ReadEnd::Eof);
    assert_eq!(echo.connections(), 1);
    assert_eq!(echo.received(), payload);

    // CONNECT to an HTTP port.
    let (head, body) = raw_exchange(
        out,
        "CONNECT payments.aether.internal:8080 HTTP/1.1\r\nHost: payments.aether.internal:8080\r\n\r\n",
    )
    .await;
    assert_raw_proxy_error(&head, &body, 400, "not-a-tcp-port", "CONNECT to 8080");
    let (head, body) = raw_exchange(
        out,
        "CONNECT payments.aether.internal HTTP/1.1\r\nHost: payments.aether.internal\r\n\r\n",
    )
    .await;
    // CONNECT names host:port; without a port it is either malformed or the default (HTTP)
    // port, and either way a proxy-made 400.
    let reason = head
        .header("x-aether-error")
        .unwrap_or_default()
        .to_string();
    assert!(
        ["bad-authority", "not-a-tcp-port"].contains(&reason.as_str()),
        "CONNECT without a port: {reason:?}"
    );
    assert_raw_proxy_error(&head, &body, 400, &reason, "CONNECT without a port");

    // A plain request for the tcp port.
    let r = get_h1(out, "payments.aether.internal:5432", "/").await;
    assert_proxy_error(&r, 400, "not-an-http-port", "GET to 5432");
    let r = h2_to(out)
        .await
        .get("http://payments.aether.internal:5432/")
        .await
        .unwrap();
    assert_proxy_error(&r, 400, "not-an-http-port", "h2c GET to 5432");
    assert_eq!(app.seen().len(), 0, "nothing reached the HTTP app");
    assert_eq!(
        echo.connections(),
        1,
        "nothing else reached the echo server"
    );
}

// ---------------------------------------------------------------------------------------------
// 7. SAN pinning
// ---------------------------------------------------------------------------------------------

/// Pod 1's proxy presents the `orders` identity while the catalog pins `payments` to it: the
/// request fails with `upstream-identity-mismatch`, the app sees nothing and the endpoint is
/// not tried again. Control: the catalog's `orders` service on the same pod works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_san_mismatch_is_refused() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let s1 = server_proxy(&certs, p1, "orders", &["{ port: 8080, protocol: auto }"]).await;
    let cat = catalog(&[
        service(
            "payments",
            &certs.spiffe_id(PAYMENTS),
            "",
            &[endpoint(p1.proxy_ip(), &[8080])],
        ),
        service(
            "orders",
            &certs.spiffe_id(ORDERS),
            "",
            &[endpoint(p1.proxy_ip(), &[8080])],
        ),
    ]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    let r = get_h1(out, SVC, "/pinned").await;
    assert_proxy_error(&r, 503, "upstream-identity-mismatch", "impostor");
    assert_eq!(app.seen().len(), 0, "the impostor's app saw nothing");
    assert_eq!(app.connections(), 0, "not even a connection");

    // Exactly one handshake reached the impostor: no retry onto the same endpoint.
    let inbound = ["listener=\"inbound\""];
    let deadline = Instant::now() + LOG_TIMEOUT;
    while metric_sum(&s1, "aether_tls_handshakes_total", &inbound).await < 1.0 {
        assert!(Instant::now() < deadline, "the impostor saw no handshake");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = get_h1(out, "orders.aether.internal", "/control").await;
    assert_app_ok(&r, 8080, "control: the pod's own identity");
    assert_eq!(app.seen().len(), 1);
    let deadline = Instant::now() + LOG_TIMEOUT;
    while metric_sum(&s1, "aether_tls_handshakes_total", &inbound).await < 2.0 {
        assert!(
            Instant::now() < deadline,
            "the control handshake is missing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        metric_sum(&s1, "aether_tls_handshakes_total", &inbound).await,
        2.0,
        "one handshake for the refused request, one for the control"
    );
    let cs = clusters(&client).await;
    assert!(cs.iter().any(|c| c.0 == SVC), "{cs:?}");
}

/// The pin holds for pooled connections too: a connection verified for `orders` (pod 1's real
/// identity) must not carry a request for `payments`, whose catalog identity pod 1 lacks, just
/// because both services list the same endpoint, SNI port and protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connection_does_not_bypass_the_pin() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "orders", &["{ port: 8080, protocol: auto }"]).await;
    let cat = catalog(&[
        service(
            "payments",
            &certs.spiffe_id(PAYMENTS),
            "",
            &[endpoint(p1.proxy_ip(), &[8080])],
        ),
        service(
            "orders",
            &certs.spiffe_id(ORDERS),
            "",
            &[endpoint(p1.proxy_ip(), &[8080])],
        ),
    ]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    // `orders` first: its upstream connection (pod 1, SNI 8080, h1) goes back to the pool.
    let mut c = h1_to(out).await;
    let r = c
        .send(empty(
            get("/orders").header("host", "orders.aether.internal"),
        ))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "orders");
    assert_eq!(app.seen().len(), 1);
    // Same app connection, then a fresh one.
    let r = c
        .send(empty(get("/payments/0").header("host", SVC)))
        .await
        .unwrap();
    assert_proxy_error(
        &r,
        503,
        "upstream-identity-mismatch",
        "payments after orders",
    );
    let r = get_h1(out, SVC, "/payments/1").await;
    assert_proxy_error(
        &r,
        503,
        "upstream-identity-mismatch",
        "payments, new caller",
    );
    assert_eq!(
        paths(&app),
        vec!["/orders".to_string()],
        "a payments request reached a pod that is not payments"
    );
}

/// A new catalog that pins another identity applies to connections already pooled: pod 1 is
/// `payments`; once the catalog says the service is `orders`, pod 1 must be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_pin_from_a_catalog_reload_applies_to_pooled_connections() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let cat = |identity: &str| {
        catalog(&[service(
            "payments",
            identity,
            "",
            &[endpoint(p1.proxy_ip(), &[8080])],
        )])
    };
    let client = client_proxy(&certs, client_pod, &cat(&certs.spiffe_id(PAYMENTS)), "").await;
    let out = client_pod.outbound();
    let r = get_h1(out, SVC, "/before").await;
    assert_app_ok(&r, 8080, "before the reload");

    // Replace the catalog (write + rename, as a control plane would) and wait for the reload.
    let ok_reloads = ["result=\"ok\""];
    let before = metric_sum(&client, "aether_catalog_reloads_total", &ok_reloads).await;
    let tmp = client.dir().join("catalog.yaml.tmp");
    std::fs::write(&tmp, cat(&certs.spiffe_id(ORDERS))).unwrap();
    std::fs::rename(&tmp, client.catalog_path()).unwrap();
    let deadline = Instant::now() + LOG_TIMEOUT;
    while metric_sum(&client, "aether_catalog_reloads_total", &ok_reloads).await <= before {
        assert!(Instant::now() < deadline, "the new catalog was not loaded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let r = get_h1(out, SVC, "/after").await;
    assert_proxy_error(
        &r,
        503,
        "upstream-identity-mismatch",
        "after the pin changed",
    );
    assert_eq!(
        paths(&app),
        vec!["/before".to_string()],
        "pod 1 is no longer the pinned identity"
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Retries
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
    let deadline = Instant::now() + LOG_TIMEOUT;
    loop {
        let lines: Vec<_> = client
            .access_log()
            .into_iter()
            .filter(|l| l["path"].as_str().is_some_and(|p| p.starts_with("/r/")))
            .collect();
        if lines.len() == n {
            for l in &lines {
                assert_eq!(l["status"], 200, "{l}");
                assert_eq!(l["upstream"].as_str(), Some(live_addr.as_str()), "{l}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} access-log lines",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
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
// 9. Load spread
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
// 10. XFCC and x-request-id through both proxies
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfcc_is_stripped_and_request_id_kept() {
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
    let want = expected_xfcc(&certs, PAYMENTS, "frontend", FRONTEND);
    let forged = "By=spiffe://aether.local/ns/default/sa/payments;Hash=00;URI=spiffe://aether.local/ns/kube-system/sa/admin";

    // HTTP/1.1, forged XFCC twice, an id of our own.
    let r = h1_to(out)
        .await
        .send(empty(
            get("/xfcc")
                .header("host", SVC)
                .header("x-forwarded-client-cert", forged)
                .header("x-forwarded-client-cert", "URI=spiffe://evil")
                .header("x-request-id", "req-e2e-0001"),
        ))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "h1 with forged XFCC");
    assert_eq!(
        echoed_header(&r, "x-forwarded-client-cert"),
        vec![want.clone()]
    );
    assert_eq!(
        echoed_header(&r, "x-request-id"),
        vec!["req-e2e-0001".to_string()]
    );

    // h2c, same.
    let r = h2_to(out)
        .await
        .send(empty(
            get(&format!("http://{SVC}/xfcc-h2"))
                .header("x-forwarded-client-cert", forged)
                .header("x-request-id", "req-e2e-0002"),
        ))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "h2c with forged XFCC");
    assert_eq!(
        echoed_header(&r, "x-forwarded-client-cert"),
        vec![want.clone()]
    );
    assert_eq!(
        echoed_header(&r, "x-request-id"),
        vec!["req-e2e-0002".to_string()]
    );

    // No id: one is made (a UUID) and the app gets exactly one.
    let r = get_h1(out, SVC, "/no-id").await;
    let ids = echoed_header(&r, "x-request-id");
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert!(uuid::Uuid::parse_str(&ids[0]).is_ok(), "{ids:?}");
    assert_eq!(app.seen().len(), 3);
}

// ---------------------------------------------------------------------------------------------
// 11. The upstream connection as a server pod sees it
// ---------------------------------------------------------------------------------------------

/// What the client proxy puts on the wire to a server pod: SNI = the bare port, ALPN with the
/// caller's protocol first, its own certificate, the app's XFCC removed, `x-request-id` kept
/// (or made).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_wire_view_sni_alpn_and_headers() {
    use wire::*;
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let observer = Observer::start(&certs, p1.inbound()).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(p1.proxy_ip(), &[8080, 9090])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

    let r = h1_to(out)
        .await
        .send(empty(
            get("/wire-h1")
                .header("host", SVC)
                .header(
                    "x-forwarded-client-cert",
                    "URI=spiffe://aether.local/ns/x/sa/forged",
                )
                .header("x-request-id", "wire-0001"),
        ))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.text(), "observed\n");
    let r = h2_to(out)
        .await
        .send(empty(get(&format!("http://{SVC}:9090/wire-h2")).header(
            "x-forwarded-client-cert",
            "URI=spiffe://aether.local/ns/x/sa/forged",
        )))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK, "{r:?}");

    let conns = observer.conns();
    assert_eq!(
        conns.len(),
        2,
        "one upstream connection per (port, protocol): {conns:#?}"
    );
    let c1 = conns
        .iter()
        .find(|c| c.requests.iter().any(|r| r.1.ends_with("/wire-h1")))
        .unwrap_or_else(|| panic!("the h1 request is missing: {conns:#?}"));
    assert_eq!(
        c1.sni.as_deref(),
        Some("8080"),
        "SNI is the bare port number"
    );
    assert_eq!(
        c1.alpn_offered,
        vec!["http/1.1", "h2"],
        "the caller's protocol first"
    );
    assert_eq!(c1.alpn_selected.as_deref(), Some("http/1.1"));
    assert_eq!(c1.peer_ids, vec![certs.spiffe_id(FRONTEND)]);
    let (version, _, headers) = &c1.requests[0];
    assert_eq!(version, "HTTP/1.1");
    let h = |name: &str| -> Vec<&str> {
        headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    assert!(
        h("x-forwarded-client-cert").is_empty(),
        "the app's XFCC left the client: {headers:?}"
    );
    assert_eq!(h("x-request-id"), vec!["wire-0001"]);
    assert_eq!(h("host"), vec![SVC], "{headers:?}");

    let c2 = conns
        .iter()
        .find(|c| c.requests.iter().any(|r| r.1.ends_with("/wire-h2")))
        .unwrap_or_else(|| panic!("the h2 request is missing: {conns:#?}"));
    assert_eq!(c2.sni.as_deref(), Some("9090"));
    assert_eq!(c2.alpn_offered, vec!["h2", "http/1.1"]);
    assert_eq!(c2.alpn_selected.as_deref(), Some("h2"));
    assert_eq!(c2.peer_ids, vec![certs.spiffe_id(FRONTEND)]);
    let (version, uri, headers) = &c2.requests[0];
    assert_eq!(version, "HTTP/2.0");
    assert!(
        uri.starts_with("http://payments.aether.internal:9090/")
            || uri.starts_with("https://payments.aether.internal:9090/"),
        ":authority is the caller's: {uri}"
    );
    assert!(
        !headers.iter().any(|(k, _)| k == "x-forwarded-client-cert"),
        "{headers:?}"
    );
    let ids: Vec<&str> = headers
        .iter()
        .filter(|(k, _)| k == "x-request-id")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(ids.len(), 1, "{headers:?}");
    assert!(uuid::Uuid::parse_str(ids[0]).is_ok(), "{ids:?}");
}

// ---------------------------------------------------------------------------------------------
// 12. Per-source identities
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_identities_pick_the_client_cert() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let _app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(p1.proxy_ip(), &[8080])],
    )]);
    let batch_src = client_pod.extra(0);
    let plain_src = client_pod.extra(1);
    let extra = format!(
        "source_identities:\n  - source: {batch_src}\n    cert: {}\n    key: {}\n",
        certs.cert("batch").display(),
        certs.key("batch").display()
    );
    let _client = client_proxy(&certs, client_pod, &cat, &extra).await;
    let out = client_pod.outbound();
    let as_batch = expected_xfcc(&certs, PAYMENTS, "batch", BATCH);
    let as_frontend = expected_xfcc(&certs, PAYMENTS, "frontend", FRONTEND);

    // Interleaved, so a pooled upstream connection of one identity would show up on the other.
    for round in 0..3 {
        for (src, want, who) in [
            (batch_src, &as_batch, "batch"),
            (plain_src, &as_frontend, "frontend"),
        ] {
            let tcp = tcp_connect_from(src, out).await;
            let r = HttpClient::h1(tcp)
                .await
                .unwrap()
                .send(empty(get(&format!("/{who}/{round}")).header("host", SVC)))
                .await
                .unwrap();
            assert_app_ok(&r, 8080, who);
            assert_eq!(
                echoed_header(&r, "x-forwarded-client-cert"),
                vec![want.clone()],
                "round {round}, source {src}"
            );
        }
    }
    // Over h2 as well.
    let tcp = tcp_connect_from(batch_src, out).await;
    let r = HttpClient::h2(tcp)
        .await
        .unwrap()
        .get(&format!("http://{SVC}/batch-h2"))
        .await
        .unwrap();
    assert_eq!(echoed_header(&r, "x-forwarded-client-cert"), vec![as_batch]);
}

// ---------------------------------------------------------------------------------------------
// 13. Request timeout
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_gives_504() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    request_timeout: 500ms\n",
        &[endpoint(p1.proxy_ip(), &[8080])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();

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
    assert_eq!(app.seen().len(), 3, "the slow request did reach the app");

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
    let ejections = metric_sum(
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
