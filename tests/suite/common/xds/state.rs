//! The control plane's state and protocol logic, apart from the transport: the fixture and the
//! resources made from it, the test's overrides, every open stream with what it subscribed to
//! and what it was told, and the record of everything clients sent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use tokio::sync::mpsc::UnboundedSender;
use tonic::Status;

use super::fixture::Fixture;
use super::resources::{build, eds_of, version_of, Key, Res, CLA_TYPE, CLUSTER_TYPE, SECRET_TYPE};

/// Which API a stream used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `AggregatedDiscoveryService/DeltaAggregatedResources`.
    DeltaAds,
    /// `SecretDiscoveryService/StreamSecrets` (state of the world).
    Sds,
}

/// The node a client identified itself with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: String,
    pub cluster: String,
    pub region: String,
    pub zone: String,
    pub sub_zone: String,
    pub user_agent_name: String,
}

impl From<&Node> for NodeInfo {
    fn from(n: &Node) -> NodeInfo {
        let l = n.locality.clone().unwrap_or_default();
        NodeInfo {
            id: n.id.clone(),
            cluster: n.cluster.clone(),
            region: l.region,
            zone: l.zone,
            sub_zone: l.sub_zone,
            user_agent_name: n.user_agent_name.clone(),
        }
    }
}

/// One request a client sent, as received.
#[derive(Debug, Clone)]
pub struct Request {
    pub at: Instant,
    pub type_url: String,
    pub node: Option<NodeInfo>,
    /// Delta: `resource_names_subscribe`.
    pub subscribe: Vec<String>,
    /// Delta: `resource_names_unsubscribe`.
    pub unsubscribe: Vec<String>,
    /// Delta: `initial_resource_versions`.
    pub initial_versions: BTreeMap<String, String>,
    /// State of the world (SDS): `resource_names`.
    pub resource_names: Vec<String>,
    pub response_nonce: String,
    /// `error_detail.message` (a NACK).
    pub error: Option<String>,
}

impl Request {
    /// An ACK: it answers a response (nonce) without an error.
    pub fn is_ack(&self) -> bool {
        !self.response_nonce.is_empty() && self.error.is_none()
    }
    pub fn is_nack(&self) -> bool {
        self.error.is_some()
    }
}

/// One response the control plane sent.
#[derive(Debug, Clone)]
pub struct Response {
    pub at: Instant,
    pub type_url: String,
    pub nonce: String,
    /// (name, version) of each resource in it.
    pub resources: Vec<(String, String)>,
    /// Delta: `removed_resources`.
    pub removed: Vec<String>,
}

/// Everything about one stream, kept after it closed.
#[derive(Debug, Clone)]
pub struct StreamRecord {
    pub id: u64,
    pub api: Api,
    pub opened: Instant,
    pub closed: Option<Instant>,
    pub requests: Vec<Request>,
    pub responses: Vec<Response>,
}

impl StreamRecord {
    /// The node of the stream's first request (None if it carried none).
    pub fn first_node(&self) -> Option<&NodeInfo> {
        self.requests.first().and_then(|r| r.node.as_ref())
    }
    /// The nonces of this stream's responses no later request answered (ACK or NACK).
    pub fn unanswered_nonces(&self) -> Vec<String> {
        self.responses
            .iter()
            .filter(|resp| !self.requests.iter().any(|r| r.response_nonce == resp.nonce))
            .map(|r| r.nonce.clone())
            .collect()
    }
}

/// One response's content: (name, resource) to send, names removed.
type Delta = (Vec<(String, Res)>, Vec<String>);

struct AdsStream {
    tx: UnboundedSender<Result<DeltaDiscoveryResponse, Status>>,
    subscribed: BTreeSet<Key>,
    /// What the client was told last: Some(version) or None (removed). Missing: nothing yet.
    known: BTreeMap<Key, Option<String>>,
    /// Subscribed to everything by the server (`Inner::wildcard`).
    wildcarded: bool,
}

