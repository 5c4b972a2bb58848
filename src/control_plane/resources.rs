//! A validated catalog as the Envoy v3 resources a mesh client reads (docs/reference.md, "What
//! the proxy takes from a control plane"): per service one Cluster for the default port and one
//! per other port, each with its own ClusterLoadAssignment. What the file says is carried so
//! that the proxy's xDS client (`crate::xds::resources`) reads back the same services.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers::Thresholds, cluster, CircuitBreakers, Cluster, OutlierDetection,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, transport_socket, Address, AggregatedConfigSource,
    ApiVersion, ConfigSource, HealthStatus, HttpProtocolOptions as CommonHttpOptions, Locality,
    Metadata, SocketAddress, TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint as EnvoyEndpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, subject_alt_name_matcher::SanType, CertificateValidationContext,
    CommonTlsContext, SdsSecretConfig, SubjectAltNameMatcher, UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options, HttpProtocolOptions,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
use envoy_types::pb::google::protobuf::{
    value, Any, Duration as PbDuration, ListValue, Struct, UInt32Value, Value,
};
use prost::{Message, Name};

use crate::catalog::{Catalog, Endpoint, PortProtocol, Route, RouteTarget, Service};
use crate::xds::resources::{CLUSTER_TYPE, ENDPOINT_TYPE};

/// The secrets the clusters' TLS contexts name. They are the client's own (its bootstrap's
/// static secrets for Envoy); aether-proxy ignores them and presents its workload identity.
pub const CERT_SECRET: &str = "default";
pub const CA_SECRET: &str = "ROOTCA";
const HTTP_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";
const TLS_SOCKET: &str = "envoy.transport_sockets.tls";

/// The two resource types served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Cluster,
    Endpoint,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Cluster, Kind::Endpoint];

    pub fn type_url(self) -> &'static str {
        match self {
            Kind::Cluster => CLUSTER_TYPE,
            Kind::Endpoint => ENDPOINT_TYPE,
        }
    }

    pub fn of(type_url: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.type_url() == type_url)
    }
}

/// One resource as served.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    /// A hash of what the resource is made from: stable across restarts of this server, so a
    /// reconnecting client that names it in `initial_resource_versions` is not sent it again.
    pub version: String,
    pub body: Any,
    /// For a Cluster, the assignment it reads its endpoints from.
    pub eds_name: Option<String>,
}

/// Every resource of one catalog, by type and name.
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// Counts the catalogs served since start (`system_version_info`).
    pub generation: u64,
    pub clusters: BTreeMap<String, Resource>,
    pub assignments: BTreeMap<String, Resource>,
}

impl Snapshot {
    pub fn of(&self, kind: Kind) -> &BTreeMap<String, Resource> {
        match kind {
            Kind::Cluster => &self.clusters,
            Kind::Endpoint => &self.assignments,
        }
    }

    /// The resources of `catalog`. A resource whose version is the same as in `previous` keeps
    /// the bytes it had: protobuf maps encode in no fixed order, and a client compares bytes.
    pub fn build(
        catalog: &Catalog,
        mesh_domain: &str,
        generation: u64,
        previous: Option<&Snapshot>,
    ) -> Snapshot {
        let mut snap = Snapshot {
            generation,
            ..Default::default()
        };
        for svc in catalog.services.values() {
            let mut ports = svc.ports.clone();
            // The default cluster always exists: it is where a client learns the service.
            ports.insert(svc.default_port);
            for port in ports {
                let name = crate::outbound::route::cluster_name(
                    &svc.name,
                    mesh_domain,
                    port,
                    svc.default_port,
                );
                let eds = eds_name(&svc.name, mesh_domain, port);
                let c = ClusterSpec {
                    name: &name,
                    eds: &eds,
                    svc,
                    port,
                };
                let version = version_of(&c.canonical());
                let body = reuse(previous, Kind::Cluster, &name, &version)
                    .unwrap_or_else(|| pack(&cluster(&c)));
                snap.clusters.insert(
                    name.clone(),
                    Resource {
                        version,
                        body,
                        eds_name: Some(eds.clone()),
                    },
                );
                let endpoints: Vec<&Endpoint> = svc
                    .endpoints
                    .iter()
                    .filter(|e| e.ports.contains(&port))
                    .collect();
                // What the assignment carries of each endpoint (not its other ports).
                let carried: Vec<_> = endpoints
                    .iter()
                    .map(|e| (e.address, &e.locality, &e.labels, e.draining, e.weight))
                    .collect();
                let version = version_of(&format!("{eds}|{carried:?}"));
                let body = reuse(previous, Kind::Endpoint, &eds, &version)
                    .unwrap_or_else(|| pack(&assignment(&eds, &endpoints)));
                snap.assignments.insert(
                    eds,
                    Resource {
                        version,
                        body,
                        eds_name: None,
                    },
                );
            }
        }
        snap
    }
}

