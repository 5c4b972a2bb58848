//! Identities on the outbound side (SPEC section 1 "Upstream connection", section 7): the
//! catalog's SAN pin (fresh, pooled and after a reload), per-source client identities, XFCC and
//! `x-request-id` through both proxies, and the upstream connection as a server pod sees it.
//!
//! Real `aether-proxy run` processes: a client pod whose apps (this test) talk plaintext to its
//! outbound listener, server pods with their own proxies and apps, real mTLS between them, all
//! on loopback; the pods and catalogs are those of `crate::common::mesh`.

use std::net::{IpAddr, SocketAddr};

use crate::common::inbound::series_or_zero;
use crate::common::mesh::*;
use crate::common::*;
use http::StatusCode;
use tokio::net::{TcpSocket, TcpStream};

// ---------------------------------------------------------------------------------------------
// SAN pinning
// ---------------------------------------------------------------------------------------------

/// Pod 1 runs the `orders` identity while the catalog lists it for both `payments` (pinned to
/// the payments identity) and `orders`, 8080 each.
struct ImpostorPod {
    _certs: Certs,
    app: HttpApp,
    server: Proxy,
    client: Proxy,
    out: SocketAddr,
}

impl ImpostorPod {
    async fn start() -> ImpostorPod {
        let net = Net::fresh();
        let (client_pod, p1) = (net.pod(0), net.pod(1));
        let certs = certs();
        let app = HttpApp::auto(p1.app(8080)).await;
        let server = server_proxy(&certs, p1, "orders", &["{ port: 8080, protocol: auto }"]).await;
        let eps = [endpoint(p1.proxy_ip(), &[8080])];
        let cat = catalog(&[
            service("payments", &certs.spiffe_id(PAYMENTS), "", &eps),
            service("orders", &certs.spiffe_id(ORDERS), "", &eps),
        ]);
        let client = client_proxy(&certs, client_pod, &cat, "").await;
        let out = client_pod.outbound();
        ImpostorPod {
            _certs: certs,
            app,
            server,
            client,
            out,
        }
    }
}

/// Pod 1's proxy presents the `orders` identity while the catalog pins `payments` to it: the
/// request fails with `upstream-identity-mismatch`, the app sees nothing and the endpoint is
/// not tried again. Control: the catalog's `orders` service on the same pod works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_san_mismatch_is_refused() {
    let pod = ImpostorPod::start().await;
    let (app, s1, client, out) = (&pod.app, &pod.server, &pod.client, pod.out);

    let r = get_h1(out, SVC, "/pinned").await;
    assert_proxy_error(&r, 503, "upstream-identity-mismatch", "impostor");
    assert_eq!(app.seen().len(), 0, "the impostor's app saw nothing");
    assert_eq!(app.connections(), 0, "not even a connection");

    // Exactly one handshake reached the impostor: no retry onto the same endpoint.
    let inbound = ["listener=\"inbound\""];
    let handshakes = "aether_tls_handshakes_total";
    // The impostor saw the handshake.
    wait_metric(s1, handshakes, &inbound, LOG_TIMEOUT, |v| v >= 1.0).await;
    let r = get_h1(out, "orders.aether.internal", "/control").await;
    assert_app_ok(&r, 8080, "control: the pod's own identity");
    assert_eq!(app.seen().len(), 1);
    // And the control's.
    wait_metric(s1, handshakes, &inbound, LOG_TIMEOUT, |v| v >= 2.0).await;
    assert_eq!(
        metric(s1, handshakes, &inbound).await,
        2.0,
        "one handshake for the refused request, one for the control"
    );
    let cs = clusters(client).await;
    assert!(cs.iter().any(|c| c.0 == SVC), "{cs:?}");
}

/// The pin holds for pooled connections too: a connection verified for `orders` (pod 1's real
/// identity) must not carry a request for `payments`, whose catalog identity pod 1 lacks, just
/// because both services list the same endpoint, SNI port and protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connection_does_not_bypass_the_pin() {
    let pod = ImpostorPod::start().await;
    let (app, out) = (&pod.app, pod.out);

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
        paths(app),
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
    let before = metric(&client, "aether_catalog_reloads_total", &ok_reloads).await;
    let tmp = client.dir().join("catalog.yaml.tmp");
    std::fs::write(&tmp, cat(&certs.spiffe_id(ORDERS))).unwrap();
    std::fs::rename(&tmp, client.catalog_path()).unwrap();
    // The new catalog was loaded.
    let reloads = "aether_catalog_reloads_total";
    wait_metric(&client, reloads, &ok_reloads, LOG_TIMEOUT, |v| v > before).await;

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
// XFCC and x-request-id through both proxies
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfcc_is_stripped_and_request_id_kept() {
    let m = OnePodMesh::start().await;
    let out = m.outbound();
    let want = expected_xfcc(&m.certs, PAYMENTS, "frontend", FRONTEND);
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
    assert_eq!(m.app.seen().len(), 3);
}

/// Every request on its own upstream connection (`max_requests_per_connection: 1`). After the
/// first, the client proxy offers the session it kept and the connection resumes (that much is
/// pinned in `identity::store` and `outbound::connect`); a resumed connection brings the
/// client's leaf only as the server side's session restored it from the ticket. XFCC must
/// name the client exactly on each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfcc_names_the_client_on_every_new_upstream_connection() {
    let m = OnePodMesh::start_with(OnePodExtras {
        service: "    max_requests_per_connection: 1\n",
        ..Default::default()
    })
    .await;
    let want = expected_xfcc(&m.certs, PAYMENTS, "frontend", FRONTEND);
    let handshakes = r#"aether_tls_handshakes_total{listener="inbound",result="ok"}"#;
    let before = series_or_zero(&m.server, handshakes).await;
    for i in 0..5 {
        let r = get_h1(m.outbound(), SVC, &format!("/conn-{i}")).await;
        assert_app_ok(&r, 8080, "a request on a new upstream connection");
        assert_eq!(
            echoed_header(&r, "x-forwarded-client-cert"),
            vec![want.clone()],
            "request {i}"
        );
    }
    let after = series_or_zero(&m.server, handshakes).await;
    assert!(after - before >= 5, "server handshakes {before} -> {after}");
    // One session kept for the endpoint, the one each connection after the first offered.
    assert_eq!(
        series_or_zero(&m.client, "aether_tls_client_sessions").await,
        1
    );
}

// ---------------------------------------------------------------------------------------------
// The upstream connection as a server pod sees it
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
// Per-source identities
// ---------------------------------------------------------------------------------------------

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
