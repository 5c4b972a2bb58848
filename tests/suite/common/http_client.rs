//! The HTTP client side: HTTP/1.1 or HTTP/2 over any stream, CONNECT tunnels, one-shot GETs.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};

use super::{tcp_connect, within, IO_TIMEOUT};

/// A response, fully read.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// The `x-aether-error` reason, if the proxy answered itself.
    pub fn aether_error(&self) -> Option<&str> {
        self.header("x-aether-error")
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The body as JSON; panics with the body if it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.text()))
    }
}

/// An HTTP client connection (hyper's `client::conn`) over any stream: TLS, plain TCP, ...
/// Each request is bounded by [`IO_TIMEOUT`].
pub enum HttpClient {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl HttpClient {
    /// HTTP/1.1 over `io`.
    pub async fn h1<S>(io: S) -> Result<HttpClient, String>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (send, conn) = within(
            IO_TIMEOUT,
            "h1 handshake",
            hyper::client::conn::http1::handshake(TokioIo::new(io)),
        )
        .await?
        .map_err(|e| format!("h1 handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(HttpClient::H1(send))
    }

    /// HTTP/2 (prior knowledge, or after ALPN h2) over `io`.
    pub async fn h2<S>(io: S) -> Result<HttpClient, String>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (send, conn) = within(
            IO_TIMEOUT,
            "h2 handshake",
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)),
        )
        .await?
        .map_err(|e| format!("h2 handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(HttpClient::H2(send))
    }

    pub fn is_h2(&self) -> bool {
        matches!(self, HttpClient::H2(_))
    }

    /// Sends `req` and reads the whole response.
    ///
    /// The URI may be absolute (`http://payments.aether.internal/x`) or origin-form with a
    /// `Host` header; it is put in the form the protocol wants: origin-form plus `Host` for
    /// HTTP/1.1, absolute (`:authority`) for HTTP/2. An absolute-form HTTP/1.1 request can be
    /// sent with [`HttpClient::send_raw`].
    pub async fn send(&mut self, req: Request<Full<Bytes>>) -> Result<Reply, String> {
        let req = if self.is_h2() {
            to_h2_form(req)?
        } else {
            to_h1_form(req)?
        };
        self.send_raw(req).await
    }

    /// Sends `req` exactly as given.
    pub async fn send_raw(&mut self, req: Request<Full<Bytes>>) -> Result<Reply, String> {
        let fut = async {
            let resp = match self {
                HttpClient::H1(s) => {
                    s.ready().await.map_err(|e| format!("h1 not ready: {e}"))?;
                    s.send_request(req).await
                }
                HttpClient::H2(s) => {
                    s.ready().await.map_err(|e| format!("h2 not ready: {e}"))?;
                    s.send_request(req).await
                }
            }
            .map_err(|e| format!("request failed: {e}"))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| format!("reading the response body: {e}"))?
                .to_bytes();
            Ok(Reply {
                status: parts.status,
                version: parts.version,
                headers: parts.headers,
                body,
            })
        };
        within(IO_TIMEOUT, "HTTP request", fut).await?
    }

    /// `GET uri` with no extra headers.
    pub async fn get(&mut self, uri: &str) -> Result<Reply, String> {
        self.send(Request::get(uri).body(Full::new(Bytes::new())).unwrap())
            .await
    }
}

/// Why [`http_connect`] got no tunnel.
#[derive(Debug)]
pub enum TunnelError {
    /// The proxy answered, but not with 2xx (e.g. 400 `not-a-tcp-port`).
    Refused(Reply),
    /// No answer, or the upgrade failed.
    Failed(String),
}

/// An HTTP/1.1 `CONNECT authority` over `io`; on a 2xx answer, the raw tunnel.
pub async fn http_connect<S>(
    io: S,
    authority: &str,
) -> Result<TokioIo<hyper::upgrade::Upgraded>, TunnelError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let fail = TunnelError::Failed;
    let (mut send, conn) = within(
        IO_TIMEOUT,
        "h1 handshake",
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(io)),
    )
    .await
    .map_err(fail)?
    .map_err(|e| fail(format!("h1 handshake: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let req = Request::connect(authority)
        .header(http::header::HOST, authority)
        .body(Full::new(Bytes::new()))
        .map_err(|e| fail(format!("CONNECT request: {e}")))?;
    let resp = within(IO_TIMEOUT, "CONNECT", send.send_request(req))
        .await
        .map_err(fail)?
        .map_err(|e| fail(format!("CONNECT: {e}")))?;
    if !resp.status().is_success() {
        let (parts, body) = resp.into_parts();
        let body = within(IO_TIMEOUT, "CONNECT answer body", body.collect())
            .await
            .map_err(fail)?
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err(TunnelError::Refused(Reply {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body,
        }));
    }
    let upgraded = within(IO_TIMEOUT, "CONNECT upgrade", hyper::upgrade::on(resp))
        .await
        .map_err(fail)?
        .map_err(|e| fail(format!("CONNECT upgrade: {e}")))?;
    Ok(TokioIo::new(upgraded))
}

fn to_h1_form(mut req: Request<Full<Bytes>>) -> Result<Request<Full<Bytes>>, String> {
    if let Some(auth) = req.uri().authority().cloned() {
        if !req.headers().contains_key(http::header::HOST) {
            req.headers_mut().insert(
                http::header::HOST,
                auth.as_str().parse().map_err(|e| format!("host: {e}"))?,
            );
        }
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        *req.uri_mut() = pq.parse().map_err(|e| format!("uri: {e}"))?;
    }
    *req.version_mut() = Version::HTTP_11;
    Ok(req)
}

fn to_h2_form(mut req: Request<Full<Bytes>>) -> Result<Request<Full<Bytes>>, String> {
    if req.uri().authority().is_none() {
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("localhost")
            .to_string();
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        *req.uri_mut() = Uri::builder()
            .scheme("http")
            .authority(host)
            .path_and_query(pq)
            .build()
            .map_err(|e| format!("uri: {e}"))?;
    }
    req.headers_mut().remove(http::header::HOST);
    *req.version_mut() = Version::HTTP_2;
    Ok(req)
}

/// One plaintext HTTP/1.1 `GET` on a fresh connection (admin endpoints and the like).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<Reply, String> {
    let tcp = tcp_connect(addr).await?;
    let req = Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    HttpClient::h1(tcp).await?.send(req).await
}

/// A request builder result with an empty body; shorthand for tests.
pub fn get(uri: &str) -> http::request::Builder {
    Request::get(uri)
}

/// Finishes a builder with an empty body.
pub fn empty(b: http::request::Builder) -> Request<Full<Bytes>> {
    b.body(Full::new(Bytes::new())).expect("valid request")
}
