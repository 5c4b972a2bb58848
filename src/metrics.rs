//! Prometheus metrics (SPEC section 6). Label values come from the config and catalog only,
//! never from raw client input, so cardinality stays bounded.

use std::sync::OnceLock;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Direction {
    inbound,
    outbound,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub direction: Direction,
    pub service: String,
    pub port: u16,
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    pub direction: Direction,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    pub listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    pub listener: &'static str,
    pub result: &'static str,
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
pub struct RejectedLabels {
    pub listener: &'static str,
    /// `limit` (the listener's connection cap) or `handshake-evicted` (the oldest connection
    /// still in its TLS handshake, closed to admit a new one).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

pub struct Metrics {
    /// Subsystems add their own families at start (`register`).
    registry: std::sync::Mutex<Registry>,
    pub requests: Family<RequestLabels, Counter>,
    pub duration: Family<DirectionLabels, Histogram>,
    /// `duration`'s two series, resolved once: every request observes one, and the family's
    /// lookup (lock, SipHash of the labels) cost more than the observation.
    duration_by_direction: [Histogram; 2],
    pub connections_active: Family<ListenerLabels, Gauge>,
    pub tls_handshakes: Family<HandshakeLabels, Counter>,
    pub cut_offs: Family<CutOffLabels, Counter>,
    pub outlier_ejections: Family<ServicePortLabels, Counter>,
    pub catalog_reloads: Family<ResultLabels, Counter>,
    pub identity_reloads: Family<ResultLabels, Counter>,
    /// The process's resident set, set when scraped.
    pub resident_memory: Gauge,
    pub overflows: Family<OverflowLabels, Counter>,
    pub retries: Family<RetryLabels, Counter>,
    pub connections_rejected: Family<RejectedLabels, Counter>,
    /// Request headers dropped for an underscore in their name, per side.
    pub headers_dropped: Family<DirectionLabels, Counter>,
    /// Peer certificates refused for their SAN shape or identity, per listener.
    pub identity_refused: Family<ListenerLabels, Counter>,
    /// Access-log lines dropped because the buffer was full (stdout not keeping up).
    pub access_log_dropped: Counter,
    /// TLS sessions the client side keeps for resumption, across its client identities.
    pub tls_client_sessions: Gauge,
    /// Admin requests refused (`origin`, `body`).
    pub admin_refused: Family<ReasonLabels, Counter>,
    /// Seconds until the earliest certificate of each kind expires; set at scrape time.
    pub certificate_expiry: Family<CertLabels, Gauge>,
    /// Captured connections to destinations outside the mesh, by what `outbound.egress` did.
    pub egress: Family<EgressLabels, Counter>,
    /// Captured connections to a service's HTTP port whose first bytes were not HTTP (closed).
    pub captured_not_http: Counter,
    /// Requests the proxy answered itself, by direction and `x-aether-error` reason.
    pub errors: Family<ErrorLabels, Counter>,
    /// 1 while `/readyz` answers 200; set when scraped.
    pub ready: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub direction: Direction,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EgressLabels {
    /// `deny` or `passthrough` (`outbound.egress`).
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertLabels {
    /// `workload` or `trust`.
    pub cert: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

fn duration_histogram() -> Histogram {
    Histogram::new([
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let duration = Family::<DirectionLabels, Histogram>::new_with_constructor(
            duration_histogram as fn() -> Histogram,
        );
        let connections_active = Family::<ListenerLabels, Gauge>::default();
        let tls_handshakes = Family::<HandshakeLabels, Counter>::default();
        let cut_offs = Family::<CutOffLabels, Counter>::default();
        let outlier_ejections = Family::<ServicePortLabels, Counter>::default();
        let catalog_reloads = Family::<ResultLabels, Counter>::default();
        let identity_reloads = Family::<ResultLabels, Counter>::default();
        let overflows = Family::<OverflowLabels, Counter>::default();
        let retries = Family::<RetryLabels, Counter>::default();
        registry.register(
            "aether_retries",
            "Requests sent again (outbound: to another endpoint; inbound: to the app on a new connection), by why the attempt before failed",
            retries.clone(),
        );
        let connections_rejected = Family::<RejectedLabels, Counter>::default();
        registry.register(
            "aether_cluster_overflow",
            "Requests refused with 503 overflow, by the circuit breaker that was full",
            overflows.clone(),
        );
        registry.register(
            "aether_connections_rejected",
            "Downstream connections closed at accept: a listener cap, or overload",
            connections_rejected.clone(),
        );
        let headers_dropped = Family::<DirectionLabels, Counter>::default();
        let identity_refused = Family::<ListenerLabels, Counter>::default();
        let access_log_dropped = Counter::default();
        let tls_client_sessions = Gauge::default();
        let admin_refused = Family::<ReasonLabels, Counter>::default();
        let certificate_expiry = Family::<CertLabels, Gauge>::default();
        let resident_memory = Gauge::default();
        registry.register(
            "aether_process_resident_memory_bytes",
            "Resident memory of the proxy process (RSS), read when scraped",
            resident_memory.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "aether_errors",
            "Requests the proxy answered itself (x-aether-error), by direction and reason",
            errors.clone(),
        );
        let ready = Gauge::default();
        registry.register(
            "aether_ready",
            "1 while /readyz answers 200 (ready), else 0; read when scraped",
            ready.clone(),
        );
        registry.register(
            "aether_certificate_expiry_seconds",
            "Seconds until the earliest not-after of the workload chain or the trust bundle",
            certificate_expiry.clone(),
        );
        let egress = Family::<EgressLabels, Counter>::default();
        let captured_not_http = Counter::default();
        registry.register(
            "aether_egress",
            "Captured connections to destinations outside the mesh, by action",
            egress.clone(),
        );
        registry.register(
            "aether_captured_not_http",
            "Captured connections to a service's HTTP port closed because they did not speak HTTP",
            captured_not_http.clone(),
        );
        for action in ["deny", "passthrough"] {
            let _ = egress.get_or_create(&EgressLabels { action });
        }
        registry.register(
            "aether_request_headers_dropped",
            "Request headers dropped for an underscore in their name",
            headers_dropped.clone(),
        );
        registry.register(
            "aether_peer_identity_refused",
            "Peer certificates refused for their SAN shape or identity",
            identity_refused.clone(),
        );
        registry.register(
            "aether_access_log_dropped",
            "Access-log lines dropped because the output did not keep up",
            access_log_dropped.clone(),
        );
        registry.register(
            "aether_tls_client_sessions",
            "TLS sessions kept for resuming upstream connections",
            tls_client_sessions.clone(),
        );
        registry.register(
            "aether_admin_requests_refused",
            "Admin POST requests refused (an Origin header or a body)",
            admin_refused.clone(),
        );
        registry.register("aether_requests", "Requests handled", requests.clone());
        registry.register(
            "aether_request_duration_seconds",
            "Request duration until the response headers",
            duration.clone(),
        );
        registry.register(
            "aether_connections_active",
            "Open downstream connections",
            connections_active.clone(),
        );
        registry.register(
            "aether_tls_handshakes",
            "Completed TLS handshakes",
            tls_handshakes.clone(),
        );
        registry.register(
            "aether_http_protocol_errors",
            "Downstream connections and streams cut off by a limit or timer, by reason",
            cut_offs.clone(),
        );
        registry.register(
            "aether_outlier_ejections",
            "Endpoints ejected by outlier detection",
            outlier_ejections.clone(),
        );
        registry.register(
            "aether_catalog_reloads",
            "Catalog file reloads",
            catalog_reloads.clone(),
        );
        registry.register(
            "aether_identity_reloads",
            "Identity certificate reloads",
            identity_reloads.clone(),
        );
        // Pre-create the series operators alert on, so they read 0 rather than absent.
        for listener in ["inbound", "outbound"] {
            for result in ["ok", "error"] {
                let _ = tls_handshakes.get_or_create(&HandshakeLabels { listener, result });
            }
        }
        for listener in ["inbound", "outbound"] {
            for reason in CUT_OFF_REASONS {
                let _ = cut_offs.get_or_create(&CutOffLabels { listener, reason });
            }
        }
        for listener in ["inbound", "outbound"] {
            let _ = connections_active.get_or_create(&ListenerLabels { listener });
            let _ = connections_rejected.get_or_create(&RejectedLabels {
                listener,
                reason: "limit",
            });
        }
        let _ = connections_rejected.get_or_create(&RejectedLabels {
            listener: "inbound",
            reason: "handshake-evicted",
        });
        let duration_by_direction = [Direction::inbound, Direction::outbound].map(|direction| {
            let _ = headers_dropped.get_or_create(&DirectionLabels { direction });
            duration
                .get_or_create(&DirectionLabels { direction })
                .clone()
        });
        for listener in ["inbound", "outbound"] {
            let _ = identity_refused.get_or_create(&ListenerLabels { listener });
        }
        for reason in ["origin", "body"] {
            let _ = admin_refused.get_or_create(&ReasonLabels { reason });
        }
        for result in ["ok", "error"] {
            let _ = catalog_reloads.get_or_create(&ResultLabels { result });
            let _ = identity_reloads.get_or_create(&ResultLabels { result });
        }
        Metrics {
            registry: std::sync::Mutex::new(registry),
            requests,
            duration,
            duration_by_direction,
            connections_active,
            tls_handshakes,
            cut_offs,
            outlier_ejections,
            catalog_reloads,
            identity_reloads,
            overflows,
            retries,
            connections_rejected,
            headers_dropped,
            identity_refused,
            access_log_dropped,
            tls_client_sessions,
            admin_refused,
            egress,
            captured_not_http,
            certificate_expiry,
            resident_memory,
            errors,
            ready,
        }
    }

    /// `aether_request_duration_seconds` for `direction`.
    pub fn duration(&self, direction: Direction) -> &Histogram {
        &self.duration_by_direction[direction as usize]
    }

    pub fn overflow(&self, service: &str, port: u16, breaker: &'static str) {
        self.overflows
            .get_or_create(&OverflowLabels {
                service: service.to_string(),
                port,
                breaker,
            })
            .inc();
    }

    pub fn retry(&self, direction: Direction, service: &str, port: u16, reason: &'static str) {
        self.retries
            .get_or_create(&RetryLabels {
                direction,
                service: service.to_string(),
                port,
                reason,
            })
            .inc();
    }

    pub fn connection_rejected(&self, listener: &'static str, reason: &'static str) {
        self.connections_rejected
            .get_or_create(&RejectedLabels { listener, reason })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }

    pub fn identity_refused(&self, listener: &'static str) {
        self.identity_refused
            .get_or_create(&ListenerLabels { listener })
            .inc();
    }

    /// Counts a cut-off; `reason` is one of `CUT_OFF_REASONS`.
    pub fn cut_off(&self, listener: &'static str, reason: &'static str) {
        debug_assert!(CUT_OFF_REASONS.contains(&reason), "{reason}");
        self.cut_offs
            .get_or_create(&CutOffLabels { listener, reason })
            .inc();
    }

    pub fn handshake(&self, listener: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.tls_handshakes
            .get_or_create(&HandshakeLabels { listener, result })
            .inc();
    }
}

/// Adds a subsystem's families to the registry `/metrics` encodes. Each subsystem keeps its
/// own families beside the code that sets them (`dns::metrics`, `overload::metrics`,
/// `trace::metrics`), and `run` creates them at start so each is there from the first scrape.
pub fn register(add: impl FnOnce(&mut Registry)) {
    let mut registry = get().registry.lock().unwrap_or_else(|e| e.into_inner());
    add(&mut registry);
}

/// The process-wide metrics (one registry per process, as Prometheus expects).
pub fn get() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
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
        let counter = get()
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

/// Counts a connection as active until dropped.
pub struct ActiveConnection(&'static str);

impl ActiveConnection {
    pub fn new(listener: &'static str) -> ActiveConnection {
        get()
            .connections_active
            .get_or_create(&ListenerLabels { listener })
            .inc();
        ActiveConnection(listener)
    }
}

impl Drop for ActiveConnection {
    fn drop(&mut self) {
        get()
            .connections_active
            .get_or_create(&ListenerLabels { listener: self.0 })
            .dec();
    }
}

/// The classic Prometheus text format (0.0.4) of an OpenMetrics exposition, for scrapers that
/// did not ask for OpenMetrics (SPEC section 6). The sample lines are the same in both; what
/// differs: a counter family is named with its `_total` suffix in HELP and TYPE, `unknown` is
/// `untyped`, and there is no `# UNIT` or `# EOF`.
pub fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(if prefix == "# TYPE " && tail == "unknown" {
                    "untyped"
                } else {
                    tail
                });
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
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
        let text = m.encode();
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
            let text = get().encode();
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
        assert!(get().encode().lines().any(|l| l == inbound));
    }
}
