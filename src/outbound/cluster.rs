//! Clusters: one per (service, port), materialized on first use from the current catalog. They
//! follow the catalog store by version: the first look after a new catalog rebuilds every
//! materialized cluster from it (endpoint counters carried over), so nothing has to tell them.
//! A cluster holds the endpoints that advertise its port; draining ones are kept (for
//! `/clusters` and in-flight work) but never picked.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;
use foldhash::fast::RandomState;

use super::metrics;
use super::route::cluster_name;
use crate::catalog::{Catalog, CatalogStore, Endpoint, Labels, Service};
use crate::config::Locality;

/// Counters that outlive catalog reloads: a rebuilt cluster shares them with its predecessor,
/// so requests in flight across a reload still count, and outlier history is kept.
#[derive(Default)]
pub struct EndpointStats {
    /// Requests in flight (least-outstanding-requests balancing).
    pub active: AtomicU32,
    consecutive_failures: AtomicU32,
    ejections: AtomicU32,
    /// Milliseconds since the clusters' epoch until which the endpoint is ejected.
    ejected_until_ms: AtomicU64,
}

/// One endpoint inside one cluster.
pub struct EndpointState {
    pub address: SocketAddr,
    pub locality: Option<Locality>,
    pub labels: Labels,
    pub draining: bool,
    pub weight: u32,
    pub priority: Option<u32>,
    pub stats: Arc<EndpointStats>,
}

impl EndpointState {
    fn new(e: &Endpoint, stats: Arc<EndpointStats>) -> EndpointState {
        EndpointState {
            address: e.address,
            locality: e.locality.clone(),
            labels: e.labels.clone(),
            draining: e.draining,
            weight: e.weight.max(1),
            priority: e.priority,
            stats,
        }
    }

    pub fn active(&self) -> u32 {
        self.stats.active.load(Ordering::Relaxed)
    }

    pub fn is_ejected(&self, now_ms: u64) -> bool {
        self.stats.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }
}

/// Holds an endpoint's in-flight count for the life of a request.
pub struct ActiveGuard(pub Arc<EndpointState>);

impl ActiveGuard {
    pub fn new(e: Arc<EndpointState>) -> ActiveGuard {
        e.stats.active.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(e)
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.stats.active.fetch_sub(1, Ordering::Relaxed);
    }
}

pub struct Cluster {
    /// Canonical authority: `svc.<mesh>` for the default port, `svc.<mesh>:<port>` otherwise.
    pub name: String,
    pub service: Arc<Service>,
    /// The service's name as metrics and the access log take it, made once per cluster.
    pub service_label: Arc<str>,
    pub port: u16,
    /// Every listed endpoint that advertises the port, draining ones included.
    pub endpoints: Vec<Arc<EndpointState>>,
    /// The control plane gave priorities: they order endpoints instead of locality.
    pub by_priority: bool,
    /// Requests in flight on this cluster (the request circuit breaker); shared with the
    /// cluster's predecessors and successors across catalog changes.
    requests: Arc<AtomicU32>,
    /// Upstream connections open for this cluster (the connection circuit breaker), shared
    /// the same way.
    connections: Arc<AtomicU32>,
    /// Where outlier time is measured from.
    epoch: Instant,
}

