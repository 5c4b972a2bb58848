//! Connection-specific fields: the hop-by-hop headers removed at each hop, when an HTTP/1
//! connection closes after a request, and trailers an HTTP/1.1 client asked for (`TE`).

use http::header::{HeaderMap, HeaderName, HeaderValue};

use super::added::{XFCC, X_REQUEST_ID};

/// Removes connection-specific headers, which must not cross a proxy (RFC 9110 7.6.1) and
/// are illegal in HTTP/2. Headers a `Connection` header names go too, except the ones this
/// proxy answers for (SPEC section 8): `x-request-id` keeps the value the request carried, and
/// XFCC is set by the inbound side after this removal, so a peer cannot make it vanish.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // One pass over the names finds which of them are present; most messages carry none, and
    // a lookup per absent name would cost more than the pass.
    let mut present = 0u8;
    // A header literally named `close`: only then does `Connection: close` name one to remove.
    let mut close_header = false;
    for n in h.keys() {
        if let Some(i) = hop_by_hop_at(n) {
            present |= 1 << i;
        } else if n.as_str() == "close" {
            close_header = true;
        }
    }
    if present == 0 {
        return;
    }
    if present & (1 << CONNECTION_AT) != 0 {
        let mut named: Vec<HeaderName> = Vec::new();
        let tokens = h
            .get_all(http::header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim);
        for t in tokens {
            // The usual tokens: `keep-alive` is removed below when present, and `close`
            // (every request of an h1 client that does not reuse connections) names a header
            // only when the pass above saw one.
            if t.eq_ignore_ascii_case("keep-alive") {
                continue;
            }
            if t.eq_ignore_ascii_case("close") {
                if close_header {
                    named.push(HeaderName::from_static("close"));
                }
                continue;
            }
            if let Ok(n) = HeaderName::from_bytes(t.as_bytes()) {
                if n != X_REQUEST_ID && n != XFCC {
                    named.push(n);
                }
            }
        }
        for n in named {
            h.remove(n);
        }
    }
    for (i, n) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 && i != TE_AT {
            h.remove(n);
        }
    }
    // `TE: trailers` is the one TE value HTTP/2 allows, and gRPC needs it. Any other value, in
    // any of the `te` headers, removes them all (a list like `trailers, gzip` is not kept).
    if present & (1 << TE_AT) == 0 {
        return;
    }
    let te_only_trailers = h
        .get_all(http::header::TE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .all(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"));
    if !te_only_trailers {
        h.remove(http::header::TE);
    }
}

/// Where `n` is in [`HOP_BY_HOP`]: one match on the name's text, cheaper than seven
/// comparisons of `HeaderName`s.
fn hop_by_hop_at(n: &HeaderName) -> Option<usize> {
    Some(match n.as_str() {
        "connection" => CONNECTION_AT,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "transfer-encoding" => 3,
        "upgrade" => 4,
        "proxy-authorization" => 5,
        "te" => TE_AT,
        "http2-settings" => 7,
        _ => return None,
    })
}

/// The connection-specific headers (`TE` is kept when it only asks for trailers).
const CONNECTION_AT: usize = 0;
const TE_AT: usize = 6;
static HOP_BY_HOP: [HeaderName; 8] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::PROXY_AUTHORIZATION,
    http::header::TE,
    // Sent with `Upgrade: h2c`, which is never forwarded; connection-specific (RFC 9113 3.2.1
    // of its predecessor), so it goes whether or not `Connection` names it.
    HeaderName::from_static("http2-settings"),
];

/// True for an HTTP/1.x request whose `TE` asks for trailers: hyper writes a response's
/// trailers to such a client, but only the ones its `Trailer` header declared.
pub fn h1_wants_trailers<B>(req: &http::Request<B>) -> bool {
    req.version() < http::Version::HTTP_2
        && req
            .headers()
            .get_all(http::header::TE)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
}

/// True for an HTTP/1.x request after whose response the connection closes (RFC 9112 9.3):
/// HTTP/1.1 with a `close` token in `Connection`, or HTTP/1.0 without `keep-alive`. CONNECT
/// and upgrades are never the last: their socket lives on as a tunnel.
pub fn h1_closes_after<B>(req: &http::Request<B>) -> bool {
    let v = req.version();
    if v >= http::Version::HTTP_2 || req.method() == http::Method::CONNECT {
        return false;
    }
    let mut close = false;
    let mut keep_alive = false;
    for t in req
        .headers()
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
    {
        let t = t.trim_ascii();
        if t.eq_ignore_ascii_case(b"upgrade") {
            return false;
        }
        close |= t.eq_ignore_ascii_case(b"close");
        keep_alive |= t.eq_ignore_ascii_case(b"keep-alive");
    }
    close || (v < http::Version::HTTP_11 && !keep_alive)
}

