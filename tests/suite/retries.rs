//! Retries as Istio configures Envoy (SPEC section 11, section 1 for failed connects): a
//! request the upstream refused before processing it (h2 `REFUSED_STREAM`, a stream above a
//! GOAWAY's last-stream-id) goes to another endpoint; so does an idempotent request without a
//! body that was reset before any response byte; nothing goes again once response bytes may
//! have reached the client, and no request tries an endpoint twice.
//!
//! A real client proxy in front of a misbehaving server pod (`crate::common::mesh::rogue`: real mTLS,
//! HTTP/2 frames written by hand) and a real aether-proxy server pod with its app. The client
//! pod's locality puts the rogue pod first (same zone), so every request tries it first until
//! outlier detection ejects it (5 failures in a row; each test stays under that unless it says
//! otherwise).

use std::net::IpAddr;

use crate::common::mesh::rogue::{Misbehaviour, RoguePod};
use crate::common::mesh::*;
use crate::common::*;
use bytes::Bytes;
use http::Request;
use http_body_util::Full;

/// A catalog endpoint line with a locality.
fn endpoint_in(addr: IpAddr, zone: &str) -> String {
    format!("      - {{ address: \"{addr}\", ports: [8080], locality: {zone} }}\n")
}

/// The client pod's zone: rogue pods are in it, live pods in another region.
const HERE: &str = "r1/z1";
const ELSEWHERE: &str = "r2/z1";

struct Mesh {
    client: Proxy,
    rogues: Vec<RoguePod>,
    app: Option<HttpApp>,
    _live: Option<Proxy>,
    net: Net,
}

impl Mesh {
    /// The client pod, `rogues` misbehaving pods in its zone and, when `live`, one real pod
    /// (its proxy and app) elsewhere.
    async fn start(rogues: &[Misbehaviour], live: bool) -> Mesh {
        let net = Net::fresh();
        let certs = certs();
        let mut eps = Vec::new();
        let mut pods = Vec::new();
        for (i, how) in rogues.iter().enumerate() {
            let pod = net.pod(1 + i as u8);
            pods.push(RoguePod::start(&certs, pod.inbound(), *how).await);
            eps.push(endpoint_in(pod.proxy_ip(), HERE));
        }
        let (app, live_proxy) = if live {
            let pod = net.pod(8);
            let app = HttpApp::auto(pod.app(8080)).await;
            let p =
                server_proxy(&certs, pod, "payments", &["{ port: 8080, protocol: auto }"]).await;
            eps.push(endpoint_in(pod.proxy_ip(), ELSEWHERE));
            (Some(app), Some(p))
        } else {
            (None, None)
        };
        let cat = catalog(&[service("payments", &certs.spiffe_id(PAYMENTS), "", &eps)]);
        let client = client_proxy(&certs, net.pod(0), &cat, &format!("locality: {HERE}\n")).await;
        Mesh {
            client,
            rogues: pods,
            app,
            _live: live_proxy,
            net,
        }
    }

    fn out(&self) -> std::net::SocketAddr {
        self.net.pod(0).outbound()
    }

    /// Requests the live app got.
    fn live_paths(&self) -> Vec<String> {
        self.app.as_ref().map(paths).unwrap_or_default()
    }

    async fn retries(&self, reason: &str) -> f64 {
        metric(
            &self.client,
            "aether_retries_total",
            &[
                "direction=\"outbound\"",
                "service=\"payments\"",
                &format!("reason=\"{reason}\""),
            ],
        )
        .await
    }
}

fn request(method: &str, path: &str, body: &'static [u8]) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(path)
        .header("host", SVC)
        .body(Full::new(Bytes::from_static(body)))
        .unwrap()
}

async fn send_h1(m: &Mesh, req: Request<Full<Bytes>>) -> Result<Reply, String> {
    h1_to(m.out()).await.send(req).await
}

async fn send_h2(m: &Mesh, req: Request<Full<Bytes>>) -> Result<Reply, String> {
    h2_to(m.out()).await.send(req).await
}

// ---------------------------------------------------------------------------------------------
// Refused before processing: any method, as long as there is no body to send again
// ---------------------------------------------------------------------------------------------

