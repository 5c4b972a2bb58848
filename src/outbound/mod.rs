//! The outbound side: apps send plaintext HTTP/1.1, h2c (prior knowledge) or CONNECT to
//! `outbound.listen`. Data flows one way through the files here:
//!
//! listener (this file) -> `route` (authority -> service and port) -> `cluster` (the port's
//! endpoints) -> `lb` (one endpoint) -> `pool` / `connect` (a pooled or new mTLS connection,
//! SNI chosen and SAN pinned) -> `forward` (HTTP, with `retry`), `upgrade` (HTTP/1.1 upgrades)
//! or `tunnel` (CONNECT, and the bytes of upgraded connections). Connections the pod's rules
//! redirected here (transparent capture) are sorted by their original destination in `capture`.
//! `metrics` holds the families of breakers, retries, outlier ejection and capture.

pub mod abandon;
pub mod capture;
pub mod cluster;
pub mod connect;
pub mod explain;
pub mod forward;
pub mod h2_client;
pub mod lb;
pub mod metrics;
pub mod pool;
pub mod retry;
pub mod route;
pub mod tunnel;
pub mod upgrade;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

use crate::accesslog::{self, ConnLog, Decided, RequestLog};
use crate::catalog::{CatalogStore, PortProtocol};
use crate::config::{Config, Egress, Locality};
use crate::drain::{accept_until_closing, ActiveConnection, Drain, Phase, Tracker};
use crate::http::answer::{Body, Reason};
use crate::http::body::{Activity, BoxedRequest, ReqBody, RespBody, UpBody};
use crate::http::fin::FinTcp;
use crate::http::headers;
use crate::http::server::{
    serve_until_drained, sniff_codec, Codec, ConnRequests, Guarded, RequestOpen, Servers, Wire,
};
use crate::identity::IdentityStore;
use crate::identity::SpiffeId;
use crate::metrics::Direction;
use cluster::{ActiveGuard, Admitted, Cluster, Clusters};
use connect::Upstream;
use forward::InFlight;

pub struct Outbound {
    pub mesh_domain: String,
    pub locality: Option<Locality>,
    pub catalog: Arc<CatalogStore>,
    pub clusters: Arc<Clusters>,
    pub upstream: Upstream,
    pub servers: Servers,
    pub drain: Drain,
    pub tracker: Tracker,
    max_connections: usize,
    /// What captured connections to destinations outside the mesh get.
    egress: Egress,
}

/// What one request did, for the access log and metrics.
struct Outcome {
    resp: Response<Body>,
    reason: Option<Reason>,
    upstream: Option<SocketAddr>,
    service: Option<Arc<str>>,
    port: u16,
    /// The identity pinned on the upstream connection, once one was used.
    peer: Option<SpiffeId>,
    inflight: Option<InFlight>,
    /// The request's place under the cluster's circuit breaker.
    admitted: Option<Admitted>,
}

/// Where `route` left a request: answered (boxed: the rarer way, and the larger), or to be
/// forwarded to `cluster`.
enum Routed {
    Answered(Box<Outcome>),
    Forward(BoxedRequest, Arc<Cluster>, Admitted),
}

impl Routed {
    fn answered(out: Outcome) -> Routed {
        Routed::Answered(Box::new(out))
    }
}

impl Outcome {
    /// The outcome of a forwarded request.
    fn forwarded(sent: Result<(Response<UpBody>, InFlight), Reason>) -> Outcome {
        match sent {
            Ok((resp, inflight)) => Outcome {
                resp: resp.map(Either::Left),
                reason: None,
                upstream: Some(inflight.active.0.address),
                service: None,
                port: 0,
                peer: None,
                inflight: Some(inflight),
                admitted: None,
            },
            Err(r) => Outcome::error(r),
        }
    }

    /// Names the cluster a request was routed to, and its identity once an upstream was used.
    fn routed_to(mut self, cluster: &Cluster) -> Outcome {
        self.service = Some(cluster.service_label.clone());
        self.port = cluster.port;
        if self.upstream.is_some() {
            self.peer = Some(cluster.service.identity.clone());
        }
        self
    }

