//! Prometheus metrics (SPEC section 6): the one registry `/metrics` encodes, and the label
//! types more than one subsystem uses. Label values come from the config and catalog only,
//! never from raw client input, so cardinality stays bounded.
//!
//! Each subsystem keeps its families beside the code that sets them and adds them here with
//! `register`: `accesslog::metrics` (requests, their duration, the proxy's own answers),
//! `http::metrics` (cut-offs, dropped headers), `identity::metrics` (TLS, certificates),
//! `outbound::metrics` (breakers, retries, outlier ejection, egress), `catalog::metrics`,
//! `memory::metrics`, `drain` (open and rejected connections), `admin`, and `dns`, `overload`,
//! `trace`, `xds`. `run` creates them all at start, so each is there from the first scrape.

use std::sync::{Mutex, OnceLock};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::registry::Registry;

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Direction {
    inbound,
    outbound,
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
pub struct ResultLabels {
    pub result: &'static str,
}

/// The process-wide registry (one per process, as Prometheus expects).
fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Adds a subsystem's families to the registry `/metrics` encodes.
pub fn register(add: impl FnOnce(&mut Registry)) {
    let mut registry = registry().lock().unwrap_or_else(|e| e.into_inner());
    add(&mut registry);
}

/// Every registered family, in the OpenMetrics text format.
pub fn encode() -> String {
    let mut out = String::new();
    let registry = registry().lock().unwrap_or_else(|e| e.into_inner());
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
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