fn reuse(previous: Option<&Snapshot>, kind: Kind, name: &str, version: &str) -> Option<Any> {
    let old = previous?.of(kind).get(name)?;
    (old.version == version).then(|| old.body.clone())
}

/// The assignment name of a service port, Istio's spelling: deliberately not the cluster's
/// name, so clients follow `eds_cluster_config.service_name`.
pub fn eds_name(service: &str, mesh_domain: &str, port: u16) -> String {
    format!("outbound|{port}||{service}.{mesh_domain}")
}

/// FNV-1a, 64 bits: fixed, unlike std's hasher, whatever binary computes it.
fn version_of(canonical: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in canonical.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// What one Cluster is made from.
struct ClusterSpec<'a> {
    name: &'a str,
    eds: &'a str,
    svc: &'a Service,
    port: u16,
}

impl ClusterSpec<'_> {
    fn is_default(&self) -> bool {
        self.port == self.svc.default_port
    }

    /// Every input of the Cluster, in a fixed rendering (for its version).
    fn canonical(&self) -> String {
        let s = self.svc;
        let ports = self.is_default().then_some(&s.ports);
        format!(
            "{}|{}|{}|{}|{:?}|{:?}|{:?}|{}|{:?}|{:?}|{:?}|{:?}",
            self.name,
            self.eds,
            self.port,
            s.identity,
            s.port_protocol(self.port),
            s.connect_timeout,
            s.request_timeout,
            s.max_requests_per_connection,
            s.routes,
            s.outlier,
            s.breakers,
            ports,
        )
    }
}

fn pack<M: Message + Name>(m: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: m.encode_to_vec(),
    }
}

fn duration(d: Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

fn u32v(value: u32) -> Option<UInt32Value> {
    Some(UInt32Value { value })
}

fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        ..Default::default()
    }
}

fn cluster(c: &ClusterSpec) -> Cluster {
    let s = c.svc;
    let mut meta = vec![
        (
            "protocol",
            string(match s.port_protocol(c.port) {
                PortProtocol::Http => "http",
                PortProtocol::Tcp => "tcp",
            }),
        ),
        (
            "request_timeout",
            string(&humantime::format_duration(s.request_timeout).to_string()),
        ),
    ];
    if !s.routes.is_empty() {
        meta.push(("routes", routes(&s.routes)));
    }
    if c.is_default() {
        // The file lists every port a service has: a client need not ask about any other.
        let ports = s.ports.iter().map(|p| number(f64::from(*p))).collect();
        meta.push(("ports", list(ports)));
    }
    let metadata = Metadata {
        filter_metadata: HashMap::from([(
            "aether.io".to_string(),
            Struct {
                fields: meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            },
        )]),
        ..Default::default()
    };
    let http = HttpProtocolOptions {
        common_http_protocol_options: (s.max_requests_per_connection > 0).then(|| {
            CommonHttpOptions {
                max_requests_per_connection: u32v(s.max_requests_per_connection),
                ..Default::default()
            }
        }),
        // Envoy requires a choice; the client's protocol is what the mesh carries.
        upstream_protocol_options: Some(
            http_protocol_options::UpstreamProtocolOptions::UseDownstreamProtocolConfig(
                Default::default(),
            ),
        ),
        ..Default::default()
    };
    Cluster {
        name: c.name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: c.eds.to_string(),
        }),
        connect_timeout: Some(duration(s.connect_timeout)),
        transport_socket: Some(TransportSocket {
            name: TLS_SOCKET.into(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(pack(
                &upstream_tls(c.port, s.identity.as_str()),
            ))),
        }),
        outlier_detection: Some(OutlierDetection {
            consecutive_5xx: u32v(s.outlier.consecutive),
            base_ejection_time: Some(duration(s.outlier.base_ejection)),
            max_ejection_percent: u32v(s.outlier.max_percent),
            ..Default::default()
        }),
        circuit_breakers: Some(CircuitBreakers {
            thresholds: vec![Thresholds {
                max_connections: u32v(s.breakers.max_connections),
                max_requests: u32v(s.breakers.max_requests),
                ..Default::default()
            }],
            ..Default::default()
        }),
        typed_extension_protocol_options: HashMap::from([(HTTP_OPTIONS.to_string(), pack(&http))]),
        metadata: Some(metadata),
        ..Default::default()
    }
}

