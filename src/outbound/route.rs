//! Where an outbound request's authority becomes a route: authority parsing (SPEC "Addressing")
//! and the choice of a subset from the service's `routes`.

use http::HeaderMap;

use crate::catalog::{Catalog, Labels, PortProtocol, Route, RouteTarget, Service};
use crate::http::answer::Reason;

/// A mesh authority: `<service>.<mesh_domain>[:<port>]`, host lower-cased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshAuthority<'a> {
    pub service: std::borrow::Cow<'a, str>,
    pub port: Option<u16>,
}

/// Parses an authority against the mesh domain. Errors: `NoRoute` for anything that is not
/// mesh-shaped (answered without touching the catalog), `BadAuthority` for a missing or
/// malformed authority or a port outside 1..65535.
pub fn parse_authority<'a>(raw: &'a str, mesh_domain: &str) -> Result<MeshAuthority<'a>, Reason> {
    if raw.is_empty() {
        return Err(Reason::BadAuthority);
    }
    // Userinfo, paths, whitespace and control bytes have no place in an authority.
    if raw
        .bytes()
        .any(|b| b <= b' ' || b == 0x7f || matches!(b, b'@' | b'/' | b'?' | b'#' | b'\\'))
    {
        return Err(Reason::BadAuthority);
    }
    // IPv6 literals are never mesh-shaped.
    if raw.starts_with('[') {
        return Err(Reason::NoRoute);
    }
    let (host, port) = match raw.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (raw, None),
    };
    if host.is_empty() || host.contains(':') {
        return Err(Reason::BadAuthority);
    }
    let service = match mesh_service(host, mesh_domain) {
        Some(s) => s,
        None => return Err(Reason::NoRoute),
    };
    let port = match port {
        None => None,
        Some(p) => Some(parse_port(p).ok_or(Reason::BadAuthority)?),
    };
    Ok(MeshAuthority { service, port })
}

/// `1..=65535`, digits only.
fn parse_port(p: &str) -> Option<u16> {
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match p.parse::<u32>() {
        Ok(n) if (1..=65535).contains(&n) => Some(n as u16),
        _ => None,
    }
}

/// The service name when `host` (any case) is `[a-z0-9-]+.<mesh_domain>`.
fn mesh_service<'a>(host: &'a str, mesh_domain: &str) -> Option<std::borrow::Cow<'a, str>> {
    let n = host.len().checked_sub(mesh_domain.len() + 1)?;
    if n == 0 || host.as_bytes()[n] != b'.' || !host[n + 1..].eq_ignore_ascii_case(mesh_domain) {
        return None;
    }
    let name = &host[..n];
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return None;
    }
    // Borrow in the common (already lower-case) case.
    if name.bytes().any(|b| b.is_ascii_uppercase()) {
        Some(std::borrow::Cow::Owned(name.to_ascii_lowercase()))
    } else {
        Some(std::borrow::Cow::Borrowed(name))
    }
}

/// What the catalog says about an authority, before any endpoint is chosen.
#[derive(Debug, Clone, Copy)]
pub struct Target<'c> {
    pub service: &'c Service,
    pub port: u16,
    pub protocol: PortProtocol,
}

/// What a catalog says about an authority.
#[derive(Debug)]
pub enum Lookup<'c> {
    Found(Target<'c>),
    Refused(Reason),
    /// The catalog discovers on demand and does not know yet: the cluster name to ask for, and
    /// the answer if it never comes.
    Unknown {
        cluster: String,
        absent: Reason,
    },
}

/// The addressing table of SPEC section 1 against `catalog`.
pub fn lookup<'c>(catalog: &'c Catalog, auth: &MeshAuthority<'_>, mesh_domain: &str) -> Lookup<'c> {
    let Some(service) = catalog.services.get(auth.service.as_ref()) else {
        return match &catalog.on_demand {
            Some(od) if !od.absent.contains(auth.service.as_ref()) => Lookup::Unknown {
                cluster: format!("{}.{mesh_domain}", auth.service),
                absent: Reason::UnknownService,
            },
            _ => Lookup::Refused(Reason::UnknownService),
        };
    };
    let port = auth.port.unwrap_or(service.default_port);
    if !service.exposes(port) {
        if service.ports_complete || service.absent_ports.contains(&port) {
            return Lookup::Refused(Reason::PortNotExposed);
        }
        return Lookup::Unknown {
            cluster: cluster_name(&service.name, mesh_domain, port, service.default_port),
            absent: Reason::PortNotExposed,
        };
    }
    if !service.loaded.contains(&port) {
        return Lookup::Unknown {
            cluster: cluster_name(&service.name, mesh_domain, port, service.default_port),
            absent: Reason::NoEndpoints,
        };
    }
    Lookup::Found(Target {
        service,
        port,
        protocol: service.port_protocol(port),
    })
}

