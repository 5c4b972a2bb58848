//! The DNS listener's metric families, registered with the rest when first used.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::answer::Outcome;

pub struct Metrics {
    /// Queries by what became of them.
    pub queries: Family<QueryLabels, Counter>,
    /// Queries answered SERVFAIL because every in-flight place was taken.
    pub overloaded: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueryLabels {
    /// `Outcome::as_str`.
    pub result: &'static str,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            queries: Family::default(),
            overloaded: Counter::default(),
        };
        // Every result reads 0 rather than absent from the start.
        for outcome in Outcome::ALL {
            let _ = m.queries.get_or_create(&QueryLabels {
                result: outcome.as_str(),
            });
        }
        crate::metrics::register(|registry| {
            registry.register(
                "aether_dns_queries",
                "DNS queries, by result",
                m.queries.clone(),
            );
            registry.register(
                "aether_dns_overloaded",
                "DNS queries answered SERVFAIL because too many were in flight",
                m.overloaded.clone(),
            );
        });
        m
    })
}

/// Counts a query by what became of it.
pub fn count(outcome: Outcome) {
    metrics()
        .queries
        .get_or_create(&QueryLabels {
            result: outcome.as_str(),
        })
        .inc();
}