/// A request's place under its cluster's circuit breaker, released when dropped.
pub struct Admitted(Arc<AtomicU32>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One upstream connection's place under its cluster's connection breaker, released when the
/// connection closes (the connection's task holds it).
pub struct ConnSlot(Arc<AtomicU32>);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Cluster {
    /// A place for one more upstream connection, or `None` when the breaker is full.
    pub fn connection_slot(&self) -> Option<ConnSlot> {
        let max = self.service.breakers.max_connections;
        let prev = self.connections.fetch_add(1, Ordering::Relaxed);
        let slot = ConnSlot(self.connections.clone());
        if prev < max {
            return Some(slot);
        }
        metrics::overflow(&self.service.name, self.port, "connections");
        None
    }

    /// A place for one more request, or `None` when the breaker is full (503 `overflow`).
    pub fn admit(&self) -> Option<Admitted> {
        let max = self.service.breakers.max_requests;
        let prev = self.requests.fetch_add(1, Ordering::Relaxed);
        let admitted = Admitted(self.requests.clone());
        if prev < max {
            return Some(admitted);
        }
        metrics::overflow(&self.service.name, self.port, "requests");
        None
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Records a request's outcome for outlier detection: 5xx and connect failures count.
    pub fn record(&self, e: &EndpointState, failed: bool) {
        let st = &e.stats;
        if !failed {
            st.consecutive_failures.store(0, Ordering::Relaxed);
            return;
        }
        let outlier = &self.service.outlier;
        let n = st.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n < outlier.consecutive {
            return;
        }
        let now = self.now_ms();
        if e.is_ejected(now) {
            return;
        }
        let ejected = self.endpoints.iter().filter(|x| x.is_ejected(now)).count();
        let max = (self.endpoints.len() * outlier.max_percent as usize / 100).max(1);
        if ejected >= max {
            return;
        }
        let times = st.ejections.fetch_add(1, Ordering::Relaxed) + 1;
        let until = now + (outlier.base_ejection.as_millis() as u64) * times as u64;
        st.ejected_until_ms.store(until, Ordering::Relaxed);
        st.consecutive_failures.store(0, Ordering::Relaxed);
        tracing::warn!(cluster = %self.name, endpoint = %e.address, times, "outlier: endpoint ejected");
        metrics::metrics()
            .outlier_ejections
            .get_or_create(&metrics::ServicePortLabels {
                service: self.service.name.clone(),
                port: self.port,
            })
            .inc();
    }

    /// The cluster as `/clusters` and `/config_dump` show it (keys in sorted order).
    pub fn json(&self) -> ClusterJson<'_> {
        ClusterJson(self)
    }
}

/// A cluster's admin JSON, serialized straight into the response. Built as a
/// `serde_json::Value` first, the tree of a few thousand clusters' endpoints takes many times
/// the text it becomes, and that peak stays resident after the answer is sent.
pub struct ClusterJson<'a>(&'a Cluster);

impl serde::Serialize for ClusterJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let c = self.0;
        let now = c.now_ms();
        let mut m = s.serialize_struct("Cluster", 4)?;
        m.serialize_field("endpoints", &Endpoints(&c.endpoints, now))?;
        m.serialize_field("name", &c.name)?;
        m.serialize_field("port", &c.port)?;
        m.serialize_field("service", &c.service.name)?;
        m.end()
    }
}

struct Endpoints<'a>(&'a [Arc<EndpointState>], u64);

impl serde::Serialize for Endpoints<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|e| EndpointJson(e, self.1)))
    }
}

struct EndpointJson<'a>(&'a EndpointState, u64);

impl serde::Serialize for EndpointJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let e = self.0;
        let mut m = s.serialize_struct("Endpoint", 6)?;
        m.serialize_field("active_requests", &e.active())?;
        m.serialize_field("address", &e.address)?;
        m.serialize_field("draining", &e.draining)?;
        m.serialize_field("ejected", &e.is_ejected(self.1))?;
        m.serialize_field("labels", &e.labels)?;
        m.serialize_field("locality", &LocalityText(e.locality.as_ref()))?;
        m.end()
    }
}

/// An endpoint's locality as text, empty when it has none.
struct LocalityText<'a>(Option<&'a Locality>);

impl serde::Serialize for LocalityText<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Some(l) => s.collect_str(l),
            None => s.serialize_str(""),
        }
    }
}

/// Materialized clusters by service, then port, built from catalog `version`. Shared parts
/// (`Arc`) keep the copy each new cluster or catalog makes cheap with thousands of services.
#[derive(Default, Clone)]
struct ClusterMap {
    version: u64,
    by_service: HashMap<Arc<str>, Arc<PortClusters>, RandomState>,
}

type PortClusters = HashMap<u16, Arc<Cluster>, RandomState>;

impl ClusterMap {
    fn lookup(&self, service: &str, port: u16) -> Option<Arc<Cluster>> {
        self.by_service
            .get(service)
            .and_then(|ports| ports.get(&port))
            .cloned()
    }
}

