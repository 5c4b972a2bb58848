//! A control plane for the xDS tests (SPEC section 9): delta ADS for Clusters,
//! ClusterLoadAssignments and Secrets, and SDS (`StreamSecrets`), served with tonic from
//! Envoy's generated v3 types, on a TCP or unix listener.
//!
//! * The input is a catalog-shaped [`Fixture`]: services (default port, identity, tcp ports,
//!   timeouts, routes, endpoints with ports, locality, labels, draining, weight) and the
//!   workload secrets. From it the control plane makes Istio-shaped resources
//!   ([`resources`]): an EDS Cluster `svc.<domain>` for the default port and `svc.<domain>:P`
//!   for every other advertised port (never `svc:<default>`), whose EDS name is
//!   `outbound|P||svc.<domain>`; a per-port ClusterLoadAssignment under that name; Secrets
//!   `default` and `ROOTCA`. With [`Fixture::with_default_port_aliases`] it also answers
//!   `svc.<domain>:<default>` with the default Cluster under that name, for Envoy's on-demand
//!   discovery (which asks for the authority as written).
//! * Delta ADS per stream: a subscribe is answered with the named resources that exist, the
//!   others in `removed_resources`; a change ([`ControlPlane::set`]) goes to every stream
//!   subscribed to a changed or removed name; unsubscribes are honoured; each response has a
//!   fresh nonce, each resource a version (a hash of what it is made from). A resubscribe with
//!   `initial_resource_versions` gets only what differs. As Istio does for Envoy, a changed
//!   Cluster (or one new to the stream whose EDS name another Cluster shares) is followed by
//!   its assignment, resent even when unchanged ([`ControlPlane::resend_assignments`]). `StreamAggregatedResources` is unimplemented.
//! * SDS: each stream names its secrets; they are answered once they exist and pushed when
//!   they change.
//! * Everything clients send is recorded ([`StreamRecord`]): node, subscribes, unsubscribes,
//!   ACKs, NACKs with their message, initial versions; and every response sent. For one
//!   client, [`ControlPlane::answers_of_node`] pairs each response with its ACK or NACK.
//! * Test controls: [`ControlPlane::set`] / [`ControlPlane::update`],
//!   [`ControlPlane::drop_streams`], [`ControlPlane::stop`] and [`ControlPlane::serve`] (again,
//!   on the same address), [`ControlPlane::serve_invalid`], [`ControlPlane::hold`],
//!   [`ControlPlane::resend`], [`ControlPlane::subscribes`].
//!
//! Not re-exported by `common`: `use common::xds::*;`.

pub mod fixture;
mod grpcio;
pub mod resources;
mod server;
mod state;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use prost::Message;
use tonic::Status;

pub use fixture::*;
#[allow(unused_imports)]
pub use resources::{
    cluster_name, eds_name, set_tls, tls_of, uri_san, CLA_TYPE, CLUSTER_TYPE, SECRET_TYPE,
};
pub use server::Listen;
#[allow(unused_imports)]
pub use state::{Api, NodeInfo, Request, Response, StreamRecord};

use super::{
    empty, eventually_every, get, holds, poll_until, tcp_connect, Certs, HttpApp, HttpClient, Net,
    PodNet, Proxy, Reply, PACE,
};
use resources::{pack, version_of, Key, Res};
use state::State;

/// The TCP address tests give their control plane: port 18000 on pod 15's proxy host.
pub fn cp_addr(net: &Net) -> SocketAddr {
    SocketAddr::new(net.pod(15).proxy_ip(), 18000)
}

/// Which gRPC server a control plane is served by; the state behind both is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// tonic, in the test process: response headers as soon as a stream is accepted.
    Tonic,
    /// The gRPC project's Python server (`grpcio_control_plane.py`): response headers only
    /// with the first response, as grpc-go and gRPC C++ send them.
    Grpcio,
}

