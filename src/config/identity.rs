//! `identity:` and `source_identities:`, where the workload's certificates come from.

use std::net::IpAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::discovery::GrpcAddress;

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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceIdentity {
    pub source: IpAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
}
