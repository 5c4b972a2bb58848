//! Upstream mTLS connections: where the SNI is chosen (the bare port number) and where the
//! peer's identity is pinned (the service's SPIFFE id). The two are separate values on purpose:
//! the SNI routes on the server proxy, the pin says who it must be.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::cluster::{Cluster, ConnSlot};
use super::pool::{self, Conn, Pool};
use crate::config::Config;
use crate::http::answer::Reason;
use crate::identity::metrics as identity_metrics;
use crate::identity::san;
use crate::identity::tls::{self, alpn_wire, Client, ALPN_H2};
use crate::identity::{IdentityStore, SpiffeId};

pub type UpstreamTls = crate::sockets::Tls<crate::sockets::ReadAhead<TcpStream>>;

/// Why an upstream connection could not be used. Each variant says which step failed; the io
/// error kind is kept where there is one.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connect {addr}: {source}")]
    Tcp { addr: SocketAddr, source: io::Error },
    #[error("tls setup: {0}")]
    Setup(#[source] boring::error::ErrorStack),
    #[error("tls handshake with {addr}: {detail}")]
    Tls {
        addr: SocketAddr,
        detail: String,
        io: Option<io::ErrorKind>,
    },
    #[error("connect {addr}: timed out after {after:?}")]
    Timeout { addr: SocketAddr, after: Duration },
    /// The peer proved an identity other than the service's.
    #[error("{addr} is not {expected}: its certificate names {got:?}")]
    Identity {
        addr: SocketAddr,
        expected: SpiffeId,
        got: Vec<String>,
    },
    #[error("h1 handshake with {addr}: {source}")]
    Http {
        addr: SocketAddr,
        source: hyper::Error,
    },
    #[error("h2 handshake with {addr}: {source}")]
    H2 { addr: SocketAddr, source: h2::Error },
    /// An upgrade's connection: the server's chain for the port chose HTTP/2, which has no
    /// HTTP/1.1 upgrades.
    #[error("{addr} serves the port over HTTP/2 only")]
    H2Only { addr: SocketAddr },
    /// The cluster's connection breaker is full; nothing was dialled.
    #[error("the cluster's connection limit is reached")]
    Overflow,
}

impl ConnectError {
    pub fn reason(&self) -> Reason {
        match self {
            ConnectError::Identity { .. } => Reason::UpstreamIdentityMismatch,
            ConnectError::Overflow => Reason::Overflow,
            ConnectError::H2Only { .. } => Reason::UpgradeNotSupported,
            ConnectError::Tcp { .. }
            | ConnectError::Setup(_)
            | ConnectError::Tls { .. }
            | ConnectError::Timeout { .. }
            | ConnectError::Http { .. }
            | ConnectError::H2 { .. } => Reason::UpstreamConnectFailure,
        }
    }
}

/// Connects to an endpoint's proxy: TCP, then TLS with SNI `"<port>"`, ALPN `alpn` (wire
/// format; `None` for raw TCP tunnels), the chain verified against the bundle, and the leaf's
/// URI SAN pinned to `identity`.
pub async fn connect(
    client: &Client,
    addr: SocketAddr,
    port: u16,
    alpn: Option<&[u8]>,
    identity: &SpiffeId,
    timeout: Duration,
) -> Result<UpstreamTls, ConnectError> {
    let attempt = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|source| ConnectError::Tcp { addr, source })?;
        crate::sockets::tune(&tcp);
        let mut cfg = client.ctx.configure().map_err(ConnectError::Setup)?;
        let key = (addr, port);
        tls::offer(&mut cfg, &client.sessions, key);
        // The SNI is the bare port; it is not a hostname to verify.
        cfg.set_use_server_name_indication(true);
        cfg.set_verify_hostname(false);
        if let Some(alpn) = alpn {
            cfg.set_alpn_protos(alpn).map_err(ConnectError::Setup)?;
        }
        let sni = port.to_string();
        let tcp = crate::sockets::ReadAhead::new(tcp);
        let tls = tokio_boring::connect(cfg, &sni, tcp).await.map_err(|e| {
            identity_metrics::handshake("outbound", false);
            client.sessions.forget(&key);
            ConnectError::Tls {
                addr,
                io: e.as_io_error().map(io::Error::kind),
                detail: e.to_string(),
            }
        })?;
        identity_metrics::handshake("outbound", true);
        let der = tls::peer_leaf_der(tls.ssl()).unwrap_or_default();
        if !san::is_pinned(der, identity) {
            client.sessions.forget(&key);
            identity_metrics::identity_refused("outbound");
            return Err(ConnectError::Identity {
                addr,
                expected: identity.clone(),
                got: san::uri_sans(der),
            });
        }
        Ok(crate::sockets::Tls::new(tls))
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout {
            addr,
            after: timeout,
        }),
    }
}

