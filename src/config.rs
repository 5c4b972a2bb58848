//! The sidecar's own configuration file (`--config`, SPEC section 3).
//!
//! Parsing is strict (unknown fields are errors) and every error names the file, the field path
//! and the reason. Relative file paths are taken relative to the working directory, as Envoy does.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::identity::tls::{ServerAlpn, ALPN_H2, ALPN_HTTP1};
use crate::identity::{IdentityPaths, IdentitySpec, SpiffeId};
use crate::validation::{from_yaml, read_file, FieldError, FieldErrors, Origin};

/// Application protocol of an inbound chain. Every `match` on it names all four: a new kind
/// of chain must decide its ALPN and its server explicitly (see `inbound::chain`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    H2,
    Http1,
    Auto,
    Tcp,
}

impl Protocol {
    /// The ALPN the port's TLS server agrees to: `h2` chains only h2, `http1` only http/1.1,
    /// `auto` the client's first choice of the two, `tcp` none.
    pub fn server_alpn(self) -> ServerAlpn {
        match self {
            Protocol::H2 => ServerAlpn::Only(ALPN_H2),
            Protocol::Http1 => ServerAlpn::Only(ALPN_HTTP1),
            Protocol::Auto => ServerAlpn::ClientFirst,
            Protocol::Tcp => ServerAlpn::Refuse,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::H2 => "h2",
            Protocol::Http1 => "http1",
            Protocol::Auto => "auto",
            Protocol::Tcp => "tcp",
        }
    }
}

/// `region/zone[/subzone]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Locality {
    pub region: String,
    pub zone: String,
    pub subzone: String,
}

impl Locality {
    pub fn parse(s: &str) -> Result<Locality, String> {
        let parts: Vec<&str> = s.split('/').collect();
        if !(2..=3).contains(&parts.len()) || parts.iter().any(|p| p.is_empty()) {
            return Err(format!("{s:?} is not region/zone[/subzone]"));
        }
        Ok(Locality {
            region: parts[0].to_string(),
            zone: parts[1].to_string(),
            subzone: parts.get(2).unwrap_or(&"").to_string(),
        })
    }
}

impl fmt::Display for Locality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.region, self.zone)?;
        if !self.subzone.is_empty() {
            write!(f, "/{}", self.subzone)?;
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for Locality {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Locality::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Locality {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Durations are written as "5s", "250ms", "1m".
pub(crate) mod duration {
    use serde::Deserialize;
    use std::time::Duration;

    /// The longest duration any file may give.
    pub const MAX: Duration = Duration::from_secs(24 * 60 * 60);

    pub fn parse(s: &str) -> Result<Duration, String> {
        let d = humantime::parse_duration(s.trim())
            .map_err(|_| format!("{s:?} is not a duration like \"5s\" or \"250ms\""))?;
        if d.is_zero() {
            return Err(format!("{s:?} must be greater than zero"));
        }
        // No timer here needs more than a day; the cap keeps deadline arithmetic far from
        // overflow whatever a file says. Fields with tighter bounds check them too.
        if d > MAX {
            return Err(format!("{s:?} is over the limit of 24h"));
        }
        Ok(d)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(serde::de::Error::custom)
    }

    pub fn deserialize_opt<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        deserialize(d).map(Some)
    }
}

/// The workload identity: PEM files (watched), or an SDS server (SPEC section 9).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityFiles {
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// `unix:///path` or `host:port`.
    #[serde(default)]
    pub sds: Option<GrpcAddress>,
}

/// Where a gRPC server (xDS, SDS) listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrpcAddress {
    Unix(PathBuf),
    Tcp(String),
}

impl GrpcAddress {
    pub fn parse(s: &str) -> Result<GrpcAddress, String> {
        if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(format!(
                    "{s:?}: a unix socket address is unix:///absolute/path"
                ));
            }
            return Ok(GrpcAddress::Unix(PathBuf::from(path)));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?} is neither unix:///path nor host:port"))?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(format!("{s:?} is neither unix:///path nor host:port"));
        }
        Ok(GrpcAddress::Tcp(s.to_string()))
    }

    /// Loopback and unix sockets need no TLS; anything else is mTLS with the workload identity.
    pub fn is_local(&self) -> bool {
        match self {
            GrpcAddress::Unix(_) => true,
            GrpcAddress::Tcp(a) => {
                let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
            }
        }
    }
}

impl fmt::Display for GrpcAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrpcAddress::Unix(p) => write!(f, "unix://{}", p.display()),
            GrpcAddress::Tcp(a) => f.write_str(a),
        }
    }
}

