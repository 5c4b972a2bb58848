//! The admin listener (SPEC section 6): health, readiness, metrics, drain, logging.
//!
//! It runs on its own small runtime thread so scrapes never compete with the data path. Its
//! own metric families (refused POSTs, readiness) are at the end of this file.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;

use crate::drain::{Drain, Phase};
use crate::readiness::{ListenerCheck, ListenerStatus};

/// Changes the log filter at run time (`POST /logging?level=...`).
pub type SetLogFilter = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Answers `/explain`'s query, or says what is wrong with it.
pub type Explain = Box<dyn Fn(&str) -> Result<serde_json::Value, String> + Send + Sync>;

/// A JSON view served at a path: the body, serialized by the view (large ones stream their
/// parts instead of building a `serde_json::Value`).
pub type View = Box<dyn Fn() -> Vec<u8> + Send + Sync>;

pub struct Admin {
    pub drain: Drain,
    /// Set once every data-plane listener is bound.
    pub bound: AtomicBool,
    pub listeners: Arc<ListenerCheck>,
    pub set_log_filter: SetLogFilter,
    /// Extra JSON views (config dump, clusters), set once the proxy has its identity.
    pub views: std::sync::OnceLock<Vec<(&'static str, View)>>,
    /// `GET /explain?authority=...`: where a request would go (`outbound::explain`).
    pub explain: std::sync::OnceLock<Explain>,
    /// Sets the gauges that are computed when scraped (certificate expiry).
    pub before_scrape: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    r
}

/// SPEC section 12: an admin POST with an `Origin` header (a browser, maybe a page tricking
/// one) or with a body (no admin POST takes one; an app's SSRF often carries one) is refused,
/// so neither can drain the pod or change its logging. The body is judged from the head alone
/// (a length above zero or chunked framing), so a refusal never waits for body bytes.
fn refuse_post(req: &Request<Incoming>) -> Option<&'static str> {
    use hyper::body::Body;
    if req.headers().contains_key(http::header::ORIGIN) {
        return Some("origin");
    }
    if !req.body().is_end_stream() {
        return Some("body");
    }
    None
}

/// True when the scraper's `Accept` names OpenMetrics without refusing it (`q=0`); Prometheus
/// sends it first, curl and older scrapers do not.
fn wants_openmetrics(req: &Request<Incoming>) -> bool {
    req.headers()
        .get_all(http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|choice| {
            let mut parts = choice.split(';').map(str::trim);
            parts
                .next()
                .is_some_and(|t| t.eq_ignore_ascii_case("application/openmetrics-text"))
                && !parts.any(|p| {
                    p.strip_prefix("q=")
                        .and_then(|q| q.parse::<f32>().ok())
                        .is_some_and(|q| q <= 0.0)
                })
        })
}

fn json(status: StatusCode, v: serde_json::Value) -> Response<Full<Bytes>> {
    let mut body = serde_json::to_vec(&v).unwrap_or_default();
    body.push(b'\n');
    reply(status, "application/json", body)
}

