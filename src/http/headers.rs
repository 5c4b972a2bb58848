//! Header handling shared by both directions: hop-by-hop removal, request ids, XFCC, limits.

use http::header::{HeaderMap, HeaderName, HeaderValue};

use super::answer::Reason;

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const XFCC: HeaderName = HeaderName::from_static("x-forwarded-client-cert");

/// SPEC section 8: at most 100 headers and 60 KiB of them.
pub const MAX_HEADERS: usize = 100;
pub const MAX_HEADER_BYTES: usize = 60 * 1024;

/// True when the header block is over the limits (answer 431 `headers-too-large`).
pub fn too_large(h: &HeaderMap) -> bool {
    if h.len() > MAX_HEADERS {
        return true;
    }
    let bytes: usize = h.iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    bytes > MAX_HEADER_BYTES
}

/// Readies an upstream's response to go downstream: its hop-by-hop fields removed, and this
/// proxy's own HTTP version on it, as an intermediary answers (RFC 9110, section 6.2). hyper
/// writes a response's version on its status line: an HTTP/1.0 app's answer went on as
/// `HTTP/1.0` to HTTP/1.1 clients, and each h1 hop then closed its connection after it, the
/// sidecars' mTLS connection included. hyper still answers an HTTP/1.0 client in HTTP/1.0.
pub fn forwarded_response<B>(resp: &mut http::Response<B>) {
    strip_hop_by_hop(resp.headers_mut());
    *resp.version_mut() = http::Version::HTTP_11;
}

/// Why an HTTP/1 request's framing is refused (SPEC 11), before anything is forwarded:
/// `Content-Length` with `Transfer-Encoding`, or two `Content-Length` fields, is ambiguous
/// (the request smuggling of RFC 9112 section 11.2), 400; a transfer coding other than
/// `chunked` would reach the app still coded once the hop-by-hop header is gone, 501. Either
/// way the connection closes after the answer. HTTP/2 frames its own bodies.
pub fn framing_error<B>(req: &http::Request<B>) -> Option<Reason> {
    if req.version() >= http::Version::HTTP_2 {
        return None;
    }
    let h = req.headers();
    let lengths = h.get_all(http::header::CONTENT_LENGTH).iter().count();
    let mut codings = h.get_all(http::header::TRANSFER_ENCODING).iter().peekable();
    if codings.peek().is_some() {
        if lengths > 0 {
            return Some(Reason::BadRequest);
        }
        let only_chunked = codings
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            .all(|t| t.eq_ignore_ascii_case(b"chunked"));
        if !only_chunked {
            return Some(Reason::UnsupportedTransferCoding);
        }
    }
    (lengths > 1).then_some(Reason::BadRequest)
}

/// Why a response to a plain (not upgrade) request cannot be passed on, if it cannot: a
/// transfer coding other than `chunked` (the hop-by-hop `Transfer-Encoding` is removed, and
/// the client would read still-coded bytes as plain), or a `101` (no upgrade was forwarded, so
/// a switch would be a tunnel the proxy never agreed to). Either is 502.
pub fn unforwardable<B>(resp: &http::Response<B>) -> Option<&'static str> {
    if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        return Some("switched protocols unasked");
    }
    let only_chunked = resp
        .headers()
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .all(|t| t.eq_ignore_ascii_case(b"chunked"));
    (!only_chunked).then_some("answered with a transfer coding other than chunked")
}

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

/// The protocol an HTTP/1.1 request may switch to through this proxy: the tokens of its
/// `Upgrade` value, when `Connection` names `upgrade` too (RFC 9110 7.8), that are opaque
/// protocols this hop tunnels. `h2c` never is (RFC 9113 deprecates it, and after a tunnel the
/// proxy could no longer set XFCC or enforce anything); with `allowed`, only the tokens it lists
/// (a port's `upgrades`, lowercased), compared without a `/version`. None: the request goes on
/// as a plain request, its `Upgrade` removed with the other hop-by-hop fields. HTTP/2 has no
/// upgrades.
pub fn upgrade_of<B>(req: &http::Request<B>, allowed: Option<&[String]>) -> Option<HeaderValue> {
    if req.version() != http::Version::HTTP_11 {
        return None;
    }
    let asked = req
        .headers()
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if !asked {
        return None;
    }
    let mut kept = String::new();
    for t in req
        .headers()
        .get_all(http::header::UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        let name = t.split('/').next().unwrap_or_default();
        if name.eq_ignore_ascii_case("h2c") {
            continue;
        }
        if let Some(allowed) = allowed {
            if !allowed.iter().any(|a| a.eq_ignore_ascii_case(name)) {
                continue;
            }
        }
        if !kept.is_empty() {
            kept.push_str(", ");
        }
        kept.push_str(t);
    }
    HeaderValue::from_str(&kept).ok().filter(|v| !v.is_empty())
}

