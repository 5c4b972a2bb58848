//! Outbound routing of a client pod fed by xDS (SPEC section 9, with section 1's authority
//! table): on-demand Clusters, shared subscriptions, remembered absences, discovery timeouts,
//! idle unsubscribes, the node the client announces, and the aether fields a Cluster carries.
//!
//! The client pod (pod 0) takes its mesh from the test control plane (`crate::common::xds`, on pod
//! 15's host, port 18000); server pods keep their file configs (`crate::common::mesh`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::xds::*;
use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

const AUTO_8080_9090: [&str; 2] = [
    "{ port: 8080, protocol: auto }",
    "{ port: 9090, protocol: auto }",
];

fn names(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// SPEC 1's table through an xDS-fed client: `payments` carries `aether.io.ports`, `orders`
/// does not. Which Cluster names the client subscribed to is part of the contract: the default
/// Cluster first, `svc:P` only for a port that may exist, never `svc:<default>`, nothing for a
/// foreign authority or for ports of an unknown service.
async fn authority_table_over_xds(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1, p2, p3) = (net.pod(0), net.pod(1), net.pod(2), net.pod(3));
    let certs = certs();
    let a1_8080 = HttpApp::auto(p1.app(8080)).await;
    let a1_9090 = HttpApp::auto(p1.app(9090)).await;
    let a2_8080 = HttpApp::auto(p2.app(8080)).await;
    let a2_9090 = HttpApp::auto(p2.app(9090)).await;
    let a3_8080 = HttpApp::auto(p3.app(8080)).await;
    let a3_9090 = HttpApp::auto(p3.app(9090)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &AUTO_8080_9090).await;
    let _s2 = server_proxy(&certs, p2, "payments", &AUTO_8080_9090).await;
    let _s3 = server_proxy(&certs, p3, "orders", &AUTO_8080_9090).await;
    let fx = Fixture::new()
        .service(
            "payments",
            Service::new(&certs.spiffe_id(PAYMENTS))
                .endpoint(Endpoint::new(p1.proxy_ip(), &[8080, 9090]))
                .endpoint(Endpoint::new(p2.proxy_ip(), &[8080])),
        )
        .service(
            "orders",
            Service::new(&certs.spiffe_id(ORDERS))
                .without_ports_metadata()
                .endpoint(Endpoint::new(p3.proxy_ip(), &[8080, 9090])),
        );
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();

    // The default port, both spellings: one Cluster, subscribed once, never `svc:8080`.
    let r = get_h1(out, SVC, "/portless").await;
    assert_app_ok(&r, 8080, "portless authority");
    let r = get_h1(out, &format!("{SVC}:8080"), "/explicit").await;
    assert_app_ok(&r, 8080, "explicit default port");
    assert_eq!(a1_8080.seen().len() + a2_8080.seen().len(), 2);
    let cs = clusters(&client).await;
    assert_eq!(cs.len(), 1, "one cluster for both spellings: {cs:?}");
    assert_eq!(cs[0].0, SVC);
    assert_eq!((cs[0].1.as_str(), cs[0].2), ("payments", 8080));
    let mut eps = cs[0].3.clone();
    eps.sort();
    let mut want = vec![p1.inbound().to_string(), p2.inbound().to_string()];
    want.sort();
    assert_eq!(eps, want, "the 8080 set is pods 1 and 2");
    assert_eq!(cp.subscribes(SVC), 1, "{}", cp.summary());
    assert_eq!(cp.subscribes(&format!("{SVC}:8080")), 0, "{}", cp.summary());
    assert!(
        cp.subscribed_of(CLA_TYPE)
            .contains("outbound|8080||payments.aether.internal"),
        "the assignment is asked for by the Cluster's EDS service_name: {}",
        cp.summary()
    );

    // 9090: its own Cluster, only the pod that advertises it.
    for i in 0..10 {
        let r = get_h1(out, &format!("{SVC}:9090"), &format!("/p9090/{i}")).await;
        assert_app_ok(&r, 9090, "port 9090");
    }
    assert_eq!(a1_9090.seen().len(), 10);
    assert_eq!(a2_9090.seen().len(), 0, "pod 2 does not advertise 9090");
    assert_eq!(cp.subscribes(&format!("{SVC}:9090")), 1);
    let cs = clusters(&client).await;
    let c9090: Vec<_> = cs.iter().filter(|c| c.0 == format!("{SVC}:9090")).collect();
    assert_eq!(c9090.len(), 1, "{cs:?}");
    assert_eq!(c9090[0].3, vec![p1.inbound().to_string()]);

    // 7777 with `aether.io.ports`: answered from the default Cluster, no subscription.
    let r = get_h1(out, &format!("{SVC}:7777"), "/7777").await;
    assert_proxy_error(
        &r,
        503,
        "port-not-exposed",
        "payments:7777 (ports metadata)",
    );
    assert_eq!(
        cp.subscribes(&format!("{SVC}:7777")),
        0,
        "with aether.io.ports the client must not subscribe to svc:7777: {}",
        cp.summary()
    );

    // `orders` has no ports metadata: 9090 exists because its Cluster does; 7777 is learnt
    // absent from the control plane.
    let r = get_h1(out, "orders.aether.internal", "/o").await;
    assert_app_ok(&r, 8080, "orders default port");
    let r = get_h1(out, "orders.aether.internal:9090", "/o9090").await;
    assert_app_ok(&r, 9090, "orders:9090");
    assert_eq!((a3_8080.seen().len(), a3_9090.seen().len()), (1, 1));
    let r = get_h1(out, "orders.aether.internal:7777", "/o7777").await;
    assert_proxy_error(
        &r,
        503,
        "port-not-exposed",
        "orders:7777 (no ports metadata)",
    );
    assert_eq!(cp.subscribes("orders.aether.internal:7777"), 1);
    assert!(
        !cp.sent_removed("orders.aether.internal:7777").is_empty(),
        "the answer came from the control plane's removed_resources"
    );

    // Unknown service, with and without a port.
    let r = get_h1(out, "ghost.aether.internal", "/g").await;
    assert_proxy_error(&r, 503, "unknown-service", "ghost");
    let r = get_h1(out, "ghost.aether.internal:9090", "/g9090").await;
    assert_proxy_error(&r, 503, "unknown-service", "ghost:9090");
    assert!(!cp.sent_removed("ghost.aether.internal").is_empty());

    // Foreign authorities: 404 at once, nothing asked of the control plane.
    for a in ["evil.com", "evil.com:9090"] {
        let t = Instant::now();
        let r = get_h1(out, a, "/evil").await;
        assert_proxy_error(&r, 404, "no-route", a);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "{a}: no-route took {:?}",
            t.elapsed()
        );
    }

    assert_eq!(
        cp.subscribed_of(CLUSTER_TYPE),
        names(&[
            SVC,
            "payments.aether.internal:9090",
            "orders.aether.internal",
            "orders.aether.internal:9090",
            "orders.aether.internal:7777",
            "ghost.aether.internal",
        ]),
        "the Cluster names subscribed to; {}",
        cp.summary()
    );
    let all: Vec<String> = cp
        .ads_requests()
        .into_iter()
        .flat_map(|r| r.subscribe)
        .collect();
    assert!(
        !all.iter().any(|n| n.contains("evil")),
        "a foreign authority reached the control plane: {all:?}"
    );
    assert_eq!(
        a2_9090.seen().len() + a3_8080.seen().len() + a3_9090.seen().len(),
        2,
        "no stray requests"
    );
}

