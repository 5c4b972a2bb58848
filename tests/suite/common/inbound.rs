//! Helpers of the tests that dial a sidecar's inbound listener (:15008) themselves, as a peer
//! proxy would (`tests/inbound.rs`, `tests/abuse.rs`, `tests/timers.rs`, `tests/rules.rs`): a
//! `payments` sidecar's proxy, the `frontend` peer's TLS client, refusals, and the inbound
//! protocol-error counters.
//!
//! Not re-exported by `common`: a test file imports it with `use common::inbound::*;` (and
//! the workload names from `common::mesh`).

use std::net::SocketAddr;
use std::time::Duration;

use super::*;

/// A `payments` sidecar's proxy on `pod`: default port 8080, `inbound.ports` as given, an
/// empty catalog. The caller adds what differs (environment) and starts it.
pub fn payments_sidecar(certs: &Certs, pod: PodNet, ports: &[&str]) -> ProxyBuilder {
    let config = format!(
        "trust_domain: {}\n{}{}",
        certs.trust_domain(),
        certs.identity_yaml("payments"),
        pod.listeners_yaml(8080, ports),
    );
    Proxy::builder(&config, "services: {}\n")
}

/// A peer presenting the `frontend` leaf, offering `sni` and the `alpn` list.
pub fn frontend_peer(certs: &Certs, sni: &str, alpn: &[&str]) -> TlsClient {
    TlsClient::with_identity(certs, "frontend")
        .sni(Some(sni))
        .alpn(alpn)
}

/// TLS to `addr` as `client` says; panics if the handshake fails.
pub async fn tls_to(client: &TlsClient, addr: SocketAddr) -> TlsStream {
    client
        .connect(addr)
        .await
        .unwrap_or_else(|e| panic!("TLS connect to {addr} failed: {e:?}"))
}

/// The client must not get a request through: the handshake fails, or the connection dies
/// before any answer (TLS 1.3 clients learn of a refused certificate after their Finished).
pub async fn assert_refused(addr: SocketAddr, client: &TlsClient, what: &str) {
    if let Ok(tls) = client.connect(addr).await {
        let r = async {
            let mut c = HttpClient::h1(tls).await?;
            c.get("http://payments.aether.internal/should-not-arrive")
                .await
        }
        .await;
        assert!(r.is_err(), "{what}: got an answer: {r:?}");
    }
}

/// The value of one exact series (`name{labels}` as the exposition writes it), 0 while the
/// proxy has not written it.
pub async fn series_or_zero(p: &Proxy, series: &str) -> u64 {
    let text = p.admin_get("/metrics").await.unwrap().text();
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// `aether_http_protocol_errors_total{listener="inbound",reason}`: connections and streams
/// the inbound side cut off for `reason`.
pub async fn cut_offs(p: &Proxy, reason: &str) -> u64 {
    series_or_zero(
        p,
        &format!("aether_http_protocol_errors_total{{listener=\"inbound\",reason=\"{reason}\"}}"),
    )
    .await
}

/// Polls [`cut_offs`] until it reaches `min` (the proxy counts a connection once its task has
/// ended, a moment after the client saw the end), or 5 s passed; returns the last value.
pub async fn cut_offs_at_least(p: &Proxy, reason: &str, min: u64) -> u64 {
    let (Ok(n) | Err(n)) = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || {
            let n = cut_offs(p, reason).await;
            if n >= min {
                Ok(n)
            } else {
                Err(n)
            }
        },
    )
    .await;
    n
}
