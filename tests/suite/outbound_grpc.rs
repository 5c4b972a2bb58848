//! gRPC through both proxies end to end (SPEC section 1 "Upstream connection", section 7): a
//! tonic client and a tonic server (`crate::common::mesh::grpc`), unary and server streaming, OK and
//! non-OK statuses with their metadata.
//!
//! Real `aether-proxy run` processes: a client pod whose apps (this test) talk plaintext to its
//! outbound listener, server pods with their own proxies and apps, real mTLS between them, all
//! on loopback; the pods and catalogs are those of `crate::common::mesh`.

use std::sync::atomic::Ordering;

use crate::common::mesh::*;
use crate::common::*;

// ---------------------------------------------------------------------------------------------
// gRPC
// ---------------------------------------------------------------------------------------------

/// A tonic client dials the client proxy's outbound listener with `:authority`
/// `payments.aether.internal:9090`; the call travels through both proxies to a tonic server on
/// the server pod's 9090 (chain `h2`): unary, server streaming, and non-OK statuses whose
/// custom metadata survive both as a trailers-only answer and as real trailers after data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_unary_and_server_streaming_end_to_end() {
    use grpc::*;
    use tonic::Code;

    let net = Net::fresh();
    let (client_pod, p1) = (net.pod(0), net.pod(1));
    let certs = certs();
    let server = GrpcServer::start(p1.app(9090), "pod-1").await;
    let _s1 = server_proxy(
        &certs,
        p1,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: h2 }",
        ],
    )
    .await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(p1.proxy_ip(), &[8080, 9090])],
    )]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;
    let xfcc = expected_xfcc(&certs, PAYMENTS, "frontend", FRONTEND);

    let mut g = grpc::client(
        client_pod.outbound(),
        "http://payments.aether.internal:9090",
    )
    .await;
    let path = http::uri::PathAndQuery::from_static;

    // Unary, OK, request and response metadata intact.
    let mut req = tonic::Request::new(EchoRequest {
        message: "hello mesh".into(),
        count: 0,
        fail_at_end: false,
    });
    req.metadata_mut()
        .insert("x-caller", "frontend-test".parse().unwrap());
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let resp = within(IO_TIMEOUT, "unary", g.unary(req, path(UNARY), codec()))
        .await
        .unwrap()
        .unwrap_or_else(|s| panic!("unary call failed: {s:?}"));
    assert_eq!(
        resp.metadata().get("x-served-by").unwrap(),
        "pod-1",
        "response headers intact"
    );
    assert_eq!(
        resp.metadata().get("x-echo-caller").unwrap(),
        "frontend-test"
    );
    let reply = resp.into_inner();
    assert_eq!(reply.message, "hello mesh");
    assert_eq!(reply.served_by, "pod-1");
    assert_eq!(
        reply.xfcc, xfcc,
        "the server app sees the server proxy's XFCC"
    );

    // Unary, non-OK: status, message and custom metadata (a trailers-only answer).
    let req = tonic::Request::new(EchoRequest {
        message: "decline".into(),
        count: 0,
        fail_at_end: false,
    });
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let status = within(IO_TIMEOUT, "unary", g.unary(req, path(UNARY), codec()))
        .await
        .unwrap()
        .expect_err("the server declines");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(status.message(), "card declined: insufficient funds");
    assert_eq!(status.metadata().get("x-decline-code").unwrap(), "51");
    assert_eq!(
        status
            .metadata()
            .get_bin("x-detail-bin")
            .expect("binary metadata kept")
            .to_bytes()
            .unwrap()
            .as_ref(),
        &[0u8, 1, 2, 255]
    );

    // Server streaming, OK: every message in order, then grpc-status 0 in the trailers.
    let req = tonic::Request::new(EchoRequest {
        message: "tick".into(),
        count: 25,
        fail_at_end: false,
    });
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let resp = within(
        IO_TIMEOUT,
        "server streaming",
        g.server_streaming(req, path(STREAM), codec()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(resp.metadata().get("x-served-by").unwrap(), "pod-1");
    let mut stream = resp.into_inner();
    let mut got = Vec::new();
    while let Some(m) = within(IO_TIMEOUT, "stream message", stream.message())
        .await
        .unwrap()
        .unwrap_or_else(|s| panic!("stream failed: {s:?}"))
    {
        got.push(m);
    }
    assert_eq!(got.len(), 25);
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.seq, i as u32);
        assert_eq!(m.message, format!("tick#{i}"));
    }
    let trailers = within(IO_TIMEOUT, "trailers", stream.trailers())
        .await
        .unwrap()
        .unwrap();
    // The trailers arrived (grpc-status 0, or the stream would have ended in an error above).
    assert!(trailers.is_some(), "the OK stream's trailers were lost");

    // Server streaming ending in a non-OK status: real trailers after data.
    let req = tonic::Request::new(EchoRequest {
        message: "burst".into(),
        count: 3,
        fail_at_end: true,
    });
    within(IO_TIMEOUT, "ready", g.ready())
        .await
        .unwrap()
        .unwrap();
    let mut stream = within(
        IO_TIMEOUT,
        "server streaming",
        g.server_streaming(req, path(STREAM), codec()),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner();
    let mut n = 0;
    let status = loop {
        match within(IO_TIMEOUT, "stream message", stream.message())
            .await
            .unwrap()
        {
            Ok(Some(m)) => {
                assert_eq!(m.message, format!("burst#{n}"));
                n += 1;
            }
            Ok(None) => panic!("the stream ended OK; the server ended it with an error"),
            Err(s) => break s,
        }
    };
    assert_eq!(n, 3, "every message before the error arrived");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "quota exhausted");
    assert_eq!(
        status
            .metadata()
            .get("x-quota-left")
            .map(|v| v.to_str().unwrap()),
        Some("0"),
        "custom trailer kept: {:?}",
        status.metadata()
    );

    assert_eq!(
        server.calls.load(Ordering::SeqCst),
        4,
        "four calls reached the server"
    );
    let cs = clusters(&client).await;
    assert_eq!(
        cs.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        vec!["payments.aether.internal:9090"]
    );
}
