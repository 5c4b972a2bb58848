//! The ClientHello reader against real BoringSSL hellos and hand-made broken ones.

use super::hello::*;
use super::record::*;
use crate::inbound::chain::{classify_sni, SniKind};
use boring::ssl::{HandshakeError, SslConnector, SslConnectorBuilder, SslMethod, SslVerifyMode};
use bytes::BytesMut;
use std::io::{Read, Write};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::AsyncRead;
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

/// Hands out as much as each read has room for, counting the reads: a socket with the whole
/// hello already queued.
struct Queued {
    data: Vec<u8>,
    pos: usize,
    reads: usize,
}

impl AsyncRead for Queued {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = buf.remaining().min(self.data.len() - self.pos);
        let start = self.pos;
        buf.put_slice(&self.data[start..start + n]);
        self.pos += n;
        self.reads += 1;
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn a_post_quantum_hello_takes_one_read_whatever_the_callers_buffer() {
    // The mesh's key share and a few more ALPN names: past 2 KiB, as a real mesh client's hello
    // with its session ticket is.
    let names: Vec<Vec<u8>> = (0..8)
        .map(|i| format!("proto-{i}-{}", "x".repeat(90)).into_bytes())
        .collect();
    let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    let wire = real_hello_with(Some("9090"), &refs, |b| {
        b.set_curves_list("X25519MLKEM768:X25519:P-256").unwrap();
    });
    assert!(wire.len() > 2048, "hello of {} bytes", wire.len());
    for mut buf in [BytesMut::new(), BytesMut::with_capacity(2048)] {
        let mut io = Queued {
            data: wire.clone(),
            pos: 0,
            reads: 0,
        };
        let got = read(&mut io, &mut buf, T).await.unwrap();
        assert_eq!(got.alpn, names);
        assert_eq!(io.reads, 1, "reads for a {}-byte hello", wire.len());
    }
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
    assert!(matches!(&err, ReadError::Io(e) if e.kind() == std::io::ErrorKind::ConnectionReset));
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
