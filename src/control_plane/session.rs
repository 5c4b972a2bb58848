//! One delta ADS stream, as plain data: what the client subscribed to per type, what it holds,
//! and the responses owed to it after a request or a new catalog. No gRPC in here, so the
//! protocol is tested with requests built by hand.
//!
//! The rules followed (xDS protocol, incremental variant): a type's first request with no names
//! is a wildcard, as is `*`; a subscribe is answered with the resource, or with the name in
//! `removed_resources` when it does not exist; a client that declared a version in
//! `initial_resource_versions` is not sent that version again; every response has its own
//! nonce, and a request carrying it is its ACK, or its NACK when it has `error_detail`.

use std::collections::{BTreeMap, BTreeSet};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource as PbResource,
};

use super::resources::{Kind, Snapshot};

/// How many unanswered responses are remembered for the log of their ACK or NACK; a client
/// that never answers must not grow the session.
const REMEMBERED: usize = 256;

/// What one stream subscribed to, for one type.
#[derive(Debug, Default)]
pub struct Subscription {
    /// A request of this type was seen on the stream (the first one decides a legacy wildcard).
    pub started: bool,
    /// Every resource of the type, present and future.
    pub wildcard: bool,
    /// Names subscribed one by one.
    pub names: BTreeSet<String>,
    /// What the client holds, by name: the version last sent (or declared by it), or `None`
    /// once it was told the name does not exist.
    pub known: BTreeMap<String, Option<String>>,
}

impl Subscription {
    fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }
}

/// A response not answered yet: what it carried, for the log of a NACK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub kind: Kind,
    pub names: Vec<String>,
    pub removed: Vec<String>,
}

/// How the client answered a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Ack {
        nonce: String,
        sent: Option<Sent>,
    },
    Nack {
        nonce: String,
        sent: Option<Sent>,
        message: String,
    },
}

/// What a request led to.
#[derive(Debug, Default)]
pub struct Handled {
    /// The ACK or NACK the request carried, if any.
    pub answer: Option<Answer>,
    pub responses: Vec<DeltaDiscoveryResponse>,
    /// A type this server does not serve (the request is otherwise ignored).
    pub unknown_type: Option<String>,
}

/// One stream's state.
#[derive(Debug)]
pub struct Session {
    /// Prefixes the nonces, so a nonce of an earlier stream is never taken for one of this.
    stream: u64,
    next_nonce: u64,
    pub clusters: Subscription,
    pub endpoints: Subscription,
    unanswered: BTreeMap<u64, Sent>,
}

impl Session {
    pub fn new(stream: u64) -> Session {
        Session {
            stream,
            next_nonce: 1,
            clusters: Subscription::default(),
            endpoints: Subscription::default(),
            unanswered: BTreeMap::new(),
        }
    }

    pub fn subscription(&self, kind: Kind) -> &Subscription {
        match kind {
            Kind::Cluster => &self.clusters,
            Kind::Endpoint => &self.endpoints,
        }
    }

    fn sub_mut(&mut self, kind: Kind) -> &mut Subscription {
        match kind {
            Kind::Cluster => &mut self.clusters,
            Kind::Endpoint => &mut self.endpoints,
        }
    }

