//! The inbound side: mTLS on :15008, the chain chosen from the ClientHello's SNI before the
//! handshake (`chain.rs`), then forwarded in the chain's protocol to `app_host:<port>`
//! (`http.rs` for HTTP chains, `tcp.rs` for raw TCP).

pub mod chain;
pub mod clienthello;
pub mod http;
pub mod prefixed;
pub mod tcp;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::config::{Config, Protocol};
use crate::drain::{accept_until_closing, Drain};
use crate::identity::{san, IdentityStore};
use crate::metrics;
use crate::pool::Pool;
use chain::Chains;
use prefixed::Prefixed;

/// How long a client may take to send its ClientHello (slow or silent clients are cut off).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the rest of the handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A fatal TLS alert record, `unrecognized_name` (112), sent before any TLS state exists.
const ALERT_UNRECOGNIZED_NAME: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x70];

pub type TlsStream = tokio_boring::SslStream<Prefixed<TcpStream>>;

/// Everything the inbound listener needs, built once at start-up.
pub struct Inbound {
    pub chains: Chains,
    pub app_host: IpAddr,
    pub trust_domain: String,
    pub identity: Arc<IdentityStore>,
    pub drain: Drain,
    pub tracker: crate::drain::Tracker,
    /// Pooled connections to the local app, keyed by (port, h2).
    pub app_pool: Arc<Pool<(u16, bool)>>,
    pub servers: crate::http_server::Servers,
    /// `service` label for metrics: this workload's service account.
    pub service_label: String,
}

/// The verified peer of one inbound connection.
pub struct Peer {
    pub addr: SocketAddr,
    pub spiffe_id: String,
    /// Lower-case hex SHA-256 of the peer's leaf DER.
    pub cert_hash: String,
}

impl Inbound {
    pub fn new(
        cfg: &Config,
        identity: Arc<IdentityStore>,
        drain: Drain,
        tracker: crate::drain::Tracker,
    ) -> Inbound {
        let own = identity.current().identity.spiffe_id.clone();
        let service_label = own.rsplit('/').next().unwrap_or_default().to_string();
        let app_pool = Pool::new();
        Inbound {
            chains: Chains::new(&cfg.inbound),
            app_host: cfg.inbound.app_host,
            trust_domain: cfg.trust_domain.clone(),
            identity,
            drain,
            tracker,
            app_pool,
            servers: crate::http_server::Servers::new(),
            service_label,
        }
    }

    /// Accepts until the drain closes the listener.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        self.app_pool.spawn_sweeper();
        let (drain, tracker) = (self.drain.clone(), self.tracker.clone());
        accept_until_closing("inbound", listener, &drain, &tracker, |tcp, addr| {
            self.clone().connection(tcp, addr)
        })
        .await;
    }

    async fn connection(self: Arc<Self>, mut tcp: TcpStream, addr: SocketAddr) {
        let _active = metrics::ActiveConnection::new("inbound");
        let _ = tcp.set_nodelay(true);
        let mut buf = BytesMut::with_capacity(2048);
        let hello = match clienthello::read(&mut tcp, &mut buf, HELLO_TIMEOUT).await {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(%addr, "inbound: no usable ClientHello: {e}");
                metrics::get().handshake("inbound", false);
                return;
            }
        };
        let Some(chain) = self.chains.select(hello.sni.as_deref()) else {
            tracing::debug!(%addr, sni = ?hello.sni, "inbound: SNI names a port this pod does not serve");
            metrics::get().handshake("inbound", false);
            let _ = tcp.write_all(&ALERT_UNRECOGNIZED_NAME).await;
            let _ = tcp.shutdown().await;
            return;
        };
        let contexts = self.identity.current();
        let io = Prefixed::new(buf.freeze(), tcp);
        let accepted = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            tokio_boring::accept(contexts.acceptor(chain.protocol), io),
        )
        .await;
        let tls = match accepted {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(%addr, "inbound handshake failed: {e}");
                metrics::get().handshake("inbound", false);
                return;
            }
            Err(_) => {
                tracing::debug!(%addr, "inbound handshake timed out");
                metrics::get().handshake("inbound", false);
                return;
            }
        };
        metrics::get().handshake("inbound", true);
        // The verify callback already insisted on a SPIFFE id in the trust domain.
        let Some(der) = tls.ssl().peer_certificate().and_then(|c| c.to_der().ok()) else {
            return;
        };
        let Some(spiffe_id) = san::spiffe_id_in(&der, &self.trust_domain) else {
            return;
        };
        let peer = Peer {
            addr,
            spiffe_id,
            cert_hash: san::der_sha256_hex(&der),
        };
        let chain = chain.clone();
        match chain.protocol {
            Protocol::Tcp => tcp::forward(&self, &chain, &peer, tls).await,
            _ => http::serve(self.clone(), chain, peer, &contexts.identity.spiffe_id, tls).await,
        }
    }
}