/// 50 concurrent first requests, half for the default port and half for 9090, against a cold
/// client: one subscription per name.
async fn concurrent_first_requests_share_one_subscription(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, p1).await;
    let fx = Fixture::new().service("payments", s1.service(&certs, PAYMENTS));
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let _client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();

    // Connect all first, then send: the requests reach the proxy together.
    let mut conns = Vec::new();
    for _ in 0..50 {
        conns.push(h1_to(out).await);
    }
    let mut set = JoinSet::new();
    for (i, mut c) in conns.into_iter().enumerate() {
        let authority = if i % 2 == 0 {
            SVC.to_string()
        } else {
            format!("{SVC}:9090")
        };
        set.spawn(async move {
            let r = c
                .send(empty(get(&format!("/c/{i}")).header("host", &authority)))
                .await;
            (authority, r)
        });
    }
    while let Some(j) = set.join_next().await {
        let (authority, r) = j.unwrap();
        let r = r.unwrap_or_else(|e| panic!("{authority}: {e}"));
        let port = if authority.ends_with(":9090") {
            9090
        } else {
            8080
        };
        assert_app_ok(&r, port, &authority);
    }
    assert_eq!((s1.app8080.seen().len(), s1.app9090.seen().len()), (25, 25));
    for name in [
        SVC,
        "payments.aether.internal:9090",
        "outbound|8080||payments.aether.internal",
        "outbound|9090||payments.aether.internal",
    ] {
        assert_eq!(
            cp.subscribes(name),
            1,
            "{name} subscribed more than once; {}",
            cp.summary()
        );
    }
    assert_eq!(cp.ads_streams().len(), 1, "one ADS stream");
}

