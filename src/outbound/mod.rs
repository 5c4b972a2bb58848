//! The outbound side: apps send plaintext HTTP/1.1, h2c (prior knowledge) or CONNECT to
//! `outbound.listen`; the authority picks a cluster (`routing`), the balancer an endpoint
//! (`lb`), and the request travels over a pooled mTLS connection (`connect`, `pool`).

pub mod connect;

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::{HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

use crate::accesslog::{Decided, RequestLog};
use crate::body::{self, Metered, ReqBody, RespBody};
use crate::catalog::{CatalogStore, Labels, PortProtocol};
use crate::cluster::{ActiveGuard, Cluster, Clusters};
use crate::config::{Config, Locality};
use crate::drain::{accept_until_closing, Drain, Phase, Tracker};
use crate::errors::{Body, Reason};
use crate::headers;
use crate::http_server::{serve_until_drained, ConnRequests, RequestOpen, Servers, Timed};
use crate::identity::tls::{alpn_wire, ALPN_H2};
use crate::identity::IdentityStore;
use crate::lb;
use crate::metrics::{self, Direction};
use crate::pool::{self, Conn, Pool, SendError, StreamGuard};
use crate::routing;
use connect::ConnectError;

/// A request whose connection failed before anything was sent is retried this many times,
/// each time on an endpoint it has not tried yet.
pub const MAX_RETRIES: usize = 2;

/// What makes two upstream connections interchangeable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub endpoint: SocketAddr,
    /// The app port, sent as SNI.
    pub port: u16,
    /// The ALPN order offered (the calling app's protocol first).
    pub h2_first: bool,
    /// The app's source address when it has its own client identity.
    pub source: Option<IpAddr>,
    /// The identity the peer was verified against: a connection pinned for one service never
    /// carries another service's requests, even to the same endpoint and port.
    pub identity: Arc<str>,
}

pub struct Outbound {
    pub mesh_domain: String,
    pub locality: Option<Locality>,
    pub catalog: Arc<CatalogStore>,
    pub clusters: Arc<Clusters>,
    pub identity: Arc<IdentityStore>,
    pub pool: Arc<Pool<PoolKey>>,
    pub servers: Servers,
    pub drain: Drain,
    pub tracker: Tracker,
    sources_with_identity: HashSet<IpAddr>,
}

/// What one request did, for the access log and metrics.
struct Outcome {
    resp: Response<Body>,
    reason: Option<Reason>,
    upstream: Option<SocketAddr>,
    service: Option<String>,
    port: u16,
    inflight: Option<InFlight>,
}

/// What a request holds until its response body ends: its endpoint's in-flight count and its
/// place on a multiplexed connection.
struct InFlight {
    active: ActiveGuard,
    #[allow(dead_code)] // held for its Drop
    stream: Option<StreamGuard>,
}

impl Outcome {
    fn error(reason: Reason) -> Outcome {
        Outcome {
            resp: reason.response(),
            reason: Some(reason),
            upstream: None,
            service: None,
            port: 0,
            inflight: None,
        }
    }
}