    fn error(reason: Reason) -> Outcome {
        Outcome {
            resp: reason.response(),
            reason: Some(reason),
            upstream: None,
            service: None,
            port: 0,
            peer: None,
            inflight: None,
            admitted: None,
        }
    }
}

impl Outbound {
    pub fn new(
        cfg: &Config,
        catalog: Arc<CatalogStore>,
        identity: Arc<IdentityStore>,
        drain: Drain,
        tracker: Tracker,
    ) -> Outbound {
        Outbound {
            mesh_domain: cfg.mesh_domain.clone(),
            locality: cfg.locality.clone(),
            clusters: Arc::new(Clusters::new(&cfg.mesh_domain, catalog.clone())),
            catalog,
            upstream: Upstream::new(cfg, identity),
            servers: Servers::new(),
            drain,
            tracker,
            max_connections: cfg.limits.max_connections_per_listener,
            egress: cfg.outbound.egress,
        }
    }

    /// Serves every outbound listener (the configured one, and `[::1]` on the same port when
    /// `dns.ipv6` captures IPv6 too), each with its own connection cap.
    pub async fn serve(self: Arc<Self>, listeners: Vec<TcpListener>) {
        self.upstream.pool.spawn_sweeper();
        self.follow_catalog();
        let (drain, tracker) = (self.drain.clone(), self.tracker.clone());
        let max = self.max_connections;
        let loops = listeners.into_iter().map(|listener| {
            // Only a listener whose address is known can tell captured connections apart.
            let listen = listener.local_addr().ok();
            let this = self.clone();
            let (drain, tracker) = (drain.clone(), tracker.clone());
            async move {
                accept_until_closing(
                    "outbound",
                    listener,
                    (max, true),
                    &drain,
                    &tracker,
                    |tcp, addr| this.clone().connection(tcp, addr, listen),
                )
                .await
            }
        });
        futures_util::future::join_all(loops).await;
    }

    /// On each new catalog: pooled connections to endpoints (or ports) that left, or whose
    /// pinned identity changed, leave the pool; requests in flight on them keep them open
    /// until they finish. TLS sessions for endpoints (or ports) that left are forgotten too.
    fn follow_catalog(self: &Arc<Self>) {
        let mut changed = self.catalog.subscribe();
        let this = Arc::downgrade(self);
        let mut seen = self.catalog.load_full();
        tokio::spawn(async move {
            while changed.changed().await.is_ok() {
                let Some(this) = this.upgrade() else { return };
                let catalog = this.catalog.load_full();
                // Consecutive catalogs: only what left needs looking at. After a skipped one,
                // connections made for it may match neither, so everything is checked.
                let skipped = catalog.version != seen.version + 1;
                if skipped || !catalog.upstreams_gone(&seen).is_empty() {
                    let live = catalog.live_upstreams();
                    this.upstream
                        .pool
                        .retain(|k| live.contains(&(k.endpoint, k.port, &k.identity)));
                    let places: std::collections::HashSet<(SocketAddr, u16)> =
                        live.iter().map(|(addr, port, _)| (*addr, *port)).collect();
                    for client in this.upstream.identity.current().clients() {
                        client.sessions.retain(|k| places.contains(k));
                    }
                }
                seen = catalog;
            }
        });
    }

    async fn connection(
        self: Arc<Self>,
        tcp: TcpStream,
        addr: SocketAddr,
        listen: Option<SocketAddr>,
    ) {
        let _active = ActiveConnection::new("outbound");
        // Keepalive and TCP_NODELAY came from the listener (`sockets::tune_listener`).
        // One getsockopt tells an explicit client from a redirected one (SPEC section 10).
        if let Some(dst) = listen.and_then(|l| capture::redirected(&tcp, l)) {
            // Boxed: the rare path's future stays out of the explicit client's.
            return Box::pin(self.captured(tcp, addr, dst)).await;
        }
        self.serve_http(tcp, addr, addr.ip(), 0).await;
    }