/// SNI = the port; the peer pinned by an exact URI SAN matcher. The certificate and the trust
/// bundle are named, not sent: every client has its own.
fn upstream_tls(port: u16, identity: &str) -> UpstreamTlsContext {
    let secret = |name: &str| SdsSecretConfig {
        name: name.into(),
        sds_config: None,
    };
    UpstreamTlsContext {
        sni: port.to_string(),
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![secret(CERT_SECRET)],
            validation_context_type: Some(
                common_tls_context::ValidationContextType::CombinedValidationContext(
                    common_tls_context::CombinedCertificateValidationContext {
                        default_validation_context: Some(CertificateValidationContext {
                            match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
                                san_type: SanType::Uri as i32,
                                matcher: Some(StringMatcher {
                                    match_pattern: Some(string_matcher::MatchPattern::Exact(
                                        identity.into(),
                                    )),
                                    ignore_case: false,
                                }),
                                oid: String::new(),
                            }],
                            ..Default::default()
                        }),
                        validation_context_sds_secret_config: Some(secret(CA_SECRET)),
                        ..Default::default()
                    },
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The endpoints of one port, grouped by locality in the order the file first names each.
fn assignment(eds: &str, endpoints: &[&Endpoint]) -> ClusterLoadAssignment {
    let mut groups: Vec<LocalityLbEndpoints> = Vec::new();
    for e in endpoints {
        let locality = e.locality.as_ref().map(|l| Locality {
            region: l.region.clone(),
            zone: l.zone.clone(),
            sub_zone: l.subzone.clone(),
        });
        let at = match groups.iter().position(|g| g.locality == locality) {
            Some(i) => i,
            None => {
                groups.push(LocalityLbEndpoints {
                    locality,
                    ..Default::default()
                });
                groups.len() - 1
            }
        };
        groups[at].lb_endpoints.push(lb_endpoint(e));
    }
    ClusterLoadAssignment {
        cluster_name: eds.to_string(),
        endpoints: groups,
        ..Default::default()
    }
}

fn lb_endpoint(e: &Endpoint) -> LbEndpoint {
    LbEndpoint {
        health_status: if e.draining {
            HealthStatus::Draining as i32
        } else {
            HealthStatus::Healthy as i32
        },
        metadata: (!e.labels.is_empty()).then(|| Metadata {
            filter_metadata: HashMap::from([("envoy.lb".to_string(), labels(&e.labels))]),
            ..Default::default()
        }),
        load_balancing_weight: u32v(e.weight),
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(EnvoyEndpoint {
            address: Some(Address {
                address: Some(address::Address::SocketAddress(SocketAddress {
                    address: e.address.ip().to_string(),
                    port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                        e.address.port(),
                    ))),
                    ..Default::default()
                })),
            }),
            ..Default::default()
        })),
    }
}

fn labels(l: &crate::catalog::Labels) -> Struct {
    Struct {
        fields: l.iter().map(|(k, v)| (k.clone(), string(v))).collect(),
    }
}

