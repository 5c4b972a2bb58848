//! What the ADS stream subscribes to, per resource kind: the names each service needs, how many
//! services need each name, and what the server has been told. A name is subscribed when the
//! first service needs it and unsubscribed when the last one stops; a new stream starts from
//! nothing told. Plain data, so it is tested without gRPC.

use std::collections::{BTreeSet, HashMap};

use super::resources::{CLUSTER_TYPE, ENDPOINT_TYPE};

/// The two resource types of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Cluster,
    Endpoint,
}

impl Kind {
    pub(super) const ALL: [Kind; 2] = [Kind::Cluster, Kind::Endpoint];

    pub(super) fn type_url(self) -> &'static str {
        match self {
            Kind::Cluster => CLUSTER_TYPE,
            Kind::Endpoint => ENDPOINT_TYPE,
        }
    }

    pub(super) fn metric(self) -> &'static str {
        match self {
            Kind::Cluster => "cluster",
            Kind::Endpoint => "endpoint",
        }
    }

    pub(super) fn of(type_url: &str) -> Option<Kind> {
        match type_url {
            CLUSTER_TYPE => Some(Kind::Cluster),
            ENDPOINT_TYPE => Some(Kind::Endpoint),
            _ => None,
        }
    }
}

/// One value for each resource kind.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct PerKind<T> {
    pub(super) cluster: T,
    pub(super) endpoint: T,
}

impl<T> PerKind<T> {
    pub(super) fn get(&self, kind: Kind) -> &T {
        match kind {
            Kind::Cluster => &self.cluster,
            Kind::Endpoint => &self.endpoint,
        }
    }

    pub(super) fn get_mut(&mut self, kind: Kind) -> &mut T {
        match kind {
            Kind::Cluster => &mut self.cluster,
            Kind::Endpoint => &mut self.endpoint,
        }
    }
}

/// Resource names, per kind.
pub(super) type Names = PerKind<BTreeSet<String>>;

impl Names {
    fn is_empty(&self) -> bool {
        self.cluster.is_empty() && self.endpoint.is_empty()
    }
}

/// What one request tells the server for one kind.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Change {
    /// Sorted.
    pub(super) subscribe: Vec<String>,
    pub(super) unsubscribe: Vec<String>,
}

#[derive(Default)]
pub(super) struct Subscriptions {
    /// Per service, the names it needs subscribed.
    needs: HashMap<String, Names>,
    /// Per kind, how many services need each name.
    counts: PerKind<HashMap<String, usize>>,
    /// What the server was told we subscribe to, per kind.
    told: Names,
    /// Names that became needed or stopped being needed since the last request of their kind.
    crossed: Names,
}

impl Subscriptions {
    /// Service `svc` needs `new` from now on (nothing, when empty), in place of what it needed.
    pub(super) fn need(&mut self, svc: String, new: Names) {
        let old = self.needs.remove(&svc).unwrap_or_default();
        for kind in Kind::ALL {
            let count = self.counts.get_mut(kind);
            let crossed = self.crossed.get_mut(kind);
            for n in new.get(kind).difference(old.get(kind)) {
                let c = count.entry(n.clone()).or_default();
                *c += 1;
                if *c == 1 {
                    crossed.insert(n.clone());
                }
            }
            for n in old.get(kind).difference(new.get(kind)) {
                if let Some(c) = count.get_mut(n) {
                    *c -= 1;
                    if *c == 0 {
                        count.remove(n);
                        crossed.insert(n.clone());
                    }
                }
            }
        }
        if !new.is_empty() {
            self.needs.insert(svc, new);
        }
    }

    /// A new stream: the server has been told nothing yet.
    pub(super) fn restart(&mut self) {
        self.told = Default::default();
    }

    /// What the next request for `kind` tells the server, now counted as told; `None` when
    /// there is nothing to tell. `initial`: the first request of a stream, which subscribes to
    /// every name needed; else only names whose need began or ended since the last request
    /// are looked at.
    pub(super) fn next_change(&mut self, kind: Kind, initial: bool) -> Option<Change> {
        let crossed = std::mem::take(self.crossed.get_mut(kind));
        let count = self.counts.get(kind);
        let told = self.told.get_mut(kind);
        let candidates: Vec<&String> = match initial {
            true => count.keys().collect(),
            false => crossed.iter().collect(),
        };
        let (mut subscribe, mut unsubscribe) = (Vec::new(), Vec::new());
        for n in candidates {
            match (count.contains_key(n), told.contains(n)) {
                (true, false) => subscribe.push(n.clone()),
                (false, true) => unsubscribe.push(n.clone()),
                _ => {}
            }
        }
        if subscribe.is_empty() && unsubscribe.is_empty() {
            return None;
        }
        subscribe.sort();
        told.extend(subscribe.iter().cloned());
        for n in &unsubscribe {
            told.remove(n);
        }
        Some(Change {
            subscribe,
            unsubscribe,
        })
    }

    /// Whether some service needs `name`.
    pub(super) fn needed(&self, kind: Kind, name: &str) -> bool {
        self.counts.get(kind).contains_key(name)
    }

