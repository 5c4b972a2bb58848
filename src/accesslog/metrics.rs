//! The request families, counted as each request's line is recorded, and the access log's own
//! dropped lines; registered with the rest when first used.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::{Direction, DirectionLabels};

pub struct Metrics {
    pub requests: Family<RequestLabels, Counter>,
    pub duration: Family<DirectionLabels, Histogram>,
    /// `duration`'s two series, resolved once: every request observes one, and the family's
    /// lookup (lock, SipHash of the labels) cost more than the observation.
    duration_by_direction: [Histogram; 2],
    /// Requests the proxy answered itself, by direction and `x-aether-error` reason.
    pub errors: Family<ErrorLabels, Counter>,
    /// Access-log lines dropped because the buffer was full (stdout not keeping up).
    pub access_log_dropped: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub direction: Direction,
    pub service: String,
    pub port: u16,
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub direction: Direction,
    pub reason: &'static str,
}

fn duration_histogram() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics::new();
        crate::metrics::register(|registry| m.register(registry));
        m
    })
}

impl Metrics {
    fn new() -> Metrics {
        let duration = Family::<DirectionLabels, Histogram>::new_with_constructor(
            duration_histogram as fn() -> Histogram,
        );
        // Both directions read 0 rather than absent from the start.
        let duration_by_direction = [Direction::inbound, Direction::outbound].map(|direction| {
            duration
                .get_or_create(&DirectionLabels { direction })
                .clone()
        });
        Metrics {
            requests: Family::default(),
            duration,
            duration_by_direction,
            errors: Family::default(),
            access_log_dropped: Counter::default(),
        }
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "aether_errors",
            "Requests the proxy answered itself (x-aether-error), by direction and reason",
            self.errors.clone(),
        );
        registry.register(
            "aether_access_log_dropped",
            "Access-log lines dropped because the output did not keep up",
            self.access_log_dropped.clone(),
        );
        registry.register("aether_requests", "Requests handled", self.requests.clone());
        registry.register(
            "aether_request_duration_seconds",
            "Request duration until the response headers",
            self.duration.clone(),
        );
    }

    /// `aether_request_duration_seconds` for `direction`.
    pub fn duration(&self, direction: Direction) -> &Histogram {
        &self.duration_by_direction[direction as usize]
    }
}

/// Counts one request in `aether_requests_total`. Each thread keeps the counters of the label
/// sets it used last, so a request costs a short scan rather than SipHash over the labels, the
/// family's lock and a String for the service.
/// Families never drop a series, so a kept counter is always the exported one.
pub fn count_request(direction: Direction, service: &str, port: u16, code: u16) {
    type Recent = Vec<(Direction, u16, u16, Box<str>, Counter)>;
    thread_local! {
        static RECENT: std::cell::RefCell<Recent> = const { std::cell::RefCell::new(Vec::new()) };
    }
    /// Label sets kept per thread; a sidecar serves a handful of service, port and code sets.
    const KEEP: usize = 16;
    RECENT.with_borrow_mut(|recent| {
        let hit = recent
            .iter()
            .find(|(d, p, c, s, _)| *p == port && *c == code && *d == direction && **s == *service);
        if let Some((.., counter)) = hit {
            counter.inc();
            return;
        }
        let counter = metrics()
            .requests
            .get_or_create(&RequestLabels {
                direction,
                service: service.to_string(),
                port,
                code,
            })
            .clone();
        counter.inc();
        if recent.len() == KEEP {
            recent.remove(0);
        }
        recent.push((direction, port, code, service.into(), counter));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handles `duration()` returns are the exported series themselves, one per direction
    /// (a detached copy would still let the pre-created series show up, at zero).
    #[test]
    fn duration_handles_feed_the_exported_series() {
        let m = Metrics::new();
        m.duration(Direction::outbound).observe(0.002);
        m.duration(Direction::outbound).observe(0.003);
        m.duration(Direction::inbound).observe(0.5);
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let count = |dir: &str| {
            let key = format!("aether_request_duration_seconds_count{{direction=\"{dir}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .unwrap_or_else(|| panic!("no {key} in:\n{text}"))
                .to_string()
        };
        assert_eq!(count("outbound"), "2");
        assert_eq!(count("inbound"), "1");
    }

    /// Requests counted through the per-thread handles land in the exported series, each label
    /// set in its own, also after more label sets than the thread keeps have pushed one out.
    #[test]
    fn counted_requests_reach_the_exported_series() {
        let exported = |service: &str, code: u16| {
            let text = crate::metrics::encode();
            let key = format!(
                "aether_requests_total{{direction=\"outbound\",service=\"{service}\",port=\"80\",code=\"{code}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(key.as_str()).map(str::to_string))
                .unwrap_or_default()
        };
        for _ in 0..3 {
            count_request(Direction::outbound, "counted-a", 80, 200);
        }
        count_request(Direction::outbound, "counted-a", 80, 503);
        count_request(Direction::inbound, "counted-a", 80, 200);
        assert_eq!(exported("counted-a", 200), "3");
        assert_eq!(exported("counted-a", 503), "1");
        for i in 0..40 {
            count_request(Direction::outbound, &format!("counted-b{i}"), 80, 200);
        }
        count_request(Direction::outbound, "counted-a", 80, 200);
        assert_eq!(exported("counted-a", 200), "4");
        assert_eq!(exported("counted-b0", 200), "1");
        assert_eq!(exported("counted-b39", 200), "1");
        let inbound = "aether_requests_total{direction=\"inbound\",service=\"counted-a\",port=\"80\",code=\"200\"} 1";
        assert!(crate::metrics::encode().lines().any(|l| l == inbound));
    }
}
