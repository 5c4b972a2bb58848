//! Envoy's v3 resources in, the catalog model out. What SPEC 9 lists is taken from a Cluster
//! and a ClusterLoadAssignment; everything else in them is ignored (the proxy always presents
//! its own identity and trusts its own bundle). A resource that fails validation is refused
//! whole with an error naming the resource and the field, to be sent back as a NACK.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{address, socket_address, HealthStatus, Metadata};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::ValidationContextType, subject_alt_name_matcher::SanType,
    CertificateValidationContext, UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
use envoy_types::pb::google::protobuf::{self as pb, value::Kind};
use prost::Message;

use crate::catalog::model::{at_most, MAX_CONNECT_TIMEOUT, MAX_EJECTION_TIME, MAX_REQUEST_TIMEOUT};
use crate::catalog::{Breakers, Labels, Outlier, PortProtocol, Route};
use crate::config::Locality;
use crate::identity::SpiffeId;
use crate::validation::{FieldError, Origin};

pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINT_TYPE: &str =
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const SECRET_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
const TLS_CONTEXT_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
const HTTP_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// What the proxy takes from one Cluster (`svc.<domain>` or `svc.<domain>:<port>`).
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterRes {
    pub service: String,
    /// The port the name carries; `None` for the default cluster.
    pub named_port: Option<u16>,
    /// The SNI: the port this cluster's connections are for.
    pub port: u16,
    pub eds_name: String,
    pub identity: SpiffeId,
    pub connect_timeout: Option<Duration>,
    pub outlier: Outlier,
    pub breakers: Breakers,
    pub max_requests_per_connection: u32,
    pub protocol: PortProtocol,
    pub request_timeout: Option<Duration>,
    pub routes: Vec<Route>,
    /// `aether.io.ports`: when present, the ports that exist.
    pub ports: Option<BTreeSet<u16>>,
}

/// One endpoint of a ClusterLoadAssignment.
#[derive(Debug, Clone, PartialEq)]
pub struct AssignedEndpoint {
    pub address: SocketAddr,
    pub locality: Option<Locality>,
    pub labels: Labels,
    pub draining: bool,
    pub weight: u32,
    pub priority: u32,
}

/// `svc.<domain>` -> (svc, None); `svc.<domain>:P` -> (svc, Some(P)).
pub fn parse_cluster_name(name: &str, mesh_domain: &str) -> Option<(String, Option<u16>)> {
    let (host, port) = match name.rsplit_once(':') {
        Some((h, p)) => (h, Some(parse_port(p)?)),
        None => (name, None),
    };
    let svc = host.strip_suffix(mesh_domain)?.strip_suffix('.')?;
    let ok = !svc.is_empty()
        && svc
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    ok.then(|| (svc.to_string(), port))
}

fn parse_port(p: &str) -> Option<u16> {
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) || p.starts_with('0') {
        return None;
    }
    p.parse::<u16>().ok().filter(|p| *p != 0)
}

fn duration(d: &pb::Duration) -> Option<Duration> {
    // A protobuf Duration's nanos are 0..=999_999_999.
    if d.seconds < 0 || !(0..1_000_000_000).contains(&d.nanos) || (d.seconds == 0 && d.nanos == 0) {
        return None;
    }
    Some(Duration::new(d.seconds as u64, d.nanos as u32))
}

/// Errors about one resource.
struct Check {
    origin: Origin,
}

impl Check {
    fn err(&self, field: &str, reason: impl Into<String>) -> FieldError {
        FieldError::new(&self.origin, field, reason)
    }
}

