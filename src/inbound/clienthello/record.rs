//! The TLS record layer in front of the ClientHello: [`read`] buffers the first flight from the
//! socket until a [`HelloReader`] has walked enough records (checking each header) to hold the whole
//! message, which may span several records; the message body is then parsed by `hello.rs`.

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::hello::{parse_body, ClientHello, HelloError, MAX_CLIENT_HELLO};

/// Most bytes [`read`] ever buffers: the message plus the headers of the records that carry it.
/// The slack allows a few hundred record headers; no real client fragments that finely.
pub const MAX_BUFFERED: usize = MAX_CLIENT_HELLO + 2048;

/// The TLS record layer's own limit on a plaintext fragment (RFC 8446 5.1).
pub(crate) const MAX_RECORD: usize = 1 << 14;
pub(crate) const RECORD_HEADER: usize = 5;
pub(crate) const HANDSHAKE_HEADER: usize = 4;

pub(crate) const CONTENT_CHANGE_CIPHER_SPEC: u8 = 20;
pub(crate) const CONTENT_HANDSHAKE: u8 = 22;
pub(crate) const CONTENT_HEARTBEAT: u8 = 24;
pub(crate) const HANDSHAKE_CLIENT_HELLO: u8 = 1;

/// Why [`read`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Hello(#[from] HelloError),
    /// The peer closed the connection before a whole ClientHello arrived.
    #[error("connection closed before the ClientHello was complete")]
    Eof,
    #[error("timed out waiting for the ClientHello")]
    Timeout,
    #[error("reading the ClientHello: {0}")]
    Io(#[from] std::io::Error),
}

/// Parses the ClientHello at the start of `buf` (raw bytes from the wire, record headers
/// included). `Ok(None)` means "need more bytes"; errors are reported as early as the bytes allow
/// (a bad first byte fails at once, an oversized length as soon as its header is in).
///
/// The message may span several records; records must all be handshake records. Bytes after the
/// ClientHello are ignored (they belong to the TLS stack).
#[cfg(any(test, feature = "testing"))] // the listener reads with `read`; tests, benches, fuzz
pub fn parse(buf: &[u8]) -> Result<Option<ClientHello>, HelloError> {
    HelloReader::default().feed(buf)
}

/// Reads from `io` into `buf` until a [`HelloReader`] finds a whole ClientHello, an error, EOF or the
/// `timeout` (which covers the whole read, like Envoy's listener-filter timeout). `buf` keeps every
/// byte read, including any past the ClientHello, so the caller can replay them; it never holds
/// more than [`MAX_BUFFERED`] bytes. Bytes already in `buf` are parsed first.
pub async fn read<S>(
    io: &mut S,
    buf: &mut BytesMut,
    timeout: Duration,
) -> Result<ClientHello, ReadError>
where
    S: AsyncRead + Unpin,
{
    read_with(io, buf, timeout, &mut HelloReader::default()).await
}

/// [`read`] with the caller's [`HelloReader`] (which tells how much work the read took).
pub async fn read_with<S>(
    io: &mut S,
    buf: &mut BytesMut,
    timeout: Duration,
    reader: &mut HelloReader,
) -> Result<ClientHello, ReadError>
where
    S: AsyncRead + Unpin,
{
    match tokio::time::timeout(timeout, read_until_hello(io, buf, reader)).await {
        Ok(res) => res,
        Err(_) => Err(ReadError::Timeout),
    }
}

async fn read_until_hello<S>(
    io: &mut S,
    buf: &mut BytesMut,
    reader: &mut HelloReader,
) -> Result<ClientHello, ReadError>
where
    S: AsyncRead + Unpin,
{
    // Every read has room for a whole typical hello, whatever the caller's buffer: a
    // post-quantum one (2.2 KB with an X25519MLKEM768 share and a ticket) then takes one `recv`.
    const CHUNK: usize = 4096;
    loop {
        if let Some(hello) = reader.feed(buf)? {
            return Ok(hello);
        }
        // `feed` said "incomplete", which it only does while the bytes it still needs fit under
        // MAX_BUFFERED, so `room` is positive; the check keeps that a local fact.
        let room = MAX_BUFFERED.saturating_sub(buf.len());
        if room == 0 {
            return Err(HelloError::TooLarge.into());
        }
        buf.reserve(room.min(CHUNK));
        let n = io.read_buf(&mut BufMut::limit(&mut *buf, room)).await?;
        if n == 0 {
            return Err(ReadError::Eof);
        }
    }
}

/// The record walk, kept between reads so that every byte is looked at once however finely the
/// hello is fragmented (a hello split into 1-byte records costs the same per byte as one in a
/// single record; walking from the start on every read would be quadratic).
///
/// Each [`feed`](HelloReader::feed) must be given the bytes of the previous call plus any new
/// ones (the growing read buffer).
#[derive(Debug, Default)]
pub struct HelloReader {
    /// Start of the record being read.
    pos: usize,
    /// Whether that record's header was checked.
    checked: bool,
    /// Payload bytes of that record already taken.
    taken: usize,
    /// The handshake message so far, its 4-byte header included.
    msg: Vec<u8>,
    /// The message body's length, once its header is in.
    body_len: Option<usize>,
    /// Bytes looked at so far: record headers and payload bytes, each counted once.
    examined: usize,
}

impl HelloReader {
    /// Bytes examined so far; never more than the bytes fed (linear work).
    #[cfg(feature = "testing")] // tests/suite/rules.rs
    pub fn examined(&self) -> usize {
        self.examined
    }

