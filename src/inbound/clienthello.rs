//! Reading a TLS ClientHello before any TLS state exists.
//!
//! The inbound listener chooses a per-port chain (certificate, ALPN, codec) from the ClientHello's
//! SNI, so it must see the SNI and the ALPN list before BoringSSL does. [`read`] buffers the bytes
//! of the first flight until [`parse`] finds a complete ClientHello; the caller then replays the
//! very same bytes into the TLS stack (see [`super::prefixed::Prefixed`]).
//!
//! The parser is pure and total: any input gives `Ok(None)` (need more bytes), `Ok(Some(_))` or an
//! error, never a panic. Where BoringSSL is strict (the shape of the server_name and ALPN
//! extensions) we are exactly as strict, so the name we route on is always the name BoringSSL sees.

use std::fmt;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Largest ClientHello handshake message we accept (its 4-byte header included), as Envoy's
/// tls_inspector does. Real ones are 0.3 to 2 KiB (an X25519MLKEM768 key share is 1.2 KiB).
pub const MAX_CLIENT_HELLO: usize = 16 * 1024;

/// Most bytes [`read`] ever buffers: the message plus the headers of the records that carry it.
/// The slack allows a few hundred record headers; no real client fragments that finely.
pub const MAX_BUFFERED: usize = MAX_CLIENT_HELLO + 2048;

/// The TLS record layer's own limit on a plaintext fragment (RFC 8446 5.1).
const MAX_RECORD: usize = 1 << 14;
const RECORD_HEADER: usize = 5;
const HANDSHAKE_HEADER: usize = 4;

const CONTENT_CHANGE_CIPHER_SPEC: u8 = 20;
const CONTENT_HANDSHAKE: u8 = 22;
const CONTENT_HEARTBEAT: u8 = 24;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const EXT_ALPN: u16 = 16;
const NAME_TYPE_HOST_NAME: u8 = 0;
/// BoringSSL's TLSEXT_MAXLEN_host_name: it refuses longer names, so we do too.
const MAX_HOST_NAME: usize = 255;

/// What the routing decision needs from a ClientHello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The server_name extension's host_name, byte for byte (no DNS validation: the mesh sends
    /// a bare port number such as `"9090"`).
    pub sni: Option<String>,
    /// ALPN protocol names in the client's order; empty when the extension is absent.
    pub alpn: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelloError {
    /// The first bytes are not a TLS handshake record (plaintext HTTP, garbage, ...).
    NotTls,
    /// TLS-shaped but broken, or a shape we refuse (SSLv2 hello, non-handshake record, ...).
    Malformed(&'static str),
    /// A record or the ClientHello claims more than the caps allow.
    TooLarge,
}

impl fmt::Display for HelloError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HelloError::NotTls => f.write_str("not a TLS handshake"),
            HelloError::Malformed(why) => write!(f, "malformed ClientHello: {why}"),
            HelloError::TooLarge => write!(f, "ClientHello larger than {MAX_CLIENT_HELLO} bytes"),
        }
    }
}

impl std::error::Error for HelloError {}

/// Why [`read`] gave up.
#[derive(Debug)]
pub enum ReadError {
    Hello(HelloError),
    /// The peer closed the connection before a whole ClientHello arrived.
    Eof,
    Timeout,
    Io(std::io::Error),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Hello(e) => e.fmt(f),
            ReadError::Eof => f.write_str("connection closed before the ClientHello was complete"),
            ReadError::Timeout => f.write_str("timed out waiting for the ClientHello"),
            ReadError::Io(e) => write!(f, "reading the ClientHello: {e}"),
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReadError::Hello(e) => Some(e),
            ReadError::Io(e) => Some(e),
            ReadError::Eof | ReadError::Timeout => None,
        }
    }
}

impl From<HelloError> for ReadError {
    fn from(e: HelloError) -> Self {
        ReadError::Hello(e)
    }
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
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

/// How the inbound chain selector reads a ClientHello's SNI (SPEC 1, "Inbound").
///
/// Port-shaped means all ASCII digits, or `p-` (any case) followed by ASCII digits: what the mesh
/// sends ("9090") and its DNS-shaped alias ("p-9090").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SniKind {
    /// No SNI (or an empty one): the default chain.
    Absent,
    /// A port-shaped SNI naming port P in 1..=65535, written canonically (no leading zero).
    Port(u16),
    /// Port-shaped but naming no valid port: 0, above 65535 (any number of digits), or with a
    /// leading zero ("09090", which Envoy's exact-string match would not take for "9090"). The
    /// caller refuses it like an unserved port (alert `unrecognized_name`), never the default chain.
    BadPort,
    /// Anything else (an FQDN, "bogus", "9090.", "+9090"): the default chain.
    Other,
}

