//! What the ADS stream holds, and the routing model built from it: resources as received
//! (validated, with the bytes they came in), the names requests asked for, and the catalog
//! services assembled from a service's default cluster, its port clusters and their endpoint
//! assignments. Only services whose inputs changed are built again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as PbCluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse;
use prost::Message;

use super::resources::{self, AssignedEndpoint, ClusterRes};
use super::subscriptions::{Kind, Names, Subscriptions};
use crate::catalog::{Catalog, Endpoint, OnDemand, Service, Usage};
use crate::validation::FieldError;

/// The control plane reported a service's default cluster absent.
struct Absent;

struct Held<T> {
    version: String,
    /// The resource's bytes: a resend of the same bytes changes nothing.
    raw: Vec<u8>,
    value: T,
}

/// Everything the stream has learnt, and what requests asked for.
#[derive(Default)]
pub(super) struct State {
    /// Canonical cluster names requests asked for, with when each was last used (or asked).
    pub(super) wanted: BTreeMap<String, Arc<AtomicU64>>,
    clusters: BTreeMap<String, Held<ClusterRes>>,
    assignments: BTreeMap<String, Held<Vec<AssignedEndpoint>>>,
    /// Names (either type) the control plane reported absent.
    absent: BTreeSet<String>,
    /// Assignment name -> the clusters whose endpoints it carries.
    eds_users: HashMap<String, BTreeSet<String>>,
    /// Services whose inputs changed since the last catalog (`dirty`) and since the last
    /// subscription sync (`sub_dirty`); only these are looked at again, so an update costs the
    /// services it touches, not the whole catalog.
    dirty: BTreeSet<String>,
    pub(super) sub_dirty: BTreeSet<String>,
    /// What is subscribed, per type.
    pub(super) subs: Subscriptions,
    /// The services of the last catalog, and the services known not to exist.
    built: BTreeMap<String, Arc<Service>>,
    absent_services: BTreeSet<String>,
    /// Names whose entry in `Status` may be stale.
    pub(super) noted: BTreeSet<String>,
}

impl State {
    /// Marks the services built from resource `name` (a cluster or an assignment) for rebuild.
    pub(super) fn touch(&mut self, name: &str, domain: &str) {
        let named = resources::parse_cluster_name(name, domain).map(|(svc, _)| svc);
        let users = self.eds_users.get(name).into_iter().flatten();
        let by_users = users.filter_map(|u| resources::parse_cluster_name(u, domain));
        for svc in named.into_iter().chain(by_users.map(|(svc, _)| svc)) {
            self.sub_dirty.insert(svc.clone());
            self.dirty.insert(svc);
        }
    }

    fn put_cluster(&mut self, name: String, held: Held<ClusterRes>) {
        self.unlink(&name);
        self.eds_users
            .entry(held.value.eds_name.clone())
            .or_default()
            .insert(name.clone());
        self.clusters.insert(name, held);
    }

    fn remove_cluster(&mut self, name: &str) -> bool {
        self.unlink(name);
        self.clusters.remove(name).is_some()
    }

    fn unlink(&mut self, name: &str) {
        let Some(old) = self.clusters.get(name) else {
            return;
        };
        if let Some(users) = self.eds_users.get_mut(&old.value.eds_name) {
            users.remove(name);
            if users.is_empty() {
                self.eds_users.remove(&old.value.eds_name);
            }
        }
    }

