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

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::assembly::State;
use super::subscriptions::Kind;
use super::{channel, node, resources};
use crate::catalog::model::clock_secs;
use crate::catalog::CatalogStore;
use crate::config::{Config, XdsConfig};
use crate::identity::IdentityStore;

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
        let node = node::build(cfg, Some(xds), Some(&own));
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
                    super::metrics::metrics().connected.set(0);
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
        state.subs.restart();
        self.sync_subscriptions(state, &mut out, true);
        // As Envoy counts it: connected once the stream is started, before any answer.
        super::metrics::metrics().connected.set(1);
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

    /// Tells the server about subscription changes; forgets what is no longer wanted. Only
    /// the services touched since the last call are looked at (`initial`: a new stream, told
    /// everything).
    fn sync_subscriptions(&self, state: &mut State, out: &mut Outgoing, initial: bool) {
        for svc in std::mem::take(&mut state.sub_dirty) {
            let needs = state.needs_of(&svc, &self.mesh_domain);
            state.subs.need(svc, needs);
        }
        for kind in Kind::ALL {
            let Some(change) = state.subs.next_change(kind, initial) else {
                continue;
            };
            let initial_resource_versions = if initial {
                state
                    .held_versions(kind)
                    .filter(|(n, _)| state.subs.needed(kind, n))
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect()
            } else {
                HashMap::new()
            };
            out.send(DeltaDiscoveryRequest {
                type_url: kind.type_url().into(),
                resource_names_subscribe: change.subscribe,
                resource_names_unsubscribe: change.unsubscribe.clone(),
                initial_resource_versions,
                ..Default::default()
            });
            for name in change.unsubscribe {
                state.forget(kind, name, &self.mesh_domain);
            }
        }
    }

    fn handle(&self, state: &mut State, out: &mut Outgoing, resp: DeltaDiscoveryResponse) {
        let Some(kind) = Kind::of(&resp.type_url) else {
            tracing::warn!(type_url = %resp.type_url, "control plane: unexpected resource type; ignored");
            out.send(ack(&resp, None));
            return;
        };
        match state.accept(kind, &resp, &self.mesh_domain, &self.trust_domain) {
            Ok(changed) => {
                super::metrics::update(kind.metric(), true);
                out.send(ack(&resp, None));
                if changed {
                    self.sync_subscriptions(state, out, false);
                    self.apply(state);
                } else {
                    self.flush_status(state);
                }
            }
            Err(e) => {
                super::metrics::update(kind.metric(), false);
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

    /// A new catalog from what the stream holds, applied to the store.
    fn apply(&self, state: &mut State) {
        let catalog = state.catalog(&self.mesh_domain, self.cfg.cluster_timeout);
        self.store.apply(catalog);
        self.flush_status(state);
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
            match state.version_of(&name) {
                Some(v) => status.resources.insert(name.clone(), v.clone()),
                None => status.resources.remove(&name),
            };
            match state.is_absent(&name) {
                true => status.absent.insert(name),
                false => status.absent.remove(&name),
            };
        }
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