/// Whether a `101`'s `Upgrade` names only protocols the request offered (`offered`, as
/// [`upgrade_of`] made it). A server that switches to anything else is not followed.
pub fn switched_as_offered(answer: Option<&HeaderValue>, offered: &HeaderValue) -> bool {
    let Some(answer) = answer.and_then(|v| v.to_str().ok()) else {
        return true; // no `Upgrade` on the 101: the one offered
    };
    let offered = offered.to_str().unwrap_or_default();
    answer.split(',').map(str::trim).all(|t| {
        offered
            .split(',')
            .map(str::trim)
            .any(|o| o.eq_ignore_ascii_case(t))
    })
}

/// [`strip_hop_by_hop`] for the two messages of an upgrade (the request and its 101): the
/// other hop-by-hop headers go, `Upgrade: <to>` and `Connection: upgrade` stay, as the next hop
/// needs them to switch too.
pub fn strip_hop_by_hop_upgrading(h: &mut HeaderMap, to: HeaderValue) {
    strip_hop_by_hop(h);
    if !to.is_empty() {
        h.insert(http::header::UPGRADE, to);
    }
    h.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("upgrade"),
    );
}

/// Drops request headers whose names contain `_` (Envoy's `headers_with_underscores_action:
/// DROP_HEADER`): a name like `x_forwarded_client_cert` may be read as its dashed twin by an
/// app's framework (CGI-style mapping), so it never reaches one. Returns how many were dropped.
pub fn drop_underscored(h: &mut HeaderMap) -> usize {
    let names: Vec<HeaderName> = h
        .keys()
        .filter(|n| n.as_str().contains('_'))
        .cloned()
        .collect();
    let mut dropped = 0;
    for n in names {
        if let http::header::Entry::Occupied(e) = h.entry(n) {
            dropped += e.remove_entry_mult().1.count();
        }
    }
    dropped
}

/// [`drop_underscored`], counted in `aether_request_headers_dropped_total{direction}`.
pub fn drop_underscored_counted(h: &mut HeaderMap, direction: crate::metrics::Direction) {
    let n = drop_underscored(h);
    if n > 0 {
        super::metrics::metrics()
            .headers_dropped
            .get_or_create(&crate::metrics::DirectionLabels { direction })
            .inc_by(n as u64);
    }
}

/// How many fields this proxy may add to a request it forwards: `x-request-id`, `traceparent`
/// and, inbound, XFCC.
pub const ADDED_REQUEST_FIELDS: usize = 3;

/// Makes room, in one step, for the fields this proxy adds to a request. hyper sizes the header
/// map of a connection's first request to exactly what arrived, and each field added past
/// that grew the map again (a new index table, every entry rehashed), twice for the first
/// request on each new client connection. A later request on an HTTP/1.1 connection reuses a
/// map that is already large enough, and then this checks one length.
pub fn make_room_for_added(h: &mut HeaderMap) {
    // Fails only past http's 32,768 fields; `too_large` has already counted them.
    let _ = h.try_reserve(ADDED_REQUEST_FIELDS);
}

/// Adds `x-request-id` (a version 4 UUID) when absent; returns the request's id.
///
/// The random bits come from the per-thread generator the trace ids use (`fastrand`), as
/// Envoy's ids come from a fast generator: the id names a request, it guards nothing, and
/// `uuid`'s own source (a ChaCha12 generator per thread) costs far more a request.
pub fn ensure_request_id(h: &mut HeaderMap) -> HeaderValue {
    if let Some(v) = h.get_mut(X_REQUEST_ID) {
        never_indexed(v);
        return v.clone();
    }
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let random = fastrand::u128(..).to_le_bytes();
    uuid::Builder::from_random_bytes(random)
        .into_uuid()
        .hyphenated()
        .encode_lower(&mut buf);
    // One allocation that holds the text and a count, so the clone kept for the access log
    // shares it (a copied value would be promoted to a second, shared allocation on clone).
    let shared = bytes::Bytes::from_owner(buf);
    let mut v = HeaderValue::from_maybe_shared(shared).expect("a UUID is a valid header value");
    never_indexed(&mut v);
    h.insert(X_REQUEST_ID, v.clone());
    v
}