/// The route decision of SPEC's addressing table against a complete catalog (the file).
#[cfg(any(test, feature = "testing"))] // unit tests, the routing bench and two fuzz targets
pub fn decide<'c>(catalog: &'c Catalog, auth: &MeshAuthority<'_>) -> Result<Target<'c>, Reason> {
    match lookup(catalog, auth, "") {
        Lookup::Found(t) => Ok(t),
        Lookup::Refused(r) | Lookup::Unknown { absent: r, .. } => Err(r),
    }
}

/// The canonical cluster name: the default port's cluster has no port in its name.
pub fn cluster_name(service: &str, mesh_domain: &str, port: u16, default_port: u16) -> String {
    if port == default_port {
        format!("{service}.{mesh_domain}")
    } else {
        format!("{service}.{mesh_domain}:{port}")
    }
}

/// The first of the service's `routes` that takes a request with these headers, and its
/// index: its header matches (or it has no match) and, for a split, its weights add up to more
/// than zero. `None`: every endpoint of the port.
pub fn route_for<'s>(service: &'s Service, headers: &HeaderMap) -> Option<(usize, &'s Route)> {
    service.routes.iter().enumerate().find(|(_, route)| {
        if let Some(m) = &route.matches {
            let hit = headers
                .get_all(&m.header)
                .iter()
                .any(|v| v.as_bytes() == m.value.as_bytes());
            if !hit {
                return false;
            }
        }
        match &route.target {
            RouteTarget::Subset(_) => true,
            RouteTarget::Split(split) => split.iter().any(|w| w.weight > 0),
        }
    })
}

/// The subset a request is routed to by the service's `routes` (first match wins); `None`
/// means every endpoint of the port. `roll` is a uniform random number for weighted splits.
pub fn choose_subset<'s>(
    service: &'s Service,
    headers: &HeaderMap,
    roll: u32,
) -> Option<&'s Labels> {
    let split = match &route_for(service, headers)?.1.target {
        RouteTarget::Subset(subset) => return Some(subset),
        RouteTarget::Split(split) => split,
    };
    // Validation keeps the sum within u32; summing in u64 keeps this total regardless.
    let total: u64 = split.iter().map(|w| u64::from(w.weight)).sum();
    let mut pick = u64::from(roll) % total;
    for w in split {
        if pick < u64::from(w.weight) {
            return Some(&w.subset);
        }
        pick -= u64::from(w.weight);
    }
    None
}