/// The materialized clusters, read lock-free on the hot path.
pub struct Clusters {
    mesh_domain: String,
    catalog: Arc<CatalogStore>,
    map: ArcSwap<ClusterMap>,
    /// Serializes builds so concurrent first requests build one cluster.
    build: Mutex<()>,
    epoch: Instant,
}

impl Clusters {
    pub fn new(mesh_domain: &str, catalog: Arc<CatalogStore>) -> Clusters {
        Clusters {
            mesh_domain: mesh_domain.to_string(),
            catalog,
            map: ArcSwap::from_pointee(ClusterMap::default()),
            build: Mutex::new(()),
            epoch: Instant::now(),
        }
    }

    /// The cluster for `service`/`port`, for a request routed on `routed` (the caller already
    /// checked the port is exposed there). Clusters are never older than the request's catalog:
    /// a newer catalog rebuilds them first. Builds happen under the build lock, so concurrent
    /// first requests build one cluster and a build never leaves a cluster of an old catalog.
    pub fn get(&self, routed: &Catalog, service: &str, port: u16) -> Option<Arc<Cluster>> {
        let map = self.map.load();
        if map.version >= routed.version {
            if let Some(c) = map.lookup(service, port) {
                return Some(c);
            }
        }
        drop(map);
        let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
        let catalog = self.catalog.load();
        let current = self.refreshed(&catalog);
        if let Some(c) = current.lookup(service, port) {
            return Some(c);
        }
        let svc = catalog.services.get(service).filter(|s| s.exposes(port))?;
        let cluster = Arc::new(self.build_cluster(svc.clone(), port, None));
        tracing::info!(cluster = %cluster.name, endpoints = cluster.endpoints.len(), "cluster materialized");
        let mut next = (*current).clone();
        let ports = next.by_service.entry(Arc::from(service)).or_default();
        Arc::make_mut(ports).insert(port, cluster.clone());
        self.map.store(Arc::new(next));
        Some(cluster)
    }

    fn build_cluster(&self, svc: Arc<Service>, port: u16, old: Option<&Cluster>) -> Cluster {
        let endpoints = svc
            .endpoints
            .iter()
            .filter(|e| e.ports.contains(&port))
            .map(|e| {
                let stats = old
                    .and_then(|o| o.endpoints.iter().find(|x| x.address == e.address))
                    .map(|p| p.stats.clone())
                    .unwrap_or_default();
                Arc::new(EndpointState::new(e, stats))
            })
            .collect::<Vec<_>>();
        Cluster {
            name: cluster_name(&svc.name, &self.mesh_domain, port, svc.default_port),
            by_priority: endpoints.iter().any(|e| e.priority.unwrap_or(0) != 0),
            service_label: svc.name.as_str().into(),
            service: svc,
            port,
            endpoints,
            requests: old.map(|o| o.requests.clone()).unwrap_or_default(),
            connections: old.map(|o| o.connections.clone()).unwrap_or_default(),
            epoch: self.epoch,
        }
    }

    /// The map for `catalog`, rebuilt first (and stored) when it was built from an older one.
    /// Clusters whose service or port is gone are dropped; endpoint state (outlier history,
    /// in-flight counts) carries over; clusters of services the catalog did not change are kept.
    /// Called with the build lock held.
    fn refreshed(&self, catalog: &Catalog) -> Arc<ClusterMap> {
        let current = self.map.load_full();
        if current.version >= catalog.version {
            return current;
        }
        let mut next = ClusterMap {
            version: catalog.version,
            by_service: HashMap::default(),
        };
        for (service, ports) in current.by_service.iter() {
            let Some(svc) = catalog.services.get(&**service) else {
                continue;
            };
            // A service the new catalog shares unchanged keeps its clusters as they are.
            if ports.values().all(|c| Arc::ptr_eq(svc, &c.service)) {
                next.by_service.insert(service.clone(), ports.clone());
                continue;
            }
            let rebuilt: PortClusters = ports
                .iter()
                .filter(|(port, _)| svc.exposes(**port) && svc.loaded.contains(port))
                .map(|(port, old)| {
                    let c = self.build_cluster(svc.clone(), *port, Some(old));
                    (*port, Arc::new(c))
                })
                .collect();
            if !rebuilt.is_empty() {
                next.by_service.insert(service.clone(), Arc::new(rebuilt));
            }
        }
        let next = Arc::new(next);
        self.map.store(next.clone());
        next
    }