    /// A connection the pod's rules redirected here, sorted by its original destination `dst`
    /// (SPEC section 10, see `capture`) before any client byte is awaited.
    async fn captured(self: Arc<Self>, tcp: TcpStream, addr: SocketAddr, dst: SocketAddr) {
        let name = self.catalog.load().vips.service_at(dst.ip()).cloned();
        let Some(name) = name else {
            return capture::egress(self.egress, &self.drain, tcp, dst).await;
        };
        let auth = route::MeshAuthority {
            service: std::borrow::Cow::Borrowed(&name),
            port: Some(dst.port()),
        };
        match self.cluster_for(&auth).await {
            Ok((cluster, PortProtocol::Tcp)) => {
                let (up, locality) = (&self.upstream, self.locality.as_ref());
                capture::tunnel_to(up, locality, &cluster, &self.drain, tcp).await
            }
            // Not a tcp port (or not one the service has): HTTP, routed by Host.
            Ok((_, PortProtocol::Http)) | Err(Reason::PortNotExposed) => {
                // Its first bytes must look like HTTP (`capture::first_bytes_http`).
                let src = capture::CAPTURED_SOURCE;
                self.serve_http(tcp, addr, src, dst.port()).await;
            }
            Err(r) => capture::unresolved(&name, &self.mesh_domain, dst.port(), r),
        }
    }

    /// Serves HTTP/1.1, h2c and CONNECT on a downstream connection. `src` picks the client
    /// identity; `captured_port` is a captured connection's original destination port (0 for
    /// explicit clients), which a portless Host takes when the service exposes it.
    async fn serve_http(
        self: Arc<Self>,
        tcp: TcpStream,
        addr: SocketAddr,
        src: IpAddr,
        captured_port: u16,
    ) {
        let drain = self.drain.clone();
        let requests = Arc::new(ConnRequests::default());
        // The request's own future is the service's: no block around it, which would hold
        // it whole and copy it in on its first poll (KiBs a request).
        let request = {
            let this = self.clone();
            let requests = requests.clone();
            move |req| {
                let open = requests.start();
                this.clone().request(req, src, captured_port, open)
            }
        };
        let tcp = FinTcp::new(tcp, requests.fin());
        let mut guarded = Guarded::new(tcp, requests.clone(), "outbound", Wire::Sniff);
        if captured_port != 0 {
            guarded = guarded.first_bytes(capture::first_bytes_http);
        }
        let Some(codec) = sniff_codec(&mut guarded, &drain).await else {
            return;
        };
        let io = TokioIo::new(guarded);
        let s = &self.servers;
        let r = match codec {
            Codec::H1 => {
                let conn =
                    s.h1.serve_connection(io, service_fn(request))
                        .with_upgrades();
                serve_until_drained!(conn, drain, requests, "outbound")
            }
            // Boxed: the HTTP/2 connection's state stays out of the (more common) HTTP/1.1
            // connection's future, which is moved whole into its task.
            Codec::H2 => {
                // Each stream's future is built in its box (`memory::box_future`): hyper
                // spawns it as a task, and unboxed it was copied whole on the way (KiBs).
                let svc = service_fn(move |req| crate::memory::box_future(|| request(req)));
                Box::pin(async {
                    serve_until_drained!(
                        s.h2.serve_connection(io, svc),
                        drain,
                        requests,
                        "outbound"
                    )
                })
                .await
            }
        };
        if let Err(e) = r {
            tracing::debug!(%addr, "outbound connection ended: {e}");
        }
    }

