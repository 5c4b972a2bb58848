//! The W3C Trace Context `traceparent` header: `VV-<32 hex trace id>-<16 hex parent id>-FF`.
//!
//! Parsing and writing work on fixed-size arrays, so neither allocates; the only allocation a
//! request pays is the header value a proxy must write.

use http::{HeaderName, HeaderValue};

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The length of a version-00 `traceparent`.
pub const LEN: usize = 55;

/// The `sampled` bit of the trace flags.
pub const SAMPLED: u8 = 0x01;

/// The flag bits this proxy passes on when it writes a `traceparent` of its own: `sampled`
/// and (Trace Context level 2) `random`; version 00 has no others, so the rest are cleared.
const KNOWN_FLAGS: u8 = 0x03;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
}

impl TraceParent {
    /// Parses one `traceparent` value; `None` when it breaks the rules (the header then
    /// counts as absent). A version above 00 is read for its first four fields, as the W3C
    /// rules ask, provided what follows them starts with `-`.
    pub fn parse(v: &[u8]) -> Option<TraceParent> {
        if v.len() < LEN {
            return None;
        }
        let version = hex_byte(v[0], v[1])?;
        match version {
            0xff => return None,
            0x00 if v.len() != LEN => return None,
            _ if v.len() > LEN && v[LEN] != b'-' => return None,
            _ => {}
        }
        if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return None;
        }
        let mut trace_id = [0u8; 16];
        for (i, b) in trace_id.iter_mut().enumerate() {
            *b = hex_byte(v[3 + 2 * i], v[4 + 2 * i])?;
        }
        let mut parent_id = [0u8; 8];
        for (i, b) in parent_id.iter_mut().enumerate() {
            *b = hex_byte(v[36 + 2 * i], v[37 + 2 * i])?;
        }
        let flags = hex_byte(v[53], v[54])?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The one `traceparent` of a request; several values (or none) make it absent. (The
    /// proxy reads it through `from_values` on the entry it also marks; tests read it here.)
    #[cfg(test)]
    pub fn from_headers(h: &http::HeaderMap) -> Option<TraceParent> {
        Self::from_values(h.get_all(TRACEPARENT).iter())
    }

    /// The one value of `all` as a `traceparent`; several (or none) make it absent.
    pub fn from_values<'a>(mut all: impl Iterator<Item = &'a HeaderValue>) -> Option<TraceParent> {
        match (all.next(), all.next()) {
            (Some(v), None) => TraceParent::parse(v.as_bytes()),
            _ => None,
        }
    }

    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The same trace continued by `span_id`, as this proxy forwards it.
    pub fn child(&self, span_id: [u8; 8]) -> TraceParent {
        TraceParent {
            trace_id: self.trace_id,
            parent_id: span_id,
            flags: self.flags & KNOWN_FLAGS,
        }
    }

    /// The version-00 text.
    pub fn encode(&self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        out[..3].copy_from_slice(b"00-");
        hex_into(&self.trace_id, &mut out[3..35]);
        out[35] = b'-';
        hex_into(&self.parent_id, &mut out[36..52]);
        out[52] = b'-';
        hex_into(&[self.flags], &mut out[53..55]);
        out
    }

    pub fn to_header(self) -> HeaderValue {
        let mut v = HeaderValue::from_bytes(&self.encode())
            .expect("hex and dashes are a valid header value");
        crate::http::headers::never_indexed(&mut v);
        v
    }
}

/// A fresh trace id: random, never all zeros.
pub fn new_trace_id() -> [u8; 16] {
    loop {
        let id = fastrand::u128(..).to_be_bytes();
        if id != [0; 16] {
            return id;
        }
    }
}

/// A fresh span id: random, never all zeros.
pub fn new_span_id() -> [u8; 8] {
    loop {
        let id = fastrand::u64(..).to_be_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

/// Lower-case hex of `bytes` into `out` (twice as long).
pub fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = DIGITS[usize::from(b >> 4)];
        out[2 * i + 1] = DIGITS[usize::from(b & 0x0f)];
    }
}

/// Two lower-case hex digits; upper case is not allowed in `traceparent`.
fn hex_byte(hi: u8, lo: u8) -> Option<u8> {
    Some(hex_digit(hi)? << 4 | hex_digit(lo)?)
}

fn hex_digit(c: u8) -> Option<u8> {
    // A table lookup: fifty digits a request go through here on each side.
    const VALUES: [u8; 256] = {
        let mut t = [0xff; 256];
        let mut i = 0;
        while i < 16 {
            t[b"0123456789abcdef"[i] as usize] = i as u8;
            i += 1;
        }
        t
    };
    let v = VALUES[usize::from(c)];
    (v != 0xff).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_header_round_trips() {
        let tp = TraceParent::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(tp.trace_id[0], 0x4b);
        assert_eq!(tp.parent_id[7], 0xb7);
        assert!(tp.sampled());
        assert_eq!(&tp.encode()[..], GOOD.as_bytes());
        let unsampled = GOOD.replace("-01", "-00");
        assert!(!TraceParent::parse(unsampled.as_bytes()).unwrap().sampled());
    }

    #[test]
    fn invalid_headers_are_refused() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ];
        for b in bad {
            assert_eq!(TraceParent::parse(b.as_bytes()), None, "{b:?}");
        }
    }

    #[test]
    fn a_higher_version_is_read_for_its_first_fields() {
        let v = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        let tp = TraceParent::parse(v.as_bytes()).unwrap();
        assert_eq!(&tp.encode()[3..], &GOOD.as_bytes()[3..]);
        assert!(TraceParent::parse(&v.as_bytes()[..LEN]).is_some());
    }

    #[test]
    fn a_child_keeps_the_trace_and_known_flags() {
        let tp = TraceParent::parse(
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff".as_slice(),
        )
        .unwrap();
        let c = tp.child([1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            std::str::from_utf8(&c.encode()).unwrap(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0102030405060708-03"
        );
    }

    #[test]
    fn several_headers_count_as_none() {
        let mut h = HeaderMap::new();
        h.append(TRACEPARENT, HeaderValue::from_static(GOOD));
        assert!(TraceParent::from_headers(&h).is_some());
        h.append(TRACEPARENT, HeaderValue::from_static(GOOD));
        assert!(TraceParent::from_headers(&h).is_none());
    }

    #[test]
    fn fresh_ids_are_not_zero() {
        for _ in 0..1000 {
            assert_ne!(new_trace_id(), [0; 16]);
            assert_ne!(new_span_id(), [0; 8]);
        }
    }
}
