//! The timers of SPEC section 8 that end requests and tunnels, from the outside: the inbound
//! first-response-byte timeout (504 `upstream-timeout`), the stream idle timeout on a response
//! that stops moving (HTTP/1.1 and HTTP/2 clients), and the idle timeout of tcp chains.
//!
//! The proxy runs with the timers shrunk to a second (`AETHER_TEST_TIMERS`).

use std::convert::Infallible;
use std::time::{Duration, Instant};

use crate::common::inbound::*;
use crate::common::mesh::{FRONTEND, PAYMENTS, TD};
use crate::common::*;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TIMER: Duration = Duration::from_secs(1);
const TIMERS: &str = "first_byte=1s,stream_idle=1s,tunnel_idle=1s";

/// A payments sidecar: 8080 `auto` to an app that sends `hello` and then stalls its response
/// forever; 9090 `auto` to an app that honours `x-app-delay-ms`; 5432 `tcp` to an echo server.
struct Pod {
    net: PodNet,
    certs: Certs,
    proxy: Proxy,
    _stalling: tokio::task::JoinHandle<()>,
    _app: HttpApp,
    _echo: TcpEcho,
}

impl Pod {
    async fn start() -> Pod {
        let net = Net::fresh().pod(0);
        let certs = Certs::new(TD, &[PAYMENTS, FRONTEND]);
        let stalling = stalling_app(net.app(8080)).await;
        let app = HttpApp::auto(net.app(9090)).await;
        let echo = TcpEcho::start(net.app(5432)).await;
        let ports = [
            "{ port: 8080, protocol: auto }",
            "{ port: 9090, protocol: auto }",
            "{ port: 5432, protocol: tcp }",
        ];
        let proxy = payments_sidecar(&certs, net, &ports)
            .env("AETHER_TEST_TIMERS", TIMERS)
            .start()
            .await;
        Pod {
            net,
            certs,
            proxy,
            _stalling: stalling,
            _app: app,
            _echo: echo,
        }
    }

    async fn tls(&self, sni: &str, alpn: &[&str]) -> TlsStream {
        tls_to(&frontend_peer(&self.certs, sni, alpn), self.net.inbound()).await
    }
}

/// HTTP/1.1 and h2c: answers 200 with a body that sends `hello` and then nothing, ever.
async fn stalling_app(addr: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(|_req: Request<hyper::body::Incoming>| async {
                    let frames = futures_util::stream::iter([Ok::<_, Infallible>(Frame::data(
                        Bytes::from_static(b"hello"),
                    ))])
                    .chain(futures_util::stream::pending());
                    Ok::<_, Infallible>(Response::new(StreamBody::new(frames)))
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    })
}

use futures_util::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_that_does_not_answer_in_time_gets_504() {
    let pod = Pod::start().await;
    let mut c = HttpClient::h2(pod.tls("9090", &["h2"]).await)
        .await
        .unwrap();
    let start = Instant::now();
    let r = c
        .send(
            Request::get("http://payments/late")
                .header("x-app-delay-ms", "4000")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    let took = start.elapsed();
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{r:?}");
    assert_eq!(r.aether_error(), Some("upstream-timeout"), "{r:?}");
    assert!(
        took >= TIMER - Duration::from_millis(100),
        "answered after {took:?}"
    );
    assert!(
        took < TIMER + Duration::from_secs(2),
        "answered after {took:?}"
    );
    assert_eq!(
        cut_offs_at_least(&pod.proxy, "first_byte_timeout", 1).await,
        1
    );
    // An app that answers in time is not affected.
    let r = c.get("http://payments/quick").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_stops_moving_is_ended_http1() {
    let pod = Pod::start().await;
    let mut tls = pod.tls("8080", &["http/1.1"]).await;
    tls.write_all(b"GET /stall HTTP/1.1\r\nhost: payments\r\n\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    let (got, end) = read_to_end_within(&mut tls, TIMER * 6).await;
    let took = start.elapsed();
    let got = String::from_utf8_lossy(&got);
    assert_ne!(end, ReadEnd::TimedOut, "still open after {took:?}: {got}");
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("hello"), "{got}");
    assert!(
        took >= TIMER - Duration::from_millis(100),
        "ended after {took:?}"
    );
    assert!(took < TIMER * 4, "ended after {took:?}");
    assert!(cut_offs_at_least(&pod.proxy, "stream_idle", 1).await >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_stops_moving_is_ended_http2() {
    let pod = Pod::start().await;
    let mut c = HttpClient::h2(pod.tls("8080", &["h2"]).await)
        .await
        .unwrap();
    let start = Instant::now();
    let r = within(
        TIMER * 6,
        "stalled h2 stream",
        c.get("http://payments/stall"),
    )
    .await;
    let took = start.elapsed();
    let r = r.unwrap_or_else(|e| panic!("{e}"));
    assert!(r.is_err(), "a stalled stream must end with a reset: {r:?}");
    assert!(
        took >= TIMER - Duration::from_millis(100),
        "ended after {took:?}"
    );
    // The connection itself stays usable for other streams.
    let mut c2 = HttpClient::h2(pod.tls("9090", &["h2"]).await)
        .await
        .unwrap();
    assert_eq!(
        c2.get("http://payments/after").await.unwrap().status,
        StatusCode::OK
    );
    assert!(cut_offs_at_least(&pod.proxy, "stream_idle", 1).await >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_chain_closes_when_idle_and_bytes_keep_it_open() {
    let pod = Pod::start().await;
    let mut tls = pod.tls("5432", &[]).await;
    // Bytes every half timer for three timers: still open.
    let mut buf = [0u8; 1];
    for _ in 0..6 {
        tls.write_all(b"x").await.unwrap();
        within(IO_TIMEOUT, "echo", tls.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(TIMER / 2).await;
    }
    // Then silence: closed after about one timer.
    let start = Instant::now();
    let (_, end) = read_to_end_within(&mut tls, TIMER * 6).await;
    let took = start.elapsed();
    assert_ne!(end, ReadEnd::TimedOut, "still open after {took:?}");
    assert!(
        took >= TIMER / 2 - Duration::from_millis(100),
        "closed after {took:?}"
    );
    assert!(took < TIMER * 4, "closed after {took:?}");
    assert_eq!(cut_offs_at_least(&pod.proxy, "tunnel_idle", 1).await, 1);
}