/// gRPC servers send `grpc-status` and its companions as trailers without declaring them (HTTP/2
/// needs no `Trailer` header). For an HTTP/1.1 client that asked for trailers, a gRPC response
/// that declares none gets them declared, so they are written instead of dropped. Other
/// undeclared trailers cannot be known before the head is sent, and are not written to
/// HTTP/1.1 clients.
pub fn declare_grpc_trailers(h: &mut HeaderMap) {
    let grpc = h
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if grpc && !h.contains_key(http::header::TRAILER) {
        h.insert(
            http::header::TRAILER,
            HeaderValue::from_static("grpc-status, grpc-message, grpc-status-details-bin"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_requests_after_which_an_http1_connection_closes() {
        let req = |v: http::Version, m: http::Method, conn: &[&'static str]| {
            let mut b = http::Request::builder().version(v).method(m).uri("/");
            for c in conn {
                b = b.header("connection", *c);
            }
            b.body(()).unwrap()
        };
        use http::Method as M;
        use http::Version as V;
        let closes = [
            req(V::HTTP_11, M::GET, &["close"]),
            req(V::HTTP_11, M::POST, &["x-a, Close"]),
            req(V::HTTP_11, M::GET, &["keep-alive", "close"]),
            req(V::HTTP_10, M::GET, &[]),
            req(V::HTTP_10, M::GET, &["x-a"]),
        ];
        for r in &closes {
            assert!(h1_closes_after(r), "{r:?}");
        }
        let stays = [
            req(V::HTTP_11, M::GET, &[]),
            req(V::HTTP_11, M::GET, &["keep-alive"]),
            req(V::HTTP_10, M::GET, &["Keep-Alive"]),
            // The socket outlives these as a tunnel.
            req(V::HTTP_11, M::GET, &["close, upgrade"]),
            req(V::HTTP_11, M::CONNECT, &["close"]),
            // HTTP/2 has no connection-level close per request.
            req(V::HTTP_2, M::GET, &["close"]),
        ];
        for r in &stays {
            assert!(!h1_closes_after(r), "{r:?}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("gzip"));
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
        let mut h = HeaderMap::new();
        h.insert("te", HeaderValue::from_static("trailers"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.get("te").unwrap(), "trailers");
        // Every value of every `te` header must be `trailers`.
        for bad in [&["trailers, gzip"][..], &["trailers", "deflate"], &["gzip"]] {
            let mut h = HeaderMap::new();
            for v in bad {
                h.append("te", HeaderValue::from_static(v));
            }
            strip_hop_by_hop(&mut h);
            assert!(!h.contains_key("te"), "{bad:?}");
        }
        let mut h = HeaderMap::new();
        h.append("te", HeaderValue::from_static("Trailers"));
        h.append("te", HeaderValue::from_static("trailers ,trailers"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.get_all("te").iter().count(), 2);
    }

    #[test]
    fn connection_close_removes_a_header_named_close_and_nothing_else() {
        for token in ["close", "Close", " keep-alive , CLOSE "] {
            let mut h = HeaderMap::new();
            h.insert("connection", HeaderValue::from_static(token));
            h.insert("x-keep", HeaderValue::from_static("1"));
            strip_hop_by_hop(&mut h);
            assert_eq!(h.len(), 1, "{token}");
            let mut h = HeaderMap::new();
            h.insert("connection", HeaderValue::from_static(token));
            h.insert("close", HeaderValue::from_static("1"));
            h.insert("x-keep", HeaderValue::from_static("1"));
            strip_hop_by_hop(&mut h);
            assert!(!h.contains_key("close"), "{token}");
            assert_eq!(h.len(), 1, "{token}");
        }
        // Without `Connection` naming it, a header called `close` is an ordinary one.
        let mut h = HeaderMap::new();
        h.insert("close", HeaderValue::from_static("1"));
        h.insert("te", HeaderValue::from_static("gzip"));
        strip_hop_by_hop(&mut h);
        assert!(h.contains_key("close"));
    }

    #[test]
    fn each_hop_by_hop_header_alone_is_removed() {
        for (i, n) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_at(n), Some(i), "{n}");
        }
        for name in [
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "upgrade",
            "proxy-authorization",
            "te",
        ] {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_static("x"));
            h.insert("x-keep", HeaderValue::from_static("1"));
            strip_hop_by_hop(&mut h);
            assert!(!h.contains_key(name), "{name}");
            assert_eq!(h.len(), 1, "{name}");
        }
    }

    #[test]
    fn grpc_trailers_are_declared_only_when_undeclared() {
        let mut h = HeaderMap::new();
        h.insert(
            "content-type",
            HeaderValue::from_static("application/grpc+proto"),
        );
        declare_grpc_trailers(&mut h);
        assert!(h
            .get("trailer")
            .unwrap()
            .to_str()
            .unwrap()
            .contains("grpc-status"));
        h.insert("trailer", HeaderValue::from_static("x-own"));
        declare_grpc_trailers(&mut h);
        assert_eq!(h.get("trailer").unwrap(), "x-own");
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        declare_grpc_trailers(&mut h);
        assert!(!h.contains_key("trailer"));
        let req = |v, te: &'static str| {
            http::Request::builder()
                .version(v)
                .header("te", te)
                .body(())
                .unwrap()
        };
        assert!(h1_wants_trailers(&req(
            http::Version::HTTP_11,
            "gzip, Trailers"
        )));
        assert!(!h1_wants_trailers(&req(http::Version::HTTP_11, "gzip")));
        assert!(!h1_wants_trailers(&req(http::Version::HTTP_2, "trailers")));
    }

    #[test]
    fn connection_cannot_name_away_the_request_id_or_xfcc() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("x-request-id, X-Forwarded-Client-Cert, x-other"),
        );
        h.insert(X_REQUEST_ID, HeaderValue::from_static("id-1"));
        h.insert(XFCC, HeaderValue::from_static("By=a"));
        h.insert("x-other", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.get(X_REQUEST_ID).unwrap(), "id-1");
        assert!(h.contains_key(XFCC));
        assert!(!h.contains_key("x-other"));
    }
}
