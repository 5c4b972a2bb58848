//! The data listeners: `inbound:` (its ports and their chain `Protocol`), `outbound:` (and
//! `outbound.egress`), `dns:`, and the connection caps of `limits:`.

use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use crate::identity::tls::{ServerAlpn, ALPN_H2, ALPN_HTTP1};
use crate::identity::SpiffeId;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

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
}