/// What makes two upstream connections interchangeable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub endpoint: SocketAddr,
    /// The app port, sent as SNI.
    pub port: u16,
    /// The ALPN order offered (the calling app's protocol first).
    pub h2_first: bool,
    /// The app's source address when it has its own client identity.
    pub source: Option<IpAddr>,
    /// The identity the peer was verified against: a connection pinned for one service never
    /// carries another service's requests, even to the same endpoint and port.
    pub identity: SpiffeId,
}

/// The outbound side's way to upstreams: the client identities and the pool of mTLS
/// connections they made.
pub struct Upstream {
    pub identity: Arc<IdentityStore>,
    pub pool: Arc<Pool<PoolKey>>,
    sources_with_identity: HashSet<IpAddr>,
}

impl Upstream {
    pub fn new(cfg: &Config, identity: Arc<IdentityStore>) -> Upstream {
        Upstream {
            identity,
            pool: Pool::new(),
            sources_with_identity: cfg.source_identities.iter().map(|s| s.source).collect(),
        }
    }

    /// The pool key for a request from `src` to `endpoint` of `cluster`.
    pub fn key(
        &self,
        cluster: &Cluster,
        endpoint: SocketAddr,
        h2_first: bool,
        src: IpAddr,
    ) -> PoolKey {
        PoolKey {
            endpoint,
            port: cluster.port,
            h2_first,
            source: self.source_key(src),
            identity: cluster.service.identity.clone(),
        }
    }

    /// The app's source address when it has its own client identity.
    fn source_key(&self, src: IpAddr) -> Option<IpAddr> {
        self.sources_with_identity.contains(&src).then_some(src)
    }

    /// A raw mTLS connection (no ALPN) for a CONNECT tunnel, with its place under the
    /// cluster's connection breaker (hold it as long as the tunnel).
    pub async fn connect_tcp(
        &self,
        cluster: &Cluster,
        endpoint: SocketAddr,
        src: IpAddr,
    ) -> Result<(UpstreamTls, ConnSlot), ConnectError> {
        let slot = cluster.connection_slot().ok_or(ConnectError::Overflow)?;
        let tls = self.connect_to(cluster, endpoint, src, None).await?;
        Ok((tls, slot))
    }

    /// mTLS to `endpoint` for `cluster`'s port: the SNI, the pinned identity and the connect
    /// timeout of its service, as `src`'s identity.
    async fn connect_to(
        &self,
        cluster: &Cluster,
        endpoint: SocketAddr,
        src: IpAddr,
        alpn: Option<&[u8]>,
    ) -> Result<UpstreamTls, ConnectError> {
        let svc = &cluster.service;
        let contexts = self.identity.current();
        connect(
            contexts.connector_for(self.source_key(src)),
            endpoint,
            cluster.port,
            alpn,
            &svc.identity,
            svc.connect_timeout,
        )
        .await
    }

