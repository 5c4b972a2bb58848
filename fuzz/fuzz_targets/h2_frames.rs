//! The codec sniff and the HTTP/2 frame tracker, on any bytes a client sends: a connection is
//! HTTP/2 exactly when its first 24 bytes are the preface (never on ALPN's HTTP/1.1, never for
//! an HTTP/1 request), and after the preface a header block is open from its HEADERS (or
//! PUSH_PROMISE) frame's header until the end of the frame with END_HEADERS, timed from the
//! read that brought that frame header. The state is the same after every byte whether the
//! bytes come at once, a byte at a time or split where the fuzzer says.
//!
//! The first byte picks the input: bits 0-1 raw bytes through the sniff, raw frames, frames
//! built from the fuzzer's choices (a well-formed sequence of header blocks and other frames),
//! or an HTTP/1 request; bits 2-3 what ALPN said; bit 4 puts the preface before built frames.
#![no_main]

use std::time::{Duration, Instant};

use aether_proxy::fuzzing::{H2Frames, Sniffed};
use aether_proxy::http::server::Wire;
use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;

/// RFC 9113 section 3.4.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (points, body) = split_points(rest);
    let wire_said = match mode >> 2 & 3 {
        1 => Wire::H2,
        2 => Wire::H1,
        _ => Wire::Sniff,
    };
    let (how, wire) = match mode & 3 {
        0 => (How::Sniff(wire_said), body.to_vec()),
        1 => (How::Frames, body.to_vec()),
        2 => {
            let preface = mode & 0x10 != 0;
            let mut wire = if preface {
                PREFACE.to_vec()
            } else {
                Vec::new()
            };
            let built = build_frames(body, &mut wire);
            let how = if preface {
                How::Sniff(wire_said)
            } else {
                How::Frames
            };
            if let Some(from) = how.h2_from(&wire) {
                assert_eq!(
                    blocks(&wire, from),
                    built,
                    "the reference reads the blocks built"
                );
            }
            (how, wire)
        }
        _ => {
            let methods: [&[u8]; 9] = [
                b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH", b"CONNECT",
                b"TRACE",
            ];
            let (&pick, rest) = body.split_first().unwrap_or((&0, &[]));
            let mut wire = methods[usize::from(pick) % methods.len()].to_vec();
            wire.push(b' ');
            wire.extend_from_slice(rest);
            (How::Sniff(wire_said), wire)
        }
    };
    let mut cuts: Vec<usize> = points.iter().map(|&p| p % (wire.len() + 1)).collect();
    cuts.sort_unstable();
    check(how, &wire, &cuts);
});

#[derive(Clone, Copy, Debug)]
enum How {
    /// Through the codec sniff, after what ALPN said.
    Sniff(Wire),
    /// Straight to the frame tracker, as bytes after the preface.
    Frames,
}

impl How {
    /// Where the frames begin, when the connection is HTTP/2.
    fn h2_from(self, wire: &[u8]) -> Option<usize> {
        match self {
            How::Frames => Some(0),
            How::Sniff(Wire::H1) => None,
            How::Sniff(_) => wire.starts_with(PREFACE).then_some(PREFACE.len()),
        }
    }
}

enum Reader {
    Sniff(Sniffed),
    Frames(H2Frames),
}

/// What the reader says after some bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State {
    /// This read completed the preface.
    completed: bool,
    h2: bool,
    block_since: Option<Instant>,
}

impl Reader {
    fn new(how: How) -> Reader {
        match how {
            How::Sniff(wire) => Reader::Sniff(Sniffed::new(wire)),
            How::Frames => Reader::Frames(H2Frames::default()),
        }
    }

    fn feed(&mut self, bytes: &[u8], now: Instant) -> State {
        match self {
            Reader::Sniff(s) => {
                let completed = s.arrived(bytes, now);
                State {
                    completed,
                    h2: s.is_h2(),
                    block_since: s.header_block_since(),
                }
            }
            Reader::Frames(f) => {
                f.feed(bytes, now);
                State {
                    completed: false,
                    h2: true,
                    block_since: f.block_since(),
                }
            }
        }
    }
}

