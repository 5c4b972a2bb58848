//! Header handling shared by both directions: hop-by-hop removal, request ids, XFCC, limits.

use http::header::{HeaderMap, HeaderName, HeaderValue};

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

/// Removes connection-specific headers, which must not cross a proxy (RFC 9110 7.6.1) and
/// are illegal in HTTP/2.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Headers named by `Connection` are hop-by-hop too.
    let named: Vec<HeaderName> = h
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        http::header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        http::header::TRANSFER_ENCODING,
        http::header::UPGRADE,
        http::header::PROXY_AUTHORIZATION,
    ] {
        h.remove(n);
    }
    // `TE: trailers` is the one TE value HTTP/2 allows, and gRPC needs it.
    if let Some(te) = h.get(http::header::TE) {
        if te.as_bytes().eq_ignore_ascii_case(b"trailers") {
            return;
        }
        h.remove(http::header::TE);
    }
}

/// Adds `x-request-id` (a UUID) when absent; returns the request's id.
pub fn ensure_request_id(h: &mut HeaderMap) -> HeaderValue {
    if let Some(v) = h.get(X_REQUEST_ID) {
        return v.clone();
    }
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let id = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut buf);
    let v = HeaderValue::from_str(id).expect("a UUID is a valid header value");
    h.insert(X_REQUEST_ID, v.clone());
    v
}

/// `By=<own id>;Hash=<hex sha256 of the peer leaf>;URI=<peer id>`.
pub fn xfcc_value(own_id: &str, peer_hash: &str, peer_id: &str) -> HeaderValue {
    HeaderValue::from_str(&format!("By={own_id};Hash={peer_hash};URI={peer_id}"))
        .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Points a request at its next hop. For HTTP/2 the URI becomes absolute with `authority`
/// (sent as `:authority`) and `Host` goes; for HTTP/1.1 the URI becomes origin-form and `Host`
/// is `authority` (a URI authority wins over a Host header, RFC 9112 3.2.2).
pub fn retarget<B>(
    req: &mut http::Request<B>,
    to_h2: bool,
    authority: &str,
) -> Result<(), super::answer::Reason> {
    use super::answer::Reason;
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    if to_h2 {
        let scheme = req.uri().scheme_str().unwrap_or("http");
        let uri = http::Uri::builder()
            .scheme(scheme)
            .authority(authority)
            .path_and_query(pq)
            .build()
            .map_err(|_| Reason::BadAuthority)?;
        *req.uri_mut() = uri;
        req.headers_mut().remove(http::header::HOST);
        *req.version_mut() = http::Version::HTTP_2;
    } else {
        let uri = http::Uri::try_from(pq).map_err(|_| Reason::BadAuthority)?;
        let host = HeaderValue::from_str(authority).map_err(|_| Reason::BadAuthority)?;
        *req.uri_mut() = uri;
        req.headers_mut().insert(http::header::HOST, host);
        *req.version_mut() = http::Version::HTTP_11;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn request_id_is_kept_when_present_and_made_when_absent() {
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID, HeaderValue::from_static("abc"));
        assert_eq!(ensure_request_id(&mut h), "abc");
        let mut h = HeaderMap::new();
        let v = ensure_request_id(&mut h);
        assert!(uuid::Uuid::parse_str(v.to_str().unwrap()).is_ok());
        assert_eq!(h.get(X_REQUEST_ID), Some(&v));
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
