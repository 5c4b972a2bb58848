//! Authority parsing and routing: any authority against any mesh domain parses to a canonical
//! form or a clear refusal, and routing it through a catalog built from fuzzed routes (checked
//! by the same validation the catalog sources use) never panics and picks only listed subsets.
#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use aether_proxy::catalog::{
    file::parse_routes, Breakers, Catalog, Labels, OnDemand, Outlier, RouteTarget, Service,
};
use aether_proxy::identity::SpiffeId;
use aether_proxy::outbound::route::{choose_subset, decide, lookup, parse_authority, Lookup};
use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

const HEADERS: [&str; 4] = ["x-canary", "x-version", "cookie", "user-agent"];
const LABEL_KEYS: [&str; 3] = ["version", "zone", "track"];
const LABEL_VALUES: [&str; 4] = ["v1", "v2", "canary", ""];

#[derive(Arbitrary, Debug)]
struct Input {
    authority: String,
    /// `None`: the usual `aether.internal`.
    domain: Option<String>,
    /// Whether the catalog holds the authority's service.
    known: bool,
    on_demand: bool,
    default_port: u16,
    ports: Vec<u16>,
    routes: Vec<FuzzRoute>,
    headers: Vec<(u8, String)>,
    roll: u32,
}

#[derive(Arbitrary, Debug)]
struct FuzzRoute {
    header: Option<(u8, String)>,
    subset: Option<Vec<(u8, u8)>>,
    split: Vec<(Vec<(u8, u8)>, u32)>,
}

fuzz_target!(|input: Input| {
    let domain = input.domain.as_deref().unwrap_or("aether.internal");
    let parsed = parse_authority(&input.authority, domain);
    // Case never changes the answer (hosts are case-insensitive, ports are digits).
    let upper = input.authority.to_ascii_uppercase();
    assert_eq!(parse_authority(&upper, domain), parsed);
    let Ok(auth) = parsed else {
        return;
    };
    assert!(!auth.service.is_empty());
    assert!(auth
        .service
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'));
    assert_ne!(auth.port, Some(0));
    // The canonical spelling parses back to the same authority.
    let canonical = match auth.port {
        Some(p) => format!("{}.{domain}:{p}", auth.service),
        None => format!("{}.{domain}", auth.service),
    };
    assert_eq!(parse_authority(&canonical, domain).as_ref(), Ok(&auth));

    let Some(routes) = routes_json(&input.routes) else {
        return;
    };
    let Ok(routes) = parse_routes(routes) else {
        return;
    };
    let default_port = input.default_port.max(1);
    let mut ports: BTreeSet<u16> = input.ports.iter().copied().filter(|p| *p != 0).collect();
    ports.insert(default_port);
    let service = Service {
        name: auth.service.to_string(),
        default_port,
        identity: SpiffeId::parse("spiffe://aether.local/ns/default/sa/fuzz").unwrap(),
        protocols: BTreeMap::new(),
        connect_timeout: std::time::Duration::from_secs(1),
        request_timeout: std::time::Duration::from_secs(1),
        max_requests_per_connection: 0,
        routes,
        outlier: Outlier::default(),
        breakers: Breakers::default(),
        endpoints: Vec::new(),
        loaded: ports.iter().copied().step_by(2).collect(),
        ports,
        ports_complete: !input.on_demand,
        absent_ports: BTreeSet::new(),
        usage: BTreeMap::new(),
    };
    let mut catalog = Catalog {
        on_demand: input.on_demand.then(OnDemand::default),
        ..Catalog::default()
    };
    if input.known {
        catalog
            .services
            .insert(service.name.clone(), Arc::new(service.clone()));
    }
    let looked = lookup(&catalog, &auth, domain);
    match &looked {
        Lookup::Found(t) => {
            assert!(t.service.exposes(t.port) && t.service.loaded.contains(&t.port));
            assert_eq!(t.port, auth.port.unwrap_or(t.service.default_port));
        }
        Lookup::Unknown { cluster, .. } => {
            assert!(input.on_demand || input.known);
            assert!(cluster.starts_with(auth.service.as_ref()));
        }
        Lookup::Refused(_) => {}
    }
    let _ = decide(&catalog, &auth);

    let mut headers = HeaderMap::new();
    for (i, v) in &input.headers {
        if let Ok(v) = HeaderValue::from_str(v) {
            let name = HeaderName::from_static(HEADERS[usize::from(*i) % HEADERS.len()]);
            headers.append(name, v);
        }
    }
    for roll in [input.roll, 0, u32::MAX] {
        if let Some(chosen) = choose_subset(&service, &headers, roll) {
            let listed = service.routes.iter().any(|r| match &r.target {
                RouteTarget::Subset(s) => s == chosen,
                RouteTarget::Split(split) => split.iter().any(|w| &w.subset == chosen),
            });
            assert!(listed, "chose a subset no route lists");
        }
    }
});

fn labels(pairs: &[(u8, u8)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| {
            (
                LABEL_KEYS[usize::from(*k) % LABEL_KEYS.len()].to_string(),
                LABEL_VALUES[usize::from(*v) % LABEL_VALUES.len()].to_string(),
            )
        })
        .collect()
}

/// The routes as the catalog's YAML/JSON shape, so they pass through its validation.
fn routes_json(routes: &[FuzzRoute]) -> Option<serde_json::Value> {
    let mut out = Vec::new();
    for r in routes {
        let mut obj = serde_json::Map::new();
        if let Some((h, v)) = &r.header {
            // Mostly a real header name; sometimes the value's text, which may be invalid.
            let header = if *h < 200 {
                HEADERS[usize::from(*h) % HEADERS.len()].to_string()
            } else {
                v.clone()
            };
            obj.insert(
                "match".into(),
                serde_json::json!({ "header": header, "value": v }),
            );
        }
        if let Some(s) = &r.subset {
            obj.insert("subset".into(), serde_json::to_value(labels(s)).ok()?);
        }
        if !r.split.is_empty() {
            let split: Vec<_> = r
                .split
                .iter()
                .map(|(s, w)| serde_json::json!({ "subset": labels(s), "weight": w }))
                .collect();
            obj.insert("split".into(), split.into());
        }
        out.push(serde_json::Value::Object(obj));
    }
    Some(out.into())
}
