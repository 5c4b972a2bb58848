//! The delta ADS client (SPEC section 9): one stream, two resource types (Cluster and
//! ClusterLoadAssignment), subscriptions driven by what requests ask for.
//!
//! Requests that meet a name the catalog does not know ask the store (`CatalogStore::want`);
//! this task subscribes to the default cluster of the service first, then to the port's
//! cluster (never `svc:<default>`), then to the endpoint assignment of whichever serves the
//! port. Every response is ACKed or NACKed; every accepted change becomes a new catalog,
//! applied to the store like a new file would be. Names unused for `idle` are unsubscribed and
//! forgotten. Losing the stream keeps the last catalog serving; reconnects resubscribe with the
//! versions held.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as PbCluster;
use envoy_types::pb::envoy::config::core::v3::{node::UserAgentVersionType, Locality, Node};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::channel;
use super::resources::{self, AssignedEndpoint, ClusterRes, CLUSTER_TYPE, ENDPOINT_TYPE};
use crate::catalog::model::clock_secs;
use crate::catalog::{Catalog, CatalogStore, Endpoint, OnDemand, Service, Usage};
use crate::config::{Config, XdsConfig};
use crate::identity::IdentityStore;
use crate::metrics;
use crate::validation::FieldError;

/// The largest response accepted (tonic's default is 4 MiB): the assignments of a large service
/// run past that, and the whole response is held while it is checked.
pub const MAX_RESPONSE: usize = 64 << 20;

/// What `/config_dump` shows of the control plane.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Status {
    pub address: String,
    pub connected: bool,
    /// Resource name -> version, of every resource held.
    pub resources: BTreeMap<String, String>,
    /// Names the control plane reported absent.
    pub absent: BTreeSet<String>,
    pub last_nack: Option<Nack>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Nack {
    pub resource: String,
    pub message: String,
}

/// Two resource types, indexed the same way everywhere below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Cluster,
    Endpoint,
}

impl Kind {
    fn type_url(self) -> &'static str {
        match self {
            Kind::Cluster => CLUSTER_TYPE,
            Kind::Endpoint => ENDPOINT_TYPE,
        }
    }

    fn metric(self) -> &'static str {
        match self {
            Kind::Cluster => "cluster",
            Kind::Endpoint => "endpoint",
        }
    }

    fn of(type_url: &str) -> Option<Kind> {
        match type_url {
            CLUSTER_TYPE => Some(Kind::Cluster),
            ENDPOINT_TYPE => Some(Kind::Endpoint),
            _ => None,
        }
    }
}

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
struct State {
    /// Canonical cluster names requests asked for, with when each was last used (or asked).
    wanted: BTreeMap<String, Arc<AtomicU64>>,
    clusters: BTreeMap<String, Held<ClusterRes>>,
    assignments: BTreeMap<String, Held<Vec<AssignedEndpoint>>>,
    /// Names (either type) the control plane reported absent.
    absent: BTreeSet<String>,
    /// What the server was told we subscribe to, per type.
    subscribed: [BTreeSet<String>; 2],
    /// Assignment name -> the clusters whose endpoints it carries.
    eds_users: HashMap<String, BTreeSet<String>>,
    /// Services whose inputs changed since the last catalog (`dirty`) and since the last
    /// subscription sync (`sub_dirty`); only these are looked at again, so an update costs the
    /// services it touches, not the whole catalog.
    dirty: BTreeSet<String>,
    sub_dirty: BTreeSet<String>,
    /// Per service, the names it needs subscribed; per type, how many services need each.
    wants_of: HashMap<String, [BTreeSet<String>; 2]>,
    want_count: [HashMap<String, usize>; 2],
    /// The services of the last catalog, and the services known not to exist.
    built: BTreeMap<String, Arc<Service>>,
    absent_services: BTreeSet<String>,
    /// Names whose entry in `Status` may be stale.
    noted: BTreeSet<String>,
}