/// Classifies an SNI for chain selection. Pure and total.
pub fn classify_sni(sni: Option<&str>) -> SniKind {
    let Some(sni) = sni else {
        return SniKind::Absent;
    };
    if sni.is_empty() {
        return SniKind::Absent;
    }
    let digits = match sni.as_bytes() {
        [b'p' | b'P', b'-', rest @ ..] => rest,
        all => all,
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return SniKind::Other;
    }
    if digits[0] == b'0' {
        return SniKind::BadPort;
    }
    let mut port: u32 = 0;
    for &d in digits {
        port = port * 10 + u32::from(d - b'0');
        if port > u32::from(u16::MAX) {
            return SniKind::BadPort;
        }
    }
    match u16::try_from(port) {
        Ok(p) => SniKind::Port(p),
        Err(_) => SniKind::BadPort,
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

/// A bounds-checked reader over a byte slice: every getter returns None past the end.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.bytes(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn prefixed_u8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.bytes(usize::from(n))
    }
    fn prefixed_u16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.bytes(usize::from(n))
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Parses a ClientHello body (RFC 8446 4.1.2; the TLS 1.2 form may omit extensions).
fn parse_body(body: &[u8]) -> Result<ClientHello, HelloError> {
    let mut c = Cursor(body);
    c.u16().ok_or(HelloError::Malformed("truncated version"))?;
    c.bytes(32)
        .ok_or(HelloError::Malformed("truncated random"))?;
    let session_id = c
        .prefixed_u8()
        .ok_or(HelloError::Malformed("truncated session id"))?;
    if session_id.len() > 32 {
        return Err(HelloError::Malformed("session id longer than 32 bytes"));
    }
    let suites = c
        .prefixed_u16()
        .ok_or(HelloError::Malformed("truncated cipher suites"))?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err(HelloError::Malformed("bad cipher suite list"));
    }
    let compression = c
        .prefixed_u8()
        .ok_or(HelloError::Malformed("truncated compression methods"))?;
    if compression.is_empty() {
        return Err(HelloError::Malformed("empty compression methods"));
    }
    let mut hello = ClientHello {
        sni: None,
        alpn: Vec::new(),
    };
    if c.is_empty() {
        return Ok(hello);
    }
    let mut exts = Cursor(
        c.prefixed_u16()
            .ok_or(HelloError::Malformed("truncated extensions"))?,
    );
    if !c.is_empty() {
        return Err(HelloError::Malformed("trailing bytes after extensions"));
    }
    let (mut seen_sni, mut seen_alpn) = (false, false);
    while !exts.is_empty() {
        let ty = exts
            .u16()
            .ok_or(HelloError::Malformed("truncated extension header"))?;
        let data = exts.prefixed_u16().ok_or(HelloError::Malformed(
            "extension longer than the extension list",
        ))?;
        // A duplicate would let us route on one value while the TLS stack saw another.
        match ty {
            EXT_SERVER_NAME if seen_sni => {
                return Err(HelloError::Malformed("duplicate server_name"))
            }
            EXT_SERVER_NAME => {
                seen_sni = true;
                hello.sni = Some(parse_server_name(data)?);
            }
            EXT_ALPN if seen_alpn => return Err(HelloError::Malformed("duplicate ALPN extension")),
            EXT_ALPN => {
                seen_alpn = true;
                hello.alpn = parse_alpn(data)?;
            }
            _ => {}
        }
    }
    Ok(hello)
}

/// server_name (RFC 6066 3) with BoringSSL's reading: exactly one entry, of type host_name,
/// 1..=255 bytes, no NUL. We also require UTF-8 (host names are ASCII by the RFC) so the name
/// can be a `String` without lossy conversion.
fn parse_server_name(data: &[u8]) -> Result<String, HelloError> {
    let mut ext = Cursor(data);
    let mut list = Cursor(
        ext.prefixed_u16()
            .ok_or(HelloError::Malformed("truncated server_name list"))?,
    );
    if !ext.is_empty() {
        return Err(HelloError::Malformed("trailing bytes in server_name"));
    }
    let ty = list
        .u8()
        .ok_or(HelloError::Malformed("empty server_name list"))?;
    let name = list
        .prefixed_u16()
        .ok_or(HelloError::Malformed("truncated host_name"))?;
    if !list.is_empty() {
        return Err(HelloError::Malformed("more than one server_name entry"));
    }
    if ty != NAME_TYPE_HOST_NAME {
        return Err(HelloError::Malformed(
            "server_name entry is not a host_name",
        ));
    }
    if name.is_empty() || name.len() > MAX_HOST_NAME {
        return Err(HelloError::Malformed("host_name length out of 1..=255"));
    }
    if name.contains(&0) {
        return Err(HelloError::Malformed("NUL in host_name"));
    }
    std::str::from_utf8(name)
        .map(str::to_owned)
        .map_err(|_| HelloError::Malformed("host_name is not UTF-8"))
}