    /// Whether the server was told we subscribe to `name`.
    pub(super) fn told(&self, kind: Kind, name: &str) -> bool {
        self.told.get(kind).contains(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(clusters: &[&str], endpoints: &[&str]) -> Names {
        let set = |ns: &[&str]| ns.iter().map(|n| n.to_string()).collect();
        Names {
            cluster: set(clusters),
            endpoint: set(endpoints),
        }
    }

    fn change(subscribe: &[&str], unsubscribe: &[&str]) -> Option<Change> {
        let list = |ns: &[&str]| ns.iter().map(|n| n.to_string()).collect();
        Some(Change {
            subscribe: list(subscribe),
            unsubscribe: list(unsubscribe),
        })
    }

    #[test]
    fn a_needed_name_is_subscribed_once_in_sorted_order() {
        let mut subs = Subscriptions::default();
        subs.need(
            "payments".into(),
            names(&["payments.mesh:9090", "payments.mesh"], &["payments.mesh"]),
        );
        assert_eq!(
            subs.next_change(Kind::Cluster, false),
            change(&["payments.mesh", "payments.mesh:9090"], &[])
        );
        assert_eq!(
            subs.next_change(Kind::Endpoint, false),
            change(&["payments.mesh"], &[])
        );
        assert!(subs.told(Kind::Cluster, "payments.mesh:9090"));
        assert!(subs.needed(Kind::Endpoint, "payments.mesh"));
        // Told once: the next request has nothing to add.
        assert_eq!(subs.next_change(Kind::Cluster, false), None);
        assert_eq!(subs.next_change(Kind::Endpoint, false), None);
        // The same needs again change nothing either.
        subs.need(
            "payments".into(),
            names(&["payments.mesh", "payments.mesh:9090"], &["payments.mesh"]),
        );
        assert_eq!(subs.next_change(Kind::Cluster, false), None);
    }

    #[test]
    fn a_name_no_service_needs_is_unsubscribed() {
        let mut subs = Subscriptions::default();
        subs.need("payments".into(), names(&["payments.mesh"], &["eds-a"]));
        subs.next_change(Kind::Cluster, false);
        subs.next_change(Kind::Endpoint, false);
        // The service now needs another assignment: one out, one in, in one request.
        subs.need("payments".into(), names(&["payments.mesh"], &["eds-b"]));
        assert_eq!(subs.next_change(Kind::Cluster, false), None);
        assert_eq!(
            subs.next_change(Kind::Endpoint, false),
            change(&["eds-b"], &["eds-a"])
        );
        assert!(!subs.told(Kind::Endpoint, "eds-a"));
        // Nothing needed any more: everything goes.
        subs.need("payments".into(), names(&[], &[]));
        assert_eq!(
            subs.next_change(Kind::Cluster, false),
            change(&[], &["payments.mesh"])
        );
        assert_eq!(
            subs.next_change(Kind::Endpoint, false),
            change(&[], &["eds-b"])
        );
        assert!(!subs.needed(Kind::Cluster, "payments.mesh"));
    }

    #[test]
    fn a_name_two_services_need_stays_until_neither_does() {
        let mut subs = Subscriptions::default();
        subs.need("a".into(), names(&["a.mesh"], &["shared"]));
        subs.need("b".into(), names(&["b.mesh"], &["shared"]));
        assert_eq!(
            subs.next_change(Kind::Endpoint, false),
            change(&["shared"], &[])
        );
        subs.next_change(Kind::Cluster, false);
        subs.need("a".into(), names(&[], &[]));
        assert_eq!(
            subs.next_change(Kind::Endpoint, false),
            None,
            "b still needs it"
        );
        assert_eq!(
            subs.next_change(Kind::Cluster, false),
            change(&[], &["a.mesh"])
        );
        subs.need("b".into(), names(&[], &[]));
        assert_eq!(
            subs.next_change(Kind::Endpoint, false),
            change(&[], &["shared"])
        );
    }

    #[test]
    fn a_name_needed_and_dropped_between_requests_is_never_sent() {
        let mut subs = Subscriptions::default();
        subs.need("a".into(), names(&["a.mesh"], &[]));
        subs.need("a".into(), names(&[], &[]));
        assert_eq!(subs.next_change(Kind::Cluster, false), None);
        assert!(!subs.told(Kind::Cluster, "a.mesh"));
    }

    #[test]
    fn a_new_stream_subscribes_again_to_everything_needed() {
        let mut subs = Subscriptions::default();
        subs.need("b".into(), names(&["b.mesh"], &["eds-b"]));
        subs.need("a".into(), names(&["a.mesh"], &["eds-a"]));
        subs.next_change(Kind::Cluster, false);
        subs.next_change(Kind::Endpoint, false);
        // The stream was lost: the server of the next one has been told nothing. Its first
        // request names every needed name, though none became needed since the last request.
        subs.restart();
        assert!(!subs.told(Kind::Cluster, "a.mesh"));
        assert_eq!(
            subs.next_change(Kind::Cluster, true),
            change(&["a.mesh", "b.mesh"], &[])
        );
        assert_eq!(
            subs.next_change(Kind::Endpoint, true),
            change(&["eds-a", "eds-b"], &[])
        );
        assert_eq!(subs.next_change(Kind::Cluster, true), None);
        // With nothing needed, a new stream's first request has nothing to say (an empty
        // subscription would be a wildcard).
        let mut idle = Subscriptions::default();
        idle.restart();
        assert_eq!(idle.next_change(Kind::Cluster, true), None);
    }

    #[test]
    fn kinds_map_to_their_type_urls_and_back() {
        for kind in Kind::ALL {
            assert_eq!(Kind::of(kind.type_url()), Some(kind));
        }
        assert_eq!(
            Kind::of("type.googleapis.com/envoy.config.listener.v3.Listener"),
            None
        );
    }
}