/// An absence is remembered: the second request for an unknown service is answered at once
/// with no new subscription; when the control plane later adds the service, the next request
/// works, without a restart and without a new subscription; removing it again is seen too.
async fn absence_is_remembered_and_a_later_push_fills_it(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &AUTO_8080_9090).await;
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), Fixture::new()).await;
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    let pid = client.pid();
    let ghost = "ghost.aether.internal";

    let r = get_h1(out, ghost, "/1").await;
    assert_proxy_error(&r, 503, "unknown-service", "first request");
    assert_eq!(cp.subscribes(ghost), 1);
    for i in 0..3 {
        let t = Instant::now();
        let r = get_h1(out, ghost, &format!("/again/{i}")).await;
        assert_proxy_error(&r, 503, "unknown-service", "remembered absence");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "a remembered absence is answered at once, took {:?}",
            t.elapsed()
        );
    }
    let r = get_h1(out, &format!("{ghost}:9090"), "/port").await;
    assert_proxy_error(&r, 503, "unknown-service", "a port of the absent service");
    assert_eq!(
        cp.subscribes(ghost),
        1,
        "no new subscription; {}",
        cp.summary()
    );

    // The control plane learns of the service: the standing subscription gets it.
    cp.update(|f| {
        f.services.insert(
            "ghost".into(),
            Service::new(&certs.spiffe_id(PAYMENTS))
                .endpoint(Endpoint::new(p1.proxy_ip(), &[8080])),
        );
    });
    let pushed = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || {
            let r = get_h1(out, ghost, "/now").await;
            if r.status.as_u16() == 200 {
                assert_app_ok(&r, 8080, "after the push");
                return Ok(());
            }
            assert_proxy_error(&r, 503, "unknown-service", "before the push lands");
            Err(())
        },
    )
    .await;
    assert!(
        pushed.is_ok(),
        "the pushed service is still unknown after 5 s; {}",
        cp.summary()
    );
    assert_eq!(app.seen().len(), 1);
    assert_eq!(client.pid(), pid, "same process");
    assert_eq!(
        cp.subscribes(ghost),
        1,
        "the push used the standing subscription; {}",
        cp.summary()
    );

    // And away again.
    cp.update(|f| {
        f.services.remove("ghost");
    });
    let r = eventually_every(
        Duration::from_secs(5),
        Duration::from_millis(50),
        "the removed service gone",
        async || {
            let r = get_h1(out, ghost, "/gone").await;
            if r.status.as_u16() == 503 {
                Ok(r)
            } else {
                Err(format!("it still answers: {r:?}"))
            }
        },
    )
    .await;
    assert_proxy_error(&r, 503, "unknown-service", "after the removal");
}

