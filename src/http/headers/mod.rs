//! Header handling shared by both directions: hop-by-hop removal, request ids, XFCC, limits.
//!
//! The limits and the underscore rule are here; connection-specific fields in `hop_by_hop.rs`,
//! upgrades in `upgrade.rs`, the fields the proxy adds (`x-request-id`, XFCC) in `added.rs`, and
//! what a message needs to go to its next hop in `forwarding.rs`.

mod added;
mod forwarding;
mod hop_by_hop;
mod upgrade;

use http::header::{HeaderMap, HeaderName};

pub use added::{
    ensure_request_id, make_room_for_added, never_indexed, xfcc_value, XFCC, X_REQUEST_ID,
};
pub use forwarding::{forwarded_response, framing_error, keep_h1_body, retarget, unforwardable};
pub use hop_by_hop::{declare_grpc_trailers, h1_closes_after, h1_wants_trailers, strip_hop_by_hop};
pub use upgrade::{strip_hop_by_hop_upgrading, switched_as_offered, upgrade_of};

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

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::HeaderValue;

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
