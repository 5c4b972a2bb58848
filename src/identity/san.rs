//! SPIFFE URI SANs: reading them out of a certificate and checking them.
//!
//! A leaf is an identity only when it carries exactly one URI SAN and that URI is a strict
//! SPIFFE id (SPEC section 8, the X509-SVID rule). Any other URI, or a second one, refuses the
//! leaf on both sides: the inbound verify callback and the outbound pin use the same reading.

use std::cell::RefCell;
use std::collections::HashMap;

use x509_parser::extensions::GeneralName;

use super::spiffe::SpiffeId;

/// Why a leaf is not one workload's identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeafIdError {
    #[error("not a readable X.509 certificate")]
    Unreadable,
    #[error("no URI SAN")]
    NoUri,
    #[error("{0} URI SANs (one SPIFFE id expected): {1:?}")]
    SeveralUris(usize, Vec<String>),
    #[error("URI SAN {0:?} is not a SPIFFE id: {1}")]
    NotSpiffe(String, super::spiffe::SpiffeIdError),
    #[error("{id} is outside the trust domain {trust_domain:?}")]
    OtherTrustDomain { id: SpiffeId, trust_domain: String },
}

/// Every URI SAN of `der`, in certificate order (for error messages).
pub fn uri_sans(der: &[u8]) -> Vec<String> {
    match x509_parser::parse_x509_certificate(der) {
        Ok((_, cert)) => uris_of(&cert),
        Err(_) => Vec::new(),
    }
}

fn uris_of(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some(u.to_string()),
            _ => None,
        })
        .collect()
}

/// The one SPIFFE id a leaf proves: exactly one URI SAN, strictly shaped. DNS and other SAN
/// kinds may sit beside it (the X509-SVID rule allows them); they identify nothing here.
/// The certificate is parsed once here; the data path asks [`read_leaf`], which remembers.
pub fn leaf_id(der: &[u8]) -> Result<SpiffeId, LeafIdError> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Err(LeafIdError::Unreadable);
    };
    let mut uris = uris_of(&cert);
    match uris.len() {
        0 => Err(LeafIdError::NoUri),
        1 => {
            let uri = uris.remove(0);
            SpiffeId::parse(&uri).map_err(|e| LeafIdError::NotSpiffe(uri, e))
        }
        n => Err(LeafIdError::SeveralUris(n, uris)),
    }
}

/// Identities a thread has read lately, by their leaf's SHA-256.
const REMEMBERED_LEAVES: usize = 256;

/// A peer leaf as the data path needs it: its SHA-256 (XFCC's `Hash=`) and [`leaf_id`]. Every
/// connection to or from a peer brings one of a few leaves again (resumed handshakes
/// included), and x509-parser reads a whole certificate to find its SAN, several times what
/// the digest costs; so each thread remembers the identities it read, by digest (a leaf that
/// proves none is read again each time). The digest names the DER exactly, so what is
/// remembered is what reading it again would give.
pub fn read_leaf(der: &[u8]) -> ([u8; 32], Result<SpiffeId, LeafIdError>) {
    thread_local! {
        static SEEN: RefCell<HashMap<[u8; 32], SpiffeId>> = RefCell::new(HashMap::new());
    }
    let digest = boring::sha::sha256(der);
    if let Some(id) = SEEN.with_borrow(|m| m.get(&digest).cloned()) {
        return (digest, Ok(id));
    }
    let id = leaf_id(der);
    if let Ok(id) = &id {
        SEEN.with_borrow_mut(|m| {
            // Bounded by forgetting all at once: the leaves in use come back at their next
            // connection, and certificates rotate, so old digests would otherwise pile up.
            if m.len() >= REMEMBERED_LEAVES {
                m.clear();
            }
            m.insert(digest, id.clone());
        });
    }
    (digest, id)
}

/// [`leaf_id`], inside `trust_domain`.
pub fn leaf_id_in(der: &[u8], trust_domain: &str) -> Result<SpiffeId, LeafIdError> {
    let id = read_leaf(der).1?;
    if id.trust_domain() != trust_domain {
        return Err(LeafIdError::OtherTrustDomain {
            id,
            trust_domain: trust_domain.to_string(),
        });
    }
    Ok(id)
}

/// The certificate's SPIFFE id inside `trust_domain`, when the leaf is one identity.
pub fn spiffe_id_in(der: &[u8], trust_domain: &str) -> Option<SpiffeId> {
    leaf_id_in(der, trust_domain).ok()
}

/// The identity pin: the leaf proves exactly one SPIFFE id, and it is `expected`.
pub fn is_pinned(der: &[u8], expected: &SpiffeId) -> bool {
    read_leaf(der).1.is_ok_and(|id| id == *expected)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::certgen::{self, Workload};

    /// Leaves read again come back with their own identity and digest, never another leaf's,
    /// also after the thread has forgotten what it read once its memory was full; a leaf
    /// outside the trust domain stays refused however often it is read.
    #[test]
    fn a_remembered_leaf_is_the_leaf_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<String> = (0..REMEMBERED_LEAVES + 40)
            .map(|i| format!("default/w{i}"))
            .collect();
        let ws: Vec<Workload> = names.iter().map(|n| Workload::parse(n).unwrap()).collect();
        certgen::generate(dir.path(), "aether.local", &ws).unwrap();
        let leaves: Vec<Vec<u8>> = (0..names.len())
            .map(|i| {
                let pem = std::fs::read(dir.path().join(format!("w{i}.crt"))).unwrap();
                boring::x509::X509::from_pem(&pem)
                    .unwrap()
                    .to_der()
                    .unwrap()
            })
            .collect();
        let want = |d: &[u8]| (boring::sha::sha256(d), leaf_id(d).unwrap());
        for round in 0..2 {
            for (i, d) in leaves.iter().enumerate() {
                let (digest, id) = read_leaf(d);
                assert_eq!((digest, id.unwrap()), want(d), "round {round}, leaf {i}");
                assert!(leaf_id_in(d, "other.local").is_err());
            }
        }
        assert!(is_pinned(&leaves[1], &leaf_id(&leaves[1]).unwrap()));
        assert!(!is_pinned(&leaves[1], &leaf_id(&leaves[0]).unwrap()));
        read_leaf(b"not a certificate").1.unwrap_err();
    }
}