/// A name the control plane never answers: 503 `discovery-timeout` after `cluster_timeout`
/// (2 s here), for the default Cluster, a port's Cluster and an assignment alike; once the
/// control plane answers, the next request works.
async fn discovery_timeout_when_the_control_plane_holds_a_name(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, p1).await;
    let svc = |id: &str| s1.service(&certs, id);
    let fx = Fixture::new()
        .service("slow", svc(PAYMENTS))
        .service("payments", svc(PAYMENTS))
        .service("orders", svc(PAYMENTS));
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    cp.hold("slow.aether.internal");
    cp.hold("payments.aether.internal:9090");
    cp.hold("outbound|8080||orders.aether.internal");
    let _client = xds_client(
        &certs,
        client_pod,
        &cp.address(),
        &["cluster_timeout: 2s"],
        "",
    )
    .await;
    let out = client_pod.outbound();

    // The default port's Cluster is not held, so 9090's wait starts from a known service.
    let r = get_h1(out, SVC, "/warm").await;
    assert_app_ok(&r, 8080, "payments default port");

    let mut set = JoinSet::new();
    for authority in [
        "slow.aether.internal",
        "payments.aether.internal:9090",
        "orders.aether.internal",
    ] {
        set.spawn(async move {
            let t = Instant::now();
            let r = get_h1(out, authority, "/held").await;
            (authority, r, t.elapsed())
        });
    }
    while let Some(j) = set.join_next().await {
        let (authority, r, took) = j.unwrap();
        assert_proxy_error(&r, 503, "discovery-timeout", authority);
        assert!(
            took >= Duration::from_millis(1800) && took <= Duration::from_millis(3500),
            "{authority}: discovery-timeout after {took:?}, cluster_timeout is 2 s"
        );
    }

    // Answered at last: the next request works (the subscriptions were kept).
    for n in [
        "slow.aether.internal",
        "payments.aether.internal:9090",
        "outbound|8080||orders.aether.internal",
    ] {
        cp.release(n);
    }
    for (authority, port) in [
        ("slow.aether.internal", 8080),
        ("payments.aether.internal:9090", 9090),
        ("orders.aether.internal", 8080),
    ] {
        let what = format!("{authority} answered after the release");
        let r = eventually_every(
            Duration::from_secs(5),
            Duration::from_millis(50),
            &what,
            async || {
                let r = get_h1(out, authority, "/released").await;
                if r.status.as_u16() == 200 {
                    Ok(r)
                } else {
                    Err(format!("{r:?} {}", r.text()))
                }
            },
        )
        .await;
        assert_app_ok(&r, port, authority);
    }
}

/// `idle: 2s`: a Cluster unused that long is unsubscribed and leaves `/clusters`, while one in
/// use stays; a later request subscribes again and works.
async fn idle_clusters_are_unsubscribed(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, p1).await;
    let fx = Fixture::new().service("payments", s1.service(&certs, PAYMENTS));
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let client = xds_client(&certs, client_pod, &cp.address(), &["idle: 2s"], "").await;
    let out = client_pod.outbound();
    let p9090 = "payments.aether.internal:9090";

    let r = get_h1(out, p9090, "/first").await;
    assert_app_ok(&r, 9090, "first use");
    assert_eq!(cp.subscribes(p9090), 1);
    let used = Instant::now();

    // Keep the default Cluster busy (every 200 ms, well within idle: 2s); leave 9090 alone
    // until the control plane sees it unsubscribed and /clusters has dropped it.
    let mut unsubscribed_after = None;
    let left = poll_until(
        Duration::from_secs(8).saturating_sub(used.elapsed()),
        Duration::from_millis(200),
        async || {
            let r = get_h1(out, SVC, "/busy").await;
            assert_app_ok(&r, 8080, "the default port, in use");
            if unsubscribed_after.is_none() && cp.unsubscribes(p9090) >= 1 {
                unsubscribed_after = Some(used.elapsed());
            }
            let cs = clusters(&client).await;
            match unsubscribed_after {
                Some(after) if !cs.iter().any(|c| c.0 == p9090) => Ok((after, cs)),
                _ => Err(cs),
            }
        },
    )
    .await;
    let (idle_for, cs) = left.unwrap_or_else(|cs| {
        panic!(
            "9090 unused for {:?} with idle: 2s: unsubscribed after {unsubscribed_after:?}, \
             /clusters {cs:?}; {}",
            used.elapsed(),
            cp.summary()
        )
    });
    assert!(
        cs.iter().any(|c| c.0 == SVC),
        "the Cluster in use stays in /clusters: {cs:?}"
    );
    assert!(
        idle_for >= Duration::from_millis(1900),
        "unsubscribed after only {idle_for:?} (idle: 2s)"
    );
    assert_eq!(
        cp.unsubscribes(SVC),
        0,
        "the default Cluster is in use; {}",
        cp.summary()
    );

    // Used again: subscribed again, works.
    let r = get_h1(out, p9090, "/again").await;
    assert_app_ok(&r, 9090, "after the idle unsubscribe");
    assert_eq!(cp.subscribes(p9090), 2, "{}", cp.summary());
    assert_eq!(s1.app9090.seen().len(), 2);
}

