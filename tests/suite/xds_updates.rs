//! Changes from the control plane while traffic flows (SPEC section 9): NACKed Clusters keep
//! the last good one, endpoint and identity pushes apply without a restart, a rollout driven by
//! pushes never sends a port to a pod that lacks it, and a control plane that dies and comes
//! back costs no request.
//!
//! The client pod (pod 0) is fed by the test control plane (`crate::common::xds`); server pods keep
//! their file configs (`crate::common::mesh`).

use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::xds::*;
use crate::common::*;
use envoy_types::pb::google::protobuf::Duration as PbDuration;

/// `/clusters` of a proxy: cluster name -> (endpoint address, draining), sorted.
async fn endpoints_of(p: &Proxy, cluster: &str) -> Option<Vec<(String, bool)>> {
    let r = p.admin_get("/clusters").await.unwrap();
    assert_eq!(r.status.as_u16(), 200);
    let v = r.json();
    let c = v["clusters"]
        .as_array()
        .expect("clusters array")
        .iter()
        .find(|c| c["name"] == cluster)?
        .clone();
    let mut eps: Vec<(String, bool)> = c["endpoints"]
        .as_array()
        .expect("endpoints array")
        .iter()
        .map(|e| {
            (
                e["address"].as_str().unwrap_or_default().to_string(),
                e["draining"].as_bool().unwrap_or(false),
            )
        })
        .collect();
    eps.sort();
    Some(eps)
}

