//! The xDS resource conversion. The first byte picks the input: raw bytes decoded as a Cluster,
//! a ClusterLoadAssignment or an SDS Secret (what a control plane sends, byte for byte), or a
//! structured Cluster / assignment built from the fuzzer's choices (to reach the checks deep
//! inside valid-looking resources). Every input converts or is refused with a reason; what
//! converts keeps the model's promises and survives a re-encode unchanged.
#![no_main]

use std::collections::HashMap;

use aether_proxy::xds::resources::{assignment, cluster, parse_cluster_name};
use arbitrary::{Arbitrary, Unstructured};
use envoy_types::pb::envoy::config::cluster::v3::cluster::EdsClusterConfig;
use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers::Thresholds, CircuitBreakers, Cluster, OutlierDetection,
};
use envoy_types::pb::envoy::config::core::v3::{
    address, socket_address, transport_socket, Address, HttpProtocolOptions as CommonHttpOptions,
    Locality, Metadata, SocketAddress, TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, CertificateValidationContext, CommonTlsContext, SubjectAltNameMatcher,
    UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::google::protobuf::{
    value::Kind, Any, Duration as PbDuration, ListValue, Struct, UInt32Value, Value,
};
use libfuzzer_sys::fuzz_target;
use prost::Message;

const DOMAIN: &str = "aether.internal";
const TRUST: &str = "aether.local";

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 5 {
        0 => {
            if let Ok(c) = Cluster::decode(rest) {
                check_cluster(&c);
            }
        }
        1 => {
            if let Ok(cla) = ClusterLoadAssignment::decode(rest) {
                check_assignment(&cla);
            }
        }
        2 => {
            let name = if mode & 0x80 == 0 {
                "default"
            } else {
                "ROOTCA"
            };
            if let Ok(sizes) = aether_proxy::fuzzing::sds_secret(name, rest) {
                assert!(!sizes.is_empty());
            }
        }
        3 => {
            if let Ok(c) = SCluster::arbitrary_take_rest(Unstructured::new(rest)) {
                check_cluster(&c.build());
            }
        }
        _ => {
            if let Ok(a) = SAssignment::arbitrary_take_rest(Unstructured::new(rest)) {
                check_assignment(&a.build());
            }
        }
    }
});

fn check_cluster(c: &Cluster) {
    let res = cluster(c, DOMAIN, TRUST);
    if let Ok(r) = &res {
        assert_eq!(
            parse_cluster_name(&c.name, DOMAIN),
            Some((r.service.clone(), r.named_port))
        );
        assert!(r.named_port.is_none_or(|p| p == r.port));
        assert_ne!(r.port, 0);
        assert!(!r.eds_name.is_empty());
        assert!(r.outlier.max_percent <= 100 && r.outlier.consecutive >= 1);
        assert!(r.ports.as_ref().is_none_or(|p| !p.contains(&0)));
    }
    // The conversion reads the message, not its encoding. (A structured input may nest
    // metadata deeper than the wire's decoder allows; only that may fail to come back.)
    match Cluster::decode(c.encode_to_vec().as_slice()) {
        Ok(again) => assert_eq!(cluster(&again, DOMAIN, TRUST), res),
        Err(e) => assert!(format!("{e:?}").contains("RecursionLimitReached"), "{e}"),
    }
}

fn check_assignment(cla: &ClusterLoadAssignment) {
    let res = assignment(cla);
    if let Ok(eps) = &res {
        let mut total = 0u64;
        for e in eps {
            assert!(e.weight >= 1 && e.address.port() != 0);
            total += u64::from(e.weight);
        }
        assert!(total <= u64::from(u32::MAX), "weights overflow a u32");
    }
    match ClusterLoadAssignment::decode(cla.encode_to_vec().as_slice()) {
        Ok(again) => assert_eq!(assignment(&again), res),
        Err(e) => assert!(format!("{e:?}").contains("RecursionLimitReached"), "{e}"),
    }
}

/// A protobuf `Value`, built by the fuzzer.
#[derive(Arbitrary, Debug)]
enum SValue {
    Null,
    Number(f64),
    Str(String),
    Bool(bool),
    List(Vec<SValue>),
    Struct(Vec<(String, SValue)>),
}