impl<'de> Deserialize<'de> for GrpcAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        GrpcAddress::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// `discovery.xds` (SPEC section 9).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XdsConfig {
    pub address: GrpcAddress,
    #[serde(default)]
    pub node_id: Option<String>,
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(
        default = "default_cluster_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub cluster_timeout: Duration,
    #[serde(
        default = "default_xds_idle",
        deserialize_with = "duration::deserialize"
    )]
    pub idle: Duration,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    pub xds: XdsConfig,
}

fn default_cluster_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_xds_idle() -> Duration {
    Duration::from_secs(3600)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceIdentity {
    pub source: IpAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboundPort {
    pub port: u16,
    pub protocol: Protocol,
    /// Peer SPIFFE ids let through; empty means every identity of the trust domain.
    #[serde(default)]
    pub allow: Vec<SpiffeId>,
    /// HTTP/1.1 upgrade tokens tunnelled after the app's `101` (http1 and auto ports);
    /// omitted: `[websocket]`. Never `h2c`: after a tunnel nothing could be enforced.
    #[serde(default)]
    pub upgrades: Option<Vec<String>>,
}

/// The upgrade a port tunnels when its config names none.
pub const DEFAULT_UPGRADES: [&str; 1] = ["websocket"];

impl InboundPort {
    /// The upgrade tokens this port tunnels, lowercased.
    pub fn upgrade_tokens(&self) -> Vec<String> {
        match &self.upgrades {
            Some(u) => u.iter().map(|t| t.to_ascii_lowercase()).collect(),
            None => DEFAULT_UPGRADES.iter().map(|t| t.to_string()).collect(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboundConfig {
    #[serde(default = "default_inbound_listen")]
    pub listen: SocketAddr,
    #[serde(default = "default_app_host")]
    pub app_host: IpAddr,
    #[serde(default = "default_port")]
    pub default_port: u16,
    /// Omitted => `[{port: default_port, protocol: auto}]` (filled in by `Config::parse`).
    #[serde(default)]
    pub ports: Vec<InboundPort>,
}

impl Default for InboundConfig {
    fn default() -> Self {
        InboundConfig {
            listen: default_inbound_listen(),
            app_host: default_app_host(),
            default_port: default_port(),
            ports: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboundConfig {
    #[serde(default = "default_outbound_listen")]
    pub listen: SocketAddr,
    /// What captured connections to destinations outside the mesh get (SPEC section 10).
    #[serde(default)]
    pub egress: Egress,
}

impl Default for OutboundConfig {
    fn default() -> Self {
        OutboundConfig {
            listen: default_outbound_listen(),
            egress: Egress::default(),
        }
    }
}

/// `outbound.egress`: a captured connection whose original destination is no service's
/// virtual address is closed without a byte (`deny`) or connected there as is
/// (`passthrough`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Egress {
    #[default]
    Deny,
    Passthrough,
}

impl Egress {
    pub fn as_str(self) -> &'static str {
        match self {
            Egress::Deny => "deny",
            Egress::Passthrough => "passthrough",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    #[serde(default = "default_admin_listen")]
    pub listen: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: default_admin_listen(),
        }
    }
}

/// `health.listen`: only `/healthz/ready` and `/healthz`, so it can face the kubelet on the
/// pod address while admin stays on loopback.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    pub listen: SocketAddr,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadinessConfig {
    #[serde(default)]
    pub required_listeners: Vec<u16>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogConfig {
    pub path: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainConfig {
    #[serde(
        default = "default_drain_notify",
        deserialize_with = "duration::deserialize"
    )]
    pub notify: Duration,
    #[serde(
        default = "default_drain_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub timeout: Duration,
}

impl Default for DrainConfig {
    fn default() -> Self {
        DrainConfig {
            notify: default_drain_notify(),
            timeout: default_drain_timeout(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_mesh_domain")]
    pub mesh_domain: String,
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    #[serde(default)]
    pub locality: Option<Locality>,
    pub identity: IdentityFiles,
    #[serde(default)]
    pub source_identities: Vec<SourceIdentity>,
    #[serde(default)]
    pub inbound: InboundConfig,
    #[serde(default)]
    pub outbound: OutboundConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    /// The kubelet's probe port (SPEC section 12); no listener when absent.
    #[serde(default)]
    pub health: Option<HealthConfig>,
    #[serde(default)]
    pub readiness: ReadinessConfig,
    /// Required unless `discovery` is set (then it is not used).
    #[serde(default)]
    pub catalog: Option<CatalogConfig>,
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    #[serde(default)]
    pub drain: DrainConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Trace context and span export (SPEC section 12).
    #[serde(default)]
    pub tracing: TracingConfig,
    /// The DNS listener (SPEC section 10); none when absent.
    #[serde(default)]
    pub dns: Option<DnsConfig>,
    /// Shedding inside a memory limit (SPEC section 13).
    #[serde(default)]
    pub overload: OverloadConfig,
}

/// `overload:` what the sidecar does as its memory use nears its limit. The thresholds are
/// shares of the limit; `docs/decisions/0012-overload-thresholds.md` explains the defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverloadConfig {
    /// False: never shed, whatever the limit.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Bytes (`67108864`) or a Kubernetes quantity (`64Mi`, `1G`); overrides the cgroup's limit.
    #[serde(default, deserialize_with = "bytes::deserialize_opt")]
    pub memory_limit: Option<u64>,
    /// Step 1 (refuse new connections and requests, release idle memory) from this share on.
    #[serde(default = "default_shed_at")]
    pub shed_at: f64,
    /// Step 2 (close the idlest client connections) from this share on.
    #[serde(default = "default_close_at")]
    pub close_at: f64,
    /// Step 1 ends this far below `shed_at`, so a sidecar at the edge does not flap.
    #[serde(default = "default_resume_gap")]
    pub resume_gap: f64,
}

fn default_true() -> bool {
    true
}
fn default_shed_at() -> f64 {
    0.85
}
fn default_close_at() -> f64 {
    0.95
}
fn default_resume_gap() -> f64 {
    0.05
}

impl Default for OverloadConfig {
    fn default() -> Self {
        OverloadConfig {
            enabled: true,
            memory_limit: None,
            shed_at: default_shed_at(),
            close_at: default_close_at(),
            resume_gap: default_resume_gap(),
        }
    }
}

/// Byte counts written as plain numbers or Kubernetes quantities.
pub mod bytes {
    use serde::Deserialize;

    /// `64Mi` (binary), `64M` (decimal), `64k`, or a plain count of bytes.
    pub fn parse(s: &str) -> Result<u64, String> {
        let s = s.trim();
        let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (n, unit) = s.split_at(digits);
        let n: u64 = n
            .parse()
            .map_err(|_| format!("{s:?} is not a byte count (for example 67108864 or 64Mi)"))?;
        let scale: u64 = match unit {
            "" => 1,
            "k" | "K" => 1_000,
            "M" => 1_000_000,
            "G" => 1_000_000_000,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {unit:?} (use Ki, Mi, Gi, k, M or G)"
                ))
            }
        };
        n.checked_mul(scale)
            .ok_or_else(|| format!("{s:?} is too large"))
    }

    pub fn deserialize_opt<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<u64>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(u64),
            Text(String),
        }
        match Option::<Raw>::deserialize(d)? {
            None => Ok(None),
            Some(Raw::Count(n)) => Ok(Some(n)),
            Some(Raw::Text(t)) => parse(&t).map(Some).map_err(serde::de::Error::custom),
        }
    }
}

/// The sample rate of traces the client side starts, unless `tracing.sample_rate` says.
pub const DEFAULT_SAMPLE_RATE: f64 = 0.01;

/// `tracing: { sample_rate, otlp }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The share of new traces (requests without `traceparent`) marked sampled, 0..=1.
    #[serde(default = "default_sample_rate")]
    pub sample_rate: f64,
    /// The OTLP/gRPC collector (`host:port`, plaintext); no spans are exported without it.
    #[serde(default)]
    pub otlp: Option<HostPort>,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            sample_rate: DEFAULT_SAMPLE_RATE,
            otlp: None,
        }
    }
}

