//! The downstream HTTP families: connections and streams cut off by a limit or timer, and
//! request headers dropped by the header rules; registered with the rest when first used.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::metrics::{Direction, DirectionLabels};

pub struct Metrics {
    pub cut_offs: Family<CutOffLabels, Counter>,
    /// Request headers dropped for an underscore in their name, per side.
    pub headers_dropped: Family<DirectionLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CutOffLabels {
    pub listener: &'static str,
    pub reason: &'static str,
}

/// Why the proxy cut a downstream connection or stream short (SPEC section 8), the `reason`
/// label of `aether_http_protocol_errors_total`.
pub const CUT_OFF_REASONS: [&str; 12] = [
    "head_timeout",
    "header_block_timeout",
    "connection_idle",
    "stream_idle",
    "first_byte_timeout",
    "tunnel_idle",
    "headers_too_large",
    "ambiguous_framing",
    "malformed_request",
    "rapid_reset",
    "h2_protocol_error",
    "h2_too_much",
];

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            cut_offs: Family::default(),
            headers_dropped: Family::default(),
        };
        // Pre-create the series operators alert on, so they read 0 rather than absent.
        for listener in ["inbound", "outbound"] {
            for reason in CUT_OFF_REASONS {
                let _ = m.cut_offs.get_or_create(&CutOffLabels { listener, reason });
            }
        }
        for direction in [Direction::inbound, Direction::outbound] {
            let _ = m
                .headers_dropped
                .get_or_create(&DirectionLabels { direction });
        }
        crate::metrics::register(|registry| m.register(registry));
        m
    })
}

impl Metrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "aether_request_headers_dropped",
            "Request headers dropped for an underscore in their name",
            self.headers_dropped.clone(),
        );
        registry.register(
            "aether_http_protocol_errors",
            "Downstream connections and streams cut off by a limit or timer, by reason",
            self.cut_offs.clone(),
        );
    }
}

/// Counts a cut-off; `reason` is one of `CUT_OFF_REASONS`.
pub fn cut_off(listener: &'static str, reason: &'static str) {
    debug_assert!(CUT_OFF_REASONS.contains(&reason), "{reason}");
    metrics()
        .cut_offs
        .get_or_create(&CutOffLabels { listener, reason })
        .inc();
}
