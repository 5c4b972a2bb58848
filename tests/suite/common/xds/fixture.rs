//! The control plane's input: a catalog-shaped description of the mesh (services, their ports
//! and pods) plus the workload secrets, written the way `tests/common/mesh` writes catalogs.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use crate::common::Certs;

/// What the control plane knows. `set` it on a [`super::ControlPlane`] to push the change.
#[derive(Debug, Clone, PartialEq)]
pub struct Fixture {
    /// Default `aether.internal`.
    pub mesh_domain: String,
    /// Service name (the first DNS label) -> service.
    pub services: BTreeMap<String, Service>,
    /// Secret name (`default`, `ROOTCA`) -> secret; served over SDS and delta ADS alike.
    pub secrets: BTreeMap<String, SecretSpec>,
    /// Whether a subscription to `svc.<domain>:<default port>` is answered with the default
    /// Cluster under that name (the design record's ODCDS resolver canonicalizing a cold
    /// explicit-default authority for Envoy, whose on-demand discovery asks for the authority
    /// as written). Default false: aether-proxy never asks for that name, and without this the
    /// name does not exist.
    pub default_port_aliases: bool,
}

impl Default for Fixture {
    fn default() -> Fixture {
        Fixture {
            mesh_domain: "aether.internal".into(),
            services: BTreeMap::new(),
            secrets: BTreeMap::new(),
            default_port_aliases: false,
        }
    }
}

impl Fixture {
    pub fn new() -> Fixture {
        Fixture::default()
    }
    /// Adds (or replaces) service `name`.
    pub fn service(mut self, name: &str, svc: Service) -> Fixture {
        self.services.insert(name.to_string(), svc);
        self
    }
    /// Answers `svc:<default port>` too (see [`Fixture::default_port_aliases`]).
    pub fn with_default_port_aliases(mut self) -> Fixture {
        self.default_port_aliases = true;
        self
    }
    /// The secrets of workload `stem` from `certs`: `default` (its chain and key) and `ROOTCA`
    /// (the CA), read from the files now.
    pub fn identity(mut self, certs: &Certs, stem: &str) -> Fixture {
        self.set_identity(certs, stem);
        self
    }
    pub fn set_identity(&mut self, certs: &Certs, stem: &str) {
        let read = |p: std::path::PathBuf| {
            std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
        };
        self.secrets.insert(
            "default".into(),
            SecretSpec::Certificate {
                chain_pem: read(certs.cert(stem)),
                key_pem: read(certs.key(stem)),
            },
        );
        self.secrets.insert(
            "ROOTCA".into(),
            SecretSpec::TrustedCa {
                pem: read(certs.ca()),
            },
        );
    }
    /// The service `name`, for edits in place.
    pub fn svc(&mut self, name: &str) -> &mut Service {
        self.services
            .get_mut(name)
            .unwrap_or_else(|| panic!("the fixture has no service {name}"))
    }
    /// `<name>.<mesh_domain>`.
    pub fn host(&self, name: &str) -> String {
        format!("{name}.{}", self.mesh_domain)
    }
}

/// A secret, as SDS carries it (inline bytes).
#[derive(Debug, Clone, PartialEq)]
pub enum SecretSpec {
    /// `tls_certificate`: certificate chain (leaf first) and private key, PEM.
    Certificate {
        chain_pem: Vec<u8>,
        key_pem: Vec<u8>,
    },
    /// `validation_context.trusted_ca`, PEM.
    TrustedCa { pem: Vec<u8> },
}

/// One service, in the catalog's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    pub default_port: u16,
    /// The SPIFFE id pinned by the Cluster's URI SAN matcher.
    pub identity: String,
    /// Ports whose protocol is `tcp` (`metadata["aether.io"].protocol` on their Cluster).
    pub tcp_ports: Vec<u16>,
    /// `Cluster.connect_timeout`; default 5 s.
    pub connect_timeout: Duration,
    /// `metadata["aether.io"].request_timeout` when set.
    pub request_timeout: Option<Duration>,
    /// `HttpProtocolOptions.common_http_protocol_options.max_requests_per_connection`.
    pub max_requests_per_connection: Option<u32>,
    pub outlier_detection: Option<Outlier>,
    pub circuit_breakers: Option<Breakers>,
    /// `metadata["aether.io"].routes`: the catalog's `routes` list, as JSON.
    pub routes: Option<serde_json::Value>,
    /// Whether the default Cluster carries `metadata["aether.io"].ports` (the union of the
    /// advertised ports). Default true.
    pub ports_metadata: bool,
    pub endpoints: Vec<Endpoint>,
}

