//! The admin listener (SPEC section 6) of a real proxy: health, readiness, metrics names,
//! config dump, clusters, run-time log filter, and unknown paths.

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_answer_per_spec() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = Certs::new("aether.local", &["default/payments"]);
    let config = format!(
        "{}{}",
        certs.identity_yaml("payments"),
        pod.listeners_yaml(8080, &[])
    );
    // An endpoint where nothing listens: the catalog is loaded, nothing is ever sent there.
    let idle = net.pod(1).proxy_ip();
    let catalog = format!("services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    endpoints: [{{ address: {idle} }}]\n");
    let proxy = Proxy::start(&config, &catalog).await;

    for path in ["/health", "/healthz"] {
        let r = proxy.admin_get(path).await.unwrap();
        assert_eq!(r.status.as_u16(), 200, "{path}");
        assert_eq!(r.text().trim(), "ok");
    }
    let r = proxy.admin_get("/readyz").await.unwrap();
    assert_eq!(r.status.as_u16(), 200);
    assert_eq!(r.json()["status"], "ready");

    // One request through the outbound listener, so a request series exists.
    let mut h1 = HttpClient::h1(tcp_connect(pod.outbound()).await.unwrap())
        .await
        .unwrap();
    let r = h1
        .send(
            http::Request::get("/")
                .header("host", "evil.com")
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 404);
    let metrics = proxy.admin_get("/metrics").await.unwrap().text();
    for name in [
        "aether_connections_active{listener=\"inbound\"}",
        "aether_connections_active{listener=\"outbound\"} 1",
        "aether_requests_total{direction=\"outbound\",service=\"\",port=\"0\",code=\"404\"} 1",
        "aether_tls_handshakes_total{listener=\"inbound\",result=\"ok\"}",
        "aether_tls_handshakes_total{listener=\"outbound\",result=\"error\"}",
        "aether_catalog_reloads_total{result=\"ok\"}",
        "aether_catalog_reloads_total{result=\"error\"}",
        "aether_request_duration_seconds_bucket{le=\"0.001\",direction=\"inbound\"}",
        "aether_identity_reloads_total{result=\"ok\"}",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}:\n{metrics}");
    }

    let dump = proxy.admin_get("/config_dump").await.unwrap().json();
    assert_eq!(dump["catalog"]["version"], 1, "{dump}");
    assert_eq!(dump["catalog"]["services"], serde_json::json!(["payments"]));
    assert_eq!(
        dump["config"]["inbound"]["listen"],
        pod.inbound().to_string()
    );
    assert_eq!(
        dump["config"]["identity"]["spiffe_id"],
        "spiffe://aether.local/ns/default/sa/payments"
    );
    let clusters = proxy.admin_get("/clusters").await.unwrap().json();
    assert_eq!(
        clusters["clusters"],
        serde_json::json!([]),
        "nothing materialized yet"
    );

    // The log filter changes at run time; a bad one is refused.
    let r = proxy.admin_post("/logging?level=debug").await.unwrap();
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    let r = proxy
        .admin_post("/logging?level=aether_proxy=nonsense[")
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 400, "{}", r.text());
    // Filters with `=` and `,` arrive percent-encoded; a missing level is refused, not
    // taken as an empty filter (which would silence every log line).
    let r = proxy
        .admin_post("/logging?level=aether_proxy%3Ddebug%2Cinfo")
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    assert_eq!(r.text(), "log filter: aether_proxy=debug,info\n");
    for bad in ["/logging", "/logging?level=", "/logging?lvl=debug"] {
        let r = proxy.admin_post(bad).await.unwrap();
        assert_eq!(r.status.as_u16(), 400, "{bad}: {}", r.text());
        assert!(r.text().contains("missing level"), "{bad}: {}", r.text());
    }

    let r = proxy.admin_get("/nope").await.unwrap();
    assert_eq!(r.status.as_u16(), 404);
}
