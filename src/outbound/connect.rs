//! Upstream mTLS connections: where the SNI is chosen (the bare port number) and where the
//! peer's identity is pinned (the service's SPIFFE id). The two are separate values on purpose:
//! the SNI routes on the server proxy, the pin says who it must be.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::errors::Reason;
use crate::identity::san;
use crate::identity::tls::{session_key_index, Client};
use crate::metrics;

pub type UpstreamTls = tokio_boring::SslStream<TcpStream>;

#[derive(Debug)]
pub enum ConnectError {
    /// TCP or TLS failed, or took longer than the connect timeout.
    Failed(String),
    /// The peer proved an identity other than the service's.
    Identity { got: Vec<String> },
}

impl ConnectError {
    pub fn reason(&self) -> Reason {
        match self {
            ConnectError::Failed(_) => Reason::UpstreamConnectFailure,
            ConnectError::Identity { .. } => Reason::UpstreamIdentityMismatch,
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
    identity: &str,
    timeout: Duration,
) -> Result<UpstreamTls, ConnectError> {
    let attempt = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| ConnectError::Failed(format!("connect {addr}: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let mut cfg = client
            .ctx
            .configure()
            .map_err(|e| ConnectError::Failed(format!("tls setup: {e}")))?;
        let key = (addr, port);
        cfg.set_ex_data(session_key_index(), key);
        if let Some(session) = client.sessions.get(&key) {
            // SAFETY: the session came from this very context (each context has its own cache).
            unsafe {
                let _ = cfg.set_session(&session);
            }
        }
        // The SNI is the bare port; it is not a hostname to verify.
        cfg.set_use_server_name_indication(true);
        cfg.set_verify_hostname(false);
        if let Some(alpn) = alpn {
            cfg.set_alpn_protos(alpn)
                .map_err(|e| ConnectError::Failed(format!("alpn: {e}")))?;
        }
        let sni = port.to_string();
        let tls = tokio_boring::connect(cfg, &sni, tcp).await.map_err(|e| {
            metrics::get().handshake("outbound", false);
            client.sessions.forget(&key);
            ConnectError::Failed(format!("tls handshake with {addr}: {e}"))
        })?;
        metrics::get().handshake("outbound", true);
        let der = tls
            .ssl()
            .peer_certificate()
            .and_then(|c| c.to_der().ok())
            .unwrap_or_default();
        if !san::has_uri_san(&der, identity) {
            client.sessions.forget(&key);
            return Err(ConnectError::Identity {
                got: san::spiffe_ids(&der),
            });
        }
        Ok(tls)
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Failed(format!(
            "connect {addr}: timed out after {timeout:?}"
        ))),
    }
}