impl State {
    /// Marks the services built from resource `name` (a cluster or an assignment) for rebuild.
    fn touch(&mut self, name: &str, domain: &str) {
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
}

fn idx(k: Kind) -> usize {
    match k {
        Kind::Cluster => 0,
        Kind::Endpoint => 1,
    }
}

pub struct Ads {
    cfg: XdsConfig,
    mesh_domain: String,
    trust_domain: String,
    node: Node,
    store: Arc<CatalogStore>,
    identity: Arc<IdentityStore>,
    /// Kept up to date name by name (a whole copy per update would cost the catalog's size).
    pub status: Arc<Mutex<Status>>,
}

impl Ads {
    pub fn new(
        cfg: &Config,
        xds: &XdsConfig,
        store: Arc<CatalogStore>,
        identity: Arc<IdentityStore>,
    ) -> Ads {
        let own = identity.current().identity.spiffe_id.clone();
        let namespace = own
            .as_str()
            .split('/')
            .skip_while(|s| *s != "ns")
            .nth(1)
            .unwrap_or("default")
            .to_string();
        let ip = match cfg.inbound.listen.ip() {
            ip if ip.is_unspecified() => "127.0.0.1".to_string(),
            ip => ip.to_string(),
        };
        let node = Node {
            id: xds
                .node_id
                .clone()
                .unwrap_or_else(|| format!("sidecar~{ip}~{}.{namespace}", hostname())),
            cluster: xds
                .cluster
                .clone()
                .unwrap_or_else(|| own.last_segment().to_string()),
            locality: cfg.locality.as_ref().map(|l| Locality {
                region: l.region.clone(),
                zone: l.zone.clone(),
                sub_zone: l.subzone.clone(),
            }),
            user_agent_name: "aether-proxy".into(),
            user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(
                env!("CARGO_PKG_VERSION").into(),
            )),
            ..Default::default()
        };
        Ads {
            status: Arc::new(Mutex::new(Status {
                address: xds.address.to_string(),
                ..Default::default()
            })),
            cfg: xds.clone(),
            mesh_domain: cfg.mesh_domain.clone(),
            trust_domain: cfg.trust_domain.clone(),
            node,
            store,
            identity,
        }
    }

    /// Runs the client for the life of the process.
    pub fn spawn(self) {
        let Some(wants) = self.store.take_wants() else {
            tracing::error!("the catalog store already has an on-demand source");
            return;
        };
        tokio::spawn(self.run(wants));
    }