struct SdsStream {
    tx: UnboundedSender<Result<DiscoveryResponse, Status>>,
    names: Vec<String>,
    /// name -> version of what the last response carried.
    sent: BTreeMap<String, String>,
}

#[derive(Default)]
pub struct Inner {
    pub fixture: Fixture,
    built: BTreeMap<Key, Res>,
    /// Cluster name -> a hand-made Cluster served instead of the fixture's.
    pub overrides: BTreeMap<String, Res>,
    /// Names never answered.
    pub held: BTreeSet<String>,
    ads: BTreeMap<u64, AdsStream>,
    sds: BTreeMap<u64, SdsStream>,
    pub records: Vec<StreamRecord>,
    next_nonce: u64,
    /// Istio's habit: after a Cluster update, resend its assignment (unchanged) too, since
    /// Envoy does not ask for it again.
    pub resend_assignments: bool,
    /// New streams are ended with this status as soon as they open.
    pub refuse: Option<Status>,
    /// A stream's first request subscribes it to every Cluster and assignment.
    pub wildcard: bool,
}

/// The shared state behind a control plane.
#[derive(Default)]
pub struct State(Mutex<Inner>);

impl State {
    pub fn new(fixture: Fixture) -> State {
        let built = build(&fixture);
        State(Mutex::new(Inner {
            fixture,
            built,
            ..Default::default()
        }))
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    /// The resource served now for `key`, unless it is held.
    pub fn current(&self, key: &Key) -> Option<&Res> {
        if key.0 == CLUSTER_TYPE {
            if let Some(r) = self.overrides.get(&key.1) {
                return Some(r);
            }
        }
        self.built.get(key)
    }

    pub fn set_fixture(&mut self, fixture: Fixture) {
        self.built = build(&fixture);
        self.fixture = fixture;
        self.push_all();
    }

    fn nonce(&mut self) -> String {
        self.next_nonce += 1;
        format!("n{}", self.next_nonce)
    }

    fn open(&mut self, api: Api) -> u64 {
        let id = self.records.len() as u64;
        self.records.push(StreamRecord {
            id,
            api,
            opened: Instant::now(),
            closed: None,
            requests: Vec::new(),
            responses: Vec::new(),
        });
        id
    }

    pub fn open_ads(&mut self, tx: UnboundedSender<Result<DeltaDiscoveryResponse, Status>>) -> u64 {
        let id = self.open(Api::DeltaAds);
        self.ads.insert(
            id,
            AdsStream {
                tx,
                subscribed: BTreeSet::new(),
                known: BTreeMap::new(),
                wildcarded: false,
            },
        );
        self.refuse_if_asked(id);
        id
    }

    pub fn open_sds(&mut self, tx: UnboundedSender<Result<DiscoveryResponse, Status>>) -> u64 {
        let id = self.open(Api::Sds);
        self.sds.insert(
            id,
            SdsStream {
                tx,
                names: Vec::new(),
                sent: BTreeMap::new(),
            },
        );
        self.refuse_if_asked(id);
        id
    }

    fn refuse_if_asked(&mut self, id: u64) {
        let Some(status) = self.refuse.clone() else {
            return;
        };
        if let Some(s) = self.ads.get(&id) {
            let _ = s.tx.send(Err(status.clone()));
        }
        if let Some(s) = self.sds.get(&id) {
            let _ = s.tx.send(Err(status));
        }
        self.close(id);
    }

    pub fn close(&mut self, id: u64) {
        self.ads.remove(&id);
        self.sds.remove(&id);
        if let Some(r) = self.records.get_mut(id as usize) {
            r.closed.get_or_insert_with(Instant::now);
        }
    }

    /// Ends every open stream: with `status` sent to the client (None: silently, as when the
    /// connection is gone).
    pub fn close_all(&mut self, status: Option<Status>) {
        let ids: Vec<u64> = self.ads.keys().chain(self.sds.keys()).copied().collect();
        for id in ids {
            if let Some(st) = &status {
                if let Some(s) = self.ads.get(&id) {
                    let _ = s.tx.send(Err(st.clone()));
                }
                if let Some(s) = self.sds.get(&id) {
                    let _ = s.tx.send(Err(st.clone()));
                }
            }
            self.close(id);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Delta ADS
    // -----------------------------------------------------------------------------------------

    pub fn on_delta(&mut self, id: u64, req: DeltaDiscoveryRequest) {
        let rec = Request {
            at: Instant::now(),
            type_url: req.type_url.clone(),
            node: req.node.as_ref().map(NodeInfo::from),
            subscribe: req.resource_names_subscribe.clone(),
            unsubscribe: req.resource_names_unsubscribe.clone(),
            initial_versions: req
                .initial_resource_versions
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            resource_names: Vec::new(),
            response_nonce: req.response_nonce.clone(),
            error: req.error_detail.as_ref().map(|e| e.message.clone()),
        };
        if let Some(r) = self.records.get_mut(id as usize) {
            r.requests.push(rec);
        }
        let t = req.type_url;
        let Some(st) = self.ads.get_mut(&id) else {
            return;
        };
        for n in &req.resource_names_unsubscribe {
            let key = (t.clone(), n.clone());
            st.subscribed.remove(&key);
            st.known.remove(&key);
        }
        for (n, v) in &req.initial_resource_versions {
            st.known.insert((t.clone(), n.clone()), Some(v.clone()));
        }
        let mut fresh = Vec::new();
        for n in &req.resource_names_subscribe {
            if n == "*" {
                // No wildcard: aether subscribes by name only.
                continue;
            }
            let key = (t.clone(), n.clone());
            st.subscribed.insert(key.clone());
            if !req.initial_resource_versions.contains_key(n) {
                st.known.remove(&key);
            }
            fresh.push(key);
        }
        for (n, _) in req.initial_resource_versions {
            let key = (t.clone(), n);
            if !fresh.contains(&key) && st.subscribed.contains(&key) {
                fresh.push(key);
            }
        }
        if self.wildcard && !st.wildcarded {
            st.wildcarded = true;
            for key in self.built.keys().filter(|k| k.0 != SECRET_TYPE) {
                if st.subscribed.insert(key.clone()) {
                    fresh.push(key.clone());
                }
            }
        }
        // A Cluster whose EDS name the client already has (another Cluster shares it) is
        // followed by that assignment: Envoy asks for no name it already watches, and the new
        // Cluster would warm forever.
        let mut resend: Vec<Key> = Vec::new();
        let st = &self.ads[&id];
        if self.resend_assignments {
            for k in fresh.iter().filter(|k| k.0 == CLUSTER_TYPE) {
                let Some(eds) = self.current(k).and_then(|r| eds_of(&r.any)) else {
                    continue;
                };
                let cla = (CLA_TYPE.to_string(), eds);
                let has = self.current(&cla).map(|r| Some(r.version.clone()));
                if st.subscribed.contains(&cla)
                    && has.is_some()
                    && st.known.get(&cla) == has.as_ref()
                {
                    resend.push(cla);
                }
            }
        }
        self.delta_respond(id, &fresh, false);
        if !resend.is_empty() {
            self.delta_respond(id, &resend, true);
        }
    }

    /// Sends stream `id` what it lacks of `keys` (all of them when `force`); returns the nonces.
    fn delta_respond(&mut self, id: u64, keys: &[Key], force: bool) -> Vec<String> {
        let Some(st) = self.ads.get(&id) else {
            return Vec::new();
        };
        let mut by_type: BTreeMap<String, Delta> = BTreeMap::new();
        for key in keys {
            if self.held.contains(&key.1) || !st.subscribed.contains(key) {
                continue;
            }
            let known = st.known.get(key);
            match self.current(key) {
                Some(r) => {
                    if !force && known == Some(&Some(r.version.clone())) {
                        continue;
                    }
                    by_type
                        .entry(key.0.clone())
                        .or_default()
                        .0
                        .push((key.1.clone(), r.clone()));
                }
                None => {
                    if !force && known == Some(&None) {
                        continue;
                    }
                    by_type
                        .entry(key.0.clone())
                        .or_default()
                        .1
                        .push(key.1.clone());
                }
            }
        }
        let mut nonces = Vec::new();
        for (type_url, (resources, removed)) in by_type {
            let nonce = self.nonce();
            let resp = DeltaDiscoveryResponse {
                system_version_info: nonce.clone(),
                type_url: type_url.clone(),
                nonce: nonce.clone(),
                resources: resources
                    .iter()
                    .map(|(name, r)| Resource {
                        name: name.clone(),
                        version: r.version.clone(),
                        resource: Some(r.any.clone()),
                        ..Default::default()
                    })
                    .collect(),
                removed_resources: removed.clone(),
                ..Default::default()
            };
            let st = self.ads.get_mut(&id).expect("stream is open");
            if st.tx.send(Ok(resp)).is_err() {
                continue;
            }
            for (name, r) in &resources {
                st.known
                    .insert((type_url.clone(), name.clone()), Some(r.version.clone()));
            }
            for name in &removed {
                st.known.insert((type_url.clone(), name.clone()), None);
            }
            if let Some(rec) = self.records.get_mut(id as usize) {
                rec.responses.push(Response {
                    at: Instant::now(),
                    type_url: type_url.clone(),
                    nonce: nonce.clone(),
                    resources: resources
                        .iter()
                        .map(|(n, r)| (n.clone(), r.version.clone()))
                        .collect(),
                    removed,
                });
            }
            nonces.push(nonce);
        }
        nonces
    }

    // -----------------------------------------------------------------------------------------
    // SDS (state of the world)
    // -----------------------------------------------------------------------------------------

    pub fn on_sds(&mut self, id: u64, req: DiscoveryRequest) {
        let rec = Request {
            at: Instant::now(),
            type_url: req.type_url.clone(),
            node: req.node.as_ref().map(NodeInfo::from),
            subscribe: Vec::new(),
            unsubscribe: Vec::new(),
            initial_versions: BTreeMap::new(),
            resource_names: req.resource_names.clone(),
            response_nonce: req.response_nonce.clone(),
            error: req.error_detail.as_ref().map(|e| e.message.clone()),
        };
        if let Some(r) = self.records.get_mut(id as usize) {
            r.requests.push(rec);
        }
        let Some(st) = self.sds.get_mut(&id) else {
            return;
        };
        if req.error_detail.is_some() {
            return;
        }
        if !req.response_nonce.is_empty() && req.resource_names == st.names {
            return; // an ACK
        }
        st.names = req.resource_names;
        self.sds_respond(id, true);
    }

    /// Sends stream `id` the secrets it names (those that exist and are not held), unless it
    /// already has exactly these versions and `force` is false.
    fn sds_respond(&mut self, id: u64, force: bool) -> Vec<String> {
        let Some(st) = self.sds.get(&id) else {
            return Vec::new();
        };
        let mut now: BTreeMap<String, Res> = BTreeMap::new();
        for n in &st.names {
            if self.held.contains(n) {
                continue;
            }
            if let Some(r) = self.current(&(SECRET_TYPE.to_string(), n.clone())) {
                now.insert(n.clone(), r.clone());
            }
        }
        let versions: BTreeMap<String, String> = now
            .iter()
            .map(|(n, r)| (n.clone(), r.version.clone()))
            .collect();
        if now.is_empty() || (!force && versions == st.sent) {
            return Vec::new();
        }
        let nonce = self.nonce();
        let resp = DiscoveryResponse {
            version_info: version_of(&format!("{versions:?}")),
            resources: now.values().map(|r| r.any.clone()).collect(),
            type_url: SECRET_TYPE.into(),
            nonce: nonce.clone(),
            ..Default::default()
        };
        let st = self.sds.get_mut(&id).expect("stream is open");
        if st.tx.send(Ok(resp)).is_err() {
            return Vec::new();
        }
        st.sent = versions.clone();
        if let Some(rec) = self.records.get_mut(id as usize) {
            rec.responses.push(Response {
                at: Instant::now(),
                type_url: SECRET_TYPE.into(),
                nonce: nonce.clone(),
                resources: versions.into_iter().collect(),
                removed: Vec::new(),
            });
        }
        vec![nonce]
    }

    // -----------------------------------------------------------------------------------------
    // Pushes
    // -----------------------------------------------------------------------------------------

    /// Sends every stream what changed for the names it subscribed to (and, with
    /// `resend_assignments`, the assignment of every changed Cluster, changed or not).
    pub fn push_all(&mut self) {
        let ids: Vec<u64> = self.ads.keys().copied().collect();
        for id in ids {
            let st = &self.ads[&id];
            let keys: Vec<Key> = st.subscribed.iter().cloned().collect();
            let changed = |k: &Key| match self.current(k) {
                Some(r) => st.known.get(k) != Some(&Some(r.version.clone())),
                None => st.known.get(k) != Some(&None),
            };
            let mut resend: Vec<Key> = Vec::new();
            if self.resend_assignments {
                for k in keys.iter().filter(|k| k.0 == CLUSTER_TYPE) {
                    if self.held.contains(&k.1) || !changed(k) {
                        continue;
                    }
                    let Some(eds) = self.current(k).and_then(|r| eds_of(&r.any)) else {
                        continue;
                    };
                    let cla = (CLA_TYPE.to_string(), eds);
                    if st.subscribed.contains(&cla) && !changed(&cla) {
                        resend.push(cla);
                    }
                }
            }
            self.delta_respond(id, &keys, false);
            if !resend.is_empty() {
                self.delta_respond(id, &resend, true);
            }
        }
        let ids: Vec<u64> = self.sds.keys().copied().collect();
        for id in ids {
            self.sds_respond(id, false);
        }
    }

    /// Sends every ADS stream a response of `type_url` removing `name`, and nothing else.
    pub fn send_removed(&mut self, type_url: &str, name: &str) -> Vec<String> {
        let mut nonces = Vec::new();
        let ids: Vec<u64> = self.ads.keys().copied().collect();
        for id in ids {
            let nonce = self.nonce();
            let resp = DeltaDiscoveryResponse {
                system_version_info: nonce.clone(),
                type_url: type_url.to_string(),
                nonce: nonce.clone(),
                removed_resources: vec![name.to_string()],
                ..Default::default()
            };
            if self.ads[&id].tx.send(Ok(resp)).is_err() {
                continue;
            }
            if let Some(rec) = self.records.get_mut(id as usize) {
                rec.responses.push(Response {
                    at: Instant::now(),
                    type_url: type_url.to_string(),
                    nonce: nonce.clone(),
                    resources: Vec::new(),
                    removed: vec![name.to_string()],
                });
            }
            nonces.push(nonce);
        }
        nonces
    }

    /// Sends `name` again (same version) to every stream subscribed to it; returns the nonces.
    pub fn resend(&mut self, name: &str) -> Vec<String> {
        let mut nonces = Vec::new();
        let ids: Vec<u64> = self.ads.keys().copied().collect();
        for id in ids {
            let keys: Vec<Key> = self.ads[&id]
                .subscribed
                .iter()
                .filter(|k| k.1 == name)
                .cloned()
                .collect();
            nonces.extend(self.delta_respond(id, &keys, true));
        }
        let ids: Vec<u64> = self.sds.keys().copied().collect();
        for id in ids {
            if self.sds[&id].names.iter().any(|n| n == name) {
                nonces.extend(self.sds_respond(id, true));
            }
        }
        nonces
    }
}
