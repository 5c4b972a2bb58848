//! The TLS record layer in front of the ClientHello: [`read`] buffers the first flight from the
//! socket until [`parse`] has walked enough records (checking each header) to hold the whole
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
pub fn parse(buf: &[u8]) -> Result<Option<ClientHello>, HelloError> {
    match locate(buf)? {
        Located::Incomplete => Ok(None),
        // The common case: the whole message sits in the first record; parse it in place.
        Located::Contiguous(body) => parse_body(body).map(Some),
        Located::Fragmented(body_len) => {
            let mut msg = Vec::with_capacity(HANDSHAKE_HEADER + body_len);
            gather(buf, &mut msg, HANDSHAKE_HEADER + body_len);
            parse_body(msg.get(HANDSHAKE_HEADER..).unwrap_or_default()).map(Some)
        }
    }
}

/// Reads from `io` into `buf` until [`parse`] finds a whole ClientHello, an error, EOF or the
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
    match tokio::time::timeout(timeout, read_until_hello(io, buf)).await {
        Ok(res) => res,
        Err(_) => Err(ReadError::Timeout),
    }
}

async fn read_until_hello<S>(io: &mut S, buf: &mut BytesMut) -> Result<ClientHello, ReadError>
where
    S: AsyncRead + Unpin,
{
    // One read usually brings the whole hello; start with room for a typical one.
    const CHUNK: usize = 4096;
    loop {
        if let Some(hello) = parse(buf)? {
            return Ok(hello);
        }
        // `parse` said "incomplete", which it only does while the bytes it still needs fit under
        // MAX_BUFFERED, so `room` is positive; the check keeps that a local fact.
        let room = MAX_BUFFERED.saturating_sub(buf.len());
        if room == 0 {
            return Err(HelloError::TooLarge.into());
        }
        if buf.capacity() == buf.len() {
            buf.reserve(room.min(CHUNK));
        }
        let n = io.read_buf(&mut BufMut::limit(&mut *buf, room)).await?;
        if n == 0 {
            return Err(ReadError::Eof);
        }
    }
}

/// Where the ClientHello message is in the raw bytes.
enum Located<'a> {
    Incomplete,
    /// The handshake body (after the 4-byte header), all inside the first record.
    Contiguous(&'a [u8]),
    /// The body has this length and crosses record boundaries: it must be gathered.
    Fragmented(usize),
}

/// Walks the record headers, checking each, until the ClientHello message is complete.
fn locate(buf: &[u8]) -> Result<Located<'_>, HelloError> {
    check_first_bytes(buf)?;
    let mut pos = 0;
    // The 4-byte handshake header may itself be split across (tiny) records.
    let mut header = [0u8; HANDSHAKE_HEADER];
    let mut have = 0usize;
    let mut msg_len: Option<usize> = None;
    // Handshake-layer bytes available so far (payloads, record headers excluded).
    let mut collected = 0usize;
    loop {
        let Some(rec) = buf.get(pos..pos + RECORD_HEADER) else {
            return Ok(Located::Incomplete);
        };
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
        let start = pos + RECORD_HEADER;
        let end = start + len;
        if end > MAX_BUFFERED {
            return Err(HelloError::TooLarge);
        }
        let payload = buf.get(start..end.min(buf.len())).unwrap_or_default();
        collected += payload.len();

        if msg_len.is_none() {
            let take = (HANDSHAKE_HEADER - have).min(payload.len());
            header[have..have + take].copy_from_slice(&payload[..take]);
            have += take;
            if have == HANDSHAKE_HEADER {
                if header[0] != HANDSHAKE_CLIENT_HELLO {
                    return Err(HelloError::Malformed(
                        "first handshake message is not a ClientHello",
                    ));
                }
                let body_len = usize::from(header[1]) << 16
                    | usize::from(header[2]) << 8
                    | usize::from(header[3]);
                // Fail on the claim, before waiting for bytes we would refuse anyway.
                if HANDSHAKE_HEADER + body_len > MAX_CLIENT_HELLO {
                    return Err(HelloError::TooLarge);
                }
                msg_len = Some(body_len);
            }
        }
        if let Some(body_len) = msg_len {
            // Only the message's bytes count; a record may carry trailing bytes after it.
            if collected >= HANDSHAKE_HEADER + body_len {
                return Ok(if pos == 0 {
                    let body = payload.get(HANDSHAKE_HEADER..HANDSHAKE_HEADER + body_len);
                    Located::Contiguous(body.unwrap_or_default())
                } else {
                    Located::Fragmented(body_len)
                });
            }
        }
        if end > buf.len() {
            return Ok(Located::Incomplete);
        }
        pos = end;
    }
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

/// Copies the payloads of consecutive records into `out` until it holds `want` bytes.
fn gather(buf: &[u8], out: &mut Vec<u8>, want: usize) {
    let mut pos = 0;
    while out.len() < want {
        let Some(rec) = buf.get(pos..pos + RECORD_HEADER) else {
            return;
        };
        let start = pos + RECORD_HEADER;
        let end = start + usize::from(u16::from_be_bytes([rec[3], rec[4]]));
        let payload = buf.get(start..end.min(buf.len())).unwrap_or_default();
        let take = (want - out.len()).min(payload.len());
        out.extend_from_slice(&payload[..take]);
        pos = end;
    }
}
