//! A workload's certificate chain, key and trust bundle, read from PEM and checked to belong
//! together before anything serves with them.

use std::path::{Path, PathBuf};

use boring::error::ErrorStack;
use boring::pkey::{PKey, Private};
use boring::x509::X509;

use super::san;
use super::spiffe::SpiffeId;

/// Why an identity could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("identity ({}, {}, {}): {source}", cert.display(), key.display(), ca.display())]
    Files {
        cert: PathBuf,
        key: PathBuf,
        ca: PathBuf,
        source: Box<IdentityError>,
    },
    #[error("source identity {}: {source}", cert.display())]
    Source {
        cert: PathBuf,
        source: Box<IdentityError>,
    },
    #[error("no identity files (the identity comes from SDS)")]
    NoFiles,
    #[error("bad {what} PEM: {source}")]
    Pem {
        what: &'static str,
        source: ErrorStack,
    },
    #[error("no certificate in the {0} file")]
    Empty(&'static str),
    #[error("the key does not match the certificate")]
    KeyMismatch,
    #[error("the certificate has no single SPIFFE URI SAN in trust domain {0:?}")]
    NoSpiffeId(String),
    /// BoringSSL refused to build a context from otherwise readable files.
    #[error("{what}: {source}")]
    Tls {
        what: &'static str,
        source: ErrorStack,
    },
}

impl IdentityError {
    pub(crate) fn tls(what: &'static str) -> impl FnOnce(ErrorStack) -> IdentityError {
        move |source| IdentityError::Tls { what, source }
    }
}

/// A workload's certificate chain, key and trust bundle, checked to belong together.
pub struct Identity {
    /// Leaf first.
    pub chain: Vec<X509>,
    pub key: PKey<Private>,
    pub ca: Vec<X509>,
    /// The leaf's SPIFFE id.
    pub spiffe_id: SpiffeId,
    /// Serial of the leaf, hex; logged on load and rotation.
    pub serial: String,
    /// Every certificate of the chain and the bundle, as admin shows them (`/certs`).
    pub certs: Vec<super::expiry::CertInfo>,
}

impl Identity {
    pub fn load(
        cert: &Path,
        key: &Path,
        ca: &Path,
        trust_domain: &str,
    ) -> Result<Identity, IdentityError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| IdentityError::Read {
                path: p.to_path_buf(),
                source,
            })
        };
        let (cert_pem, key_pem, ca_pem) = (read(cert)?, read(key)?, read(ca)?);
        Identity::from_pem(&cert_pem, &key_pem, &ca_pem, trust_domain).map_err(|e| {
            IdentityError::Files {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                ca: ca.to_path_buf(),
                source: Box::new(e),
            }
        })
    }

    pub fn from_pem(
        cert_pem: &[u8],
        key_pem: &[u8],
        ca_pem: &[u8],
        trust_domain: &str,
    ) -> Result<Identity, IdentityError> {
        let pem = |what| move |source| IdentityError::Pem { what, source };
        let chain = X509::stack_from_pem(cert_pem).map_err(pem("certificate"))?;
        let leaf = chain.first().ok_or(IdentityError::Empty("cert"))?;
        let key = PKey::private_key_from_pem(key_pem).map_err(pem("key"))?;
        let leaf_key = leaf.public_key().map_err(pem("leaf key"))?;
        if !leaf_key.public_eq(&key) {
            return Err(IdentityError::KeyMismatch);
        }
        let ca = X509::stack_from_pem(ca_pem).map_err(pem("CA"))?;
        if ca.is_empty() {
            return Err(IdentityError::Empty("CA"));
        }
        let der = leaf.to_der().map_err(pem("certificate"))?;
        let spiffe_id = san::spiffe_id_in(&der, trust_domain)
            .ok_or_else(|| IdentityError::NoSpiffeId(trust_domain.to_string()))?;
        let serial = leaf
            .serial_number()
            .to_bn()
            .and_then(|b| b.to_hex_str().map(|s| s.to_string()))
            .unwrap_or_default();
        use super::expiry::{CertInfo, Kind};
        let certs = (chain.iter().map(|c| (Kind::Workload, c)))
            .chain(ca.iter().map(|c| (Kind::Trust, c)))
            .filter_map(|(kind, c)| CertInfo::of_der(kind, &c.to_der().ok()?))
            .collect();
        Ok(Identity {
            chain,
            key,
            ca,
            spiffe_id,
            serial,
            certs,
        })
    }
}