/// Runs `async fn $name(server: Server)` once per control-plane server, as the tests
/// `$name::tonic` and `$name::grpcio`.
#[macro_export]
macro_rules! on_both_control_planes {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tonic() {
                super::$name($crate::common::xds::Server::Tonic).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn grpcio() {
                super::$name($crate::common::xds::Server::Grpcio).await
            }
        }
    )*};
}

enum Running {
    Tonic(server::Running),
    Grpcio(Box<grpcio::Running>),
}

impl Running {
    async fn stop(self) {
        match self {
            Running::Tonic(r) => r.stop().await,
            Running::Grpcio(r) => r.stop().await,
        }
    }
}

/// A test control plane. Stops serving when dropped.
pub struct ControlPlane {
    state: Arc<State>,
    server: Server,
    listen: Listen,
    running: Mutex<Option<Running>>,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // Cuts the connections and stops accepting.
        drop(
            self.running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }
}

impl ControlPlane {
    /// A control plane for `listen` with `fixture`, served by `server` once
    /// [`ControlPlane::serve`] is called.
    pub fn new(server: Server, listen: Listen, fixture: Fixture) -> ControlPlane {
        let state = State::new(fixture);
        state.lock().resend_assignments = true;
        ControlPlane {
            state: Arc::new(state),
            server,
            listen,
            running: Mutex::new(None),
        }
    }

    /// [`ControlPlane::new`], then serving.
    pub async fn start(server: Server, listen: Listen, fixture: Fixture) -> ControlPlane {
        let cp = ControlPlane::new(server, listen, fixture);
        cp.serve().await;
        cp
    }

    /// Starts serving (again) on its address.
    pub async fn serve(&self) {
        assert!(!self.is_serving(), "the control plane is already serving");
        let r = match self.server {
            Server::Tonic => Running::Tonic(server::serve(self.state.clone(), &self.listen).await),
            Server::Grpcio => Running::Grpcio(Box::new(
                grpcio::serve(self.state.clone(), &self.listen).await,
            )),
        };
        *self.running.lock().unwrap() = Some(r);
    }

    /// A graceful restart of the grpcio server: a new process takes the address, the old one
    /// sends GOAWAY and cancels its streams after its grace period (1 s). Returns once the old
    /// one has exited.
    pub async fn restart_gracefully(&self) {
        let running = self.running.lock().unwrap().take();
        let Some(Running::Grpcio(mut r)) = running else {
            panic!("a graceful restart is a grpcio control plane's");
        };
        r.restart_gracefully().await;
        *self.running.lock().unwrap() = Some(Running::Grpcio(r));
    }

    /// Kills it: every connection is cut, the listener closed, every stream ended. The state
    /// (fixture, records, overrides) stays for a later [`ControlPlane::serve`].
    pub async fn stop(&self) {
        let r = self.running.lock().unwrap().take();
        if let Some(r) = r {
            r.stop().await;
        }
        self.state.lock().close_all(None);
    }

    pub fn is_serving(&self) -> bool {
        self.running.lock().unwrap().is_some()
    }

    /// The address as a proxy config spells it (`host:port` or `unix:///path`).
    pub fn address(&self) -> String {
        self.listen.config_address()
    }

    // -----------------------------------------------------------------------------------------
    // The mesh it describes
    // -----------------------------------------------------------------------------------------

    pub fn fixture(&self) -> Fixture {
        self.state.lock().fixture.clone()
    }

    /// Replaces the fixture and pushes what changed to every subscribed stream.
    pub fn set(&self, fixture: Fixture) {
        self.state.lock().set_fixture(fixture);
    }

    /// Edits the fixture in place, then pushes as [`ControlPlane::set`].
    pub fn update(&self, f: impl FnOnce(&mut Fixture)) {
        let mut st = self.state.lock();
        let mut fx = st.fixture.clone();
        f(&mut fx);
        st.set_fixture(fx);
    }

