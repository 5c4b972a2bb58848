//! `CONNECT host:port` to a tcp port: a raw mTLS connection (no ALPN) to an endpoint, then bytes
//! both ways between the app and it, half-close respected.

use std::net::IpAddr;
use std::sync::Arc;

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use super::cluster::{Cluster, ConnSlot, EndpointState};
use super::connect::{ConnectError, Upstream, UpstreamTls};
use super::retry::Tries;
use super::route::choose_subset;
use crate::config::Locality;
use crate::http::answer::Reason;

/// Connects to an endpoint of `cluster` (of the subset the service's `routes` pick for the
/// CONNECT's headers, as for any request), retrying failed connects on other endpoints.
pub async fn open(
    up: &Upstream,
    locality: Option<&Locality>,
    cluster: &Cluster,
    headers: &http::HeaderMap,
    src: IpAddr,
) -> Result<(UpstreamTls, ConnSlot, Arc<EndpointState>), Reason> {
    let subset = choose_subset(&cluster.service, headers, fastrand::u32(..));
    let mut tries = Tries::new(cluster, subset, locality);
    loop {
        let ep = tries.next()?;
        match up.connect_tcp(cluster, ep.address, src).await {
            Ok((tls, slot)) => {
                cluster.record(&ep, false);
                return Ok((tls, slot, ep));
            }
            Err(ConnectError::Overflow) => return Err(Reason::Overflow),
            Err(e) => {
                tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "tunnel connect failed: {e}");
                if !tries.failed(&ep, e.reason()) {
                    return Err(tries.last());
                }
            }
        }
    }
}

/// Copies bytes both ways once the app's side of the CONNECT is upgraded; `held` (in-flight
/// counts, the drain tracker) is released when the tunnel ends.
pub fn splice<G: Send + 'static>(upgrade: OnUpgrade, mut tls: UpstreamTls, name: String, held: G) {
    tokio::spawn(async move {
        match upgrade.await {
            Ok(up) => {
                let mut up = TokioIo::new(up);
                let idle = crate::http::limits::timers().tunnel_idle;
                match crate::sockets::splice(&mut up, &mut tls, idle, "outbound").await {
                    Ok((a, b)) => {
                        tracing::debug!(cluster = %name, up = a, down = b, "tunnel done")
                    }
                    Err(e) => tracing::debug!(cluster = %name, "tunnel ended: {e}"),
                }
            }
            Err(e) => tracing::debug!(cluster = %name, "CONNECT upgrade failed: {e}"),
        }
        drop(held);
    });
}