    /// A request from the client, against the catalog served now.
    pub fn request(&mut self, req: &DeltaDiscoveryRequest, snap: &Snapshot) -> Handled {
        let mut handled = Handled {
            answer: self.answer(req),
            ..Default::default()
        };
        let Some(kind) = Kind::of(&req.type_url) else {
            handled.unknown_type = Some(req.type_url.clone());
            return handled;
        };
        let sub = self.sub_mut(kind);
        let first = !sub.started;
        sub.started = true;
        let mut check: BTreeSet<String> = BTreeSet::new();
        if first {
            // An empty first request is the legacy spelling of a wildcard.
            if req.resource_names_subscribe.is_empty() && req.response_nonce.is_empty() {
                sub.wildcard = true;
            }
            for (name, version) in &req.initial_resource_versions {
                sub.known.insert(name.clone(), Some(version.clone()));
                check.insert(name.clone());
            }
        }
        let mut became_wildcard = first && sub.wildcard;
        for name in &req.resource_names_subscribe {
            if name == "*" {
                became_wildcard |= !sub.wildcard;
                sub.wildcard = true;
                continue;
            }
            sub.names.insert(name.clone());
            // A subscribe asks for the resource even if it was sent before, unless the client
            // says here which version it has.
            if !req.initial_resource_versions.contains_key(name) {
                sub.known.remove(name);
            }
            check.insert(name.clone());
        }
        for name in &req.resource_names_unsubscribe {
            if name == "*" {
                sub.wildcard = false;
                let names = &sub.names;
                sub.known.retain(|n, _| names.contains(n));
                continue;
            }
            sub.names.remove(name);
            if !sub.wildcard {
                sub.known.remove(name);
            }
            check.remove(name);
        }
        if became_wildcard {
            check.extend(snap.of(kind).keys().cloned());
        }
        let mut forced = BTreeSet::new();
        if let Some(r) = self.respond(kind, check, &BTreeSet::new(), snap) {
            forced = self.eds_of(&r, snap);
            handled.responses.push(r);
        }
        if !forced.is_empty() {
            let wanted = forced.clone();
            handled
                .responses
                .extend(self.respond(Kind::Endpoint, wanted, &forced, snap));
        }
        handled
    }

    /// A new catalog: what changed in what the client subscribed to, Clusters first (a client
    /// that meets a new assignment name learns it from its Cluster).
    pub fn update(&mut self, snap: &Snapshot) -> Vec<DeltaDiscoveryResponse> {
        let mut out = Vec::new();
        let mut forced = BTreeSet::new();
        for kind in Kind::ALL {
            let sub = self.subscription(kind);
            let mut check: BTreeSet<String> = sub.names.clone();
            check.extend(sub.known.keys().cloned());
            if sub.wildcard {
                check.extend(snap.of(kind).keys().cloned());
            }
            let force = match kind {
                Kind::Cluster => BTreeSet::new(),
                Kind::Endpoint => {
                    check.extend(forced.iter().cloned());
                    std::mem::take(&mut forced)
                }
            };
            if let Some(r) = self.respond(kind, check, &force, snap) {
                if kind == Kind::Cluster {
                    forced = self.eds_of(&r, snap);
                }
                out.push(r);
            }
        }
        out
    }

    /// The assignments of the Clusters in `r` that the client already subscribed to. Envoy
    /// does not ask again for an assignment it watches when a Cluster using it is replaced,
    /// and the new Cluster waits for one: they are sent again with it, unchanged or not.
    fn eds_of(&self, r: &DeltaDiscoveryResponse, snap: &Snapshot) -> BTreeSet<String> {
        let eds = &self.endpoints;
        r.resources
            .iter()
            .filter_map(|c| snap.clusters.get(&c.name)?.eds_name.clone())
            .filter(|n| eds.wants(n) && matches!(eds.known.get(n), Some(Some(_))))
            .collect()
    }

    /// The response that brings the client up to date on `names` of `kind` (`force`: sent
    /// even when the client holds the same version), or `None` when it is.
    fn respond(
        &mut self,
        kind: Kind,
        names: BTreeSet<String>,
        force: &BTreeSet<String>,
        snap: &Snapshot,
    ) -> Option<DeltaDiscoveryResponse> {
        let served = snap.of(kind);
        let sub = self.sub_mut(kind);
        let mut resources = Vec::new();
        let mut removed = Vec::new();
        for name in names {
            let explicit = sub.names.contains(&name);
            if !explicit && !sub.wildcard {
                continue;
            }
            let held = sub.known.get(&name);
            match served.get(&name) {
                Some(r) => {
                    let current = held.is_some_and(|v| v.as_deref() == Some(r.version.as_str()));
                    if current && !force.contains(&name) {
                        continue;
                    }
                    sub.known.insert(name.clone(), Some(r.version.clone()));
                    resources.push(PbResource {
                        name,
                        version: r.version.clone(),
                        resource: Some(r.body.clone()),
                        ..Default::default()
                    });
                }
                None => {
                    let had = matches!(held, Some(Some(_)));
                    // A name asked for by name is told it does not exist, once; a wildcard
                    // client hears only of what it had.
                    if had || (explicit && held.is_none()) {
                        removed.push(name.clone());
                    }
                    if explicit {
                        sub.known.insert(name, None);
                    } else {
                        sub.known.remove(&name);
                    }
                }
            }
        }
        if resources.is_empty() && removed.is_empty() {
            return None;
        }
        let n = self.next_nonce;
        self.next_nonce += 1;
        self.unanswered.insert(
            n,
            Sent {
                kind,
                names: resources.iter().map(|r| r.name.clone()).collect(),
                removed: removed.clone(),
            },
        );
        while self.unanswered.len() > REMEMBERED {
            self.unanswered.pop_first();
        }
        Some(DeltaDiscoveryResponse {
            system_version_info: snap.generation.to_string(),
            type_url: kind.type_url().to_string(),
            resources,
            removed_resources: removed,
            nonce: format!("{}-{n}", self.stream),
            ..Default::default()
        })
    }