impl SValue {
    fn build(&self) -> Value {
        let kind = match self {
            SValue::Null => Kind::NullValue(0),
            SValue::Number(n) => Kind::NumberValue(*n),
            SValue::Str(s) => Kind::StringValue(s.clone()),
            SValue::Bool(b) => Kind::BoolValue(*b),
            SValue::List(l) => Kind::ListValue(ListValue {
                values: l.iter().map(SValue::build).collect(),
            }),
            SValue::Struct(f) => Kind::StructValue(Struct {
                fields: f.iter().map(|(k, v)| (k.clone(), v.build())).collect(),
            }),
        };
        Value { kind: Some(kind) }
    }
}

#[derive(Arbitrary, Debug)]
enum Text {
    /// A service name, to be mesh-shaped.
    Service(String, Option<u16>),
    Raw(String),
}

#[derive(Arbitrary, Debug)]
enum Sni {
    Port(u16),
    Raw(String),
}

#[derive(Arbitrary, Debug)]
struct San {
    san_type: u8,
    /// `Some`: an exact matcher; the bool picks the mesh spelling of the identity.
    exact: Option<(bool, String)>,
}

#[derive(Arbitrary, Debug)]
struct SCluster {
    name: Text,
    eds: Option<String>,
    sni: Sni,
    sans: Vec<San>,
    combined: bool,
    connect_timeout: Option<(i64, i32)>,
    outlier: Option<(Option<u32>, Option<(i64, i32)>, Option<u32>)>,
    thresholds: Vec<(i32, Option<u32>, Option<u32>)>,
    /// `Some(Ok)`: HTTP options with this max requests per connection; `Some(Err)`: raw bytes.
    http_options: Option<Result<Option<u32>, Vec<u8>>>,
    /// (key pick, value): keys 0..4 are aether's own.
    metadata: Vec<(u8, SValue)>,
    ports: Option<Vec<f64>>,
}

const META_KEYS: [&str; 4] = ["protocol", "request_timeout", "routes", "ports"];

fn dur((seconds, nanos): (i64, i32)) -> PbDuration {
    PbDuration { seconds, nanos }
}

fn any<M: Message>(type_url: &str, m: &M) -> Any {
    Any {
        type_url: type_url.into(),
        value: m.encode_to_vec(),
    }
}

