//! Readiness gated on local listeners (SPEC section 5), through the real binary.

use crate::common::*;

use std::net::SocketAddr;
use std::time::Duration;

async fn readyz(p: &Proxy) -> (u16, serde_json::Value) {
    match p.admin_get("/readyz").await {
        Ok(r) => (r.status.as_u16(), r.json()),
        // Not listening yet (the proxy was started without waiting for readiness).
        Err(e) => (0, serde_json::Value::String(e)),
    }
}

/// Polls `/readyz` until it answers `want`; a 503 while the proxy is still starting (its own
/// listeners not up yet, on a loaded machine) does not count as the answer.
async fn wait_for_status(p: &Proxy, want: u16) -> serde_json::Value {
    let what = format!("/readyz answering {want}");
    eventually_every(
        Duration::from_secs(10),
        Duration::from_millis(100),
        &what,
        async || {
            let (status, body) = readyz(p).await;
            if status == want && body["reason"] != "starting" {
                Ok(body)
            } else {
                Err(format!("/readyz stayed {status} ({body})"))
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_until_the_required_port_listens() {
    let net = Net::fresh();
    let pod = net.pod(0);
    // Reserve a port by binding without listening: nothing else can take it, and it is not
    // in LISTEN state until we say so.
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.bind(&SocketAddr::new(pod.app_host(), 0).into())
        .unwrap();
    let port = sock.local_addr().unwrap().as_socket().unwrap().port();

    let certs = Certs::new("aether.local", &["default/payments"]);
    let config = format!(
        "{}{}readiness: {{ required_listeners: [{port}] }}\n",
        certs.identity_yaml("payments"),
        pod.listeners_yaml(8080, &[]),
    );
    let proxy = Proxy::builder(&config, "services: {}\n")
        .no_wait()
        .start()
        .await;

    let body = wait_for_status(&proxy, 503).await;
    assert_eq!(body["status"], "not ready", "{body}");
    assert_eq!(
        body["missingListeners"],
        serde_json::json!([port]),
        "{body}"
    );
    // Liveness never depends on readiness.
    for path in ["/health", "/healthz"] {
        let r = proxy.admin_get(path).await.unwrap();
        assert_eq!(r.status.as_u16(), 200, "{path}");
    }
    // Still 503 on a second look (the cache does not invent readiness).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(readyz(&proxy).await.0, 503);

    sock.listen(16).unwrap();
    let body = wait_for_status(&proxy, 200).await;
    assert_eq!(body["status"], "ready", "{body}");

    let log = proxy.stderr();
    let count = |s: &str| log.matches(s).count();
    assert_eq!(
        count("required listeners missing; reporting not ready"),
        1,
        "{log}"
    );
    assert_eq!(
        count("required listeners present; reporting ready"),
        1,
        "{log}"
    );
    assert_eq!(count("required listeners not enforced"), 0, "{log}");
    drop(sock);
}
