//! From a [`Fixture`] to Envoy's v3 resources, shaped as Istio shapes them (SPEC section 9):
//! one EDS Cluster per service port, a per-port ClusterLoadAssignment, and the SDS secrets.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers::Thresholds, cluster, CircuitBreakers, Cluster, OutlierDetection,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, data_source, socket_address, transport_socket, Address,
    AggregatedConfigSource, ApiVersion, ConfigSource, DataSource, HealthStatus,
    HttpProtocolOptions as CommonHttpOptions, Locality, Metadata, SocketAddress, TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint as EnvoyEndpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, secret, subject_alt_name_matcher::SanType, CertificateValidationContext,
    CommonTlsContext, SdsSecretConfig, Secret, SubjectAltNameMatcher, TlsCertificate,
    UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options, HttpProtocolOptions,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher, StringMatcher};
use envoy_types::pb::google::protobuf::{
    value, Any, Duration as PbDuration, ListValue, Struct, UInt32Value, Value,
};
use prost::{Message, Name};

use super::fixture::{Endpoint, Fixture, SecretSpec, Service};

pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const CLA_TYPE: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const SECRET_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// The transport socket name Istio gives its TLS sockets.
pub const TLS_SOCKET: &str = "envoy.transport_sockets.tls";
/// The key of the HTTP protocol options in `typed_extension_protocol_options`.
pub const HTTP_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";
/// The filter-metadata namespace of aether's own Cluster fields.
pub const AETHER_META: &str = "aether.io";

/// One resource as served: the packed message and its version.
#[derive(Debug, Clone, PartialEq)]
pub struct Res {
    pub any: Any,
    pub version: String,
}

/// (type URL, resource name).
pub type Key = (String, String);

/// A version: a hash of a canonical (deterministic) rendering of what the resource is made
/// from. Not of the encoded bytes: prost encodes maps (Struct fields, metadata) in hash-map
/// order, which differs between two builds of the same resource.
pub fn version_of(canonical: &str) -> String {
    let mut h = DefaultHasher::new();
    canonical.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// The EDS name of a service port: Istio's `outbound|<port>||<host>` (deliberately not the
/// Cluster's name, so a client must read `eds_cluster_config.service_name`).
pub fn eds_name(host: &str, port: u16) -> String {
    format!("outbound|{port}||{host}")
}

/// The Cluster name of a service port: the host for the default port, `host:port` otherwise.
pub fn cluster_name(host: &str, svc: &Service, port: u16) -> String {
    if port == svc.default_port {
        host.to_string()
    } else {
        format!("{host}:{port}")
    }
}

/// Every resource the fixture describes.
pub fn build(fx: &Fixture) -> BTreeMap<Key, Res> {
    let mut out = BTreeMap::new();
    for (name, svc) in &fx.services {
        let host = fx.host(name);
        let advertised = svc.advertised_ports();
        let mut ports = advertised.clone();
        ports.push(svc.default_port);
        ports.sort_unstable();
        ports.dedup();
        for port in ports {
            let eds = eds_name(&host, port);
            let mut names = vec![cluster_name(&host, svc, port)];
            if port == svc.default_port && fx.default_port_aliases {
                names.push(format!("{host}:{port}"));
            }
            for cname in names {
                let c = cluster(&cname, &eds, svc, port, &advertised);
                let canonical = format!(
                    "{cname}|{eds}|{port}|{advertised:?}|{:?}",
                    Service {
                        endpoints: Vec::new(),
                        ..svc.clone()
                    }
                );
                out.insert(
                    (CLUSTER_TYPE.to_string(), cname),
                    Res {
                        any: pack(&c),
                        version: version_of(&canonical),
                    },
                );
            }
            let eps: Vec<&Endpoint> = svc
                .endpoints
                .iter()
                .filter(|e| e.ports_or(svc.default_port).contains(&port))
                .collect();
            let cla = load_assignment(&eds, &eps);
            out.insert(
                (CLA_TYPE.to_string(), eds.clone()),
                Res {
                    any: pack(&cla),
                    version: version_of(&format!("{eds}|{eps:?}")),
                },
            );
        }
    }
    for (name, s) in &fx.secrets {
        out.insert(
            (SECRET_TYPE.to_string(), name.clone()),
            Res {
                any: pack(&secret_resource(name, s)),
                version: version_of(&format!("{name}|{s:?}")),
            },
        );
    }
    out
}

pub fn pack<M: Message + Name>(m: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: m.encode_to_vec(),
    }
}

