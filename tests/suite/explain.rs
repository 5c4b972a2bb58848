//! `aether-proxy explain` against a running client sidecar: for every row of the authority
//! table and every error answer a routing decision can give, what `explain` says a request
//! would get is what the same request through `:15001` gets. Also the route, endpoint order
//! and identity it reports, and the text a person reads.

use std::process::Command;

use crate::common::mesh::*;
use crate::common::*;
use http::Request;
use http_body_util::Full;

/// `aether-proxy explain --json` against `admin`: the parsed answer.
fn explain(admin: std::net::SocketAddr, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_aether-proxy"))
        .args(["explain", "--admin", &admin.to_string(), "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "explain {args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("explain {args:?}: {e}: {out:?}"))
}

/// One row: what, explain's extra arguments, the request's headers, CONNECT or not, and the
/// answer both must agree on.
type Row = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    bool,
    u16,
    Option<&'static str>,
);

/// What explain predicts: (status, reason), 200-with-no-reason when forwarded.
fn predicted(v: &serde_json::Value) -> (u16, Option<String>) {
    match &v["answer"] {
        serde_json::Value::Null => (200, None),
        a => (
            a["status"].as_u64().unwrap() as u16,
            a["reason"].as_str().map(str::to_string),
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_predicts_every_row_of_the_authority_table() {
    let net = Net::fresh();
    let (client_pod, p1, p2, dead) = (net.pod(0), net.pod(1), net.pod(2), net.pod(3));
    let certs = certs();
    let _apps = (
        HttpApp::auto(p1.app(8080)).await,
        HttpApp::auto(p1.app(9090)).await,
        HttpApp::auto(p2.app(8080)).await,
        TcpEcho::start(p1.app(5432)).await,
    );
    let ports = [
        "{ port: 8080, protocol: auto }",
        "{ port: 9090, protocol: auto }",
        "{ port: 5432, protocol: tcp }",
    ];
    let _s1 = server_proxy(&certs, p1, "payments", &ports).await;
    let _s2 = server_proxy(&certs, p2, "payments", &ports).await;
    let ep = |pod: PodNet, ports: &str, extra: &str| {
        format!(
            "      - {{ address: \"{}\", ports: {ports}{extra} }}\n",
            pod.proxy_ip()
        )
    };
    let routes = "    protocols: { 5432: tcp }\n    routes:\n      - match: { header: x-canary, value: \"1\" }\n        subset: { version: v2 }\n";
    let cat = catalog(&[
        service(
            "payments",
            &certs.spiffe_id(PAYMENTS),
            routes,
            &[
                ep(p1, "[8080, 9090, 5432]", ", labels: { version: v1 }"),
                ep(
                    p2,
                    "[8080, 7070]",
                    ", labels: { version: v2 }, draining: true",
                ),
            ],
        ),
        // Nothing listens at `dead`: five failed connects eject it.
        service(
            "orders",
            &certs.spiffe_id(ORDERS),
            "",
            &[ep(dead, "[8080]", "")],
        ),
    ]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let admin = client.admin_addr();
    let out = client_pod.outbound();

    // What a request for `authority` (with `headers`, or as a CONNECT) gets through :15001.
    let actual = |authority: String, headers: Vec<(&'static str, &'static str)>, connect: bool| async move {
        if connect {
            let tcp = tcp_connect(out).await.unwrap();
            return match http_connect(tcp, &authority).await {
                Ok(_) => (200, None),
                Err(TunnelError::Refused(r)) => (
                    r.status.as_u16(),
                    r.header("x-aether-error").map(str::to_string),
                ),
                Err(TunnelError::Failed(e)) => panic!("CONNECT {authority}: {e}"),
            };
        }
        let mut b = Request::get("/explained").header("host", authority.as_str());
        for (k, v) in &headers {
            b = b.header(*k, *v);
        }
        let r = h1_to(out)
            .await
            .send(b.body(Full::new(bytes::Bytes::new())).unwrap())
            .await
            .unwrap();
        (
            r.status.as_u16(),
            r.header("x-aether-error").map(str::to_string),
        )
    };

    // Eject the dead endpoint first, as any client's requests would.
    for _ in 0..5 {
        let (status, _) = actual("orders.aether.internal".into(), vec![], false).await;
        assert_eq!(status, 503, "orders, to be ejected");
    }

    let rows: &[Row] = &[
        ("the default port", &[], &[], false, 200, None),
        ("a port spelled out", &[], &[], false, 200, None),
        (
            "a port the service does not expose",
            &[],
            &[],
            false,
            503,
            Some("port-not-exposed"),
        ),
        (
            "a service the catalog lacks",
            &[],
            &[],
            false,
            503,
            Some("unknown-service"),
        ),
        ("not a mesh name", &[], &[], false, 404, Some("no-route")),
        (
            "a malformed port",
            &[],
            &[],
            false,
            400,
            Some("bad-authority"),
        ),
        (
            "userinfo in the authority",
            &[],
            &[],
            false,
            400,
            Some("bad-authority"),
        ),
        (
            "CONNECT to an HTTP port",
            &[],
            &[],
            true,
            400,
            Some("not-a-tcp-port"),
        ),
        (
            "HTTP to a tcp port",
            &[],
            &[],
            false,
            400,
            Some("not-an-http-port"),
        ),
        ("CONNECT to a tcp port", &[], &[], true, 200, None),
        (
            "a route to draining endpoints only",
            &["-H", "x-canary: 1"],
            &[("x-canary", "1")],
            false,
            503,
            Some("no-endpoints"),
        ),
        (
            "a port only a draining endpoint serves",
            &[],
            &[],
            false,
            503,
            Some("no-endpoints"),
        ),
        (
            "every endpoint ejected",
            &[],
            &[],
            false,
            503,
            Some("no-healthy-upstream"),
        ),
    ];
    let authorities = [
        SVC.to_string(),
        format!("{SVC}:9090"),
        format!("{SVC}:7777"),
        "ghost.aether.internal".to_string(),
        "example.com:80".to_string(),
        format!("{SVC}:99999"),
        format!("user@{SVC}"),
        format!("{SVC}:9090"),
        format!("{SVC}:5432"),
        format!("{SVC}:5432"),
        SVC.to_string(),
        format!("{SVC}:7070"),
        "orders.aether.internal".to_string(),
    ];
    for ((what, args, headers, connect, status, reason), authority) in rows.iter().zip(authorities)
    {
        let mut a: Vec<&str> = args.to_vec();
        if *connect {
            a.push("--connect");
        }
        a.push(&authority);
        let v = explain(admin, &a);
        let said = predicted(&v);
        assert_eq!(
            said,
            (*status, reason.map(str::to_string)),
            "{what}: explain said {v}"
        );
        let got = actual(authority.clone(), headers.to_vec(), *connect).await;
        let got = if got.0 < 300 { (200, None) } else { got };
        assert_eq!(got, said, "{what}: the request got what explain said ({v})");
    }

    // The details of a forwarded request: route, endpoints in order, SNI and identity.
    let v = explain(admin, &["-H", "x-other: 1", &format!("{SVC}:8080")]);
    assert_eq!(v["cluster"], SVC, "{v}");
    assert_eq!(v["sni"], "8080", "{v}");
    assert_eq!(v["identity"], certs.spiffe_id(PAYMENTS), "{v}");
    assert_eq!(v["route"]["why"], "no route matched", "{v}");
    let eps = v["endpoints"].as_array().unwrap();
    assert_eq!(eps.len(), 2, "{v}");
    let p2_state = eps
        .iter()
        .find(|e| e["address"] == format!("{}:15008", p2.proxy_ip()))
        .expect("p2 listed");
    assert_eq!(p2_state["draining"], true, "{v}");
    let canary = explain(admin, &["-H", "x-canary: 1", SVC]);
    assert_eq!(canary["route"]["index"], 0, "{canary}");
    assert_eq!(canary["route"]["why"], "x-canary: 1 matched", "{canary}");
    assert_eq!(canary["route"]["subset"]["version"], "v2", "{canary}");
    let ejected = explain(admin, &["orders.aether.internal"]);
    assert_eq!(ejected["endpoints"][0]["ejected"], true, "{ejected}");

    // The text a person reads names the same things.
    let text = Command::new(env!("CARGO_BIN_EXE_aether-proxy"))
        .args([
            "explain",
            "--admin",
            &admin.to_string(),
            &format!("{SVC}:7777"),
        ])
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("answer     503 x-aether-error: port-not-exposed"),
        "{text}"
    );
    // A question the admin cannot take is exit 1 with a reason.
    let bad = Command::new(env!("CARGO_BIN_EXE_aether-proxy"))
        .args([
            "explain",
            "--admin",
            &admin.to_string(),
            "-H",
            "no colon",
            SVC,
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("expected name:value"),
        "{bad:?}"
    );
}

/// Fed by a control plane: explain names the discovery state, predicts what a request gets in
/// each, and asks the control plane nothing itself.
async fn explain_follows_discovery(server: crate::common::xds::Server) {
    use crate::common::xds::{
        cp_addr, xds_client, ControlPlane, Endpoint, Fixture, Listen, Service,
    };
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let _app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let svc =
        || Service::new(&certs.spiffe_id(PAYMENTS)).endpoint(Endpoint::new(p1.proxy_ip(), &[8080]));
    let fx = Fixture::new()
        .service("payments", svc())
        .service("slow", svc());
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    cp.hold("slow.aether.internal");
    let client = xds_client(
        &certs,
        client_pod,
        &cp.address(),
        &["cluster_timeout: 1s"],
        "",
    )
    .await;
    let (admin, out) = (client.admin_addr(), client_pod.outbound());

    let v = explain(admin, &[SVC]);
    assert_eq!(v["discovery"], "to be discovered", "{v}");
    assert_eq!(v["cluster"], SVC, "{v}");
    assert_eq!(v["if_absent"]["reason"], "unknown-service", "{v}");
    assert_eq!(v["if_no_answer"]["reason"], "discovery-timeout", "{v}");
    assert_eq!(cp.subscribes(SVC), 0, "explain subscribed to {SVC}");

    let r = get_h1(out, SVC, "/discover").await;
    assert_app_ok(&r, 8080, "payments, discovered");
    let v = explain(admin, &[SVC]);
    assert_eq!(
        (v["discovery"].as_str(), predicted(&v)),
        (Some("known"), (200, None)),
        "{v}"
    );

    let r = get_h1(out, "ghost.aether.internal", "/absent").await;
    assert_proxy_error(&r, 503, "unknown-service", "ghost");
    let v = explain(admin, &["ghost.aether.internal"]);
    assert_eq!(v["discovery"], "remembered as absent", "{v}");
    assert_eq!(predicted(&v), (503, Some("unknown-service".into())), "{v}");

    let v = explain(admin, &["slow.aether.internal"]);
    assert_eq!(v["discovery"], "to be discovered", "{v}");
    let r = get_h1(out, "slow.aether.internal", "/held").await;
    assert_proxy_error(&r, 503, "discovery-timeout", "slow, held");
}

crate::on_both_control_planes!(explain_follows_discovery,);