    /// The Cluster `name` as the fixture makes it (decoded), for hand-made variants.
    pub fn cluster(&self, name: &str) -> Cluster {
        let fx = self.fixture();
        let built = resources::build(&fx);
        let r = built
            .get(&(CLUSTER_TYPE.to_string(), name.to_string()))
            .unwrap_or_else(|| panic!("the fixture makes no Cluster {name}"));
        Cluster::decode(r.any.value.as_slice()).expect("a Cluster")
    }

    /// The encoded size of the resource served now for (type, name).
    pub fn encoded_len(&self, type_url: &str, name: &str) -> usize {
        let k: Key = (type_url.to_string(), name.to_string());
        let st = self.state.lock();
        let r = st
            .current(&k)
            .unwrap_or_else(|| panic!("no {type_url} {name}"));
        r.any.value.len()
    }

    /// Serves `cluster` (typically invalid) as the Cluster `name` instead of the fixture's, and
    /// pushes it.
    pub fn serve_invalid(&self, name: &str, cluster: Cluster) {
        let bytes = cluster.encode_to_vec();
        let res = Res {
            version: version_of(&format!("override|{name}|{bytes:?}")),
            any: pack(&cluster),
        };
        let mut st = self.state.lock();
        st.overrides.insert(name.to_string(), res);
        st.push_all();
    }

    /// Back to the fixture's Cluster `name`; pushes it.
    pub fn clear_invalid(&self, name: &str) {
        let mut st = self.state.lock();
        st.overrides.remove(name);
        st.push_all();
    }

    /// Never answers `name` (any type) from now on: subscribes to it stay unanswered.
    pub fn hold(&self, name: &str) {
        self.state.lock().held.insert(name.to_string());
    }

    /// Answers `name` again; streams subscribed to it get it now.
    pub fn release(&self, name: &str) {
        let mut st = self.state.lock();
        st.held.remove(name);
        st.push_all();
    }

    /// Sends `name` again, unchanged (same version), to every stream subscribed to it; returns
    /// the nonces of those responses.
    pub fn resend(&self, name: &str) -> Vec<String> {
        self.state.lock().resend(name)
    }

    /// Istio's habit (on by default): after pushing a changed Cluster, or a Cluster new to the
    /// stream whose EDS name the client already has, push that assignment again even when
    /// unchanged (Envoy does not ask for a name it already watches). Off: only what changed.
    pub fn resend_assignments(&self, on: bool) {
        self.state.lock().resend_assignments = on;
    }

    /// From now on every new stream (ADS and SDS) is ended with `status` as soon as it is
    /// accepted, before any response; None: streams are served again.
    pub fn refuse_streams(&self, status: Option<Status>) {
        self.state.lock().refuse = status;
    }

    /// As servers that treat a node as a wildcard subscriber do: on a stream's first request,
    /// every Cluster and every assignment of the fixture is subscribed for it and sent, whatever
    /// it asked for (assignments before any request of their type).
    pub fn wildcard(&self, on: bool) {
        self.state.lock().wildcard = on;
    }

    /// Sends every ADS stream a response of `type_url` whose only content is `name` in
    /// `removed_resources`; returns the nonces.
    pub fn send_removed(&self, type_url: &str, name: &str) -> Vec<String> {
        self.state.lock().send_removed(type_url, name)
    }

    /// Ends every open stream with UNAVAILABLE (the connections stay), so clients reconnect.
    pub fn drop_streams(&self) {
        self.state.lock().close_all(Some(Status::unavailable(
            "the control plane dropped the stream",
        )));
    }

    /// The version served now for (type, name), if it exists.
    pub fn version(&self, type_url: &str, name: &str) -> Option<String> {
        let k: Key = (type_url.to_string(), name.to_string());
        self.state.lock().current(&k).map(|r| r.version.clone())
    }

    // -----------------------------------------------------------------------------------------
    // What clients sent
    // -----------------------------------------------------------------------------------------

    /// Every stream so far (open or closed), in the order they opened.
    pub fn streams(&self) -> Vec<StreamRecord> {
        self.state.lock().records.clone()
    }