/// Validates and converts a Cluster.
pub fn cluster(
    c: &Cluster,
    mesh_domain: &str,
    trust_domain: &str,
) -> Result<ClusterRes, FieldError> {
    let k = Check {
        origin: Origin::Resource(c.name.clone()),
    };
    let (service, named_port) = parse_cluster_name(&c.name, mesh_domain).ok_or_else(|| {
        k.err(
            "name",
            format!("{:?} is not svc.{mesh_domain}[:port]", c.name),
        )
    })?;
    let tls = upstream_tls(c, &k)?;
    let port = parse_port(&tls.sni).ok_or_else(|| {
        k.err(
            "transport_socket.sni",
            format!("{:?} is not a port", tls.sni),
        )
    })?;
    if named_port.is_some_and(|p| p != port) {
        return Err(k.err(
            "transport_socket.sni",
            format!("{port} is not the port of the cluster's name"),
        ));
    }
    let identity = pinned_identity(&tls, &k, trust_domain)?;
    let connect_timeout = match &c.connect_timeout {
        None => None,
        Some(d) => {
            let d =
                duration(d).ok_or_else(|| k.err("connect_timeout", "must be greater than zero"))?;
            Some(at_most(d, MAX_CONNECT_TIMEOUT).map_err(|e| k.err("connect_timeout", e))?)
        }
    };
    let mut outlier = Outlier::default();
    if let Some(o) = &c.outlier_detection {
        if let Some(n) = &o.consecutive_5xx {
            if n.value == 0 {
                return Err(k.err("outlier_detection.consecutive_5xx", "must be at least 1"));
            }
            outlier.consecutive = n.value;
        }
        if let Some(d) = &o.base_ejection_time {
            let field = "outlier_detection.base_ejection_time";
            let d = duration(d).ok_or_else(|| k.err(field, "must be greater than zero"))?;
            outlier.base_ejection = at_most(d, MAX_EJECTION_TIME).map_err(|e| k.err(field, e))?;
        }
        if let Some(p) = &o.max_ejection_percent {
            if p.value > 100 {
                return Err(k.err("outlier_detection.max_ejection_percent", "at most 100"));
            }
            outlier.max_percent = p.value;
        }
    }
    let mut breakers = Breakers::default();
    if let Some(cb) = &c.circuit_breakers {
        // Priority DEFAULT (0) is the one requests use.
        if let Some(t) = cb.thresholds.iter().find(|t| t.priority == 0) {
            if let Some(v) = &t.max_requests {
                breakers.max_requests = v.value;
            }
            if let Some(v) = &t.max_connections {
                breakers.max_connections = v.value;
            }
        }
    }
    let mut max_requests_per_connection = 0;
    if let Some(any) = c.typed_extension_protocol_options.get(HTTP_OPTIONS) {
        let opts = HttpProtocolOptions::decode(any.value.as_slice()).map_err(|e| {
            k.err(
                &format!("typed_extension_protocol_options[{HTTP_OPTIONS}]"),
                e.to_string(),
            )
        })?;
        if let Some(v) = opts
            .common_http_protocol_options
            .and_then(|o| o.max_requests_per_connection)
        {
            max_requests_per_connection = v.value;
        }
    }
    let meta = aether_metadata(c.metadata.as_ref());
    let mut protocol = PortProtocol::Http;
    let mut request_timeout = None;
    let mut routes = Vec::new();
    let mut ports = None;
    if let Some(fields) = meta {
        let field = |f: &str| format!("metadata.filter_metadata[aether.io].{f}");
        if let Some(v) = fields.get("protocol") {
            protocol = match &v.kind {
                Some(Kind::StringValue(s)) if s == "tcp" => PortProtocol::Tcp,
                Some(Kind::StringValue(s)) if s == "http" => PortProtocol::Http,
                _ => return Err(k.err(&field("protocol"), "is not \"tcp\" or \"http\"")),
            };
        }
        if let Some(v) = fields.get("request_timeout") {
            let Some(Kind::StringValue(s)) = &v.kind else {
                return Err(k.err(&field("request_timeout"), "is not a duration string"));
            };
            request_timeout = Some(
                crate::config::duration::parse(s)
                    .and_then(|d| at_most(d, MAX_REQUEST_TIMEOUT))
                    .map_err(|e| k.err(&field("request_timeout"), e))?,
            );
        }
        if let Some(v) = fields.get("routes") {
            routes = crate::catalog::file::parse_routes(to_json(v))
                .map_err(|(f, e)| k.err(&format!("{}{f}", field("routes")), e))?;
        }
        if let Some(v) = fields.get("ports") {
            let Some(Kind::ListValue(list)) = &v.kind else {
                return Err(k.err(&field("ports"), "is not a list of ports"));
            };
            let mut set = BTreeSet::new();
            for (i, p) in list.values.iter().enumerate() {
                match &p.kind {
                    Some(Kind::NumberValue(n))
                        if *n >= 1.0 && *n <= 65535.0 && n.fract() == 0.0 =>
                    {
                        set.insert(*n as u16);
                    }
                    _ => return Err(k.err(&field(&format!("ports[{i}]")), "is not a port")),
                }
            }
            ports = Some(set);
        }
    }
    Ok(ClusterRes {
        service,
        named_port,
        port,
        eds_name: c
            .eds_cluster_config
            .as_ref()
            .map(|e| e.service_name.clone())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| c.name.clone()),
        identity,
        connect_timeout,
        outlier,
        breakers,
        max_requests_per_connection,
        protocol,
        request_timeout,
        routes,
        ports,
    })
}

fn upstream_tls(c: &Cluster, k: &Check) -> Result<UpstreamTlsContext, FieldError> {
    use envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType;
    let ts = c
        .transport_socket
        .as_ref()
        .ok_or_else(|| k.err("transport_socket", "missing: the mesh is mTLS only"))?;
    let Some(ConfigType::TypedConfig(any)) = &ts.config_type else {
        return Err(k.err("transport_socket.typed_config", "missing"));
    };
    if any.type_url != TLS_CONTEXT_TYPE {
        return Err(k.err(
            "transport_socket.typed_config",
            format!("{} is not an UpstreamTlsContext", any.type_url),
        ));
    }
    UpstreamTlsContext::decode(any.value.as_slice())
        .map_err(|e| k.err("transport_socket.typed_config", e.to_string()))
}