impl SCluster {
    fn build(&self) -> Cluster {
        let name = match &self.name {
            Text::Service(s, None) => format!("{s}.{DOMAIN}"),
            Text::Service(s, Some(p)) => format!("{s}.{DOMAIN}:{p}"),
            Text::Raw(s) => s.clone(),
        };
        let sni = match &self.sni {
            Sni::Port(p) => p.to_string(),
            Sni::Raw(s) => s.clone(),
        };
        let sans = self
            .sans
            .iter()
            .map(|s| SubjectAltNameMatcher {
                san_type: i32::from(s.san_type % 6),
                matcher: s.exact.as_ref().map(|(mesh, id)| StringMatcher {
                    match_pattern: Some(MatchPattern::Exact(if *mesh {
                        format!("spiffe://{TRUST}/ns/default/sa/{id}")
                    } else {
                        id.clone()
                    })),
                    ignore_case: false,
                }),
                oid: String::new(),
            })
            .collect();
        let validation = CertificateValidationContext {
            match_typed_subject_alt_names: sans,
            ..Default::default()
        };
        let validation = if self.combined {
            common_tls_context::ValidationContextType::CombinedValidationContext(
                common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context: Some(validation),
                    ..Default::default()
                },
            )
        } else {
            common_tls_context::ValidationContextType::ValidationContext(validation)
        };
        let tls = UpstreamTlsContext {
            sni,
            common_tls_context: Some(CommonTlsContext {
                validation_context_type: Some(validation),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut options = HashMap::new();
        match &self.http_options {
            None => {}
            Some(Ok(n)) => {
                let opts = HttpProtocolOptions {
                    common_http_protocol_options: Some(CommonHttpOptions {
                        max_requests_per_connection: n.map(|value| UInt32Value { value }),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                options.insert(
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
                    any("type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions", &opts),
                );
            }
            Some(Err(raw)) => {
                options.insert(
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
                    Any {
                        type_url: String::new(),
                        value: raw.clone(),
                    },
                );
            }
        }
        let mut fields: HashMap<String, Value> = self
            .metadata
            .iter()
            .map(|(k, v)| {
                let key = META_KEYS
                    .get(usize::from(*k))
                    .map_or_else(|| format!("k{k}"), |s| s.to_string());
                (key, v.build())
            })
            .collect();
        if let Some(ports) = &self.ports {
            fields.insert(
                "ports".into(),
                Value {
                    kind: Some(Kind::ListValue(ListValue {
                        values: ports
                            .iter()
                            .map(|n| Value {
                                kind: Some(Kind::NumberValue(*n)),
                            })
                            .collect(),
                    })),
                },
            );
        }
        Cluster {
            name,
            eds_cluster_config: self.eds.as_ref().map(|e| EdsClusterConfig {
                eds_config: None,
                service_name: e.clone(),
            }),
            connect_timeout: self.connect_timeout.map(dur),
            transport_socket: Some(TransportSocket {
                name: "envoy.transport_sockets.tls".into(),
                config_type: Some(transport_socket::ConfigType::TypedConfig(any(
                    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    &tls,
                ))),
            }),
            outlier_detection: self.outlier.map(|(c, b, m)| OutlierDetection {
                consecutive_5xx: c.map(|value| UInt32Value { value }),
                base_ejection_time: b.map(dur),
                max_ejection_percent: m.map(|value| UInt32Value { value }),
                ..Default::default()
            }),
            circuit_breakers: (!self.thresholds.is_empty()).then(|| CircuitBreakers {
                thresholds: self
                    .thresholds
                    .iter()
                    .map(|(priority, conns, reqs)| Thresholds {
                        priority: *priority,
                        max_connections: conns.map(|value| UInt32Value { value }),
                        max_requests: reqs.map(|value| UInt32Value { value }),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            typed_extension_protocol_options: options,
            metadata: (!fields.is_empty()).then(|| Metadata {
                filter_metadata: HashMap::from([("aether.io".to_string(), Struct { fields })]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

#[derive(Arbitrary, Debug)]
struct SEndpoint {
    health: i32,
    /// `Ok`: an IPv4 address by its bits; `Err`: any text.
    ip: Result<u32, String>,
    port: u32,
    weight: Option<u32>,
    labels: Vec<(String, SValue)>,
    missing: bool,
}

#[derive(Arbitrary, Debug)]
struct SGroup {
    locality: Option<(String, String, String)>,
    priority: u32,
    endpoints: Vec<SEndpoint>,
}

#[derive(Arbitrary, Debug)]
struct SAssignment {
    name: String,
    groups: Vec<SGroup>,
}

impl SAssignment {
    fn build(&self) -> ClusterLoadAssignment {
        let lb = |e: &SEndpoint| LbEndpoint {
            health_status: e.health % 7,
            metadata: (!e.labels.is_empty()).then(|| Metadata {
                filter_metadata: HashMap::from([(
                    "envoy.lb".to_string(),
                    Struct {
                        fields: e
                            .labels
                            .iter()
                            .map(|(k, v)| (k.clone(), v.build()))
                            .collect(),
                    },
                )]),
                ..Default::default()
            }),
            load_balancing_weight: e.weight.map(|value| UInt32Value { value }),
            host_identifier: (!e.missing).then(|| {
                lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address: Some(Address {
                        address: Some(address::Address::SocketAddress(SocketAddress {
                            address: match &e.ip {
                                Ok(bits) => std::net::Ipv4Addr::from(*bits).to_string(),
                                Err(s) => s.clone(),
                            },
                            port_specifier: Some(socket_address::PortSpecifier::PortValue(e.port)),
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                })
            }),
        };
        ClusterLoadAssignment {
            cluster_name: self.name.clone(),
            endpoints: self
                .groups
                .iter()
                .map(|g| LocalityLbEndpoints {
                    locality: g
                        .locality
                        .as_ref()
                        .map(|(region, zone, sub_zone)| Locality {
                            region: region.clone(),
                            zone: zone.clone(),
                            sub_zone: sub_zone.clone(),
                        }),
                    priority: g.priority,
                    lb_endpoints: g.endpoints.iter().map(lb).collect(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }
}