/// The first request on the stream names the node (id, cluster from the config, locality,
/// `user_agent_name: aether-proxy`); without them, `node.cluster` is the identity's service
/// account. Every response is ACKed with its nonce.
async fn node_identification_and_acks(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1, other_pod) = (net.pod(0), net.pod(1), net.pod(2));
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, p1).await;
    let fx = Fixture::new().service("payments", s1.service(&certs, PAYMENTS));
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let node_id = format!("sidecar~{}~frontend-7d9f.default", client_pod.proxy_ip());
    let _client = xds_client(
        &certs,
        client_pod,
        &cp.address(),
        &[
            &format!("node_id: \"{node_id}\""),
            "cluster: frontend-cluster",
        ],
        "locality: us-east1/us-east1-b\n",
    )
    .await;
    let out = client_pod.outbound();
    assert_app_ok(&get_h1(out, SVC, "/a").await, 8080, "default");
    assert_app_ok(
        &get_h1(out, &format!("{SVC}:9090"), "/b").await,
        9090,
        "9090",
    );
    let r = get_h1(out, "ghost.aether.internal", "/c").await;
    assert_proxy_error(&r, 503, "unknown-service", "ghost");

    cp.wait_until(IO_TIMEOUT, "every response answered", |cp| {
        let s = cp.ads_streams();
        !s.is_empty() && s[0].responses.len() >= 5 && s[0].unanswered_nonces().is_empty()
    })
    .await;
    let streams = cp.ads_streams();
    assert_eq!(streams.len(), 1, "{}", cp.summary());
    let s = &streams[0];
    let node = s
        .first_node()
        .unwrap_or_else(|| panic!("the first request carries no node; {}", cp.summary()));
    assert_eq!(node.id, node_id);
    assert_eq!(node.cluster, "frontend-cluster");
    assert_eq!(node.user_agent_name, "aether-proxy");
    assert_eq!(
        (node.region.as_str(), node.zone.as_str()),
        ("us-east1", "us-east1-b")
    );
    for resp in &s.responses {
        let answer = s.requests.iter().find(|r| r.response_nonce == resp.nonce);
        match answer {
            Some(r) => assert!(
                r.is_ack() && r.type_url == resp.type_url,
                "response {} ({}) was answered with {r:?}",
                resp.nonce,
                resp.type_url
            ),
            None => panic!("response {} was never ACKed; {}", resp.nonce, cp.summary()),
        }
    }
    assert!(cp.nacks().is_empty(), "{:?}", cp.nacks());

    // Defaults: node.cluster is the service account of the identity; an id is made up.
    let _other = xds_client(&certs, other_pod, &cp.address(), &[], "").await;
    let r = get_h1(other_pod.outbound(), SVC, "/d").await;
    assert_app_ok(&r, 8080, "second client");
    let streams = cp.ads_streams();
    assert_eq!(streams.len(), 2, "{}", cp.summary());
    let node = streams[1].first_node().expect("node");
    assert_eq!(node.cluster, "frontend", "default node.cluster");
    assert!(!node.id.is_empty(), "a default node id");
    assert_eq!(node.user_agent_name, "aether-proxy");
}

