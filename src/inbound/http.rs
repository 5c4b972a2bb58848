//! HTTP chains: terminate h1/h2 from the peer proxy, apply `allow`, set XFCC and
//! `x-request-id`, and forward to the app in the chain's protocol (h2c prior knowledge for
//! `h2`, HTTP/1.1 for `http1`, the arriving protocol for `auto`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderValue, Request, Response, Uri, Version};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use super::chain::Chain;
use super::{Inbound, Peer, TlsStream};
use crate::accesslog;
use crate::config::Protocol;
use crate::drain::{Drain, Phase};
use crate::errors::{Body, Reason};
use crate::headers;
use crate::identity::tls::ALPN_H2;
use crate::metrics::{self, Direction};
use crate::pool::{self, Conn};

/// Server builders, made once and shared by every connection.
pub struct Servers {
    h1: hyper::server::conn::http1::Builder,
    h2: hyper::server::conn::http2::Builder<TokioExecutor>,
    auto: hyper_util::server::conn::auto::Builder<TokioExecutor>,
}

/// Slow clients are cut off after this long without a complete header block.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle downstream connections close after this long (SPEC section 8).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

impl Servers {
    pub fn new() -> Servers {
        let mut h1 = hyper::server::conn::http1::Builder::new();
        configure_h1(&mut h1);
        let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        configure_h2(&mut h2);
        let mut auto = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        // The auto builder wraps the same settings behind its own types.
        auto.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .max_headers(headers::MAX_HEADERS * 2)
            .max_buf_size(256 * 1024)
            .keep_alive(true);
        auto.http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(1024)
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(24 << 20)
            .max_frame_size(64 << 10)
            .max_header_list_size(256 * 1024)
            .max_pending_accept_reset_streams(Some(200))
            .max_local_error_reset_streams(Some(1024));
        Servers { h1, h2, auto }
    }
}

impl Default for Servers {
    fn default() -> Self {
        Servers::new()
    }
}

fn configure_h1(b: &mut hyper::server::conn::http1::Builder) {
    // hyper answers past its own limits; ours (100 headers, 60 KiB) are checked per request so
    // the answer carries `x-aether-error`.
    b.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_headers(headers::MAX_HEADERS * 2)
        .max_buf_size(256 * 1024)
        .keep_alive(true);
}

fn configure_h2(b: &mut hyper::server::conn::http2::Builder<TokioExecutor>) {
    b.timer(TokioTimer::new())
        .max_concurrent_streams(1024)
        .initial_stream_window_size(16 << 20)
        .initial_connection_window_size(24 << 20)
        .max_frame_size(64 << 10)
        .max_header_list_size(256 * 1024)
        // Rapid reset (CVE-2023-44487): h2 closes connections that reset too many streams.
        .max_pending_accept_reset_streams(Some(200))
        .max_local_error_reset_streams(Some(1024));
}

/// Serves one HTTP connection until it ends, or finishes it gracefully once the drain closes.
macro_rules! serve_until_drained {
    ($conn:expr, $drain:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let closing = Drain::reached($drain.watch(), Phase::Closing);
        tokio::select! {
            r = conn.as_mut() => r.map_err(|e| e.to_string()),
            _ = closing => {
                conn.as_mut().graceful_shutdown();
                conn.await.map_err(|e| e.to_string())
            }
        }
    }};
}

pub async fn serve(inbound: Arc<Inbound>, chain: Chain, peer: Peer, own_id: &str, tls: TlsStream) {
    let h2_alpn = tls.ssl().selected_alpn_protocol() == Some(ALPN_H2);
    let no_alpn = tls.ssl().selected_alpn_protocol().is_none();
    let conn = Arc::new(ConnCtx {
        xfcc: headers::xfcc_value(own_id, &peer.cert_hash, &peer.spiffe_id),
        chain,
        peer,
    });
    let proto = conn.chain.protocol;
    let drain = inbound.drain.clone();
    let svc = {
        let inbound = inbound.clone();
        service_fn(move |req| {
            let inbound = inbound.clone();
            let conn = conn.clone();
            async move { Ok::<_, Infallible>(inbound.request(req, &conn).await) }
        })
    };
    let io = TokioIo::new(tls);
    let s = &inbound.servers;
    let result = match proto {
        Protocol::H2 => serve_until_drained!(s.h2.serve_connection(io, svc), drain),
        Protocol::Http1 => serve_until_drained!(s.h1.serve_connection(io, svc), drain),
        _ if h2_alpn => serve_until_drained!(s.h2.serve_connection(io, svc), drain),
        _ if !no_alpn => serve_until_drained!(s.h1.serve_connection(io, svc), drain),
        // No ALPN on an auto chain: sniff the HTTP/2 preface.
        _ => serve_until_drained!(s.auto.serve_connection(io, svc), drain),
    };
    if let Err(e) = result {
        tracing::debug!("inbound http connection ended: {e}");
    }
}

struct ConnCtx {
    chain: Chain,
    peer: Peer,
    xfcc: HeaderValue,
}