    /// Held names of the service's clusters (`svc.<domain>` and `svc.<domain>:P`), in order.
    fn names_of<'a>(
        set: impl Iterator<Item = &'a String> + 'a,
        default_name: &'a str,
    ) -> impl Iterator<Item = &'a String> + 'a {
        set.take_while(move |n| n.starts_with(default_name))
            .filter(move |n| {
                n.len() == default_name.len() || n.as_bytes()[default_name.len()] == b':'
            })
    }

    /// Drops what is held of `name` once it is unsubscribed, and marks what used it.
    pub(super) fn forget(&mut self, kind: Kind, name: String, domain: &str) {
        self.touch(&name, domain);
        self.noted.insert(name.clone());
        match kind {
            Kind::Cluster => self.remove_cluster(&name),
            Kind::Endpoint => self.assignments.remove(&name).is_some(),
        };
        self.absent.remove(&name);
    }

    /// The version held of `name` (an assignment's, else a cluster's).
    pub(super) fn version_of(&self, name: &str) -> Option<&String> {
        self.assignments
            .get(name)
            .map(|h| &h.version)
            .or_else(|| self.clusters.get(name).map(|h| &h.version))
    }

    /// Whether the control plane reported `name` absent.
    pub(super) fn is_absent(&self, name: &str) -> bool {
        self.absent.contains(name)
    }

    /// The names each type should be subscribed to for service `svc`'s wanted names.
    pub(super) fn needs_of(&self, svc: &str, domain: &str) -> Names {
        let mut clusters = BTreeSet::new();
        let mut eds = BTreeSet::new();
        let default = format!("{svc}.{domain}");
        let wanted = self.wanted.range(default.clone()..).map(|(n, _)| n);
        for name in Self::names_of(wanted, &default) {
            let Some((_, port)) = resources::parse_cluster_name(name, domain) else {
                continue;
            };
            clusters.insert(default.clone());
            let Some(d) = self.clusters.get(&default) else {
                continue;
            };
            let target = match port {
                Some(p) if p != d.value.port => {
                    if d.value.ports.as_ref().is_some_and(|ps| !ps.contains(&p)) {
                        continue; // aether.io.ports says it does not exist
                    }
                    let name = format!("{default}:{p}");
                    clusters.insert(name.clone());
                    name
                }
                _ => default.clone(),
            };
            if let Some(c) = self.clusters.get(&target) {
                eds.insert(c.value.eds_name.clone());
            }
        }
        Names {
            cluster: clusters,
            endpoint: eds,
        }
    }

    /// Validates a whole response; applies it only if every resource is valid.
    /// Returns whether anything changed.
    pub(super) fn accept(
        &mut self,
        kind: Kind,
        resp: &DeltaDiscoveryResponse,
        domain: &str,
        trust_domain: &str,
    ) -> Result<bool, FieldError> {
        let mut clusters = Vec::new();
        let mut assignments = Vec::new();
        for r in &resp.resources {
            let Some(any) = &r.resource else { continue };
            let origin = crate::validation::Origin::Resource(r.name.clone());
            let bad =
                |e: prost::DecodeError| FieldError::new(&origin, "", format!("cannot decode: {e}"));
            match kind {
                Kind::Cluster => {
                    let c = PbCluster::decode(any.value.as_slice()).map_err(bad)?;
                    let v = resources::cluster(&c, domain, trust_domain)?;
                    clusters.push((c.name.clone(), r.version.clone(), any.value.clone(), v));
                }
                Kind::Endpoint => {
                    let cla = ClusterLoadAssignment::decode(any.value.as_slice()).map_err(bad)?;
                    let v = resources::assignment(&cla)?;
                    assignments.push((
                        cla.cluster_name.clone(),
                        r.version.clone(),
                        any.value.clone(),
                        v,
                    ));
                }
            }
        }
        let mut changed = false;
        self.noted.extend(clusters.iter().map(|c| c.0.clone()));
        self.noted.extend(assignments.iter().map(|a| a.0.clone()));
        self.noted.extend(resp.removed_resources.iter().cloned());
        for (name, version, raw, value) in clusters {
            let same = self.clusters.get(&name).is_some_and(|h| h.raw == raw);
            if self.absent.remove(&name) || !same {
                changed = true;
                self.touch(&name, domain);
            }
            self.put_cluster(
                name,
                Held {
                    version,
                    raw,
                    value,
                },
            );
        }
        for (name, version, raw, value) in assignments {
            let same = self.assignments.get(&name).is_some_and(|h| h.raw == raw);
            if self.absent.remove(&name) || !same {
                changed = true;
                self.touch(&name, domain);
            }
            self.assignments.insert(
                name,
                Held {
                    version,
                    raw,
                    value,
                },
            );
        }
        for name in &resp.removed_resources {
            self.touch(name, domain);
            let had = match kind {
                Kind::Cluster => self.remove_cluster(name),
                Kind::Endpoint => self.assignments.remove(name).is_some(),
            };
            if self.subs.told(kind, name) && self.absent.insert(name.clone()) {
                changed = true;
            }
            changed |= had;
        }
        Ok(changed)
    }

    /// The catalog: the services touched since the last one are rebuilt, the others shared
    /// (the same `Arc`, which also lets their materialized clusters stay as they are).
    pub(super) fn catalog(&mut self, domain: &str, cluster_timeout: Duration) -> Catalog {
        for svc in std::mem::take(&mut self.dirty) {
            match self.service(&svc, domain) {
                Some(Ok(built)) => {
                    self.absent_services.remove(&svc);
                    self.built.insert(svc, Arc::new(built));
                }
                Some(Err(Absent)) => {
                    self.built.remove(&svc);
                    self.absent_services.insert(svc);
                }
                None => {
                    self.built.remove(&svc);
                    self.absent_services.remove(&svc);
                }
            }
        }
        Catalog {
            services: self.built.clone(),
            version: 0,
            on_demand: Some(OnDemand {
                timeout: cluster_timeout,
                absent: self.absent_services.clone(),
            }),
            vips: Default::default(),
        }
    }

    /// Service `svc` as the held resources describe it; `Err(Absent)`: the control plane said
    /// its default cluster does not exist; `None`: nothing is known of it (yet).
    fn service(&self, svc: &str, domain: &str) -> Option<Result<Service, Absent>> {
        let default_name = format!("{svc}.{domain}");
        let Some(d) = self.clusters.get(&default_name).map(|h| &h.value) else {
            return self.absent.contains(&default_name).then_some(Err(Absent));
        };
        let port_cluster = |p: u16| -> Option<&ClusterRes> {
            if p == d.port {
                Some(d)
            } else {
                self.clusters
                    .get(&format!("{default_name}:{p}"))
                    .map(|h| &h.value)
            }
        };
        let (ports, ports_complete) = match &d.ports {
            Some(ps) => (ps.clone(), true),
            None => {
                let mut ps: BTreeSet<u16> = Self::names_of(
                    self.clusters.range(default_name.clone()..).map(|(n, _)| n),
                    &default_name,
                )
                .filter_map(|n| self.clusters.get(n).and_then(|h| h.value.named_port))
                .collect();
                ps.insert(d.port);
                (ps, false)
            }
        };
        let absent_ports = Self::names_of(self.absent.range(default_name.clone()..), &default_name)
            .filter_map(|n| resources::parse_cluster_name(n, domain))
            .filter_map(|(_, p)| p)
            .collect();
        let mut endpoints = Vec::new();
        let mut loaded = BTreeSet::new();
        let mut protocols = BTreeMap::new();
        let mut usage = Usage::new();
        for &p in &ports {
            let Some(c) = port_cluster(p) else { continue };
            protocols.insert(p, c.protocol);
            let assigned = match self.assignments.get(&c.eds_name) {
                Some(h) => &h.value[..],
                None if self.absent.contains(&c.eds_name) => &[],
                None => continue,
            };
            loaded.insert(p);
            let key = cluster_key(svc, domain, p, d.port);
            if let Some(used) = self.wanted.get(&key) {
                usage.insert(p, used.clone());
            }
            endpoints.reserve_exact(assigned.len());
            endpoints.extend(assigned.iter().map(|e| Endpoint {
                address: e.address,
                ports: vec![p],
                locality: e.locality.clone(),
                labels: e.labels.clone(),
                draining: e.draining,
                weight: e.weight,
                priority: Some(e.priority),
            }));
        }
        Some(Ok(Service {
            name: svc.to_string(),
            default_port: d.port,
            identity: d.identity.clone(),
            protocols,
            connect_timeout: d
                .connect_timeout
                .unwrap_or(crate::catalog::model::DEFAULT_CONNECT_TIMEOUT),
            request_timeout: d
                .request_timeout
                .unwrap_or(crate::catalog::model::DEFAULT_REQUEST_TIMEOUT),
            max_requests_per_connection: d.max_requests_per_connection,
            routes: d.routes.clone(),
            outlier: d.outlier,
            breakers: d.breakers,
            endpoints,
            ports,
            ports_complete,
            absent_ports,
            loaded,
            usage,
        }))
    }

    /// (name, version) of every resource of `kind` held.
    pub(super) fn held_versions(
        &self,
        kind: Kind,
    ) -> Box<dyn Iterator<Item = (&String, &String)> + '_> {
        match kind {
            Kind::Cluster => Box::new(self.clusters.iter().map(|(n, h)| (n, &h.version))),
            Kind::Endpoint => Box::new(self.assignments.iter().map(|(n, h)| (n, &h.version))),
        }
    }
}

/// The canonical cluster name requests use for a port (the default port has none).
fn cluster_key(svc: &str, domain: &str, port: u16, default_port: u16) -> String {
    crate::outbound::route::cluster_name(svc, domain, port, default_port)
}
