//! An HTTP/1 request head's field lines, counted as they arrive (SPEC section 8: at most 100),
//! and its framing fields checked for contradictions (SPEC section 11), on the bytes before
//! hyper parses them: hyper would answer the field too many without `x-aether-error`, and
//! quietly drops the contradicting `Content-Length`.

use crate::http::headers::MAX_HEADERS;

/// Counts an HTTP/1 request head's field lines as they arrive, up to the blank line that ends
/// it. A field counts from its first byte, as hyper's parser counts it, so the field too many
/// is seen here before hyper could parse it. It also notes the framing fields: hyper quietly
/// drops a `Content-Length` beside `Transfer-Encoding`, and a second equal one, so only the
/// bytes show a head whose framing is ambiguous (SPEC 11: 400 and close, as Envoy answers).
#[derive(Default)]
pub(crate) struct HeadLines {
    at: LineAt,
    fields: usize,
    /// The field being read, lowercased up to its colon, while it may still be a framing one.
    name: [u8; FRAMING_NAME_MAX],
    name_len: usize,
    naming: bool,
    lengths: u8,
    coded: bool,
    /// Refused for ambiguous framing (else, when `feed` refused, for too many fields).
    pub(crate) ambiguous: bool,
}

/// `transfer-encoding`, the longer of the two framing field names.
const FRAMING_NAME_MAX: usize = 17;

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum LineAt {
    /// Before the request line (empty lines there are skipped, as parsers do).
    #[default]
    Lead,
    /// Inside a line.
    Line,
    /// At the start of a line; `Cr` after its first byte was `\r`.
    Start,
    Cr,
    /// Past the blank line: the rest is body or the next request, counted when it begins.
    End,
}

impl HeadLines {
    /// True once the head has more fields than SPEC section 8 allows, or framing fields that
    /// contradict each other (`ambiguous`).
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> bool {
        // A field name split between two reads goes on here.
        if self.naming && self.name_more(bytes) {
            return true;
        }
        let mut i = 0;
        // Byte by byte only where a line begins; inside lines, from one `\n` to the next.
        loop {
            let Some(&b) = bytes.get(i) else {
                return false;
            };
            match self.at {
                LineAt::End => return false,
                LineAt::Lead => {
                    if b != b'\r' && b != b'\n' {
                        self.at = LineAt::Line;
                    }
                    i += 1;
                }
                LineAt::Start | LineAt::Cr => {
                    if b == b'\n' {
                        self.at = LineAt::End;
                        return false;
                    } else if b == b'\r' && self.at == LineAt::Start {
                        self.at = LineAt::Cr;
                        i += 1;
                    } else {
                        if self.field_begins(&bytes[i..]) {
                            return true;
                        }
                        self.at = LineAt::Line;
                        i += 1;
                    }
                }
                LineAt::Line => {
                    let rest = &bytes[i..];
                    let mut ends = memchr::memchr_iter(b'\n', rest);
                    let mut next = ends.next();
                    loop {
                        let Some(lf) = next else {
                            return false;
                        };
                        // The common line: a field starts right after its predecessor's end.
                        match rest.get(lf + 1) {
                            Some(&c) if c != b'\r' && c != b'\n' => {
                                if self.field_begins(&rest[lf + 1..]) {
                                    return true;
                                }
                                next = ends.next();
                            }
                            _ => {
                                self.at = LineAt::Start;
                                i += lf + 1;
                                break;
                            }
                        }
                    }
                }
            }
        }
    }

    /// The field lines counted so far, and whether the blank line that ends the head came.
    #[cfg(feature = "testing")] // for the fuzz targets' `Http1Head`
    pub(crate) fn progress(&self) -> (usize, bool) {
        (self.fields, self.at == LineAt::End)
    }

    /// A field line begins at `from[0]`; true when the head must be refused.
    fn field_begins(&mut self, from: &[u8]) -> bool {
        self.fields += 1;
        if self.fields > MAX_HEADERS {
            return true;
        }
        // Only `content-length` and `transfer-encoding` are looked at; other fields cost
        // this one comparison.
        self.naming = matches!(from[0], b'c' | b'C' | b't' | b'T');
        self.name_len = 0;
        self.naming && self.name_more(from)
    }

