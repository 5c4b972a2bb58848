//! The catalog file: any text gives a validated catalog or field errors naming the file; a
//! catalog that validates keeps the model's promises, and every service in it routes without
//! a panic (authorities, ports, header matches and weighted splits).
#![no_main]

use std::collections::BTreeSet;
use std::path::Path;

use aether_proxy::catalog::{Catalog, RouteTarget};
use aether_proxy::outbound::route::{choose_subset, decide, parse_authority};
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const DOMAIN: &str = "aether.internal";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = Path::new("fuzz-catalog.yaml");
    let catalog = match Catalog::parse(file, text, "aether.local") {
        Ok(c) => c,
        Err(errs) => {
            assert!(!errs.0.is_empty(), "refused without a reason");
            assert!(errs.to_string().contains("fuzz-catalog.yaml"));
            return;
        }
    };
    for (name, svc) in &catalog.services {
        assert_eq!(name, &svc.name);
        assert!(
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        );
        assert_ne!(svc.default_port, 0);
        let mut union = BTreeSet::new();
        for e in &svc.endpoints {
            assert!(!e.ports.is_empty() && e.weight >= 1 && e.address.port() != 0);
            union.extend(e.ports.iter().copied());
        }
        assert_eq!(union, svc.ports);
        for r in &svc.routes {
            if let RouteTarget::Split(split) = &r.target {
                assert!(
                    split.iter().any(|w| w.weight > 0),
                    "a split that adds up to 0"
                );
            }
        }
        // Route to the default port, every listed port and one that is not listed.
        let mut try_ports: Vec<Option<u16>> = vec![None, Some(1), Some(65535)];
        try_ports.extend(svc.ports.iter().map(|p| Some(*p)));
        for port in try_ports {
            let raw = match port {
                Some(p) => format!("{name}.{DOMAIN}:{p}"),
                None => format!("{name}.{DOMAIN}"),
            };
            let auth = parse_authority(&raw, DOMAIN).expect("a catalog name is mesh-shaped");
            let want = port.unwrap_or(svc.default_port);
            match decide(&catalog, &auth) {
                Ok(t) => assert!(t.port == want && svc.ports.contains(&want)),
                Err(_) => assert!(!svc.ports.contains(&want)),
            }
        }
        // Each route's own header match, then no headers, across the roll's range.
        let mut headers = vec![HeaderMap::new()];
        for r in &svc.routes {
            if let Some(m) = &r.matches {
                if let Ok(v) = HeaderValue::from_str(&m.value) {
                    let mut h = HeaderMap::new();
                    h.insert(m.header.clone(), v);
                    headers.push(h);
                }
            }
        }
        for h in &headers {
            for roll in [0, 1, 99, u32::MAX / 2, u32::MAX] {
                let _ = choose_subset(svc, h, roll);
            }
        }
    }
});