    pub fn ads_streams(&self) -> Vec<StreamRecord> {
        self.streams_of(Api::DeltaAds)
    }

    pub fn sds_streams(&self) -> Vec<StreamRecord> {
        self.streams_of(Api::Sds)
    }

    fn streams_of(&self, api: Api) -> Vec<StreamRecord> {
        self.streams()
            .into_iter()
            .filter(|s| s.api == api)
            .collect()
    }

    /// Streams of `api` open now.
    pub fn open_streams(&self, api: Api) -> usize {
        self.streams_of(api)
            .iter()
            .filter(|s| s.closed.is_none())
            .count()
    }

    /// How many times `name` appeared in a `resource_names_subscribe`, over every stream.
    pub fn subscribes(&self, name: &str) -> usize {
        self.ads_requests()
            .iter()
            .map(|r| r.subscribe.iter().filter(|n| *n == name).count())
            .sum()
    }

    /// How many times `name` appeared in a `resource_names_unsubscribe`.
    pub fn unsubscribes(&self, name: &str) -> usize {
        self.ads_requests()
            .iter()
            .map(|r| r.unsubscribe.iter().filter(|n| *n == name).count())
            .sum()
    }

    /// Every name ever subscribed to over delta ADS.
    pub fn subscribed_names(&self) -> BTreeSet<String> {
        self.ads_requests()
            .into_iter()
            .flat_map(|r| r.subscribe)
            .collect()
    }

    /// Every name of type `type_url` ever subscribed to over delta ADS.
    pub fn subscribed_of(&self, type_url: &str) -> BTreeSet<String> {
        self.ads_requests()
            .into_iter()
            .filter(|r| r.type_url == type_url)
            .flat_map(|r| r.subscribe)
            .collect()
    }

    /// Whether some open stream's client has the version of `name` (of any type) served now:
    /// the stream's last response carrying `name` carried it and was ACKed, or, with no such
    /// response, the stream opened with it in `initial_resource_versions`.
    pub fn acked_current(&self, name: &str) -> bool {
        let st = self.state.lock();
        let versions: Vec<String> = [CLUSTER_TYPE, CLA_TYPE, SECRET_TYPE]
            .iter()
            .filter_map(|t| st.current(&(t.to_string(), name.to_string())))
            .map(|r| r.version.clone())
            .collect();
        st.records.iter().filter(|s| s.closed.is_none()).any(|s| {
            let last = s
                .responses
                .iter()
                .rev()
                .find(|resp| resp.resources.iter().any(|(n, _)| n == name));
            match last {
                Some(resp) => {
                    resp.resources
                        .iter()
                        .any(|(n, v)| n == name && versions.contains(v))
                        && s.requests
                            .iter()
                            .any(|r| r.response_nonce == resp.nonce && r.error.is_none())
                }
                None => s.requests.iter().any(|r| {
                    r.initial_versions
                        .get(name)
                        .is_some_and(|v| versions.contains(v))
                }),
            }
        })
    }

    /// Waits until [`ControlPlane::acked_current`] holds for every name.
    pub async fn wait_acked(&self, names: &[&str], limit: Duration) {
        self.wait_until(limit, &format!("ACK of the current {names:?}"), |cp| {
            names.iter().all(|n| cp.acked_current(n))
        })
        .await
    }

    /// Every delta ADS request, in order per stream, streams in order.
    pub fn ads_requests(&self) -> Vec<Request> {
        self.ads_streams()
            .into_iter()
            .flat_map(|s| s.requests)
            .collect()
    }

    /// Every ACK (delta ADS and SDS).
    pub fn acks(&self) -> Vec<Request> {
        self.streams()
            .into_iter()
            .flat_map(|s| s.requests)
            .filter(Request::is_ack)
            .collect()
    }

