//! An HTTP request to a cluster: the subset, an endpoint, a pooled or new connection, retries
//! of what the upstream never processed (or, for idempotent body-less requests, never began
//! to answer; `retry.rs` decides), and the request timeout around all of it.

use std::net::IpAddr;

use http::{Response, Version};

use super::cluster::{ActiveGuard, Cluster};
use super::connect::{ConnectError, PoolKey, Upstream};
use super::pool::{Conn, SendError, StreamGuard, Waited};
use super::retry::{self, Resend, Tries, MAX_RETRIES};
use super::route::choose_subset;
use crate::config::Locality;
use crate::http::answer::Reason;
use crate::http::body::{BoxedRequest, UpBody};
use crate::http::headers;

/// What a request holds until its response body ends: its endpoint's in-flight count and its
/// place on a multiplexed connection.
pub struct InFlight {
    pub active: ActiveGuard,
    #[allow(dead_code)] // held for its Drop
    stream: Option<StreamGuard>,
}

impl InFlight {
    /// A request on a connection of its own.
    pub fn unpooled(active: ActiveGuard) -> InFlight {
        InFlight {
            active,
            stream: None,
        }
    }
}

/// Sends `req` to `cluster`; the response comes with its hop-by-hop headers removed.
pub async fn forward(
    up: &Upstream,
    locality: Option<&Locality>,
    mut req: BoxedRequest,
    cluster: &Cluster,
    authority: &str,
    src: IpAddr,
) -> Result<(Response<UpBody>, InFlight), Reason> {
    let h2_first = req.version() == Version::HTTP_2;
    headers::strip_hop_by_hop(req.headers_mut());
    let subset = choose_subset(&cluster.service, req.headers(), fastrand::u32(..)).cloned();
    let tries = Tries::new(cluster, subset.as_ref(), locality);
    // Boxed where it is built: the exchange's future (retries, the pool, hyper's send) is
    // several KiB, and each future around it would otherwise copy it whole (see
    // `memory::box_future`).
    let attempt =
        crate::memory::box_future(|| attempts(up, tries, req, cluster, authority, h2_first, src));
    match tokio::time::timeout(cluster.service.request_timeout, attempt).await {
        Ok(Ok((mut resp, inflight))) => {
            headers::forwarded_response(&mut resp);
            Ok((resp, inflight))
        }
        Ok(Err(r)) => Err(r),
        Err(_) => Err(Reason::UpstreamTimeout),
    }
}