/// `REFUSED_STREAM`: retried on the live pod for GET and for a body-less POST, over HTTP/1.1
/// and HTTP/2 from the app; the rogue pod saw each request exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_stream_is_retried_on_another_endpoint() {
    let m = Mesh::start(&[Misbehaviour::Refuse], true).await;
    let r = send_h1(&m, request("GET", "/refused/get", b""))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "GET refused by the first pod");
    let r = send_h2(&m, request("GET", "/refused/h2", b""))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "h2 GET refused by the first pod");
    let r = send_h1(&m, request("POST", "/refused/post", b""))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "body-less POST refused by the first pod");
    assert_eq!(
        m.live_paths(),
        ["/refused/get", "/refused/h2", "/refused/post"],
        "each request reached the live app once"
    );
    assert_eq!(m.rogues[0].requests(), 3, "one attempt per request");
    assert_eq!(m.retries("refused").await, 3.0);
}

/// A stream above the last-stream-id of the pod's GOAWAY was never processed: retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_above_a_goaway_is_retried() {
    let m = Mesh::start(&[Misbehaviour::GoAwayBelow], true).await;
    for path in ["/goaway/1", "/goaway/2"] {
        let r = send_h1(&m, request("GET", path, b"")).await.unwrap();
        assert_app_ok(&r, 8080, path);
    }
    assert_eq!(m.live_paths(), ["/goaway/1", "/goaway/2"]);
    assert_eq!(m.rogues[0].requests(), 2);
    assert_eq!(m.retries("refused").await, 2.0);
}

/// A refused request whose body was handed to the upstream connection is not sent again (the
/// body cannot be replayed): 503 `upstream-connect-failure`, as for a failed connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_with_a_body_is_not_sent_again() {
    let m = Mesh::start(&[Misbehaviour::Refuse], true).await;
    let r = send_h1(&m, request("PUT", "/refused/put", b"some body"))
        .await
        .unwrap();
    assert_proxy_error(
        &r,
        503,
        "upstream-connect-failure",
        "refused PUT with a body",
    );
    assert!(m.live_paths().is_empty(), "{:?}", m.live_paths());
    assert_eq!(m.rogues[0].requests(), 1);
}

// ---------------------------------------------------------------------------------------------
// Reset before any response byte: idempotent and body-less only
// ---------------------------------------------------------------------------------------------

/// `RST_STREAM(INTERNAL_ERROR)` before the response: GET, HEAD and DELETE go to the live pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_request_reset_before_its_response_is_retried() {
    let m = Mesh::start(&[Misbehaviour::ResetBeforeResponse], true).await;
    for (method, path) in [
        ("GET", "/reset/get"),
        ("HEAD", "/reset/head"),
        ("DELETE", "/reset/delete"),
    ] {
        let r = send_h1(&m, request(method, path, b"")).await.unwrap();
        assert_eq!(r.status, 200, "{method}: {r:?}");
        assert_eq!(r.header("x-app-port"), Some("8080"), "{method}: {r:?}");
    }
    assert_eq!(
        m.live_paths(),
        ["/reset/get", "/reset/head", "/reset/delete"]
    );
    assert_eq!(m.rogues[0].requests(), 3);
    assert_eq!(m.retries("reset").await, 3.0);
}

/// The pod's connection closes under the request, before any response byte: a GET is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_whose_connection_closes_before_the_response_is_retried() {
    let m = Mesh::start(&[Misbehaviour::CloseBeforeResponse], true).await;
    let r = send_h1(&m, request("GET", "/closed/get", b""))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "GET on a connection that closed");
    assert_eq!(m.live_paths(), ["/closed/get"]);
    assert_eq!(m.rogues[0].requests(), 1);
    assert_eq!(m.retries("reset").await, 1.0);
}

/// The same over HTTP/1.1 to the pod (its chain chose `http/1.1`): the connection closes once
/// the request head arrived. A GET goes to the live pod; a POST with a body gets 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_connection_closed_under_the_request_retries_only_the_get() {
    let m = Mesh::start(&[Misbehaviour::H1CloseBeforeResponse], true).await;
    let r = send_h1(&m, request("GET", "/h1-closed/get", b""))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "GET on an HTTP/1.1 connection that closed");
    let r = send_h1(&m, request("POST", "/h1-closed/post", b"order=1"))
        .await
        .unwrap();
    assert_proxy_error(
        &r,
        502,
        "upstream-protocol-error",
        "POST with a body, closed",
    );
    assert_eq!(m.live_paths(), ["/h1-closed/get"]);
    assert_eq!(m.rogues[0].requests(), 2);
    assert_eq!(m.retries("reset").await, 1.0);
}

