//! The file source (`catalog.path`, SPEC section 4): YAML in, a validated [`Catalog`] out, and a
//! watch that applies each good new file to the store. A bad file keeps the last good catalog.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::metrics;
use super::model::{
    Breakers, Catalog, Endpoint, HeaderMatch, Labels, Outlier, PortProtocol, Route, RouteTarget,
    Service, Usage, WeightedSubset, DEFAULT_CONNECT_TIMEOUT, DEFAULT_INBOUND_PORT,
    DEFAULT_REQUEST_TIMEOUT, MAX_CONNECT_TIMEOUT, MAX_REQUEST_TIMEOUT,
};
use super::store::CatalogStore;
use crate::config::{duration, Locality};
use crate::identity::SpiffeId;
use crate::metrics::ResultLabels;
use crate::validation::{from_yaml, read_file, FieldError, FieldErrors, Origin};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderMatch {
    header: String,
    value: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWeightedSubset {
    subset: Labels,
    weight: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    #[serde(default, rename = "match")]
    matches: Option<RawHeaderMatch>,
    #[serde(default)]
    subset: Option<Labels>,
    #[serde(default)]
    split: Vec<RawWeightedSubset>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEndpoint {
    address: String,
    #[serde(default)]
    ports: Option<Vec<u16>>,
    #[serde(default)]
    locality: Option<Locality>,
    #[serde(default)]
    labels: Labels,
    #[serde(default)]
    draining: bool,
    #[serde(default = "one")]
    weight: u32,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    default_port: u16,
    identity: SpiffeId,
    #[serde(default)]
    protocols: BTreeMap<u16, PortProtocol>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    connect_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    request_timeout: Option<Duration>,
    #[serde(default)]
    max_requests_per_connection: u32,
    /// Envoy's cluster circuit-breaker thresholds; Envoy's defaults when absent.
    #[serde(default)]
    circuit_breakers: Option<RawBreakers>,
    #[serde(default)]
    routes: Vec<RawRoute>,
    #[serde(default)]
    endpoints: Vec<RawEndpoint>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBreakers {
    #[serde(default = "default_breaker")]
    max_requests: u32,
    #[serde(default = "default_breaker")]
    max_connections: u32,
}

fn default_breaker() -> u32 {
    Breakers::default().max_requests
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCatalog {
    #[serde(default)]
    services: BTreeMap<String, RawService>,
}

impl Catalog {
    pub fn load(path: &Path, trust_domain: &str) -> Result<Catalog, FieldErrors> {
        Catalog::parse(path, &read_file(path)?, trust_domain)
    }

    /// Parses and validates catalog text; `file` names the origin in errors.
    pub fn parse(file: &Path, text: &str, trust_domain: &str) -> Result<Catalog, FieldErrors> {
        // An empty file is an empty catalog, not an error.
        let raw: RawCatalog = if text.trim().is_empty() {
            RawCatalog::default()
        } else {
            from_yaml(file, text)?
        };
        let origin = Origin::File(file.to_path_buf());
        let mut errs = Vec::new();
        let mut services = BTreeMap::new();
        for (name, raw) in raw.services {
            let mut err = |field: String, reason: String| {
                errs.push(FieldError::new(
                    &origin,
                    format!("services.{name}{field}"),
                    reason,
                ))
            };
            let svc = service(&name, raw, trust_domain, &mut err);
            services.insert(name, Arc::new(svc));
        }
        if errs.is_empty() {
            Ok(Catalog {
                services,
                version: 0,
                on_demand: None,
                vips: Default::default(),
            })
        } else {
            Err(FieldErrors(errs))
        }
    }
}

/// Validates one service; every problem goes to `err` (field path relative to the service).
fn service(
    name: &str,
    raw: RawService,
    trust_domain: &str,
    err: &mut impl FnMut(String, String),
) -> Service {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        err(String::new(), "service names are [a-z0-9-]+".into());
    }
    if raw.default_port == 0 {
        err(".default_port".into(), "port must be in 1..65535".into());
    }
    if let Err(reason) = raw.identity.check_trust_domain(trust_domain) {
        err(".identity".into(), reason.to_string());
    }
    for port in raw.protocols.keys() {
        if *port == 0 {
            err(".protocols".into(), "port must be in 1..65535".into());
        }
    }
    if let Some(b) = &raw.circuit_breakers {
        for (field, v) in [
            ("max_requests", b.max_requests),
            ("max_connections", b.max_connections),
        ] {
            if v == 0 {
                err(
                    format!(".circuit_breakers.{field}"),
                    "must be at least 1 (0 would refuse every request)".into(),
                );
            }
        }
    }
    let routes = raw
        .routes
        .into_iter()
        .enumerate()
        .filter_map(|(i, r)| route(i, r, err))
        .collect();
    let mut endpoints = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, e) in raw.endpoints.into_iter().enumerate() {
        let address = match parse_endpoint_address(&e.address) {
            Ok(a) => a,
            Err(reason) => {
                err(format!(".endpoints[{i}].address"), reason);
                continue;
            }
        };
        if !seen.insert(address) {
            err(
                format!(".endpoints[{i}].address"),
                format!("duplicate endpoint {address}"),
            );
        }
        let ports = e.ports.unwrap_or_else(|| vec![raw.default_port]);
        if ports.is_empty() {
            err(
                format!(".endpoints[{i}].ports"),
                "an endpoint serves at least one port".into(),
            );
        }
        let mut pseen = BTreeSet::new();
        for (j, p) in ports.iter().enumerate() {
            if *p == 0 {
                err(
                    format!(".endpoints[{i}].ports[{j}]"),
                    "port must be in 1..65535".into(),
                );
            } else if !pseen.insert(*p) {
                err(
                    format!(".endpoints[{i}].ports[{j}]"),
                    format!("duplicate port {p}"),
                );
            }
        }
        if e.weight == 0 {
            err(
                format!(".endpoints[{i}].weight"),
                "weight must be at least 1".into(),
            );
        }
        endpoints.push(Endpoint {
            address,
            ports,
            locality: e.locality,
            labels: e.labels,
            draining: e.draining,
            weight: e.weight,
            priority: None,
        });
    }
    // Weights are shares of one sum; it must fit the u32 the balancer and xDS use.
    if endpoints
        .iter()
        .try_fold(0u32, |t, e| t.checked_add(e.weight))
        .is_none()
    {
        err(
            ".endpoints".into(),
            format!("endpoint weights add up to more than {}", u32::MAX),
        );
    }
    for (field, d, max) in [
        (".connect_timeout", raw.connect_timeout, MAX_CONNECT_TIMEOUT),
        (".request_timeout", raw.request_timeout, MAX_REQUEST_TIMEOUT),
    ] {
        if let Some(Err(reason)) = d.map(|d| super::model::at_most(d, max)) {
            err(field.into(), reason);
        }
    }
    let ports: BTreeSet<u16> = endpoints
        .iter()
        .flat_map(|e| e.ports.iter().copied())
        .collect();
    Service {
        name: name.to_string(),
        default_port: raw.default_port,
        identity: raw.identity,
        protocols: raw.protocols,
        connect_timeout: raw.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT),
        request_timeout: raw.request_timeout.unwrap_or(DEFAULT_REQUEST_TIMEOUT),
        max_requests_per_connection: raw.max_requests_per_connection,
        routes,
        outlier: Outlier::default(),
        breakers: raw
            .circuit_breakers
            .map(|b| Breakers {
                max_requests: b.max_requests,
                max_connections: b.max_connections,
            })
            .unwrap_or_default(),
        endpoints,
        loaded: ports.clone(),
        ports,
        ports_complete: true,
        absent_ports: BTreeSet::new(),
        usage: Usage::new(),
    }
}

/// One `routes[i]` entry: exactly one of `subset` or `split`, a valid header name.
fn route(i: usize, r: RawRoute, err: &mut impl FnMut(String, String)) -> Option<Route> {
    let matches = match r.matches {
        None => None,
        Some(m) => match http::HeaderName::from_bytes(m.header.as_bytes()) {
            Ok(header) => Some(HeaderMatch {
                header,
                value: m.value,
            }),
            Err(_) => {
                err(
                    format!(".routes[{i}].match.header"),
                    "not a header name".into(),
                );
                return None;
            }
        },
    };
    let target = match (r.subset, r.split.is_empty()) {
        (Some(subset), true) => RouteTarget::Subset(subset),
        (None, false) if r.split.iter().all(|w| w.weight == 0) => {
            err(format!(".routes[{i}].split"), "weights add up to 0".into());
            return None;
        }
        (None, false)
            if r.split
                .iter()
                .try_fold(0u32, |t, w| t.checked_add(w.weight))
                .is_none() =>
        {
            err(
                format!(".routes[{i}].split"),
                format!("weights add up to more than {}", u32::MAX),
            );
            return None;
        }
        (None, false) => RouteTarget::Split(
            r.split
                .into_iter()
                .map(|w| WeightedSubset {
                    subset: w.subset,
                    weight: w.weight,
                })
                .collect(),
        ),
        _ => {
            err(
                format!(".routes[{i}]"),
                "a route has exactly one of `subset` or `split`".into(),
            );
            return None;
        }
    };
    Some(Route { matches, target })
}

/// A service's `routes` in the catalog's shape from any other source (the control plane's
/// `aether.io` metadata). Errors: (field path below `routes`, reason).
pub fn parse_routes(value: serde_json::Value) -> Result<Vec<Route>, (String, String)> {
    let raw: Vec<RawRoute> = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." {
            String::new()
        } else {
            format!(".{path}")
        };
        (path, e.into_inner().to_string())
    })?;
    let mut first = None;
    let routes = raw
        .into_iter()
        .enumerate()
        .filter_map(|(i, r)| {
            route(i, r, &mut |f: String, e: String| {
                first.get_or_insert((
                    f.replacen(&format!(".routes[{i}]"), &format!("[{i}]"), 1),
                    e,
                ));
            })
        })
        .collect();
    match first {
        Some(e) => Err(e),
        None => Ok(routes),
    }
}

