//! Which endpoint a request tries next, and which failures earn a retry (SPEC sections 1 and
//! 11, Istio's defaults): a failed connect, a pooled connection found closed before the request
//! went out, a request the upstream refused before processing it (h2 `REFUSED_STREAM`, a stream
//! above a GOAWAY's last-stream-id) and, for idempotent requests without a body, a reset before
//! any response byte; a server sidecar's 503 `app-unavailable` counts as refused (its app never
//! took the connection). A retry goes to an endpoint the request has not tried yet, up to
//! `MAX_RETRIES` times. Apart from that 503, which goes no further than this proxy when it is
//! retried, nothing is retried once a response head arrived: from then on bytes may have
//! reached the client.

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{HeaderMap, Method, Request, Uri, Version};

use super::cluster::{Cluster, EndpointState};
use super::lb;
use crate::catalog::Labels;
use crate::config::Locality;
use crate::http::answer::{Reason, X_AETHER_ERROR};
use crate::http::body::ReqBody;

pub const MAX_RETRIES: usize = 2;

/// The endpoints one request has tried, and why the last one failed.
pub struct Tries<'a> {
    cluster: &'a Cluster,
    subset: Option<&'a Labels>,
    locality: Option<&'a Locality>,
    tried: Vec<SocketAddr>,
    last: Reason,
}

impl<'a> Tries<'a> {
    pub fn new(
        cluster: &'a Cluster,
        subset: Option<&'a Labels>,
        locality: Option<&'a Locality>,
    ) -> Tries<'a> {
        Tries {
            cluster,
            subset,
            locality,
            tried: Vec::new(),
            last: Reason::UpstreamConnectFailure,
        }
    }

    /// The next endpoint to try. When there is none, the answer: the balancer's reason on the
    /// first try, the last failure's after that.
    pub fn next(&self) -> Result<Arc<EndpointState>, Reason> {
        match lb::pick(self.cluster, self.subset, self.locality, &self.tried, |n| {
            fastrand::usize(..n)
        }) {
            Ok(e) => Ok(e),
            Err(r) if self.tried.is_empty() => Err(r),
            Err(_) => Err(self.last),
        }
    }

    /// Records a failed connect to `ep` (it counts for outlier detection). False when the
    /// request has no retry left.
    pub fn failed(&mut self, ep: &EndpointState, reason: Reason) -> bool {
        self.cluster.record(ep, true);
        self.tried.push(ep.address);
        self.last = reason;
        self.tried.len() <= MAX_RETRIES
    }

    /// Records that `ep` is not worth trying for this request (a dial to it just failed for
    /// another request, and outlier detection counted that one; or the pooled connection to it
    /// was found closed). False when no retry is left.
    pub fn skip(&mut self, ep: &EndpointState, reason: Reason) -> bool {
        self.tried.push(ep.address);
        self.last = reason;
        self.tried.len() <= MAX_RETRIES
    }

    /// Whether another attempt could follow this one: a retry is left and the cluster has an
    /// endpoint besides those tried and the current one. Only then is a request's head worth
    /// copying before it is sent.
    pub fn may_retry(&self) -> bool {
        self.tried.len() < MAX_RETRIES && self.cluster.endpoints.len() > self.tried.len() + 1
    }

    pub fn last(&self) -> Reason {
        self.last
    }
}

/// How an attempt failed after its request was handed to an upstream connection, before a
/// response head arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The upstream did not process the request: h2 `REFUSED_STREAM`, or the stream was above
    /// the last-stream-id of the peer's GOAWAY (or opened after it). Any method may go again.
    Refused,
    /// Reset, or the connection closed, before any response byte. The upstream may have acted
    /// on the request: only idempotent requests without a body go again.
    Reset,
    /// The exchange broke some other way (e.g. a malformed response): never retried.
    Broken,
}

impl Failure {
    /// The answer when this failure ends the request: a refused request never reached the
    /// app, like a failed connect (503); a broken exchange is 502.
    pub fn reason(self) -> Reason {
        match self {
            Failure::Refused => Reason::UpstreamConnectFailure,
            Failure::Reset | Failure::Broken => Reason::UpstreamProtocolError,
        }
    }

    /// The `reason` label of `aether_retries_total`.
    pub fn label(self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::Reset | Failure::Broken => "reset",
        }
    }
}

/// Reads the client's error for what happened to the request.
pub fn classify(e: &super::pool::Failed) -> Failure {
    match e {
        super::pool::Failed::H1(e) => classify_hyper(e),
        super::pool::Failed::H2(e) => classify_h2(e),
    }
}

fn classify_hyper(e: &hyper::Error) -> Failure {
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(h2) = s.downcast_ref::<h2::Error>() {
            return classify_h2(h2);
        }
        if s.downcast_ref::<std::io::Error>().is_some() {
            // The connection was reset or broke under the request.
            return Failure::Reset;
        }
        source = s.source();
    }
    // HTTP/1.1: the connection closed before the response was complete; a response that had
    // started would have been a parse error instead.
    if e.is_incomplete_message() || e.is_canceled() || e.is_closed() {
        return Failure::Reset;
    }
    Failure::Broken
}