    /// Every NACK (delta ADS and SDS), with its `error_detail.message` in `error`.
    pub fn nacks(&self) -> Vec<Request> {
        self.streams()
            .into_iter()
            .flat_map(|s| s.requests)
            .filter(Request::is_nack)
            .collect()
    }

    /// Every delta ADS response sent on the streams of the client whose node id is `node_id`,
    /// each with how it was answered, in order.
    pub fn answers_of_node(&self, node_id: &str) -> Vec<Answered> {
        self.ads_streams()
            .into_iter()
            .filter(|s| s.first_node().is_some_and(|n| n.id == node_id))
            .flat_map(|s| {
                s.responses
                    .iter()
                    .map(|resp| Answered {
                        answer: s
                            .requests
                            .iter()
                            .find(|r| r.response_nonce == resp.nonce)
                            .map(|r| match &r.error {
                                None => Answer::Ack,
                                Some(m) => Answer::Nack(m.clone()),
                            }),
                        response: resp.clone(),
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Whether some request answered the response with `nonce`, and how: Some(None) an ACK,
    /// Some(Some(message)) a NACK.
    pub fn answer_to(&self, nonce: &str) -> Option<Option<String>> {
        self.streams()
            .into_iter()
            .flat_map(|s| s.requests)
            .find(|r| r.response_nonce == nonce)
            .map(|r| r.error)
    }

    /// Every response that listed `name` in `removed_resources`.
    pub fn sent_removed(&self, name: &str) -> Vec<Response> {
        self.streams()
            .into_iter()
            .flat_map(|s| s.responses)
            .filter(|r| r.removed.iter().any(|n| n == name))
            .collect()
    }

    /// A readable account of every stream, for assertion messages.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for s in self.streams() {
            out.push_str(&format!(
                "stream {} {:?} node {:?} {}\n",
                s.id,
                s.api,
                s.first_node(),
                if s.closed.is_some() { "closed" } else { "open" }
            ));
            let t0 = s.opened;
            let mut events: Vec<(Duration, String)> = Vec::new();
            for r in &s.requests {
                events.push((
                    r.at - t0,
                    format!(
                        "  <- {} sub {:?} unsub {:?} names {:?} init {:?} nonce {:?}{}",
                        short(&r.type_url),
                        r.subscribe,
                        r.unsubscribe,
                        r.resource_names,
                        r.initial_versions,
                        r.response_nonce,
                        r.error
                            .as_ref()
                            .map(|e| format!(" NACK {e:?}"))
                            .unwrap_or_default()
                    ),
                ));
            }
            for r in &s.responses {
                events.push((
                    r.at - t0,
                    format!(
                        "  -> {} {} resources {:?} removed {:?}",
                        short(&r.type_url),
                        r.nonce,
                        r.resources,
                        r.removed
                    ),
                ));
            }
            events.sort_by_key(|e| e.0);
            for (t, e) in events {
                out.push_str(&format!("  {:>8.3}s {e}\n", t.as_secs_f64()));
            }
        }
        out
    }

    /// Polls until `pred` holds; panics after `limit` with `what` and the record.
    pub async fn wait_until(
        &self,
        limit: Duration,
        what: &str,
        pred: impl Fn(&ControlPlane) -> bool,
    ) {
        let seen = poll_until(limit, PACE, async || holds(pred(self))).await;
        assert!(
            seen.is_ok(),
            "{what}: not seen by the control plane after {limit:?}; streams:\n{}",
            self.summary()
        );
    }
}

/// How a client answered one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Ack,
    /// With the `error_detail.message`.
    Nack(String),
}

/// One response sent on a stream and the client's answer to it (None: not answered yet).
#[derive(Debug, Clone)]
pub struct Answered {
    pub response: Response,
    pub answer: Option<Answer>,
}

fn short(type_url: &str) -> &str {
    type_url.rsplit('.').next().unwrap_or(type_url)
}

// ---------------------------------------------------------------------------------------------
// Proxy configs of xDS-fed pods
// ---------------------------------------------------------------------------------------------

/// The server pod most xDS tests route to: `payments`' proxy with an app on 8080 and one on
/// 9090, both `auto`.
pub struct PaymentsPod {
    pub app8080: HttpApp,
    pub app9090: HttpApp,
    _proxy: Proxy,
    ip: std::net::IpAddr,
}

impl PaymentsPod {
    pub async fn start(certs: &Certs, pod: PodNet) -> PaymentsPod {
        let app8080 = HttpApp::auto(pod.app(8080)).await;
        let app9090 = HttpApp::auto(pod.app(9090)).await;
        let ports = [
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: auto }",
        ];
        let proxy = super::mesh::server_proxy(certs, pod, "payments", &ports).await;
        PaymentsPod {
            app8080,
            app9090,
            _proxy: proxy,
            ip: pod.proxy_ip(),
        }
    }

    /// A service pinned to `identity` whose one endpoint is this pod, on 8080 and 9090.
    pub fn service(&self, certs: &Certs, identity: &str) -> Service {
        Service::new(&certs.spiffe_id(identity)).endpoint(Endpoint::new(self.ip, &[8080, 9090]))
    }
}

/// The config of a client pod fed by xDS: identity from files (`stem`), the pod's listeners,
/// `discovery.xds` with `address`, `cluster_timeout: 2s` and the lines of `xds_extra` (each
/// `key: value`), then `extra` appended as is.
pub fn xds_client_config(
    certs: &Certs,
    pod: PodNet,
    stem: &str,
    address: &str,
    xds_extra: &[&str],
    extra: &str,
) -> String {
    format!(
        "trust_domain: {}\n{}{}{}{extra}",
        certs.trust_domain(),
        certs.identity_yaml(stem),
        pod.listeners_yaml(8080, &[]),
        discovery_yaml(address, xds_extra)
    )
}

/// The `discovery:` section: `address`, `cluster_timeout: 2s` unless `xds_extra` sets one,
/// and `xds_extra`'s lines.
pub fn discovery_yaml(address: &str, xds_extra: &[&str]) -> String {
    let mut y = format!("discovery:\n  xds:\n    address: \"{address}\"\n");
    if !xds_extra.iter().any(|l| l.starts_with("cluster_timeout:")) {
        y.push_str("    cluster_timeout: 2s\n");
    }
    for l in xds_extra {
        y.push_str(&format!("    {l}\n"));
    }
    y
}

/// Starts a client pod's proxy fed by the control plane at `address` (see
/// [`xds_client_config`]) with identity `frontend` from files, and waits until it is ready.
pub async fn xds_client(
    certs: &Certs,
    pod: PodNet,
    address: &str,
    xds_extra: &[&str],
    extra: &str,
) -> Proxy {
    let config = xds_client_config(certs, pod, "frontend", address, xds_extra, extra);
    Proxy::start(&config, "").await
}

/// `GET path` with `Host: authority` on a fresh HTTP/1.1 connection; errors are returned, not
/// panicked on (for load loops that count them).
pub async fn try_get(outbound: SocketAddr, authority: &str, path: &str) -> Result<Reply, String> {
    let tcp = tcp_connect(outbound).await?;
    let req = empty(get(path).header("host", authority));
    HttpClient::h1(tcp).await?.send(req).await
}

/// The `"xds"` object of `/config_dump`.
pub async fn xds_dump(p: &Proxy) -> serde_json::Value {
    let r = p.admin_get("/config_dump").await.expect("GET /config_dump");
    assert_eq!(r.status.as_u16(), 200, "/config_dump: {r:?}");
    let v = r.json();
    assert!(
        v["xds"].is_object(),
        "/config_dump has no \"xds\" object: {v}"
    );
    v["xds"].clone()
}

// ---------------------------------------------------------------------------------------------
// Load during pushes
// ---------------------------------------------------------------------------------------------

/// What one request of a [`Load`] got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An app answered 200; the port it listens on (`x-app-port`).
    App(u16),
    /// The proxy (or an app) answered something else: status and `x-aether-error`.
    Answer(u16, Option<String>),
    /// No answer at all: the connection failed or broke.
    Failed(String),
}