/// application_layer_protocol_negotiation (RFC 7301 3.1): a non-empty list of non-empty names.
fn parse_alpn(data: &[u8]) -> Result<Vec<Vec<u8>>, HelloError> {
    let mut ext = Cursor(data);
    let mut list = Cursor(
        ext.prefixed_u16()
            .ok_or(HelloError::Malformed("truncated ALPN list"))?,
    );
    if !ext.is_empty() {
        return Err(HelloError::Malformed("trailing bytes in ALPN"));
    }
    if list.is_empty() {
        return Err(HelloError::Malformed("empty ALPN list"));
    }
    let mut protocols = Vec::new();
    while !list.is_empty() {
        let name = list
            .prefixed_u8()
            .ok_or(HelloError::Malformed("truncated ALPN protocol name"))?;
        if name.is_empty() {
            return Err(HelloError::Malformed("empty ALPN protocol name"));
        }
        protocols.push(name.to_vec());
    }
    Ok(protocols)
}

#[cfg(test)]
mod tests {
    use super::*;
    use boring::ssl::{
        HandshakeError, SslConnector, SslConnectorBuilder, SslMethod, SslVerifyMode,
    };
    use std::io::{Read, Write};
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio::io::{AsyncWriteExt, ReadBuf};

    /// A blocking-style stream for a boring client: keeps what it writes, never has data to read,
    /// so the handshake stops right after sending the ClientHello.
    #[derive(Default)]
    struct Capture(Vec<u8>);

