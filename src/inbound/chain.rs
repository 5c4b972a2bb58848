//! Where the inbound chain is chosen: the ClientHello's SNI against the ports this pod serves.

use std::collections::HashMap;

use super::clienthello::{classify_sni, SniKind};
use crate::config::{InboundConfig, Protocol};

#[derive(Debug, Clone)]
pub struct Chain {
    pub port: u16,
    pub protocol: Protocol,
    /// Empty: every identity of the trust domain.
    pub allow: Vec<String>,
}

impl Chain {
    pub fn allows(&self, peer: &str) -> bool {
        self.allow.is_empty() || self.allow.iter().any(|a| a == peer)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::InboundPort;

    fn chains() -> Chains {
        let port = |port, protocol| InboundPort {
            port,
            protocol,
            allow: vec![],
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
