//! The fields this proxy adds to a request: room made for them, `x-request-id`, XFCC, and
//! values kept out of HPACK's dynamic tables.

use http::header::{HeaderMap, HeaderName, HeaderValue};

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const XFCC: HeaderName = HeaderName::from_static("x-forwarded-client-cert");

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
