//! Endpoint choice inside a cluster: locality priorities with Envoy's overprovisioning factor,
//! then least outstanding requests over two random choices.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::catalog::Labels;
use crate::cluster::{Cluster, EndpointState};
use crate::config::Locality;
use crate::errors::Reason;
use crate::routing::labels_match;

/// Envoy's overprovisioning factor: a priority keeps all traffic until its healthy share
/// drops below 1/1.4 (~71%).
const OVERPROVISIONING: f64 = 1.4;

/// 0: same zone, 1: same region, 2: elsewhere (or unknown).
pub fn priority(own: Option<&Locality>, ep: Option<&Locality>) -> usize {
    match (own, ep) {
        (Some(o), Some(e)) if o.region == e.region && o.zone == e.zone => 0,
        (Some(o), Some(e)) if o.region == e.region => 1,
        (None, _) => 0,
        _ => 2,
    }
}

/// Picks an endpoint for a new request. `exclude` holds endpoints already tried by this
/// request. `roll` values are uniform random numbers (injected for tests).
pub fn pick(
    cluster: &Cluster,
    subset: Option<&Labels>,
    own: Option<&Locality>,
    exclude: &[SocketAddr],
    mut roll: impl FnMut(usize) -> usize,
) -> Result<Arc<EndpointState>, Reason> {
    let now = cluster.now_ms();
    // Eligible: advertises the port (every cluster member does), not draining, in the subset.
    let eligible = || {
        cluster
            .endpoints
            .iter()
            .filter(|e| !e.draining && subset.is_none_or(|s| labels_match(&e.labels, s)))
    };
    let mut total = [0usize; 3];
    let mut healthy = [0usize; 3];
    let mut any = false;
    for e in eligible() {
        any = true;
        if exclude.contains(&e.address) {
            continue;
        }
        let p = priority(own, e.locality.as_ref());
        total[p] += 1;
        if !e.is_ejected(now) {
            healthy[p] += 1;
        }
    }
    if !any {
        return Err(Reason::NoEndpoints);
    }
    if total.iter().sum::<usize>() == 0 {
        // Every eligible endpoint was already tried by this request.
        return Err(Reason::UpstreamConnectFailure);
    }
    if healthy.iter().sum::<usize>() == 0 {
        return Err(Reason::NoHealthyUpstream);
    }
    // Priority load: each level takes its overprovisioned health, spilling the rest down.
    let mut load = [0f64; 3];
    let mut remaining = 1.0f64;
    for p in 0..3 {
        if total[p] == 0 {
            continue;
        }
        let health = (OVERPROVISIONING * healthy[p] as f64 / total[p] as f64).min(1.0);
        load[p] = health.min(remaining);
        remaining -= load[p];
    }
    let sum: f64 = load.iter().sum();
    let mut r = (roll(1_000_000) as f64 / 1_000_000.0) * sum;
    let mut level = 0;
    for (p, l) in load.iter().enumerate() {
        if *l > 0.0 {
            level = p;
            if r < *l {
                break;
            }
            r -= l;
        }
    }
    let candidates: Vec<&Arc<EndpointState>> = eligible()
        .filter(|e| {
            !exclude.contains(&e.address)
                && !e.is_ejected(now)
                && priority(own, e.locality.as_ref()) == level
        })
        .collect();
    let chosen = match candidates.len() {
        0 => return Err(Reason::NoHealthyUpstream),
        1 => candidates[0],
        n => {
            let a = candidates[roll(n)];
            let b = candidates[roll(n)];
            if b.active.load(Ordering::Relaxed) < a.active.load(Ordering::Relaxed) {
                b
            } else {
                a
            }
        }
    };
    Ok(chosen.clone())
}