/// A POST with a body, and a body-less POST (not idempotent), reset before the response: not
/// sent again; the client gets 502 `upstream-protocol-error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_idempotent_or_bodied_request_reset_before_its_response_is_not_retried() {
    let m = Mesh::start(&[Misbehaviour::ResetBeforeResponse], true).await;
    let r = send_h1(&m, request("POST", "/reset/post-body", b"order=1"))
        .await
        .unwrap();
    assert_proxy_error(
        &r,
        502,
        "upstream-protocol-error",
        "POST with a body, reset",
    );
    let r = send_h1(&m, request("POST", "/reset/post", b""))
        .await
        .unwrap();
    assert_proxy_error(&r, 502, "upstream-protocol-error", "body-less POST, reset");
    let r = send_h1(&m, request("PUT", "/reset/put-body", b"x"))
        .await
        .unwrap();
    assert_proxy_error(&r, 502, "upstream-protocol-error", "PUT with a body, reset");
    assert!(m.live_paths().is_empty(), "{:?}", m.live_paths());
    assert_eq!(m.rogues[0].requests(), 3);
    assert_eq!(m.retries("reset").await, 0.0);
}

// ---------------------------------------------------------------------------------------------
// Never after response bytes
// ---------------------------------------------------------------------------------------------

/// A reset after the response head and some body bytes: the client sees the 200 and then the
/// broken body; the request never goes to the live pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_after_the_response_head_is_not_retried() {
    let m = Mesh::start(&[Misbehaviour::ResetAfterHead], true).await;
    for h2 in [false, true] {
        let req = request("GET", "/late-reset", b"");
        let r = if h2 {
            send_h2(&m, req).await
        } else {
            send_h1(&m, req).await
        };
        let e = r.expect_err("the response body must end with an error");
        assert!(e.contains("response body"), "{e}");
    }
    assert!(m.live_paths().is_empty(), "{:?}", m.live_paths());
    assert_eq!(m.rogues[0].requests(), 2);
    assert_eq!(m.retries("reset").await + m.retries("refused").await, 0.0);
}

// ---------------------------------------------------------------------------------------------
// No endpoint twice
// ---------------------------------------------------------------------------------------------

/// Only refusing pods: each is tried once, then the answer names the failure. With one pod,
/// one attempt (Istio's previous_hosts would try it again; we never do).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_refusing_endpoints_are_each_tried_once() {
    let m = Mesh::start(&[Misbehaviour::Refuse, Misbehaviour::Refuse], false).await;
    let r = send_h1(&m, request("GET", "/nowhere", b"")).await.unwrap();
    assert_proxy_error(&r, 503, "upstream-connect-failure", "two refusing pods");
    assert_eq!(m.rogues[0].requests(), 1);
    assert_eq!(m.rogues[1].requests(), 1);

    let m = Mesh::start(&[Misbehaviour::Refuse], false).await;
    let r = send_h1(&m, request("GET", "/alone", b"")).await.unwrap();
    assert_proxy_error(&r, 503, "upstream-connect-failure", "one refusing pod");
    assert_eq!(m.rogues[0].requests(), 1);

    let m = Mesh::start(&[Misbehaviour::ResetBeforeResponse; 3], false).await;
    let r = send_h1(&m, request("GET", "/resets", b"")).await.unwrap();
    assert_proxy_error(&r, 502, "upstream-protocol-error", "three resetting pods");
    for (i, rogue) in m.rogues.iter().enumerate() {
        assert_eq!(rogue.requests(), 1, "pod {i}");
    }
    assert_eq!(m.retries("reset").await, 2.0, "MAX_RETRIES");
}

/// A pooled connection that dies under its next request: that request goes to another pod,
/// not to a fresh connection to the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_that_died_does_not_bring_the_request_back_to_its_pod() {
    let m = Mesh::start(&[Misbehaviour::ServeOnceThenClose], true).await;
    let r = send_h1(&m, request("GET", "/pooled/1", b"")).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.header("x-app-port"),
        None,
        "the first request is the rogue pod's: {r:?}"
    );
    let r = send_h1(&m, request("GET", "/pooled/2", b"")).await.unwrap();
    assert_app_ok(&r, 8080, "the request whose pooled connection died");
    assert_eq!(m.live_paths(), ["/pooled/2"]);
    assert_eq!(m.rogues[0].requests(), 2);
    assert_eq!(
        m.rogues[0].connections(),
        1,
        "no second connection to the same pod"
    );
}

// ---------------------------------------------------------------------------------------------
// A server sidecar whose app is down
// ---------------------------------------------------------------------------------------------