/// Keeps a value that is new on every request (`x-request-id`, `traceparent`) out of HPACK's
/// dynamic tables on each h2 hop. Indexed, each one took a table slot that no later request
/// could use and pushed out the headers that repeat (authority, user agent, XFCC), which then
/// went out again as Huffman-coded literals. Only HPACK reads the flag; HTTP/1.1 writes the
/// value as before.
pub fn never_indexed(v: &mut HeaderValue) {
    v.set_sensitive(true);
}

/// `By=<own id>;Hash=<hex sha256 of the peer leaf>;URI=<peer id>`, each value quoted when it
/// holds a character XFCC uses as syntax (`;`, `,`, `=`, `"`), as Envoy does. Strict SPIFFE ids
/// never need it; the quoting keeps the header unambiguous whatever reaches it.
pub fn xfcc_value(own_id: &str, peer_hash: &str, peer_id: &str) -> HeaderValue {
    let v = format!(
        "By={};Hash={};URI={}",
        xfcc_quote(own_id),
        xfcc_quote(peer_hash),
        xfcc_quote(peer_id)
    );
    HeaderValue::from_str(&v).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// One XFCC value, quoted (with `"` and `\` escaped) when it holds `;`, `,`, `=` or `"`.
pub fn xfcc_quote(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains([';', ',', '=', '"']) {
        return v.into();
    }
    let mut q = String::with_capacity(v.len() + 2);
    q.push('"');
    for c in v.chars() {
        if c == '"' || c == '\\' {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('"');
    q.into()
}

/// Points a request at its next hop. For HTTP/2 the URI becomes absolute with `authority`
/// (sent as `:authority`) and `Host` goes; for HTTP/1.1 the URI becomes origin-form and `Host`
/// is `authority` (a URI authority wins over a Host header, RFC 9112 3.2.2).
///
/// Most requests already have the form they leave in (an h2 request keeps its `:authority`, an
/// h1 request its origin-form target and `Host`); those keep their URI and header, since a new
/// URI parses and copies its parts (two allocations) and a new `Host` value copies too.
pub fn retarget<B>(
    req: &mut http::Request<B>,
    to_h2: bool,
    authority: &str,
) -> Result<(), super::answer::Reason> {
    use super::answer::Reason;
    let uri = req.uri();
    let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    if to_h2 {
        // `Authority == str` ignores case; the request leaves with `authority` byte for byte.
        let ready =
            uri.scheme().is_some() && uri.authority().is_some_and(|a| a.as_str() == authority);
        if !ready {
            let scheme = uri.scheme_str().unwrap_or("http");
            let uri = http::Uri::builder()
                .scheme(scheme)
                .authority(authority)
                .path_and_query(pq)
                .build()
                .map_err(|_| Reason::BadAuthority)?;
            *req.uri_mut() = uri;
        }
        req.headers_mut().remove(http::header::HOST);
        *req.version_mut() = http::Version::HTTP_2;
    } else {
        if uri.scheme().is_some() || uri.authority().is_some() {
            let uri = http::Uri::try_from(pq).map_err(|_| Reason::BadAuthority)?;
            *req.uri_mut() = uri;
        }
        let mut hosts = req.headers().get_all(http::header::HOST).iter();
        let host_is_authority = hosts
            .next()
            .is_some_and(|h| h.as_bytes() == authority.as_bytes())
            && hosts.next().is_none();
        if !host_is_authority {
            let host = HeaderValue::from_str(authority).map_err(|_| Reason::BadAuthority)?;
            req.headers_mut().insert(http::header::HOST, host);
        }
        *req.version_mut() = http::Version::HTTP_11;
    }
    Ok(())
}

/// A request body goes on whatever the method (SPEC 11). hyper's HTTP/1 client sends a GET or
/// HEAD whose body length is unknown (chunked, or from HTTP/2) without it, unless the request
/// says `Transfer-Encoding: chunked` itself; the hop-by-hop removal took the client's away.
pub fn keep_h1_body<B: hyper::body::Body>(req: &mut http::Request<B>) {
    let dropped_by_default = matches!(*req.method(), http::Method::GET | http::Method::HEAD);
    if dropped_by_default
        && !req.body().is_end_stream()
        && req.body().size_hint().exact().is_none()
        && !req.headers().contains_key(http::header::CONTENT_LENGTH)
    {
        req.headers_mut().insert(
            http::header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
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
    fn upgrade_headers_stay_only_for_upgrades() {
        let req = |version, conn: &'static str| {
            http::Request::builder()
                .version(version)
                .header("connection", conn)
                .header("upgrade", "websocket")
                .header("x-named", "1")
                .body(())
                .unwrap()
        };
        let r = req(http::Version::HTTP_11, "keep-alive, Upgrade, x-named");
        let to = upgrade_of(&r, None).expect("an upgrade request");
        assert_eq!(to, "websocket");
        let mut h = r.headers().clone();
        strip_hop_by_hop_upgrading(&mut h, to);
        assert_eq!(h.get("upgrade").unwrap(), "websocket");
        assert_eq!(h.get("connection").unwrap(), "upgrade");
        assert!(!h.contains_key("x-named"));
        // `Upgrade` without `Connection: upgrade`, or over HTTP/2, is no upgrade: it goes.
        for r in [
            req(http::Version::HTTP_11, "keep-alive"),
            req(http::Version::HTTP_2, "upgrade"),
        ] {
            assert!(upgrade_of(&r, None).is_none());
            let mut h = r.headers().clone();
            strip_hop_by_hop(&mut h);
            assert!(!h.contains_key("upgrade") && !h.contains_key("connection"));
        }
    }

    #[test]
    fn h2c_is_never_an_upgrade_and_ports_choose_their_tokens() {
        let req = |upgrade: &str| {
            http::Request::builder()
                .header("connection", "Upgrade, HTTP2-Settings")
                .header("upgrade", upgrade)
                .header("http2-settings", "AAMAAABkAARAAAAAAAIAAAAA")
                .body(())
                .unwrap()
        };
        let ws = ["websocket".to_string()];
        let listed = ["websocket".to_string(), "x-echo".to_string()];
        for (upgrade, allowed, want) in [
            ("h2c", None, None),
            ("H2C", Some(&ws[..]), None),
            ("h2c, websocket", Some(&ws[..]), Some("websocket")),
            ("websocket/13", Some(&ws[..]), Some("websocket/13")),
            ("x-echo", Some(&ws[..]), None),
            ("x-echo", Some(&listed[..]), Some("x-echo")),
            // The client side tunnels any opaque token; the server side decides.
            ("x-echo, h2c", None, Some("x-echo")),
        ] {
            let got = upgrade_of(&req(upgrade), allowed);
            assert_eq!(got.as_ref().map(|v| v.to_str().unwrap()), want, "{upgrade}");
        }
        let mut h = req("h2c").headers().clone();
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
        // HTTP2-Settings goes even when `Connection` does not name it.
        let mut h = HeaderMap::new();
        h.insert("http2-settings", HeaderValue::from_static("AAMAAABk"));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty());

        let offered = HeaderValue::from_static("websocket");
        let up = |v: &'static str| HeaderValue::from_static(v);
        assert!(switched_as_offered(None, &offered));
        assert!(switched_as_offered(Some(&up("WebSocket")), &offered));
        assert!(!switched_as_offered(Some(&up("h2c")), &offered));
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

    #[test]
    fn underscored_names_are_dropped() {
        let mut h = HeaderMap::new();
        h.append("x_forwarded_client_cert", HeaderValue::from_static("a"));
        h.append("x_forwarded_client_cert", HeaderValue::from_static("b"));
        h.append("x-dashed", HeaderValue::from_static("c"));
        assert_eq!(drop_underscored(&mut h), 2);
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn xfcc_values_are_quoted_when_they_hold_syntax() {
        assert_eq!(
            xfcc_value("spiffe://td/a", "00ff", "spiffe://td/b"),
            "By=spiffe://td/a;Hash=00ff;URI=spiffe://td/b"
        );
        assert_eq!(
            xfcc_value("spiffe://td/a", "00", "spiffe://td/b;URI=x,\"y\"="),
            "By=spiffe://td/a;Hash=00;URI=\"spiffe://td/b;URI=x,\\\"y\\\"=\""
        );
    }

    #[test]
    fn the_added_fields_fit_in_one_growth() {
        // As hyper parses a connection's first request: a map sized to the two fields it has.
        let mut h = HeaderMap::new();
        h.reserve(2);
        h.insert(http::header::HOST, HeaderValue::from_static("a.example"));
        h.insert(http::header::ACCEPT, HeaderValue::from_static("*/*"));
        make_room_for_added(&mut h);
        let room = h.capacity();
        // A map with the room already is left as it is.
        make_room_for_added(&mut h);
        assert_eq!(h.capacity(), room);
        ensure_request_id(&mut h);
        crate::trace::Tracer::new(1.0, None).start(&mut h, crate::trace::Side::Client);
        h.insert(XFCC, HeaderValue::from_static("By=x"));
        assert_eq!(h.len(), 2 + ADDED_REQUEST_FIELDS);
        assert_eq!(
            h.capacity(),
            room,
            "the map grew again after make_room_for_added"
        );
    }

    #[test]
    fn request_id_is_kept_when_present_and_made_when_absent() {
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID, HeaderValue::from_static("abc"));
        assert_eq!(ensure_request_id(&mut h), "abc");
        // Forwarded or made, the id is unique to the request: never indexed by HPACK.
        assert!(h.get(X_REQUEST_ID).unwrap().is_sensitive());
        let mut h = HeaderMap::new();
        let v = ensure_request_id(&mut h);
        let id = uuid::Uuid::parse_str(v.to_str().unwrap()).unwrap();
        assert_eq!(id.get_version(), Some(uuid::Version::Random));
        assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
        assert_eq!(v.len(), 36);
        assert_eq!(h.get(X_REQUEST_ID), Some(&v));
        assert!(h.get(X_REQUEST_ID).unwrap().is_sensitive());
        // A new id for every request.
        let ids: std::collections::HashSet<HeaderValue> = (0..1000)
            .map(|_| ensure_request_id(&mut HeaderMap::new()))
            .collect();
        assert_eq!(ids.len(), 1000);
    }

    #[test]
    fn retarget_gives_each_protocol_its_form() {
        fn req(uri: &str, hosts: &[&'static str]) -> http::Request<()> {
            let mut r = http::Request::builder().uri(uri).body(()).unwrap();
            for h in hosts {
                r.headers_mut()
                    .append(http::header::HOST, HeaderValue::from_static(h));
            }
            r
        }
        let to = "payments.aether.internal:9090";
        // To HTTP/2: absolute URI with the authority, no Host, whatever came in.
        for (uri, hosts) in [
            ("/a?b=1", &["payments.aether.internal:9090"][..]),
            ("/a?b=1", &["other"][..]),
            ("http://payments.aether.internal:9090/a?b=1", &[][..]),
            (
                "https://payments.aether.internal:9090/a?b=1",
                &["x", "y"][..],
            ),
            ("http://other:9090/a?b=1", &[][..]),
            ("http://Payments.Aether.Internal:9090/a?b=1", &[][..]),
        ] {
            let mut r = req(uri, hosts);
            retarget(&mut r, true, to).unwrap();
            assert_eq!(r.uri().authority().unwrap().as_str(), to, "{uri}");
            assert_eq!(r.uri().path_and_query().unwrap().as_str(), "/a?b=1");
            let scheme = if uri.starts_with("https") {
                "https"
            } else {
                "http"
            };
            assert_eq!(r.uri().scheme_str(), Some(scheme), "{uri}");
            assert!(!r.headers().contains_key(http::header::HOST), "{uri}");
            assert_eq!(r.version(), http::Version::HTTP_2);
        }
        // To HTTP/1.1: origin-form, exactly one Host, the authority.
        for (uri, hosts) in [
            ("/a?b=1", &["payments.aether.internal:9090"][..]),
            ("/a?b=1", &["other"][..]),
            ("/a?b=1", &[][..]),
            ("/a?b=1", &["payments.aether.internal:9090", "other"][..]),
            ("http://payments.aether.internal:9090/a?b=1", &["other"][..]),
            ("/a?b=1", &["Payments.Aether.Internal:9090"][..]),
        ] {
            let mut r = req(uri, hosts);
            retarget(&mut r, false, to).unwrap();
            assert_eq!(r.uri().to_string(), "/a?b=1", "{uri}");
            let h: Vec<_> = r.headers().get_all(http::header::HOST).iter().collect();
            assert_eq!(h, [to], "{uri} {hosts:?}");
            assert_eq!(r.version(), http::Version::HTTP_11);
        }
        // An authority that cannot be one is an error, not a panic.
        let mut r = req("/a", &[]);
        assert!(retarget(&mut r, true, "bad host").is_err());
        let mut r = req("/a", &[]);
        assert!(retarget(&mut r, false, "bad\nhost").is_err());
    }

    #[test]
    fn header_limits() {
        let mut h = HeaderMap::new();
        for i in 0..MAX_HEADERS {
            h.insert(
                HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("v"),
            );
        }
        assert!(!too_large(&h));
        h.insert("x-one-more", HeaderValue::from_static("v"));
        assert!(too_large(&h));
        let mut h = HeaderMap::new();
        h.insert(
            "x-big",
            HeaderValue::from_str(&"a".repeat(MAX_HEADER_BYTES)).unwrap(),
        );
        assert!(too_large(&h));
    }
}
