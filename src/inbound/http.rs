//! HTTP chains: terminate h1/h2 from the peer proxy, apply `allow`, set XFCC and
//! `x-request-id`, and forward to the app in the chain's protocol (h2c prior knowledge for
//! `h2`, HTTP/1.1 for `http1`, the arriving protocol for `auto`).

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::chain::{Chain, HttpCodec};
use super::peer::{Peer, TlsStream};
use crate::accesslog::{self, ConnLog, Decided, RequestLog};
use crate::drain::{Drain, Phase, Tracker};
use crate::http::answer::{Body, Reason};
use crate::http::body::{Activity, BoxedRequest, ReqBody, RespBody, UpBody};
use crate::http::headers;
use crate::http::server::{
    serve_until_drained, sniff_codec, Codec, ConnRequests, Guarded, RequestOpen, Servers, Wire,
};
use crate::identity::SpiffeId;
use crate::metrics::Direction;
use crate::outbound::pool::{self, Conn, Pool, SendError, StreamGuard};
use crate::outbound::retry::{self, Resend};
use crate::outbound::{tunnel, upgrade};

/// How long a pooled HTTP/1.1 app connection must have sat idle before a request sent on it
/// keeps a copy of its head to go again. Apps close idle connections after a second or more
/// (Node.js 5 s, gunicorn 2 s, nginx 75 s); a connection in steady use is idle for far less.
const RESEND_AFTER_IDLE: Duration = Duration::from_millis(100);

/// What every HTTP chain shares: the app it forwards to and the servers it speaks with.
pub struct HttpChains {
    pub app_host: IpAddr,
    /// Pooled connections to the local app, keyed by (port, h2).
    pub app_pool: Arc<Pool<(u16, bool)>>,
    pub servers: Servers,
    pub drain: Drain,
    /// Upgraded connections outlive their HTTP connection's task; the drain waits for them.
    pub tracker: Tracker,
    /// `service` label for metrics: this workload's service account.
    pub service_label: Arc<str>,
    /// Set once the app has closed a busy pooled connection under a request (an app that
    /// closes after each answer without `Connection: close`): from then on every idempotent
    /// request on a pooled HTTP/1.1 connection keeps a copy to go again, not only those after
    /// an idle spell.
    pub app_closes_busy: AtomicBool,
}

impl HttpChains {
    /// Serves one peer connection on an HTTP chain with `codec`.
    pub async fn serve(
        self: Arc<Self>,
        codec: HttpCodec,
        chain: Chain,
        peer: Peer,
        own_id: &SpiffeId,
        tls: TlsStream,
    ) {
        let conn = Arc::new(ConnCtx {
            xfcc: headers::xfcc_value(own_id.as_str(), &peer.cert_hash, peer.spiffe_id.as_str()),
            chain,
            peer,
        });
        let drain = self.drain.clone();
        let requests = Arc::new(ConnRequests::default());
        // The request's own future is the service's: no block around it, which would hold
        // it whole and copy it in on its first poll (KiBs a request).
        let request = {
            let this = self.clone();
            let requests = requests.clone();
            move |req| {
                let open = requests.start();
                this.clone().request(req, conn.clone(), open)
            }
        };
        let wire = match codec {
            HttpCodec::H2 => Wire::H2,
            HttpCodec::H1 => Wire::H1,
            HttpCodec::Sniff => Wire::Sniff,
        };
        let mut guarded = Guarded::new(tls, requests.clone(), "inbound", wire);
        let codec = match codec {
            HttpCodec::H1 => Codec::H1,
            HttpCodec::H2 => Codec::H2,
            HttpCodec::Sniff => match sniff_codec(&mut guarded, &drain).await {
                Some(codec) => codec,
                None => return,
            },
        };
        let io = TokioIo::new(guarded);
        let s = &self.servers;
        let result = match codec {
            Codec::H2 => {
                // Boxed on HTTP/2 only: hyper spawns each stream's future (several KiB) as a task
                // and moves it several times on the way; a box moves as one pointer. HTTP/1.1
                // polls it in place, where a box would only add an allocation. Built in its
                // box (`memory::box_future`), it is not copied there either.
                let svc = service_fn(move |req| crate::memory::box_future(|| request(req)));
                // The connection's state is boxed too: it stays out of the HTTP/1.1
                // connection's future, which is moved whole into its task.
                Box::pin(async {
                    serve_until_drained!(s.h2.serve_connection(io, svc), drain, requests, "inbound")
                })
                .await
            }
            Codec::H1 => {
                let conn =
                    s.h1.serve_connection(io, service_fn(request))
                        .with_upgrades();
                serve_until_drained!(conn, drain, requests, "inbound")
            }
        };
        if let Err(e) = result {
            tracing::debug!("inbound http connection ended: {e}");
        }
    }
}

