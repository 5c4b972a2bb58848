//! The ClientHello reader: any bytes, read in any split, give the same answer, and a parsed
//! hello is in canonical form (re-encoding it minimally parses back to the same value).
#![no_main]

use aether_proxy::inbound::clienthello::{parse, ClientHello, HelloError, MAX_BUFFERED};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte seeds the split; the rest is the wire.
    let Some((&seed, wire)) = data.split_first() else {
        return;
    };
    let whole = parse(wire);
    assert_eq!(
        split_reads(wire, seed),
        whole,
        "answer depends on the split"
    );
    if let Ok(Some(hello)) = &whole {
        check_hello(hello);
        let again = parse(&encode(hello, seed)).expect("re-encoded hello is refused");
        assert_eq!(
            again.as_ref(),
            Some(hello),
            "re-encoded hello parses differently"
        );
    }
});

/// What `record::read` answers when the bytes arrive in chunks: it parses after every read
/// and stops at the first definite answer; running out of bytes is "incomplete".
fn split_reads(wire: &[u8], seed: u8) -> Result<Option<ClientHello>, HelloError> {
    let mut state = u32::from(seed) | 0x9e37_0000;
    let mut end = 0;
    while end < wire.len() && end < MAX_BUFFERED {
        // Chunks of 1..=64 bytes, mostly small: real fragmentation is byte-level at worst.
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        end = (end + 1 + (state % 64) as usize).min(wire.len());
        if let answer @ (Ok(Some(_)) | Err(_)) = parse(&wire[..end]) {
            return answer;
        }
    }
    parse(wire)
}

fn check_hello(h: &ClientHello) {
    if let Some(sni) = &h.sni {
        assert!((1..=255).contains(&sni.len()), "SNI length {}", sni.len());
        assert!(!sni.contains('\0'), "NUL in SNI");
    }
    assert!(h.alpn.iter().all(|p| (1..=255).contains(&p.len())));
}

/// The smallest TLS 1.2-style record carrying `h`, split into records by `seed`.
fn encode(h: &ClientHello, seed: u8) -> Vec<u8> {
    let mut exts = Vec::new();
    if let Some(sni) = &h.sni {
        let name = sni.as_bytes();
        let mut list = vec![0u8];
        list.extend_from_slice(&u16b(name.len()));
        list.extend_from_slice(name);
        let mut data = u16b(list.len()).to_vec();
        data.extend_from_slice(&list);
        ext(&mut exts, 0, &data);
    }
    if !h.alpn.is_empty() {
        let mut list = Vec::new();
        for p in &h.alpn {
            list.push(p.len() as u8);
            list.extend_from_slice(p);
        }
        let mut data = u16b(list.len()).to_vec();
        data.extend_from_slice(&list);
        ext(&mut exts, 16, &data);
    }
    let mut body = vec![3, 3];
    body.extend_from_slice(&[0u8; 32]);
    body.push(0); // session id
    body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one cipher suite
    body.extend_from_slice(&[1, 0]); // null compression
    body.extend_from_slice(&u16b(exts.len()));
    body.extend_from_slice(&exts);
    let mut msg = vec![1];
    msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    msg.extend_from_slice(&body);
    // Record payloads of `seed`-chosen sizes (at least 64 bytes, so the slack for record
    // headers is never the limit).
    let size = 64 + usize::from(seed) * 64;
    let mut wire = Vec::new();
    for chunk in msg.chunks(size) {
        wire.extend_from_slice(&[22, 3, 1]);
        wire.extend_from_slice(&u16b(chunk.len()));
        wire.extend_from_slice(chunk);
    }
    wire
}

fn ext(out: &mut Vec<u8>, ty: u16, data: &[u8]) {
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&u16b(data.len()));
    out.extend_from_slice(data);
}

fn u16b(n: usize) -> [u8; 2] {
    (n as u16).to_be_bytes()
}
