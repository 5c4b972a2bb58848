//! HTTP/2 frame boundaries on a downstream connection, followed only far enough to time its
//! header blocks (SPEC section 8): the h2 codec has no timer of its own for a block left open.

use tokio::time::Instant;

/// Follows HTTP/2 frame boundaries (after the preface) just far enough to know when a header
/// block (HEADERS or PUSH_PROMISE, then CONTINUATION up to END_HEADERS) is open.
#[derive(Default)]
pub(crate) struct Frames {
    head: [u8; 9],
    head_len: usize,
    payload_left: usize,
    /// The frame being read ends the open header block.
    ends_block: bool,
    /// When the open header block began.
    block_since: Option<Instant>,
}

impl Frames {
    const HEADERS: u8 = 0x1;
    const PUSH_PROMISE: u8 = 0x5;
    const CONTINUATION: u8 = 0x9;
    const END_HEADERS: u8 = 0x4;

    /// When the open header block began; `None` when no block is open.
    pub(crate) fn block_since(&self) -> Option<Instant> {
        self.block_since
    }

    pub(crate) fn feed(&mut self, mut bytes: &[u8], now: Instant) {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let k = self.payload_left.min(bytes.len());
                self.payload_left -= k;
                bytes = &bytes[k..];
                if self.payload_left == 0 {
                    self.frame_done();
                }
                continue;
            }
            let k = (9 - self.head_len).min(bytes.len());
            self.head[self.head_len..self.head_len + k].copy_from_slice(&bytes[..k]);
            self.head_len += k;
            bytes = &bytes[k..];
            if self.head_len < 9 {
                return;
            }
            self.head_len = 0;
            let h = self.head;
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            let (kind, flags) = (h[3], h[4]);
            if matches!(kind, Self::HEADERS | Self::PUSH_PROMISE) && self.block_since.is_none() {
                self.block_since = Some(now);
            }
            let in_block = matches!(
                kind,
                Self::HEADERS | Self::PUSH_PROMISE | Self::CONTINUATION
            );
            self.ends_block = in_block && flags & Self::END_HEADERS != 0;
            self.payload_left = len;
            if len == 0 {
                self.frame_done();
            }
        }
    }

    fn frame_done(&mut self) {
        if self.ends_block {
            self.block_since = None;
            self.ends_block = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use crate::http::server::guarded::tests::{guarded_with, time_to_error, IDLE};
    use crate::http::server::sniff::{Wire, PREFACE};
    use std::time::Duration;

    /// An HTTP/2 frame header.
    fn frame(len: usize, kind: u8, flags: u8, stream: u32) -> Vec<u8> {
        let mut f = (len as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f
    }

    #[tokio::test]
    async fn an_h2_header_block_must_complete_in_time() {
        let (mut io, mut client, _) = guarded_with(Wire::H2, 1024);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0, 0x4, 0, 0)); // SETTINGS
        bytes.extend(frame(3, 0x1, 0, 1)); // HEADERS without END_HEADERS
        bytes.extend([0x82, 0x86, 0x84]);
        bytes.extend(frame(1, 0x9, 0, 1)); // CONTINUATION without END_HEADERS
        bytes.push(0x41);
        client.write_all(&bytes).await.unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("header block"), "{e}");
        assert!(took < IDLE, "took {took:?}");
    }

    #[tokio::test]
    async fn a_complete_h2_header_block_stops_the_block_timer() {
        let (mut io, mut client, _) = guarded_with(Wire::H2, 1024);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(3, 0x1, 0, 1));
        bytes.extend([0x82, 0x86, 0x84]);
        bytes.extend(frame(0, 0x9, 0x4, 1)); // CONTINUATION with END_HEADERS
        client.write_all(&bytes).await.unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(took >= IDLE - Duration::from_millis(20), "took {took:?}");
    }
}