    /// Continues the walk over `buf` (see the type's contract); `Ok(None)`: need more bytes.
    pub fn feed(&mut self, buf: &[u8]) -> Result<Option<ClientHello>, HelloError> {
        if self.pos == 0 && !self.checked {
            check_first_bytes(buf)?;
        }
        loop {
            let Some(rec) = buf.get(self.pos..self.pos + RECORD_HEADER) else {
                return Ok(None);
            };
            let len = usize::from(u16::from_be_bytes([rec[3], rec[4]]));
            let start = self.pos + RECORD_HEADER;
            let end = start + len;
            if !self.checked {
                check_record(rec, end)?;
                self.checked = true;
                self.examined += RECORD_HEADER;
                // The common case: the whole message sits in the first record; parse it in
                // place, without copying.
                if self.pos == 0 && buf.len() >= end {
                    if let Some(body) = whole_message(&buf[start..end])? {
                        self.examined += HANDSHAKE_HEADER + body.len();
                        return parse_body(body).map(Some);
                    }
                }
            }
            let payload = buf.get(start + self.taken..end.min(buf.len()));
            let payload = payload.unwrap_or_default();
            let want = match self.body_len {
                Some(n) => HANDSHAKE_HEADER + n,
                None => HANDSHAKE_HEADER,
            };
            let take = (want - self.msg.len()).min(payload.len());
            self.msg.extend_from_slice(&payload[..take]);
            self.taken += take;
            self.examined += take;
            if self.body_len.is_none() && self.msg.len() == HANDSHAKE_HEADER {
                self.body_len = Some(message_len(&self.msg)?);
                // The same record may carry more of the message.
                continue;
            }
            if let Some(n) = self.body_len {
                // Only the message's bytes count; a record may carry trailing bytes after it.
                if self.msg.len() == HANDSHAKE_HEADER + n {
                    return parse_body(&self.msg[HANDSHAKE_HEADER..]).map(Some);
                }
            }
            if end > buf.len() {
                return Ok(None);
            }
            self.pos = end;
            self.checked = false;
            self.taken = 0;
        }
    }
}

/// Checks one record header; `end` is where its payload would end in the buffer.
fn check_record(rec: &[u8], end: usize) -> Result<(), HelloError> {
    if rec[0] != CONTENT_HANDSHAKE {
        return Err(HelloError::Malformed(
            "non-handshake record inside the ClientHello",
        ));
    }
    if !valid_record_version(rec[1], rec[2]) {
        return Err(HelloError::Malformed("bad record version"));
    }
    let len = usize::from(u16::from_be_bytes([rec[3], rec[4]]));
    if len > MAX_RECORD {
        return Err(HelloError::TooLarge);
    }
    if len == 0 {
        // RFC 8446 5.1: zero-length handshake fragments are forbidden.
        return Err(HelloError::Malformed("empty handshake record"));
    }
    if end > MAX_BUFFERED {
        return Err(HelloError::TooLarge);
    }
    Ok(())
}

/// The body length from a handshake header, which must be a ClientHello's within the cap.
fn message_len(header: &[u8]) -> Result<usize, HelloError> {
    if header[0] != HANDSHAKE_CLIENT_HELLO {
        return Err(HelloError::Malformed(
            "first handshake message is not a ClientHello",
        ));
    }
    let body_len =
        usize::from(header[1]) << 16 | usize::from(header[2]) << 8 | usize::from(header[3]);
    // Fail on the claim, before waiting for bytes we would refuse anyway.
    if HANDSHAKE_HEADER + body_len > MAX_CLIENT_HELLO {
        return Err(HelloError::TooLarge);
    }
    Ok(body_len)
}

/// The message body when the first record's `payload` holds the whole message.
fn whole_message(payload: &[u8]) -> Result<Option<&[u8]>, HelloError> {
    let Some(header) = payload.get(..HANDSHAKE_HEADER) else {
        return Ok(None);
    };
    let body_len = message_len(header)?;
    Ok(payload.get(HANDSHAKE_HEADER..HANDSHAKE_HEADER + body_len))
}

/// Rejects, from as few bytes as possible, what cannot be a TLS ClientHello record.
fn check_first_bytes(buf: &[u8]) -> Result<(), HelloError> {
    let Some(&first) = buf.first() else {
        return Ok(());
    };
    if first == CONTENT_HANDSHAKE {
        return match buf.get(1) {
            Some(&3) | None => Ok(()),
            Some(_) => Err(HelloError::NotTls),
        };
    }
    if first & 0x80 != 0 {
        // SSLv2-compatible hello: 2-byte length with the top bit set, then msg type 1 and a
        // 3.x version. TLS 1.2+ stacks refuse it; say so rather than "not TLS".
        return match (buf.get(2), buf.get(3)) {
            (Some(&1), Some(&3)) => Err(HelloError::Malformed("SSLv2 ClientHello")),
            (None, _) | (Some(&1), None) => Ok(()),
            _ => Err(HelloError::NotTls),
        };
    }
    if (CONTENT_CHANGE_CIPHER_SPEC..=CONTENT_HEARTBEAT).contains(&first) {
        // Another TLS record type (alert, application data, ...) where a hello must come.
        return match buf.get(1) {
            Some(&3) => Err(HelloError::Malformed(
                "first record is not a handshake record",
            )),
            None => Ok(()),
            Some(_) => Err(HelloError::NotTls),
        };
    }
    Err(HelloError::NotTls)
}

/// The record layer's legacy version: ignored by TLS 1.3 peers, but it is 3.x (SSL 3.0 to
/// TLS 1.3); clients send 0x0301..0x0303 in practice.
fn valid_record_version(major: u8, minor: u8) -> bool {
    major == 3 && minor <= 4
}
