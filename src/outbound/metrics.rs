//! The upstream families: circuit-breaker overflows, retries, outlier ejections, and what
//! became of captured connections (egress, not HTTP); registered with the rest when first used.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::metrics::Direction;

pub struct Metrics {
    pub outlier_ejections: Family<ServicePortLabels, Counter>,
    pub overflows: Family<OverflowLabels, Counter>,
    pub retries: Family<RetryLabels, Counter>,
    /// Captured connections to destinations outside the mesh, by what `outbound.egress` did.
    pub egress: Family<EgressLabels, Counter>,
    /// Captured connections to a service's HTTP port whose first bytes were not HTTP (closed).
    pub captured_not_http: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServicePortLabels {
    pub service: String,
    pub port: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OverflowLabels {
    pub service: String,
    pub port: u16,
    /// `requests` or `connections`.
    pub breaker: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// `outbound`: a retry to the destination service's endpoints; `inbound`: a request sent
    /// to the app again on a new connection (`service` is then this workload's own).
    pub direction: Direction,
    pub service: String,
    pub port: u16,
    /// Why the attempt before failed: `connect-failure`, `pool-closed`, `refused`, `reset`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EgressLabels {
    /// `deny` or `passthrough` (`outbound.egress`).
    pub action: &'static str,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            outlier_ejections: Family::default(),
            overflows: Family::default(),
            retries: Family::default(),
            egress: Family::default(),
            captured_not_http: Counter::default(),
        };
        for action in ["deny", "passthrough"] {
            let _ = m.egress.get_or_create(&EgressLabels { action });
        }
        crate::metrics::register(|registry| m.register(registry));
        m
    })
}

impl Metrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "aether_retries",
            "Requests sent again (outbound: to another endpoint; inbound: to the app on a new connection), by why the attempt before failed",
            self.retries.clone(),
        );
        registry.register(
            "aether_cluster_overflow",
            "Requests refused with 503 overflow, by the circuit breaker that was full",
            self.overflows.clone(),
        );
        registry.register(
            "aether_egress",
            "Captured connections to destinations outside the mesh, by action",
            self.egress.clone(),
        );
        registry.register(
            "aether_captured_not_http",
            "Captured connections to a service's HTTP port closed because they did not speak HTTP",
            self.captured_not_http.clone(),
        );
        registry.register(
            "aether_outlier_ejections",
            "Endpoints ejected by outlier detection",
            self.outlier_ejections.clone(),
        );
    }
}

/// Counts a request or connection refused because `breaker` (`requests`, `connections`) of
/// the service's port was full.
pub fn overflow(service: &str, port: u16, breaker: &'static str) {
    metrics()
        .overflows
        .get_or_create(&OverflowLabels {
            service: service.to_string(),
            port,
            breaker,
        })
        .inc();
}

/// Counts a request sent again because the attempt before failed for `reason`.
pub fn retry(direction: Direction, service: &str, port: u16, reason: &'static str) {
    metrics()
        .retries
        .get_or_create(&RetryLabels {
            direction,
            service: service.to_string(),
            port,
            reason,
        })
        .inc();
}