/// Workers sending `GET` for one authority back to back on keep-alive HTTP/1.1 connections to
/// a client proxy, recording every outcome with its time. A broken connection is recorded and
/// replaced.
pub struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    results: Arc<Mutex<Vec<(Instant, Outcome)>>>,
    tasks: tokio::task::JoinSet<()>,
}

impl Load {
    pub fn start(outbound: SocketAddr, authority: &str, workers: usize) -> Load {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let results = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..workers {
            let (stop, results) = (stop.clone(), results.clone());
            let authority = authority.to_string();
            tasks.spawn(async move {
                let mut client: Option<HttpClient> = None;
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    i += 1;
                    if client.is_none() {
                        match tcp_connect(outbound).await {
                            Ok(tcp) => match HttpClient::h1(tcp).await {
                                Ok(c) => client = Some(c),
                                Err(e) => {
                                    results.lock().unwrap().push((
                                        Instant::now(),
                                        Outcome::Failed(format!("h1 handshake: {e}")),
                                    ));
                                    continue;
                                }
                            },
                            Err(e) => {
                                results
                                    .lock()
                                    .unwrap()
                                    .push((Instant::now(), Outcome::Failed(e)));
                                tokio::time::sleep(Duration::from_millis(10)).await;
                                continue;
                            }
                        }
                    }
                    let req = empty(get(&format!("/load/{w}/{i}")).header("host", &authority));
                    let outcome = match client.as_mut().unwrap().send(req).await {
                        Ok(r) if r.status.as_u16() == 200 => Outcome::App(
                            r.header("x-app-port")
                                .and_then(|p| p.parse().ok())
                                .unwrap_or(0),
                        ),
                        Ok(r) => {
                            if r.header("connection") == Some("close") {
                                client = None;
                            }
                            Outcome::Answer(r.status.as_u16(), r.aether_error().map(str::to_string))
                        }
                        Err(e) => {
                            client = None;
                            Outcome::Failed(e)
                        }
                    };
                    results.lock().unwrap().push((Instant::now(), outcome));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
        }
        Load {
            stop,
            results,
            tasks,
        }
    }

    /// The outcomes so far, in time order.
    pub fn results(&self) -> Vec<(Instant, Outcome)> {
        let mut v = self.results.lock().unwrap().clone();
        v.sort_by_key(|r| r.0);
        v
    }

    pub fn count(&self) -> usize {
        self.results.lock().unwrap().len()
    }

    /// Waits until `n` more requests than now have finished.
    pub async fn wait_more(&self, n: usize, limit: Duration) {
        let target = self.count() + n;
        let what = format!("the load making {n} more requests ({target} in all)");
        eventually_every(limit, Duration::from_millis(10), &what, async || {
            let made = self.count();
            (made >= target)
                .then_some(())
                .ok_or_else(|| format!("{made} made"))
        })
        .await
    }

    /// Waits until some outcome satisfies `pred`.
    pub async fn wait_for(&self, limit: Duration, what: &str, pred: impl Fn(&Outcome) -> bool) {
        let seen = poll_until(limit, Duration::from_millis(10), async || {
            holds(self.results.lock().unwrap().iter().any(|(_, o)| pred(o)))
        })
        .await;
        assert!(
            seen.is_ok(),
            "{what}: not seen in {limit:?}; last outcomes: {:?}",
            self.results().iter().rev().take(5).collect::<Vec<_>>()
        );
    }

    /// Stops the workers; returns every outcome, in time order.
    pub async fn stop(mut self) -> Vec<(Instant, Outcome)> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        while tokio::time::timeout(super::IO_TIMEOUT, self.tasks.join_next())
            .await
            .expect("load workers stop")
            .is_some()
        {}
        self.results()
    }
}
