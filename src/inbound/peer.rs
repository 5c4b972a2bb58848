//! The verified peer of one inbound connection: who it is (its SPIFFE id, checked by the TLS
//! verify callback) and the hash of its leaf for XFCC.

use tokio::net::TcpStream;

use crate::identity::{san, tls, SpiffeId};

/// The inbound TLS stream: the ClientHello bytes replayed, then the socket, read ahead.
pub type TlsStream = crate::sockets::Tls<crate::sockets::ReadAhead<TcpStream>>;

pub struct Peer {
    pub spiffe_id: SpiffeId,
    /// Lower-case hex SHA-256 of the peer's leaf DER.
    pub cert_hash: String,
}

impl Peer {
    /// The peer of an established connection; `None` without a leaf carrying one SPIFFE id of
    /// `trust_domain` (which the verify callback already insisted on).
    pub fn of(tls: &TlsStream, trust_domain: &str) -> Option<Peer> {
        let der = tls::peer_leaf_der(tls.ssl())?;
        let (digest, id) = san::read_leaf(der);
        let spiffe_id = id.ok().filter(|id| id.trust_domain() == trust_domain)?;
        Some(Peer {
            spiffe_id,
            cert_hash: hex::encode(digest),
        })
    }
}