/// `10.0.0.5` (port 15008) or `10.0.0.5:15009` or `[::1]:15008`.
fn parse_endpoint_address(s: &str) -> Result<SocketAddr, String> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, DEFAULT_INBOUND_PORT));
    }
    match s.parse::<SocketAddr>() {
        Ok(a) if a.port() != 0 => Ok(a),
        Ok(_) => Err("port must be in 1..65535".into()),
        Err(_) => Err(format!("{s:?} is not an IP address or IP:port")),
    }
}

/// Applies the file to `store` whenever it changes. A bad file keeps the last good catalog;
/// each distinct error is logged once.
pub fn watch(path: PathBuf, trust_domain: String, store: Arc<CatalogStore>) {
    let mut last_error: Option<String> = None;
    crate::watch::spawn("catalog", vec![path.clone()], move || {
        let reloads = &metrics::metrics().catalog_reloads;
        match Catalog::load(&path, &trust_domain) {
            Ok(next) => {
                store.apply(next);
                let _ = reloads.get_or_create(&ResultLabels { result: "ok" }).inc();
                last_error = None;
            }
            Err(e) => {
                let _ = reloads
                    .get_or_create(&ResultLabels { result: "error" })
                    .inc();
                let msg = e.to_string();
                if last_error.as_deref() != Some(msg.as_str()) {
                    tracing::error!("catalog reload failed; keeping the last good catalog: {msg}");
                    last_error = Some(msg);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(yaml: &str) -> Vec<String> {
        match Catalog::parse(Path::new("cat.yaml"), yaml, "aether.local") {
            Ok(_) => vec![],
            Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
        }
    }

    const SVC: &str = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n";

    #[test]
    fn the_spec_example_parses() {
        let yaml = format!(
            "{SVC}    protocols: {{ 5432: tcp }}\n    connect_timeout: 2s\n    request_timeout: 250ms\n    max_requests_per_connection: 1\n\
             \x20   routes:\n      - match: {{ header: x-canary, value: \"1\" }}\n        subset: {{ version: v2 }}\n\
             \x20     - split:\n          - {{ subset: {{ version: v1 }}, weight: 90 }}\n          - {{ subset: {{ version: v2 }}, weight: 10 }}\n\
             \x20   endpoints:\n      - address: 10.0.0.5\n        ports: [8080, 9090]\n        locality: us-east1/us-east1-b\n        labels: {{ version: v2 }}\n        draining: false\n\
             \x20     - {{ address: \"10.0.0.6:15009\" }}\n"
        );
        let c = Catalog::parse(Path::new("cat.yaml"), &yaml, "aether.local").unwrap();
        let s = &c.services["payments"];
        assert_eq!(s.port_protocol(5432), PortProtocol::Tcp);
        assert_eq!(s.port_protocol(8080), PortProtocol::Http);
        assert_eq!(s.connect_timeout, Duration::from_secs(2));
        assert_eq!(s.request_timeout, Duration::from_millis(250));
        assert_eq!(s.endpoints[0].address.to_string(), "10.0.0.5:15008");
        assert_eq!(s.endpoints[1].address.to_string(), "10.0.0.6:15009");
        // Omitted ports mean the default port; the union is what exists.
        assert_eq!(s.endpoints[1].ports, vec![8080]);
        assert_eq!(
            s.ports.iter().copied().collect::<Vec<_>>(),
            vec![8080, 9090]
        );
        assert!(Catalog::parse(Path::new("cat.yaml"), "", "aether.local")
            .unwrap()
            .services
            .is_empty());
    }

    #[test]
    fn bad_catalogs_name_the_field() {
        let e = errors(&format!("{SVC}    endpoints: [{{ address: not-an-ip }}]\n"));
        assert_eq!(e.len(), 1);
        assert!(
            e[0].starts_with("cat.yaml: services.payments.endpoints[0].address: "),
            "{e:?}"
        );
        let e = errors(&format!(
            "{SVC}    endpoints: [{{ address: 10.0.0.1, ports: [8080, 0, 8080] }}]\n"
        ));
        assert!(
            e.iter().any(|e| e
                == "cat.yaml: services.payments.endpoints[0].ports[1]: port must be in 1..65535"),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|e| e
                    == "cat.yaml: services.payments.endpoints[0].ports[2]: duplicate port 8080"),
            "{e:?}"
        );
        let e = errors("services:\n  payments:\n    default_port: 8080\n    identity: spiffe://other/ns/a/sa/b\n");
        assert!(
            e[0].starts_with("cat.yaml: services.payments.identity: ")
                && e[0].contains("outside the trust domain"),
            "{e:?}"
        );
        let e = errors(&format!("{SVC}    colour: blue\n"));
        assert!(e[0].contains("unknown field `colour`"), "{e:?}");
        let e = errors(&format!("{SVC}    request_timeout: soon\n"));
        assert!(
            e[0].contains("request_timeout") && e[0].contains("not a duration"),
            "{e:?}"
        );
        let e = errors(&format!(
            "{SVC}    routes: [{{ match: {{ header: x, value: y }} }}]\n"
        ));
        assert!(
            e[0].starts_with("cat.yaml: services.payments.routes[0]: "),
            "{e:?}"
        );
        let e = errors(&format!("{SVC}    protocols: {{ 5432: udp }}\n"));
        assert!(e[0].contains("unknown variant `udp`"), "{e:?}");
        let e = errors("services:\n  Pay_ments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n");
        assert!(e[0].starts_with("cat.yaml: services.Pay_ments: "), "{e:?}");
        let e = errors("services: [\n");
        assert!(e[0].starts_with("cat.yaml: "), "{e:?}");
    }

    #[test]
    fn endpoint_weights_default_to_one_and_zero_is_refused() {
        let c = Catalog::parse(
            Path::new("cat.yaml"),
            &format!("{SVC}    endpoints: [{{ address: 10.0.0.1 }}, {{ address: 10.0.0.2, weight: 7 }}]\n"),
            "aether.local",
        )
        .unwrap();
        let w: Vec<u32> = c.services["payments"]
            .endpoints
            .iter()
            .map(|e| e.weight)
            .collect();
        assert_eq!(w, vec![1, 7]);
        let e = errors(&format!(
            "{SVC}    endpoints: [{{ address: 10.0.0.1, weight: 0 }}]\n"
        ));
        assert_eq!(
            e,
            vec!["cat.yaml: services.payments.endpoints[0].weight: weight must be at least 1"]
        );
    }
}