async fn attempts(
    up: &Upstream,
    mut tries: Tries<'_>,
    req: BoxedRequest,
    cluster: &Cluster,
    authority: &str,
    h2_first: bool,
    src: IpAddr,
) -> Result<(Response<UpBody>, InFlight), Reason> {
    let max_uses = cluster.service.max_requests_per_connection;
    let received = req.body().received();
    let mut req = Some(req);
    // Why the attempt before this one failed (the `reason` of the retry counter).
    let mut retrying: Option<&'static str> = None;
    // Every failure below records its endpoint as tried, so this ends within MAX_RETRIES + 1.
    for _ in 0..=MAX_RETRIES {
        let ep = tries.next()?;
        if let Some(why) = retrying.take() {
            super::metrics::retry(
                crate::metrics::Direction::outbound,
                &cluster.service.name,
                cluster.port,
                why,
            );
        }
        let active = ActiveGuard::new(ep.clone());
        let key = up.key(cluster, ep.address, h2_first, src);
        let conn = match up.pool.get(&key, max_uses) {
            Some(c) => c,
            None => match dial(up, &key, cluster, max_uses).await {
                Ok(c) => c,
                Err(Dial::Overflow) => return Err(Reason::Overflow),
                Err(Dial::Failed(reason)) => {
                    if !tries.failed(&ep, reason) {
                        break;
                    }
                    retrying = Some("connect-failure");
                    continue;
                }
                Err(Dial::WaitedForAFailure) => {
                    if !tries.skip(&ep, Reason::UpstreamConnectFailure) {
                        break;
                    }
                    retrying = Some("connect-failure");
                    continue;
                }
            },
        };
        let mut r = req.take().expect("a request is present until sent");
        let to_h2 = matches!(conn, Conn::H2(..));
        headers::retarget(&mut r, to_h2, authority)?;
        if !to_h2 {
            headers::keep_h1_body(&mut r);
        }
        // hyper consumes the request even when the upstream then refuses it: keep a copy to
        // send again, when that is possible at all.
        let again = if tries.may_retry() {
            Resend::of(&r)
        } else {
            None
        };
        match up.pool.send(&key, conn, r, max_uses).await {
            Ok((resp, stream)) => {
                if let Some(why) = headers::unforwardable(&resp) {
                    tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "upstream {why}");
                    cluster.record(&ep, true);
                    return Err(Reason::UpstreamProtocolError);
                }
                cluster.record(&ep, resp.status().is_server_error());
                // The server sidecar's app refused the connection: the request reached no
                // app, as with a refused stream. Another endpoint when the request can go
                // again; else this answer as it came.
                // (`again` is kept only when a retry is left, so `skip` allows one.)
                if let Some(a) = again.filter(|_| retry::app_unavailable(&resp)) {
                    if tries.skip(&ep, Reason::AppUnavailable) {
                        req = Some(Box::new(a.into_request()));
                        retrying = Some("refused");
                        continue;
                    }
                }
                return Ok((resp, InFlight { active, stream }));
            }
            Err(SendError::NotSent(r)) => {
                // The pooled connection was closed before the request went out: another
                // endpoint, as for a failed connect.
                if !tries.skip(&ep, Reason::UpstreamConnectFailure) {
                    break;
                }
                req = Some(r);
                retrying = Some("pool-closed");
            }
            Err(SendError::Failed(e)) if received.as_ref().is_some_and(|r| r.client_failed()) => {
                // The client's own body broke (malformed framing, a close or reset mid-body):
                // the endpoint did nothing wrong, so no outlier failure and no retry.
                tracing::info!(cluster = %cluster.name, endpoint = %ep.address, "the client broke its request: {e}");
                return Err(Reason::BadRequest);
            }
            Err(SendError::Failed(e)) => {
                let failure = retry::classify(&e);
                tracing::info!(cluster = %cluster.name, endpoint = %ep.address, ?failure, "upstream broke the exchange: {e}");
                let retry_left = tries.failed(&ep, failure.reason());
                match again {
                    Some(a) if retry_left && a.allowed_after(failure) => {
                        req = Some(Box::new(a.into_request()));
                        retrying = Some(failure.label());
                    }
                    _ => return Err(failure.reason()),
                }
            }
        }
    }
    Err(tries.last())
}

/// Why `dial` gave no connection.
enum Dial {
    /// The cluster's connection breaker is full.
    Overflow,
    /// This request's own dial failed (outlier detection counts it).
    Failed(Reason),
    /// The dial this request waited for failed; not dialled again.
    WaitedForAFailure,
}

/// A connection for `key` when the pool had none: after its turn to dial (one dial per key in
/// flight) or, for a key whose connections are not shared, a place (one of
/// `pool::PARALLEL_DIALS`), from the pool if one came back meanwhile, else a new one.
async fn dial(
    up: &Upstream,
    key: &PoolKey,
    cluster: &Cluster,
    max_uses: u32,
) -> Result<Conn, Dial> {
    // Boxed, here and below: dialling is the rare path, and its machinery would otherwise be
    // part of (and copied with) every request's future.
    let mut right = match Box::pin(up.pool.wait_to_dial(key, max_uses)).await {
        Waited::Dial(right) => right,
        Waited::Pooled(c) => return Ok(c),
        Waited::DialFailed => return Err(Dial::WaitedForAFailure),
    };
    match Box::pin(up.connect_http(key, cluster)).await {
        Ok(c) => {
            up.pool
                .dialled(key, matches!(c, Conn::H2(..)) && max_uses != 1);
            Ok(c)
        }
        Err(ConnectError::Overflow) => Err(Dial::Overflow),
        Err(e) => {
            right.failed();
            tracing::info!(cluster = %cluster.name, endpoint = %key.endpoint, "upstream connect failed: {e}");
            Err(Dial::Failed(e.reason()))
        }
    }
}
