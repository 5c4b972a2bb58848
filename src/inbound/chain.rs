//! Where the inbound chain is chosen, and what a chain is: the ClientHello's SNI against the
//! ports this pod serves, and for each port its protocol (which decides the TLS ALPN, see
//! `Protocol::server_alpn`, and the server that takes the connection after TLS), and its
//! `allow` list.

use std::collections::HashMap;

use http::Version;

use crate::config::{InboundConfig, Protocol};
use crate::identity::tls::ALPN_H2;
use crate::identity::SpiffeId;

#[derive(Debug, Clone)]
pub struct Chain {
    pub port: u16,
    pub protocol: Protocol,
    /// Empty: every identity of the trust domain.
    pub allow: Vec<SpiffeId>,
    /// The HTTP/1.1 upgrade tokens tunnelled to the app (lowercased).
    pub upgrades: Vec<String>,
}

/// What serves a chain's connection once TLS is up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// Bytes both ways to the app port.
    Tcp,
    Http(HttpCodec),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpCodec {
    H1,
    H2,
    /// No ALPN on an `auto` chain: the HTTP/2 preface decides.
    Sniff,
}

impl Chain {
    pub fn allows(&self, peer: &SpiffeId) -> bool {
        self.allow.is_empty() || self.allow.iter().any(|a| a == peer)
    }

    /// The server for a connection that negotiated `alpn`.
    pub fn server(&self, alpn: Option<&[u8]>) -> Server {
        match self.protocol {
            Protocol::Tcp => Server::Tcp,
            Protocol::H2 => Server::Http(HttpCodec::H2),
            Protocol::Http1 => Server::Http(HttpCodec::H1),
            Protocol::Auto => Server::Http(match alpn {
                Some(p) if p == ALPN_H2 => HttpCodec::H2,
                Some(_) => HttpCodec::H1,
                None => HttpCodec::Sniff,
            }),
        }
    }

    /// Whether a request that arrived as `version` goes to the app as HTTP/2: `h2` chains
    /// always, `http1` never, `auto` as it arrived.
    pub fn to_app_h2(&self, version: Version) -> bool {
        match self.protocol {
            Protocol::H2 => true,
            Protocol::Http1 | Protocol::Tcp => false,
            Protocol::Auto => version == Version::HTTP_2,
        }
    }
}

pub struct Chains {
    by_port: HashMap<u16, Chain>,
    default_port: u16,
}

impl Chains {
    pub fn new(cfg: &InboundConfig) -> Chains {
        Chains {
            by_port: cfg
                .ports
                .iter()
                .map(|p| {
                    (
                        p.port,
                        Chain {
                            port: p.port,
                            protocol: p.protocol,
                            allow: p.allow.clone(),
                            upgrades: p.upgrade_tokens(),
                        },
                    )
                })
                .collect(),
            default_port: cfg.default_port,
        }
    }

    /// SPEC's inbound table. `None`: a port-shaped SNI for a port this pod does not serve, to
    /// be refused with `unrecognized_name` (never the default chain).
    pub fn select(&self, sni: Option<&str>) -> Option<&Chain> {
        match classify_sni(sni) {
            SniKind::Port(p) => self.by_port.get(&p),
            SniKind::BadPort => None,
            SniKind::Absent | SniKind::Other => self.by_port.get(&self.default_port),
        }
    }
}

/// How the inbound chain selector reads a ClientHello's SNI (SPEC 1, "Inbound").
///
/// Port-shaped means all ASCII digits, or `p-` (any case) followed by ASCII digits: what the mesh
/// sends ("9090") and its DNS-shaped alias ("p-9090").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SniKind {
    /// No SNI (or an empty one): the default chain.
    Absent,
    /// A port-shaped SNI naming port P in 1..=65535, written canonically (no leading zero).
    Port(u16),
    /// Port-shaped but naming no valid port: 0, above 65535 (any number of digits), or with a
    /// leading zero ("09090", which Envoy's exact-string match would not take for "9090"). The
    /// caller refuses it like an unserved port (alert `unrecognized_name`), never the default chain.
    BadPort,
    /// Anything else (an FQDN, "bogus", "9090.", "+9090"): the default chain.
    Other,
}

/// Classifies an SNI for chain selection. Pure and total.
pub fn classify_sni(sni: Option<&str>) -> SniKind {
    let Some(sni) = sni else {
        return SniKind::Absent;
    };
    if sni.is_empty() {
        return SniKind::Absent;
    }
    let digits = match sni.as_bytes() {
        [b'p' | b'P', b'-', rest @ ..] => rest,
        all => all,
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return SniKind::Other;
    }
    if digits[0] == b'0' {
        return SniKind::BadPort;
    }
    let mut port: u32 = 0;
    for &d in digits {
        port = port * 10 + u32::from(d - b'0');
        if port > u32::from(u16::MAX) {
            return SniKind::BadPort;
        }
    }
    match u16::try_from(port) {
        Ok(p) => SniKind::Port(p),
        Err(_) => SniKind::BadPort,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::InboundPort;

    fn chains() -> Chains {
        let port = |port, protocol| InboundPort {
            port,
            protocol,
            allow: vec![],
            upgrades: None,
        };
        Chains::new(&InboundConfig {
            default_port: 8080,
            ports: vec![port(8080, Protocol::Auto), port(9090, Protocol::H2)],
            ..Default::default()
        })
    }

    #[test]
    fn the_inbound_table() {
        let c = chains();
        let port = |sni| c.select(sni).map(|c| c.port);
        assert_eq!(port(Some("8080")), Some(8080));
        assert_eq!(port(Some("9090")), Some(9090));
        assert_eq!(port(Some("p-9090")), Some(9090));
        assert_eq!(port(None), Some(8080));
        assert_eq!(port(Some("payments.aether.internal")), Some(8080));
        assert_eq!(port(Some("7777")), None);
        assert_eq!(port(Some("p-7777")), None);
        assert_eq!(port(Some("99999")), None);
    }
}