struct ConnCtx {
    chain: Chain,
    peer: Peer,
    xfcc: HeaderValue,
}

impl HttpChains {
    async fn request(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        conn: Arc<ConnCtx>,
        open: RequestOpen,
    ) -> Result<Response<RespBody>, Infallible> {
        let conn = &*conn;
        // Limits apply to what the client sent, before this proxy adds anything.
        let oversized = headers::too_large(req.headers());
        let misframed = headers::framing_error(&req);
        headers::drop_underscored_counted(req.headers_mut(), Direction::inbound);
        headers::make_room_for_added(req.headers_mut());
        let request_id = headers::ensure_request_id(req.headers_mut());
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or_else(|| {
                req.headers()
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
            })
            .unwrap_or_default()
            .to_string();
        let trace = crate::trace::tracer().start(req.headers_mut(), crate::trace::Side::Server);
        let mut log = RequestLog::new(
            Direction::inbound,
            &req,
            authority,
            request_id,
            Some(conn.peer.spiffe_id.clone()),
        );
        log.trace = trace;
        let timers = crate::http::limits::timers();
        let activity = Activity::new();
        let expects = crate::http::expect::expects_continue(&req);
        // Boxed once, as outbound: it is moved down to the app's connection, not copied at
        // each level.
        let req = Box::new(req.map(|b| {
            ReqBody::from_peer(b, log.received.clone())
                .guarded("inbound", activity.clone())
                .held_for_continue(expects)
        }));
        // The app must start its answer in time (SPEC section 8), the request body's upload
        // included.
        let mut open = Some(open);
        let forwarded = tokio::time::timeout(
            timers.first_byte,
            self.forward(req, conn, &log.authority, (oversized, misframed), &mut open),
        )
        .await
        .unwrap_or_else(|_| {
            crate::http::metrics::cut_off("inbound", "first_byte_timeout");
            Err(Reason::UpstreamTimeout)
        });
        let (mut resp, reason, stream) = match forwarded {
            Ok((resp, stream)) => (resp, None, stream),
            Err(reason) => (reason.response(), Some(reason), None),
        };
        let broken = misframed.is_some() || reason == Some(Reason::BadRequest);
        if self.drain.phase() >= Phase::Closing || broken {
            // HTTP/1.1 peers learn to reconnect elsewhere; hyper drops it on h2. After a
            // misframed request, or a body that broke on the client's side, the connection's
            // next bytes cannot be trusted either.
            resp.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        let decided = Decided {
            status: resp.status().as_u16(),
            reason,
            upstream: Some(std::net::SocketAddr::new(self.app_host, conn.chain.port)),
            service: Some(self.service_label.clone()),
            port: conn.chain.port,
            peer: None,
        };
        let held = (stream, open.map(RequestOpen::answered));
        let resp = accesslog::finish_with(resp, log, decided, held).map(|b| {
            b.guarded("inbound", activity)
                .idle_timeout(timers.stream_idle)
        });
        Ok(resp)
    }

    async fn forward(
        &self,
        mut req: BoxedRequest,
        conn: &ConnCtx,
        authority: &str,
        (oversized, misframed): (bool, Option<Reason>),
        open: &mut Option<RequestOpen>,
    ) -> Result<(Response<Body>, Option<StreamGuard>), Reason> {
        if oversized {
            return Err(Reason::HeadersTooLarge);
        }
        if let Some(r) = misframed {
            return Err(r);
        }
        if crate::overload::shedding() {
            crate::overload::count("refuse-request");
            return Err(Reason::Overloaded);
        }
        if !conn.chain.allows(&conn.peer.spiffe_id) {
            return Err(Reason::Forbidden);
        }
        let upgrade_to = headers::upgrade_of(&req, Some(&conn.chain.upgrades));
        let h = req.headers_mut();
        match upgrade_to.clone() {
            Some(to) => headers::strip_hop_by_hop_upgrading(h, to),
            None => headers::strip_hop_by_hop(h),
        }
        // Only this proxy may speak for the peer's certificate.
        h.insert(headers::XFCC, conn.xfcc.clone());
        let to_h2 = conn.chain.to_app_h2(req.version());
        let port = conn.chain.port;
        let fallback;
        let authority = if authority.is_empty() {
            fallback = format!("{}:{port}", self.app_host);
            fallback.as_str()
        } else {
            authority
        };
        if let Some(offered) = upgrade_to {
            if to_h2 {
                return Err(Reason::UpgradeNotSupported);
            }
            headers::retarget(&mut req, false, authority)?;
            // Boxed: the rare path's future stays out of every request's.
            let up = self.upgrade(*req, offered, port, authority, &conn.peer.spiffe_id, open);
            return Box::pin(up).await;
        }
        headers::retarget(&mut req, to_h2, authority)?;
        if !to_h2 {
            headers::keep_h1_body(&mut req);
        }
        let key = (port, to_h2);
        let (sender, idle, pooled) = match self.app_pool.get_with_idle(&key, 0) {
            Some((c, idle)) => (c, idle, true),
            None => (self.connect_app(port, to_h2).await?, Duration::ZERO, false),
        };
        // A pooled HTTP/1.1 connection may be closing at the app's end as the request is
        // written to it: its keep-alive timeout after an idle spell, or an app that closes
        // after each answer without `Connection: close`. The app never reads the request and
        // no answer comes. An idempotent request without a body may then go again (RFC 9112
        // section 9.3.1), so its head is copied first: after an idle spell, or always once
        // this app has closed a busy connection under a request. The copy is not free, so a
        // busy connection to any other app copies nothing.
        let pooled_h1 = pooled && matches!(sender, Conn::H1(..));
        let copy = idle >= RESEND_AFTER_IDLE || self.app_closes_busy.load(Ordering::Relaxed);
        let resend = if pooled_h1 && copy && retry::idempotent(req.method()) {
            Resend::of(&req)
        } else {
            None
        };
        let received = req.body().received();
        let sent = match self.app_pool.send(&key, sender, req, 0).await {
            // A pooled connection the app had closed (its keep-alive timeout, or an app short
            // of connections closing idle ones) hands the request back unsent: it goes again,
            // once, on a new connection. Only a port that does not answer is `app-unavailable`.
            Err(SendError::NotSent(req)) => self.send_again(key, "pool-closed", req).await?,
            Err(SendError::Failed(e))
                if resend
                    .as_ref()
                    .is_some_and(|r| r.allowed_after(retry::classify(&e))) =>
            {
                tracing::debug!(
                    port,
                    "inbound: the app closed under the request ({e}), again"
                );
                let req = Box::new(resend.expect("checked").into_request());
                self.send_again(key, "reset", req).await?
            }
            Err(SendError::Failed(e)) => {
                let busy = pooled_h1 && idle < RESEND_AFTER_IDLE;
                if busy && retry::classify(&e) == retry::Failure::Reset {
                    // Closed under a request with no idle spell to explain it: this app
                    // closes busy connections, and the next such request goes again.
                    self.app_closes_busy.store(true, Ordering::Relaxed);
                }
                Err(SendError::Failed(e))
            }
            sent => sent,
        };
        let (mut resp, stream) = match sent {
            Ok(r) => r,
            Err(SendError::NotSent(_)) => return Err(Reason::AppUnavailable),
            Err(SendError::Failed(e)) if received.is_some_and(|r| r.client_failed()) => {
                // The peer's request broke (malformed, or the peer went away mid-body): not the
                // app's doing, and answered as the client's.
                tracing::debug!(port, "inbound: the request broke on the client's side: {e}");
                return Err(Reason::BadRequest);
            }
            Err(SendError::Failed(e)) => {
                tracing::debug!(port, "inbound: app broke the exchange: {e}");
                // An h2 app that refused the stream (`REFUSED_STREAM`, or a stream above its
                // GOAWAY's last-stream-id, as a server shutting down sends) never processed
                // it: `app-unavailable`, which client sidecars send to another pod.
                if retry::classify(&e) == retry::Failure::Refused {
                    return Err(Reason::AppUnavailable);
                }
                return Err(Reason::UpstreamProtocolError);
            }
        };
        if let Some(why) = headers::unforwardable(&resp) {
            tracing::debug!(port, "inbound: the app {why}");
            return Err(Reason::UpstreamProtocolError);
        }
        headers::forwarded_response(&mut resp);
        if resp.status() == http::StatusCode::SERVICE_UNAVAILABLE {
            // Client sidecars send a request elsewhere on a sidecar's `app-unavailable`; an app
            // that processed the request must not be able to say it.
            resp.headers_mut()
                .remove(crate::http::answer::X_AETHER_ERROR);
        }
        Ok((resp.map(Either::Left), stream))
    }

    /// Sends `req` again, once, on a new connection to the app, counted as a retry for `why`.
    async fn send_again(
        &self,
        key: (u16, bool),
        why: &'static str,
        req: BoxedRequest,
    ) -> Result<Result<(Response<UpBody>, Option<StreamGuard>), SendError>, Reason> {
        let (port, h2) = key;
        crate::outbound::metrics::retry(Direction::inbound, &self.service_label, port, why);
        let fresh = self.connect_app(port, h2).await?;
        Ok(self.app_pool.send(&key, fresh, req, 0).await)
    }

    /// An HTTP/1.1 upgrade to the app, on a connection of its own: after the app's 101 the
    /// peer's connection and the app's are spliced (the tunnel holds the request's place on
    /// the peer connection); any other answer is an ordinary response.
    async fn upgrade(
        &self,
        mut req: Request<ReqBody>,
        offered: http::HeaderValue,
        port: u16,
        authority: &str,
        peer: &SpiffeId,
        open: &mut Option<RequestOpen>,
    ) -> Result<(Response<Body>, Option<StreamGuard>), Reason> {
        let near = hyper::upgrade::on(&mut req);
        let mut log = ConnLog::new(Direction::inbound, "upgrade", authority.to_string());
        log.request_id = req.headers().get(headers::X_REQUEST_ID).cloned();
        log.upstream = Some(std::net::SocketAddr::new(self.app_host, port));
        log.peer_identity = Some(peer.clone());
        let tcp = self.dial_app(port).await?;
        let mut sender = pool::handshake_h1(TokioIo::new(tcp), ())
            .await
            .map_err(|_| Reason::AppUnavailable)?;
        let mut resp = sender.send_request(req).await.map_err(|e| {
            tracing::debug!(port, "inbound: app broke the upgrade: {e}");
            Reason::UpstreamProtocolError
        })?;
        let Some(to) = upgrade::switched_to(&resp, &offered)? else {
            headers::forwarded_response(&mut resp);
            return Ok((resp.map(|b| Either::Left(UpBody::h1(b))), None));
        };
        let far = hyper::upgrade::on(&mut resp);
        headers::strip_hop_by_hop_upgrading(resp.headers_mut(), to);
        let held = (self.tracker.track(), open.take().map(RequestOpen::tunnel));
        let far = tunnel::Far::Upgraded(far);
        tunnel::splice(near, far, "inbound", log, self.drain.clone(), held);
        Ok((resp.map(|_| Either::Right(Full::default())), None))
    }

    async fn dial_app(&self, port: u16) -> Result<TcpStream, Reason> {
        let tcp = TcpStream::connect((self.app_host, port))
            .await
            .map_err(|e| {
                tracing::debug!(port, "inbound: app port did not answer: {e}");
                Reason::AppUnavailable
            })?;
        crate::sockets::tune(&tcp);
        Ok(tcp)
    }

    async fn connect_app(&self, port: u16, h2: bool) -> Result<Conn, Reason> {
        let tcp = self.dial_app(port).await?;
        if h2 {
            let s = pool::handshake_h2(tcp, ()).await.map_err(|e| {
                tracing::debug!(port, "inbound: h2c handshake with the app failed: {e}");
                Reason::UpstreamProtocolError
            })?;
            let stream = self.app_pool.put_h2((port, true), s.clone(), 0);
            Ok(Conn::H2(s, stream))
        } else {
            let s = pool::handshake_h1(TokioIo::new(tcp), ())
                .await
                .map_err(|_| Reason::AppUnavailable)?;
            Ok(Conn::H1(s, 0))
        }
    }
}
