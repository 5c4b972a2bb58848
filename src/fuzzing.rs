//! What the fuzz targets in `fuzz/` need that is private to its module. Not an API: nothing
//! else may use it, and it may change with the code it reaches.

/// Decodes `value` as the SDS Secret `name` (`default` or `ROOTCA`) exactly as a pushed one
/// is read. `Ok` carries the lengths of the PEM blobs the secret holds.
pub fn sds_secret(name: &str, value: &[u8]) -> Result<Vec<usize>, String> {
    use crate::xds::sds::{decode_secret, Pushed};
    Ok(match decode_secret(name, value)? {
        Pushed::Workload { cert, key } => vec![cert.len(), key.len()],
        Pushed::RootCa(pem) => vec![pem.len()],
    })
}

/// An HTTP/1 request head's field lines counted as its bytes arrive, as every downstream
/// HTTP/1 connection counts them.
#[derive(Default)]
pub struct Http1Head(crate::http::server::HeadLines);

impl Http1Head {
    /// True when the head must be refused (a field too many, or contradicting framing).
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        self.0.feed(bytes)
    }

    /// The field lines counted so far.
    pub fn fields(&self) -> usize {
        self.0.progress().0
    }

    /// Whether the blank line that ends the head has arrived.
    pub fn ended(&self) -> bool {
        self.0.progress().1
    }

    /// Whether the refusal was for contradicting framing fields.
    pub fn ambiguous(&self) -> bool {
        self.0.ambiguous
    }
}

/// HTTP/2 frame boundaries after the preface, followed for the header-block timer. The clock
/// is std's, so the targets need no tokio.
#[derive(Default)]
pub struct H2Frames(crate::http::server::Frames);

impl H2Frames {
    pub fn feed(&mut self, bytes: &[u8], now: std::time::Instant) {
        self.0.feed(bytes, now.into());
    }

    /// When the open header block began; `None` when no block is open.
    pub fn block_since(&self) -> Option<std::time::Instant> {
        self.0.block_since().map(Into::into)
    }
}

/// What a downstream connection's bytes say it speaks: the HTTP/2 preface, then its frames.
pub struct Sniffed(crate::http::server::Seen);

impl Sniffed {
    pub fn new(wire: crate::http::server::Wire) -> Sniffed {
        Sniffed(crate::http::server::Seen::new(wire))
    }

    /// True when these bytes completed the preface.
    pub fn arrived(&mut self, got: &[u8], now: std::time::Instant) -> bool {
        self.0.arrived(got, now.into())
    }

    pub fn is_h2(&self) -> bool {
        self.0.is_h2()
    }

    /// When the open HTTP/2 header block began, if one is open.
    pub fn header_block_since(&self) -> Option<std::time::Instant> {
        self.0.header_block_since().map(Into::into)
    }
}
