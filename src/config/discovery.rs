//! Where the mesh's services come from: the catalog file (`catalog:`) or a control plane
//! (`discovery.xds`), and the address of a gRPC server (xDS, SDS).

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogConfig {
    pub path: PathBuf,
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