fn default_sample_rate() -> f64 {
    DEFAULT_SAMPLE_RATE
}

/// `host:port` with a port in 1..65535 (the host is a name or an address, IPv6 in brackets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort(String);

impl HostPort {
    pub fn parse(s: &str) -> Result<HostPort, String> {
        let bad = || format!("{s:?} is not host:port");
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let host_ok = match host.strip_prefix('[') {
            Some(v6) => v6
                .strip_suffix(']')
                .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok()),
            None => {
                !host.is_empty()
                    && host
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
            }
        };
        let port_ok = !port.starts_with('0')
            && port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u16>().is_ok_and(|p| p > 0);
        if host_ok && port_ok {
            Ok(HostPort(s.to_string()))
        } else {
            Err(bad())
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for HostPort {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HostPort::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// `dns:` (SPEC section 10): where mesh names are answered and other names forwarded.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsConfig {
    /// UDP and TCP.
    #[serde(default = "default_dns_listen")]
    pub listen: SocketAddr,
    /// True: AAAA queries for mesh names get the service's IPv6 virtual address.
    #[serde(default)]
    pub ipv6: bool,
}

fn default_dns_listen() -> SocketAddr {
    "127.0.0.1:15053".parse().unwrap()
}

/// Connection caps (SPEC section 8). Envoy's overload manager plays this part there; the
/// defaults are the SPEC's and rarely need changing.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Open connections per data listener; past it new connections are closed at accept.
    #[serde(default = "default_max_connections")]
    pub max_connections_per_listener: usize,
    /// Inbound connections still in their TLS handshake; past it the oldest is closed.
    #[serde(default = "default_max_handshakes")]
    pub max_pending_handshakes: usize,
}

fn default_max_connections() -> usize {
    16384
}
fn default_max_handshakes() -> usize {
    1024
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_connections_per_listener: default_max_connections(),
            max_pending_handshakes: default_max_handshakes(),
        }
    }
}