    async fn run(self, mut wants: mpsc::UnboundedReceiver<String>) {
        let mut state = State::default();
        let mut failures = 0u32;
        loop {
            match self.session(&mut state, &mut wants).await {
                Ok(()) => return, // the store is gone: the process is ending
                Err(Ended { heard }) => {
                    metrics::get().xds_connected.set(0);
                    self.set_connected(false);
                    failures = if heard { 1 } else { failures.saturating_add(1) };
                }
            }
            let wait = channel::backoff(failures);
            tracing::info!(?wait, "control plane: reconnecting");
            // Names asked for meanwhile are kept for the next stream.
            let sleep = tokio::time::sleep(wait);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break,
                    w = wants.recv() => match w {
                        Some(name) => self.want(&mut state, name),
                        None => return,
                    },
                }
            }
        }
    }

    /// One stream, until it ends.
    async fn session(
        &self,
        state: &mut State,
        wants: &mut mpsc::UnboundedReceiver<String>,
    ) -> Result<(), Ended> {
        let mut heard = false;
        let channel = match channel::connect(&self.cfg.address, Some(self.identity.clone())).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("control plane: {e}");
                return Err(Ended { heard });
            }
        };
        // Unbounded: a server that stops reading while we stop reading its answers must not
        // deadlock the two; what goes in is bounded by the names requests ask for.
        let (tx, rx) = mpsc::unbounded_channel::<DeltaDiscoveryRequest>();
        let mut client =
            AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(MAX_RESPONSE);
        // The call starts now and requests flow from now on; its response headers are awaited
        // only beside the demand queue (see `channel::Responses`).
        let mut responses = channel::Responses::new(async move {
            client
                .delta_aggregated_resources(UnboundedReceiverStream::new(rx))
                .await
        });
        // The server learns the node from the first request on the stream; nothing is
        // subscribed before a request asks (an empty first subscription would be a wildcard).
        let mut out = Outgoing {
            tx,
            node: Some(self.node.clone()),
        };
        state.subscribed = Default::default();
        self.sync_subscriptions(state, &mut out, true);
        // As Envoy counts it: connected once the stream is started, before any answer.
        metrics::get().xds_connected.set(1);
        self.set_connected(true);
        tracing::info!(address = %self.cfg.address, "control plane: stream started");
        let sweep_every =
            (self.cfg.idle / 4).clamp(Duration::from_millis(250), Duration::from_secs(60));
        let mut sweep = tokio::time::interval(sweep_every);
        loop {
            tokio::select! {
                msg = responses.message() => match msg {
                    Ok(Some(resp)) => {
                        heard = true;
                        self.handle(state, &mut out, resp);
                    }
                    Ok(None) => {
                        tracing::warn!("control plane: stream closed");
                        return Err(Ended { heard });
                    }
                    Err(e) => {
                        tracing::warn!("control plane: stream failed: {e}");
                        return Err(Ended { heard });
                    }
                },
                w = wants.recv() => match w {
                    Some(name) => {
                        self.want(state, name);
                        self.sync_subscriptions(state, &mut out, false);
                    }
                    None => return Ok(()),
                },
                _ = sweep.tick() => {
                    if self.forget_idle(state) {
                        self.sync_subscriptions(state, &mut out, false);
                        self.apply(state);
                    }
                }
            }
        }
    }

    fn want(&self, state: &mut State, name: String) {
        if resources::parse_cluster_name(&name, &self.mesh_domain).is_none() {
            return;
        }
        if !state.wanted.contains_key(&name) {
            state.touch(&name, &self.mesh_domain);
            state
                .wanted
                .insert(name, Arc::new(AtomicU64::new(clock_secs())));
        }
    }

    /// Unwanted names whose service port has not been used for `idle`. True when any went.
    fn forget_idle(&self, state: &mut State) -> bool {
        let now = clock_secs();
        let idle = self.cfg.idle.as_secs().max(1);
        let mut forgotten = Vec::new();
        state.wanted.retain(|name, used| {
            let keep = now.saturating_sub(used.load(Ordering::Relaxed)) < idle;
            if !keep {
                forgotten.push(name.clone());
            }
            keep
        });
        for name in &forgotten {
            state.touch(name, &self.mesh_domain);
        }
        let gone = !forgotten.is_empty();
        if gone {
            tracing::info!(
                left = state.wanted.len(),
                "control plane: idle clusters forgotten"
            );
        }
        gone
    }

    /// The names each type should be subscribed to for service `svc`'s wanted names.
    fn desired_for(&self, state: &State, svc: &str) -> [BTreeSet<String>; 2] {
        let mut clusters = BTreeSet::new();
        let mut eds = BTreeSet::new();
        let default = format!("{svc}.{}", self.mesh_domain);
        let wanted = state.wanted.range(default.clone()..).map(|(n, _)| n);
        for name in State::names_of(wanted, &default) {
            let Some((_, port)) = resources::parse_cluster_name(name, &self.mesh_domain) else {
                continue;
            };
            clusters.insert(default.clone());
            let Some(d) = state.clusters.get(&default) else {
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
            if let Some(c) = state.clusters.get(&target) {
                eds.insert(c.value.eds_name.clone());
            }
        }
        [clusters, eds]
    }

    /// Tells the server about subscription changes; forgets what is no longer wanted. Only
    /// the services touched since the last call are looked at (`initial`: a new stream, told
    /// everything).
    fn sync_subscriptions(&self, state: &mut State, out: &mut Outgoing, initial: bool) {
        let mut crossed: [BTreeSet<String>; 2] = Default::default();
        for svc in std::mem::take(&mut state.sub_dirty) {
            let new = self.desired_for(state, &svc);
            let old = state.wants_of.remove(&svc).unwrap_or_default();
            for k in 0..2 {
                let count = &mut state.want_count[k];
                for n in new[k].difference(&old[k]) {
                    let c = count.entry(n.clone()).or_default();
                    *c += 1;
                    if *c == 1 {
                        crossed[k].insert(n.clone());
                    }
                }
                for n in old[k].difference(&new[k]) {
                    if let Some(c) = count.get_mut(n) {
                        *c -= 1;
                        if *c == 0 {
                            count.remove(n);
                            crossed[k].insert(n.clone());
                        }
                    }
                }
            }
            if !new[0].is_empty() || !new[1].is_empty() {
                state.wants_of.insert(svc, new);
            }
        }
        for kind in [Kind::Cluster, Kind::Endpoint] {
            let k = idx(kind);
            let candidates: Vec<&String> = match initial {
                true => state.want_count[k].keys().collect(),
                false => crossed[k].iter().collect(),
            };
            let (mut subscribe, mut unsubscribe) = (Vec::new(), Vec::new());
            for n in candidates {
                match (
                    state.want_count[k].contains_key(n),
                    state.subscribed[k].contains(n),
                ) {
                    (true, false) => subscribe.push(n.clone()),
                    (false, true) => unsubscribe.push(n.clone()),
                    _ => {}
                }
            }
            if subscribe.is_empty() && unsubscribe.is_empty() {
                continue;
            }
            subscribe.sort();
            let initial_resource_versions = if initial {
                held_versions(state, kind)
                    .filter(|(n, _)| state.want_count[k].contains_key(*n))
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect()
            } else {
                HashMap::new()
            };
            state.subscribed[k].extend(subscribe.iter().cloned());
            for n in &unsubscribe {
                state.subscribed[k].remove(n);
            }
            out.send(DeltaDiscoveryRequest {
                type_url: kind.type_url().into(),
                resource_names_subscribe: subscribe,
                resource_names_unsubscribe: unsubscribe.clone(),
                initial_resource_versions,
                ..Default::default()
            });
            for name in unsubscribe {
                state.touch(&name, &self.mesh_domain);
                state.noted.insert(name.clone());
                match kind {
                    Kind::Cluster => state.remove_cluster(&name),
                    Kind::Endpoint => state.assignments.remove(&name).is_some(),
                };
                state.absent.remove(&name);
            }
        }
    }

    fn handle(&self, state: &mut State, out: &mut Outgoing, resp: DeltaDiscoveryResponse) {
        let Some(kind) = Kind::of(&resp.type_url) else {
            tracing::warn!(type_url = %resp.type_url, "control plane: unexpected resource type; ignored");
            out.send(ack(&resp, None));
            return;
        };
        match self.accept(state, kind, &resp) {
            Ok(changed) => {
                metrics::get().xds_update(kind.metric(), true);
                out.send(ack(&resp, None));
                if changed {
                    self.sync_subscriptions(state, out, false);
                    self.apply(state);
                } else {
                    self.flush_status(state);
                }
            }
            Err(e) => {
                metrics::get().xds_update(kind.metric(), false);
                tracing::warn!("control plane: update refused, keeping the last good version: {e}");
                let resource = match &e.origin {
                    crate::validation::Origin::Resource(r) => r.clone(),
                    other => other.to_string(),
                };
                let message = e.to_string();
                out.send(ack(&resp, Some(message.clone())));
                self.status
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .last_nack = Some(Nack { resource, message });
            }
        }
    }

    /// Validates a whole response; applies it to `state` only if every resource is valid.
    /// Returns whether anything changed.
    fn accept(
        &self,
        state: &mut State,
        kind: Kind,
        resp: &DeltaDiscoveryResponse,
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
                    let v = resources::cluster(&c, &self.mesh_domain, &self.trust_domain)?;
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
        let domain = &self.mesh_domain;
        state.noted.extend(clusters.iter().map(|c| c.0.clone()));
        state.noted.extend(assignments.iter().map(|a| a.0.clone()));
        state.noted.extend(resp.removed_resources.iter().cloned());
        for (name, version, raw, value) in clusters {
            let same = state.clusters.get(&name).is_some_and(|h| h.raw == raw);
            if state.absent.remove(&name) || !same {
                changed = true;
                state.touch(&name, domain);
            }
            state.put_cluster(
                name,
                Held {
                    version,
                    raw,
                    value,
                },
            );
        }
        for (name, version, raw, value) in assignments {
            let same = state.assignments.get(&name).is_some_and(|h| h.raw == raw);
            if state.absent.remove(&name) || !same {
                changed = true;
                state.touch(&name, domain);
            }
            state.assignments.insert(
                name,
                Held {
                    version,
                    raw,
                    value,
                },
            );
        }
        for name in &resp.removed_resources {
            state.touch(name, domain);
            let had = match kind {
                Kind::Cluster => state.remove_cluster(name),
                Kind::Endpoint => state.assignments.remove(name).is_some(),
            };
            if state.subscribed[idx(kind)].contains(name) && state.absent.insert(name.clone()) {
                changed = true;
            }
            changed |= had;
        }
        Ok(changed)
    }

    /// A new catalog from what the stream holds, applied to the store.
    fn apply(&self, state: &mut State) {
        let catalog = self.catalog(state);
        self.store.apply(catalog);
        self.flush_status(state);
    }

    /// The catalog: the services touched since the last one are rebuilt, the others shared
    /// (the same `Arc`, which also lets their materialized clusters stay as they are).
    fn catalog(&self, state: &mut State) -> Catalog {
        for svc in std::mem::take(&mut state.dirty) {
            match self.service(state, &svc) {
                Some(Ok(built)) => {
                    state.absent_services.remove(&svc);
                    state.built.insert(svc, Arc::new(built));
                }
                Some(Err(Absent)) => {
                    state.built.remove(&svc);
                    state.absent_services.insert(svc);
                }
                None => {
                    state.built.remove(&svc);
                    state.absent_services.remove(&svc);
                }
            }
        }
        Catalog {
            services: state.built.clone(),
            version: 0,
            on_demand: Some(OnDemand {
                timeout: self.cfg.cluster_timeout,
                absent: state.absent_services.clone(),
            }),
            vips: Default::default(),
        }
    }

    /// Service `svc` as the held resources describe it; `Err(Absent)`: the control plane said
    /// its default cluster does not exist; `None`: nothing is known of it (yet).
    fn service(&self, state: &State, svc: &str) -> Option<Result<Service, Absent>> {
        let domain = &self.mesh_domain;
        let default_name = format!("{svc}.{domain}");
        let Some(d) = state.clusters.get(&default_name).map(|h| &h.value) else {
            return state.absent.contains(&default_name).then_some(Err(Absent));
        };
        let port_cluster = |p: u16| -> Option<&ClusterRes> {
            if p == d.port {
                Some(d)
            } else {
                state
                    .clusters
                    .get(&format!("{default_name}:{p}"))
                    .map(|h| &h.value)
            }
        };
        let (ports, ports_complete) = match &d.ports {
            Some(ps) => (ps.clone(), true),
            None => {
                let mut ps: BTreeSet<u16> = State::names_of(
                    state.clusters.range(default_name.clone()..).map(|(n, _)| n),
                    &default_name,
                )
                .filter_map(|n| state.clusters.get(n).and_then(|h| h.value.named_port))
                .collect();
                ps.insert(d.port);
                (ps, false)
            }
        };
        let absent_ports =
            State::names_of(state.absent.range(default_name.clone()..), &default_name)
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
            let assigned = match state.assignments.get(&c.eds_name) {
                Some(h) => &h.value[..],
                None if state.absent.contains(&c.eds_name) => &[],
                None => continue,
            };
            loaded.insert(p);
            let key = cluster_key(svc, domain, p, d.port);
            if let Some(used) = state.wanted.get(&key) {
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

    fn set_connected(&self, connected: bool) {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .connected = connected;
    }

    /// Brings the status of the names noted since the last flush up to date.
    fn flush_status(&self, state: &mut State) {
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        for name in std::mem::take(&mut state.noted) {
            let version = state
                .assignments
                .get(&name)
                .map(|h| &h.version)
                .or_else(|| state.clusters.get(&name).map(|h| &h.version));
            match version {
                Some(v) => status.resources.insert(name.clone(), v.clone()),
                None => status.resources.remove(&name),
            };
            match state.absent.contains(&name) {
                true => status.absent.insert(name),
                false => status.absent.remove(&name),
            };
        }
    }
}

/// The canonical cluster name requests use for a port (the default port has none).
fn cluster_key(svc: &str, domain: &str, port: u16, default_port: u16) -> String {
    crate::outbound::route::cluster_name(svc, domain, port, default_port)
}

fn held_versions(state: &State, kind: Kind) -> Box<dyn Iterator<Item = (&String, &String)> + '_> {
    match kind {
        Kind::Cluster => Box::new(state.clusters.iter().map(|(n, h)| (n, &h.version))),
        Kind::Endpoint => Box::new(state.assignments.iter().map(|(n, h)| (n, &h.version))),
    }
}

/// An ACK (no error) or a NACK for a response.
fn ack(resp: &DeltaDiscoveryResponse, error: Option<String>) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        error_detail: error.map(|message| RpcStatus {
            code: 3, // INVALID_ARGUMENT
            message,
            details: Vec::new(),
        }),
        ..Default::default()
    }
}

/// Why a stream ended; `heard`: the server answered at least once (resets the backoff).
struct Ended {
    heard: bool,
}

struct Outgoing {
    tx: mpsc::UnboundedSender<DeltaDiscoveryRequest>,
    /// Sent with the first request of the stream.
    node: Option<Node>,
}

impl Outgoing {
    fn send(&mut self, mut req: DeltaDiscoveryRequest) {
        if let Some(node) = self.node.take() {
            req.node = Some(node);
        }
        // A closed stream is seen by the response side, which ends the session.
        let _ = self.tx.send(req);
    }
}

/// The node SDS streams identify with: the workload's identity is not known yet, so the id
/// falls back to the hostname and the namespace to `default`.
pub fn sds_node(cfg: &Config) -> Node {
    let xds = cfg.discovery.as_ref().map(|d| &d.xds);
    Node {
        id: xds
            .and_then(|x| x.node_id.clone())
            .unwrap_or_else(|| format!("sidecar~127.0.0.1~{}.default", hostname())),
        cluster: xds.and_then(|x| x.cluster.clone()).unwrap_or_default(),
        user_agent_name: "aether-proxy".into(),
        ..Default::default()
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
