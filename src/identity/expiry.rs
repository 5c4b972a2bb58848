//! What the operator sees of the certificates in use (SPEC section 12): serial, SANs and
//! not-after of every workload and trust certificate, read once per load or rotation, and the
//! seconds left until the earliest of each kind expires.

use x509_parser::extensions::GeneralName;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The workload's chain: the leaf and any intermediates sent with it.
    Workload,
    /// The trust bundle.
    Trust,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Workload => "workload",
            Kind::Trust => "trust",
        }
    }
}

#[derive(Debug, Clone)]
pub struct CertInfo {
    pub kind: Kind,
    /// Lower-case hex, as the log and `/config_dump` print the leaf's.
    pub serial: String,
    pub sans: Vec<String>,
    /// Unix seconds.
    pub not_after: i64,
}

impl CertInfo {
    /// `None` for DER that does not parse (the TLS library accepted it, so this does not happen
    /// for certificates in use; nothing is invented for it either way).
    pub fn of_der(kind: Kind, der: &[u8]) -> Option<CertInfo> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let mut sans = Vec::new();
        if let Ok(Some(ext)) = cert.subject_alternative_name() {
            for name in &ext.value.general_names {
                match name {
                    GeneralName::URI(u) => sans.push(u.to_string()),
                    GeneralName::DNSName(d) => sans.push(d.to_string()),
                    GeneralName::RFC822Name(m) => sans.push(m.to_string()),
                    GeneralName::IPAddress(b) => match b.len() {
                        4 => sans.push(
                            std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).ok()?).to_string(),
                        ),
                        16 => sans.push(
                            std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).ok()?).to_string(),
                        ),
                        _ => {}
                    },
                    _ => {}
                }
            }
        }
        Some(CertInfo {
            kind,
            serial: cert.tbs_certificate.serial.to_str_radix(16),
            sans,
            not_after: cert.validity().not_after.timestamp(),
        })
    }

    pub fn not_after_rfc3339(&self) -> String {
        time::OffsetDateTime::from_unix_timestamp(self.not_after)
            .ok()
            .and_then(|t| {
                t.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .unwrap_or_default()
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "kind": self.kind.as_str(),
            "serial": self.serial,
            "sans": self.sans,
            "not_after": self.not_after_rfc3339(),
        })
    }
}

/// Seconds from `now` (Unix seconds) until the earliest not-after of `kind`; `None` when there
/// is no certificate of that kind.
pub fn seconds_left(certs: &[CertInfo], kind: Kind, now: i64) -> Option<i64> {
    certs
        .iter()
        .filter(|c| c.kind == kind)
        .map(|c| c.not_after - now)
        .min()
}

pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_serial_sans_and_expiry_of_generated_certificates() {
        let dir = tempfile::tempdir().unwrap();
        crate::identity::certgen::generate(
            dir.path(),
            "aether.local",
            &[crate::identity::certgen::Workload::parse("default/payments").unwrap()],
        )
        .unwrap();
        let pem = std::fs::read(dir.path().join("payments.crt")).unwrap();
        let leaf = boring::x509::X509::from_pem(&pem).unwrap();
        let info = CertInfo::of_der(Kind::Workload, &leaf.to_der().unwrap()).unwrap();
        assert_eq!(
            info.serial,
            leaf.serial_number()
                .to_bn()
                .unwrap()
                .to_hex_str()
                .unwrap()
                .to_string()
        );
        assert!(info
            .sans
            .contains(&"spiffe://aether.local/ns/default/sa/payments".to_string()));
        let left = seconds_left(std::slice::from_ref(&info), Kind::Workload, unix_now()).unwrap();
        assert!(left > 3600, "{left}");
        assert_eq!(
            seconds_left(std::slice::from_ref(&info), Kind::Trust, 0),
            None
        );
        assert!(
            info.not_after_rfc3339().ends_with('Z'),
            "{}",
            info.not_after_rfc3339()
        );
    }
}