/// A service's routes in the catalog file's shape (`match`, `subset` or `split`).
fn routes(routes: &[Route]) -> Value {
    let one = |r: &Route| {
        let mut fields = HashMap::new();
        if let Some(m) = &r.matches {
            let mut mf = HashMap::new();
            mf.insert("header".to_string(), string(m.header.as_str()));
            mf.insert("value".to_string(), string(&m.value));
            fields.insert("match".to_string(), object(mf));
        }
        match &r.target {
            RouteTarget::Subset(s) => {
                fields.insert("subset".to_string(), struct_value(labels(s)));
            }
            RouteTarget::Split(ws) => {
                let split = ws
                    .iter()
                    .map(|w| {
                        object(HashMap::from([
                            ("subset".to_string(), struct_value(labels(&w.subset))),
                            ("weight".to_string(), number(f64::from(w.weight))),
                        ]))
                    })
                    .collect();
                fields.insert("split".to_string(), list(split));
            }
        }
        object(fields)
    };
    list(routes.iter().map(one).collect())
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(value::Kind::StringValue(s.into())),
    }
}

fn number(n: f64) -> Value {
    Value {
        kind: Some(value::Kind::NumberValue(n)),
    }
}

fn list(values: Vec<Value>) -> Value {
    Value {
        kind: Some(value::Kind::ListValue(ListValue { values })),
    }
}

fn struct_value(s: Struct) -> Value {
    Value {
        kind: Some(value::Kind::StructValue(s)),
    }
}

