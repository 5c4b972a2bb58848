//! The identity in use: TLS contexts built from one consistent set of files, swapped whole on
//! rotation. New connections take the current set; established ones keep the one they started
//! with.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use boring::ssl::SslAcceptor;

use super::tls::{self, ServerAlpn};
use super::workload::{Identity, IdentityError};

/// The workload's PEM files.
#[derive(Debug, Clone)]
pub struct IdentityPaths {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// What an identity is built from: the files (or, with SDS, PEM pushed by the control plane),
/// the trust domain, and the ports served inbound (each gets its own server context).
#[derive(Debug, Clone)]
pub struct IdentitySpec {
    /// `None`: the identity arrives over SDS.
    pub files: Option<IdentityPaths>,
    pub trust_domain: String,
    pub served: Vec<(u16, ServerAlpn)>,
    /// Per-source client identities: (the app connection's source, cert, key); their trust
    /// bundle is the workload's.
    pub sources: Vec<(IpAddr, PathBuf, PathBuf)>,
}

impl IdentitySpec {
    /// Every file the identity is read from (watched for rotation).
    pub fn files(&self) -> Vec<PathBuf> {
        let mut v = Vec::new();
        if let Some(f) = &self.files {
            v.extend([f.cert.clone(), f.key.clone(), f.ca.clone()]);
        }
        for (_, cert, key) in &self.sources {
            v.push(cert.clone());
            v.push(key.clone());
        }
        v
    }
}

/// Everything TLS needs for new connections, built from one consistent set of files.
pub struct Contexts {
    pub identity: Identity,
    /// One server context per served port.
    acceptors: HashMap<u16, SslAcceptor>,
    pub connector: tls::Client,
    /// Per-source client identities (`source_identities`), by the app connection's source.
    pub source_connectors: HashMap<IpAddr, tls::Client>,
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, IdentityError> {
    std::fs::read(path).map_err(|source| IdentityError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl Contexts {
    /// From the spec's files.
    pub fn build(spec: &IdentitySpec) -> Result<Contexts, IdentityError> {
        let f = spec.files.as_ref().ok_or(IdentityError::NoFiles)?;
        let identity = Identity::load(&f.cert, &f.key, &f.ca, &spec.trust_domain)?;
        Contexts::with_identity(spec, identity, &read(&f.ca)?)
    }

    /// From PEM the control plane pushed (SDS).
    pub fn from_pem(
        spec: &IdentitySpec,
        cert: &[u8],
        key: &[u8],
        ca: &[u8],
    ) -> Result<Contexts, IdentityError> {
        let identity = Identity::from_pem(cert, key, ca, &spec.trust_domain)?;
        Contexts::with_identity(spec, identity, ca)
    }

    fn with_identity(
        spec: &IdentitySpec,
        identity: Identity,
        ca_pem: &[u8],
    ) -> Result<Contexts, IdentityError> {
        let td = &spec.trust_domain;
        let mut acceptors = HashMap::new();
        for (port, alpn) in &spec.served {
            acceptors.insert(*port, tls::acceptor(&identity, td, *port, *alpn)?);
        }
        let connector = tls::connector(&identity)?;
        let mut source_connectors = HashMap::new();
        for (source, cert, key) in &spec.sources {
            let id = Identity::from_pem(&read(cert)?, &read(key)?, ca_pem, td).map_err(|e| {
                IdentityError::Source {
                    cert: cert.clone(),
                    source: Box::new(e),
                }
            })?;
            source_connectors.insert(*source, tls::connector(&id)?);
        }
        Ok(Contexts {
            identity,
            acceptors,
            connector,
            source_connectors,
        })
    }

    /// The server context of a served port.
    pub fn acceptor(&self, port: u16) -> Option<&SslAcceptor> {
        self.acceptors.get(&port)
    }

    /// Every client context: the workload's own, then the per-source ones.
    pub fn clients(&self) -> impl Iterator<Item = &tls::Client> {
        std::iter::once(&self.connector).chain(self.source_connectors.values())
    }

    /// The client context for an app connection from `source` (`None`: the workload's own).
    pub fn connector_for(&self, source: Option<IpAddr>) -> &tls::Client {
        source
            .and_then(|s| self.source_connectors.get(&s))
            .unwrap_or(&self.connector)
    }
}

/// The current `Contexts`, swapped atomically on rotation.
pub struct IdentityStore {
    spec: IdentitySpec,
    current: ArcSwap<Contexts>,
}

impl IdentityStore {
    /// From the spec's files.
    pub fn load(spec: IdentitySpec) -> Result<Arc<IdentityStore>, IdentityError> {
        let first = Contexts::build(&spec)?;
        Ok(IdentityStore::with(spec, first))
    }

    /// Starting from contexts built elsewhere (the first identity SDS pushed).
    pub fn with(spec: IdentitySpec, first: Contexts) -> Arc<IdentityStore> {
        Arc::new(IdentityStore {
            spec,
            current: ArcSwap::from_pointee(first),
        })
    }

    /// Swaps in a new identity (an SDS push).
    pub fn replace(&self, next: Contexts) {
        tracing::info!(serial = %next.identity.serial, id = %next.identity.spiffe_id, "identity loaded");
        self.current.store(Arc::new(next));
    }

    pub fn spec(&self) -> &IdentitySpec {
        &self.spec
    }

    pub fn current(&self) -> Arc<Contexts> {
        self.current.load_full()
    }

    /// Re-reads the files; on any error the previous identity stays in use.
    pub fn reload(&self) -> Result<(), IdentityError> {
        self.replace(Contexts::build(&self.spec)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::certgen::{self, Workload};
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// One TLS connection to the server context of `port`, offering the cached session of
    /// `as_port` (filed under that key). Returns whether the handshake resumed a session.
    async fn handshake(contexts: &Contexts, port: u16, as_port: u16) -> bool {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = contexts.acceptor(port).unwrap().clone();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut tls = tokio_boring::accept(&acceptor, tcp).await.unwrap();
            tls.write_all(b"x").await.unwrap();
            let _ = tls.read(&mut [0u8; 1]).await;
        });
        let client = contexts.connector_for(None);
        let mut cfg = client.ctx.configure().unwrap();
        let key: (SocketAddr, u16) = (SocketAddr::from(([127, 0, 0, 1], 1)), as_port);
        crate::identity::tls::offer(&mut cfg, &client.sessions, key);
        cfg.set_verify_hostname(false);
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut tls = tokio_boring::connect(cfg, &port.to_string(), tcp)
            .await
            .unwrap();
        // Reading the server's byte also takes in its session tickets.
        tls.read_exact(&mut [0u8; 1]).await.unwrap();
        let resumed = tls.ssl().session_reused();
        drop(tls);
        server.await.unwrap();
        resumed
    }

    /// The files `certgen` wrote for workload `name` under `dir`.
    fn files(dir: &std::path::Path, name: &str) -> IdentityPaths {
        IdentityPaths {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
            ca: dir.join("ca.crt"),
        }
    }

    /// Payments, serving `ports` with either protocol.
    fn payments_spec(dir: &std::path::Path, ports: &[u16]) -> IdentitySpec {
        IdentitySpec {
            files: Some(files(dir, "payments")),
            trust_domain: "aether.local".into(),
            served: ports
                .iter()
                .map(|&p| (p, ServerAlpn::ClientFirst))
                .collect(),
            sources: vec![],
        }
    }

    /// The server sends one session ticket per handshake, full or resumed: the client keeps
    /// only the latest per endpoint and port, so a second one would be wasted work each time.
    #[tokio::test]
    async fn one_ticket_per_handshake() {
        use boring::ssl::{SslConnector, SslMethod, SslSessionCacheMode, SslVerifyMode};
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};

        let dir = tempfile::tempdir().unwrap();
        let ws = [
            Workload::parse("default/payments").unwrap(),
            Workload::parse("default/frontend").unwrap(),
        ];
        certgen::generate(dir.path(), "aether.local", &ws).unwrap();
        let spec = payments_spec(dir.path(), &[8080]);
        let acceptor = Contexts::build(&spec)
            .unwrap()
            .acceptor(8080)
            .unwrap()
            .clone();
        let p = files(dir.path(), "frontend");
        let me = crate::identity::workload::Identity::load(&p.cert, &p.key, &p.ca, "aether.local").unwrap();

        // A plain client that counts every session it is handed.
        let tickets = Arc::new(AtomicUsize::new(0));
        let latest = Arc::new(Mutex::new(None));
        let mut b = SslConnector::builder(SslMethod::tls()).unwrap();
        b.set_certificate(&me.chain[0]).unwrap();
        b.set_private_key(&me.key).unwrap();
        b.set_verify(SslVerifyMode::NONE);
        b.set_session_cache_mode(SslSessionCacheMode::CLIENT);
        let (t, l) = (tickets.clone(), latest.clone());
        b.set_new_session_callback(move |_, s| {
            t.fetch_add(1, Ordering::SeqCst);
            *l.lock().unwrap() = Some(s);
        });
        let client = b.build();

        for round in 0..3 {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let acceptor = acceptor.clone();
            let server = tokio::spawn(async move {
                let (tcp, _) = listener.accept().await.unwrap();
                let mut tls = tokio_boring::accept(&acceptor, tcp).await.unwrap();
                tls.write_all(b"x").await.unwrap();
                let _ = tls.read(&mut [0u8; 1]).await;
            });
            let mut cfg = client.configure().unwrap();
            if let Some(s) = latest.lock().unwrap().clone() {
                // SAFETY: the session came from this very context.
                unsafe { cfg.set_session(&s).unwrap() };
            }
            let tcp = TcpStream::connect(addr).await.unwrap();
            let mut tls = tokio_boring::connect(cfg, "8080", tcp).await.unwrap();
            // The tickets precede the server's byte on the wire.
            tls.read_exact(&mut [0u8; 1]).await.unwrap();
            assert_eq!(tls.ssl().session_reused(), round > 0);
            drop(tls);
            server.await.unwrap();
            assert_eq!(tickets.load(Ordering::SeqCst), round + 1, "round {round}");
        }
    }

    #[tokio::test]
    async fn each_served_port_has_its_own_server_context() {
        let dir = tempfile::tempdir().unwrap();
        let w = Workload::parse("default/payments").unwrap();
        certgen::generate(dir.path(), "aether.local", &[w]).unwrap();
        let contexts = Contexts::build(&payments_spec(dir.path(), &[8080, 9090])).unwrap();
        assert!(contexts.acceptor(7777).is_none());
        assert!(
            !handshake(&contexts, 8080, 8080).await,
            "first contact is a full handshake"
        );
        assert!(
            handshake(&contexts, 8080, 8080).await,
            "the same port resumes"
        );
        // A session of port 8080's chain is not taken by port 9090's context.
        assert!(!handshake(&contexts, 9090, 8080).await);
    }
}
