//! The admin listener (SPEC section 6) of a real proxy: health, readiness, metrics names,
//! config dump, clusters, run-time log filter, and unknown paths.

use std::time::Duration;

use crate::common::*;

/// A payments pod's certificates and config (default port 8080), `extra` appended.
fn payments_pod(pod: &PodNet, extra: &str) -> (Certs, String) {
    let certs = Certs::new("aether.local", &["default/payments"]);
    let config = format!(
        "{}{}{extra}",
        certs.identity_yaml("payments"),
        pod.listeners_yaml(8080, &[])
    );
    (certs, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_answer_per_spec() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let (_certs, config) = payments_pod(&pod, "");
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

/// Parses a metrics exposition with the Prometheus project's Python client (the reference
/// parsers): `format` is "classic" or "openmetrics". Returns {family: [type, [sample names]]}.
fn parse_exposition(format: &str, text: &str) -> serde_json::Value {
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families as classic
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
parse = classic if sys.argv[1] == "classic" else om
out = {}
for f in parse(sys.stdin.read()):
    out[f.name] = [f.type, sorted({s.name for s in f.samples})]
print(json.dumps(out))
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script, format])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs (CI installs prometheus-client)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the {format} parser refused the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_classic_text_unless_the_scraper_asks_for_openmetrics() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let (_certs, config) = payments_pod(&pod, "");
    let proxy = Proxy::start(&config, "services: {}\n").await;
    // A request, so request counters and the duration histogram have samples.
    let mut h1 = HttpClient::h1(tcp_connect(pod.outbound()).await.unwrap())
        .await
        .unwrap();
    let r = h1
        .send(empty(get("/").header("host", "nowhere.example")))
        .await;
    assert_eq!(r.unwrap().status.as_u16(), 404);

    let scrape = |accept: Option<&'static str>| {
        let admin = proxy.admin_addr();
        async move {
            let mut req = get("/metrics").header("host", admin.to_string());
            if let Some(a) = accept {
                req = req.header("accept", a);
            }
            let tcp = tcp_connect(admin).await.unwrap();
            HttpClient::h1(tcp)
                .await
                .unwrap()
                .send(empty(req))
                .await
                .unwrap()
        }
    };

    // No Accept (curl, older scrapers): the classic text format.
    let classic = scrape(None).await;
    assert_eq!(
        classic.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let text = classic.text();
    assert!(!text.contains("# EOF"), "{text}");
    assert!(
        text.contains("# TYPE aether_requests_total counter\n"),
        "a classic counter's TYPE names its samples:\n{text}"
    );
    let families = parse_exposition("classic", &text);
    assert_eq!(families["aether_requests"][0], "counter", "{families}");
    assert_eq!(
        families["aether_requests"][1],
        serde_json::json!(["aether_requests_total"])
    );
    assert_eq!(families["aether_request_duration_seconds"][0], "histogram");
    assert_eq!(families["aether_connections_active"][0], "gauge");

    // Prometheus' own Accept header: OpenMetrics, which its strict parser accepts.
    let om = scrape(Some(
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    ))
    .await;
    assert_eq!(
        om.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(om.text().ends_with("# EOF\n"));
    let families = parse_exposition("openmetrics", &om.text());
    assert_eq!(families["aether_requests"][0], "counter", "{families}");
    assert_eq!(families["aether_request_duration_seconds"][0], "histogram");

    // OpenMetrics refused outright (q=0): classic again.
    let refused = scrape(Some("application/openmetrics-text; q=0, text/plain")).await;
    assert_eq!(
        refused.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_listener_serves_only_the_probes() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let health = std::net::SocketAddr::new(pod.proxy_ip(), 15021);
    // Port 8080's app is never started: readiness gated on it stays "not ready".
    let extra =
        format!("health: {{ listen: {health} }}\nreadiness: {{ required_listeners: [8080] }}\n");
    let (_certs, config) = payments_pod(&pod, &extra);
    let proxy = Proxy::builder(&config, "services: {}\n")
        .no_wait()
        .start()
        .await;
    let (five_s, pace) = (Duration::from_secs(5), Duration::from_millis(25));
    eventually_every(five_s, pace, "the health listener answering", async || {
        http_get(health, "/healthz/ready").await.map(drop)
    })
    .await;
    // The first answers can straddle the first readiness scan ("starting", then the scan's
    // result): ask both again until they agree on a state, then compare them whole.
    let (Ok((ready, readyz)) | Err((ready, readyz))) = poll_until(five_s, pace, async || {
        let ready = http_get(health, "/healthz/ready").await.unwrap();
        let readyz = proxy.admin_get("/readyz").await.unwrap();
        if ready.text() == readyz.text() {
            Ok((ready, readyz))
        } else {
            Err((ready, readyz))
        }
    })
    .await;
    assert_eq!(ready.status.as_u16(), 503);
    assert_eq!(ready.status, readyz.status);
    assert_eq!(ready.text(), readyz.text(), "exactly the /readyz answer");
    assert_eq!(ready.header("content-type"), readyz.header("content-type"));

    // Once the app listens, both say ready.
    let _app = tokio::net::TcpListener::bind(pod.app(8080)).await.unwrap();
    let ten_s = Duration::from_secs(10);
    let pace = Duration::from_millis(50);
    let ready = eventually_every(ten_s, pace, "ready once the app listens", async || {
        let r = http_get(health, "/healthz/ready").await.unwrap();
        if r.status.as_u16() == 200 {
            Ok(r)
        } else {
            Err(format!("{} {}", r.status, r.text()))
        }
    })
    .await;
    assert_eq!(ready.json()["status"], "ready");
    assert_eq!(
        proxy.admin_get("/readyz").await.unwrap().text(),
        ready.text()
    );

    let live = http_get(health, "/healthz").await.unwrap();
    assert_eq!(live.status.as_u16(), 200);
    assert_eq!(live.text().trim(), "ok");

    // Nothing else of admin is reachable there, POSTs included.
    for path in [
        "/readyz",
        "/metrics",
        "/config_dump",
        "/clusters",
        "/health",
        "/",
    ] {
        let r = http_get(health, path).await.unwrap();
        assert_eq!(r.status.as_u16(), 404, "{path}: {}", r.text());
    }
    let tcp = tcp_connect(health).await.unwrap();
    let r = HttpClient::h1(tcp)
        .await
        .unwrap()
        .send(empty(
            http::Request::post("/drain").header("host", health.to_string()),
        ))
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 404);
    let r = proxy.admin_get("/readyz").await.unwrap();
    assert_eq!(r.status.as_u16(), 200, "no drain started: {}", r.text());
}
