//! An HTTP/1.1 upgrade (WebSocket or any other token) to a cluster: a dedicated HTTP/1.1 mTLS
//! connection to one endpoint, the request on it, and after the server's `101` the request's
//! connection and that one become a tunnel (`tunnel::splice`). Any other answer is an ordinary
//! response, after which the connection closes.

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;

use super::cluster::{ActiveGuard, Cluster, ConnSlot};
use super::connect::{ConnectError, Upstream};
use super::retry::Tries;
use super::route::choose_subset;
use crate::config::Locality;
use crate::http::answer::Reason;
use crate::http::body::ReqBody;
use crate::http::headers;

/// What the next hop answered to an upgrade request.
pub enum Answer {
    /// It switched: the `101` to pass on, the far side of the tunnel, and what the tunnel
    /// holds (the connection's breaker place, the endpoint's in-flight count).
    Switched {
        resp: Response<Incoming>,
        far: OnUpgrade,
        slot: Arc<ConnSlot>,
        active: ActiveGuard,
    },
    /// It did not: an ordinary response.
    Refused {
        resp: Response<Incoming>,
        active: ActiveGuard,
    },
}

/// Sends the upgrade request `req` (asking for `to`) to an endpoint of `cluster`. Failed
/// connects are retried on other endpoints; the request itself is sent once. The request
/// timeout runs until the answer's head.
pub async fn send(
    up: &Upstream,
    locality: Option<&Locality>,
    mut req: Request<ReqBody>,
    to: HeaderValue,
    cluster: &Cluster,
    authority: &str,
    src: IpAddr,
) -> Result<Answer, Reason> {
    headers::strip_hop_by_hop_upgrading(req.headers_mut(), to.clone());
    headers::retarget(&mut req, false, authority)?;
    let subset = choose_subset(&cluster.service, req.headers(), fastrand::u32(..)).cloned();
    let attempt = async {
        let mut tries = Tries::new(cluster, subset.as_ref(), locality);
        let (mut sender, slot, ep) = loop {
            let ep = tries.next()?;
            match up.connect_upgrade(cluster, ep.address, src).await {
                Ok((sender, slot)) => break (sender, slot, ep),
                Err(ConnectError::Overflow) => return Err(Reason::Overflow),
                Err(e @ ConnectError::H2Only { .. }) => {
                    tracing::debug!(cluster = %cluster.name, "upgrade refused: {e}");
                    return Err(e.reason());
                }
                Err(e) => {
                    tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "upgrade connect failed: {e}");
                    if !tries.failed(&ep, e.reason()) {
                        return Err(tries.last());
                    }
                }
            }
        };
        let active = ActiveGuard::new(ep.clone());
        let mut resp = match sender.send_request(req).await {
            Ok(resp) => resp,
            Err(e) => {
                tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "upstream broke the upgrade: {e}");
                cluster.record(&ep, true);
                return Err(Reason::UpstreamProtocolError);
            }
        };
        cluster.record(&ep, resp.status().is_server_error());
        Ok(match switched_to(&resp, &to)? {
            Some(to) => {
                let far = hyper::upgrade::on(&mut resp);
                headers::strip_hop_by_hop_upgrading(resp.headers_mut(), to);
                Answer::Switched {
                    resp,
                    far,
                    slot,
                    active,
                }
            }
            None => {
                headers::forwarded_response(&mut resp);
                Answer::Refused { resp, active }
            }
        })
    };
    match tokio::time::timeout(cluster.service.request_timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(Reason::UpstreamTimeout),
    }
}

/// The protocol a `101` answer switched to (its `Upgrade` value, else the one `offered`);
/// `None` for any other answer. A `101` to something the request did not offer is broken
/// HTTP: 502, never a tunnel.
pub fn switched_to<B>(
    resp: &Response<B>,
    offered: &HeaderValue,
) -> Result<Option<HeaderValue>, Reason> {
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Ok(None);
    }
    let answer = resp.headers().get(http::header::UPGRADE);
    if !headers::switched_as_offered(answer, offered) {
        tracing::info!(
            ?answer,
            ?offered,
            "upstream switched to a protocol not offered"
        );
        return Err(Reason::UpstreamProtocolError);
    }
    Ok(Some(answer.unwrap_or(offered).clone()))
}
