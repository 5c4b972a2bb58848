//! Clusters: one per (service, port), materialized on first use from the current catalog and
//! rebuilt from each new one. A cluster holds the endpoints that advertise its port; draining
//! ones are kept (for `/clusters` and in-flight work) but never picked.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::catalog::{Catalog, Endpoint, Labels, Service};
use crate::config::Locality;
use crate::metrics;

/// Outlier detection (Envoy defaults): consecutive failures before ejection, base ejection
/// time (multiplied by the number of ejections), and the share of a cluster ejectable at once.
pub const OUTLIER_CONSECUTIVE: u32 = 5;
pub const OUTLIER_BASE_EJECTION: Duration = Duration::from_secs(30);
pub const OUTLIER_MAX_PERCENT: usize = 10;

/// Live state of one endpoint inside one cluster.
pub struct EndpointState {
    pub address: SocketAddr,
    pub locality: Option<Locality>,
    pub labels: Labels,
    pub draining: bool,
    /// Requests in flight (least-outstanding-requests balancing).
    pub active: AtomicU32,
    consecutive_failures: AtomicU32,
    ejections: AtomicU32,
    /// Milliseconds since `epoch` until which the endpoint is ejected; 0 = not ejected.
    ejected_until_ms: AtomicU64,
    /// Set once the endpoint left the catalog: pooled connections to it close.
    pub removed: AtomicBool,
}

impl EndpointState {
    fn new(e: &Endpoint) -> EndpointState {
        EndpointState {
            address: e.address,
            locality: e.locality.clone(),
            labels: e.labels.clone(),
            draining: e.draining,
            active: AtomicU32::new(0),
            consecutive_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until_ms: AtomicU64::new(0),
            removed: AtomicBool::new(false),
        }
    }

