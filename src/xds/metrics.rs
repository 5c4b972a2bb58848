//! The control-plane client's metric families, registered with the rest when first used.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

pub struct Metrics {
    /// 1 while the ADS stream is up.
    pub connected: Gauge,
    pub updates: Family<UpdateLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpdateLabels {
    /// `cluster`, `endpoint` or `secret`.
    pub r#type: &'static str,
    /// `ack` or `nack`.
    pub result: &'static str,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            connected: Gauge::default(),
            updates: Family::default(),
        };
        crate::metrics::register(|registry| {
            registry.register(
                "aether_xds_connected",
                "1 while the control-plane stream is up",
                m.connected.clone(),
            );
            registry.register(
                "aether_xds_updates",
                "Control-plane updates, acknowledged or refused",
                m.updates.clone(),
            );
        });
        m
    })
}

/// Counts an update of `type` (`cluster`, `endpoint`, `secret`), acknowledged or refused.
pub fn update(r#type: &'static str, ack: bool) {
    let result = if ack { "ack" } else { "nack" };
    metrics()
        .updates
        .get_or_create(&UpdateLabels { r#type, result })
        .inc();
}
