//! Endpoint choice inside a cluster: locality priorities with Envoy's overprovisioning factor,
//! then least outstanding requests over two random choices.

use std::net::SocketAddr;
use std::sync::Arc;

use super::cluster::{Cluster, EndpointState};
use super::route::labels_match;
use crate::catalog::Labels;
use crate::config::Locality;
use crate::http::answer::Reason;

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

/// Priority levels: locality gives three; a control plane's priorities above this share the
/// last level.
const LEVELS: usize = 8;

/// The level of an endpoint: the control plane's priority when the cluster has them, else the
/// locality ordering.
pub fn level(cluster: &Cluster, own: Option<&Locality>, e: &EndpointState) -> usize {
    if cluster.by_priority {
        (e.priority.unwrap_or(0) as usize).min(LEVELS - 1)
    } else {
        priority(own, e.locality.as_ref())
    }
}

/// Whether `e` may take new requests of a route choosing `subset`: it advertises the port
/// (every cluster member does), is not draining, and carries the subset's labels. `explain`
/// asks the same question.
pub fn eligible(e: &EndpointState, subset: Option<&Labels>) -> bool {
    !e.draining && subset.is_none_or(|s| labels_match(&e.labels, s))
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
    let eligible = || cluster.endpoints.iter().filter(|e| eligible(e, subset));
    let mut total = [0usize; LEVELS];
    let mut healthy = [0usize; LEVELS];
    // Per level, of its healthy endpoints: the sum of their weights and whether all are equal.
    let mut weight = [0u64; LEVELS];
    let mut first_weight = [None; LEVELS];
    let mut equal_weights = [true; LEVELS];
    let mut any = false;
    for e in eligible() {
        any = true;
        if exclude.contains(&e.address) {
            continue;
        }
        let p = level(cluster, own, e);
        total[p] += 1;
        if !e.is_ejected(now) {
            healthy[p] += 1;
            weight[p] += u64::from(e.weight);
            equal_weights[p] &= *first_weight[p].get_or_insert(e.weight) == e.weight;
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
    let mut load = [0f64; LEVELS];
    let mut remaining = 1.0f64;
    for p in 0..LEVELS {
        if total[p] == 0 {
            continue;
        }
        let health = (OVERPROVISIONING * healthy[p] as f64 / total[p] as f64).min(1.0);
        load[p] = health.min(remaining);
        remaining -= load[p];
    }
    let sum: f64 = load.iter().sum();
    let mut r = (roll(1_000_000) as f64 / 1_000_000.0) * sum;
    let mut chosen_level = 0;
    for (p, l) in load.iter().enumerate() {
        if *l > 0.0 {
            chosen_level = p;
            if r < *l {
                break;
            }
            r -= l;
        }
    }
    // The chosen level's healthy endpoints (the ones counted above), walked to each draw
    // rather than collected: the list was an allocation on every request. A draw walks half
    // the level on average, so two cost about what collecting did.
    let candidates = || {
        eligible().filter(move |e| {
            !exclude.contains(&e.address)
                && !e.is_ejected(now)
                && level(cluster, own, e) == chosen_level
        })
    };
    let n = healthy[chosen_level];
    let mut sample = || {
        if equal_weights[chosen_level] {
            // The first one if another thread ejected endpoints since they were counted.
            return candidates().nth(roll(n)).or_else(|| candidates().next());
        }
        // Weighted: each candidate's chance is its share of the level's weight.
        let mut at = roll(weight[chosen_level] as usize) as u64;
        let mut last = None;
        for e in candidates() {
            if at < u64::from(e.weight) {
                return Some(e);
            }
            at -= u64::from(e.weight);
            last = Some(e);
        }
        last
    };
    let chosen = match n {
        0 => None,
        1 => candidates().next(),
        _ => match (sample(), sample()) {
            (Some(a), Some(b)) if b.active() < a.active() => Some(b),
            (a, b) => a.or(b),
        },
    };
    chosen.cloned().ok_or(Reason::NoHealthyUpstream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{Catalog, CatalogStore};
    use crate::outbound::cluster::{ActiveGuard, Clusters};
    use std::collections::HashMap;
    use std::path::Path;

    fn cluster(endpoints: &str) -> Arc<Cluster> {
        let yaml = format!(
            "services:\n  s:\n    default_port: 80\n    identity: spiffe://aether.local/ns/default/sa/s\n    endpoints:\n{endpoints}"
        );
        let store = Arc::new(CatalogStore::new(
            Catalog::parse(Path::new("c.yaml"), &yaml, "aether.local").unwrap(),
        ));
        Clusters::new("aether.internal", store)
            .get_or_build("s", 80)
            .unwrap()
    }

    fn own() -> Locality {
        Locality::parse("r1/z1").unwrap()
    }

    fn counts(c: &Cluster, subset: Option<&Labels>, n: usize) -> HashMap<String, usize> {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut m = HashMap::new();
        for _ in 0..n {
            let e = pick(c, subset, Some(&own()), &[], |k| rng.usize(..k)).unwrap();
            *m.entry(e.address.ip().to_string()).or_default() += 1;
        }
        m
    }

    #[test]
    fn same_zone_first_then_region() {
        let c = cluster(
            "      - { address: 10.0.0.1, locality: r1/z1 }\n      - { address: 10.0.0.2, locality: r1/z2 }\n      - { address: 10.0.0.3, locality: r2/z1 }\n",
        );
        let m = counts(&c, None, 200);
        assert_eq!(m.get("10.0.0.1"), Some(&200));
        assert_eq!(priority(Some(&own()), c.endpoints[1].locality.as_ref()), 1);
        assert_eq!(priority(Some(&own()), c.endpoints[2].locality.as_ref()), 2);
    }

    #[test]
    fn traffic_spills_as_a_priority_loses_health() {
        // Two of three local endpoints ejected: local health 1/3 * 1.4 = 47%; the rest spills.
        let c = cluster(
            "      - { address: 10.0.0.1, locality: r1/z1 }\n      - { address: 10.0.0.2, locality: r1/z1 }\n      - { address: 10.0.0.3, locality: r1/z1 }\n      - { address: 10.0.0.4, locality: r1/z2 }\n",
        );
        for e in &c.endpoints[1..3] {
            for _ in 0..5 {
                c.record(e, true);
            }
        }
        // The 10% cap allows one ejection among four endpoints.
        let ejected = c
            .endpoints
            .iter()
            .filter(|e| e.is_ejected(c.now_ms()))
            .count();
        assert_eq!(ejected, 1);
        // One of three local endpoints ejected: health 2/3 * 1.4 = 93% stays local.
        let m = counts(&c, None, 2000);
        let local = 2000 - m.get("10.0.0.4").copied().unwrap_or(0);
        assert!((1780..=1940).contains(&local), "local share {local}");
    }

    #[test]
    fn draining_is_never_picked_and_an_all_draining_port_has_no_endpoints() {
        let c = cluster(
            "      - { address: 10.0.0.1 }\n      - { address: 10.0.0.2, draining: true }\n",
        );
        assert_eq!(counts(&c, None, 100).get("10.0.0.1"), Some(&100));
        let c = cluster("      - { address: 10.0.0.1, draining: true }\n");
        assert_eq!(
            pick(&c, None, None, &[], |_| 0).err(),
            Some(Reason::NoEndpoints)
        );
    }

    #[test]
    fn subsets_filter_and_an_empty_subset_has_no_endpoints() {
        let c = cluster(
            "      - { address: 10.0.0.1, labels: { version: v1 } }\n      - { address: 10.0.0.2, labels: { version: v2 } }\n",
        );
        let v2: Labels = [("version".to_string(), "v2".to_string())].into();
        assert_eq!(counts(&c, Some(&v2), 50).get("10.0.0.2"), Some(&50));
        let v3: Labels = [("version".to_string(), "v3".to_string())].into();
        assert_eq!(
            pick(&c, Some(&v3), None, &[], |_| 0).err(),
            Some(Reason::NoEndpoints)
        );
    }

    #[test]
    fn all_ejected_is_no_healthy_upstream_and_tried_ones_are_skipped() {
        let c = cluster("      - { address: 10.0.0.1 }\n      - { address: 10.0.0.2 }\n");
        let first = c.endpoints[0].address;
        let e = pick(&c, None, None, &[first], |k| k - 1).unwrap();
        assert_ne!(e.address, first);
        let both = [first, c.endpoints[1].address];
        assert_eq!(
            pick(&c, None, None, &both, |_| 0).err(),
            Some(Reason::UpstreamConnectFailure)
        );
        let c = cluster("      - { address: 10.0.0.1 }\n");
        for _ in 0..5 {
            c.record(&c.endpoints[0], true);
        }
        assert_eq!(
            pick(&c, None, None, &[], |_| 0).err(),
            Some(Reason::NoHealthyUpstream)
        );
    }

    #[test]
    fn two_choices_prefer_the_less_loaded() {
        let c = cluster("      - { address: 10.0.0.1 }\n      - { address: 10.0.0.2 }\n");
        let _busy: Vec<_> = (0..3)
            .map(|_| ActiveGuard::new(c.endpoints[0].clone()))
            .collect();
        // Rolls pick endpoint 0 then endpoint 1: the idle one wins.
        let mut rolls = [0usize, 0, 1].into_iter();
        let e = pick(&c, None, None, &[], |_| rolls.next().unwrap()).unwrap();
        assert_eq!(e.address, c.endpoints[1].address);
    }
}

#[cfg(test)]
mod weights_and_priorities {
    use super::*;
    use crate::catalog::{Catalog, CatalogStore};
    use crate::outbound::cluster::Clusters;
    use std::path::Path;

    /// A cluster of `endpoints` (catalog YAML lines), after `edit` changed the parsed service.
    fn cluster_with(
        endpoints: &str,
        edit: impl FnOnce(&mut crate::catalog::Service),
    ) -> Arc<Cluster> {
        let yaml = format!(
            "services:\n  s:\n    default_port: 80\n    identity: spiffe://aether.local/ns/default/sa/s\n    endpoints:\n{endpoints}"
        );
        let mut catalog = Catalog::parse(Path::new("c.yaml"), &yaml, "aether.local").unwrap();
        let svc = catalog.services.get_mut("s").unwrap();
        edit(Arc::make_mut(svc));
        let store = Arc::new(CatalogStore::new(catalog));
        Clusters::new("aether.internal", store)
            .get_or_build("s", 80)
            .unwrap()
    }

    fn share_of(c: &Cluster, ip: &str, n: usize) -> usize {
        let mut rng = fastrand::Rng::with_seed(11);
        (0..n)
            .filter(|_| {
                let e = pick(c, None, None, &[], |k| rng.usize(..k)).unwrap();
                e.address.ip().to_string() == ip
            })
            .count()
    }

    #[test]
    fn weights_share_traffic_within_a_level() {
        let c = cluster_with(
            "      - { address: 10.0.0.1, weight: 1 }\n      - { address: 10.0.0.2, weight: 3 }\n",
            |_| {},
        );
        let heavy = share_of(&c, "10.0.0.2", 4000);
        assert!(
            (2700..=3300).contains(&heavy),
            "weight 3 of 4 got {heavy}/4000"
        );
    }

    #[test]
    fn control_plane_priorities_order_endpoints_instead_of_locality() {
        let c = cluster_with(
            "      - { address: 10.0.0.1 }\n      - { address: 10.0.0.2 }\n",
            |s| {
                s.endpoints[0].priority = Some(1);
                s.endpoints[1].priority = Some(0);
            },
        );
        assert!(c.by_priority);
        assert_eq!(share_of(&c, "10.0.0.2", 500), 500);
        // Priority 0 ejected: its traffic moves to priority 1.
        for _ in 0..5 {
            c.record(&c.endpoints[1], true);
        }
        assert_eq!(share_of(&c, "10.0.0.1", 500), 500);
    }
}