/// The client pod, a `payments` pod in its zone whose port 8080 is served by `first_app` (or by
/// nothing), and a live pod elsewhere; returned with the first pod's sidecar.
async fn with_first_pod(first_app: Option<fn(std::net::SocketAddr)>) -> (Mesh, Proxy) {
    let net = Net::fresh();
    let certs = certs();
    let ports = ["{ port: 8080, protocol: auto }"];
    let first = net.pod(1);
    if let Some(start) = first_app {
        start(first.app(8080));
    }
    let first_proxy = server_proxy(&certs, first, "payments", &ports).await;
    let live = net.pod(8);
    let app = HttpApp::auto(live.app(8080)).await;
    let live_proxy = server_proxy(&certs, live, "payments", &ports).await;
    let eps = [
        endpoint_in(first.proxy_ip(), HERE),
        endpoint_in(live.proxy_ip(), ELSEWHERE),
    ];
    let cat = catalog(&[service("payments", &certs.spiffe_id(PAYMENTS), "", &eps)]);
    let client = client_proxy(&certs, net.pod(0), &cat, &format!("locality: {HERE}\n")).await;
    let m = Mesh {
        client,
        rogues: Vec::new(),
        app: Some(app),
        _live: Some(live_proxy),
        net,
    };
    (m, first_proxy)
}

/// A pod whose app is down answers 503 `app-unavailable`: no app saw the request, so the client
/// sidecar sends it to another pod as it does a refused stream (any method, no body). A request
/// with a body cannot go again: the pod's 503 comes back as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_app_is_down_sends_the_request_elsewhere() {
    let (m, _down) = with_first_pod(None).await;
    let r = send_h1(&m, request("GET", "/down/get", b"")).await.unwrap();
    assert_app_ok(&r, 8080, "GET to a pod whose app is down");
    let r = send_h2(&m, request("POST", "/down/post", b""))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "body-less POST to a pod whose app is down");
    let r = send_h1(&m, request("PUT", "/down/put", b"a body"))
        .await
        .unwrap();
    assert_proxy_error(&r, 503, "app-unavailable", "a request with a body");
    assert_eq!(m.live_paths(), ["/down/get", "/down/post"]);
    assert_eq!(m.retries("refused").await, 2.0);
}

/// An app cannot make clients send its requests elsewhere by answering as a sidecar would: the
/// inbound removes `x-aether-error` from the app's 503, and the client sidecar passes it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_cannot_pass_for_a_sidecar_whose_app_is_down() {
    fn forging_app(addr: std::net::SocketAddr) {
        let listener = std::net::TcpListener::bind(addr).unwrap();
        listener.set_nonblocking(true).unwrap();
        tokio::spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((mut tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    if read_http_head(&mut tcp, &mut Vec::new()).await.is_none() {
                        return;
                    }
                    let answer = b"HTTP/1.1 503 Service Unavailable\r\n\
                        x-aether-error: app-unavailable\r\ncontent-length: 6\r\n\r\nforged";
                    let _ = tcp.write_all(answer).await;
                });
            }
        });
    }
    let (m, _forging) = with_first_pod(Some(forging_app)).await;
    let r = send_h1(&m, request("POST", "/forged", b"")).await.unwrap();
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.aether_error(), None, "{r:?}");
    assert_eq!(r.text(), "forged");
    assert!(m.live_paths().is_empty(), "{:?}", m.live_paths());
    assert_eq!(m.retries("refused").await, 0.0);
}

/// An h2 app that refuses its streams (`REFUSED_STREAM`, as a server going away does with
/// streams it will not process) makes its sidecar answer 503 `app-unavailable`, so the request
/// goes to another pod as for an app that is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_app_refused_goes_to_another_pod() {
    fn refusing_h2_app(addr: std::net::SocketAddr) {
        let listener = std::net::TcpListener::bind(addr).unwrap();
        listener.set_nonblocking(true).unwrap();
        tokio::spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(mut conn) = h2::server::handshake(tcp).await else {
                        return;
                    };
                    while let Some(Ok((_req, mut respond))) = conn.accept().await {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                    }
                });
            }
        });
    }
    let (m, _refusing) = with_first_pod(Some(refusing_h2_app)).await;
    for path in ["/refused-by-app/get", "/refused-by-app/again"] {
        let r = send_h2(&m, request("GET", path, b"")).await.unwrap();
        assert_app_ok(&r, 8080, path);
    }
    let r = send_h2(&m, request("PUT", "/refused-by-app/put", b"a body"))
        .await
        .unwrap();
    assert_proxy_error(&r, 503, "app-unavailable", "a request with a body");
    assert_eq!(
        m.live_paths(),
        ["/refused-by-app/get", "/refused-by-app/again"]
    );
    assert_eq!(m.retries("refused").await, 2.0);
}