    /// Reads more of the current field's name from `bytes`, which continue it; true when its
    /// framing now contradicts an earlier field's.
    fn name_more(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            if b == b':' {
                self.naming = false;
                return self.framing_field();
            }
            if b == b'\n' || self.name_len == FRAMING_NAME_MAX {
                self.naming = false;
                return false;
            }
            self.name[self.name_len] = b.to_ascii_lowercase();
            self.name_len += 1;
        }
        false
    }

    fn framing_field(&mut self) -> bool {
        match &self.name[..self.name_len] {
            b"content-length" => self.lengths = self.lengths.saturating_add(1),
            b"transfer-encoding" => self.coded = true,
            _ => return false,
        }
        self.ambiguous = self.lengths > 1 || (self.coded && self.lengths > 0);
        self.ambiguous
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::http::server::guarded::tests::guarded_with;
    use crate::http::server::sniff::Wire;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A request head with `fields` fields, each line `x-hN: v`.
    pub(in crate::http::server) fn head_with(fields: usize) -> Vec<u8> {
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..fields {
            head.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        head
    }

    #[test]
    fn head_lines_count_fields_in_any_split_and_stop_at_the_blank_line() {
        let exact = head_with(100);
        for piece in [1, 2, 3, 7, 64, exact.len()] {
            let mut lines = HeadLines::default();
            for part in exact.chunks(piece) {
                assert!(!lines.feed(part), "100 fields, pieces of {piece}");
            }
            assert_eq!(lines.fields, 100, "pieces of {piece}");
            assert!(lines.at == LineAt::End, "pieces of {piece}");
            // What follows the blank line (a body of header-like lines) is not counted.
            assert!(!lines.feed(&b"a: b\r\n".repeat(200)));
        }
        // The field too many counts from its first byte, CRLF or bare LF line ends alike, and
        // empty lines before the request line are skipped.
        let mut over = head_with(100);
        over.truncate(over.len() - 2);
        let mut lines = HeadLines::default();
        assert!(!lines.feed(b"\r\n"));
        assert!(!lines.feed(&over));
        assert!(lines.feed(b"x"), "the 101st field");
        let mut lines = HeadLines::default();
        let bare = "GET / HTTP/1.1\n".to_string() + &"a: b\n".repeat(101);
        assert!(lines.feed(bare.as_bytes()));
        let mut lines = HeadLines::default();
        assert!(
            !lines.feed(("GET / HTTP/1.1\n".to_string() + &"a: b\n".repeat(100) + "\n").as_bytes())
        );
    }

    #[test]
    fn head_lines_find_ambiguous_framing_in_any_split() {
        let heads: [(&[u8], bool); 7] = [
            (
                b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
                true,
            ),
            (
                b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
                true,
            ),
            (
                b"POST / HTTP/1.1\r\nCONTENT-LENGTH: 5\r\nx: y\r\nContent-Length: 5\r\n\r\n",
                true,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Type: a\r\n\r\n",
                false,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTE: trailers\r\n\r\n",
                false,
            ),
            (
                b"POST / HTTP/1.1\r\nx-content-length: 5\r\ncontent-length: 5\r\n\r\n",
                false,
            ),
            (
                b"POST / HTTP/1.1\r\ncontent-length-x: 5\r\ncontent-length: 5\r\n\r\n",
                false,
            ),
        ];
        for (head, ambiguous) in heads {
            for piece in [1, 2, 3, 5, 16, head.len()] {
                let mut lines = HeadLines::default();
                let refused = head.chunks(piece).any(|part| lines.feed(part));
                let what = String::from_utf8_lossy(head);
                assert_eq!(refused, ambiguous, "{what} in pieces of {piece}");
                assert_eq!(lines.ambiguous, ambiguous, "{what} in pieces of {piece}");
            }
        }
    }

    #[tokio::test]
    async fn each_keep_alive_head_gets_its_own_field_count() {
        let (mut io, mut client, requests) = guarded_with(Wire::H1, 64 << 10);
        let mut buf = vec![0u8; 64 << 10];
        for _ in 0..3 {
            let head = head_with(100);
            client.write_all(&head).await.unwrap();
            let mut got = 0;
            while got < head.len() {
                got += io.read(&mut buf).await.unwrap();
            }
            // The codec parsed the head and the request was answered: the next head is new.
            drop(requests.start().answered());
        }
    }
}
