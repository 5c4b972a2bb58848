//! The inbound per-connection cost of reading a ClientHello before BoringSSL does.
//!
//! The hellos are made at start-up by a real BoringSSL client with the mesh's defaults
//! (X25519MLKEM768 key share, SNI "9090", ALPN h2 + http/1.1).

use std::hint::black_box;
use std::io::{Read, Write};

use aether_proxy::inbound::chain::classify_sni;
use aether_proxy::inbound::clienthello::parse;
use boring::ssl::{HandshakeError, SslConnector, SslMethod, SslVerifyMode};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// Keeps what the client writes; never has anything to read, so the client stops after its hello.
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

fn real_hello(sni: Option<&str>) -> Vec<u8> {
    let mut b = SslConnector::builder(SslMethod::tls()).expect("connector");
    b.set_verify(SslVerifyMode::NONE);
    b.set_grease_enabled(true);
    b.set_curves_list("X25519MLKEM768:X25519:P-256")
        .expect("curves");
    b.set_alpn_protos(b"\x02h2\x08http/1.1").expect("alpn");
    let mut cfg = b.build().configure().expect("configure");
    cfg.set_verify_hostname(false);
    cfg.set_use_server_name_indication(sni.is_some());
    match cfg.connect(sni.unwrap_or("unused"), Capture::default()) {
        Err(HandshakeError::WouldBlock(mid)) => mid.get_ref().0.clone(),
        _ => panic!("the client should stop after its hello"),
    }
}

/// The same handshake message carried in two records (split in the middle).
fn two_records(wire: &[u8]) -> Vec<u8> {
    let msg = &wire[5..];
    let (a, b) = msg.split_at(msg.len() / 2);
    let mut out = Vec::with_capacity(msg.len() + 10);
    for part in [a, b] {
        out.extend_from_slice(&[22, 3, 1]);
        out.extend_from_slice(&(part.len() as u16).to_be_bytes());
        out.extend_from_slice(part);
    }
    out
}

fn bench_parse(c: &mut Criterion) {
    let port = real_hello(Some("9090"));
    let none = real_hello(None);
    let split = two_records(&port);
    assert_eq!(
        parse(&port)
            .expect("parses")
            .expect("complete")
            .sni
            .as_deref(),
        Some("9090")
    );
    assert_eq!(
        parse(&split).expect("parses"),
        parse(&port).expect("parses")
    );

    let mut g = c.benchmark_group("clienthello_parse");
    for (name, wire) in [
        ("sni_9090", &port),
        ("no_sni", &none),
        ("two_records", &split),
    ] {
        g.throughput(Throughput::Bytes(wire.len() as u64));
        g.bench_function(format!("{name}_{}B", wire.len()), |b| {
            b.iter(|| parse(black_box(wire)))
        });
    }
    // The early-rejection paths a scanner or plaintext client hits.
    g.throughput(Throughput::Elements(1));
    g.bench_function("not_tls", |b| {
        b.iter(|| parse(black_box(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")))
    });
    g.bench_function("incomplete_half", |b| {
        let half = &port[..port.len() / 2];
        b.iter(|| parse(black_box(half)))
    });
    g.finish();
}

fn bench_classify(c: &mut Criterion) {
    let mut g = c.benchmark_group("classify_sni");
    for sni in [
        Some("9090"),
        Some("p-9090"),
        Some("99999"),
        Some("payments.aether.internal"),
        None,
    ] {
        g.bench_function(sni.unwrap_or("absent"), |b| {
            b.iter(|| classify_sni(black_box(sni)))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_parse, bench_classify);
criterion_main!(benches);
