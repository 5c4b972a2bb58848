//! One DNS answer for a mesh name, as the listener makes it: parse the query, read the
//! catalog snapshot, build and serialize the answer (SPEC 10's budget: under 20 µs of CPU).

use std::hint::black_box;
use std::path::Path;

use aether_proxy::catalog::{Catalog, CatalogStore};
use aether_proxy::dns::answer::{Answerer, Step};
use criterion::{criterion_group, criterion_main, Criterion};
use hickory_proto::op::{Edns, Message, Query};
use hickory_proto::rr::{Name, RecordType};

fn query(name: &str, t: RecordType, edns: bool) -> Vec<u8> {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), t));
    if edns {
        let mut e = Edns::new();
        e.set_max_payload(1232);
        m.set_edns(e);
    }
    m.to_vec().unwrap()
}

fn bench(c: &mut Criterion) {
    // A realistic catalog size: 500 services besides `payments`.
    let mut yaml = String::from(
        "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    endpoints: [{ address: 10.0.0.5 }]\n",
    );
    for i in 0..500 {
        yaml.push_str(&format!(
            "  svc-{i}:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/svc-{i}\n    endpoints: [{{ address: 10.1.{}.{} }}]\n",
            i / 250,
            i % 250 + 1
        ));
    }
    let store =
        CatalogStore::new(Catalog::parse(Path::new("bench.yaml"), &yaml, "aether.local").unwrap());
    let answerer = Answerer::new("aether.internal", true);
    let mut g = c.benchmark_group("dns answer");
    for (what, bytes) in [
        (
            "A payments",
            query("payments.aether.internal", RecordType::A, false),
        ),
        (
            "A payments, EDNS",
            query("payments.aether.internal", RecordType::A, true),
        ),
        (
            "AAAA PAYMENTS.",
            query("PAYMENTS.aether.internal.", RecordType::AAAA, false),
        ),
        (
            "NXDOMAIN ghost",
            query("ghost.aether.internal", RecordType::A, false),
        ),
        (
            "outside (forward decision)",
            query("example.com", RecordType::A, false),
        ),
    ] {
        g.bench_function(what, |b| {
            b.iter(|| match answerer.handle(black_box(&bytes), &store.load()) {
                Step::Reply(out, _) => out.len(),
                Step::Forward { max_udp, .. } => max_udp as usize,
                _ => 0,
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
