//! The span exporter's metric families, registered with the rest when first used.

use prometheus_client::metrics::counter::Counter;

pub struct Metrics {
    /// Spans accepted by the OTLP collector.
    pub exported: Counter,
    /// Spans dropped: the export queue was full, or the collector failed or was unreachable.
    pub dropped: Counter,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            exported: Counter::default(),
            dropped: Counter::default(),
        };
        crate::metrics::register(|registry| {
            registry.register(
                "aether_trace_spans_exported",
                "Spans accepted by the OTLP collector",
                m.exported.clone(),
            );
            registry.register(
                "aether_trace_spans_dropped",
                "Spans dropped because the export queue was full or the collector failed",
                m.dropped.clone(),
            );
        });
        m
    })
}