    /// The ACK or NACK a request carries.
    fn answer(&mut self, req: &DeltaDiscoveryRequest) -> Option<Answer> {
        if req.response_nonce.is_empty() {
            return None;
        }
        let nonce = req.response_nonce.clone();
        let sent = nonce
            .strip_prefix(&format!("{}-", self.stream))
            .and_then(|n| n.parse::<u64>().ok())
            .and_then(|n| self.unanswered.remove(&n));
        Some(match &req.error_detail {
            Some(e) => Answer::Nack {
                nonce,
                sent,
                message: e.message.clone(),
            },
            None => Answer::Ack { nonce, sent },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::Path;

    use envoy_types::pb::google::rpc::Status as RpcStatus;

    use crate::catalog::Catalog;

    const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const CLA: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    const PAY: &str = "payments.aether.internal";
    const PAY_EDS: &str = "outbound|8080||payments.aether.internal";

    fn snap(endpoints: &[&str], generation: u64, previous: Option<&Snapshot>) -> Snapshot {
        let mut yaml = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    endpoints:\n".to_string();
        for e in endpoints {
            yaml.push_str(&format!("      - {e}\n"));
        }
        yaml.push_str("  orders:\n    default_port: 80\n    identity: spiffe://aether.local/ns/default/sa/orders\n");
        let c = Catalog::parse(Path::new("c.yaml"), &yaml, "aether.local").unwrap();
        Snapshot::build(&c, "aether.internal", generation, previous)
    }

    fn req(type_url: &str, sub: &[&str], unsub: &[&str]) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: type_url.into(),
            resource_names_subscribe: sub.iter().map(|s| s.to_string()).collect(),
            resource_names_unsubscribe: unsub.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn ack(r: &DeltaDiscoveryResponse, error: Option<&str>) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            error_detail: error.map(|m| RpcStatus {
                code: 3,
                message: m.into(),
                details: vec![],
            }),
            ..Default::default()
        }
    }

    fn names(r: &DeltaDiscoveryResponse) -> Vec<&str> {
        r.resources.iter().map(|r| r.name.as_str()).collect()
    }

    #[test]
    fn a_subscribe_is_answered_with_what_exists_and_absences() {
        let s = snap(&["{ address: 10.0.0.1, ports: [8080, 9090] }"], 1, None);
        let mut session = Session::new(7);
        let h = session.request(&req(CLUSTER, &[PAY, "nope.aether.internal"], &[]), &s);
        assert_eq!(h.responses.len(), 1);
        let r = &h.responses[0];
        assert_eq!(r.type_url, CLUSTER);
        assert_eq!(names(r), [PAY]);
        assert_eq!(r.removed_resources, ["nope.aether.internal"]);
        assert_eq!(r.resources[0].version, s.clusters[PAY].version);
        assert!(r.nonce.starts_with("7-"));
        // The ACK is matched with what the response carried.
        let h = session.request(&ack(r, None), &s);
        assert!(h.responses.is_empty());
        match h.answer {
            Some(Answer::Ack {
                sent: Some(sent), ..
            }) => {
                assert_eq!(sent.names, [PAY]);
                assert_eq!(sent.removed, ["nope.aether.internal"]);
            }
            other => panic!("{other:?}"),
        }
        // Nothing changed: an update sends nothing, not even the absence again.
        assert!(session.update(&s).is_empty());
        // The assignment, asked for by its EDS name.
        let h = session.request(&req(CLA, &[PAY_EDS], &[]), &s);
        assert_eq!(names(&h.responses[0]), [PAY_EDS]);
        // The nonces differ.
        assert_ne!(h.responses[0].nonce, r.nonce);
    }

    #[test]
    fn changes_are_pushed_to_subscribers_only_and_vanished_names_removed() {
        let s1 = snap(&["{ address: 10.0.0.1, ports: [8080, 9090] }"], 1, None);
        let mut session = Session::new(1);
        session.request(
            &req(CLUSTER, &[PAY, "payments.aether.internal:9090"], &[]),
            &s1,
        );
        session.request(
            &req(
                CLA,
                &[PAY_EDS, "outbound|9090||payments.aether.internal"],
                &[],
            ),
            &s1,
        );
        // An endpoint added on 8080; 9090 gone (its cluster and assignment vanish).
        let s2 = snap(
            &["{ address: 10.0.0.1 }", "{ address: 10.0.0.2 }"],
            2,
            Some(&s1),
        );
        let out = session.update(&s2);
        assert_eq!(out.len(), 2, "{out:?}");
        // Clusters first: the default one changed (its `ports`), :9090 is removed.
        assert_eq!(out[0].type_url, CLUSTER);
        assert_eq!(names(&out[0]), [PAY]);
        assert_eq!(out[0].removed_resources, ["payments.aether.internal:9090"]);
        assert_eq!(out[0].system_version_info, "2");
        assert_eq!(out[1].type_url, CLA);
        assert_eq!(names(&out[1]), [PAY_EDS]);
        assert_eq!(
            out[1].removed_resources,
            ["outbound|9090||payments.aether.internal"]
        );
        // `orders` changed nowhere and was never asked for: never sent.
        assert!(out
            .iter()
            .all(|r| r.resources.iter().all(|r| !r.name.starts_with("orders"))));
        // The port comes back: the subscription still stands, so it is sent.
        let s3 = snap(
            &["{ address: 10.0.0.1, ports: [8080, 9090] }"],
            3,
            Some(&s2),
        );
        let out = session.update(&s3);
        let sent: Vec<&str> = out.iter().flat_map(names).collect();
        assert!(sent.contains(&"payments.aether.internal:9090"), "{sent:?}");
        assert!(sent.contains(&"outbound|9090||payments.aether.internal"));
    }

    #[test]
    fn an_unsubscribed_name_is_no_longer_pushed() {
        let s1 = snap(&["{ address: 10.0.0.1 }"], 1, None);
        let mut session = Session::new(1);
        session.request(&req(CLA, &[PAY_EDS], &[]), &s1);
        session.request(&req(CLA, &[], &[PAY_EDS]), &s1);
        let s2 = snap(&["{ address: 10.0.0.2 }"], 2, Some(&s1));
        assert!(session.update(&s2).is_empty());
        assert!(session.endpoints.names.is_empty() && session.endpoints.known.is_empty());
    }

    #[test]
    fn a_resubscribe_with_initial_versions_gets_only_what_differs() {
        let s1 = snap(&["{ address: 10.0.0.1 }"], 1, None);
        let s2 = snap(&["{ address: 10.0.0.2 }"], 2, Some(&s1));
        // A new stream (the server restarted) from a client that holds s1's resources.
        let mut session = Session::new(2);
        let mut r = req(CLUSTER, &[PAY], &[]);
        r.initial_resource_versions =
            HashMap::from([(PAY.to_string(), s1.clusters[PAY].version.clone())]);
        assert!(
            session.request(&r, &s2).responses.is_empty(),
            "the cluster is unchanged"
        );
        let mut r = req(CLA, &[PAY_EDS], &[]);
        r.initial_resource_versions =
            HashMap::from([(PAY_EDS.to_string(), s1.assignments[PAY_EDS].version.clone())]);
        let h = session.request(&r, &s2);
        assert_eq!(names(&h.responses[0]), [PAY_EDS]);
        assert_eq!(
            h.responses[0].resources[0].version,
            s2.assignments[PAY_EDS].version
        );
    }

    #[test]
    fn a_subscribe_again_is_answered_again() {
        let s = snap(&["{ address: 10.0.0.1 }"], 1, None);
        let mut session = Session::new(1);
        session.request(&req(CLUSTER, &[PAY], &[]), &s);
        let h = session.request(&req(CLUSTER, &[PAY], &[]), &s);
        assert_eq!(names(&h.responses[0]), [PAY]);
    }

    #[test]
    fn wildcards_get_everything_and_hear_of_removals() {
        let s1 = snap(&["{ address: 10.0.0.1, ports: [8080, 9090] }"], 1, None);
        let mut session = Session::new(1);
        // Legacy: an empty first request.
        let h = session.request(&req(CLUSTER, &[], &[]), &s1);
        assert!(session.clusters.wildcard);
        assert_eq!(
            names(&h.responses[0]),
            [
                "orders.aether.internal",
                PAY,
                "payments.aether.internal:9090"
            ]
        );
        assert!(h.responses[0].removed_resources.is_empty());
        // An ACK with no names is not a new wildcard decision, nor a response.
        let h = session.request(&ack(&h.responses[0], None), &s1);
        assert!(h.responses.is_empty());
        let s2 = snap(&["{ address: 10.0.0.1 }"], 2, Some(&s1));
        let out = session.update(&s2);
        assert_eq!(out[0].removed_resources, ["payments.aether.internal:9090"]);
        // `*` explicitly, for assignments; then dropped.
        let h = session.request(&req(CLA, &["*"], &[]), &s2);
        assert_eq!(names(&h.responses[0]).len(), 2);
        session.request(&req(CLA, &[], &["*"]), &s2);
        assert!(!session.endpoints.wildcard && session.endpoints.known.is_empty());
        let s3 = snap(&["{ address: 10.0.0.3 }"], 3, Some(&s2));
        let out = session.update(&s3);
        assert!(out.iter().all(|r| r.type_url == CLUSTER), "{out:?}");
    }

    #[test]
    fn a_changed_cluster_brings_its_assignment_along() {
        let s1 = snap(&["{ address: 10.0.0.1 }"], 1, None);
        let mut session = Session::new(1);
        session.request(&req(CLUSTER, &[PAY], &[]), &s1);
        session.request(&req(CLA, &[PAY_EDS], &[]), &s1);
        // Only the cluster changes (a new port on an endpoint): the unchanged assignment of
        // the default port is sent again behind it.
        let s2 = snap(
            &["{ address: 10.0.0.1, ports: [8080, 9090] }"],
            2,
            Some(&s1),
        );
        assert_eq!(s1.assignments[PAY_EDS], s2.assignments[PAY_EDS]);
        let out = session.update(&s2);
        assert_eq!(out.len(), 2);
        assert_eq!(names(&out[0]), [PAY]);
        assert_eq!(names(&out[1]), [PAY_EDS]);
    }

    #[test]
    fn a_nack_names_what_was_refused_and_is_not_resent() {
        let s = snap(&["{ address: 10.0.0.1 }"], 1, None);
        let mut session = Session::new(3);
        let h = session.request(&req(CLUSTER, &[PAY], &[]), &s);
        let h = session.request(&ack(&h.responses[0], Some("bad cluster")), &s);
        match h.answer {
            Some(Answer::Nack {
                sent: Some(sent),
                message,
                ..
            }) => {
                assert_eq!(sent.names, [PAY]);
                assert_eq!(message, "bad cluster");
            }
            other => panic!("{other:?}"),
        }
        assert!(h.responses.is_empty());
        assert!(session.update(&s).is_empty());
        // A nonce of another stream is an answer to nothing known.
        let mut stale = req(CLUSTER, &[], &[]);
        stale.response_nonce = "9-1".into();
        assert!(matches!(
            session.request(&stale, &s).answer,
            Some(Answer::Ack { sent: None, .. })
        ));
    }

    #[test]
    fn other_types_are_reported_and_ignored() {
        let s = snap(&[], 1, None);
        let mut session = Session::new(1);
        let h = session.request(
            &req(
                "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
                &["default"],
                &[],
            ),
            &s,
        );
        assert!(h.responses.is_empty());
        assert!(h.unknown_type.is_some());
    }
}