/// The aether fields of a Cluster: `protocol: tcp` (CONNECT tunnels, plain HTTP refused),
/// `request_timeout`, and `routes` (a header match onto a labelled subset from `envoy.lb`).
async fn cluster_metadata_tcp_timeout_and_routes(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1, p2) = (net.pod(0), net.pod(1), net.pod(2));
    let certs = certs();
    let ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 5432, protocol: tcp }",
    ];
    let a1 = HttpApp::auto(p1.app(8080)).await;
    let a2 = HttpApp::auto(p2.app(8080)).await;
    let echo = TcpEcho::start(p1.app(5432)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &ports).await;
    let _s2 = server_proxy(&certs, p2, "payments", &ports).await;
    let fx = Fixture::new().service(
        "payments",
        Service::new(&certs.spiffe_id(PAYMENTS))
            .tcp(5432)
            .request_timeout(Duration::from_secs(1))
            .routes(serde_json::json!([
                {"match": {"header": "x-canary", "value": "1"}, "subset": {"version": "v2"}}
            ]))
            .endpoint(Endpoint::new(p1.proxy_ip(), &[8080, 5432]).label("version", "v1"))
            .endpoint(Endpoint::new(p2.proxy_ip(), &[8080]).label("version", "v2")),
    );
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let _client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();

    // routes: the canary header goes to v2 only.
    for i in 0..10 {
        let req = empty(
            get(&format!("/canary/{i}"))
                .header("host", SVC)
                .header("x-canary", "1"),
        );
        let r = h1_to(out).await.send(req).await.unwrap();
        assert_app_ok(&r, 8080, "canary");
    }
    assert_eq!(
        (a1.seen().len(), a2.seen().len()),
        (0, 10),
        "x-canary: 1 -> v2"
    );

    // request_timeout 1 s.
    let t = Instant::now();
    let req = empty(
        get("/slow")
            .header("host", SVC)
            .header("x-app-delay-ms", "3000"),
    );
    let r = h1_to(out).await.send(req).await.unwrap();
    assert_proxy_error(&r, 504, "upstream-timeout", "request_timeout from metadata");
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "504 after {:?}, request_timeout is 1 s",
        t.elapsed()
    );

    // protocol tcp: CONNECT tunnels to 5432; plain HTTP is refused there; CONNECT to 8080 is
    // refused.
    let tcp = tcp_connect(out).await.unwrap();
    let mut tunnel = match http_connect(tcp, &format!("{SVC}:5432")).await {
        Ok(t) => t,
        Err(TunnelError::Refused(r)) => panic!("CONNECT {SVC}:5432 refused: {r:?} {}", r.text()),
        Err(TunnelError::Failed(e)) => panic!("CONNECT {SVC}:5432: {e}"),
    };
    tunnel.write_all(b"over xds").await.unwrap();
    tunnel.shutdown().await.unwrap();
    let mut got = Vec::new();
    within(IO_TIMEOUT, "echo", tunnel.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got[..8], b"over xds");
    assert!(
        got.ends_with(ECHO_EOF_MARKER),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    assert_eq!(echo.connections(), 1);
    let r = get_h1(out, &format!("{SVC}:5432"), "/http-to-tcp").await;
    assert_proxy_error(&r, 400, "not-an-http-port", "HTTP to a tcp port");
    let tcp = tcp_connect(out).await.unwrap();
    match http_connect(tcp, &format!("{SVC}:8080")).await {
        Err(TunnelError::Refused(r)) => {
            assert_proxy_error(&r, 400, "not-a-tcp-port", "CONNECT to an http port")
        }
        Ok(_) => panic!("CONNECT to 8080 was tunnelled"),
        Err(TunnelError::Failed(e)) => panic!("CONNECT to 8080: {e}"),
    }
}

crate::on_both_control_planes!(
    authority_table_over_xds,
    concurrent_first_requests_share_one_subscription,
    absence_is_remembered_and_a_later_push_fills_it,
    discovery_timeout_when_the_control_plane_holds_a_name,
    idle_clusters_are_unsubscribed,
    node_identification_and_acks,
    cluster_metadata_tcp_timeout_and_routes,
);
