//! The workload identity from SDS and the control plane on a unix socket (SPEC section 9):
//! `/readyz` waits for the first identity, the ADS stream starts once it is known, and a pushed
//! `default` secret rotates the client certificate without a restart.

use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::xds::*;
use crate::common::*;

/// The client pod's config: identity from SDS and discovery over ADS, both on `sock`.
fn sds_client_config(certs: &Certs, pod: PodNet, address: &str) -> String {
    format!(
        "trust_domain: {}\nidentity:\n  sds: \"{address}\"\n{}{}",
        certs.trust_domain(),
        pod.listeners_yaml(8080, &[]),
        discovery_yaml(address, &[])
    )
}

/// The `Hash=` of the XFCC value an app behind a server proxy saw: the SHA-256 of the client
/// leaf the client proxy presented.
fn xfcc_hash(r: &Reply) -> String {
    let xfcc = echoed_header(r, "x-forwarded-client-cert");
    assert_eq!(xfcc.len(), 1, "one XFCC value: {xfcc:?}");
    xfcc[0]
        .split(';')
        .find_map(|kv| kv.strip_prefix("Hash="))
        .unwrap_or_else(|| panic!("no Hash in {:?}", xfcc[0]))
        .to_string()
}

/// A client pod with `identity.sds` and `discovery.xds` on one unix socket: 503 on `/readyz`
/// while the control plane is not there (started late), ready once it serves the secrets;
/// traffic uses the SDS identity; rotating `default` to a new leaf shows on the server side
/// without a restart.
async fn sds_identity_and_ads_over_a_unix_socket(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let _app = HttpApp::auto(p1.app(8080)).await;
    let _s1 = server_proxy(&certs, p1, "payments", &["{ port: 8080, protocol: auto }"]).await;
    let dir = tempfile::Builder::new()
        .prefix("aether-xds-")
        .tempdir()
        .unwrap();
    let sock = dir.path().join("xds.sock");
    // One handshake per request, so each request shows the certificate in use now.
    let fx = Fixture::new()
        .service(
            "payments",
            Service::new(&certs.spiffe_id(PAYMENTS))
                .max_requests_per_connection(1)
                .endpoint(Endpoint::new(p1.proxy_ip(), &[8080])),
        )
        .identity(&certs, "frontend");
    let cp = ControlPlane::new(server, Listen::Unix(sock.clone()), fx);
    let config = sds_client_config(&certs, client_pod, &cp.address());
    let mut client = Proxy::builder(&config, "").no_wait().start().await;

    // No control plane yet: not ready, and stays so.
    let until = Instant::now() + Duration::from_millis(1500);
    let mut polls = 0;
    while Instant::now() < until {
        if let Some(s) = client.try_exit() {
            panic!(
                "the proxy exited without its identity ({s}); stderr:\n{}",
                client.stderr()
            );
        }
        if let Ok(r) = client.admin_get("/readyz").await {
            assert_eq!(
                r.status.as_u16(),
                503,
                "/readyz before any identity arrived: {r:?} {}",
                r.text()
            );
            polls += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(polls > 0, "the admin listener never answered /readyz");
    assert!(cp.streams().is_empty());

    cp.serve().await;
    client.wait_ready(Duration::from_secs(15)).await;
    let sds = cp.sds_streams();
    assert!(
        !sds.is_empty(),
        "the identity came over SDS; {}",
        cp.summary()
    );
    let requested: std::collections::BTreeSet<String> = sds
        .iter()
        .flat_map(|s| s.requests.iter().flat_map(|r| r.resource_names.clone()))
        .collect();
    assert!(
        requested.contains("default") && requested.contains("ROOTCA"),
        "SDS asked for {requested:?}"
    );
    assert_eq!(
        sds[0].first_node().map(|n| n.user_agent_name.as_str()),
        Some("aether-proxy")
    );

    let out = client_pod.outbound();
    let r = get_h1(out, SVC, "/first").await;
    assert_app_ok(&r, 8080, "with the SDS identity");
    let old = sha256_hex(&certs.leaf_der("frontend"));
    assert_eq!(xfcc_hash(&r), old, "the server saw the SDS leaf");
    assert_eq!(
        echoed_header(&r, "x-forwarded-client-cert")[0]
            .split(';')
            .find_map(|kv| kv.strip_prefix("URI=")),
        Some(certs.spiffe_id(FRONTEND).as_str())
    );

    // The ADS stream came over the same socket, after the identity.
    let ads = cp.ads_streams();
    assert!(!ads.is_empty(), "{}", cp.summary());
    let first_secret = sds
        .iter()
        .flat_map(|s| s.responses.iter().map(|r| r.at))
        .min()
        .expect("an SDS response");
    assert!(
        ads[0].opened >= first_secret,
        "the ADS stream opened before the identity was known; {}",
        cp.summary()
    );

    // Rotation: a new leaf for the same workload, pushed over SDS.
    let pid = client.pid();
    certs.issue(&[FRONTEND]);
    let new = sha256_hex(&certs.leaf_der("frontend"));
    assert_ne!(new, old);
    cp.update(|f| f.set_identity(&certs, "frontend"));
    cp.wait_acked(&["default"], IO_TIMEOUT).await;
    let rotated = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || {
            let r = get_h1(out, SVC, "/rotated").await;
            assert_app_ok(&r, 8080, "during the rotation");
            let seen = xfcc_hash(&r);
            if seen == new {
                return Ok(());
            }
            assert_eq!(seen, old, "an unknown leaf");
            Err(())
        },
    )
    .await;
    assert!(
        rotated.is_ok(),
        "5 s after the rotation was ACKed the server still sees the old leaf (each request is \
         its own connection: max_requests_per_connection 1); /config_dump identity: {}",
        crate::common::live::config_dump(&client).await["config"]["identity"]
    );
    for i in 0..3 {
        let r = get_h1(out, SVC, &format!("/after/{i}")).await;
        assert_eq!(xfcc_hash(&r), new, "every new connection uses the new leaf");
    }
    assert_eq!(client.pid(), pid, "no restart");
    assert!(cp.nacks().is_empty(), "{:?}", cp.nacks());
}

crate::on_both_control_planes!(sds_identity_and_ads_over_a_unix_socket,);
