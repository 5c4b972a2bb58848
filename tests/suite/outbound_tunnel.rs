//! CONNECT tunnels through the client proxy (SPEC section 1 "Addressing", section 7): a tunnel
//! to a `tcp` port with half-close end to end, and the proxy-made answers for every other
//! combination of CONNECT and port protocol.
//!
//! Real `aether-proxy run` processes: a client pod whose apps (this test) talk plaintext to its
//! outbound listener, server pods with their own proxies and apps, real mTLS between them, all
//! on loopback; the pods and catalogs are those of `crate::common::mesh`.

use crate::common::mesh::*;
use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ---------------------------------------------------------------------------------------------
// CONNECT tunnels
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_tunnels_to_tcp_ports_only() {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let echo = TcpEcho::start(p1.app(5432)).await;
    let (_s1, cat) = payments_with_tcp_port(&certs, p1).await;
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

/// A CONNECT tunnel is routed by the service's `routes` like any request: a header match picks
/// the canary subset, the default route takes the split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_tunnels_follow_the_service_routes() {
    let net = Net::fresh();
    let (client_pod, v1, v2) = (net.pod(0), net.pod(1), net.pod(2));
    let certs = certs();
    let mut echoes = Vec::new();
    let mut proxies = Vec::new();
    for pod in [v1, v2] {
        echoes.push(TcpEcho::start(pod.app(5432)).await);
        let ports = [
            "{ port: 8080, protocol: auto }",
            "{ port: 5432, protocol: tcp }",
        ];
        proxies.push(server_proxy(&certs, pod, "payments", &ports).await);
    }
    let ep = |pod: PodNet, v: &str| {
        format!(
            "      - {{ address: \"{}\", ports: [5432], labels: {{ version: {v} }} }}\n",
            pod.proxy_ip()
        )
    };
    let routes = "    protocols: { 5432: tcp }\n    routes:\n      - match: { header: x-canary, value: \"1\" }\n        subset: { version: v2 }\n      - split:\n          - { subset: { version: v1 }, weight: 100 }\n";
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        routes,
        &[ep(v1, "v1"), ep(v2, "v2")],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let out = client_pod.outbound();
    let tunnel = |canary: bool| async move {
        let mut s = tcp_connect(out).await.unwrap();
        let extra = if canary { "x-canary: 1\r\n" } else { "" };
        s.write_all(
            format!("CONNECT payments.aether.internal:5432 HTTP/1.1\r\nHost: payments.aether.internal:5432\r\n{extra}\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let head = read_head(&mut s).await.unwrap();
        assert_eq!(head.status, 200, "CONNECT answer: {:?}", head.headers);
        s.write_all(b"hello").await.unwrap();
        let mut back = [0u8; 5];
        within(IO_TIMEOUT, "echo", s.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&back, b"hello");
    };
    for _ in 0..6 {
        tunnel(true).await;
    }
    assert_eq!(echoes[1].connections(), 6, "the canary header picks v2");
    assert_eq!(echoes[0].connections(), 0, "no canary tunnel reached v1");
    for _ in 0..6 {
        tunnel(false).await;
    }
    assert_eq!(echoes[0].connections(), 6, "the default split is v1 only");
    assert_eq!(echoes[1].connections(), 6, "no default tunnel reached v2");
}