    /// A new HTTP/1.1 connection for one upgrade request, never pooled (once upgraded it
    /// carries only that tunnel). HTTP/1.1 is offered first; a server whose chain for the port
    /// speaks only HTTP/2 picks h2, and the upgrade cannot go there. The breaker place is shared
    /// by the connection and, after a 101, the tunnel.
    pub async fn connect_upgrade(
        &self,
        cluster: &Cluster,
        endpoint: SocketAddr,
        src: IpAddr,
    ) -> Result<(pool::H1, Arc<ConnSlot>), ConnectError> {
        let slot = Arc::new(cluster.connection_slot().ok_or(ConnectError::Overflow)?);
        let tls = self
            .connect_to(cluster, endpoint, src, Some(alpn_wire(false)))
            .await?;
        if tls.ssl().selected_alpn_protocol() == Some(ALPN_H2) {
            return Err(ConnectError::H2Only { addr: endpoint });
        }
        let s = pool::handshake_h1(TokioIo::new(tls), slot.clone())
            .await
            .map_err(|source| ConnectError::Http {
                addr: endpoint,
                source,
            })?;
        Ok((s, slot))
    }

    /// A new HTTP connection for `key`, in the protocol the server chose by ALPN. A new HTTP/2
    /// connection joins the pool at once (the caller's request is its first stream).
    pub async fn connect_http(
        &self,
        key: &PoolKey,
        cluster: &Cluster,
    ) -> Result<Conn, ConnectError> {
        let slot = cluster.connection_slot().ok_or(ConnectError::Overflow)?;
        let svc = &cluster.service;
        let addr = key.endpoint;
        let contexts = self.identity.current();
        let tls = connect(
            contexts.connector_for(key.source),
            addr,
            key.port,
            Some(alpn_wire(key.h2_first)),
            &svc.identity,
            svc.connect_timeout,
        )
        .await?;
        let io = TokioIo::new(tls);
        if io.inner().ssl().selected_alpn_protocol() == Some(ALPN_H2) {
            let s = pool::handshake_h2(io.into_inner(), slot)
                .await
                .map_err(|source| ConnectError::H2 { addr, source })?;
            let stream = self
                .pool
                .put_h2(key.clone(), s.clone(), svc.max_requests_per_connection);
            Ok(Conn::H2(s, stream))
        } else {
            let s = pool::handshake_h1(io, slot)
                .await
                .map_err(|source| ConnectError::Http { addr, source })?;
            Ok(Conn::H1(s, 0))
        }
    }
}

#[cfg(test)]
impl ConnectError {
    /// The io error kind behind the failure, when the failure was an io error.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            ConnectError::Tcp { source, .. } => Some(source.kind()),
            ConnectError::Tls { io, .. } => *io,
            ConnectError::Timeout { .. } => Some(io::ErrorKind::TimedOut),
            ConnectError::Setup(_)
            | ConnectError::Identity { .. }
            | ConnectError::Http { .. }
            | ConnectError::H2 { .. }
            | ConnectError::H2Only { .. }
            | ConnectError::Overflow => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::certgen::{self, Workload};
    use crate::identity::tls::{self, ServerAlpn};
    use crate::identity::workload::Identity;
    use tokio::net::TcpListener;

    const TD: &str = "aether.local";

    /// A client and a server identity (frontend, payments) under one test CA.
    fn identities(dir: &std::path::Path) -> (Identity, Identity) {
        let w = |s| Workload::parse(s).unwrap();
        certgen::generate(dir, TD, &[w("default/frontend"), w("default/payments")]).unwrap();
        let load = |stem: &str| {
            Identity::load(
                &dir.join(format!("{stem}.crt")),
                &dir.join(format!("{stem}.key")),
                &dir.join("ca.crt"),
                TD,
            )
            .unwrap()
        };
        (load("frontend"), load("payments"))
    }

    fn pin(sa: &str) -> SpiffeId {
        SpiffeId::parse(&format!("spiffe://{TD}/ns/default/sa/{sa}")).unwrap()
    }

    async fn connect_to(client: &Client, addr: SocketAddr, sa: &str) -> ConnectError {
        let r = connect(
            client,
            addr,
            9090,
            None,
            &pin(sa),
            Duration::from_millis(300),
        )
        .await;
        match r {
            Ok(_) => panic!("the connection must fail"),
            Err(e) => e,
        }
    }