fn default_mesh_domain() -> String {
    "aether.internal".into()
}
fn default_trust_domain() -> String {
    "aether.local".into()
}
fn default_inbound_listen() -> SocketAddr {
    "0.0.0.0:15008".parse().unwrap()
}
fn default_app_host() -> IpAddr {
    "127.0.0.1".parse().unwrap()
}
fn default_port() -> u16 {
    8080
}
fn default_outbound_listen() -> SocketAddr {
    "127.0.0.1:15001".parse().unwrap()
}
fn default_admin_listen() -> SocketAddr {
    "127.0.0.1:15000".parse().unwrap()
}
fn default_drain_notify() -> Duration {
    Duration::from_secs(5)
}
fn default_drain_timeout() -> Duration {
    Duration::from_secs(20)
}

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, FieldErrors> {
        Config::parse(path, &read_file(path)?)
    }

    /// Parses and validates configuration text; `file` is used in error messages.
    pub fn parse(file: &Path, text: &str) -> Result<Config, FieldErrors> {
        let mut cfg: Config = from_yaml(file, text)?;
        if cfg.inbound.ports.is_empty() {
            cfg.inbound.ports.push(InboundPort {
                port: cfg.inbound.default_port,
                protocol: Protocol::Auto,
                allow: Vec::new(),
                upgrades: None,
            });
        }
        let errors = cfg.validate(file);
        if errors.is_empty() {
            Ok(cfg)
        } else {
            Err(FieldErrors(errors))
        }
    }

    fn validate(&self, file: &Path) -> Vec<FieldError> {
        let origin = Origin::File(file.to_path_buf());
        let mut errs = Vec::new();
        let mut err =
            |field: String, reason: String| errs.push(FieldError::new(&origin, field, reason));
        let id = &self.identity;
        match (&id.cert, &id.key, &id.ca, &id.sds) {
            (Some(_), Some(_), Some(_), None) | (None, None, None, Some(_)) => {}
            (_, _, _, Some(_)) => err(
                "identity.sds".into(),
                "either cert, key and ca files or sds, not both".into(),
            ),
            _ => err(
                "identity".into(),
                "needs cert, key and ca (files) or sds (a secret discovery server)".into(),
            ),
        }
        if self.catalog.is_none() && self.discovery.is_none() {
            err(
                "catalog".into(),
                "missing field `catalog` (or `discovery` for a control plane)".into(),
            );
        }
        if !is_dns_name(&self.mesh_domain) {
            err(
                "mesh_domain".into(),
                format!("{:?} is not a domain name", self.mesh_domain),
            );
        }
        if !is_dns_name(&self.trust_domain) {
            err(
                "trust_domain".into(),
                format!("{:?} is not a trust domain", self.trust_domain),
            );
        }
        if self.inbound.default_port == 0 {
            err(
                "inbound.default_port".into(),
                "port must be in 1..65535".into(),
            );
        }
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.inbound.ports.iter().enumerate() {
            if p.port == 0 {
                err(
                    format!("inbound.ports[{i}].port"),
                    "port must be in 1..65535".into(),
                );
            } else if !seen.insert(p.port) {
                err(
                    format!("inbound.ports[{i}].port"),
                    format!("duplicate port {}", p.port),
                );
            }
            for (j, id) in p.allow.iter().enumerate() {
                if let Err(reason) = id.check_trust_domain(&self.trust_domain) {
                    err(format!("inbound.ports[{i}].allow[{j}]"), reason.to_string());
                }
            }
            if let Some(upgrades) = &p.upgrades {
                if matches!(p.protocol, Protocol::H2 | Protocol::Tcp) {
                    err(
                        format!("inbound.ports[{i}].upgrades"),
                        "only http1 and auto ports tunnel HTTP/1.1 upgrades".into(),
                    );
                }
                for (j, t) in upgrades.iter().enumerate() {
                    let token = t.split('/').next().unwrap_or_default();
                    if token.eq_ignore_ascii_case("h2c") {
                        err(
                            format!("inbound.ports[{i}].upgrades[{j}]"),
                            "h2c is never tunnelled: HTTP must stay HTTP through the proxy".into(),
                        );
                    } else if t.is_empty() || !t.bytes().all(is_tchar_or_slash) {
                        err(
                            format!("inbound.ports[{i}].upgrades[{j}]"),
                            format!("{t:?} is not an upgrade token (RFC 9110 7.8)"),
                        );
                    }
                }
            }
        }
        if !self
            .inbound
            .ports
            .iter()
            .any(|p| p.port == self.inbound.default_port)
        {
            err(
                "inbound.default_port".into(),
                format!(
                    "default port {} is not listed in inbound.ports",
                    self.inbound.default_port
                ),
            );
        }
        let mut seen = std::collections::HashSet::new();
        if self.readiness.required_listeners.len() > 16 {
            err(
                "readiness.required_listeners".into(),
                "at most 16 ports".into(),
            );
        }
        for (i, p) in self.readiness.required_listeners.iter().enumerate() {
            if *p == 0 {
                err(
                    format!("readiness.required_listeners[{i}]"),
                    "port must be in 1..65535".into(),
                );
            } else if !seen.insert(*p) {
                err(
                    format!("readiness.required_listeners[{i}]"),
                    format!("duplicate port {p}"),
                );
            }
        }
        let rate = self.tracing.sample_rate;
        if !(0.0..=1.0).contains(&rate) {
            err(
                "tracing.sample_rate".into(),
                format!("{rate} is not in 0..=1"),
            );
        }
        let o = &self.overload;
        if !(o.shed_at > 0.0 && o.shed_at < o.close_at && o.close_at <= 1.0) {
            err(
                "overload".into(),
                format!(
                    "shed_at {} and close_at {} must satisfy 0 < shed_at < close_at <= 1",
                    o.shed_at, o.close_at
                ),
            );
        }
        if !(0.0..o.shed_at).contains(&o.resume_gap) {
            err(
                "overload.resume_gap".into(),
                format!("{} is not in 0..shed_at", o.resume_gap),
            );
        }
        if o.memory_limit == Some(0) {
            err(
                "overload.memory_limit".into(),
                "0 bytes; leave it out to use the cgroup's limit, or set enabled: false".into(),
            );
        }
        if let Some(dns) = &self.dns {
            if dns.listen.port() == 0 {
                err("dns.listen".into(), "port must be in 1..65535".into());
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, s) in self.source_identities.iter().enumerate() {
            if !seen.insert(s.source) {
                err(
                    format!("source_identities[{i}].source"),
                    format!("duplicate source {}", s.source),
                );
            }
        }
        errs
    }

    /// The inbound chain config for `port`, if this pod serves it.
    pub fn inbound_port(&self, port: u16) -> Option<&InboundPort> {
        self.inbound.ports.iter().find(|p| p.port == port)
    }

    /// What the workload identity is built from.
    pub fn identity_spec(&self) -> IdentitySpec {
        let id = &self.identity;
        IdentitySpec {
            files: match (&id.cert, &id.key, &id.ca) {
                (Some(cert), Some(key), Some(ca)) => Some(IdentityPaths {
                    cert: cert.clone(),
                    key: key.clone(),
                    ca: ca.clone(),
                }),
                _ => None,
            },
            trust_domain: self.trust_domain.clone(),
            served: self
                .inbound
                .ports
                .iter()
                .map(|p| (p.port, p.protocol.server_alpn()))
                .collect(),
            sources: self
                .source_identities
                .iter()
                .map(|s| (s.source, s.cert.clone(), s.key.clone()))
                .collect(),
        }
    }
}