impl Inbound {
    async fn request(&self, mut req: Request<Incoming>, conn: &ConnCtx) -> Response<Body> {
        let start = Instant::now();
        let request_id = headers::ensure_request_id(req.headers_mut());
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let authority = req
            .uri()
            .authority()
            .map(|a| a.to_string())
            .or_else(|| {
                req.headers()
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_string)
            })
            .unwrap_or_default();
        let (resp, reason) = match self.forward(req, conn, &authority).await {
            Ok(resp) => (resp.map(Either::Left), None),
            Err(reason) => (reason.response(), Some(reason)),
        };
        let mut resp = resp;
        if self.drain.phase() >= Phase::Closing {
            // HTTP/1.1 peers learn to reconnect elsewhere; hyper drops it on h2.
            resp.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        let status = resp.status().as_u16();
        let m = metrics::get();
        m.requests
            .get_or_create(&metrics::RequestLabels {
                direction: Direction::inbound,
                service: self.service_label.clone(),
                port: conn.chain.port,
                code: status,
            })
            .inc();
        let elapsed = start.elapsed();
        m.duration
            .get_or_create(&metrics::DirectionLabels {
                direction: Direction::inbound,
            })
            .observe(elapsed.as_secs_f64());
        accesslog::log(&accesslog::Entry {
            time: accesslog::now_rfc3339(),
            direction: "inbound",
            method: method.as_str(),
            authority: &authority,
            path: &path,
            status,
            error: reason.map(Reason::as_str),
            upstream: Some(format!("{}:{}", self.app_host, conn.chain.port)),
            duration_ms: elapsed.as_secs_f64() * 1000.0,
            bytes_received: 0,
            bytes_sent: content_length(resp.headers()),
            peer_identity: Some(&conn.peer.spiffe_id),
            request_id: request_id.to_str().ok(),
        });
        resp
    }

    async fn forward(
        &self,
        mut req: Request<Incoming>,
        conn: &ConnCtx,
        authority: &str,
    ) -> Result<Response<Incoming>, Reason> {
        if headers::too_large(req.headers()) {
            return Err(Reason::HeadersTooLarge);
        }
        if !conn.chain.allows(&conn.peer.spiffe_id) {
            return Err(Reason::Forbidden);
        }
        let h = req.headers_mut();
        headers::strip_hop_by_hop(h);
        // Only this proxy may speak for the peer's certificate.
        h.insert(headers::XFCC, conn.xfcc.clone());
        let to_h2 = match conn.chain.protocol {
            Protocol::H2 => true,
            Protocol::Http1 => false,
            _ => req.version() == Version::HTTP_2,
        };
        let port = conn.chain.port;
        set_target(&mut req, to_h2, authority, self.app_host, port)?;
        let key = (port, to_h2);
        let sender = match self.app_pool.get(&key, 0) {
            Some(c) => c,
            None => self.connect_app(port, to_h2).await?,
        };
        let resp = match sender {
            Conn::H1(mut s, uses) => {
                let r = s.send_request(req).await;
                if r.is_ok() {
                    self.app_pool.put_h1_when_ready(key, s, uses + 1, 0);
                }
                r
            }
            Conn::H2(mut s, _) => {
                if s.ready().await.is_err() {
                    return Err(Reason::AppUnavailable);
                }
                s.send_request(req).await
            }
        };
        let mut resp = resp.map_err(|e| {
            tracing::debug!(port, "inbound: app broke the exchange: {e}");
            Reason::UpstreamProtocolError
        })?;
        headers::strip_hop_by_hop(resp.headers_mut());
        Ok(resp)
    }

    async fn connect_app(&self, port: u16, h2: bool) -> Result<Conn, Reason> {
        let tcp = TcpStream::connect((self.app_host, port))
            .await
            .map_err(|e| {
                tracing::debug!(port, "inbound: app port did not answer: {e}");
                Reason::AppUnavailable
            })?;
        let _ = tcp.set_nodelay(true);
        let io = TokioIo::new(tcp);
        if h2 {
            let s = pool::handshake_h2(io).await.map_err(|e| {
                tracing::debug!(port, "inbound: h2c handshake with the app failed: {e}");
                Reason::UpstreamProtocolError
            })?;
            let uses = self.app_pool.put_h2((port, true), s.clone(), 0);
            Ok(Conn::H2(s, uses))
        } else {
            let s = pool::handshake_h1(io)
                .await
                .map_err(|_| Reason::AppUnavailable)?;
            Ok(Conn::H1(s, 0))
        }
    }
}

/// Points the request at the app: absolute URI with the original authority for h2 (it becomes
/// `:authority`), origin-form plus `Host` for HTTP/1.1.
fn set_target(
    req: &mut Request<Incoming>,
    to_h2: bool,
    authority: &str,
    app_host: std::net::IpAddr,
    port: u16,
) -> Result<(), Reason> {
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    if to_h2 {
        let auth = if authority.is_empty() {
            format!("{app_host}:{port}")
        } else {
            authority.to_string()
        };
        let scheme = req.uri().scheme_str().unwrap_or("http").to_string();
        *req.uri_mut() = Uri::builder()
            .scheme(scheme.as_str())
            .authority(auth)
            .path_and_query(pq)
            .build()
            .map_err(|_| Reason::BadAuthority)?;
        req.headers_mut().remove(http::header::HOST);
        *req.version_mut() = Version::HTTP_2;
    } else {
        if !authority.is_empty() && !req.headers().contains_key(http::header::HOST) {
            let v = HeaderValue::from_str(authority).map_err(|_| Reason::BadAuthority)?;
            req.headers_mut().insert(http::header::HOST, v);
        }
        *req.uri_mut() = Uri::try_from(pq).map_err(|_| Reason::BadAuthority)?;
        *req.version_mut() = Version::HTTP_11;
    }
    Ok(())
}

pub fn content_length(h: &http::HeaderMap) -> u64 {
    h.get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
