//! The catalog's model (SPEC section 4): services, their ports, endpoints and routes, as
//! validated types. Whatever source a catalog comes from (the file today, the control plane
//! next), it arrives as one of these, immutable; a new one replaces it whole.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;

use crate::config::Locality;
use crate::identity::SpiffeId;

/// The inbound port of every pod's proxy, used when an endpoint address carries no port.
pub const DEFAULT_INBOUND_PORT: u16 = 15008;
/// Per-service defaults (SPEC section 1, "Retries. Timeouts").
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

pub type Labels = BTreeMap<String, String>;

/// How the client proxy treats a port: HTTP (ALPN decides h1/h2) or a raw TCP tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PortProtocol {
    Tcp,
    Http,
}

/// A request header that must carry exactly this value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderMatch {
    pub header: HeaderName,
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedSubset {
    pub subset: Labels,
    pub weight: u32,
}

/// Where a matching route sends a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteTarget {
    Subset(Labels),
    /// Weights add up to more than zero.
    Split(Vec<WeightedSubset>),
}

/// One entry of a service's `routes` (first match wins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `None`: every request matches.
    pub matches: Option<HeaderMatch>,
    pub target: RouteTarget,
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

#[derive(Debug, Clone)]
pub struct Service {
    pub name: String,
    pub default_port: u16,
    /// The SPIFFE id pinned on every upstream connection to this service (part of every pool
    /// key).
    pub identity: SpiffeId,
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

/// One validated catalog. `version` is set by the store when the catalog is applied: it starts
/// at 1 and grows by one per applied catalog.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// Shared with the clusters built from it.
    pub services: BTreeMap<String, Arc<Service>>,
    pub version: u64,
}

impl Catalog {
    /// Every (endpoint, port, pinned identity) the catalog lists: what a pooled upstream
    /// connection must still match to stay useful.
    pub fn live_upstreams(&self) -> std::collections::HashSet<(SocketAddr, u16, &SpiffeId)> {
        self.services
            .values()
            .flat_map(|s| {
                s.endpoints
                    .iter()
                    .flat_map(move |e| e.ports.iter().map(move |p| (e.address, *p, &s.identity)))
            })
            .collect()
    }
}
