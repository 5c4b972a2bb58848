//! The catalog file's reload family, registered with the rest when first used.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::ResultLabels;

pub struct Metrics {
    pub catalog_reloads: Family<ResultLabels, Counter>,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            catalog_reloads: Family::default(),
        };
        // Both results read 0 rather than absent from the start.
        for result in ["ok", "error"] {
            let _ = m.catalog_reloads.get_or_create(&ResultLabels { result });
        }
        crate::metrics::register(|registry| {
            registry.register(
                "aether_catalog_reloads",
                "Catalog file reloads",
                m.catalog_reloads.clone(),
            );
        });
        m
    })
}
