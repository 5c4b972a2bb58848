//! A message made ready for its next hop: request framing refused or kept, a response's
//! version and what cannot be passed on, and the request's target in each protocol's form.

use http::header::HeaderValue;

use super::hop_by_hop::strip_hop_by_hop;
use crate::http::answer::Reason;

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

/// Points a request at its next hop. For HTTP/2 the URI becomes absolute with `authority`
/// (sent as `:authority`) and `Host` goes; for HTTP/1.1 the URI becomes origin-form and `Host`
/// is `authority` (a URI authority wins over a Host header, RFC 9112 3.2.2).
///
/// Most requests already have the form they leave in (an h2 request keeps its `:authority`, an
/// h1 request its origin-form target and `Host`); those keep their URI and header, since a new
/// URI parses and copies its parts (two allocations) and a new `Host` value copies too.
pub fn retarget<B>(req: &mut http::Request<B>, to_h2: bool, authority: &str) -> Result<(), Reason> {
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
}