    /// A rebuilt endpoint keeps the outlier history and in-flight count of its predecessor.
    fn carry_over(e: &Endpoint, old: &EndpointState) -> EndpointState {
        let s = EndpointState::new(e);
        s.active
            .store(old.active.load(Ordering::Relaxed), Ordering::Relaxed);
        s.consecutive_failures.store(
            old.consecutive_failures.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        s.ejections
            .store(old.ejections.load(Ordering::Relaxed), Ordering::Relaxed);
        s.ejected_until_ms.store(
            old.ejected_until_ms.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        s
    }

    pub fn is_ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }

    /// Healthy for routing: not draining, not ejected.
    pub fn available(&self, now_ms: u64) -> bool {
        !self.draining && !self.is_ejected(now_ms)
    }
}

/// Holds an endpoint's in-flight count for the life of a request.
pub struct ActiveGuard(pub Arc<EndpointState>);

impl ActiveGuard {
    pub fn new(e: Arc<EndpointState>) -> ActiveGuard {
        e.active.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(e)
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

pub struct Cluster {
    /// Canonical authority: `svc.<mesh>` for the default port, `svc.<mesh>:<port>` otherwise.
    pub name: String,
    pub service: Arc<Service>,
    pub port: u16,
    /// Every listed endpoint that advertises the port, draining ones included.
    pub endpoints: Vec<Arc<EndpointState>>,
    /// Where outlier time is measured from.
    epoch: Instant,
}

impl Cluster {
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Records a request's outcome for outlier detection: 5xx and connect failures count.
    pub fn record(&self, e: &EndpointState, failed: bool) {
        if !failed {
            e.consecutive_failures.store(0, Ordering::Relaxed);
            return;
        }
        let n = e.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n < OUTLIER_CONSECUTIVE {
            return;
        }
        let now = self.now_ms();
        if e.is_ejected(now) {
            return;
        }
        let ejected = self.endpoints.iter().filter(|x| x.is_ejected(now)).count();
        let max = (self.endpoints.len() * OUTLIER_MAX_PERCENT / 100).max(1);
        if ejected >= max {
            return;
        }
        let times = e.ejections.fetch_add(1, Ordering::Relaxed) + 1;
        let until = now + (OUTLIER_BASE_EJECTION.as_millis() as u64) * times as u64;
        e.ejected_until_ms.store(until, Ordering::Relaxed);
        e.consecutive_failures.store(0, Ordering::Relaxed);
        tracing::warn!(cluster = %self.name, endpoint = %e.address, times, "outlier: endpoint ejected");
        metrics::get()
            .outlier_ejections
            .get_or_create(&metrics::ServicePortLabels {
                service: self.service.name.clone(),
                port: self.port,
            })
            .inc();
    }

    pub fn to_json(&self) -> serde_json::Value {
        let now = self.now_ms();
        serde_json::json!({
            "name": self.name,
            "service": self.service.name,
            "port": self.port,
            "endpoints": self.endpoints.iter().map(|e| serde_json::json!({
                "address": e.address.to_string(),
                "locality": e.locality.as_ref().map(|l| l.to_string()).unwrap_or_default(),
                "labels": e.labels,
                "draining": e.draining,
                "ejected": e.is_ejected(now),
                "active_requests": e.active.load(Ordering::Relaxed),
            })).collect::<Vec<_>>(),
        })
    }
}

/// The materialized clusters, read lock-free on the hot path.
pub struct Clusters {
    mesh_domain: String,
    map: ArcSwap<HashMap<(String, u16), Arc<Cluster>>>,
    /// Serializes builds so concurrent first requests build one cluster.
    build: Mutex<()>,
    epoch: Instant,
}

impl Clusters {
    pub fn new(mesh_domain: &str) -> Clusters {
        Clusters {
            mesh_domain: mesh_domain.to_string(),
            map: ArcSwap::from_pointee(HashMap::new()),
            build: Mutex::new(()),
            epoch: Instant::now(),
        }
    }

    /// The cluster for `service`/`port` (the caller already checked the port is exposed).
    pub fn get_or_build(
        &self,
        catalog: &Catalog,
        service: &str,
        port: u16,
    ) -> Option<Arc<Cluster>> {
        if let Some(c) = self.map.load().get(&(service.to_string(), port)) {
            return Some(c.clone());
        }
        let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.map.load_full();
        if let Some(c) = current.get(&(service.to_string(), port)) {
            return Some(c.clone());
        }
        let svc = catalog.services.get(service)?;
        let cluster = Arc::new(self.build_cluster(svc.clone(), port, None));
        tracing::info!(cluster = %cluster.name, endpoints = cluster.endpoints.len(), "cluster materialized");
        let mut next = (*current).clone();
        next.insert((service.to_string(), port), cluster.clone());
        self.map.store(Arc::new(next));
        Some(cluster)
    }

    fn build_cluster(&self, svc: Arc<Service>, port: u16, old: Option<&Cluster>) -> Cluster {
        let endpoints = svc
            .endpoints
            .iter()
            .filter(|e| e.ports.contains(&port))
            .map(|e| {
                let prev = old.and_then(|o| o.endpoints.iter().find(|x| x.address == e.address));
                Arc::new(match prev {
                    Some(p) => EndpointState::carry_over(e, p),
                    None => EndpointState::new(e),
                })
            })
            .collect();
        Cluster {
            name: crate::routing::cluster_name(
                &svc.name,
                &self.mesh_domain,
                port,
                svc.default_port,
            ),
            service: svc,
            port,
            endpoints,
            epoch: self.epoch,
        }
    }

    /// Rebuilds every materialized cluster from a new catalog; clusters whose service or port
    /// is gone are dropped. Endpoints that left are marked `removed`.
    pub fn rebuild(&self, catalog: &Catalog) {
        let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.map.load_full();
        let mut next = HashMap::new();
        for ((service, port), old) in current.iter() {
            let rebuilt = catalog
                .services
                .get(service)
                .filter(|s| s.exposes(*port))
                .map(|s| Arc::new(self.build_cluster(s.clone(), *port, Some(old))));
            for e in &old.endpoints {
                let still = rebuilt
                    .as_ref()
                    .is_some_and(|c| c.endpoints.iter().any(|n| n.address == e.address));
                if !still {
                    e.removed.store(true, Ordering::Relaxed);
                }
            }
            if let Some(c) = rebuilt {
                next.insert((service.clone(), *port), c);
            }
        }
        self.map.store(Arc::new(next));
    }

    pub fn snapshot(&self) -> Vec<Arc<Cluster>> {
        let mut v: Vec<_> = self.map.load().values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "clusters": self.snapshot().iter().map(|c| c.to_json()).collect::<Vec<_>>() })
    }
}