impl Service {
    /// Default port 8080, pinned to `identity`, no endpoints.
    pub fn new(identity: &str) -> Service {
        Service {
            default_port: 8080,
            identity: identity.to_string(),
            tcp_ports: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: None,
            max_requests_per_connection: None,
            outlier_detection: None,
            circuit_breakers: None,
            routes: None,
            ports_metadata: true,
            endpoints: Vec::new(),
        }
    }
    pub fn tcp(mut self, port: u16) -> Service {
        self.tcp_ports.push(port);
        self
    }
    pub fn request_timeout(mut self, d: Duration) -> Service {
        self.request_timeout = Some(d);
        self
    }
    pub fn max_requests_per_connection(mut self, n: u32) -> Service {
        self.max_requests_per_connection = Some(n);
        self
    }
    pub fn routes(mut self, routes: serde_json::Value) -> Service {
        self.routes = Some(routes);
        self
    }
    /// Leaves `metadata["aether.io"].ports` out of the default Cluster.
    pub fn without_ports_metadata(mut self) -> Service {
        self.ports_metadata = false;
        self
    }
    pub fn endpoint(mut self, e: Endpoint) -> Service {
        self.endpoints.push(e);
        self
    }
    /// The union of the ports the endpoints advertise (draining ones included).
    pub fn advertised_ports(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = self
            .endpoints
            .iter()
            .flat_map(|e| e.ports_or(self.default_port))
            .collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }
    /// Removes the endpoints at `addr`.
    pub fn remove_endpoint(&mut self, addr: IpAddr) {
        self.endpoints.retain(|e| e.address != addr);
    }
    /// The endpoint at `addr`, for edits in place.
    pub fn endpoint_mut(&mut self, addr: IpAddr) -> &mut Endpoint {
        self.endpoints
            .iter_mut()
            .find(|e| e.address == addr)
            .unwrap_or_else(|| panic!("no endpoint at {addr}"))
    }
}

/// `outlier_detection` (Envoy's field names).
#[derive(Debug, Clone, PartialEq)]
pub struct Outlier {
    pub consecutive_5xx: u32,
    pub base_ejection_time: Duration,
    pub max_ejection_percent: u32,
}

/// `circuit_breakers.thresholds[0]` (priority DEFAULT).
#[derive(Debug, Clone, PartialEq)]
pub struct Breakers {
    pub max_connections: u32,
    pub max_pending_requests: u32,
    pub max_requests: u32,
}

/// One pod of a service: its proxy's address (port 15008) and what it advertises.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    pub address: IpAddr,
    pub port: u16,
    /// Empty = `[default_port]`, as in the catalog.
    pub ports: Vec<u16>,
    /// `region/zone[/sub_zone]`.
    pub locality: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub draining: bool,
    pub weight: Option<u32>,
}

impl Endpoint {
    /// The pod proxy at `address:15008` advertising `ports`.
    pub fn new(address: IpAddr, ports: &[u16]) -> Endpoint {
        Endpoint {
            address,
            port: 15008,
            ports: ports.to_vec(),
            locality: None,
            labels: BTreeMap::new(),
            draining: false,
            weight: None,
        }
    }
    pub fn draining(mut self) -> Endpoint {
        self.draining = true;
        self
    }
    pub fn label(mut self, k: &str, v: &str) -> Endpoint {
        self.labels.insert(k.into(), v.into());
        self
    }
    pub fn locality(mut self, l: &str) -> Endpoint {
        self.locality = Some(l.into());
        self
    }
    pub fn weight(mut self, w: u32) -> Endpoint {
        self.weight = Some(w);
        self
    }
    pub fn ports_or(&self, default_port: u16) -> Vec<u16> {
        if self.ports.is_empty() {
            vec![default_port]
        } else {
            self.ports.clone()
        }
    }
}
