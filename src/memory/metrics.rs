//! The process's resident memory, a gauge set when scraped; registered with the rest when
//! first used.

use prometheus_client::metrics::gauge::Gauge;

pub struct Metrics {
    /// The process's resident set (`resident_bytes`), set when scraped.
    pub resident_memory: Gauge,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            resident_memory: Gauge::default(),
        };
        crate::metrics::register(|registry| {
            registry.register(
                "aether_process_resident_memory_bytes",
                "Resident memory of the proxy process (RSS), read when scraped",
                m.resident_memory.clone(),
            );
        });
        m
    })
}
