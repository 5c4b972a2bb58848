//! A request's access-log line written by hand: the same JSON `serde_json` makes of `Entry`,
//! without serde's per-byte string escaping on the per-request path. A test holds the two to
//! the same bytes.

use serde::Serialize;

use super::entry::Entry;

impl Entry<'_> {
    /// The line, as `serde_json` would write it (public for the criterion bench).
    pub fn write_json(&self, out: &mut Vec<u8>) {
        let mut time = [0u8; 30];
        let n = self.time.write(&mut time);
        out.extend_from_slice(b"{\"time\":");
        json_plain(out, &time[..n]);
        out.extend_from_slice(b",\"direction\":");
        json_plain(out, self.direction.as_bytes());
        out.extend_from_slice(b",\"method\":");
        // A method is a token (hyper refuses anything else): nothing in it needs escaping.
        json_plain(out, self.method.as_bytes());
        out.extend_from_slice(b",\"authority\":");
        json_str(out, self.authority);
        out.extend_from_slice(b",\"path\":");
        json_str(out, self.path);
        out.extend_from_slice(b",\"status\":");
        json_num(out, self.status);
        out.extend_from_slice(b",\"error\":");
        json_opt_str(out, self.error);
        out.extend_from_slice(b",\"upstream\":");
        match self.upstream {
            Some(a) => {
                out.push(b'"');
                push_addr(out, a);
                out.push(b'"');
            }
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"duration_ms\":");
        json_num(out, self.duration_ms);
        out.extend_from_slice(b",\"bytes_received\":");
        json_num(out, self.bytes_received);
        out.extend_from_slice(b",\"bytes_sent\":");
        json_num(out, self.bytes_sent);
        out.extend_from_slice(b",\"peer_identity\":");
        json_opt_str(out, self.peer_identity);
        out.extend_from_slice(b",\"request_id\":");
        json_opt_str(out, self.request_id);
        // Both are hex this proxy wrote.
        out.extend_from_slice(b",\"trace_id\":");
        json_opt_plain(out, self.trace_id);
        out.extend_from_slice(b",\"span_id\":");
        json_opt_plain(out, self.span_id);
        out.push(b'}');
    }
}

/// `a` as `Display` writes it. IPv4 is written octet by octet through itoa: the formatting
/// machinery cost more here than the rest of the line.
fn push_addr(out: &mut Vec<u8>, a: std::net::SocketAddr) {
    match a {
        std::net::SocketAddr::V4(v4) => {
            for (i, octet) in v4.ip().octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                json_num(out, octet);
            }
            out.push(b':');
            json_num(out, v4.port());
        }
        std::net::SocketAddr::V6(_) => {
            use std::io::Write as _;
            let _ = write!(out, "{a}");
        }
    }
}

/// Numbers go through serde_json (itoa and ryu), so they print exactly as it prints them.
fn json_num(out: &mut Vec<u8>, v: impl Serialize) {
    let _ = serde_json::to_writer(out, &v);
}

/// A JSON string. Most values (names, ids, paths) need no escaping: one branch-free pass over
/// the bytes says so and they are copied; anything else goes through serde_json's escaping.
fn json_str(out: &mut Vec<u8>, s: &str) {
    let needs_escape = s.bytes().fold(false, |acc, b| {
        acc | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if needs_escape {
        let _ = serde_json::to_writer(&mut *out, s);
    } else {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    }
}

/// A JSON string of bytes known to need no escaping (our own timestamps, hex, tokens).
fn json_plain(out: &mut Vec<u8>, s: &[u8]) {
    debug_assert!(!s.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\'));
    out.reserve(s.len() + 2);
    out.push(b'"');
    out.extend_from_slice(s);
    out.push(b'"');
}

fn json_opt_plain(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => json_plain(out, s.as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
}

fn json_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => json_str(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::time::Rfc3339;
    use super::*;

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        for a in [
            "0.0.0.0:0",
            "255.255.255.255:65535",
            "10.0.100.9:80",
            "127.0.0.1:15008",
            "[::1]:8080",
            "[2001:db8::1]:443",
        ] {
            let a: std::net::SocketAddr = a.parse().unwrap();
            let mut out = Vec::new();
            push_addr(&mut out, a);
            assert_eq!(String::from_utf8(out).unwrap(), a.to_string());
        }
    }

    #[test]
    fn the_hand_written_line_is_the_serde_line() {
        let addr = "127.0.0.2:15008".parse().unwrap();
        for (path, authority, id, err, upstream) in [
            (
                "/",
                "payments.aether.internal",
                Some("spiffe://td/ns/a/sa/b"),
                None,
                Some(addr),
            ),
            ("/q\"uote\\back", "h\u{1}ost", None, Some("no-route"), None),
            (
                "/ünï\ncode\t",
                "",
                Some(""),
                Some(""),
                Some("[::1]:80".parse().unwrap()),
            ),
        ] {
            let e = Entry {
                time: Rfc3339::now(),
                direction: "outbound",
                method: "GET",
                authority,
                path,
                status: 503,
                error: err,
                upstream,
                duration_ms: 15.985048000000003,
                bytes_received: 0,
                bytes_sent: u64::MAX,
                peer_identity: id,
                request_id: Some("9608f6c5-8b4b-4794-a97a-e008c54da785"),
                trace_id: id.map(|_| "4bf92f3577b34da6a3ce929d0e0e4736"),
                span_id: err.map(|_| "00f067aa0ba902b7"),
            };
            let mut mine = Vec::new();
            e.write_json(&mut mine);
            let serde = serde_json::to_vec(&e).unwrap();
            assert_eq!(
                String::from_utf8(mine).unwrap(),
                String::from_utf8(serde).unwrap()
            );
        }
    }
}
