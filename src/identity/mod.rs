//! Workload identity: certificates, SPIFFE SAN checks, TLS contexts and their rotation.
//!
//! `tls.rs` builds BoringSSL contexts from an `Identity`; `san.rs` reads and pins SPIFFE ids;
//! `certgen.rs` makes test certificates.

pub mod certgen;
pub mod san;
pub mod tls;

use std::path::Path;

use boring::pkey::{PKey, Private};
use boring::x509::X509;

/// A workload's certificate chain, key and trust bundle, checked to belong together.
pub struct Identity {
    /// Leaf first.
    pub chain: Vec<X509>,
    pub key: PKey<Private>,
    pub ca: Vec<X509>,
    /// The leaf's SPIFFE id.
    pub spiffe_id: String,
    /// Serial of the leaf, hex; logged on load and rotation.
    pub serial: String,
}

impl Identity {
    pub fn load(
        cert: &Path,
        key: &Path,
        ca: &Path,
        trust_domain: &str,
    ) -> Result<Identity, String> {
        let read =
            |p: &Path| std::fs::read(p).map_err(|e| format!("{}: cannot read: {e}", p.display()));
        let (cert_pem, key_pem, ca_pem) = (read(cert)?, read(key)?, read(ca)?);
        Identity::from_pem(&cert_pem, &key_pem, &ca_pem, trust_domain).map_err(|e| {
            format!(
                "identity ({}, {}, {}): {e}",
                cert.display(),
                key.display(),
                ca.display()
            )
        })
    }

    pub fn from_pem(
        cert_pem: &[u8],
        key_pem: &[u8],
        ca_pem: &[u8],
        trust_domain: &str,
    ) -> Result<Identity, String> {
        let chain =
            X509::stack_from_pem(cert_pem).map_err(|e| format!("bad certificate PEM: {e}"))?;
        let leaf = chain.first().ok_or("no certificate in the cert file")?;
        let key = PKey::private_key_from_pem(key_pem).map_err(|e| format!("bad key PEM: {e}"))?;
        let leaf_key = leaf
            .public_key()
            .map_err(|e| format!("bad leaf key: {e}"))?;
        if !leaf_key.public_eq(&key) {
            return Err("the key does not match the certificate".into());
        }
        let ca = X509::stack_from_pem(ca_pem).map_err(|e| format!("bad CA PEM: {e}"))?;
        if ca.is_empty() {
            return Err("no certificate in the CA file".into());
        }
        let der = leaf.to_der().map_err(|e| e.to_string())?;
        let spiffe_id = san::spiffe_id_in(&der, trust_domain).ok_or_else(|| {
            format!("the certificate has no single SPIFFE URI SAN in trust domain {trust_domain:?}")
        })?;
        let serial = leaf
            .serial_number()
            .to_bn()
            .and_then(|b| b.to_hex_str().map(|s| s.to_string()))
            .unwrap_or_default();
        Ok(Identity {
            chain,
            key,
            ca,
            spiffe_id,
            serial,
        })
    }
}

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use boring::ssl::SslAcceptor;

use crate::config::{Config, Protocol};

/// Everything TLS needs for new connections, built from one consistent set of files. New
/// connections take the current set; established ones keep the one they started with.
pub struct Contexts {
    pub identity: Identity,
    /// Indexed by `proto_index`.
    acceptors: [SslAcceptor; 4],
    pub connector: tls::Client,
    /// Per-source client identities (`source_identities`), by the app connection's source.
    pub source_connectors: HashMap<IpAddr, tls::Client>,
}

fn proto_index(p: Protocol) -> usize {
    match p {
        Protocol::H2 => 0,
        Protocol::Http1 => 1,
        Protocol::Auto => 2,
        Protocol::Tcp => 3,
    }
}

impl Contexts {
    pub fn build(cfg: &Config) -> Result<Contexts, String> {
        let td = &cfg.trust_domain;
        let f = &cfg.identity;
        let identity = Identity::load(&f.cert, &f.key, &f.ca, td)?;
        let acceptor = |p| tls::acceptor(&identity, td, p);
        let acceptors = [
            acceptor(Protocol::H2)?,
            acceptor(Protocol::Http1)?,
            acceptor(Protocol::Auto)?,
            acceptor(Protocol::Tcp)?,
        ];
        let connector = tls::connector(&identity)?;
        let mut source_connectors = HashMap::new();
        for s in &cfg.source_identities {
            let id = Identity::load(&s.cert, &s.key, &f.ca, td)?;
            source_connectors.insert(s.source, tls::connector(&id)?);
        }
        Ok(Contexts {
            identity,
            acceptors,
            connector,
            source_connectors,
        })
    }

    pub fn acceptor(&self, p: Protocol) -> &SslAcceptor {
        &self.acceptors[proto_index(p)]
    }

    /// The client context for an app connection from `source`.
    pub fn connector_for(&self, source: IpAddr) -> &tls::Client {
        self.source_connectors
            .get(&source)
            .unwrap_or(&self.connector)
    }
}

/// The current `Contexts`, swapped atomically on rotation.
pub struct IdentityStore {
    current: ArcSwap<Contexts>,
}

impl IdentityStore {
    pub fn load(cfg: &Config) -> Result<Arc<IdentityStore>, String> {
        Ok(Arc::new(IdentityStore {
            current: ArcSwap::from_pointee(Contexts::build(cfg)?),
        }))
    }

    pub fn current(&self) -> Arc<Contexts> {
        self.current.load_full()
    }

    /// Re-reads the files; on any error the previous identity stays in use.
    pub fn reload(&self, cfg: &Config) -> Result<(), String> {
        let next = Contexts::build(cfg)?;
        tracing::info!(serial = %next.identity.serial, id = %next.identity.spiffe_id, "identity loaded");
        self.current.store(Arc::new(next));
        Ok(())
    }
}