fn classify_h2(e: &h2::Error) -> Failure {
    if e.is_remote() && (e.is_go_away() || e.reason() == Some(h2::Reason::REFUSED_STREAM)) {
        // h2 reports a GOAWAY on a stream only when the stream is above the frame's
        // last-stream-id (or opened after it); the streams below it go on or end otherwise.
        return Failure::Refused;
    }
    if e.is_remote() || e.is_io() {
        return Failure::Reset;
    }
    // h2 found the peer's frames malformed: bytes came, the exchange is broken.
    Failure::Broken
}

/// Whether `resp` is a server sidecar's 503 `app-unavailable`: its app's port did not take the
/// connection, so no app saw the request. Only a sidecar can say so: the inbound removes the
/// header from a 503 its app answered.
pub fn app_unavailable<B>(resp: &http::Response<B>) -> bool {
    resp.status() == http::StatusCode::SERVICE_UNAVAILABLE
        && resp
            .headers()
            .get(X_AETHER_ERROR)
            .is_some_and(|v| v.as_bytes() == Reason::AppUnavailable.as_str().as_bytes())
}

/// Idempotent methods (RFC 9110 section 9.2.2).
pub fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// A copy of a body-less request, kept to send it again after the attempt that consumes the
/// original failed. Made only when a retry is possible, so a request to a single-endpoint
/// cluster (or one with a body) pays nothing for it.
pub struct Resend {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    body: ReqBody,
}

impl Resend {
    /// `None` when `req` has a body: it cannot be sent twice.
    pub fn of(req: &Request<ReqBody>) -> Option<Resend> {
        Some(Resend {
            body: req.body().empty_twin()?,
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            headers: req.headers().clone(),
        })
    }

    /// Whether `failure` allows sending the request again.
    pub fn allowed_after(&self, failure: Failure) -> bool {
        match failure {
            Failure::Refused => true,
            Failure::Reset => idempotent(&self.method),
            Failure::Broken => false,
        }
    }

    pub fn into_request(self) -> Request<ReqBody> {
        let mut r = Request::new(self.body);
        *r.method_mut() = self.method;
        *r.uri_mut() = self.uri;
        *r.version_mut() = self.version;
        *r.headers_mut() = self.headers;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{Catalog, CatalogStore};
    use crate::outbound::cluster::Clusters;
    use std::path::Path;

    fn cluster(n: usize) -> Arc<Cluster> {
        let mut yaml = String::from(
            "services:\n  s:\n    default_port: 80\n    identity: spiffe://aether.local/ns/default/sa/s\n    endpoints:\n",
        );
        for i in 1..=n {
            yaml.push_str(&format!("      - {{ address: 10.0.0.{i} }}\n"));
        }
        let store = Arc::new(CatalogStore::new(
            Catalog::parse(Path::new("c.yaml"), &yaml, "aether.local").unwrap(),
        ));
        Clusters::new("aether.internal", store)
            .get_or_build("s", 80)
            .unwrap()
    }

    /// The pooled-connection-closed path records its endpoint like any other failure: the
    /// request's next try is elsewhere, and with nowhere else to go it ends with the reason.
    #[test]
    fn an_endpoint_is_never_tried_twice() {
        let c = cluster(2);
        let mut tries = Tries::new(&c, None, None);
        let first = tries.next().unwrap();
        assert!(tries.skip(&first, Reason::UpstreamConnectFailure));
        for _ in 0..50 {
            assert_ne!(tries.next().unwrap().address, first.address);
        }
        let second = tries.next().unwrap();
        assert!(tries.failed(&second, Reason::UpstreamProtocolError));
        assert_eq!(tries.next().err(), Some(Reason::UpstreamProtocolError));

        let c = cluster(1);
        let mut tries = Tries::new(&c, None, None);
        let only = tries.next().unwrap();
        tries.skip(&only, Reason::UpstreamConnectFailure);
        assert_eq!(tries.next().err(), Some(Reason::UpstreamConnectFailure));
    }

    /// A request's head is copied only when another attempt could follow.
    #[test]
    fn may_retry_needs_a_retry_left_and_another_endpoint() {
        let one = cluster(1);
        assert!(!Tries::new(&one, None, None).may_retry());
        let four = cluster(4);
        let mut tries = Tries::new(&four, None, None);
        for _ in 0..MAX_RETRIES {
            assert!(tries.may_retry());
            let ep = tries.next().unwrap();
            tries.skip(&ep, Reason::UpstreamConnectFailure);
        }
        assert!(!tries.may_retry(), "the last attempt has no retry after it");
    }

    #[test]
    fn idempotent_methods_are_rfc_9110s() {
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
            assert!(idempotent(&m.parse().unwrap()), "{m}");
        }
        for m in ["POST", "PATCH", "CONNECT", "PURGE"] {
            assert!(!idempotent(&m.parse().unwrap()), "{m}");
        }
    }
}
