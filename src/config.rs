//! The sidecar's own configuration file (`--config`, SPEC section 3).
//!
//! Parsing is strict (unknown fields are errors) and every error names the file, the field path
//! and the reason. Relative file paths are taken relative to the working directory, as Envoy does.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// One problem found in a configuration or catalog file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    pub file: PathBuf,
    /// Field path such as `inbound.ports[1].port`; empty when the whole file is at fault.
    pub field: String,
    pub reason: String,
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.file.display(), self.reason)
        } else {
            write!(
                f,
                "{}: {}: {}",
                self.file.display(),
                self.field,
                self.reason
            )
        }
    }
}

impl std::error::Error for FileError {}

/// All problems found in one file (validation keeps going after the first one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileErrors(pub Vec<FileError>);

impl fmt::Display for FileErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for FileErrors {}

/// Application protocol of an inbound chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    H2,
    Http1,
    Auto,
    Tcp,
}

impl Protocol {
    pub fn is_http(self) -> bool {
        self != Protocol::Tcp
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

    pub fn parse(s: &str) -> Result<Duration, String> {
        let d = humantime::parse_duration(s.trim())
            .map_err(|_| format!("{s:?} is not a duration like \"5s\" or \"250ms\""))?;
        if d.is_zero() {
            return Err(format!("{s:?} must be greater than zero"));
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
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
    pub allow: Vec<String>,
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
}

impl Default for OutboundConfig {
    fn default() -> Self {
        OutboundConfig {
            listen: default_outbound_listen(),
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
    #[serde(default)]
    pub readiness: ReadinessConfig,
    pub catalog: CatalogConfig,
    #[serde(default)]
    pub drain: DrainConfig,
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

/// Deserializes `text` as YAML into `T`, reporting the failing field path.
pub(crate) fn from_yaml<T: serde::de::DeserializeOwned>(
    file: &Path,
    text: &str,
) -> Result<T, FileError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." { String::new() } else { field };
        let mut reason = e.into_inner().to_string();
        // The YAML library prefixes its own notion of the path; ours is already in `field`.
        let mut prefix = field.as_str();
        while !prefix.is_empty() {
            if let Some(rest) = reason.strip_prefix(&format!("{prefix}: ")) {
                reason = rest.to_string();
                break;
            }
            prefix = prefix.rsplit_once('.').map_or("", |(p, _)| p);
        }
        FileError {
            file: file.to_path_buf(),
            field,
            reason,
        }
    })
}

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, FileErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            FileErrors(vec![FileError {
                file: path.to_path_buf(),
                field: String::new(),
                reason: format!("cannot read: {e}"),
            }])
        })?;
        Config::parse(path, &text)
    }

    /// Parses and validates configuration text; `file` is used in error messages.
    pub fn parse(file: &Path, text: &str) -> Result<Config, FileErrors> {
        let mut cfg: Config = from_yaml(file, text).map_err(|e| FileErrors(vec![e]))?;
        if cfg.inbound.ports.is_empty() {
            cfg.inbound.ports.push(InboundPort {
                port: cfg.inbound.default_port,
                protocol: Protocol::Auto,
                allow: Vec::new(),
            });
        }
        let errors = cfg.validate(file);
        if errors.is_empty() {
            Ok(cfg)
        } else {
            Err(FileErrors(errors))
        }
    }

    fn validate(&self, file: &Path) -> Vec<FileError> {
        let mut errs = Vec::new();
        let mut err = |field: String, reason: String| {
            errs.push(FileError {
                file: file.to_path_buf(),
                field,
                reason,
            })
        };
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
                if let Err(reason) = check_spiffe_id(id, &self.trust_domain) {
                    err(format!("inbound.ports[{i}].allow[{j}]"), reason);
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
}

/// Lower-case DNS-ish name: labels of `[a-z0-9-]`, separated by dots.
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

/// A SPIFFE id `spiffe://<trust_domain>/<path>` in the given trust domain.
pub fn check_spiffe_id(id: &str, trust_domain: &str) -> Result<(), String> {
    let Some(rest) = id.strip_prefix("spiffe://") else {
        return Err(format!(
            "{id:?} is not a SPIFFE id (spiffe://<trust domain>/<path>)"
        ));
    };
    let (td, path) = rest.split_once('/').unwrap_or((rest, ""));
    if td != trust_domain {
        return Err(format!(
            "{id:?} is outside the trust domain {trust_domain:?}"
        ));
    }
    if path.is_empty() {
        return Err(format!("{id:?} has no workload path"));
    }
    Ok(())
}
