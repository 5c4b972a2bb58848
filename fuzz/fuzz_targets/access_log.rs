//! A request's access-log line, written by hand, is byte for byte what `serde_json` writes of
//! the same entry, for any strings (control characters, quotes, backslashes, any Unicode),
//! numbers (NaN and infinities too), addresses and times, each optional field present or not;
//! it parses as JSON back to the strings, and its time is the `time` crate's RFC 3339.
//!
//! Layout: a flags byte, fixed-width numbers, addresses and ids (zeros once the input runs
//! out), then the method, authority, path, error, peer identity and request id, separated by
//! 0xFF (never a byte of UTF-8, so the strings stay readable in the seeds).
#![no_main]

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_proxy::accesslog::{Entry, Rfc3339};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let mut r = Reader(data);
    let [flags] = r.take();
    let status = u16::from_be_bytes(r.take());
    let duration_ms = f64::from_bits(u64::from_be_bytes(r.take()));
    let bytes_received = u64::from_be_bytes(r.take());
    let bytes_sent = u64::from_be_bytes(r.take());
    let secs = u64::from_be_bytes(r.take());
    let nanos = u32::from_be_bytes(r.take()) % 1_000_000_000;
    let nanos_again = u32::from_be_bytes(r.take()) % 1_000_000_000;
    let [v6] = r.take();
    let ip: [u8; 16] = r.take();
    let port = u16::from_be_bytes(r.take());
    let flowinfo = u32::from_be_bytes(r.take());
    let scope_id = u32::from_be_bytes(r.take());
    let trace: [u8; 16] = r.take();
    let span: [u8; 8] = r.take();
    let mut strings = r.0.split(|&b| b == 0xff).map(String::from_utf8_lossy);
    let mut next = || strings.next().unwrap_or_default();
    let (method, authority, path) = (next(), next(), next());
    let (error, peer_identity, request_id) = (next(), next(), next());

    // The fields the encoder writes unescaped by contract: the method is a token (the `http`
    // crate refuses anything else), the ids are hex the proxy wrote.
    let method = http::Method::from_bytes(method.as_bytes()).unwrap_or(http::Method::GET);
    let (trace_hex, span_hex) = (hex(&trace), hex(&span));
    let upstream = if v6 & 1 == 0 {
        let [a, b, c, d, ..] = ip;
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(a, b, c, d), port))
    } else {
        let ip = Ipv6Addr::from(ip);
        SocketAddr::V6(SocketAddrV6::new(ip, port, flowinfo, scope_id))
    };
    let at = |nanos| {
        let d = Duration::new(secs, nanos);
        let t = if flags & 0x80 == 0 {
            UNIX_EPOCH.checked_add(d)
        } else {
            UNIX_EPOCH.checked_sub(d)
        };
        t.unwrap_or(UNIX_EPOCH)
    };

    // Twice: the second line in the same second, which the timestamp's per-thread cache serves.
    for t in [at(nanos), at(nanos_again)] {
        let entry = Entry {
            time: Rfc3339(t),
            direction: if flags & 1 == 0 {
                "outbound"
            } else {
                "inbound"
            },
            method: method.as_str(),
            authority: &authority,
            path: &path,
            status,
            error: given(flags, 0x02, &error),
            upstream: (flags & 0x04 != 0).then_some(upstream),
            duration_ms,
            bytes_received,
            bytes_sent,
            peer_identity: given(flags, 0x08, &peer_identity),
            request_id: given(flags, 0x10, &request_id),
            trace_id: given(flags, 0x20, &trace_hex),
            span_id: given(flags, 0x40, &span_hex),
        };
        let mut line = Vec::new();
        entry.write_json(&mut line);
        let serde = serde_json::to_vec(&entry).expect("serde writes an entry");
        assert_eq!(
            String::from_utf8_lossy(&line),
            String::from_utf8_lossy(&serde),
            "the hand-written line is not serde's"
        );
        check_parsed(&entry, &line, t);
    }
});

/// The line parses as JSON, to the entry's strings, numbers and nulls.
fn check_parsed(e: &Entry, line: &[u8], t: SystemTime) {
    let v: Value = serde_json::from_slice(line).expect("the line parses as JSON");
    let str_or_null = |s: Option<&str>| s.map_or(Value::Null, |s| Value::from(s));
    let expect = [
        ("time", Value::from(rfc3339(t))),
        ("direction", Value::from(e.direction)),
        ("method", Value::from(e.method)),
        ("authority", Value::from(e.authority)),
        ("path", Value::from(e.path)),
        ("status", Value::from(e.status)),
        ("error", str_or_null(e.error)),
        (
            "upstream",
            e.upstream
                .map_or(Value::Null, |a| Value::from(a.to_string())),
        ),
        ("bytes_received", Value::from(e.bytes_received)),
        ("bytes_sent", Value::from(e.bytes_sent)),
        ("peer_identity", str_or_null(e.peer_identity)),
        ("request_id", str_or_null(e.request_id)),
        ("trace_id", str_or_null(e.trace_id)),
        ("span_id", str_or_null(e.span_id)),
    ];
    for (key, want) in expect {
        assert_eq!(v[key], want, "{key}");
    }
    // Not compared for equality: serde_json's default float parsing may be one ulp off.
    let duration = &v["duration_ms"];
    if e.duration_ms.is_finite() {
        assert!(duration.is_number(), "duration {duration}");
    } else {
        assert!(
            duration.is_null(),
            "a non-finite duration is null: {duration}"
        );
    }
}

/// RFC 3339 as the `time` crate writes it, nothing when it cannot.
fn rfc3339(t: SystemTime) -> String {
    let nanos = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    };
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

/// `s` when the flag `bit` says the field is present.
fn given(flags: u8, bit: u8, s: &str) -> Option<&str> {
    (flags & bit != 0).then_some(s)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Fixed-width fields off the front of the input, zeros once it runs out.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        let k = N.min(self.0.len());
        out[..k].copy_from_slice(&self.0[..k]);
        self.0 = &self.0[k..];
        out
    }
}
