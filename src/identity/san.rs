//! SPIFFE URI SANs: reading them out of a certificate and checking them.

use x509_parser::extensions::GeneralName;

use super::spiffe::SpiffeId;

/// Every URI SAN of `der` that is a SPIFFE id (`spiffe://...`), in certificate order.
pub fn spiffe_ids(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) if u.starts_with("spiffe://") => Some(u.to_string()),
            _ => None,
        })
        .collect()
}

/// The certificate's SPIFFE id inside `trust_domain`, if it carries exactly one such id.
pub fn spiffe_id_in(der: &[u8], trust_domain: &str) -> Option<SpiffeId> {
    let mut ids = spiffe_ids(der)
        .into_iter()
        .filter_map(|id| SpiffeId::parse_in(&id, trust_domain).ok());
    let id = ids.next()?;
    // Two ids in one leaf would make "who is this peer" ambiguous; refuse such certificates.
    ids.next().is_none().then_some(id)
}

/// True when the certificate carries `expected` as a URI SAN: the identity pin.
pub fn has_uri_san(der: &[u8], expected: &SpiffeId) -> bool {
    spiffe_ids(der).iter().any(|id| expected == id.as_str())
}

/// Lower-case hex SHA-256 of a DER certificate (the `Hash=` of x-forwarded-client-cert).
pub fn der_sha256_hex(der: &[u8]) -> String {
    hex::encode(boring::sha::sha256(der))
}