/// The exact URI SAN matcher: the identity every connection of the cluster is pinned to.
fn pinned_identity(
    tls: &UpstreamTlsContext,
    k: &Check,
    trust_domain: &str,
) -> Result<SpiffeId, FieldError> {
    let field =
        "transport_socket.common_tls_context.validation_context.match_typed_subject_alt_names";
    let ctx: Option<&CertificateValidationContext> = tls
        .common_tls_context
        .as_ref()
        .and_then(|c| c.validation_context_type.as_ref())
        .and_then(|v| match v {
            ValidationContextType::ValidationContext(v) => Some(v),
            ValidationContextType::CombinedValidationContext(c) => {
                c.default_validation_context.as_ref()
            }
            _ => None,
        });
    let uri = ctx
        .into_iter()
        .flat_map(|v| &v.match_typed_subject_alt_names)
        .find_map(|m| {
            if m.san_type != SanType::Uri as i32 {
                return None;
            }
            match m.matcher.as_ref()?.match_pattern.as_ref()? {
                MatchPattern::Exact(s) => Some(s.clone()),
                _ => None,
            }
        });
    let uri = uri.ok_or_else(|| k.err(field, "no exact URI SAN matcher: no pin, no traffic"))?;
    SpiffeId::parse_in(&uri, trust_domain).map_err(|e| k.err(field, e.to_string()))
}

fn aether_metadata(m: Option<&Metadata>) -> Option<&std::collections::HashMap<String, pb::Value>> {
    m?.filter_metadata.get("aether.io").map(|s| &s.fields)
}

/// A protobuf Value as JSON, for the parts of the metadata that have the catalog's shape.
fn to_json(v: &pb::Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) => {
            if n.fract() == 0.0 && *n >= 0.0 && *n <= u32::MAX as f64 {
                serde_json::Value::from(*n as u64)
            } else {
                serde_json::Value::from(*n)
            }
        }
        Some(Kind::StringValue(s)) => serde_json::Value::from(s.clone()),
        Some(Kind::BoolValue(b)) => serde_json::Value::from(*b),
        Some(Kind::StructValue(s)) => serde_json::Value::Object(
            s.fields
                .iter()
                .map(|(k, v)| (k.clone(), to_json(v)))
                .collect(),
        ),
        Some(Kind::ListValue(l)) => {
            serde_json::Value::Array(l.values.iter().map(to_json).collect())
        }
    }
}

/// Validates and converts a ClusterLoadAssignment.
pub fn assignment(cla: &ClusterLoadAssignment) -> Result<Vec<AssignedEndpoint>, FieldError> {
    let k = Check {
        origin: Origin::Resource(cla.cluster_name.clone()),
    };
    let mut out = Vec::new();
    for (i, group) in cla.endpoints.iter().enumerate() {
        let locality = group.locality.as_ref().and_then(|l| {
            (!l.region.is_empty() || !l.zone.is_empty()).then(|| Locality {
                region: l.region.clone(),
                zone: l.zone.clone(),
                subzone: l.sub_zone.clone(),
            })
        });
        for (j, lb) in group.lb_endpoints.iter().enumerate() {
            let field = |f: &str| format!("endpoints[{i}].lb_endpoints[{j}]{f}");
            let health = HealthStatus::try_from(lb.health_status).unwrap_or(HealthStatus::Unknown);
            if matches!(health, HealthStatus::Unhealthy | HealthStatus::Timeout) {
                continue;
            }
            let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &lb.host_identifier else {
                return Err(k.err(&field(".endpoint"), "missing"));
            };
            let sa = match ep.address.as_ref().and_then(|a| a.address.as_ref()) {
                Some(address::Address::SocketAddress(sa)) => sa,
                _ => return Err(k.err(&field(".endpoint.address"), "not a socket address")),
            };
            let ip: IpAddr = sa.address.parse().map_err(|_| {
                k.err(
                    &field(".endpoint.address.socket_address.address"),
                    format!("{:?} is not an IP address", sa.address),
                )
            })?;
            let port = match sa.port_specifier {
                Some(socket_address::PortSpecifier::PortValue(p)) if (1..=65535).contains(&p) => {
                    p as u16
                }
                _ => {
                    return Err(k.err(
                        &field(".endpoint.address.socket_address.port_value"),
                        "port must be in 1..65535",
                    ))
                }
            };
            let labels = lb
                .metadata
                .as_ref()
                .and_then(|m| m.filter_metadata.get("envoy.lb"))
                .map(|s| {
                    s.fields
                        .iter()
                        .filter_map(|(k, v)| match &v.kind {
                            Some(Kind::StringValue(s)) => Some((k.clone(), s.clone())),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            let weight = lb.load_balancing_weight.as_ref().map_or(1, |w| w.value);
            if weight == 0 {
                return Err(k.err(&field(".load_balancing_weight"), "must be at least 1"));
            }
            out.push(AssignedEndpoint {
                address: SocketAddr::new(ip, port),
                locality: locality.clone(),
                labels,
                draining: health == HealthStatus::Draining,
                weight,
                priority: group.priority,
            });
        }
    }
    let mut total: u32 = 0;
    for e in &out {
        total = total
            .checked_add(e.weight)
            .ok_or_else(|| k.err("endpoints", "weights add up to more than 2^32-1"))?;
    }
    out.shrink_to_fit(); // held for as long as the subscription lives
    Ok(out)
}
