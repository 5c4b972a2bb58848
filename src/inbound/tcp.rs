//! Raw TCP chains: bytes both ways between the peer and `app_host:<port>`, half-close respected.

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use std::net::IpAddr;

use super::chain::Chain;
use super::peer::{Peer, TlsStream};
use crate::accesslog::ConnLog;
use crate::drain::Drain;
use crate::metrics::Direction;
use crate::sockets::Spliced;

pub async fn forward(
    app_host: IpAddr,
    chain: &Chain,
    peer: &Peer,
    mut tls: TlsStream,
    drain: &Drain,
) {
    let app_addr = std::net::SocketAddr::new(app_host, chain.port);
    let mut log = ConnLog::new(Direction::inbound, "tcp", app_addr.to_string());
    log.upstream = Some(app_addr);
    log.peer_identity = Some(peer.spiffe_id.clone());
    if !chain.allows(&peer.spiffe_id) {
        tracing::info!(peer = %peer.spiffe_id, port = chain.port, "inbound tcp: identity not allowed; closing");
        let _ = tls.shutdown().await;
        log.finish(&Spliced::refused());
        return;
    }
    let mut app = match TcpStream::connect((app_host, chain.port)).await {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(
                port = chain.port,
                "inbound tcp: app port did not answer: {e}"
            );
            let _ = tls.shutdown().await;
            log.finish(&Spliced::refused());
            return;
        }
    };
    crate::sockets::tune(&app);
    // Each write side is shut down when the other side's read ends, so a half-closed peer
    // still gets the app's remaining answer.
    let idle = crate::http::limits::timers().tunnel_idle;
    tls.batch_writes();
    let spliced = crate::sockets::splice(&mut tls, &mut app, idle, "inbound", drain).await;
    log.finish(&spliced);
}