impl Admin {
    /// Serves admin (`health: false`) or the health listener (`health: true`, SPEC 12).
    pub async fn serve(self: Arc<Self>, listener: TcpListener, health: bool) {
        loop {
            let tcp = match listener.accept().await {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("admin accept failed: {e}");
                    tokio::time::sleep(crate::drain::ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let this = self.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let this = this.clone();
                    async move {
                        Ok::<_, Infallible>(if health {
                            this.health(req).await
                        } else {
                            this.handle(req).await
                        })
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(crate::http::limits::HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    }

    /// The health listener: readiness exactly as `/readyz`, liveness, nothing else.
    async fn health(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/healthz/ready") => self.readyz().await,
            (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
            _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
        }
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() == Method::POST {
            if let Some(reason) = refuse_post(&req) {
                metrics()
                    .admin_refused
                    .get_or_create(&ReasonLabels { reason })
                    .inc();
                let text = match reason {
                    "origin" => {
                        "admin POST refused: requests with an Origin header come from a browser\n"
                    }
                    _ => "admin POST refused: admin POSTs carry no body\n",
                };
                return reply(StatusCode::FORBIDDEN, "text/plain", text);
            }
        }
        let path = req.uri().path();
        match (req.method(), path) {
            (&Method::GET, "/health" | "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
            (&Method::GET, "/readyz") => self.readyz().await,
            (&Method::GET, "/metrics") => {
                if let Some(f) = self.before_scrape.get() {
                    f();
                }
                let ready = self.readyz().await.status() == StatusCode::OK;
                metrics().ready.set(i64::from(ready));
                let text = crate::metrics::encode();
                if wants_openmetrics(&req) {
                    reply(
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        text,
                    )
                } else {
                    reply(
                        StatusCode::OK,
                        "text/plain; version=0.0.4; charset=utf-8",
                        crate::metrics::classic_text(&text),
                    )
                }
            }
            (&Method::POST, "/drain") => {
                self.drain.advance(Phase::Notifying);
                reply(StatusCode::OK, "text/plain", "draining\n")
            }
            (&Method::POST, "/logging") => {
                let level = level_param(req.uri().query().unwrap_or(""));
                match level.and_then(|level| (self.set_log_filter)(&level).map(|()| level)) {
                    Ok(level) => reply(
                        StatusCode::OK,
                        "text/plain",
                        format!("log filter: {level}\n"),
                    ),
                    Err(e) => reply(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
                }
            }
            (&Method::GET, "/explain") => match self.explain.get() {
                Some(explain) => match explain(req.uri().query().unwrap_or("")) {
                    Ok(v) => json(StatusCode::OK, v),
                    Err(e) => reply(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
                },
                None => reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "starting\n"),
            },
            (&Method::GET, p) => match self
                .views
                .get()
                .and_then(|v| v.iter().find(|(name, _)| *name == p))
            {
                Some((_, view)) => {
                    let mut body = view();
                    body.push(b'\n');
                    reply(StatusCode::OK, "application/json", body)
                }
                None => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
            },
            _ => reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "method not allowed\n",
            ),
        }
    }

    async fn readyz(&self) -> Response<Full<Bytes>> {
        let not_ready = |reason: &str, missing: Vec<u16>| {
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"status": "not ready", "reason": reason, "missingListeners": missing}),
            )
        };
        if self.drain.phase() != Phase::Serving {
            return not_ready("draining", vec![]);
        }
        if !self.bound.load(Ordering::Acquire) {
            return not_ready("starting", vec![]);
        }
        if crate::overload::shedding() {
            return not_ready("overloaded", vec![]);
        }
        match self.listeners.check().await {
            ListenerStatus::Missing(ports) => not_ready("required listeners missing", ports),
            _ => json(StatusCode::OK, serde_json::json!({"status": "ready"})),
        }
    }
}

/// The `level` of `/logging?level=...`, percent-decoded (filters hold `=` and `,`, which
/// clients encode). Missing or empty is an error: an empty filter would silence everything.
fn level_param(query: &str) -> Result<String, String> {
    let raw = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("level="))
        .filter(|v| !v.is_empty())
        .ok_or("missing level: POST /logging?level=<filter>, for example level=debug")?;
    let level = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| format!("level {raw:?} is not UTF-8 once decoded"))?;
    match level.trim() {
        "" => Err("missing level: POST /logging?level=<filter>, for example level=debug".into()),
        l => Ok(l.to_string()),
    }
}

/// The admin listener's own families, registered with the rest when first used.
pub struct Metrics {
    /// Admin requests refused (`origin`, `body`).
    pub admin_refused: Family<ReasonLabels, Counter>,
    /// 1 while `/readyz` answers 200; set when scraped.
    pub ready: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            admin_refused: Family::default(),
            ready: Gauge::default(),
        };
        // Both reasons read 0 rather than absent from the start.
        for reason in ["origin", "body"] {
            let _ = m.admin_refused.get_or_create(&ReasonLabels { reason });
        }
        crate::metrics::register(|registry| {
            registry.register(
                "aether_ready",
                "1 while /readyz answers 200 (ready), else 0; read when scraped",
                m.ready.clone(),
            );
            registry.register(
                "aether_admin_requests_refused",
                "Admin POST requests refused (an Origin header or a body)",
                m.admin_refused.clone(),
            );
        });
        m
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_logging_level_is_percent_decoded_and_required() {
        assert_eq!(level_param("level=debug").unwrap(), "debug");
        assert_eq!(
            level_param("x=1&level=aether_proxy%3Ddebug%2Cinfo").unwrap(),
            "aether_proxy=debug,info"
        );
        assert!(level_param("").is_err());
        assert!(level_param("level=").is_err());
        assert!(level_param("lvl=debug").is_err());
        assert!(level_param("level=%20").is_err());
        assert!(level_param("level=%FF").unwrap_err().contains("UTF-8"));
    }
}