/// Feeds `wire` at once, a byte at a time and in the chunks `cuts` make (chunk `i` read at
/// `base + i` seconds), and compares each with what the wire says.
fn check(how: How, wire: &[u8], cuts: &[usize]) {
    let h2_from = how.h2_from(wire);
    let open = h2_from.map_or_else(Vec::new, |from| blocks(wire, from));
    let base = Instant::now();
    let chunk_of = |b: usize| cuts.partition_point(|&c| c <= b);
    let time_of = |b: usize| base + Duration::from_secs(chunk_of(b) as u64);
    // The state after the first `p` bytes (reads ending at `p`), with byte `b` read at `at(b)`.
    let expected = |p: usize, completed: bool, at: &dyn Fn(usize) -> Instant| State {
        completed,
        h2: h2_from.is_some_and(|from| p >= from),
        block_since: open
            .iter()
            .find(|&&(from, to)| from <= p && p < to)
            .map(|&(from, _)| at(from - 1)),
    };
    let completes = |from: usize, to: usize| {
        matches!(how, How::Sniff(_)) && h2_from.is_some_and(|p| from < p && p <= to)
    };

    let mut whole = Reader::new(how);
    let got = whole.feed(wire, base);
    let want = expected(wire.len(), completes(0, wire.len()), &|_| base);
    assert_eq!(got, want, "{how:?}, all at once");

    let mut bytewise = Reader::new(how);
    for (b, byte) in wire.iter().enumerate() {
        let got = bytewise.feed(std::slice::from_ref(byte), time_of(b));
        let want = expected(b + 1, completes(b, b + 1), &time_of);
        assert_eq!(got, want, "{how:?}, byte {b} on its own");
    }

    let mut chunked = Reader::new(how);
    let mut from = 0;
    for (i, &end) in cuts.iter().chain(std::iter::once(&wire.len())).enumerate() {
        let now = base + Duration::from_secs(i as u64);
        let got = chunked.feed(&wire[from..end], now);
        let want = expected(end, completes(from, end), &time_of);
        assert_eq!(got, want, "{how:?}, chunk {from}..{end}");
        from = end;
    }
}

/// The header blocks of the frames from `from` on, simply read from the whole wire: each as
/// the position after its first frame's header and the end of its END_HEADERS frame (past
/// the wire when the block is still open where the wire ends).
fn blocks(wire: &[u8], from: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut open = None;
    let mut at = from;
    while let Some(h) = wire.get(at..at + 9) {
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (kind, flags) = (h[3], h[4]);
        let end = at + 9 + len;
        if matches!(kind, HEADERS | PUSH_PROMISE) && open.is_none() {
            open = Some(at + 9);
        }
        if matches!(kind, HEADERS | PUSH_PROMISE | CONTINUATION) && flags & END_HEADERS != 0 {
            if let Some(opened) = open.take() {
                out.push((opened, end));
            }
        }
        at = end;
    }
    if let Some(opened) = open {
        out.push((opened, usize::MAX));
    }
    out
}

/// Appends frames built from the fuzzer's choices to `wire`: other frames, and header blocks
/// of a HEADERS or PUSH_PROMISE frame then CONTINUATIONs, the last with END_HEADERS unless
/// the wire ends inside the block. Returns the blocks as `blocks` reads them.
fn build_frames(body: &[u8], wire: &mut Vec<u8>) -> Vec<(usize, usize)> {
    let mut u = Unstructured::new(body);
    let mut out = Vec::new();
    while !u.is_empty() && wire.len() < 1 << 13 {
        if u.arbitrary::<bool>().unwrap_or_default() {
            let opener = if u.arbitrary().unwrap_or_default() {
                HEADERS
            } else {
                PUSH_PROMISE
            };
            let continuations = u.int_in_range(0..=6).unwrap_or_default();
            let unfinished = u.ratio(1, 8).unwrap_or_default();
            let opened = wire.len() + 9;
            for i in 0..=continuations {
                let kind = if i == 0 { opener } else { CONTINUATION };
                let last = i == continuations && !unfinished;
                let flags = u.arbitrary::<u8>().unwrap_or_default() & !END_HEADERS;
                frame(
                    wire,
                    &mut u,
                    kind,
                    if last { flags | END_HEADERS } else { flags },
                );
            }
            if unfinished {
                out.push((opened, usize::MAX));
                break;
            }
            out.push((opened, wire.len()));
        } else {
            let mut kind = u.arbitrary::<u8>().unwrap_or_default();
            if matches!(kind, HEADERS | PUSH_PROMISE | CONTINUATION) {
                kind = 0; // DATA
            }
            let flags = u.arbitrary().unwrap_or_default();
            frame(wire, &mut u, kind, flags);
        }
    }
    out
}

/// A frame on stream 1 whose payload (mostly short, sometimes up to 4 KiB: longer ones only
/// cost time a byte at a time) is the fuzzer's bytes, zeros once they run out.
fn frame(wire: &mut Vec<u8>, u: &mut Unstructured, kind: u8, flags: u8) {
    let len = if u.ratio(1, 16).unwrap_or_default() {
        u.int_in_range(0..=1 << 12).unwrap_or_default()
    } else {
        u.int_in_range(0..=64).unwrap_or_default()
    };
    wire.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    wire.extend_from_slice(&[kind, flags, 0, 0, 0, 1]);
    let given = u.bytes(len.min(u.len())).unwrap_or_default();
    wire.extend_from_slice(given);
    wire.resize(wire.len() + len - given.len(), 0);
}

/// The first byte says how many split points follow (at most 15), each two bytes; the rest
/// is the input proper.
fn split_points(data: &[u8]) -> (Vec<usize>, &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return (Vec::new(), data);
    };
    let n = usize::from(n & 15).min(rest.len() / 2);
    let (points, body) = rest.split_at(2 * n);
    let points = points
        .chunks(2)
        .map(|p| usize::from(u16::from_be_bytes([p[0], p[1]])))
        .collect();
    (points, body)
}
