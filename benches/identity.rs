//! Per-handshake identity work, resumed handshakes included: reading the peer leaf's SPIFFE id
//! (the inbound verify callback, the outbound pin, the inbound peer) and the leaf's hash for
//! x-forwarded-client-cert.

use std::hint::black_box;

use aether_proxy::identity::certgen::{self, Workload};
use aether_proxy::identity::{san, workload::Identity, SpiffeId};
use criterion::{criterion_group, criterion_main, Criterion};

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let w = Workload::parse("default/frontend").unwrap();
    certgen::generate(dir.path(), "aether.local", &[w]).unwrap();
    let p = |f: &str| dir.path().join(f);
    let id = Identity::load(
        &p("frontend.crt"),
        &p("frontend.key"),
        &p("ca.crt"),
        "aether.local",
    )
    .unwrap();
    let der = id.chain[0].to_der().unwrap();
    let expected = SpiffeId::parse("spiffe://aether.local/ns/default/sa/frontend").unwrap();
    assert!(san::is_pinned(&der, &expected));

    // Reading the certificate, as the first connection with a leaf does.
    c.bench_function("leaf SPIFFE id, read", |b| {
        b.iter(|| san::leaf_id(black_box(&der)).unwrap())
    });
    // Every later connection: the digest (XFCC's hash) and the remembered identity.
    c.bench_function("leaf hash and SPIFFE id, remembered", |b| {
        b.iter(|| san::read_leaf(black_box(&der)).1.unwrap())
    });
    c.bench_function("outbound pin", |b| {
        b.iter(|| san::is_pinned(black_box(&der), &expected))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