/// Lower-case DNS-ish name: labels of `[a-z0-9-]`, separated by dots.
/// A byte of an upgrade token: an RFC 9110 `tchar`, or the `/` before a version.
fn is_tchar_or_slash(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~/".contains(&b)
}

fn is_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "identity: {cert: c.crt, key: c.key, ca: ca.crt}\ncatalog: {path: cat.yaml}\n";

    fn errors(yaml: &str) -> Vec<String> {
        match Config::parse(Path::new("cfg.yaml"), yaml) {
            Ok(_) => vec![],
            Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
        }
    }

    fn one_error(yaml: &str) -> String {
        let e = errors(yaml);
        assert_eq!(e.len(), 1, "{e:?}");
        e[0].clone()
    }

    #[test]
    fn overload_limits_take_bytes_or_quantities_and_thresholds_must_be_ordered() {
        let cfg = |o: &str| Config::parse(Path::new("cfg.yaml"), &format!("{ID}overload: {o}\n"));
        let limit = |o: &str| cfg(o).unwrap().overload.memory_limit;
        assert_eq!(limit("{memory_limit: 67108864}"), Some(64 << 20));
        assert_eq!(limit("{memory_limit: 64Mi}"), Some(64 << 20));
        assert_eq!(limit("{memory_limit: 1G}"), Some(1_000_000_000));
        assert_eq!(limit("{}"), None);
        let d = cfg("{}").unwrap().overload;
        assert!(d.enabled && d.shed_at == 0.85 && d.close_at == 0.95 && d.resume_gap == 0.05);
        let e = one_error(&format!("{ID}overload: {{memory_limit: 64MB}}\n"));
        assert!(e.contains("unknown unit"), "{e}");
        let e = one_error(&format!("{ID}overload: {{shed_at: 0.9, close_at: 0.8}}\n"));
        assert!(e.contains("0 < shed_at < close_at <= 1"), "{e}");
        let e = one_error(&format!("{ID}overload: {{resume_gap: 0.9}}\n"));
        assert!(e.contains("overload.resume_gap"), "{e}");
        let e = one_error(&format!("{ID}overload: {{memory_limit: 0}}\n"));
        assert!(e.contains("overload.memory_limit"), "{e}");
    }

    #[test]
    fn the_spec_example_parses_with_its_defaults() {
        let c = Config::parse(Path::new("cfg.yaml"), ID).unwrap();
        assert_eq!(c.mesh_domain, "aether.internal");
        assert_eq!(c.trust_domain, "aether.local");
        assert_eq!(c.inbound.listen.to_string(), "0.0.0.0:15008");
        assert_eq!(c.outbound.listen.to_string(), "127.0.0.1:15001");
        assert_eq!(c.admin.listen.to_string(), "127.0.0.1:15000");
        assert_eq!(c.inbound.default_port, 8080);
        assert_eq!(c.inbound.ports.len(), 1);
        assert_eq!(c.inbound.ports[0].protocol, Protocol::Auto);
        assert_eq!(c.drain.notify, Duration::from_secs(5));
        assert_eq!(c.drain.timeout, Duration::from_secs(20));
        let full = format!(
            "{ID}locality: us-east1/us-east1-b\nsource_identities:\n  - {{source: 127.0.0.5, cert: o.crt, key: o.key}}\n\
             inbound:\n  default_port: 8080\n  ports:\n    - {{port: 8080, protocol: auto}}\n    - {{port: 9090, protocol: h2}}\n\
             \x20   - {{port: 5432, protocol: tcp, allow: [spiffe://aether.local/ns/default/sa/frontend]}}\n\
             readiness: {{required_listeners: [8080, 9090]}}\ndrain: {{notify: 250ms, timeout: 1m}}\n"
        );
        let c = Config::parse(Path::new("cfg.yaml"), &full).unwrap();
        assert_eq!(c.locality.clone().unwrap().zone, "us-east1-b");
        assert_eq!(c.inbound_port(5432).unwrap().allow.len(), 1);
        assert_eq!(c.drain.notify, Duration::from_millis(250));
        assert_eq!(c.drain.timeout, Duration::from_secs(60));
    }

    #[test]
    fn errors_name_file_field_and_reason() {
        let e = one_error(&format!("{ID}inbound: {{bogus: 1}}\n"));
        assert!(
            e.starts_with("cfg.yaml: inbound.bogus: unknown field `bogus`"),
            "{e}"
        );
        let e = one_error(&format!("{ID}drain: {{notify: 5x}}\n"));
        assert!(
            e.starts_with("cfg.yaml: drain.notify: \"5x\" is not a duration"),
            "{e}"
        );
        let e = one_error(&format!("{ID}drain: {{timeout: 0s}}\n"));
        assert!(
            e.contains("drain.timeout") && e.contains("greater than zero"),
            "{e}"
        );
        let e = one_error(&format!("{ID}inbound: {{default_port: 70000}}\n"));
        assert!(e.starts_with("cfg.yaml: inbound.default_port: "), "{e}");
        let e = one_error("catalog: {path: x}\n");
        assert!(e.contains("missing field `identity`"), "{e}");
        let e = one_error(&format!("{ID}inbound: [1, 2\n"));
        assert!(e.starts_with("cfg.yaml: "), "{e}");
    }

    #[test]
    fn upgrade_tokens_are_checked() {
        let c = Config::parse(
            Path::new("cfg.yaml"),
            &format!(
                "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto, upgrades: [WebSocket, x-echo]}}\n"
            ),
        )
        .unwrap();
        assert_eq!(c.inbound.ports[0].upgrade_tokens(), ["websocket", "x-echo"]);
        let c = Config::parse(Path::new("cfg.yaml"), ID).unwrap();
        assert_eq!(c.inbound.ports[0].upgrade_tokens(), ["websocket"]);
        let e = one_error(&format!(
            "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto, upgrades: [websocket, h2c]}}\n"
        ));
        assert!(
            e.starts_with("cfg.yaml: inbound.ports[0].upgrades[1]: h2c is never tunnelled"),
            "{e}"
        );
        let e = one_error(&format!(
            "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto, upgrades: [\"a b\"]}}\n"
        ));
        assert!(e.contains("is not an upgrade token"), "{e}");
        let e = errors(&format!(
            "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto}}\n    - {{port: 9090, protocol: h2, upgrades: [websocket]}}\n"
        ));
        assert!(
            e.iter().any(|e| e
                == "cfg.yaml: inbound.ports[1].upgrades: only http1 and auto ports tunnel HTTP/1.1 upgrades"),
            "{e:?}"
        );
    }

    #[test]
    fn ports_are_checked() {
        let e = errors(&format!(
            "{ID}inbound:\n  default_port: 8081\n  ports:\n    - {{port: 8080, protocol: auto}}\n    - {{port: 8080, protocol: h2}}\n    - {{port: 0, protocol: tcp}}\n"
        ));
        assert!(
            e.iter()
                .any(|e| e == "cfg.yaml: inbound.ports[1].port: duplicate port 8080"),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|e| e == "cfg.yaml: inbound.ports[2].port: port must be in 1..65535"),
            "{e:?}"
        );
        assert!(
            e.iter().any(|e| e
                .starts_with("cfg.yaml: inbound.default_port: default port 8081 is not listed")),
            "{e:?}"
        );
        let e = one_error(&format!(
            "{ID}inbound:\n  ports: [{{port: 8080, protocol: quic}}]\n"
        ));
        assert!(
            e.starts_with("cfg.yaml: inbound.ports[0].protocol: unknown variant `quic`"),
            "{e}"
        );
    }

    #[test]
    fn identities_must_be_in_the_trust_domain() {
        let e = one_error(&format!(
            "{ID}inbound:\n  ports: [{{port: 8080, protocol: auto, allow: [spiffe://other.td/ns/a/sa/b]}}]\n"
        ));
        assert!(
            e.starts_with("cfg.yaml: inbound.ports[0].allow[0]: ")
                && e.contains("outside the trust domain"),
            "{e}"
        );
        let e = one_error(&format!(
            "{ID}inbound:\n  ports: [{{port: 8080, protocol: auto, allow: [frontend]}}]\n"
        ));
        assert!(e.contains("is not a SPIFFE id"), "{e}");
    }

    #[test]
    fn required_listeners_are_bounded_and_unique() {
        let e = one_error(&format!(
            "{ID}readiness: {{required_listeners: [8080, 8080]}}\n"
        ));
        assert_eq!(
            e,
            "cfg.yaml: readiness.required_listeners[1]: duplicate port 8080"
        );
        let e = one_error(&format!("{ID}readiness: {{required_listeners: [0]}}\n"));
        assert_eq!(
            e,
            "cfg.yaml: readiness.required_listeners[0]: port must be in 1..65535"
        );
        let e = one_error(&format!("{ID}readiness: {{required_listeners: [65536]}}\n"));
        assert!(
            e.starts_with("cfg.yaml: readiness.required_listeners[0]: "),
            "{e}"
        );
        let many: Vec<String> = (1..=17).map(|p| p.to_string()).collect();
        let e = one_error(&format!(
            "{ID}readiness: {{required_listeners: [{}]}}\n",
            many.join(",")
        ));
        assert_eq!(
            e,
            "cfg.yaml: readiness.required_listeners: at most 16 ports"
        );
        assert!(errors(&format!(
            "{ID}readiness: {{required_listeners: [1, 65535]}}\n"
        ))
        .is_empty());
    }

    #[test]
    fn tracing_is_optional_and_checked() {
        let c = Config::parse(Path::new("cfg.yaml"), ID).unwrap();
        assert_eq!(c.tracing.sample_rate, 0.01);
        assert!(c.tracing.otlp.is_none());
        let c = Config::parse(
            Path::new("cfg.yaml"),
            &format!(
                "{ID}tracing: {{sample_rate: 1, otlp: \"otel-collector.observability:4317\"}}\n"
            ),
        )
        .unwrap();
        assert_eq!(c.tracing.sample_rate, 1.0);
        assert_eq!(
            c.tracing.otlp.unwrap().as_str(),
            "otel-collector.observability:4317"
        );
        assert!(errors(&format!("{ID}tracing: {{otlp: \"[::1]:4317\"}}\n")).is_empty());
        for (yaml, want) in [
            (
                "{sample_rate: 1.5}",
                "cfg.yaml: tracing.sample_rate: 1.5 is not in 0..=1",
            ),
            (
                "{sample_rate: -0.1}",
                "cfg.yaml: tracing.sample_rate: -0.1 is not in 0..=1",
            ),
            (
                "{sample_rate: .nan}",
                "cfg.yaml: tracing.sample_rate: NaN is not in 0..=1",
            ),
            (
                "{otlp: collector}",
                "cfg.yaml: tracing.otlp: \"collector\" is not host:port",
            ),
            (
                "{otlp: \"c:0\"}",
                "cfg.yaml: tracing.otlp: \"c:0\" is not host:port",
            ),
            (
                "{otlp: \"http://c:4317\"}",
                "cfg.yaml: tracing.otlp: \"http://c:4317\" is not host:port",
            ),
            ("{sample_rate: often}", "cfg.yaml: tracing.sample_rate: "),
            (
                "{endpoint: x}",
                "cfg.yaml: tracing.endpoint: unknown field `endpoint`",
            ),
        ] {
            let e = one_error(&format!("{ID}tracing: {yaml}\n"));
            assert!(e.starts_with(want), "{yaml}: {e}");
        }
    }

    #[test]
    fn dns_is_optional_and_strict() {
        let c = Config::parse(Path::new("cfg.yaml"), ID).unwrap();
        assert!(c.dns.is_none());
        let c = Config::parse(Path::new("cfg.yaml"), &format!("{ID}dns: {{}}\n")).unwrap();
        let dns = c.dns.unwrap();
        assert_eq!(dns.listen.to_string(), "127.0.0.1:15053");
        assert!(!dns.ipv6);
        let c = Config::parse(
            Path::new("cfg.yaml"),
            &format!("{ID}dns: {{listen: 127.0.0.9:53, ipv6: true}}\n"),
        )
        .unwrap();
        assert!(c.dns.as_ref().unwrap().ipv6);
        assert_eq!(c.dns.unwrap().listen.to_string(), "127.0.0.9:53");
        let e = one_error(&format!("{ID}dns: {{listen: 127.0.0.1:15053, ttl: 5}}\n"));
        assert!(
            e.starts_with("cfg.yaml: dns.ttl: unknown field `ttl`"),
            "{e}"
        );
        let e = one_error(&format!("{ID}dns: {{listen: 127.0.0.1:0}}\n"));
        assert_eq!(e, "cfg.yaml: dns.listen: port must be in 1..65535");
        let e = one_error(&format!("{ID}dns: {{listen: nowhere}}\n"));
        assert!(e.starts_with("cfg.yaml: dns.listen: "), "{e}");
        let e = one_error(&format!("{ID}dns: {{ipv6: maybe}}\n"));
        assert!(e.starts_with("cfg.yaml: dns.ipv6: "), "{e}");
    }

    #[test]
    fn egress_is_deny_or_passthrough() {
        let c = Config::parse(Path::new("cfg.yaml"), ID).unwrap();
        assert_eq!(c.outbound.egress, Egress::Deny);
        let c = Config::parse(
            Path::new("cfg.yaml"),
            &format!("{ID}outbound: {{egress: passthrough}}\n"),
        )
        .unwrap();
        assert_eq!(c.outbound.egress, Egress::Passthrough);
        assert_eq!(c.outbound.listen.to_string(), "127.0.0.1:15001");
        let e = one_error(&format!("{ID}outbound: {{egress: allow}}\n"));
        assert!(
            e.starts_with("cfg.yaml: outbound.egress: unknown variant `allow`"),
            "{e}"
        );
    }

    #[test]
    fn locality_shape() {
        let e = one_error(&format!("{ID}locality: justone\n"));
        assert!(
            e.starts_with("cfg.yaml: locality: ") && e.contains("region/zone"),
            "{e}"
        );
    }
}
