//! The HTTP/1 head counter, on any bytes a client sends: it decides the same whether the bytes
//! come at once, a byte at a time or split where the fuzzer says, and on a head `httparse`
//! (hyper's parser) accepts it agrees with it on the fields and on where the head ends.
#![no_main]

use aether_proxy::fuzzing::Http1Head;
use libfuzzer_sys::fuzz_target;

/// SPEC section 8's limit, which the counter enforces.
const MAX_FIELDS: usize = 100;

fuzz_target!(|data: &[u8]| {
    let (cuts, wire) = split_points(data);

    // A byte at a time: the state after every prefix, which the other readings must match.
    let mut bytewise = Vec::with_capacity(wire.len() + 1);
    let mut lines = Http1Head::default();
    bytewise.push(Decision::of(&lines, false));
    for b in wire {
        let d = Decision::feed(&mut lines, std::slice::from_ref(b));
        bytewise.push(d);
        if d.refused {
            break;
        }
    }

    // Each prefix at once, and the whole wire in the fuzzer's chunks: the same decision at every
    // boundary as a byte at a time, refused in the chunk whose bytes refuse the head.
    let mut chunked = Http1Head::default();
    let mut from = 0;
    for &end in cuts.iter().chain(std::iter::once(&wire.len())) {
        let mut at_once = Http1Head::default();
        let whole = Decision::feed(&mut at_once, &wire[..end]);
        let got = Decision::feed(&mut chunked, &wire[from..end]);
        let first_refusal = bytewise[..=end.min(bytewise.len() - 1)]
            .iter()
            .position(|d| d.refused);
        match first_refusal {
            Some(at) => {
                let expected = bytewise[at];
                assert_eq!(whole, expected, "prefix of {end} bytes at once");
                assert_eq!(got, expected, "chunk {from}..{end}");
                break;
            }
            None => {
                assert_eq!(whole, bytewise[end], "prefix of {end} bytes at once");
                assert_eq!(got, bytewise[end], "chunk {from}..{end}");
            }
        }
        from = end;
    }

    agrees_with_httparse(wire, &bytewise);
});

/// What the counter has decided after some bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Decision {
    refused: bool,
    ambiguous: bool,
    fields: usize,
    ended: bool,
}

impl Decision {
    fn of(lines: &Http1Head, refused: bool) -> Decision {
        Decision {
            refused,
            ambiguous: lines.ambiguous(),
            fields: lines.fields(),
            ended: lines.ended(),
        }
    }

    fn feed(lines: &mut Http1Head, bytes: &[u8]) -> Decision {
        let refused = lines.feed(bytes);
        Decision::of(lines, refused)
    }
}

/// The first byte says how many split points follow (at most 15), each two bytes; the rest
/// is the wire. Split points are sorted offsets into the wire.
fn split_points(data: &[u8]) -> (Vec<usize>, &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return (Vec::new(), data);
    };
    let n = usize::from(n & 15).min(rest.len() / 2);
    let (points, wire) = rest.split_at(2 * n);
    let mut cuts: Vec<usize> = points
        .chunks(2)
        .map(|p| usize::from(u16::from_be_bytes([p[0], p[1]])) % (wire.len() + 1))
        .collect();
    cuts.sort_unstable();
    (cuts, wire)
}

/// Where hyper's parser reads a complete head, the counter's fields and end are its, and it
/// refuses exactly for a field past the limit or framing fields that contradict each other
/// (two `Content-Length`s, or one beside `Transfer-Encoding`), whichever comes first.
fn agrees_with_httparse(wire: &[u8], bytewise: &[Decision]) {
    let mut headers = vec![httparse::EMPTY_HEADER; wire.len() / 2 + 1];
    let mut req = httparse::Request::new(&mut headers);
    let parsed = req.parse(wire);
    let last = bytewise[bytewise.len() - 1];
    match parsed {
        Ok(httparse::Status::Complete(end)) => {
            let names: Vec<_> = req.headers.iter().map(|h| h.name).collect();
            let (mut lengths, mut coded) = (0, false);
            let mut contradiction = None;
            for (i, name) in names.iter().enumerate().take(MAX_FIELDS) {
                if name.eq_ignore_ascii_case("content-length") {
                    lengths += 1;
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    coded = true;
                }
                if lengths > 1 || (coded && lengths > 0) {
                    contradiction = Some(i + 1);
                    break;
                }
            }
            let what = String::from_utf8_lossy(&wire[..end]);
            if let Some(field) = contradiction {
                assert!(
                    last.refused && last.ambiguous,
                    "framing not refused: {what:?}"
                );
                assert_eq!(last.fields, field, "refused at another field: {what:?}");
            } else if names.len() > MAX_FIELDS {
                assert!(last.refused && !last.ambiguous, "too many fields: {what:?}");
                assert_eq!(last.fields, MAX_FIELDS + 1, "{what:?}");
            } else {
                assert!(!last.refused, "a good head refused: {what:?}");
                assert_eq!(bytewise[end].fields, names.len(), "fields of {what:?}");
                assert!(bytewise[end].ended, "the head ends at {end}: {what:?}");
                assert!(!bytewise[end - 1].ended, "ended before {end}: {what:?}");
            }
        }
        // Valid so far, and no blank line yet.
        Ok(httparse::Status::Partial) => {
            assert!(!last.ended, "ended where hyper's parser needs more");
        }
        Err(_) => {}
    }
}
