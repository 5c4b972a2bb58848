//! The sidecar's own configuration file (`--config`, SPEC section 3).
//!
//! Parsing is strict (unknown fields are errors) and every error names the file, the field path
//! and the reason. Relative file paths are taken relative to the working directory, as Envoy does.
//!
//! One file per part of the file: the identity (`identity.rs`), the data listeners and their
//! caps (`listeners.rs`), where services come from (`discovery.rs`), the operator's side
//! (`admin.rs`), overload (`overload.rs`), tracing (`trace.rs`), the pod's locality
//! (`locality.rs`); durations and byte counts as files write them (`duration.rs`, `bytes.rs`);
//! and the checks past parsing (`validate.rs`).

mod admin;
pub mod bytes;
mod discovery;
pub(crate) mod duration;
mod identity;
mod listeners;
mod locality;
mod overload;
mod trace;
mod validate;

use std::path::Path;

use serde::Deserialize;

use crate::identity::{IdentityPaths, IdentitySpec};
use crate::validation::{from_yaml, read_file, FieldErrors};

pub use admin::{AdminConfig, DrainConfig, HealthConfig, ReadinessConfig};
pub use discovery::{CatalogConfig, DiscoveryConfig, GrpcAddress, XdsConfig};
pub use identity::{IdentityFiles, SourceIdentity};
pub use listeners::{
    DnsConfig, Egress, InboundConfig, InboundPort, LimitsConfig, OutboundConfig, Protocol,
};
pub use locality::Locality;
pub use overload::OverloadConfig;
pub use trace::{TracingConfig, DEFAULT_SAMPLE_RATE};

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

fn default_mesh_domain() -> String {
    "aether.internal".into()
}
fn default_trust_domain() -> String {
    "aether.local".into()
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

    /// The inbound chain config for `port`, if this pod serves it.
    #[cfg(any(test, feature = "testing"))] // unit tests and the `config` fuzz target
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use test_support::*;

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
}

/// What the tests of each part share: a minimal valid file, and its errors.
#[cfg(test)]
mod test_support {
    pub use super::Config;
    pub use std::path::Path;

    pub const ID: &str =
        "identity: {cert: c.crt, key: c.key, ca: ca.crt}\ncatalog: {path: cat.yaml}\n";

    pub fn errors(yaml: &str) -> Vec<String> {
        match Config::parse(Path::new("cfg.yaml"), yaml) {
            Ok(_) => vec![],
            Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
        }
    }

    pub fn one_error(yaml: &str) -> String {
        let e = errors(yaml);
        assert_eq!(e.len(), 1, "{e:?}");
        e[0].clone()
    }
}