    /// Every materialized cluster, as of the catalog in use now.
    pub fn snapshot(&self) -> Vec<Arc<Cluster>> {
        let map = {
            let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
            self.refreshed(&self.catalog.load())
        };
        let mut v: Vec<_> = map
            .by_service
            .values()
            .flat_map(|p| p.values().cloned())
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// `/clusters`' body: `{"clusters":[...]}`.
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Body<'a> {
            clusters: ClusterList<'a>,
        }
        let snapshot = self.snapshot();
        serde_json::to_vec(&Body {
            clusters: ClusterList(&snapshot),
        })
        .unwrap_or_default()
    }
}

/// Clusters as a JSON array, each serialized as it is written.
pub struct ClusterList<'a>(pub &'a [Arc<Cluster>]);

impl serde::Serialize for ClusterList<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|c| c.json()))
    }
}

#[cfg(test)]
impl Clusters {
    /// `get` against the catalog in use now.
    pub fn get_or_build(&self, service: &str, port: u16) -> Option<Arc<Cluster>> {
        self.get(&self.catalog.load(), service, port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;
    use std::path::Path;

    fn store(yaml: &str) -> Arc<CatalogStore> {
        Arc::new(CatalogStore::new(
            Catalog::parse(Path::new("c.yaml"), yaml, "aether.local").unwrap(),
        ))
    }

    fn endpoints(n: usize, ports: &str) -> String {
        let mut s = String::from(
            "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    endpoints:\n",
        );
        for i in 0..n {
            s.push_str(&format!(
                "      - {{ address: 10.0.0.{}, ports: {ports} }}\n",
                i + 1
            ));
        }
        s
    }

    #[test]
    fn a_port_cluster_holds_only_endpoints_advertising_the_port() {
        let yaml = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    endpoints:\n      - { address: 10.0.0.1, ports: [8080] }\n      - { address: 10.0.0.2, ports: [8080, 9091] }\n";
        let clusters = Clusters::new("aether.internal", store(yaml));
        let c = clusters.get_or_build("payments", 9091).unwrap();
        assert_eq!(c.name, "payments.aether.internal:9091");
        let addrs: Vec<_> = c.endpoints.iter().map(|e| e.address.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.2:15008"]);
        assert_eq!(
            clusters
                .get_or_build("payments", 8080)
                .unwrap()
                .endpoints
                .len(),
            2
        );
        assert!(clusters.get_or_build("payments", 7777).is_none());
        assert!(clusters.get_or_build("ghost", 8080).is_none());
    }

    #[test]
    fn the_admin_json_is_written_as_a_sorted_value_map_would_be() {
        let yaml = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    endpoints:\n      - { address: 10.0.0.1, ports: [8080], locality: r1/z1, labels: { version: v1 } }\n      - { address: 10.0.0.2, ports: [8080], draining: true }\n";
        let clusters = Clusters::new("aether.internal", store(yaml));
        clusters.get_or_build("payments", 8080).unwrap();
        let body = clusters.to_json();
        let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            parsed,
            serde_json::json!({ "clusters": [{
                "name": "payments.aether.internal",
                "service": "payments",
                "port": 8080,
                "endpoints": [
                    { "address": "10.0.0.1:15008", "locality": "r1/z1", "labels": { "version": "v1" },
                      "draining": false, "ejected": false, "active_requests": 0 },
                    { "address": "10.0.0.2:15008", "locality": "", "labels": {},
                      "draining": true, "ejected": false, "active_requests": 0 },
                ],
            }] })
        );
        // Byte for byte what the map (keys sorted) would have written.
        assert_eq!(serde_json::to_vec(&parsed).unwrap(), body);
    }

    #[test]
    fn concurrent_first_requests_build_one_cluster() {
        let clusters = Arc::new(Clusters::new(
            "aether.internal",
            store(&endpoints(3, "[8080]")),
        ));
        let built: Vec<Arc<Cluster>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..64)
                .map(|_| s.spawn(|| clusters.get_or_build("payments", 8080).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(built.iter().all(|c| Arc::ptr_eq(c, &built[0])));
        assert_eq!(clusters.snapshot().len(), 1);
    }

    #[test]
    fn rebuild_follows_the_catalog_and_keeps_live_counters() {
        let catalog = store(&endpoints(2, "[8080]"));
        let clusters = Clusters::new("aether.internal", catalog.clone());
        let old = clusters.get_or_build("payments", 8080).unwrap();
        let guard = ActiveGuard::new(old.endpoints[0].clone());
        catalog.apply(
            Catalog::parse(Path::new("c.yaml"), &endpoints(3, "[8080]"), "aether.local").unwrap(),
        );
        let new = clusters.get_or_build("payments", 8080).unwrap();
        assert!(!Arc::ptr_eq(&old, &new));
        assert_eq!(new.endpoints.len(), 3);
        // The request that started before the reload still counts, and stops counting after.
        assert_eq!(new.endpoints[0].active(), 1);
        drop(guard);
        assert_eq!(new.endpoints[0].active(), 0);
        // A service that lost the port loses the cluster.
        catalog.apply(
            Catalog::parse(Path::new("c.yaml"), &endpoints(1, "[9090]"), "aether.local").unwrap(),
        );
        assert!(clusters.snapshot().is_empty());
    }

    #[test]
    fn five_consecutive_failures_eject_and_ten_percent_caps_it() {
        let clusters = Clusters::new("aether.internal", store(&endpoints(20, "[8080]")));
        let c = clusters.get_or_build("payments", 8080).unwrap();
        let now = c.now_ms();
        for _ in 0..4 {
            c.record(&c.endpoints[0], true);
        }
        assert!(!c.endpoints[0].is_ejected(now));
        // A success resets the streak.
        c.record(&c.endpoints[0], false);
        for _ in 0..4 {
            c.record(&c.endpoints[0], true);
        }
        assert!(!c.endpoints[0].is_ejected(now));
        c.record(&c.endpoints[0], true);
        assert!(c.endpoints[0].is_ejected(now));
        // Ejection lasts 30 s times the number of ejections.
        assert!(!c.endpoints[0].is_ejected(now + 31_000));
        // 10% of 20 endpoints: two at once, never a third.
        for i in 1..4 {
            for _ in 0..5 {
                c.record(&c.endpoints[i], true);
            }
        }
        let ejected = c.endpoints.iter().filter(|e| e.is_ejected(now)).count();
        assert_eq!(ejected, 2);
    }

    #[test]
    fn a_single_endpoint_cluster_can_still_eject_its_one_endpoint() {
        let clusters = Clusters::new("aether.internal", store(&endpoints(1, "[8080]")));
        let c = clusters.get_or_build("payments", 8080).unwrap();
        for _ in 0..5 {
            c.record(&c.endpoints[0], true);
        }
        assert!(c.endpoints[0].is_ejected(c.now_ms()));
    }

    #[test]
    fn the_request_breaker_answers_overflow_past_its_limit_and_frees_places() {
        let mut catalog =
            Catalog::parse(Path::new("c.yaml"), &endpoints(1, "[8080]"), "aether.local").unwrap();
        Arc::make_mut(catalog.services.get_mut("payments").unwrap())
            .breakers
            .max_requests = 2;
        let clusters = Clusters::new("aether.internal", Arc::new(CatalogStore::new(catalog)));
        let c = clusters.get_or_build("payments", 8080).unwrap();
        let a = c.admit().expect("first place");
        let _b = c.admit().expect("second place");
        assert!(c.admit().is_none(), "a third request overflows");
        drop(a);
        assert!(c.admit().is_some(), "a finished request frees its place");
    }
}
