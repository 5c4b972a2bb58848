//! Authority parsing and the route decision: the per-request work before any I/O.

use std::path::Path;

use aether_proxy::catalog::Catalog;
use aether_proxy::outbound::route::{choose_subset, decide, parse_authority};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

const CATALOG: &str = r#"
services:
  payments:
    default_port: 8080
    identity: spiffe://aether.local/ns/default/sa/payments
    routes:
      - match: { header: x-canary, value: "1" }
        subset: { version: v2 }
      - split:
          - { subset: { version: v1 }, weight: 90 }
          - { subset: { version: v2 }, weight: 10 }
    endpoints:
      - { address: 10.0.0.5, ports: [8080, 9090], labels: { version: v1 } }
      - { address: 10.0.0.6, ports: [8080, 9090], labels: { version: v2 } }
"#;

fn bench(c: &mut Criterion) {
    let mut catalog_yaml = CATALOG.to_string();
    // A realistic catalog size: the lookup is a map probe among 500 services.
    for i in 0..500 {
        catalog_yaml.push_str(&format!(
            "  svc-{i}:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/svc-{i}\n    endpoints: [{{ address: 10.1.{}.{} }}]\n",
            i / 250,
            i % 250 + 1
        ));
    }
    let catalog = Catalog::parse(Path::new("bench.yaml"), &catalog_yaml, "aether.local").unwrap();
    let d = "aether.internal";
    let mut g = c.benchmark_group("authority");
    for raw in [
        "payments.aether.internal",
        "payments.aether.internal:9090",
        "PAYMENTS.aether.internal:9090",
        "evil.com:9090",
    ] {
        g.bench_function(raw, |b| b.iter(|| parse_authority(black_box(raw), d)));
    }
    g.finish();
    let mut g = c.benchmark_group("route");
    g.bench_function("parse+decide payments:9090", |b| {
        b.iter(|| {
            let a = parse_authority(black_box("payments.aether.internal:9090"), d).unwrap();
            decide(&catalog, &a).map(|t| t.port).unwrap()
        })
    });
    let svc = &catalog.services["payments"];
    let mut headers = http::HeaderMap::new();
    headers.insert("x-canary", "1".parse().unwrap());
    g.bench_function("subset by header", |b| {
        b.iter(|| choose_subset(svc, black_box(&headers), 7).is_some())
    });
    let empty = http::HeaderMap::new();
    g.bench_function("subset by split", |b| {
        b.iter(|| choose_subset(svc, black_box(&empty), 93).is_some())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