/// True when an endpoint's labels include every label of the subset.
pub fn labels_match(endpoint: &Labels, subset: &Labels) -> bool {
    subset.iter().all(|(k, v)| endpoint.get(k) == Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const D: &str = "aether.internal";

    fn ok(raw: &str) -> (String, Option<u16>) {
        let a = parse_authority(raw, D).unwrap();
        (a.service.into_owned(), a.port)
    }

    #[test]
    fn mesh_shaped_authorities() {
        assert_eq!(ok("payments.aether.internal"), ("payments".into(), None));
        assert_eq!(
            ok("payments.aether.internal:8080"),
            ("payments".into(), Some(8080))
        );
        assert_eq!(
            ok("PayMents.Aether.Internal:9090"),
            ("payments".into(), Some(9090))
        );
        assert_eq!(ok("a-1.aether.internal:1"), ("a-1".into(), Some(1)));
        assert_eq!(ok("a.aether.internal:65535"), ("a".into(), Some(65535)));
    }

    #[test]
    fn not_mesh_shaped_is_no_route() {
        for raw in [
            "evil.com",
            "evil.com:9090",
            "aether.internal",
            ".aether.internal",
            "a.b.aether.internal",
            "payments.aether.internal.",
            "payments_x.aether.internal",
            "payments.aether.internalx",
            "xpayments.aether.internal.evil.com",
            "[::1]:8080",
            "127.0.0.1:8080",
        ] {
            assert_eq!(parse_authority(raw, D), Err(Reason::NoRoute), "{raw}");
        }
    }

    #[test]
    fn malformed_or_bad_port_is_bad_authority() {
        for raw in [
            "",
            "payments.aether.internal:0",
            "payments.aether.internal:65536",
            "payments.aether.internal:99999999",
            "payments.aether.internal:",
            "payments.aether.internal:80a",
            "payments.aether.internal:+80",
            "user@payments.aether.internal",
            "payments.aether.internal/x",
            "pay ments.aether.internal",
            ":8080",
            "a:b:c",
        ] {
            assert_eq!(parse_authority(raw, D), Err(Reason::BadAuthority), "{raw}");
        }
    }

    fn catalog() -> Catalog {
        let yaml = r#"
services:
  payments:
    default_port: 8080
    identity: spiffe://aether.local/ns/default/sa/payments
    protocols: { 5432: tcp }
    routes:
      - match: { header: x-canary, value: "1" }
        subset: { version: v2 }
      - split:
          - { subset: { version: v1 }, weight: 90 }
          - { subset: { version: v2 }, weight: 10 }
    endpoints:
      - { address: 10.0.0.5, ports: [8080, 9090, 5432], labels: { version: v1 } }
      - { address: 10.0.0.6, labels: { version: v2 }, draining: true }
"#;
        Catalog::parse(Path::new("c.yaml"), yaml, "aether.local").unwrap()
    }

    #[test]
    fn the_addressing_table() {
        let c = catalog();
        let d = |raw: &str| {
            parse_authority(raw, D).and_then(|a| decide(&c, &a).map(|t| (t.port, t.protocol)))
        };
        assert_eq!(
            d("payments.aether.internal"),
            Ok((8080, PortProtocol::Http))
        );
        assert_eq!(
            d("payments.aether.internal:8080"),
            Ok((8080, PortProtocol::Http))
        );
        assert_eq!(
            d("payments.aether.internal:9090"),
            Ok((9090, PortProtocol::Http))
        );
        assert_eq!(
            d("payments.aether.internal:5432"),
            Ok((5432, PortProtocol::Tcp))
        );
        assert_eq!(
            d("payments.aether.internal:7777"),
            Err(Reason::PortNotExposed)
        );
        assert_eq!(d("ghost.aether.internal"), Err(Reason::UnknownService));
        assert_eq!(d("ghost.aether.internal:9090"), Err(Reason::UnknownService));
        assert_eq!(d("evil.com:9090"), Err(Reason::NoRoute));
        assert_eq!(
            d("payments.aether.internal:70000"),
            Err(Reason::BadAuthority)
        );
    }

    #[test]
    fn default_port_spellings_share_one_cluster_name() {
        assert_eq!(
            cluster_name("payments", D, 8080, 8080),
            "payments.aether.internal"
        );
        assert_eq!(
            cluster_name("payments", D, 9090, 8080),
            "payments.aether.internal:9090"
        );
    }

    #[test]
    fn split_weights_cannot_overflow() {
        // Found by the authority_route fuzz target: two weights whose sum overflows a u32.
        let routes = serde_json::json!([{ "split": [
            { "subset": { "version": "v1" }, "weight": u32::MAX },
            { "subset": { "version": "v2" }, "weight": 1 }
        ] }]);
        let (field, reason) = crate::catalog::file::parse_routes(routes).unwrap_err();
        assert_eq!(field, "[0].split");
        assert_eq!(reason, format!("weights add up to more than {}", u32::MAX));

        // A model that holds such weights anyway routes without a panic.
        let mut svc = (*catalog().services["payments"]).clone();
        svc.routes = vec![crate::catalog::Route {
            matches: None,
            target: RouteTarget::Split(vec![
                crate::catalog::model::WeightedSubset {
                    subset: Labels::from([("version".into(), "v1".into())]),
                    weight: u32::MAX,
                },
                crate::catalog::model::WeightedSubset {
                    subset: Labels::from([("version".into(), "v2".into())]),
                    weight: u32::MAX,
                },
            ]),
        }];
        let pick = |roll| choose_subset(&svc, &HeaderMap::new(), roll).unwrap()["version"].clone();
        assert_eq!(pick(0), "v1");
        assert_eq!(pick(u32::MAX - 1), "v1");
        assert_eq!(pick(u32::MAX), "v2");
    }

    #[test]
    fn subsets_by_header_then_split() {
        let c = catalog();
        let svc = &c.services["payments"];
        let mut h = HeaderMap::new();
        h.insert("x-canary", "1".parse().unwrap());
        assert_eq!(choose_subset(svc, &h, 0).unwrap()["version"], "v2");
        let h = HeaderMap::new();
        assert_eq!(choose_subset(svc, &h, 0).unwrap()["version"], "v1");
        assert_eq!(choose_subset(svc, &h, 89).unwrap()["version"], "v1");
        assert_eq!(choose_subset(svc, &h, 90).unwrap()["version"], "v2");
        assert_eq!(choose_subset(svc, &h, 99).unwrap()["version"], "v2");
    }
}
