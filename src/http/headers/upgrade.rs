//! HTTP/1.1 upgrades through the proxy: which protocol a request may switch to, whether the
//! `101` switched to it, and the hop-by-hop removal that keeps the upgrade fields.

use http::header::{HeaderMap, HeaderValue};

use super::hop_by_hop::strip_hop_by_hop;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
