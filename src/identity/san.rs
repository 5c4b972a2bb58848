//! SPIFFE URI SANs: reading them out of a certificate and checking them.
//!
//! A leaf is an identity only when it carries exactly one URI SAN and that URI is a strict
//! SPIFFE id (SPEC section 8, the X509-SVID rule). Any other URI, or a second one, refuses the
//! leaf on both sides: the inbound verify callback and the outbound pin use the same reading.

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
/// Runs on every handshake, resumed ones included, so the certificate is parsed once.
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

/// [`leaf_id`], inside `trust_domain`.
pub fn leaf_id_in(der: &[u8], trust_domain: &str) -> Result<SpiffeId, LeafIdError> {
    let id = leaf_id(der)?;
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
    leaf_id(der).is_ok_and(|id| id == *expected)
}

/// Lower-case hex SHA-256 of a DER certificate (the `Hash=` of x-forwarded-client-cert).
pub fn der_sha256_hex(der: &[u8]) -> String {
    hex::encode(boring::sha::sha256(der))
}