fn object(fields: HashMap<String, Value>) -> Value {
    struct_value(Struct { fields })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::path::Path;

    use crate::xds::resources::{assignment as read_assignment, cluster as read_cluster};

    const TD: &str = "aether.local";
    const MESH: &str = "aether.internal";

    fn catalog(yaml: &str) -> Catalog {
        Catalog::parse(Path::new("cat.yaml"), yaml, TD).unwrap()
    }

    const FULL: &str = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n\
        \x20   protocols: { 5432: tcp }\n    connect_timeout: 2s\n    request_timeout: 1500ms\n    max_requests_per_connection: 7\n\
        \x20   circuit_breakers: { max_requests: 10, max_connections: 3 }\n\
        \x20   routes:\n      - match: { header: x-canary, value: \"1\" }\n        subset: { version: v2 }\n\
        \x20     - split:\n          - { subset: { version: v1 }, weight: 90 }\n          - { subset: { version: v2 }, weight: 10 }\n\
        \x20   endpoints:\n      - { address: 10.0.0.5, ports: [8080, 9090, 5432], locality: r1/z1, labels: { version: v1 }, weight: 3 }\n\
        \x20     - { address: \"10.0.0.6:15009\", locality: r1/z2/s, labels: { version: v2 }, draining: true }\n\
        \x20     - { address: 10.0.0.7, ports: [9090], locality: r1/z1 }\n\
        \x20 empty:\n    default_port: 80\n    identity: spiffe://aether.local/ns/x/sa/empty\n";

    fn decode_cluster(r: &Resource) -> Cluster {
        Cluster::decode(r.body.value.as_slice()).unwrap()
    }

    fn decode_cla(r: &Resource) -> ClusterLoadAssignment {
        ClusterLoadAssignment::decode(r.body.value.as_slice()).unwrap()
    }

    #[test]
    fn every_port_has_a_cluster_and_an_assignment_named_as_clients_expect() {
        let snap = Snapshot::build(&catalog(FULL), MESH, 1, None);
        let names: Vec<&str> = snap.clusters.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "empty.aether.internal",
                "payments.aether.internal",
                "payments.aether.internal:5432",
                "payments.aether.internal:9090"
            ]
        );
        assert!(snap
            .assignments
            .contains_key("outbound|9090||payments.aether.internal"));
        // A service without endpoints still has its default cluster, with no port in it.
        let c = read_cluster(
            &decode_cluster(&snap.clusters["empty.aether.internal"]),
            MESH,
            TD,
        )
        .unwrap();
        assert_eq!(c.ports, Some(BTreeSet::new()));
        assert!(read_assignment(&decode_cla(
            &snap.assignments["outbound|80||empty.aether.internal"]
        ))
        .unwrap()
        .is_empty());
    }

    #[test]
    fn the_proxys_client_reads_back_what_the_file_says() {
        let cat = catalog(FULL);
        let svc = &cat.services["payments"];
        let snap = Snapshot::build(&cat, MESH, 1, None);
        for port in [8080u16, 9090, 5432] {
            let name = crate::outbound::route::cluster_name("payments", MESH, port, 8080);
            let c = read_cluster(&decode_cluster(&snap.clusters[&name]), MESH, TD).unwrap();
            assert_eq!(c.service, "payments");
            assert_eq!(c.port, port);
            assert_eq!(c.named_port, (port != 8080).then_some(port));
            assert_eq!(c.identity, svc.identity);
            assert_eq!(c.connect_timeout, Some(svc.connect_timeout));
            assert_eq!(c.request_timeout, Some(Duration::from_millis(1500)));
            assert_eq!(c.max_requests_per_connection, 7);
            assert_eq!(c.breakers, svc.breakers);
            assert_eq!(c.outlier, svc.outlier);
            assert_eq!(c.routes, svc.routes);
            assert_eq!(c.protocol, svc.port_protocol(port));
            assert_eq!(c.eds_name, eds_name("payments", MESH, port));
            assert_eq!(
                c.ports,
                (port == 8080).then(|| svc.ports.clone()),
                "only the default cluster lists the ports"
            );
            let got = read_assignment(&decode_cla(&snap.assignments[&c.eds_name])).unwrap();
            let mut got: Vec<_> = got
                .into_iter()
                .map(|a| {
                    assert_eq!(a.priority, 0);
                    (a.address, a.locality, a.labels, a.draining, a.weight)
                })
                .collect();
            got.sort_by_key(|g| g.0);
            let want: Vec<_> = svc
                .endpoints
                .iter()
                .filter(|e| e.ports.contains(&port))
                .map(|e| {
                    (
                        e.address,
                        e.locality.clone(),
                        e.labels.clone(),
                        e.draining,
                        e.weight,
                    )
                })
                .collect();
            assert_eq!(got, want, "port {port}");
        }
    }

    #[test]
    fn versions_change_with_what_a_resource_is_made_of_and_only_then() {
        let a = Snapshot::build(&catalog(FULL), MESH, 1, None);
        let b = Snapshot::build(&catalog(FULL), MESH, 2, Some(&a));
        assert_eq!(a.clusters, b.clusters);
        assert_eq!(a.assignments, b.assignments);
        // An endpoint added on 9090 only: that assignment changes, nothing else does.
        let more = FULL.replace(
            "      - { address: 10.0.0.7, ports: [9090], locality: r1/z1 }\n",
            "      - { address: 10.0.0.7, ports: [9090], locality: r1/z1 }\n      - { address: 10.0.0.8, ports: [9090] }\n",
        );
        let c = Snapshot::build(&catalog(&more), MESH, 3, Some(&b));
        let changed: Vec<&String> = c
            .assignments
            .iter()
            .filter(|(n, r)| b.assignments[*n].version != r.version)
            .map(|(n, _)| n)
            .collect();
        assert_eq!(changed, ["outbound|9090||payments.aether.internal"]);
        assert_eq!(b.clusters, c.clusters);
        // A new port is a new Cluster, and the default cluster's `ports` changes with it.
        let port = more.replace("ports: [9090] }\n", "ports: [9090, 7070] }\n");
        let d = Snapshot::build(&catalog(&port), MESH, 4, Some(&c));
        assert!(d.clusters.contains_key("payments.aether.internal:7070"));
        assert_ne!(
            d.clusters["payments.aether.internal"].version,
            c.clusters["payments.aether.internal"].version
        );
        assert_eq!(
            d.clusters["payments.aether.internal:9090"],
            c.clusters["payments.aether.internal:9090"]
        );
    }

    #[test]
    fn kinds_map_to_their_type_urls() {
        for k in Kind::ALL {
            assert_eq!(Kind::of(k.type_url()), Some(k));
        }
        assert_eq!(Kind::of("type.googleapis.com/nothing"), None);
    }
}
