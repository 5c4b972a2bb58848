//! The operator's side: `admin:`, the kubelet's `health:` port, `readiness:` and `drain:`.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::duration;

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

fn default_admin_listen() -> SocketAddr {
    "127.0.0.1:15000".parse().unwrap()
}
fn default_drain_notify() -> Duration {
    Duration::from_secs(5)
}
fn default_drain_timeout() -> Duration {
    Duration::from_secs(20)
}
