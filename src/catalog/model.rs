//! The catalog's model (SPEC section 4): services, their ports, endpoints and routes, as
//! validated types. Whatever source a catalog comes from (the file today, the control plane
//! next), it arrives as one of these, immutable; a new one replaces it whole.

use std::collections::{BTreeMap, BTreeSet, HashSet};
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

/// Upper bounds on durations from the catalog and the control plane (SPEC section 8: input is
/// validated before use). A connect that takes minutes is a dead endpoint; a request timeout
/// past the 1 h idle timers means none; an ejection past 1 h is a removal the catalog should
/// make. Bounded values also keep every deadline computation far from overflow.
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(5 * 60);
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(60 * 60);
pub const MAX_EJECTION_TIME: Duration = Duration::from_secs(60 * 60);

/// `Err(reason)` when `d` is over `max`.
pub fn at_most(d: Duration, max: Duration) -> Result<Duration, String> {
    if d > max {
        Err(format!(
            "{} is over the limit of {}",
            humantime::format_duration(d),
            humantime::format_duration(max)
        ))
    } else {
        Ok(d)
    }
}

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
    /// Relative share within its locality (at least 1).
    pub weight: u32,
    /// The control plane's priority (Envoy's semantics); `None`: the proxy's own zone/region
    /// ordering decides.
    pub priority: Option<u32>,
}

/// Outlier detection (Envoy's defaults unless the source says otherwise): consecutive 5xx or
/// connect failures before ejection, the base ejection time (times the number of ejections),
/// and the share of a cluster that may be ejected at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outlier {
    pub consecutive: u32,
    pub base_ejection: Duration,
    pub max_percent: u32,
}

impl Default for Outlier {
    fn default() -> Self {
        Outlier {
            consecutive: 5,
            base_ejection: Duration::from_secs(30),
            max_percent: 10,
        }
    }
}

/// Circuit breakers per cluster (Envoy's defaults): requests in flight (pending and active
/// together) and upstream connections. Past them: 503 `overflow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breakers {
    pub max_requests: u32,
    pub max_connections: u32,
}

impl Default for Breakers {
    fn default() -> Self {
        Breakers {
            max_requests: 1024,
            max_connections: 1024,
        }
    }
}

/// When a service was last routed to, per port, for sources that forget what is unused (the
/// control plane's on-demand clusters). Shared by the source across the catalogs it builds.
pub type Usage = BTreeMap<u16, Arc<std::sync::atomic::AtomicU64>>;

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
    pub outlier: Outlier,
    pub breakers: Breakers,
    pub endpoints: Vec<Endpoint>,
    /// The ports that exist: for the file, the union of every listed endpoint's ports,
    /// draining ones included.
    pub ports: BTreeSet<u16>,
    /// True when a port outside `ports` certainly does not exist (the file; a control plane
    /// that sent `aether.io.ports`). False: such a port may still be discovered.
    pub ports_complete: bool,
    /// Ports known not to exist (the control plane reported their cluster absent).
    pub absent_ports: BTreeSet<u16>,
    /// Ports in `ports` whose endpoint set is known (all of them for the file).
    pub loaded: BTreeSet<u16>,
    pub usage: Usage,
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

    /// Notes that `port` was routed to now (see `Usage`); one relaxed store at most per second.
    pub fn touch(&self, port: u16) {
        if let Some(at) = self.usage.get(&port) {
            let now = crate::catalog::model::clock_secs();
            if at.load(std::sync::atomic::Ordering::Relaxed) != now {
                at.store(now, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

/// Seconds on a process-wide monotonic clock (for `Usage`).
pub fn clock_secs() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs()
}

/// How a source that discovers on demand answers for names it does not hold yet.
#[derive(Debug, Clone, Default)]
pub struct OnDemand {
    /// How long a first request waits for the source to answer.
    pub timeout: Duration,
    /// Services known not to exist.
    pub absent: BTreeSet<String>,
}

/// One validated catalog. `version` is set by the store when the catalog is applied: it starts
/// at 1 and grows by one per applied catalog.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// Shared with the clusters built from it.
    pub services: BTreeMap<String, Arc<Service>>,
    pub version: u64,
    /// `None`: the catalog is complete (the file): a name it lacks does not exist. `Some`: a
    /// name it lacks may be asked for (`CatalogStore::want`).
    pub on_demand: Option<OnDemand>,
    /// The services' virtual addresses (SPEC section 10); set by the store on apply, so a
    /// source never computes them and DNS answers and capture agree on one snapshot.
    pub vips: Arc<super::vip::VirtualIps>,
}

impl Catalog {
    /// Every (endpoint, port, pinned identity) the catalog lists: what a pooled upstream
    /// connection must still match to stay useful.
    pub fn live_upstreams(&self) -> HashSet<(SocketAddr, u16, &SpiffeId)> {
        self.services.values().flat_map(|s| s.upstreams()).collect()
    }

    /// Upstreams of `older` that its changed services no longer list (another service may
    /// still): what pooled connections may have to leave. Services both share (the same
    /// `Arc`) are skipped, so an update that touches one service costs one service.
    pub fn upstreams_gone<'a>(&self, older: &'a Catalog) -> Vec<(SocketAddr, u16, &'a SpiffeId)> {
        let mut gone = Vec::new();
        for (name, old) in &older.services {
            let new = self.services.get(name);
            if new.is_some_and(|n| Arc::ptr_eq(n, old)) {
                continue;
            }
            let kept: HashSet<_> = new.map(|n| n.upstreams().collect()).unwrap_or_default();
            gone.extend(old.upstreams().filter(|u| !kept.contains(u)));
        }
        gone
    }
}

impl Service {
    /// (endpoint, port, pinned identity) for every port of every endpoint.
    pub fn upstreams(&self) -> impl Iterator<Item = (SocketAddr, u16, &SpiffeId)> + '_ {
        self.endpoints
            .iter()
            .flat_map(move |e| e.ports.iter().map(move |p| (e.address, *p, &self.identity)))
    }
}