    /// A connection to the payments server at `addr` on port 9090, which must succeed.
    async fn connect_ok(client: &Client, addr: SocketAddr) -> UpstreamTls {
        connect(
            client,
            addr,
            9090,
            None,
            &pin("payments"),
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    }

    /// A listener on a free loopback port, and the mesh server context `id` answers it with
    /// for port 9090.
    async fn mesh_server(id: &Identity) -> (boring::ssl::SslAcceptor, TcpListener, SocketAddr) {
        let acceptor = tls::acceptor(id, TD, 9090, ServerAlpn::Refuse).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (acceptor, listener, addr)
    }

    /// The key shares of each ClientHello a test server receives, by group id.
    type Seen = std::sync::Arc<std::sync::Mutex<Vec<Vec<u16>>>>;

    /// A server proving `id` that takes key exchange `groups` only and records the key shares
    /// each ClientHello offers.
    fn recording_acceptor(id: &Identity, groups: &str, seen: Seen) -> boring::ssl::SslAcceptor {
        use boring::ssl::{ExtensionType, SslAcceptor, SslMethod};
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
        b.set_certificate(&id.chain[0]).unwrap();
        b.set_private_key(&id.key).unwrap();
        b.set_curves_list(groups).unwrap();
        b.set_select_certificate_callback(move |hello| {
            let ext = hello.get_extension(ExtensionType::KEY_SHARE).unwrap_or(&[]);
            // client_shares<2..>: { group u16, key_exchange<1..2^16-1> }*
            let (mut rest, mut shares) = (ext.get(2..).unwrap_or(&[]), Vec::new());
            while rest.len() >= 4 {
                shares.push(u16::from_be_bytes([rest[0], rest[1]]));
                let n = usize::from(u16::from_be_bytes([rest[2], rest[3]]));
                rest = rest.get(4 + n..).unwrap_or(&[]);
            }
            seen.lock().unwrap().push(shares);
            Ok(())
        });
        b.build()
    }

    #[tokio::test]
    async fn offers_one_key_share_for_the_group_the_server_chose_last_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const MLKEM: u16 = 0x11ec;
        const X25519: u16 = 0x1d;
        const P256: u16 = 0x17;
        let dir = tempfile::tempdir().unwrap();
        let (client_id, server_id) = identities(dir.path());
        let client = tls::connector(&client_id).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();

        // One server context per set of groups, so its session tickets stay valid.
        let seen = Seen::default();
        let mesh = recording_acceptor(&server_id, tls::CURVES, seen.clone());
        let p256 = recording_acceptor(&server_id, "P-256", seen.clone());

        // One connection per step, all to the same endpoint and port; the server's groups change
        // between steps as an upgraded or differently configured peer's would.
        // (server, key shares of the first ClientHello, group agreed, resumed)
        let steps: [(&boring::ssl::SslAcceptor, &[u16], u16, bool); 4] = [
            // First contact: BoringSSL's two shares, one post-quantum and one classical.
            (&mesh, &[MLKEM, X25519], MLKEM, false),
            // Then only the group the server chose, on a resumed handshake.
            (&mesh, &[MLKEM], MLKEM, true),
            // The server now takes P-256 only: a HelloRetryRequest, and the connection works.
            (&p256, &[MLKEM], P256, false),
            // From then on P-256 alone.
            (&p256, &[P256], P256, true),
        ];
        for (i, (acceptor, want, group, resumed)) in steps.into_iter().enumerate() {
            let (tcp, _) = tokio::join!(
                async {
                    let (tcp, _) = listener.accept().await.unwrap();
                    let mut tls = tokio_boring::accept(acceptor, tcp).await.unwrap();
                    tls.write_all(b"x").await.unwrap();
                    tls
                },
                async {
                    let mut tls = connect_ok(&client, addr).await;
                    // The session ticket arrives before the server's byte.
                    tls.read_exact(&mut [0u8; 1]).await.unwrap();
                    assert_eq!(tls.ssl().session_reused(), resumed, "step {i}");
                    assert_eq!(tls.ssl().curve(), Some(group), "step {i}");
                }
            );
            drop(tcp);
            // BoringSSL asks the callback about the first ClientHello only.
            let seen = std::mem::take(&mut *seen.lock().unwrap());
            assert_eq!(seen, vec![want.to_vec()], "step {i}: key shares offered");
        }
    }

