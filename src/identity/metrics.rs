//! The identity and TLS families: handshakes, peer certificates refused, identity reloads,
//! client sessions kept for resumption and certificate expiry; registered with the rest when
//! first used.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{ListenerLabels, ResultLabels};

pub struct Metrics {
    pub tls_handshakes: Family<HandshakeLabels, Counter>,
    /// Peer certificates refused for their SAN shape or identity, per listener.
    pub identity_refused: Family<ListenerLabels, Counter>,
    pub identity_reloads: Family<ResultLabels, Counter>,
    /// TLS sessions the client side keeps for resumption, across its client identities.
    pub tls_client_sessions: Gauge,
    /// Seconds until the earliest certificate of each kind expires; set at scrape time.
    pub certificate_expiry: Family<CertLabels, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    pub listener: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertLabels {
    /// `workload` or `trust`.
    pub cert: &'static str,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            tls_handshakes: Family::default(),
            identity_refused: Family::default(),
            identity_reloads: Family::default(),
            tls_client_sessions: Gauge::default(),
            certificate_expiry: Family::default(),
        };
        // Pre-create the series operators alert on, so they read 0 rather than absent.
        for listener in ["inbound", "outbound"] {
            for result in ["ok", "error"] {
                let _ = m
                    .tls_handshakes
                    .get_or_create(&HandshakeLabels { listener, result });
            }
            let _ = m
                .identity_refused
                .get_or_create(&ListenerLabels { listener });
        }
        for result in ["ok", "error"] {
            let _ = m.identity_reloads.get_or_create(&ResultLabels { result });
        }
        crate::metrics::register(|registry| m.register(registry));
        m
    })
}

impl Metrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "aether_certificate_expiry_seconds",
            "Seconds until the earliest not-after of the workload chain or the trust bundle",
            self.certificate_expiry.clone(),
        );
        registry.register(
            "aether_peer_identity_refused",
            "Peer certificates refused for their SAN shape or identity",
            self.identity_refused.clone(),
        );
        registry.register(
            "aether_tls_client_sessions",
            "TLS sessions kept for resuming upstream connections",
            self.tls_client_sessions.clone(),
        );
        registry.register(
            "aether_tls_handshakes",
            "Completed TLS handshakes",
            self.tls_handshakes.clone(),
        );
        registry.register(
            "aether_identity_reloads",
            "Identity certificate reloads",
            self.identity_reloads.clone(),
        );
    }
}

/// Counts a completed TLS handshake of `listener`, by whether it succeeded.
pub fn handshake(listener: &'static str, ok: bool) {
    let result = if ok { "ok" } else { "error" };
    metrics()
        .tls_handshakes
        .get_or_create(&HandshakeLabels { listener, result })
        .inc();
}

/// Counts a peer certificate `listener` refused for its SAN shape or identity.
pub fn identity_refused(listener: &'static str) {
    metrics()
        .identity_refused
        .get_or_create(&ListenerLabels { listener })
        .inc();
}
