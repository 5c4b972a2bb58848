//! The inbound side: mTLS on :15008. For each connection, in order: the ClientHello is read
//! before any TLS state exists (`clienthello/`), its SNI picks the port's chain (`chain.rs`), the
//! handshake runs with that port's own TLS context, the peer is identified (`peer.rs`), and the
//! chain's server forwards to `app_host:<port>` (`http.rs` for HTTP chains, `tcp.rs` for raw
//! TCP).

pub mod chain;
pub mod clienthello;
pub mod handshakes;
pub mod http;
pub mod peer;
pub mod tcp;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::config::Config;
use crate::drain::{accept_until_closing, ActiveConnection, Drain, Tracker};
use crate::http::server::Servers;
use crate::identity::metrics as identity_metrics;
use crate::identity::IdentityStore;
use crate::outbound::pool::Pool;
use chain::{Chains, Server};
use handshakes::Handshakes;
use http::HttpChains;
use peer::Peer;

/// How long a client may take to send its ClientHello (slow or silent clients are cut off):
/// the header read timeout (`Timers::head_read`, 10 s).
fn hello_timeout() -> Duration {
    crate::http::limits::timers().head_read
}
/// How long the rest of the handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A fatal TLS alert record, `unrecognized_name` (112), sent before any TLS state exists.
const ALERT_UNRECOGNIZED_NAME: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x70];

/// Everything the inbound listener needs, built once at start-up.
pub struct Inbound {
    pub chains: Chains,
    pub trust_domain: String,
    pub identity: Arc<IdentityStore>,
    pub drain: Drain,
    pub tracker: Tracker,
    pub http: Arc<HttpChains>,
    pub handshakes: Arc<Handshakes>,
    max_connections: usize,
}

impl Inbound {
    pub fn new(
        cfg: &Config,
        identity: Arc<IdentityStore>,
        drain: Drain,
        tracker: Tracker,
    ) -> Inbound {
        let service_label = identity.current().identity.spiffe_id.last_segment().into();
        Inbound {
            chains: Chains::new(&cfg.inbound),
            trust_domain: cfg.trust_domain.clone(),
            identity,
            http: Arc::new(HttpChains {
                app_host: cfg.inbound.app_host,
                app_pool: Pool::new(),
                servers: Servers::new(),
                drain: drain.clone(),
                tracker: tracker.clone(),
                service_label,
                app_closes_busy: Default::default(),
            }),
            drain,
            tracker,
            handshakes: Handshakes::new(cfg.limits.max_pending_handshakes),
            max_connections: cfg.limits.max_connections_per_listener,
        }
    }

    /// Accepts until the drain closes the listener.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        self.http.app_pool.spawn_sweeper();
        let (drain, tracker) = (self.drain.clone(), self.tracker.clone());
        let max = self.max_connections;
        accept_until_closing(
            "inbound",
            listener,
            (max, true),
            &drain,
            &tracker,
            |tcp, addr| self.clone().connection(tcp, addr),
        )
        .await;
    }

    async fn connection(self: Arc<Self>, tcp: TcpStream, addr: SocketAddr) {
        let _active = ActiveConnection::new("inbound");
        // Keepalive and TCP_NODELAY came from the listener (`sockets::tune_listener`).
        let mut pending = self.handshakes.enter();
        let accepted = tokio::select! {
            a = self.handshake(tcp, addr) => a,
            _ = pending.evicted() => {
                tracing::debug!(%addr, "inbound: closed before its handshake ended, to admit a newer connection");
                identity_metrics::handshake("inbound", false);
                return;
            }
        };
        drop(pending);
        let Some((tls, chain)) = accepted else {
            return;
        };
        identity_metrics::handshake("inbound", true);
        let Some(peer) = Peer::of(&tls, &self.trust_domain) else {
            return;
        };
        match chain.server(tls.ssl().selected_alpn_protocol()) {
            Server::Tcp => tcp::forward(self.http.app_host, &chain, &peer, tls, &self.drain).await,
            Server::Http(codec) => {
                let own_id = self.identity.current().identity.spiffe_id.clone();
                self.http
                    .clone()
                    .serve(codec, chain, peer, &own_id, tls)
                    .await
            }
        }
    }

    /// Reads the ClientHello, picks the chain its SNI names and completes the handshake with
    /// that port's context. `None` (counted as a failed handshake) when any step fails.
    async fn handshake(
        &self,
        mut tcp: TcpStream,
        addr: SocketAddr,
    ) -> Option<(peer::TlsStream, chain::Chain)> {
        // The reader sizes its reads.
        let mut buf = BytesMut::new();
        let hello = match clienthello::read(&mut tcp, &mut buf, hello_timeout()).await {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(%addr, "inbound: no usable ClientHello: {e}");
                identity_metrics::handshake("inbound", false);
                return None;
            }
        };
        let contexts = self.identity.current();
        let selected = self
            .chains
            .select(hello.sni.as_deref())
            .and_then(|c| Some((c, contexts.acceptor(c.port)?)));
        let Some((chain, acceptor)) = selected else {
            tracing::debug!(%addr, sni = ?hello.sni, "inbound: SNI names a port this pod does not serve");
            identity_metrics::handshake("inbound", false);
            let _ = tcp.write_all(&ALERT_UNRECOGNIZED_NAME).await;
            let _ = tcp.shutdown().await;
            return None;
        };
        let io = crate::sockets::ReadAhead::with_prefix(buf, tcp);
        let accepted =
            tokio::time::timeout(HANDSHAKE_TIMEOUT, tokio_boring::accept(acceptor, io)).await;
        match accepted {
            Ok(Ok(tls)) => Some((crate::sockets::Tls::new(tls), chain.clone())),
            Ok(Err(e)) => {
                tracing::debug!(%addr, "inbound handshake failed: {e}");
                identity_metrics::handshake("inbound", false);
                None
            }
            Err(_) => {
                tracing::debug!(%addr, "inbound handshake timed out");
                identity_metrics::handshake("inbound", false);
                None
            }
        }
    }
}
