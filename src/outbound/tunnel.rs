//! `CONNECT host:port` to a tcp port: a raw mTLS connection (no ALPN) to an endpoint, then bytes
//! both ways between the app and it, half-close respected. Upgraded HTTP/1.1 connections (both
//! listeners) are spliced here too.

use std::io;
use std::net::IpAddr;
use std::sync::Arc;

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use super::cluster::{Cluster, ConnSlot, EndpointState};
use super::connect::{ConnectError, Upstream, UpstreamTls};
use super::retry::Tries;
use super::route::choose_subset;
use crate::accesslog::ConnLog;
use crate::config::Locality;
use crate::drain::Drain;
use crate::http::answer::Reason;
use crate::sockets::Spliced;

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

/// The far side of a tunnel.
pub enum Far {
    /// A connection opened for the tunnel (CONNECT).
    Tls(UpstreamTls),
    /// The connection the next hop's `101` answer hands over (an HTTP/1.1 upgrade).
    Upgraded(OnUpgrade),
}

/// Copies bytes both ways once the near side (the request's connection) is upgraded, half-close
/// respected, until `tunnel_idle` passes without a byte or the drain ends; `held` (in-flight
/// counts, the drain tracker, the request's place on its connection) is released when the
/// tunnel ends, and `log` leaves its line. Idle ends are counted for `listener`.
pub fn splice<G: Send + 'static>(
    near: OnUpgrade,
    far: Far,
    listener: &'static str,
    log: ConnLog,
    drain: Drain,
    held: G,
) {
    tokio::spawn(async move {
        let idle = crate::http::limits::timers().tunnel_idle;
        let r = async {
            let mut near = TokioIo::new(near.await.map_err(io::Error::other)?);
            Ok::<_, io::Error>(match far {
                Far::Tls(mut tls) => {
                    tls.batch_writes();
                    crate::sockets::splice(&mut near, &mut tls, idle, listener, &drain).await
                }
                Far::Upgraded(up) => {
                    let mut up = TokioIo::new(up.await.map_err(io::Error::other)?);
                    crate::sockets::splice(&mut near, &mut up, idle, listener, &drain).await
                }
            })
        };
        let spliced = r.await.unwrap_or_else(|e| {
            // The upgrade itself failed (a side went away before it completed).
            tracing::debug!(authority = %log.authority, "tunnel never started: {e}");
            Spliced::refused()
        });
        log.finish(&spliced);
        drop(held);
    });
}