    #[tokio::test]
    async fn each_failure_says_which_step_failed_and_keeps_the_io_kind() {
        let dir = tempfile::tempdir().unwrap();
        let (client_id, server_id) = identities(dir.path());
        let client = tls::connector(&client_id).unwrap();

        // Nothing listens: a TCP failure, connection refused.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let e = connect_to(&client, addr, "payments").await;
        assert!(matches!(e, ConnectError::Tcp { .. }), "{e}");
        assert_eq!(e.io_kind(), Some(io::ErrorKind::ConnectionRefused));
        assert_eq!(e.reason(), Reason::UpstreamConnectFailure);

        // Accepts and says nothing: the timeout.
        let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let conns: Vec<_> = vec![silent.accept().await.unwrap()];
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(conns);
        });
        let e = connect_to(&client, addr, "payments").await;
        assert!(matches!(e, ConnectError::Timeout { .. }), "{e}");
        assert_eq!(e.io_kind(), Some(io::ErrorKind::TimedOut));
        hold.abort();

        // Accepts and closes: the TLS handshake failed.
        let rude = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = rude.local_addr().unwrap();
        tokio::spawn(async move { drop(rude.accept().await) });
        let e = connect_to(&client, addr, "payments").await;
        assert!(matches!(e, ConnectError::Tls { .. }), "{e}");
        assert_eq!(e.reason(), Reason::UpstreamConnectFailure);

        // A real server proving payments, pinned as orders: the identity step.
        let (acceptor, server, addr) = mesh_server(&server_id).await;
        tokio::spawn(async move {
            let (tcp, _) = server.accept().await.unwrap();
            let _tls = tokio_boring::accept(&acceptor, tcp).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        });
        let e = connect_to(&client, addr, "orders").await;
        match &e {
            ConnectError::Identity { expected, got, .. } => {
                assert_eq!(expected, &pin("orders"));
                assert_eq!(got, &vec![pin("payments").to_string()]);
            }
            other => panic!("expected an identity failure, got {other}"),
        }
        assert_eq!(e.reason(), Reason::UpstreamIdentityMismatch);
        assert_eq!(e.io_kind(), None);
    }

    #[tokio::test]
    async fn a_server_that_speaks_first_completes_its_handshake_when_the_client_reads() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let (client_id, server_id) = identities(dir.path());
        let client = tls::connector(&client_id).unwrap();
        let (acceptor, listener, addr) = mesh_server(&server_id).await;
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            // Returns once the client's Finished is in: a client that held it back for its
            // first write would never send it here.
            let mut tls = tokio_boring::accept(&acceptor, tcp).await.unwrap();
            tls.write_all(b"220 ready").await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let mut tls = connect_ok(&client, addr).await;
        let mut greeting = [0u8; 9];
        tokio::time::timeout(Duration::from_secs(3), tls.read_exact(&mut greeting))
            .await
            .expect("the server's greeting (the client's Finished never reached it)")
            .unwrap();
        assert_eq!(&greeting, b"220 ready");
    }

    #[tokio::test]
    async fn a_server_the_client_refuses_hears_the_alert_saying_why() {
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (client_id, _) = identities(one.path());
        // The same names under another CA: the client does not trust this server's chain.
        let (_, server_id) = identities(two.path());
        let client = tls::connector(&client_id).unwrap();
        let (acceptor, listener, addr) = mesh_server(&server_id).await;
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            match tokio_boring::accept(&acceptor, tcp).await {
                Ok(_) => panic!("the handshake must fail"),
                Err(e) => e.to_string(),
            }
        });
        let e = connect_to(&client, addr, "payments").await;
        assert!(matches!(e, ConnectError::Tls { .. }), "{e}");
        let heard = server.await.unwrap();
        assert!(heard.to_uppercase().contains("ALERT"), "server: {heard}");
    }
}