/// Polls `/clusters` until `pred` holds for the cluster's endpoints.
async fn wait_endpoints(
    p: &Proxy,
    cluster: &str,
    what: &str,
    pred: impl Fn(&[(String, bool)]) -> bool,
) {
    eventually(Duration::from_secs(5), what, async || {
        match endpoints_of(p, cluster).await {
            Some(e) if pred(&e) => Ok(()),
            eps => Err(format!("/clusters shows {cluster} as {eps:?}")),
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// NACK
// ---------------------------------------------------------------------------------------------

/// Invalid Clusters (SNI not a port, no URI SAN matcher, a zero, negative or too long connect
/// timeout) are NACKed with a message naming the resource and the field; the last good Cluster
/// keeps serving; `/config_dump` shows the NACK and the good version; the nack counter grows.
async fn invalid_clusters_are_nacked_and_the_last_good_one_stays(
    server: crate::common::xds::Server,
) {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, p1).await;
    let fx = Fixture::new().service("payments", s1.service(&certs, PAYMENTS));
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    let name = "payments.aether.internal:9090";

    assert_app_ok(&get_h1(out, name, "/good").await, 9090, "the good Cluster");
    cp.wait_acked(&[name], IO_TIMEOUT).await;
    let good = cp.version(CLUSTER_TYPE, name).unwrap();
    let d = xds_dump(&client).await;
    assert_eq!(d["connected"], true, "{d}");
    assert_eq!(
        d["resources"][name],
        good.as_str(),
        "resources in /config_dump: {d}"
    );
    assert!(d["last_nack"].is_null(), "no NACK yet: {d}");
    let nack = ["type=\"cluster\"", "result=\"nack\""];
    let ack = ["type=\"cluster\"", "result=\"ack\""];
    assert!(metric(&client, "aether_xds_updates_total", &ack).await >= 1.0);

    let base = cp.cluster(name);
    let mut sni_abc = base.clone();
    let mut tls = tls_of(&sni_abc);
    tls.sni = "abc".into();
    set_tls(&mut sni_abc, &tls);

    let mut no_pin = base.clone();
    let mut tls = tls_of(&no_pin);
    if let Some(envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::ValidationContextType::CombinedValidationContext(c)) =
        tls.common_tls_context.as_mut().and_then(|c| c.validation_context_type.as_mut())
    {
        c.default_validation_context
            .as_mut()
            .unwrap()
            .match_typed_subject_alt_names
            .clear();
    } else {
        panic!("the fixture's Cluster has a combined validation context");
    }
    set_tls(&mut no_pin, &tls);

    let mut zero = base.clone();
    zero.connect_timeout = Some(PbDuration {
        seconds: 0,
        nanos: 0,
    });
    let mut negative = base.clone();
    negative.connect_timeout = Some(PbDuration {
        seconds: -1,
        nanos: 0,
    });

    // SPEC section 8: durations are bounded (connect_timeout at most 5 min).
    let mut too_long = base.clone();
    too_long.connect_timeout = Some(PbDuration {
        seconds: 600,
        nanos: 0,
    });

    let cases: Vec<(&str, _, &[&str])> = vec![
        (
            "SNI \"abc\"",
            sni_abc,
            &["transport_socket", "sni", "abc"][..],
        ),
        ("no URI SAN matcher", no_pin, &["subject_alt_name"][..]),
        ("zero connect_timeout", zero, &["connect_timeout"][..]),
        (
            "negative connect_timeout",
            negative,
            &["connect_timeout"][..],
        ),
        (
            "connect_timeout over its bound",
            too_long,
            &["connect_timeout", "over the limit"][..],
        ),
    ];
    for (what, bad, words) in cases {
        let metric_before = metric(&client, "aether_xds_updates_total", &nack).await;
        let nacks_before = cp.nacks().len();
        cp.serve_invalid(name, bad);
        cp.wait_until(IO_TIMEOUT, &format!("a NACK of {what}"), |cp| {
            cp.nacks().len() > nacks_before
        })
        .await;
        let msg = cp.nacks().last().unwrap().error.clone().unwrap();
        assert!(
            msg.starts_with(&format!("{name}: ")),
            "{what}: the NACK message names the resource first: {msg:?}"
        );
        for w in words {
            assert!(
                msg.to_ascii_lowercase().contains(w),
                "{what}: the NACK message names the field ({w}): {msg:?}"
            );
        }

        // The last good Cluster serves: 9090's chain (SNI "9090"), the real pin.
        for i in 0..5 {
            let r = get_h1(out, name, &format!("/after-nack/{i}")).await;
            assert_app_ok(&r, 9090, what);
        }
        let d = xds_dump(&client).await;
        assert_eq!(d["last_nack"]["resource"], name, "{what}: last_nack: {d}");
        let m = d["last_nack"]["message"].as_str().unwrap_or_default();
        assert!(
            m.contains("connect_timeout") || m.contains("sni") || m.contains("subject_alt_name"),
            "{what}: last_nack.message: {m:?}"
        );
        assert_eq!(
            d["resources"][name],
            good.as_str(),
            "{what}: the version in use is the last good one: {d}"
        );
        wait_metric(
            &client,
            "aether_xds_updates_total",
            &nack,
            Duration::from_secs(5),
            |v| v > metric_before,
        )
        .await;

        cp.clear_invalid(name);
        cp.wait_acked(&[name], IO_TIMEOUT).await;
    }
    assert_eq!(s1.app9090.seen().len(), 26);
    assert_eq!(
        s1.app8080.seen().len(),
        0,
        "nothing fell back to the default chain"
    );
}

// ---------------------------------------------------------------------------------------------
// Pushes
// ---------------------------------------------------------------------------------------------

/// Endpoint pushes (a pod joins, one leaves, one drains) apply without a restart; an unchanged
/// resend changes nothing (no new upstream handshake); a pin change applies to new requests,
/// pooled connections included.
async fn pushed_endpoint_and_identity_changes_apply_without_restart(
    server: crate::common::xds::Server,
) {
    let net = Net::fresh();
    let (client_pod, p1, p2, p3) = (net.pod(0), net.pod(1), net.pod(2), net.pod(3));
    let certs = certs();
    let ports = ["{ port: 8080, protocol: auto }"];
    let a1 = HttpApp::auto(p1.app(8080)).await;
    let a2 = HttpApp::auto(p2.app(8080)).await;
    let a3 = HttpApp::auto(p3.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &ports).await;
    let _s2 = server_proxy(&certs, p2, "payments", &ports).await;
    let s3 = server_proxy(&certs, p3, "payments", &ports).await;
    let fx = Fixture::new().service(
        "payments",
        Service::new(&certs.spiffe_id(PAYMENTS)).endpoint(Endpoint::new(p1.proxy_ip(), &[8080])),
    );
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    let pid = client.pid();
    let ep = |p: PodNet| p.inbound().to_string();
    let count = || (a1.seen().len(), a2.seen().len(), a3.seen().len());

    for i in 0..5 {
        assert_app_ok(&get_h1(out, SVC, &format!("/p1/{i}")).await, 8080, "pod 1");
    }
    assert_eq!(count(), (5, 0, 0));

    // Pod 2 joins.
    cp.update(|f| {
        f.svc("payments")
            .endpoints
            .push(Endpoint::new(p2.proxy_ip(), &[8080]))
    });
    wait_endpoints(&client, SVC, "pod 2 joins", |e| e.len() == 2).await;
    for i in 0..30 {
        assert_app_ok(
            &get_h1(out, SVC, &format!("/both/{i}")).await,
            8080,
            "pods 1, 2",
        );
    }
    let (n1, n2, _) = count();
    assert!(
        n1 > 5 && n2 > 0,
        "both pods serve after the push: {:?}",
        count()
    );

    // Pod 1 leaves.
    cp.update(|f| f.svc("payments").remove_endpoint(p1.proxy_ip()));
    wait_endpoints(&client, SVC, "pod 1 leaves", |e| e == [(ep(p2), false)]).await;
    let before = count();
    for i in 0..10 {
        assert_app_ok(&get_h1(out, SVC, &format!("/p2/{i}")).await, 8080, "pod 2");
    }
    assert_eq!(
        count(),
        (before.0, before.1 + 10, 0),
        "only pod 2 after pod 1 left"
    );

    // Pod 2 drains, pod 3 joins.
    cp.update(|f| {
        let s = f.svc("payments");
        s.endpoint_mut(p2.proxy_ip()).draining = true;
        s.endpoints.push(Endpoint::new(p3.proxy_ip(), &[8080]));
    });
    wait_endpoints(&client, SVC, "pod 2 drains, pod 3 joins", |e| {
        e.contains(&(ep(p3), false)) && !e.contains(&(ep(p2), false))
    })
    .await;
    let before = count();
    for i in 0..10 {
        assert_app_ok(&get_h1(out, SVC, &format!("/p3/{i}")).await, 8080, "pod 3");
    }
    assert_eq!(
        count(),
        (before.0, before.1, 10),
        "a draining pod gets no new requests"
    );

    // An unchanged resend: no change, no new connection.
    let inbound_ok = ["listener=\"inbound\"", "result=\"ok\""];
    let handshakes = || metric(&s3, "aether_tls_handshakes_total", &inbound_ok);
    let h0 = handshakes().await;
    for i in 0..5 {
        assert_app_ok(
            &get_h1(out, SVC, &format!("/pooled/{i}")).await,
            8080,
            "pooled",
        );
    }
    let h1 = handshakes().await;
    assert_eq!(
        h1, h0,
        "precondition: sequential requests reuse the pooled connection"
    );
    let clusters_before = endpoints_of(&client, SVC).await;
    let mut nonces = cp.resend(SVC);
    nonces.extend(cp.resend("outbound|8080||payments.aether.internal"));
    assert_eq!(nonces.len(), 2);
    cp.wait_until(IO_TIMEOUT, "ACKs of the unchanged resend", |cp| {
        nonces.iter().all(|n| cp.answer_to(n) == Some(None))
    })
    .await;
    for i in 0..5 {
        assert_app_ok(
            &get_h1(out, SVC, &format!("/resent/{i}")).await,
            8080,
            "after resend",
        );
    }
    assert_eq!(
        handshakes().await,
        h1,
        "an unchanged resend must not churn the pool (new handshakes to pod 3)"
    );
    assert_eq!(endpoints_of(&client, SVC).await, clusters_before);
    assert_eq!(count().2, 20);

    // The pin changes to an identity pod 3 lacks: new requests fail, pooled connection or not.
    cp.update(|f| f.svc("payments").identity = certs.spiffe_id(ORDERS));
    cp.wait_acked(&[SVC], IO_TIMEOUT).await;
    let one_s = Duration::from_secs(1);
    let r = eventually(one_s, "the new pin refusing pod 3", async || {
        let r = get_h1(out, SVC, "/new-pin").await;
        if r.status.as_u16() == 503 {
            Ok(r)
        } else {
            Err(format!("after the ACK, requests still reach pod 3: {r:?}"))
        }
    })
    .await;
    assert_proxy_error(
        &r,
        503,
        "upstream-identity-mismatch",
        "after the pin change",
    );
    let seen = count().2;
    for _ in 0..3 {
        let r = get_h1(out, SVC, "/still-new-pin").await;
        assert_proxy_error(&r, 503, "upstream-identity-mismatch", "the new pin holds");
    }
    assert_eq!(
        count().2,
        seen,
        "no request reached pod 3 under the new pin"
    );

    // And back.
    cp.update(|f| f.svc("payments").identity = certs.spiffe_id(PAYMENTS));
    cp.wait_acked(&[SVC], IO_TIMEOUT).await;
    eventually(one_s, "the pin back", async || {
        let r = get_h1(out, SVC, "/old-pin").await;
        if r.status.as_u16() == 200 {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    assert_eq!(client.pid(), pid);
    assert_eq!(cp.ads_streams().len(), 1, "one stream throughout");
}

/// The absence table of SPEC 9 reached by pushes on live clusters: a port no pod advertises
/// any more is `port-not-exposed` (from `aether.io.ports` for `payments`, from the removed
/// `svc:9090` Cluster for `orders`), an assignment whose pods all drain is `no-endpoints`, and
/// a service the control plane removes is `unknown-service`.
async fn pushed_absences_on_live_clusters(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let s1 = PaymentsPod::start(&certs, p1).await;
    let svc = || s1.service(&certs, PAYMENTS);
    let fx = Fixture::new()
        .service("payments", svc())
        .service("orders", svc().without_ports_metadata());
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let _client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    let all = [
        ("payments.aether.internal", 8080),
        ("payments.aether.internal:9090", 9090),
        ("orders.aether.internal", 8080),
        ("orders.aether.internal:9090", 9090),
    ];
    for (a, port) in all {
        assert_app_ok(&get_h1(out, a, "/live").await, port, a);
    }

    /// Polls until `authority` gets the proxy error `reason`; until then only the answer of the
    /// previous step (an app's 200, or the proxy error `before`) is allowed.
    async fn wait_answer(
        out: std::net::SocketAddr,
        authority: &str,
        before: Option<&str>,
        status: u16,
        reason: &str,
    ) {
        let what = format!("{authority}: {reason} after the push");
        let r = eventually(Duration::from_secs(5), &what, async || {
            let r = get_h1(out, authority, "/poll").await;
            if r.aether_error() == Some(reason) {
                return Ok(r);
            }
            let interim = match before {
                None => r.status.as_u16() == 200,
                Some(b) => r.aether_error() == Some(b),
            };
            assert!(
                interim,
                "{authority}: waiting for {reason} (after {before:?}), got {r:?} {}",
                r.text()
            );
            Err(format!("still {r:?}"))
        })
        .await;
        assert_proxy_error(&r, status, reason, authority);
    }

    // 9090 goes away.
    cp.update(|f| {
        for s in ["payments", "orders"] {
            f.svc(s).endpoint_mut(p1.proxy_ip()).ports = vec![8080];
        }
    });
    wait_answer(
        out,
        "payments.aether.internal:9090",
        None,
        503,
        "port-not-exposed",
    )
    .await;
    wait_answer(
        out,
        "orders.aether.internal:9090",
        None,
        503,
        "port-not-exposed",
    )
    .await;
    assert_app_ok(&get_h1(out, SVC, "/still").await, 8080, "8080 stays");

    // Every pod drains.
    cp.update(|f| {
        for s in ["payments", "orders"] {
            f.svc(s).endpoint_mut(p1.proxy_ip()).draining = true;
        }
    });
    wait_answer(out, "payments.aether.internal", None, 503, "no-endpoints").await;
    wait_answer(
        out,
        "orders.aether.internal:8080",
        None,
        503,
        "no-endpoints",
    )
    .await;

    // The services go.
    cp.update(|f| f.services.clear());
    wait_answer(
        out,
        "payments.aether.internal",
        Some("no-endpoints"),
        503,
        "unknown-service",
    )
    .await;
    wait_answer(
        out,
        "orders.aether.internal:9090",
        Some("port-not-exposed"),
        503,
        "unknown-service",
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Rollout
// ---------------------------------------------------------------------------------------------

/// A rollout driven by pushes: v1 pods advertise [8080] (their proxies and apps would serve
/// 9091 too), v2 pods [8080, 9091]. While a client calls `:9091` without pause, v2 pods are
/// added one by one and v1 pods removed. No 9091 request reaches a v1 pod; nothing fails;
/// the only error answer is `port-not-exposed`, and only before the first v2 pod answered.
async fn rollout(server: Server, ports_metadata: bool) {
    let net = Net::fresh();
    let client_pod = net.pod(0);
    let (v1a, v1b, v2a, v2b) = (net.pod(1), net.pod(2), net.pod(3), net.pod(4));
    let certs = certs();
    let ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 9091, protocol: auto }",
    ];
    let mut apps = Vec::new();
    let mut servers = Vec::new();
    for p in [v1a, v1b, v2a, v2b] {
        apps.push((
            HttpApp::auto(p.app(8080)).await,
            HttpApp::auto(p.app(9091)).await,
        ));
        servers.push(server_proxy(&certs, p, "payments", &ports).await);
    }
    let mut svc = Service::new(&certs.spiffe_id(PAYMENTS))
        .endpoint(Endpoint::new(v1a.proxy_ip(), &[8080]).label("version", "v1"))
        .endpoint(Endpoint::new(v1b.proxy_ip(), &[8080]).label("version", "v1"));
    if !ports_metadata {
        svc = svc.without_ports_metadata();
    }
    let cp = ControlPlane::start(
        server,
        Listen::Tcp(cp_addr(&net)),
        Fixture::new().service("payments", svc),
    )
    .await;
    let _client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let authority = "payments.aether.internal:9091";
    let started = Instant::now();
    let load = Load::start(client_pod.outbound(), authority, 4);
    load.wait_more(10, Duration::from_secs(5)).await;

    let v2 = |p: PodNet| Endpoint::new(p.proxy_ip(), &[8080, 9091]).label("version", "v2");
    cp.update(|f| f.svc("payments").endpoints.push(v2(v2a)));
    load.wait_for(
        Duration::from_secs(5),
        "a 9091 answer after the first v2 pod",
        |o| *o == Outcome::App(9091),
    )
    .await;
    load.wait_more(50, Duration::from_secs(5)).await;
    cp.update(|f| f.svc("payments").endpoints.push(v2(v2b)));
    let (five_s, pace) = (Duration::from_secs(5), Duration::from_millis(10));
    let second = "a 9091 request at the second v2 pod";
    eventually_every(five_s, pace, second, async || {
        holds(!apps[3].1.seen().is_empty())
    })
    .await;
    load.wait_more(50, Duration::from_secs(5)).await;
    cp.update(|f| f.svc("payments").remove_endpoint(v1a.proxy_ip()));
    load.wait_more(50, Duration::from_secs(5)).await;
    cp.update(|f| f.svc("payments").remove_endpoint(v1b.proxy_ip()));
    load.wait_more(50, Duration::from_secs(5)).await;
    let results = load.stop().await;
    println!(
        "rollout (ports metadata: {ports_metadata}): {} requests in {:?}",
        results.len(),
        started.elapsed()
    );

    assert_eq!(
        (apps[0].1.seen().len(), apps[1].1.seen().len()),
        (0, 0),
        "a 9091 request reached a v1 pod, which does not advertise 9091"
    );
    let first_ok = results
        .iter()
        .position(|(_, o)| *o == Outcome::App(9091))
        .expect("some 9091 answer");
    for (i, (_, o)) in results.iter().enumerate() {
        match o {
            Outcome::App(9091) => {}
            Outcome::Answer(503, Some(r)) if r == "port-not-exposed" && i < first_ok => {}
            other => panic!(
                "request {i} of {} (first 9091 answer at {first_ok}): {other:?}",
                results.len()
            ),
        }
    }
    assert!(first_ok > 0, "9091 answered before any pod advertised it");
    let ok = results.len() - first_ok;
    assert!(ok >= 150, "only {ok} answers from 9091");
    assert_eq!(
        apps[2].1.seen().len() + apps[3].1.seen().len(),
        ok,
        "every 9091 answer came from a v2 pod"
    );
    assert_eq!(cp.subscribes(authority), 1, "{}", cp.summary());
}

async fn rollout_by_pushes_with_ports_metadata(server: Server) {
    rollout(server, true).await;
}

async fn rollout_by_pushes_without_ports_metadata(server: Server) {
    rollout(server, false).await;
}

// ---------------------------------------------------------------------------------------------
// Losing the control plane
// ---------------------------------------------------------------------------------------------

/// The control plane is killed mid-traffic and comes back on the same address: no request for
/// a known cluster fails meanwhile; `aether_xds_connected` goes 0 then 1; a change made while
/// it was away applies after the reconnect, which carries `initial_resource_versions`. Then the
/// control plane ends the stream alone: a new one, with the current versions, no failed request.
async fn control_plane_restart_loses_no_traffic(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1, p2) = (net.pod(0), net.pod(1), net.pod(2));
    let certs = certs();
    let ports = ["{ port: 8080, protocol: auto }"];
    let a1 = HttpApp::auto(p1.app(8080)).await;
    let a2 = HttpApp::auto(p2.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &ports).await;
    let _s2 = server_proxy(&certs, p2, "payments", &ports).await;
    let fx = Fixture::new().service(
        "payments",
        Service::new(&certs.spiffe_id(PAYMENTS)).endpoint(Endpoint::new(p1.proxy_ip(), &[8080])),
    );
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    let connected = "aether_xds_connected";
    wait_metric(&client, connected, &[], Duration::from_secs(5), |v| {
        v == 1.0
    })
    .await;
    assert_app_ok(&get_h1(out, SVC, "/before").await, 8080, "before");
    let eds = "outbound|8080||payments.aether.internal";
    cp.wait_acked(&[SVC, eds], IO_TIMEOUT).await;
    let v_cluster = cp.version(CLUSTER_TYPE, SVC).unwrap();
    let v_cla = cp.version(CLA_TYPE, eds).unwrap();

    let load = Load::start(out, SVC, 1);
    load.wait_more(10, Duration::from_secs(5)).await;
    cp.stop().await;
    let stopped = Instant::now();
    wait_metric(&client, connected, &[], Duration::from_secs(5), |v| {
        v == 0.0
    })
    .await;
    assert_eq!(xds_dump(&client).await["connected"], false);
    // Away for 1.5 s, with traffic all along (several reconnect attempts fail meanwhile).
    while stopped.elapsed() < Duration::from_millis(1500) {
        load.wait_more(5, Duration::from_secs(5)).await;
    }

    // Changed while away: pod 2 joins.
    cp.update(|f| {
        f.svc("payments")
            .endpoints
            .push(Endpoint::new(p2.proxy_ip(), &[8080]))
    });
    assert!(a2.seen().is_empty());
    cp.serve().await;
    let away = stopped.elapsed();
    wait_metric(&client, connected, &[], Duration::from_secs(10), |v| {
        v == 1.0
    })
    .await;
    let (five_s, pace) = (Duration::from_secs(5), Duration::from_millis(10));
    let served = poll_until(five_s, pace, async || holds(!a2.seen().is_empty())).await;
    assert!(
        served.is_ok(),
        "the endpoint added while the control plane was away gets no traffic; {}",
        cp.summary()
    );
    load.wait_more(10, Duration::from_secs(5)).await;
    let results = load.stop().await;
    println!(
        "control plane away for {away:?}; {} requests",
        results.len()
    );
    let bad: Vec<_> = results
        .iter()
        .filter(|(_, o)| *o != Outcome::App(8080))
        .collect();
    assert!(
        bad.is_empty(),
        "requests failed around the restart: {bad:?}"
    );
    assert!(!a1.seen().is_empty());

    let streams = cp.ads_streams();
    assert!(
        streams.len() >= 2,
        "a new stream after the restart; {}",
        cp.summary()
    );
    let again = &streams[streams.len() - 1];
    assert_eq!(
        again.first_node().map(|n| n.user_agent_name.as_str()),
        Some("aether-proxy"),
        "the new stream's first request names the node"
    );
    let initial = |type_url: &str| {
        again
            .requests
            .iter()
            .filter(|r| r.type_url == type_url)
            .flat_map(|r| r.initial_versions.clone())
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    assert_eq!(
        initial(CLUSTER_TYPE).get(SVC),
        Some(&v_cluster),
        "the reconnect carries the Cluster's version; {}",
        cp.summary()
    );
    assert_eq!(
        initial(CLA_TYPE).get(eds),
        Some(&v_cla),
        "the reconnect carries the assignment's version; {}",
        cp.summary()
    );

    // The control plane ends the stream (the connection stays): the client opens a new one,
    // with the versions it has now, and traffic does not notice.
    cp.wait_acked(&[SVC, eds], IO_TIMEOUT).await;
    let v_cla_now = cp.version(CLA_TYPE, eds).unwrap();
    assert_ne!(v_cla_now, v_cla);
    let before = cp.ads_streams().len();
    let load = Load::start(out, SVC, 1);
    load.wait_more(10, Duration::from_secs(5)).await;
    cp.drop_streams();
    cp.wait_until(
        Duration::from_secs(10),
        "a new stream after drop_streams",
        |cp| cp.open_streams(Api::DeltaAds) == 1 && cp.ads_streams().len() > before,
    )
    .await;
    cp.wait_acked(&[SVC, eds], IO_TIMEOUT).await;
    wait_metric(&client, connected, &[], Duration::from_secs(5), |v| {
        v == 1.0
    })
    .await;
    load.wait_more(10, Duration::from_secs(5)).await;
    let results = load.stop().await;
    let bad: Vec<_> = results
        .iter()
        .filter(|(_, o)| *o != Outcome::App(8080))
        .collect();
    assert!(
        bad.is_empty(),
        "requests failed around the dropped stream: {bad:?}"
    );
    let streams = cp.ads_streams();
    let last = &streams[streams.len() - 1];
    let initial: std::collections::BTreeMap<String, String> = last
        .requests
        .iter()
        .filter(|r| r.type_url == CLA_TYPE)
        .flat_map(|r| r.initial_versions.clone())
        .collect();
    assert_eq!(
        initial.get(eds),
        Some(&v_cla_now),
        "the new stream carries the assignment version learnt on the previous one; {}",
        cp.summary()
    );
}

// ---------------------------------------------------------------------------------------------
// What real gRPC servers do (the gRPC project's own server, grpcio)
// ---------------------------------------------------------------------------------------------

/// A client pod fed by `cp`, a server pod behind `payments` on 8080: (client, app, server).
async fn one_service_mesh(
    net: &Net,
    certs: &Certs,
    server: Server,
) -> (ControlPlane, HttpApp, Proxy) {
    let p1 = net.pod(1);
    let app = HttpApp::auto(p1.app(8080)).await;
    let sidecar = server_proxy(certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let fx = Fixture::new().service(
        "payments",
        Service::new(&certs.spiffe_id(PAYMENTS)).endpoint(Endpoint::new(p1.proxy_ip(), &[8080])),
    );
    let cp = ControlPlane::new(server, Listen::Tcp(cp_addr(net)), fx);
    (cp, app, sidecar)
}

/// A GET through the client pod that must be answered 200 by the app within `limit`.
async fn answered_within(out: std::net::SocketAddr, path: &str, limit: Duration) -> Duration {
    let t = Instant::now();
    let r = within(limit, path, get_h1(out, SVC, path)).await.unwrap();
    assert_app_ok(&r, 8080, path);
    t.elapsed()
}

/// The property that deadlocked a fresh sidecar: grpcio (as grpc-go and gRPC C++) sends a
/// stream's response headers only with its first response, and an xDS server answers nothing
/// before the client's first request. Checked on the server first (a call that sends nothing
/// gets no headers), then: the first request through `:15001` after start is answered within
/// 1 s, after a silent second on the stream too; a reconnect with no versions held and one with
/// versions held are answered the same; demand that arrives while the control plane cannot be
/// reached is sent once it can, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_sends_headers_with_its_first_answer_is_spoken_to_first() {
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
    let net = Net::fresh();
    let certs = certs();
    let (cp, _app, _sidecar) = one_service_mesh(&net, &certs, Server::Grpcio).await;
    cp.serve().await;
    let addr = cp_addr(&net);

    // The server withholds its headers while the client sends nothing.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connects");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<DeltaDiscoveryRequest>();
    let mut raw = AggregatedDiscoveryServiceClient::new(channel);
    let mut call = Box::pin(
        raw.delta_aggregated_resources(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)),
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut call)
            .await
            .is_err(),
        "the grpcio server sent response headers before any response"
    );
    tx.send(DeltaDiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        resource_names_subscribe: vec![SVC.into()],
        ..Default::default()
    })
    .unwrap();
    within(IO_TIMEOUT, "headers with the first response", &mut call)
        .await
        .unwrap()
        .expect("the stream opens once answered");
    drop((call, tx));

    // A fresh sidecar; its stream stays silent for a second before any demand.
    let client_pod = net.pod(0);
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first = answered_within(out, "/first", Duration::from_secs(1)).await;
    println!("first request after start answered in {first:?}");

    // The server ends the stream: the reconnect carries the versions held.
    let before = cp.ads_streams().len();
    cp.drop_streams();
    cp.wait_until(IO_TIMEOUT, "a new stream", |cp| {
        cp.open_streams(Api::DeltaAds) == 1 && cp.ads_streams().len() > before
    })
    .await;
    answered_within(out, "/after-reconnect", Duration::from_secs(1)).await;
    let last = cp.ads_streams().pop().unwrap();
    assert!(
        last.requests
            .iter()
            .any(|r| r.initial_versions.contains_key(SVC)),
        "the reconnect carries the Cluster's version; {}",
        cp.summary()
    );
    drop(client);

    // A sidecar started while the control plane is down: a request waits, then is answered
    // once the control plane serves, subscribed once.
    cp.stop().await;
    let late_pod = net.pod(2);
    let late = xds_client(
        &certs,
        late_pod,
        &cp.address(),
        &["cluster_timeout: 10s", "node_id: late"],
        "",
    )
    .await;
    let waiting = tokio::spawn(get_h1(late_pod.outbound(), SVC, "/while-down"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    cp.serve().await;
    let r = within(
        Duration::from_secs(9),
        "the request made while down",
        waiting,
    )
    .await
    .unwrap()
    .unwrap();
    assert_app_ok(&r, 8080, "made while the control plane was down");
    let late_streams: Vec<_> = cp
        .ads_streams()
        .into_iter()
        .filter(|s| s.first_node().is_some_and(|n| n.id == "late"))
        .collect();
    let subs: usize = late_streams
        .iter()
        .flat_map(|s| &s.requests)
        .map(|r| r.subscribe.iter().filter(|n| *n == SVC).count())
        .sum();
    assert_eq!(subs, 1, "subscribed once; {}", cp.summary());
    assert!(
        late_streams[0].requests[0].initial_versions.is_empty(),
        "nothing held, no versions"
    );
    drop(late);
}

/// A server that treats the node as a wildcard subscriber pushes every Cluster and every
/// assignment on the first request, assignments before any request of their type: all ACKed,
/// and a service never asked for is routed from what was pushed, without a subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcard_pushes_before_any_request_of_their_type_are_acked_and_used() {
    let net = Net::fresh();
    let certs = certs();
    let (cp, _app, _sidecar) = one_service_mesh(&net, &certs, Server::Grpcio).await;
    let p3 = net.pod(3);
    let _orders_app = HttpApp::auto(p3.app(8080)).await;
    let _orders = server_proxy(&certs, p3, "orders", &["{ port: 8080, protocol: auto }"]).await;
    cp.update(|f| {
        f.services.insert(
            "orders".into(),
            Service::new(&certs.spiffe_id(ORDERS)).endpoint(Endpoint::new(p3.proxy_ip(), &[8080])),
        );
    });
    cp.wildcard(true);
    cp.serve().await;
    let client_pod = net.pod(0);
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    answered_within(out, "/payments", Duration::from_secs(2)).await;
    let stream = &cp.ads_streams()[0];
    let first_cla_response = stream.responses.iter().position(|r| r.type_url == CLA_TYPE);
    assert!(first_cla_response.is_some(), "{}", cp.summary());
    assert!(
        !stream.requests.iter().any(|r| r.type_url == CLA_TYPE
            && !r.subscribe.is_empty()
            && r.at < stream.responses[first_cla_response.unwrap()].at),
        "the assignments came before any request of their type; {}",
        cp.summary()
    );
    let orders = "orders.aether.internal";
    cp.wait_acked(
        &[SVC, orders, "outbound|8080||orders.aether.internal"],
        IO_TIMEOUT,
    )
    .await;
    let r = get_h1(out, orders, "/orders").await;
    assert_eq!(r.status.as_u16(), 200, "{r:?}");
    assert_eq!(cp.subscribes(orders), 0, "orders was never asked for");
    assert!(cp.nacks().is_empty(), "{}", cp.summary());
    drop(client);
}

/// `removed_resources` naming something never sent is ACKed and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_of_a_name_never_sent_is_acked_and_ignored() {
    let net = Net::fresh();
    let certs = certs();
    let (cp, _app, _sidecar) = one_service_mesh(&net, &certs, Server::Grpcio).await;
    cp.serve().await;
    let client_pod = net.pod(0);
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    answered_within(out, "/before", Duration::from_secs(2)).await;
    let ghost = "ghost.aether.internal";
    let mut nonces = cp.send_removed(CLUSTER_TYPE, ghost);
    nonces.extend(cp.send_removed(CLA_TYPE, "outbound|8080||ghost.aether.internal"));
    assert_eq!(nonces.len(), 2);
    cp.wait_until(IO_TIMEOUT, "both removals answered", |cp| {
        nonces.iter().all(|n| cp.answer_to(n).is_some())
    })
    .await;
    for n in &nonces {
        assert_eq!(cp.answer_to(n), Some(None), "ACKed; {}", cp.summary());
    }
    let dump = xds_dump(&client).await;
    assert!(
        !dump["absent"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == ghost),
        "{dump}"
    );
    answered_within(out, "/after", Duration::from_secs(1)).await;
    assert_eq!(cp.subscribes(ghost), 0);
}

/// A stream ended as soon as it is accepted, with UNAVAILABLE and then RESOURCE_EXHAUSTED:
/// the client tries again with a growing backoff (never a busy loop) and is served once the
/// server is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_refused_on_accept_are_retried_with_backoff() {
    let net = Net::fresh();
    let certs = certs();
    let (cp, _app, _sidecar) = one_service_mesh(&net, &certs, Server::Grpcio).await;
    cp.refuse_streams(Some(tonic::Status::unavailable("overloaded, try later")));
    cp.serve().await;
    let client_pod = net.pod(0);
    // Longer than the largest backoff (5 s), so the request below outlives the last refusal.
    let client = xds_client(
        &certs,
        client_pod,
        &cp.address(),
        &["cluster_timeout: 10s"],
        "",
    )
    .await;
    for status in [
        tonic::Status::unavailable("overloaded, try later"),
        tonic::Status::resource_exhausted("too many streams"),
    ] {
        cp.refuse_streams(Some(status.clone()));
        // Longer than the largest backoff, so at least one try falls inside whatever the
        // jitter draws; a client that did not back off would make hundreds.
        let before = cp.ads_streams().len();
        tokio::time::sleep(Duration::from_secs(6)).await;
        let tries = cp.ads_streams().len() - before;
        println!("{:?}: {tries} streams in 6 s", status.code());
        assert!(
            (1..=12).contains(&tries),
            "{:?}: {tries} streams in 6 s; {}",
            status.code(),
            cp.summary()
        );
    }
    assert_eq!(metric(&client, "aether_xds_connected", &[]).await, 0.0);
    cp.refuse_streams(None);
    let out = client_pod.outbound();
    let r = within(
        Duration::from_secs(10),
        "served once the server is",
        get_h1(out, SVC, "/served"),
    )
    .await
    .unwrap();
    assert_app_ok(&r, 8080, "after the refusals");
}

/// An assignment over tonic's 4 MiB default message size (a large service) is accepted; the
/// client's limit is 64 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_four_mib_is_accepted() {
    let net = Net::fresh();
    let certs = certs();
    let (cp, _app, _sidecar) = one_service_mesh(&net, &certs, Server::Grpcio).await;
    let pad = "p".repeat(1500);
    cp.update(|f| {
        for i in 0..3200u32 {
            let ip = std::net::Ipv4Addr::new(127, 254, (i / 250) as u8, (i % 250 + 1) as u8);
            f.svc("payments").endpoints.push(
                Endpoint::new(ip.into(), &[8080])
                    .label("pad", &pad)
                    .draining(),
            );
        }
    });
    let eds = "outbound|8080||payments.aether.internal";
    let size = cp.encoded_len(CLA_TYPE, eds);
    assert!(size > 4 << 20, "the assignment is {size} bytes");
    cp.serve().await;
    let client_pod = net.pod(0);
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    answered_within(client_pod.outbound(), "/big", Duration::from_secs(3)).await;
    cp.wait_acked(&[eds], IO_TIMEOUT).await;
    let eps = endpoints_of(&client, SVC).await.expect("the cluster");
    assert_eq!(eps.len(), 3201);
    assert!(cp.nacks().is_empty(), "{:?}", cp.nacks());
}

/// A graceful restart of the server (a new process on the address, the old one sends GOAWAY
/// and ends its streams after its grace period): no request fails, the client reconnects once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_server_restart_loses_nothing_and_reconnects_once() {
    let net = Net::fresh();
    let certs = certs();
    let (cp, _app, _sidecar) = one_service_mesh(&net, &certs, Server::Grpcio).await;
    cp.serve().await;
    let client_pod = net.pod(0);
    let client = xds_client(&certs, client_pod, &cp.address(), &[], "").await;
    let out = client_pod.outbound();
    answered_within(out, "/before", Duration::from_secs(2)).await;
    let eds = "outbound|8080||payments.aether.internal";
    cp.wait_acked(&[SVC, eds], IO_TIMEOUT).await;
    let load = Load::start(out, SVC, 2);
    load.wait_more(10, Duration::from_secs(5)).await;
    cp.restart_gracefully().await;
    cp.wait_until(Duration::from_secs(10), "the reconnect", |cp| {
        cp.ads_streams().len() == 2 && cp.open_streams(Api::DeltaAds) == 1
    })
    .await;
    cp.wait_acked(&[SVC, eds], IO_TIMEOUT).await;
    load.wait_more(20, Duration::from_secs(5)).await;
    // Past the reconnect backoff: still one new stream.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let results = load.stop().await;
    let bad: Vec<_> = results
        .iter()
        .filter(|(_, o)| *o != Outcome::App(8080))
        .collect();
    assert!(
        bad.is_empty(),
        "requests failed around the restart: {bad:?}"
    );
    assert_eq!(cp.ads_streams().len(), 2, "one reconnect; {}", cp.summary());
    wait_metric(&client, "aether_xds_connected", &[], IO_TIMEOUT, |v| {
        v == 1.0
    })
    .await;
}

crate::on_both_control_planes!(
    rollout_by_pushes_with_ports_metadata,
    rollout_by_pushes_without_ports_metadata,
    invalid_clusters_are_nacked_and_the_last_good_one_stays,
    pushed_endpoint_and_identity_changes_apply_without_restart,
    pushed_absences_on_live_clusters,
    control_plane_restart_loses_no_traffic,
);
