//! The answers the proxy itself gives (SPEC section 7): a status, `x-aether-error: <reason>` and
//! a one-line text body. Every refusal on the request path is one of these `Reason`s.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{Either, Full};

/// A response body: streamed from a peer, or made here.
pub type Body = Either<super::upstream_body::UpBody, Full<Bytes>>;

pub const X_AETHER_ERROR: &str = "x-aether-error";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    BadAuthority,
    NotATcpPort,
    NotAnHttpPort,
    Forbidden,
    NoRoute,
    HeadersTooLarge,
    UpstreamProtocolError,
    UnknownService,
    PortNotExposed,
    NoEndpoints,
    NoHealthyUpstream,
    UpstreamConnectFailure,
    UpstreamIdentityMismatch,
    AppUnavailable,
    UpstreamTimeout,
    Overflow,
    DiscoveryTimeout,
    UpgradeNotSupported,
    BadRequest,
    UnsupportedTransferCoding,
    UriTooLong,
    Overloaded,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BadAuthority => "bad-authority",
            Reason::NotATcpPort => "not-a-tcp-port",
            Reason::NotAnHttpPort => "not-an-http-port",
            Reason::Forbidden => "forbidden",
            Reason::NoRoute => "no-route",
            Reason::HeadersTooLarge => "headers-too-large",
            Reason::UpstreamProtocolError => "upstream-protocol-error",
            Reason::UnknownService => "unknown-service",
            Reason::PortNotExposed => "port-not-exposed",
            Reason::NoEndpoints => "no-endpoints",
            Reason::NoHealthyUpstream => "no-healthy-upstream",
            Reason::UpstreamConnectFailure => "upstream-connect-failure",
            Reason::UpstreamIdentityMismatch => "upstream-identity-mismatch",
            Reason::AppUnavailable => "app-unavailable",
            Reason::UpstreamTimeout => "upstream-timeout",
            Reason::Overflow => "overflow",
            Reason::DiscoveryTimeout => "discovery-timeout",
            Reason::UpgradeNotSupported => "upgrade-not-supported",
            Reason::BadRequest => "bad-request",
            Reason::UnsupportedTransferCoding => "unsupported-transfer-coding",
            Reason::UriTooLong => "uri-too-long",
            Reason::Overloaded => "overloaded",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Reason::BadAuthority
            | Reason::NotATcpPort
            | Reason::NotAnHttpPort
            | Reason::UpgradeNotSupported
            | Reason::BadRequest => StatusCode::BAD_REQUEST,
            Reason::Forbidden => StatusCode::FORBIDDEN,
            Reason::NoRoute => StatusCode::NOT_FOUND,
            Reason::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Reason::UpstreamProtocolError => StatusCode::BAD_GATEWAY,
            Reason::UnsupportedTransferCoding => StatusCode::NOT_IMPLEMENTED,
            Reason::UriTooLong => StatusCode::URI_TOO_LONG,
            Reason::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Reason::UnknownService
            | Reason::PortNotExposed
            | Reason::NoEndpoints
            | Reason::NoHealthyUpstream
            | Reason::UpstreamConnectFailure
            | Reason::UpstreamIdentityMismatch
            | Reason::AppUnavailable
            | Reason::Overflow
            | Reason::DiscoveryTimeout
            | Reason::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn message(self) -> &'static str {
        match self {
            Reason::BadAuthority => "missing or malformed authority or port",
            Reason::NotATcpPort => "CONNECT is only for ports whose protocol is tcp",
            Reason::NotAnHttpPort => "this port carries raw TCP; use CONNECT",
            Reason::Forbidden => "peer identity is not allowed on this port",
            Reason::NoRoute => "authority is not a mesh service",
            Reason::HeadersTooLarge => "request headers too large",
            Reason::UpstreamProtocolError => "upstream broke the HTTP exchange",
            Reason::UnknownService => "no such service in the catalog",
            Reason::PortNotExposed => "no endpoint of the service serves this port",
            Reason::NoEndpoints => "no eligible endpoint for this port",
            Reason::NoHealthyUpstream => "every endpoint is ejected",
            Reason::UpstreamConnectFailure => "could not connect to an endpoint",
            Reason::UpstreamIdentityMismatch => "upstream identity does not match the service",
            Reason::AppUnavailable => "the application port did not answer",
            Reason::UpstreamTimeout => "upstream did not answer in time",
            Reason::Overflow => "a circuit breaker of the cluster is full",
            Reason::DiscoveryTimeout => "the control plane did not answer for the cluster in time",
            Reason::UpgradeNotSupported => {
                "this port speaks only HTTP/2; HTTP/1.1 upgrades cannot reach it"
            }
            Reason::BadRequest => "the request's framing or fields are malformed",
            Reason::UnsupportedTransferCoding => "only the chunked transfer coding is supported",
            Reason::UriTooLong => "the request target is over the limit",
            Reason::Overloaded => "the proxy is near its memory limit and sheds new requests",
        }
    }

    /// The one-line body: `<reason>: <message>\n`.
    pub fn body_line(self) -> String {
        format!("{}: {}\n", self.as_str(), self.message())
    }

    /// The full answer.
    pub fn response(self) -> Response<Body> {
        let mut r = Response::new(Either::Right(Full::new(Bytes::from(self.body_line()))));
        *r.status_mut() = self.status();
        let h = r.headers_mut();
        h.insert(X_AETHER_ERROR, HeaderValue::from_static(self.as_str()));
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        );
        r
    }
}
