//! The ClientHello message itself (RFC 8446 4.1.2): the SNI and ALPN list out of its body,
//! read exactly as strictly as BoringSSL reads them, so the name we route on is the name the
//! TLS stack sees. Pure and total: any input gives a value or an error, never a panic.

/// Largest ClientHello handshake message we accept (its 4-byte header included), as Envoy's
/// tls_inspector does. Real ones are 0.3 to 2 KiB (an X25519MLKEM768 key share is 1.2 KiB).
pub const MAX_CLIENT_HELLO: usize = 16 * 1024;

pub(crate) const EXT_SERVER_NAME: u16 = 0;
pub(crate) const EXT_ALPN: u16 = 16;
pub(crate) const NAME_TYPE_HOST_NAME: u8 = 0;
/// BoringSSL's TLSEXT_MAXLEN_host_name: it refuses longer names, so we do too.
pub(crate) const MAX_HOST_NAME: usize = 255;

/// What the routing decision needs from a ClientHello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The server_name extension's host_name, byte for byte (no DNS validation: the mesh sends
    /// a bare port number such as `"9090"`).
    pub sni: Option<String>,
    /// ALPN protocol names in the client's order; empty when the extension is absent.
    pub alpn: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// The first bytes are not a TLS handshake record (plaintext HTTP, garbage, ...).
    #[error("not a TLS handshake")]
    NotTls,
    /// TLS-shaped but broken, or a shape we refuse (SSLv2 hello, non-handshake record, ...).
    #[error("malformed ClientHello: {0}")]
    Malformed(&'static str),
    /// A record or the ClientHello claims more than the caps allow.
    #[error("ClientHello larger than {MAX_CLIENT_HELLO} bytes")]
    TooLarge,
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
pub(crate) fn parse_body(body: &[u8]) -> Result<ClientHello, HelloError> {
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