    impl Read for Capture {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::WouldBlock.into())
        }
    }

    impl Write for Capture {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    pub(crate) fn alpn_wire(protocols: &[&[u8]]) -> Vec<u8> {
        let mut wire = Vec::new();
        for p in protocols {
            wire.push(p.len() as u8);
            wire.extend_from_slice(p);
        }
        wire
    }

    /// The bytes a real BoringSSL client sends first, with `tweak` applied to its context.
    fn real_hello_with(
        sni: Option<&str>,
        alpn: &[&[u8]],
        tweak: impl FnOnce(&mut SslConnectorBuilder),
    ) -> Vec<u8> {
        let mut b = SslConnector::builder(SslMethod::tls()).unwrap();
        b.set_verify(SslVerifyMode::NONE);
        if !alpn.is_empty() {
            b.set_alpn_protos(&alpn_wire(alpn)).unwrap();
        }
        tweak(&mut b);
        let mut cfg = b.build().configure().unwrap();
        cfg.set_verify_hostname(false);
        cfg.set_use_server_name_indication(sni.is_some());
        match cfg.connect(sni.unwrap_or("unused"), Capture::default()) {
            Err(HandshakeError::WouldBlock(mid)) => mid.get_ref().0.clone(),
            _ => panic!("expected the client to wait for the server after its hello"),
        }
    }

    fn real_hello(sni: Option<&str>, alpn: &[&[u8]]) -> Vec<u8> {
        real_hello_with(sni, alpn, |_| {})
    }

    /// The handshake message of a hello sent in one record (what BoringSSL does below 16 KiB).
    fn message_of(wire: &[u8]) -> &[u8] {
        assert_eq!(wire[0], CONTENT_HANDSHAKE);
        let len = usize::from(u16::from_be_bytes([wire[3], wire[4]]));
        assert_eq!(wire.len(), RECORD_HEADER + len, "expected a single record");
        &wire[RECORD_HEADER..]
    }

    /// Re-frames a handshake message into records whose payload sizes are `sizes`, the last
    /// one repeated until the message is used up.
    fn frame(msg: &[u8], sizes: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = msg;
        let mut i = 0;
        while !rest.is_empty() {
            let n = sizes[i.min(sizes.len() - 1)].min(rest.len());
            out.extend_from_slice(&[CONTENT_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&(n as u16).to_be_bytes());
            out.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            i += 1;
        }
        out
    }

    fn ext(ty: u16, data: &[u8]) -> Vec<u8> {
        let mut e = ty.to_be_bytes().to_vec();
        e.extend_from_slice(&(data.len() as u16).to_be_bytes());
        e.extend_from_slice(data);
        e
    }

    fn u16_prefixed(data: &[u8]) -> Vec<u8> {
        let mut v = (data.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(data);
        v
    }

    fn sni_ext(name: &[u8]) -> Vec<u8> {
        let mut entry = vec![NAME_TYPE_HOST_NAME];
        entry.extend(u16_prefixed(name));
        ext(EXT_SERVER_NAME, &u16_prefixed(&entry))
    }

    fn alpn_ext(protocols: &[&[u8]]) -> Vec<u8> {
        ext(EXT_ALPN, &u16_prefixed(&alpn_wire(protocols)))
    }

    /// A hand-made TLS 1.2-style ClientHello message body followed by `tail` (normally the
    /// u16-prefixed extension block).
    fn body_with_tail(tail: &[u8]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one cipher suite
        body.extend_from_slice(&[1, 0]); // null compression
        body.extend_from_slice(tail);
        body
    }

    fn message(body: &[u8]) -> Vec<u8> {
        let len = body.len() as u32;
        let mut m = vec![HANDSHAKE_CLIENT_HELLO];
        m.extend_from_slice(&len.to_be_bytes()[1..]);
        m.extend_from_slice(body);
        m
    }

    /// A one-record hello whose extension block is `exts` (already concatenated extensions).
    fn hello_with_exts(exts: &[u8]) -> Vec<u8> {
        frame(
            &message(&body_with_tail(&u16_prefixed(exts))),
            &[MAX_RECORD],
        )
    }

    fn hello(sni: Option<&str>, alpn: &[&[u8]]) -> ClientHello {
        ClientHello {
            sni: sni.map(str::to_owned),
            alpn: alpn.iter().map(|p| p.to_vec()).collect(),
        }
    }

    fn malformed(buf: &[u8]) -> &'static str {
        match parse(buf) {
            Err(HelloError::Malformed(why)) => why,
            other => panic!("expected Malformed, got {other:?}"),
        }
    }

    #[test]
    fn real_hello_with_port_sni_and_alpn() {
        let wire = real_hello(Some("9090"), &[b"h2", b"http/1.1"]);
        assert_eq!(
            parse(&wire),
            Ok(Some(hello(Some("9090"), &[b"h2", b"http/1.1"])))
        );
    }

    #[test]
    fn real_hello_with_dns_shaped_port_alias() {
        let wire = real_hello(Some("p-9090"), &[b"http/1.1"]);
        assert_eq!(
            parse(&wire),
            Ok(Some(hello(Some("p-9090"), &[b"http/1.1"])))
        );
    }

    #[test]
    fn real_hello_without_sni_or_alpn() {
        let wire = real_hello(None, &[]);
        assert_eq!(parse(&wire), Ok(Some(hello(None, &[]))));
    }

    #[test]
    fn real_hello_with_fqdn_sni() {
        let wire = real_hello(Some("payments.aether.internal"), &[b"h2"]);
        assert_eq!(
            parse(&wire),
            Ok(Some(hello(Some("payments.aether.internal"), &[b"h2"])))
        );
    }

    #[test]
    fn real_hello_with_grease_permuted_extensions_and_pq_key_share() {
        // GREASE adds unknown extensions, permutation moves SNI/ALPN anywhere, and the
        // X25519MLKEM768 share makes the hello ~1.5 KiB: the mesh's actual defaults.
        for _ in 0..8 {
            let wire = real_hello_with(Some("9090"), &[b"h2", b"http/1.1"], |b| {
                b.set_grease_enabled(true);
                b.set_permute_extensions(true);
                b.set_curves_list("X25519MLKEM768:X25519:P-256").unwrap();
            });
            assert!(wire.len() > 1200, "expected a post-quantum key share");
            assert_eq!(
                parse(&wire),
                Ok(Some(hello(Some("9090"), &[b"h2", b"http/1.1"])))
            );
        }
    }

    #[test]
    fn every_strict_prefix_of_a_real_hello_is_incomplete() {
        let wire = real_hello(Some("9090"), &[b"h2", b"http/1.1"]);
        for cut in 0..wire.len() {
            assert_eq!(parse(&wire[..cut]), Ok(None), "cut at {cut}");
        }
    }

    #[test]
    fn bytes_after_the_hello_are_ignored() {
        let mut wire = real_hello(Some("9090"), &[b"h2"]);
        wire.extend_from_slice(&[0x14, 3, 3, 0, 1, 1, 0x17, 3, 3, 0, 5, 1, 2, 3]);
        assert_eq!(parse(&wire), Ok(Some(hello(Some("9090"), &[b"h2"]))));
    }

    /// A real ClientHello of about 10 KiB: a long (but legal) ALPN list.
    fn large_real_hello() -> (Vec<u8>, Vec<Vec<u8>>) {
        let names: Vec<Vec<u8>> = (0..90)
            .map(|i| format!("proto-{i:03}-{}", "x".repeat(90)).into_bytes())
            .collect();
        let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        (real_hello(Some("9090"), &refs), names)
    }

    #[test]
    fn large_hello_split_across_two_records() {
        let (wire, names) = large_real_hello();
        let msg = message_of(&wire);
        assert!(msg.len() > 9000);
        let expected = ClientHello {
            sni: Some("9090".into()),
            alpn: names,
        };
        assert_eq!(parse(&wire), Ok(Some(expected.clone())));
        for first in [1, 2, 3, 4, 5, 100, msg.len() / 2, msg.len() - 1] {
            let split = frame(msg, &[first, MAX_RECORD]);
            assert_eq!(split.len(), msg.len() + 2 * RECORD_HEADER);
            assert_eq!(
                parse(&split),
                Ok(Some(expected.clone())),
                "first record {first}"
            );
            for cut in (0..split.len()).step_by(97).chain([split.len() - 1]) {
                assert_eq!(parse(&split[..cut]), Ok(None), "first {first}, cut {cut}");
            }
        }
    }

    #[test]
    fn hello_in_many_tiny_records() {
        let wire = real_hello(Some("p-9090"), &[b"h2", b"http/1.1"]);
        let msg = message_of(&wire);
        for size in [1, 2, 3, 7, 64] {
            let split = frame(msg, &[size]);
            assert_eq!(
                parse(&split),
                Ok(Some(hello(Some("p-9090"), &[b"h2", b"http/1.1"]))),
                "records of {size}"
            );
            assert_eq!(parse(&split[..split.len() - 1]), Ok(None));
        }
    }

    #[test]
    fn real_hello_over_the_cap_is_too_large() {
        // BoringSSL itself splits this ~18 KiB hello into two records.
        let names: Vec<Vec<u8>> = (0..170)
            .map(|i| format!("proto-{i:03}-{}", "y".repeat(90)).into_bytes())
            .collect();
        let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let wire = real_hello(Some("9090"), &refs);
        assert!(wire.len() > MAX_CLIENT_HELLO + RECORD_HEADER);
        assert_eq!(parse(&wire), Err(HelloError::TooLarge));
        // Known from the first record's handshake header alone.
        assert_eq!(parse(&wire[..RECORD_HEADER + 4]), Err(HelloError::TooLarge));
    }

    #[test]
    fn record_claiming_more_than_16k_is_too_large() {
        assert_eq!(parse(&[22, 3, 1, 0x40, 0x01]), Err(HelloError::TooLarge));
        assert_eq!(parse(&[22, 3, 3, 0xff, 0xff, 1]), Err(HelloError::TooLarge));
        // A small record whose handshake header claims more than the cap.
        assert_eq!(
            parse(&[22, 3, 1, 0, 4, 1, 0, 0x40, 0x00]),
            Err(HelloError::TooLarge)
        );
        // A message right at the cap is accepted as "need more".
        let at_cap = (MAX_CLIENT_HELLO - HANDSHAKE_HEADER) as u32;
        let b = at_cap.to_be_bytes();
        assert_eq!(parse(&[22, 3, 1, 0, 4, 1, b[1], b[2], b[3]]), Ok(None));
    }

    #[test]
    fn record_overhead_past_the_buffer_cap_is_too_large() {
        // 1-byte records: the message fits the cap but its framing needs 6x the bytes.
        let msg = message(&body_with_tail(&u16_prefixed(&ext(
            0xfafa,
            &vec![0; MAX_CLIENT_HELLO / 2],
        ))));
        let split = frame(&msg, &[1]);
        assert_eq!(parse(&split), Err(HelloError::TooLarge));
    }

    #[test]
    fn garbage_is_not_tls() {
        assert_eq!(parse(b"\x00\x01\x02\x03\x04\x05"), Err(HelloError::NotTls));
        assert_eq!(parse(b"\x16\x00"), Err(HelloError::NotTls));
        assert_eq!(parse(b"SSH-2.0-OpenSSH_9.6\r\n"), Err(HelloError::NotTls));
        // Decided from the first byte alone.
        assert_eq!(parse(b"\x42"), Err(HelloError::NotTls));
        assert_eq!(parse(b""), Ok(None));
        assert_eq!(parse(b"\x16"), Ok(None));
        assert_eq!(parse(b"\x16\x03"), Ok(None));
    }

    #[test]
    fn http_requests_are_not_tls() {
        let get = b"GET / HTTP/1.1\r\nHost: payments.aether.internal\r\n\r\n";
        assert_eq!(parse(get), Err(HelloError::NotTls));
        assert_eq!(
            parse(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            Err(HelloError::NotTls)
        );
    }

    #[test]
    fn sslv2_hello_is_rejected() {
        let v2 = [0x80, 0x2e, 0x01, 0x03, 0x01, 0x00, 0x15];
        assert_eq!(parse(&v2), Err(HelloError::Malformed("SSLv2 ClientHello")));
        assert_eq!(parse(&v2[..2]), Ok(None));
    }

    #[test]
    fn non_handshake_records_are_rejected() {
        // An alert where the hello should be.
        assert_eq!(
            malformed(&[21, 3, 3, 0, 2, 2, 40]),
            "first record is not a handshake record"
        );
        assert_eq!(
            malformed(&[23, 3, 3, 0, 1, 0]),
            "first record is not a handshake record"
        );
        // Application data between two fragments of the hello.
        let wire = real_hello(Some("9090"), &[b"h2"]);
        let mut split = frame(message_of(&wire), &[10]);
        split.truncate(RECORD_HEADER + 10);
        split.extend_from_slice(&[23, 3, 3, 0, 1, 0]);
        assert_eq!(
            malformed(&split),
            "non-handshake record inside the ClientHello"
        );
    }

    #[test]
    fn other_record_level_errors() {
        assert_eq!(malformed(&[22, 3, 1, 0, 0]), "empty handshake record");
        assert_eq!(malformed(&[22, 3, 9, 0, 1, 1]), "bad record version");
        // A ServerHello (type 2) is not a ClientHello.
        assert_eq!(
            malformed(&[22, 3, 3, 0, 4, 2, 0, 0, 40]),
            "first handshake message is not a ClientHello"
        );
        // Every record version a client may use is fine.
        let msg = message(&body_with_tail(&[]));
        for minor in 0..=4 {
            let mut wire = frame(&msg, &[MAX_RECORD]);
            wire[2] = minor;
            assert_eq!(parse(&wire), Ok(Some(hello(None, &[]))));
        }
    }

    #[test]
    fn hand_made_hellos_parse() {
        // TLS 1.2 style: no extension block at all.
        let bare = frame(&message(&body_with_tail(&[])), &[MAX_RECORD]);
        assert_eq!(parse(&bare), Ok(Some(hello(None, &[]))));
        // Unknown extensions around SNI and ALPN are skipped.
        let mut exts = ext(0x0a0a, &[]);
        exts.extend(alpn_ext(&[b"http/1.1", b"h2"]));
        exts.extend(ext(0xff01, &[0]));
        exts.extend(sni_ext(b"9090"));
        let wire = hello_with_exts(&exts);
        assert_eq!(
            parse(&wire),
            Ok(Some(hello(Some("9090"), &[b"http/1.1", b"h2"])))
        );
        // A 255-byte name is the longest BoringSSL accepts.
        let long = "a".repeat(255);
        let wire = hello_with_exts(&sni_ext(long.as_bytes()));
        assert_eq!(parse(&wire), Ok(Some(hello(Some(&long), &[]))));
    }

    #[test]
    fn truncated_and_inconsistent_lengths_are_malformed() {
        let good = {
            let mut e = sni_ext(b"9090");
            e.extend(alpn_ext(&[b"h2"]));
            e
        };
        // Extension block length past the end of the body.
        let mut tail = u16_prefixed(&good);
        tail[1] += 1;
        let wire = frame(&message(&body_with_tail(&tail)), &[MAX_RECORD]);
        assert_eq!(malformed(&wire), "truncated extensions");
        // Extension block shorter than its content.
        let mut tail = u16_prefixed(&good);
        tail[1] -= 1;
        let wire = frame(&message(&body_with_tail(&tail)), &[MAX_RECORD]);
        assert_eq!(malformed(&wire), "trailing bytes after extensions");
        // One extension claiming more than the block holds.
        let mut exts = good.clone();
        exts[3] += 50;
        assert_eq!(
            malformed(&hello_with_exts(&exts)),
            "extension longer than the extension list"
        );
        // Half an extension header.
        let mut exts = good.clone();
        exts.push(0);
        assert_eq!(
            malformed(&hello_with_exts(&exts)),
            "truncated extension header"
        );
        // server_name list length past the extension.
        let mut sni = sni_ext(b"9090");
        sni[5] += 1;
        assert_eq!(
            malformed(&hello_with_exts(&sni)),
            "truncated server_name list"
        );
        // host_name length past the list.
        let mut sni = sni_ext(b"9090");
        sni[8] += 1;
        assert_eq!(malformed(&hello_with_exts(&sni)), "truncated host_name");
        // ALPN list length past the extension.
        let mut alpn = alpn_ext(&[b"h2", b"http/1.1"]);
        alpn[5] += 1;
        assert_eq!(malformed(&hello_with_exts(&alpn)), "truncated ALPN list");
        // A protocol name running past the list.
        let mut alpn = alpn_ext(&[b"h2", b"http/1.1"]);
        alpn[9] = 200;
        assert_eq!(
            malformed(&hello_with_exts(&alpn)),
            "truncated ALPN protocol name"
        );
        // Body fields.
        let body = body_with_tail(&[]);
        for (cut, why) in [
            (1, "truncated version"),
            (20, "truncated random"),
            (34, "truncated session id"),
            (36, "truncated cipher suites"),
            (39, "truncated compression methods"),
        ] {
            let wire = frame(&message(&body[..cut]), &[MAX_RECORD]);
            assert_eq!(malformed(&wire), why, "body cut at {cut}");
        }
    }

    #[test]
    fn server_name_and_alpn_shapes_boringssl_refuses_are_malformed() {
        let two_names = {
            let mut list = vec![0];
            list.extend(u16_prefixed(b"9090"));
            list.push(0);
            list.extend(u16_prefixed(b"8080"));
            ext(EXT_SERVER_NAME, &u16_prefixed(&list))
        };
        let other_type = {
            let mut list = vec![1];
            list.extend(u16_prefixed(b"9090"));
            ext(EXT_SERVER_NAME, &u16_prefixed(&list))
        };
        let mut dup_sni = sni_ext(b"9090");
        dup_sni.extend(sni_ext(b"8080"));
        let mut dup_alpn = alpn_ext(&[b"h2"]);
        dup_alpn.extend(alpn_ext(&[b"http/1.1"]));
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (two_names, "more than one server_name entry"),
            (other_type, "server_name entry is not a host_name"),
            (dup_sni, "duplicate server_name"),
            (dup_alpn, "duplicate ALPN extension"),
            (sni_ext(b""), "host_name length out of 1..=255"),
            (sni_ext(&[b'a'; 256]), "host_name length out of 1..=255"),
            (sni_ext(b"90\x0090"), "NUL in host_name"),
            (sni_ext(b"\xff\xfe"), "host_name is not UTF-8"),
            (ext(EXT_SERVER_NAME, &[]), "truncated server_name list"),
            (ext(EXT_SERVER_NAME, &[0, 0]), "empty server_name list"),
            (ext(EXT_ALPN, &[0, 0]), "empty ALPN list"),
            (alpn_ext(&[b"h2", b""]), "empty ALPN protocol name"),
            (
                ext(EXT_ALPN, &[0, 3, 2, b'h', b'2', 9]),
                "trailing bytes in ALPN",
            ),
        ];
        for (exts, why) in cases {
            assert_eq!(malformed(&hello_with_exts(&exts)), why);
        }
    }

    #[test]
    fn random_mutations_never_panic() {
        let mut rng = fastrand::Rng::with_seed(0x5eed_c0de);
        let base = real_hello_with(Some("9090"), &[b"h2", b"http/1.1"], |b| {
            b.set_grease_enabled(true);
        });
        let fragmented = frame(message_of(&base), &[3, 50, 700]);
        // Every single-byte change at every position.
        for wire in [&base, &fragmented] {
            for i in 0..wire.len() {
                for v in [
                    0u8,
                    1,
                    0x7f,
                    0x80,
                    0xff,
                    wire[i].wrapping_add(1),
                    wire[i].wrapping_sub(1),
                ] {
                    let mut m = wire.clone();
                    m[i] = v;
                    let _ = parse(&m);
                }
            }
        }
        // Random multi-byte damage, truncation and insertion.
        for _ in 0..20_000 {
            let mut m = if rng.bool() {
                base.clone()
            } else {
                fragmented.clone()
            };
            for _ in 0..rng.usize(1..6) {
                let i = rng.usize(..m.len());
                match rng.u8(..4) {
                    0 => m[i] = rng.u8(..),
                    1 => m.truncate(i.max(1)),
                    2 => m.insert(i, rng.u8(..)),
                    _ => {
                        m.remove(i);
                    }
                }
                if m.is_empty() {
                    break;
                }
            }
            if let Ok(Some(h)) = parse(&m) {
                assert!(h
                    .sni
                    .as_deref()
                    .is_none_or(|s| !s.is_empty() && s.len() <= 255));
                assert!(h.alpn.iter().all(|p| !p.is_empty()));
            }
        }
        // Pure noise behind a plausible record header.
        for _ in 0..5_000 {
            let len = rng.usize(0..600);
            let mut m = vec![22, 3, rng.u8(0..5)];
            m.extend_from_slice(&(len as u16).to_be_bytes());
            m.push(1);
            m.extend((0..len).map(|_| rng.u8(..)));
            let _ = parse(&m);
        }
    }

    #[test]
    fn classify_sni_table() {
        use SniKind::*;
        let cases: &[(Option<&str>, SniKind)] = &[
            (None, Absent),
            (Some(""), Absent),
            (Some("9090"), Port(9090)),
            (Some("1"), Port(1)),
            (Some("65535"), Port(65535)),
            (Some("p-9090"), Port(9090)),
            (Some("P-8080"), Port(8080)),
            (Some("p-1"), Port(1)),
            (Some("0"), BadPort),
            (Some("p-0"), BadPort),
            (Some("65536"), BadPort),
            (Some("99999"), BadPort),
            (Some("123456"), BadPort),
            (Some("99999999999999999999999999"), BadPort),
            (Some("09090"), BadPort),
            (Some("p-09090"), BadPort),
            (Some("payments.aether.internal"), Other),
            (Some("bogus"), Other),
            (Some("9090."), Other),
            (Some("+9090"), Other),
            (Some("-9090"), Other),
            (Some(" 9090"), Other),
            (Some("p-"), Other),
            (Some("p9090"), Other),
            (Some("p--9090"), Other),
            (Some("q-9090"), Other),
            (Some("٩٠٩٠"), Other), // non-ASCII digits are not port-shaped
            (Some("p-9090.aether.internal"), Other),
        ];
        for (sni, want) in cases {
            assert_eq!(classify_sni(*sni), *want, "{sni:?}");
        }
    }

    /// Yields one byte per read and returns Pending every other poll, like a slow peer.
    struct Trickle {
        data: Vec<u8>,
        pos: usize,
        pending: bool,
    }

    impl AsyncRead for Trickle {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            self.pending = !self.pending;
            if self.pending {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if let Some(&b) = self.data.get(self.pos) {
                buf.put_slice(&[b]);
                self.pos += 1;
            }
            Poll::Ready(Ok(()))
        }
    }

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn read_over_one_byte_reads() {
        let (wire, names) = large_real_hello();
        let split = frame(message_of(&wire), &[4000, MAX_RECORD]);
        let mut extra = split.clone();
        extra.extend_from_slice(b"after");
        let mut io = Trickle {
            data: extra,
            pos: 0,
            pending: false,
        };
        let mut buf = BytesMut::new();
        let got = read(&mut io, &mut buf, T).await.unwrap();
        assert_eq!(got.sni.as_deref(), Some("9090"));
        assert_eq!(got.alpn, names);
        // Stops at the last byte of the hello, every byte kept.
        assert_eq!(&buf[..], &split[..]);
    }

    #[tokio::test]
    async fn read_keeps_bytes_past_the_hello() {
        let mut wire = real_hello(Some("9090"), &[b"h2"]);
        let hello_len = wire.len();
        wire.extend_from_slice(b"early bytes");
        let mut io = &wire[..];
        let mut buf = BytesMut::new();
        let got = read(&mut io, &mut buf, T).await.unwrap();
        assert_eq!(got, hello(Some("9090"), &[b"h2"]));
        assert_eq!(&buf[..], &wire[..]);
        assert!(buf.len() > hello_len);
    }

    #[tokio::test]
    async fn read_parses_what_the_buffer_already_holds() {
        let wire = real_hello(Some("p-8080"), &[]);
        let mut buf = BytesMut::from(&wire[..]);
        let mut io = tokio::io::empty();
        let got = read(&mut io, &mut buf, T).await.unwrap();
        assert_eq!(got.sni.as_deref(), Some("p-8080"));
    }

    #[tokio::test]
    async fn read_eof_mid_hello() {
        let wire = real_hello(Some("9090"), &[b"h2"]);
        for cut in [0, 1, 5, 6, wire.len() / 2, wire.len() - 1] {
            let mut io = &wire[..cut];
            let mut buf = BytesMut::new();
            let err = read(&mut io, &mut buf, T).await.unwrap_err();
            assert!(matches!(err, ReadError::Eof), "cut {cut}: {err}");
            assert_eq!(&buf[..], &wire[..cut]);
        }
    }

    #[tokio::test]
    async fn read_times_out_when_the_client_sends_nothing() {
        let (_client, mut server) = tokio::io::duplex(1024);
        let mut buf = BytesMut::new();
        let started = std::time::Instant::now();
        let err = read(&mut server, &mut buf, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, ReadError::Timeout), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(50));
    }

    #[tokio::test]
    async fn read_times_out_on_a_stalled_partial_hello() {
        let wire = real_hello(Some("9090"), &[b"h2"]);
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client.write_all(&wire[..100]).await.unwrap();
        let mut buf = BytesMut::new();
        let err = read(&mut server, &mut buf, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, ReadError::Timeout), "{err}");
        assert_eq!(&buf[..], &wire[..100]);
    }

    #[tokio::test]
    async fn read_rejects_plaintext_http_at_once() {
        let mut io: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut buf = BytesMut::new();
        let err = read(&mut io, &mut buf, T).await.unwrap_err();
        assert!(matches!(err, ReadError::Hello(HelloError::NotTls)), "{err}");
        assert_eq!(err.to_string(), "not a TLS handshake");
    }

    #[tokio::test]
    async fn read_never_buffers_past_the_cap() {
        // A peer that streams 1-byte handshake records forever.
        let msg = message(&vec![0; MAX_CLIENT_HELLO - HANDSHAKE_HEADER]);
        let endless = frame(&msg, &[1]);
        let mut io = &endless[..];
        let mut buf = BytesMut::new();
        let err = read(&mut io, &mut buf, T).await.unwrap_err();
        assert!(
            matches!(err, ReadError::Hello(HelloError::TooLarge)),
            "{err}"
        );
        assert!(buf.len() <= MAX_BUFFERED, "{}", buf.len());
    }

    #[tokio::test]
    async fn read_reports_io_errors() {
        struct Broken;
        impl AsyncRead for Broken {
            fn poll_read(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &mut ReadBuf<'_>,
            ) -> Poll<std::io::Result<()>> {
                Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()))
            }
        }
        let mut buf = BytesMut::new();
        let err = read(&mut Broken, &mut buf, T).await.unwrap_err();
        assert!(
            matches!(&err, ReadError::Io(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
        );
    }

    #[tokio::test]
    async fn read_from_a_real_client_over_tcp() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut b = SslConnector::builder(SslMethod::tls()).unwrap();
            b.set_verify(SslVerifyMode::NONE);
            b.set_alpn_protos(&alpn_wire(&[b"http/1.1", b"h2"]))
                .unwrap();
            let cfg = b.build().configure().unwrap().verify_hostname(false);
            // The server below never answers; the handshake ends when it hangs up.
            let _ = tokio_boring::connect(cfg, "5432", tcp).await;
        });
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut buf = BytesMut::new();
        let got = read(&mut tcp, &mut buf, T).await.unwrap();
        assert_eq!(got, hello(Some("5432"), &[b"http/1.1", b"h2"]));
        assert_eq!(classify_sni(got.sni.as_deref()), SniKind::Port(5432));
        drop(tcp);
        client.await.unwrap();
    }
}
