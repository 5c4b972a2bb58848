//! The service catalog (`catalog.path`, SPEC section 4): what the control plane knows about
//! services and their pods. A parsed catalog is immutable; reloads swap a whole new one in.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{
    check_spiffe_id, duration, from_yaml, read_file, FileError, FileErrors, Locality,
};

/// The inbound port of every pod's proxy, used when an endpoint address carries no port.
pub const DEFAULT_INBOUND_PORT: u16 = 15008;

pub type Labels = BTreeMap<String, String>;

/// How the client proxy treats a port: HTTP (ALPN decides h1/h2) or a raw TCP tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PortProtocol {
    Tcp,
    Http,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    pub header: String,
    pub value: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedSubset {
    pub subset: Labels,
    pub weight: u32,
}

/// One entry of a service's `routes`: either a header match or a weighted split.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    #[serde(default, rename = "match")]
    pub matches: Option<HeaderMatch>,
    #[serde(default)]
    pub subset: Option<Labels>,
    #[serde(default)]
    pub split: Vec<WeightedSubset>,
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
}

#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    /// Where the pod's proxy listens (`<address>:15008` unless the catalog names a port).
    pub address: SocketAddr,
    /// App ports this pod serves; never empty.
    pub ports: Vec<u16>,
    pub locality: Option<Locality>,
    pub labels: Labels,
    pub draining: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    default_port: u16,
    identity: String,
    #[serde(default)]
    protocols: BTreeMap<u16, PortProtocol>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    connect_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    request_timeout: Option<Duration>,
    #[serde(default)]
    max_requests_per_connection: u32,
    #[serde(default)]
    routes: Vec<Route>,
    #[serde(default)]
    endpoints: Vec<RawEndpoint>,
}

#[derive(Debug, Clone)]
pub struct Service {
    pub name: String,
    pub default_port: u16,
    /// The SPIFFE id pinned on every upstream connection to this service (shared, as it is
    /// part of every pool key).
    pub identity: Arc<str>,
    pub protocols: BTreeMap<u16, PortProtocol>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// 0 = unlimited.
    pub max_requests_per_connection: u32,
    pub routes: Vec<Route>,
    pub endpoints: Vec<Endpoint>,
    /// Union of every listed endpoint's ports, draining ones included: the ports that exist.
    pub ports: BTreeSet<u16>,
}

impl Service {
    pub fn port_protocol(&self, port: u16) -> PortProtocol {
        self.protocols
            .get(&port)
            .copied()
            .unwrap_or(PortProtocol::Http)
    }

    pub fn exposes(&self, port: u16) -> bool {
        self.ports.contains(&port)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCatalog {
    #[serde(default)]
    services: BTreeMap<String, RawService>,
}

#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// Shared with the clusters built from it.
    pub services: BTreeMap<String, Arc<Service>>,
}

impl Catalog {
    pub fn load(path: &Path, trust_domain: &str) -> Result<Catalog, FileErrors> {
        Catalog::parse(path, &read_file(path)?, trust_domain)
    }

    pub fn parse(file: &Path, text: &str, trust_domain: &str) -> Result<Catalog, FileErrors> {
        // An empty file is an empty catalog, not an error.
        let raw: RawCatalog = if text.trim().is_empty() {
            RawCatalog {
                services: BTreeMap::new(),
            }
        } else {
            from_yaml(file, text).map_err(|e| FileErrors(vec![e]))?
        };
        let mut errs = Vec::new();
        let mut services = BTreeMap::new();
        for (name, raw) in raw.services {
            let mut err = |field: String, reason: String| {
                errs.push(FileError {
                    file: file.to_path_buf(),
                    field: format!("services.{name}{field}"),
                    reason,
                })
            };
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
            if let Err(reason) = check_spiffe_id(&raw.identity, trust_domain) {
                err(".identity".into(), reason);
            }
            for port in raw.protocols.keys() {
                if *port == 0 {
                    err(".protocols".into(), "port must be in 1..65535".into());
                }
            }
            for (i, r) in raw.routes.iter().enumerate() {
                let has_subset = r.subset.is_some();
                let has_split = !r.split.is_empty();
                if has_subset == has_split {
                    err(
                        format!(".routes[{i}]"),
                        "a route has exactly one of `subset` or `split`".into(),
                    );
                }
                if has_split && r.matches.is_some() {
                    // A match with a split is allowed; nothing to check.
                }
                if has_split && r.split.iter().all(|w| w.weight == 0) {
                    err(format!(".routes[{i}].split"), "weights add up to 0".into());
                }
                if let Some(m) = &r.matches {
                    if http::HeaderName::from_bytes(m.header.as_bytes()).is_err() {
                        err(
                            format!(".routes[{i}].match.header"),
                            "not a header name".into(),
                        );
                    }
                }
            }
            let mut endpoints = Vec::new();
            let mut seen = BTreeSet::new();
            for (i, e) in raw.endpoints.iter().enumerate() {
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
                let ports = e.ports.clone().unwrap_or_else(|| vec![raw.default_port]);
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
                endpoints.push(Endpoint {
                    address,
                    ports,
                    locality: e.locality.clone(),
                    labels: e.labels.clone(),
                    draining: e.draining,
                });
            }
            let ports = endpoints
                .iter()
                .flat_map(|e| e.ports.iter().copied())
                .collect();
            services.insert(
                name.clone(),
                Arc::new(Service {
                    name,
                    default_port: raw.default_port,
                    identity: raw.identity.into(),
                    protocols: raw.protocols,
                    connect_timeout: raw.connect_timeout.unwrap_or(Duration::from_secs(5)),
                    request_timeout: raw.request_timeout.unwrap_or(Duration::from_secs(15)),
                    max_requests_per_connection: raw.max_requests_per_connection,
                    routes: raw.routes,
                    endpoints,
                    ports,
                }),
            );
        }
        if errs.is_empty() {
            Ok(Catalog { services })
        } else {
            Err(FileErrors(errs))
        }
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

/// The current catalog, swapped whole on reload (a request sees the old or the new one).
pub struct CatalogStore {
    current: arc_swap::ArcSwap<Catalog>,
    version: std::sync::atomic::AtomicU64,
}

impl CatalogStore {
    pub fn new(catalog: Catalog) -> CatalogStore {
        CatalogStore {
            current: arc_swap::ArcSwap::from_pointee(catalog),
            version: std::sync::atomic::AtomicU64::new(1),
        }
    }

    pub fn load(&self) -> arc_swap::Guard<Arc<Catalog>> {
        self.current.load()
    }

    pub fn store(&self, catalog: Catalog) {
        self.current.store(Arc::new(catalog));
        self.version
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Starts at 1 and grows by one per successful reload.
    pub fn version(&self) -> u64 {
        self.version.load(std::sync::atomic::Ordering::SeqCst)
    }
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
}