pub fn duration(d: Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

fn u32v(v: u32) -> Option<UInt32Value> {
    Some(UInt32Value { value: v })
}

/// `ConfigSource { ads: {}, resource_api_version: V3 }`.
pub fn ads_source() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        ..Default::default()
    }
}

fn sds(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.into(),
        sds_config: Some(ads_source()),
    }
}

/// The URI SAN matcher that pins `identity`.
pub fn uri_san(identity: &str) -> SubjectAltNameMatcher {
    SubjectAltNameMatcher {
        san_type: SanType::Uri as i32,
        matcher: Some(StringMatcher {
            match_pattern: Some(string_matcher::MatchPattern::Exact(identity.into())),
            ignore_case: false,
        }),
        oid: String::new(),
    }
}

/// Istio's upstream TLS context: SNI = the port, the workload certificate and the root CA
/// from SDS (over ADS), and the peer pinned by a URI SAN matcher.
pub fn upstream_tls(port: u16, identity: &str) -> UpstreamTlsContext {
    UpstreamTlsContext {
        sni: port.to_string(),
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds("default")],
            validation_context_type: Some(
                common_tls_context::ValidationContextType::CombinedValidationContext(
                    common_tls_context::CombinedCertificateValidationContext {
                        default_validation_context: Some(CertificateValidationContext {
                            match_typed_subject_alt_names: vec![uri_san(identity)],
                            ..Default::default()
                        }),
                        validation_context_sds_secret_config: Some(sds("ROOTCA")),
                        ..Default::default()
                    },
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The Cluster of one service port.
pub fn cluster(name: &str, eds: &str, svc: &Service, port: u16, advertised: &[u16]) -> Cluster {
    let mut meta: Vec<(String, Value)> = Vec::new();
    if port == svc.default_port && svc.ports_metadata {
        meta.push((
            "ports".into(),
            list(advertised.iter().map(|p| number(*p as f64)).collect()),
        ));
    }
    if svc.tcp_ports.contains(&port) {
        meta.push(("protocol".into(), string("tcp")));
    }
    if let Some(t) = svc.request_timeout {
        meta.push(("request_timeout".into(), string(&humantime_secs(t))));
    }
    if let Some(r) = &svc.routes {
        meta.push(("routes".into(), json_value(r)));
    }
    let metadata = (!meta.is_empty()).then(|| Metadata {
        filter_metadata: HashMap::from([(
            AETHER_META.to_string(),
            Struct {
                fields: meta.into_iter().collect(),
            },
        )]),
        ..Default::default()
    });
    let mut typed_extension_protocol_options = HashMap::new();
    if let Some(n) = svc.max_requests_per_connection {
        let opts = HttpProtocolOptions {
            common_http_protocol_options: Some(CommonHttpOptions {
                max_requests_per_connection: u32v(n),
                ..Default::default()
            }),
            upstream_protocol_options: Some(
                http_protocol_options::UpstreamProtocolOptions::UseDownstreamProtocolConfig(
                    Default::default(),
                ),
            ),
            ..Default::default()
        };
        typed_extension_protocol_options.insert(HTTP_OPTIONS.to_string(), pack(&opts));
    }
    Cluster {
        name: name.into(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads_source()),
            service_name: eds.into(),
        }),
        connect_timeout: Some(duration(svc.connect_timeout)),
        transport_socket: Some(TransportSocket {
            name: TLS_SOCKET.into(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(pack(
                &upstream_tls(port, &svc.identity),
            ))),
        }),
        outlier_detection: svc.outlier_detection.as_ref().map(|o| OutlierDetection {
            consecutive_5xx: u32v(o.consecutive_5xx),
            base_ejection_time: Some(duration(o.base_ejection_time)),
            max_ejection_percent: u32v(o.max_ejection_percent),
            ..Default::default()
        }),
        circuit_breakers: svc.circuit_breakers.as_ref().map(|b| CircuitBreakers {
            thresholds: vec![Thresholds {
                max_connections: u32v(b.max_connections),
                max_pending_requests: u32v(b.max_pending_requests),
                max_requests: u32v(b.max_requests),
                ..Default::default()
            }],
            ..Default::default()
        }),
        typed_extension_protocol_options,
        metadata,
        ..Default::default()
    }
}

/// "15s", "1.5s", "250ms": what an operator writes in the catalog.
fn humantime_secs(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// The assignment of one EDS name: the endpoints grouped by locality, DRAINING or HEALTHY,
/// labels as `envoy.lb` metadata, the catalog weight as `load_balancing_weight`.
pub fn load_assignment(eds: &str, eps: &[&Endpoint]) -> ClusterLoadAssignment {
    let mut groups: BTreeMap<String, Vec<LbEndpoint>> = BTreeMap::new();
    for e in eps {
        let lb = LbEndpoint {
            health_status: if e.draining {
                HealthStatus::Draining as i32
            } else {
                HealthStatus::Healthy as i32
            },
            metadata: (!e.labels.is_empty()).then(|| Metadata {
                filter_metadata: HashMap::from([(
                    "envoy.lb".to_string(),
                    Struct {
                        fields: e
                            .labels
                            .iter()
                            .map(|(k, v)| (k.clone(), string(v)))
                            .collect(),
                    },
                )]),
                ..Default::default()
            }),
            load_balancing_weight: e.weight.and_then(u32v),
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(EnvoyEndpoint {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: e.address.to_string(),
                        port_specifier: Some(socket_address::PortSpecifier::PortValue(
                            e.port as u32,
                        )),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })),
        };
        groups
            .entry(e.locality.clone().unwrap_or_default())
            .or_default()
            .push(lb);
    }
    ClusterLoadAssignment {
        cluster_name: eds.into(),
        endpoints: groups
            .into_iter()
            .map(|(loc, lb_endpoints)| LocalityLbEndpoints {
                locality: (!loc.is_empty()).then(|| {
                    let mut parts = loc.splitn(3, '/');
                    Locality {
                        region: parts.next().unwrap_or_default().into(),
                        zone: parts.next().unwrap_or_default().into(),
                        sub_zone: parts.next().unwrap_or_default().into(),
                    }
                }),
                lb_endpoints,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

pub fn secret_resource(name: &str, s: &SecretSpec) -> Secret {
    let inline = |b: &[u8]| {
        Some(DataSource {
            specifier: Some(data_source::Specifier::InlineBytes(b.to_vec())),
            ..Default::default()
        })
    };
    Secret {
        name: name.into(),
        r#type: Some(match s {
            SecretSpec::Certificate { chain_pem, key_pem } => {
                secret::Type::TlsCertificate(TlsCertificate {
                    certificate_chain: inline(chain_pem),
                    private_key: inline(key_pem),
                    ..Default::default()
                })
            }
            SecretSpec::TrustedCa { pem } => {
                secret::Type::ValidationContext(CertificateValidationContext {
                    trusted_ca: inline(pem),
                    ..Default::default()
                })
            }
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// google.protobuf.Struct from JSON
// ---------------------------------------------------------------------------------------------

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

/// A JSON value as a protobuf `Value` (what an Istio control plane puts in filter metadata).
pub fn json_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    let kind = match v {
        J::Null => value::Kind::NullValue(0),
        J::Bool(b) => value::Kind::BoolValue(*b),
        J::Number(n) => value::Kind::NumberValue(n.as_f64().unwrap_or_default()),
        J::String(s) => value::Kind::StringValue(s.clone()),
        J::Array(a) => value::Kind::ListValue(ListValue {
            values: a.iter().map(json_value).collect(),
        }),
        J::Object(o) => value::Kind::StructValue(Struct {
            fields: o.iter().map(|(k, v)| (k.clone(), json_value(v))).collect(),
        }),
    };
    Value { kind: Some(kind) }
}

/// The `UpstreamTlsContext` inside a Cluster (for tests that hand-make invalid Clusters).
pub fn tls_of(c: &Cluster) -> UpstreamTlsContext {
    let Some(TransportSocket {
        config_type: Some(transport_socket::ConfigType::TypedConfig(any)),
        ..
    }) = &c.transport_socket
    else {
        panic!("cluster {} has no typed transport socket", c.name)
    };
    UpstreamTlsContext::decode(any.value.as_slice()).expect("an UpstreamTlsContext")
}

/// Replaces the `UpstreamTlsContext` inside a Cluster.
pub fn set_tls(c: &mut Cluster, tls: &UpstreamTlsContext) {
    c.transport_socket = Some(TransportSocket {
        name: TLS_SOCKET.into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(pack(tls))),
    });
}

/// The EDS name of a packed Cluster (`eds_cluster_config.service_name`), if it has one.
pub fn eds_of(any: &Any) -> Option<String> {
    let c = Cluster::decode(any.value.as_slice()).ok()?;
    c.eds_cluster_config
        .map(|e| e.service_name)
        .filter(|n| !n.is_empty())
}