    async fn request(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        src: IpAddr,
        captured_port: u16,
        open: RequestOpen,
    ) -> Result<Response<RespBody>, Infallible> {
        // Limits apply to what the app sent, before this proxy adds or removes anything.
        let oversized = headers::too_large(req.headers());
        let misframed = headers::framing_error(&req);
        headers::drop_underscored_counted(req.headers_mut(), Direction::outbound);
        // The app's own XFCC is never trusted.
        req.headers_mut().remove(headers::XFCC);
        headers::make_room_for_added(req.headers_mut());
        let request_id = headers::ensure_request_id(req.headers_mut());
        // A URI authority (absolute-form, h2 `:authority`, CONNECT) wins over Host.
        let authority = match req.uri().authority() {
            Some(a) => a.as_str(),
            None => req
                .headers()
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
        }
        .to_string();
        let trace = crate::trace::tracer().start(req.headers_mut(), crate::trace::Side::Client);
        let mut log = RequestLog::new(Direction::outbound, &req, authority, request_id, None);
        log.trace = trace;
        let activity = Activity::new();
        let expects = crate::http::expect::expects_continue(&req);
        let wants_trailers = headers::h1_wants_trailers(&req);
        if headers::h1_closes_after(&req) {
            open.last_on_connection();
        }
        // Boxed once here: the request (368 bytes) passes down several levels of futures to the
        // connection, and each level would otherwise copy it whole (DHAT: 14 copies a request).
        let req = Box::new(req.map(|b| {
            ReqBody::from_peer(b, log.received.clone())
                .guarded("outbound", activity.clone())
                .held_for_continue(expects)
        }));
        // A CONNECT tunnel takes the request's place on the connection for its whole life.
        let mut open = Some(open);
        let mut out = if oversized {
            Outcome::error(Reason::HeadersTooLarge)
        } else if let Some(r) = misframed {
            Outcome::error(r)
        } else if crate::overload::shedding() {
            crate::overload::count("refuse-request");
            Outcome::error(Reason::Overloaded)
        } else {
            match self
                .route(req, &log.authority, src, captured_port, &mut open)
                .await
            {
                Routed::Answered(out) => *out,
                // Awaited here rather than inside `route`: a future is copied whole into the
                // one awaiting it, and each level between this one and the exchange would copy
                // the exchange's state again on every request (decision 0009).
                Routed::Forward(req, cluster, admitted) => {
                    let locality = self.locality.as_ref();
                    let up = &self.upstream;
                    let sent = forward::forward(up, locality, req, &cluster, &log.authority, src);
                    let mut out = Outcome::forwarded(sent.await);
                    out.admitted = Some(admitted);
                    out.routed_to(&cluster)
                }
            }
        };
        if wants_trailers {
            headers::declare_grpc_trailers(out.resp.headers_mut());
        }
        // After a misframed request, or a body that broke on the client's side, the connection's
        // next bytes cannot be trusted to start a request: it closes.
        let broken = misframed.is_some() || out.reason == Some(Reason::BadRequest);
        if self.drain.phase() >= Phase::Closing || broken {
            out.resp
                .headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        let decided = Decided {
            status: out.resp.status().as_u16(),
            reason: out.reason,
            upstream: out.upstream,
            service: out.service,
            port: out.port,
            peer: out.peer,
        };
        let stream_idle = crate::http::limits::timers().stream_idle;
        let resp = accesslog::finish_with(
            out.resp,
            log,
            decided,
            (out.inflight, out.admitted, open.map(RequestOpen::answered)),
        )
        .map(|b| b.guarded("outbound", activity).idle_timeout(stream_idle));
        Ok(resp)
    }

    /// The addressing table (SPEC section 1): authority -> cluster, then HTTP or tunnel. An
    /// HTTP request for a cluster is handed back to be forwarded (`Routed::Forward`).
    async fn route(
        self: &Arc<Self>,
        req: BoxedRequest,
        authority: &str,
        src: IpAddr,
        captured_port: u16,
        open: &mut Option<RequestOpen>,
    ) -> Routed {
        let mut auth = match route::parse_authority(authority, &self.mesh_domain) {
            Ok(a) => a,
            Err(r) => return Routed::answered(Outcome::error(r)),
        };
        if captured_port != 0 && auth.port.is_none() {
            self.port_from_destination(&mut auth, captured_port);
        }
        let (cluster, protocol) = match self.cluster_for(&auth).await {
            Ok(v) => v,
            Err(r) => {
                let mut out = Outcome::error(r);
                // The service exists, only the port does not: name it in metrics and the log.
                // The port stays 0: any client-chosen number would make a new series.
                if r == Reason::PortNotExposed {
                    out.service = Some(auth.service.as_ref().into());
                }
                return Routed::answered(out);
            }
        };
        let Some(admitted) = cluster.admit() else {
            return Routed::answered(Outcome::error(Reason::Overflow).routed_to(&cluster));
        };
        let is_connect = req.method() == Method::CONNECT;
        let upgrade_to = headers::upgrade_of(&req, None);
        let out = match (is_connect, protocol, upgrade_to) {
            (true, PortProtocol::Http, _) => Outcome::error(Reason::NotATcpPort),
            (false, PortProtocol::Tcp, _) => Outcome::error(Reason::NotAnHttpPort),
            (true, PortProtocol::Tcp, _) => {
                // Boxed: a tunnel's connect machinery would otherwise enlarge every request.
                Box::pin(self.tunnel(*req, &cluster, src, open, admitted)).await
            }
            (false, PortProtocol::Http, Some(to)) => {
                // Boxed: as for tunnels, upgrades are the rare path.
                let up = self.upgrade(*req, to, &cluster, authority, src, open, admitted);
                Box::pin(up).await
            }
            (false, PortProtocol::Http, None) => {
                return Routed::Forward(req, cluster, admitted);
            }
        };
        Routed::answered(out.routed_to(&cluster))
    }

    /// A captured request with a portless Host goes to the port the app dialled when the
    /// service exposes it (SPEC section 10), else to the default port as usual.
    #[cold]
    fn port_from_destination(&self, auth: &mut route::MeshAuthority<'_>, port: u16) {
        let catalog = self.catalog.load();
        if let Some(service) = catalog.services.get(auth.service.as_ref()) {
            if service.exposes(port) {
                auth.port = Some(port);
            }
        }
    }

    /// The cluster an authority routes to. A catalog that discovers on demand is asked for
    /// what it does not know yet; the request waits for the answer up to its timeout.
    async fn cluster_for(
        &self,
        auth: &route::MeshAuthority<'_>,
    ) -> Result<(Arc<Cluster>, PortProtocol), Reason> {
        match self.resolve(&self.catalog.load(), auth)? {
            Ok(found) => Ok(found),
            // Rare (a first request via the control plane): boxed, so the waiting machinery does
            // not enlarge every request's future.
            Err(_) => Box::pin(self.discover(auth)).await,
        }
    }

    /// The cluster for `auth` in `catalog`; `Ok(Err(name))` when the catalog's source is still
    /// to be asked for the cluster `name`.
    fn resolve(
        &self,
        catalog: &crate::catalog::Catalog,
        auth: &route::MeshAuthority<'_>,
    ) -> Result<Result<(Arc<Cluster>, PortProtocol), String>, Reason> {
        match route::lookup(catalog, auth, &self.mesh_domain) {
            route::Lookup::Found(target) => {
                target.service.touch(target.port);
                let cluster = self
                    .clusters
                    .get(catalog, &target.service.name, target.port)
                    .ok_or(Reason::UnknownService)?;
                Ok(Ok((cluster, target.protocol)))
            }
            route::Lookup::Refused(r) => Err(r),
            route::Lookup::Unknown { cluster, .. } => Ok(Err(cluster)),
        }
    }

    /// Asks the catalog's source for the name and waits for its answer (or the timeout).
    async fn discover(
        &self,
        auth: &route::MeshAuthority<'_>,
    ) -> Result<(Arc<Cluster>, PortProtocol), Reason> {
        // Subscribed before looking again, so no change falls in between.
        let mut changes = self.catalog.subscribe();
        let mut deadline = None;
        loop {
            changes.borrow_and_update();
            let catalog = self.catalog.load();
            let wanted = match self.resolve(&catalog, auth)? {
                Ok(found) => return Ok(found),
                Err(wanted) => wanted,
            };
            let timeout = catalog
                .on_demand
                .as_ref()
                .map_or_else(Default::default, |o| o.timeout);
            drop(catalog);
            let deadline = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + timeout);
            self.catalog.want(wanted);
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => continue,
                _ => return Err(Reason::DiscoveryTimeout),
            }
        }
    }

    /// An HTTP/1.1 upgrade: after the endpoint's 101, the request's connection and the
    /// upstream one are spliced (the tunnel holds the request's place, the cluster's breakers
    /// and the endpoint's in-flight count); a refusal is an ordinary response.
    #[allow(clippy::too_many_arguments)]
    async fn upgrade(
        &self,
        mut req: Request<ReqBody>,
        to: HeaderValue,
        cluster: &Cluster,
        authority: &str,
        src: IpAddr,
        open: &mut Option<RequestOpen>,
        admitted: Admitted,
    ) -> Outcome {
        let near = hyper::upgrade::on(&mut req);
        let mut log = ConnLog::new(Direction::outbound, "upgrade", authority.to_string());
        log.request_id = req.headers().get(headers::X_REQUEST_ID).cloned();
        let locality = self.locality.as_ref();
        let answer = upgrade::send(&self.upstream, locality, req, to, cluster, authority, src);
        match answer.await {
            Err(r) => {
                let mut out = Outcome::error(r);
                out.admitted = Some(admitted);
                out
            }
            Ok(upgrade::Answer::Refused { resp, active }) => Outcome {
                resp: resp.map(|b| Either::Left(UpBody::h1(b))),
                reason: None,
                upstream: Some(active.0.address),
                service: None,
                port: 0,
                peer: None,
                inflight: Some(InFlight::unpooled(active)),
                admitted: Some(admitted),
            },
            Ok(upgrade::Answer::Switched {
                resp,
                far,
                slot,
                active,
            }) => {
                let upstream = Some(active.0.address);
                let held = (
                    active,
                    admitted,
                    slot,
                    self.tracker.track(),
                    open.take().map(RequestOpen::tunnel),
                );
                let far = tunnel::Far::Upgraded(far);
                log.upstream = upstream;
                log.peer_identity = Some(cluster.service.identity.clone());
                let drain = self.drain.clone();
                tunnel::splice(near, far, "outbound", log, drain, held);
                Outcome {
                    resp: resp.map(|_| Either::Right(Full::default())),
                    reason: None,
                    upstream,
                    service: None,
                    port: 0,
                    peer: None,
                    inflight: None,
                    admitted: None,
                }
            }
        }
    }

    /// Answers 200 once a tunnel to an endpoint is open; the bytes flow after the upgrade.
    async fn tunnel(
        &self,
        mut req: Request<ReqBody>,
        cluster: &Cluster,
        src: IpAddr,
        open: &mut Option<RequestOpen>,
        admitted: Admitted,
    ) -> Outcome {
        let locality = self.locality.as_ref();
        let (tls, slot, ep) =
            match tunnel::open(&self.upstream, locality, cluster, req.headers(), src).await {
                Ok(v) => v,
                Err(r) => return Outcome::error(r),
            };
        let upgrade = hyper::upgrade::on(&mut req);
        let authority = req.uri().authority().map_or("", |a| a.as_str());
        let mut log = ConnLog::new(Direction::outbound, "connect", authority.to_string());
        log.request_id = req.headers().get(headers::X_REQUEST_ID).cloned();
        log.upstream = Some(ep.address);
        log.peer_identity = Some(cluster.service.identity.clone());
        let held = (
            ActiveGuard::new(ep.clone()),
            admitted,
            slot,
            self.tracker.track(),
            open.take().map(RequestOpen::tunnel),
        );
        tunnel::splice(
            upgrade,
            tunnel::Far::Tls(tls),
            "outbound",
            log,
            self.drain.clone(),
            held,
        );
        let mut resp = Response::new(Either::Right(Full::default()));
        *resp.status_mut() = StatusCode::OK;
        Outcome {
            resp,
            reason: None,
            upstream: Some(ep.address),
            service: None,
            port: 0,
            peer: None,
            inflight: None,
            admitted: None,
        }
    }
}