impl Outbound {
    pub fn new(
        cfg: &Config,
        catalog: Arc<CatalogStore>,
        clusters: Arc<Clusters>,
        identity: Arc<IdentityStore>,
        drain: Drain,
        tracker: Tracker,
    ) -> Outbound {
        Outbound {
            mesh_domain: cfg.mesh_domain.clone(),
            locality: cfg.locality.clone(),
            catalog,
            clusters,
            identity,
            pool: Pool::new(),
            servers: Servers::new(),
            drain,
            tracker,
            sources_with_identity: cfg.source_identities.iter().map(|s| s.source).collect(),
        }
    }

    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        self.pool.spawn_sweeper();
        let (drain, tracker) = (self.drain.clone(), self.tracker.clone());
        accept_until_closing("outbound", listener, &drain, &tracker, |tcp, addr| {
            self.clone().connection(tcp, addr)
        })
        .await;
    }

    /// After a catalog reload: pooled connections to endpoints (or ports) that left, or whose
    /// pinned identity changed, are dropped from the pool; requests in flight on them keep
    /// them open until they finish.
    pub fn forget_removed_endpoints(&self) {
        let catalog = self.catalog.load();
        let live: HashSet<(SocketAddr, u16, &str)> = catalog
            .services
            .values()
            .flat_map(|s| {
                s.endpoints
                    .iter()
                    .flat_map(move |e| e.ports.iter().map(move |p| (e.address, *p, &*s.identity)))
            })
            .collect();
        self.pool
            .retain(|k| live.contains(&(k.endpoint, k.port, &*k.identity)));
    }

    async fn connection(self: Arc<Self>, tcp: TcpStream, addr: SocketAddr) {
        let _active = metrics::ActiveConnection::new("outbound");
        let _ = tcp.set_nodelay(true);
        let src = addr.ip();
        let drain = self.drain.clone();
        let requests = Arc::new(ConnRequests::default());
        let svc = {
            let this = self.clone();
            let requests = requests.clone();
            service_fn(move |req| {
                let open = requests.start();
                let this = this.clone();
                async move { Ok::<_, Infallible>(this.request(req, src, open).await) }
            })
        };
        let io = TokioIo::new(Timed::new(tcp, requests.clone()));
        let r = serve_until_drained!(
            self.servers.auto.serve_connection_with_upgrades(io, svc),
            drain,
            requests
        );
        if let Err(e) = r {
            tracing::debug!(%addr, "outbound connection ended: {e}");
        }
    }

    async fn request(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
        src: IpAddr,
        open: RequestOpen,
    ) -> Response<RespBody> {
        // Limits apply to what the app sent, before this proxy adds or removes anything.
        let oversized = headers::too_large(req.headers());
        // The app's own XFCC is never trusted.
        req.headers_mut().remove(headers::XFCC);
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
        let log = RequestLog::new(Direction::outbound, &req, authority, request_id, None);
        let req = req.map(|b| Metered::new(b, log.received.clone()));
        // A CONNECT tunnel takes the request's place on the connection for its whole life.
        let mut open = Some(open);
        let mut out = if oversized {
            Outcome::error(Reason::HeadersTooLarge)
        } else {
            self.route(req, &log.authority, src, &mut open).await
        };
        if self.drain.phase() >= Phase::Closing {
            out.resp
                .headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        let decided = Decided {
            status: out.resp.status().as_u16(),
            reason: out.reason,
            upstream: out.upstream,
            service: out.service.unwrap_or_default(),
            port: out.port,
        };
        body::finish_with(
            out.resp,
            log,
            decided,
            (out.inflight, open.map(RequestOpen::answered)),
        )
    }

    async fn route(
        self: &Arc<Self>,
        req: Request<ReqBody>,
        authority: &str,
        src: IpAddr,
        open: &mut Option<RequestOpen>,
    ) -> Outcome {
        let auth = match routing::parse_authority(authority, &self.mesh_domain) {
            Ok(a) => a,
            Err(r) => return Outcome::error(r),
        };
        let (cluster, protocol) = {
            let catalog = self.catalog.load();
            let target = match routing::decide(&catalog, &auth) {
                Ok(t) => t,
                Err(r) => return Outcome::error(r),
            };
            let Some(c) = self
                .clusters
                .get_or_build(&target.service.name, target.port)
            else {
                return Outcome::error(Reason::UnknownService);
            };
            (c, target.protocol)
        };
        let is_connect = req.method() == Method::CONNECT;
        let mut out = match (is_connect, protocol) {
            (true, PortProtocol::Http) => Outcome::error(Reason::NotATcpPort),
            (false, PortProtocol::Tcp) => Outcome::error(Reason::NotAnHttpPort),
            (true, PortProtocol::Tcp) => self.tunnel(req, &cluster, src, open).await,
            (false, PortProtocol::Http) => self.forward(req, &cluster, authority, src).await,
        };
        out.service = Some(cluster.service.name.clone());
        out.port = cluster.port;
        out
    }

    fn source_key(&self, src: IpAddr) -> Option<IpAddr> {
        self.sources_with_identity.contains(&src).then_some(src)
    }

    async fn forward(
        self: &Arc<Self>,
        mut req: Request<ReqBody>,
        cluster: &Arc<Cluster>,
        authority: &str,
        src: IpAddr,
    ) -> Outcome {
        let h2_first = req.version() == Version::HTTP_2;
        headers::strip_hop_by_hop(req.headers_mut());
        let subset =
            routing::choose_subset(&cluster.service, req.headers(), fastrand::u32(..)).cloned();
        let timeout = cluster.service.request_timeout;
        let attempt = self.attempts(req, cluster, subset.as_ref(), authority, h2_first, src);
        match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok((resp, inflight))) => {
                let mut resp = resp.map(Either::Left);
                headers::strip_hop_by_hop(resp.headers_mut());
                Outcome {
                    resp,
                    reason: None,
                    upstream: Some(inflight.active.0.address),
                    service: None,
                    port: 0,
                    inflight: Some(inflight),
                }
            }
            Ok(Err(r)) => Outcome::error(r),
            Err(_) => Outcome::error(Reason::UpstreamTimeout),
        }
    }

    async fn attempts(
        &self,
        req: Request<ReqBody>,
        cluster: &Cluster,
        subset: Option<&Labels>,
        authority: &str,
        h2_first: bool,
        src: IpAddr,
    ) -> Result<(Response<Incoming>, InFlight), Reason> {
        let svc = &cluster.service;
        let max_uses = svc.max_requests_per_connection;
        let mut tried: Vec<SocketAddr> = Vec::new();
        let mut last = Reason::UpstreamConnectFailure;
        let mut req = Some(req);
        // One extra round for a pooled connection that turned out closed.
        for _ in 0..=MAX_RETRIES + 1 {
            let ep = match lb::pick(cluster, subset, self.locality.as_ref(), &tried, |n| {
                fastrand::usize(..n)
            }) {
                Ok(e) => e,
                Err(r) if tried.is_empty() => return Err(r),
                Err(_) => return Err(last),
            };
            let active = ActiveGuard::new(ep.clone());
            let key = PoolKey {
                endpoint: ep.address,
                port: cluster.port,
                h2_first,
                source: self.source_key(src),
                identity: cluster.service.identity.clone(),
            };
            let conn = match self.pool.get(&key, max_uses) {
                Some(c) => c,
                None => match self.connect_http(&key, cluster, src).await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "upstream connect failed: {e:?}");
                        cluster.record(&ep, true);
                        tried.push(ep.address);
                        last = e.reason();
                        if tried.len() > MAX_RETRIES {
                            break;
                        }
                        continue;
                    }
                },
            };
            let mut r = req.take().expect("a request is present until sent");
            let to_h2 = matches!(conn, Conn::H2(..));
            headers::retarget(&mut r, to_h2, authority)?;
            match self.pool.send(&key, conn, r, max_uses).await {
                Ok((resp, stream)) => {
                    cluster.record(&ep, resp.status().is_server_error());
                    return Ok((resp, InFlight { active, stream }));
                }
                Err(SendError::NotSent(r)) => req = Some(*r),
                Err(SendError::Failed(e)) => {
                    tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "upstream broke the exchange: {e}");
                    cluster.record(&ep, true);
                    return Err(Reason::UpstreamProtocolError);
                }
            }
        }
        Err(last)
    }

    async fn connect_http(
        &self,
        key: &PoolKey,
        cluster: &Cluster,
        src: IpAddr,
    ) -> Result<Conn, ConnectError> {
        let svc = &cluster.service;
        let contexts = self.identity.current();
        let tls = connect::connect(
            contexts.connector_for(src),
            key.endpoint,
            key.port,
            Some(alpn_wire(key.h2_first)),
            &svc.identity,
            svc.connect_timeout,
        )
        .await?;
        let io = TokioIo::new(tls);
        if io.inner().ssl().selected_alpn_protocol() == Some(ALPN_H2) {
            let s = pool::handshake_h2(io)
                .await
                .map_err(|e| ConnectError::Failed(format!("h2 handshake: {e}")))?;
            let stream = self
                .pool
                .put_h2(key.clone(), s.clone(), svc.max_requests_per_connection);
            Ok(Conn::H2(s, stream))
        } else {
            let s = pool::handshake_h1(io)
                .await
                .map_err(|e| ConnectError::Failed(format!("h1 handshake: {e}")))?;
            Ok(Conn::H1(s, 0))
        }
    }

    /// `CONNECT host:port` to a tcp port: a raw tunnel over mTLS (no ALPN) to the endpoint.
    async fn tunnel(
        self: &Arc<Self>,
        mut req: Request<ReqBody>,
        cluster: &Arc<Cluster>,
        src: IpAddr,
        open: &mut Option<RequestOpen>,
    ) -> Outcome {
        let svc = &cluster.service;
        let mut tried = Vec::new();
        let mut last = Reason::UpstreamConnectFailure;
        let (tls, ep) = loop {
            let ep = match lb::pick(cluster, None, self.locality.as_ref(), &tried, |n| {
                fastrand::usize(..n)
            }) {
                Ok(e) => e,
                Err(r) if tried.is_empty() => return Outcome::error(r),
                Err(_) => return Outcome::error(last),
            };
            let contexts = self.identity.current();
            let r = connect::connect(
                contexts.connector_for(src),
                ep.address,
                cluster.port,
                None,
                &svc.identity,
                svc.connect_timeout,
            )
            .await;
            match r {
                Ok(tls) => break (tls, ep),
                Err(e) => {
                    tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "tunnel connect failed: {e:?}");
                    cluster.record(&ep, true);
                    tried.push(ep.address);
                    last = e.reason();
                    if tried.len() > MAX_RETRIES {
                        return Outcome::error(last);
                    }
                }
            }
        };
        cluster.record(&ep, false);
        let upgrade = hyper::upgrade::on(&mut req);
        let active = ActiveGuard::new(ep.clone());
        let guard = self.tracker.track();
        let open = open.take().map(RequestOpen::answered);
        let name = cluster.name.clone();
        tokio::spawn(async move {
            let mut tls = tls;
            match upgrade.await {
                Ok(up) => {
                    let mut up = TokioIo::new(up);
                    match tokio::io::copy_bidirectional(&mut up, &mut tls).await {
                        Ok((a, b)) => {
                            tracing::debug!(cluster = %name, up = a, down = b, "tunnel done")
                        }
                        Err(e) => tracing::debug!(cluster = %name, "tunnel ended: {e}"),
                    }
                }
                Err(e) => tracing::debug!(cluster = %name, "CONNECT upgrade failed: {e}"),
            }
            drop(active);
            drop(guard);
            drop(open);
        });
        let mut resp = Response::new(Either::Right(Full::default()));
        *resp.status_mut() = StatusCode::OK;
        Outcome {
            resp,
            reason: None,
            upstream: Some(ep.address),
            service: None,
            port: 0,
            inflight: None,
        }
    }
}
