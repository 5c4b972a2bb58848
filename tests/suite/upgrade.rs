//! SPEC section 11: HTTP/1.1 `Upgrade` crosses the mesh. A client pod's app upgrades through
//! its sidecar (plaintext), the sidecar carries the request to the payments pod's sidecar over
//! an HTTP/1.1 mTLS connection, and that one forwards it to the app; after the app's `101`
//! bytes flow both ways. Real WebSocket clients and servers (tokio-tungstenite) for WebSocket,
//! raw sockets for a custom token, half-close and the idle timeout.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::mesh::rogue::{Misbehaviour, RoguePod, SeenH1};
use crate::common::mesh::*;
use crate::common::*;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

/// The payments pod's ports: 8080 `auto` to an ordinary HTTP app (it answers 200 to anything,
/// upgrade requests included); 9001 `http1` and 9002 `auto` to WebSocket echo servers; 9003
/// `http1` to a raw app that switches to the token `x-echo`; 9090 `h2` to an h2c app.
const PORTS: [u16; 5] = [8080, 9001, 9002, 9003, 9090];

struct Mesh {
    client: Proxy,
    server: Proxy,
    app: HttpApp,
    h2_app: HttpApp,
    raw: RawApp,
    _ws: [tokio::task::JoinHandle<()>; 2],
    _certs: Certs,
    client_pod: PodNet,
}

impl Mesh {
    async fn start() -> Mesh {
        Mesh::start_with_timers("").await
    }

    /// With `AETHER_TEST_TIMERS=timers` on both sidecars when not empty.
    async fn start_with_timers(timers: &str) -> Mesh {
        let net = Net::fresh();
        let (client_pod, server_pod) = (net.pod(0), net.pod(1));
        let certs = certs();
        let app = HttpApp::auto(server_pod.app(8080)).await;
        let ws = [
            ws_echo(server_pod.app(9001)).await,
            ws_echo(server_pod.app(9002)).await,
        ];
        let raw = RawApp::start(server_pod.app(9003)).await;
        let h2_app = HttpApp::h2c(server_pod.app(9090)).await;
        let ports = [
            "{ port: 8080, protocol: auto }",
            "{ port: 9001, protocol: http1 }",
            "{ port: 9002, protocol: auto }",
            "{ port: 9003, protocol: http1, upgrades: [websocket, x-echo] }",
            "{ port: 9090, protocol: h2 }",
        ];
        let config = format!(
            "trust_domain: {TD}\n{}{}",
            certs.identity_yaml("payments"),
            server_pod.listeners_yaml(8080, &ports)
        );
        let mut server = Proxy::builder(&config, "services: {}\n");
        let cat = catalog(&[service(
            "payments",
            &certs.spiffe_id(PAYMENTS),
            "",
            &[endpoint(server_pod.proxy_ip(), &PORTS)],
        )]);
        let mut client = client_proxy_builder(&certs, client_pod, &cat, "");
        if !timers.is_empty() {
            server = server.env("AETHER_TEST_TIMERS", timers);
            client = client.env("AETHER_TEST_TIMERS", timers);
        }
        let server = server.start().await;
        let client = client.start().await;
        Mesh {
            client,
            server,
            app,
            h2_app,
            raw,
            _ws: ws,
            _certs: certs,
            client_pod,
        }
    }

    fn outbound(&self) -> SocketAddr {
        self.client_pod.outbound()
    }

    /// A WebSocket client through the client pod's sidecar to `port` of payments.
    async fn websocket(
        &self,
        port: u16,
    ) -> tokio_tungstenite::WebSocketStream<tokio::net::TcpStream> {
        let tcp = tcp_connect(self.outbound()).await.unwrap();
        let url = format!("ws://{SVC}:{port}/chat");
        let (ws, resp) = within(IO_TIMEOUT, "websocket handshake", async {
            tokio_tungstenite::client_async(url.as_str(), tcp).await
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("websocket handshake through the mesh to {port}: {e}"));
        assert_eq!(resp.status(), 101);
        ws
    }

    /// Writes an upgrade request for `port` asking for `token`, and reads the answer's head.
    async fn raw_upgrade(&self, port: u16, token: &str) -> (TcpStream, RawHead) {
        let mut s = tcp_connect(self.outbound()).await.unwrap();
        let req = format!(
            "GET /up HTTP/1.1\r\nHost: {SVC}:{port}\r\nConnection: Upgrade\r\nUpgrade: {token}\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let head = read_head(&mut s).await.unwrap();
        (s, head)
    }
}

/// A WebSocket echo server: text and binary messages come back as they are; pings are answered
/// and closes completed by tungstenite itself.
async fn ws_echo(addr: SocketAddr) -> tokio::task::JoinHandle<()> {
    let listener = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(tcp).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    if (msg.is_text() || msg.is_binary()) && ws.send(msg).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

/// A raw HTTP/1.1 app: to `Upgrade: x-echo` it answers 101, echoes every byte, and once the
/// client's side ends (EOF) sends `bye after <n> bytes` and closes; any other request gets 403.
/// It records each request head.
struct RawApp {
    heads: Arc<Mutex<Vec<String>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl RawApp {
    async fn start(addr: SocketAddr) -> RawApp {
        let listener = TcpListener::bind(addr).await.unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let _ = raw_app_conn(tcp, seen).await;
                });
            }
        });
        RawApp { heads, _task: task }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

async fn raw_app_conn(mut tcp: TcpStream, seen: Arc<Mutex<Vec<String>>>) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tcp.read(&mut b).await? == 0 {
            return Ok(());
        }
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    seen.lock().unwrap().push(head.clone());
    if !head.contains("\r\nupgrade: x-echo\r\n") {
        let no = "HTTP/1.1 403 Forbidden\r\ncontent-length: 11\r\nx-app: raw\r\n\r\nnot for you";
        return tcp.write_all(no.as_bytes()).await;
    }
    tcp.write_all(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x-echo\r\n\r\n",
    )
    .await?;
    let mut n = 0;
    let mut buf = [0u8; 4096];
    loop {
        let k = tcp.read(&mut buf).await?;
        if k == 0 {
            break;
        }
        n += k;
        tcp.write_all(&buf[..k]).await?;
    }
    // The client is done sending; this side still has something to say.
    tokio::time::sleep(Duration::from_millis(100)).await;
    tcp.write_all(format!("bye after {n} bytes").as_bytes())
        .await?;
    tcp.shutdown().await
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_messages_cross_the_mesh_on_http1_and_auto_ports() {
    let m = Mesh::start().await;
    for port in [9001, 9002] {
        let mut ws = m.websocket(port).await;
        let what = |w: &str| format!("port {port}: {w}");

        ws.send(Message::text("hello over the mesh")).await.unwrap();
        let got = within(IO_TIMEOUT, "text echo", ws.next()).await.unwrap();
        assert_eq!(
            got.unwrap().unwrap(),
            Message::text("hello over the mesh"),
            "{}",
            what("text")
        );

        let bin: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        ws.send(Message::binary(bin.clone())).await.unwrap();
        let got = within(IO_TIMEOUT, "binary echo", ws.next()).await.unwrap();
        assert_eq!(
            got.unwrap().unwrap(),
            Message::binary(bin),
            "{}",
            what("binary")
        );

        ws.send(Message::Ping(b"are you there".to_vec().into()))
            .await
            .unwrap();
        let got = within(IO_TIMEOUT, "pong", ws.next()).await.unwrap();
        assert_eq!(
            got.unwrap().unwrap(),
            Message::Pong(b"are you there".to_vec().into()),
            "{}",
            what("ping")
        );

        // 10 MiB in one message, both ways.
        let big: Vec<u8> = (0..10 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let t = Instant::now();
        ws.send(Message::binary(big.clone())).await.unwrap();
        let got = within(Duration::from_secs(60), "10 MiB echo", ws.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        eprintln!("port {port}: 10 MiB message echoed in {:?}", t.elapsed());
        assert!(got.is_binary(), "{}", what("10 MiB kind"));
        assert_eq!(got.len(), big.len(), "{}", what("10 MiB length"));
        assert!(got.into_data() == big, "{}", what("10 MiB content"));

        // The close handshake: our close comes back, then the stream ends.
        ws.close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "done".into(),
        }))
        .await
        .unwrap();
        let got = within(IO_TIMEOUT, "close echo", ws.next()).await.unwrap();
        match got {
            Some(Ok(Message::Close(Some(f)))) => {
                assert_eq!(f.code, CloseCode::Normal, "{}", what("close code"))
            }
            other => panic!(
                "{}: expected the server's close, got {other:?}",
                what("close")
            ),
        }
        let end = within(IO_TIMEOUT, "end after close", ws.next())
            .await
            .unwrap();
        assert!(
            end.is_none(),
            "{}: the stream must end after the close: {end:?}",
            what("end")
        );
    }
    // Each upgrade has a line in the client's access log, with its status.
    for port in [9001, 9002] {
        let authority = format!("{SVC}:{port}");
        m.client
            .wait_access_log(LOG_TIMEOUT, |e| {
                e["status"] == 101 && e["authority"] == authority.as_str()
            })
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_websockets_at_once() {
    let m = Arc::new(Mesh::start().await);
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..100 {
        let m = m.clone();
        tasks.spawn(async move {
            let mut ws = m.websocket(9002).await;
            for k in 0..3 {
                let text = format!("socket {i} message {k}");
                ws.send(Message::text(text.clone())).await.unwrap();
                let got = within(IO_TIMEOUT, "echo", ws.next()).await.unwrap();
                assert_eq!(got.unwrap().unwrap(), Message::text(text));
            }
            ws.close(None).await.unwrap();
            while let Some(Ok(_)) = within(IO_TIMEOUT, "close", ws.next()).await.unwrap() {}
        });
    }
    let mut done = 0;
    while let Some(r) = tasks.join_next().await {
        r.expect("a websocket task failed");
        done += 1;
    }
    assert_eq!(done, 100);
    eprintln!(
        "100 concurrent websockets, 3 echoes each: {:?}",
        t.elapsed()
    );
}

/// An app that does not switch answers like any request; the request did carry the upgrade
/// headers to it, and the connection goes on as HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upgrade_is_an_ordinary_response() {
    let m = Mesh::start().await;
    // The ordinary app answers 200.
    let (mut s, head) = m.raw_upgrade(8080, "websocket").await;
    let body = read_body(&mut s, &head).await;
    assert_eq!(head.status, 200, "{:?}", String::from_utf8_lossy(&body));
    assert_eq!(head.header("x-app-port"), Some("8080"));
    assert_eq!(head.header("x-aether-error"), None);
    assert_eq!(head.header("upgrade"), None, "a 200 carries no Upgrade");
    let seen = m.app.seen();
    let seen = seen
        .iter()
        .find(|r| r.uri.ends_with("/up"))
        .expect("the app saw it");
    assert_eq!(seen.header("upgrade"), Some("websocket"), "{seen:?}");
    // The same connection carries the next request.
    s.write_all(format!("GET /after HTTP/1.1\r\nHost: {SVC}:8080\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut s).await.unwrap();
    read_body(&mut s, &head).await;
    assert_eq!(head.status, 200);
    assert!(m.app.seen().iter().any(|r| r.uri.ends_with("/after")));

    // The raw app refuses a token it does not know with 403.
    let (mut s, head) = m.raw_upgrade(9003, "websocket").await;
    let body = read_body(&mut s, &head).await;
    assert_eq!(head.status, 403);
    assert_eq!(head.header("x-app"), Some("raw"));
    assert_eq!(body, b"not for you");
    // A WebSocket client sees the refusal as a failed handshake, not a hang.
    let tcp = tcp_connect(m.outbound()).await.unwrap();
    let url = format!("ws://{SVC}:8080/ws");
    let r = within(IO_TIMEOUT, "refused handshake", async {
        tokio_tungstenite::client_async(url.as_str(), tcp).await
    })
    .await
    .unwrap();
    match r {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 200),
        other => panic!("expected an HTTP refusal, got {:?}", other.map(|(_, r)| r)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_for_an_h2_only_port_is_400() {
    let m = Mesh::start().await;
    let (mut s, head) = m.raw_upgrade(9090, "websocket").await;
    let body = String::from_utf8_lossy(&read_body(&mut s, &head).await).into_owned();
    assert_raw_proxy_error(
        &head,
        &body,
        400,
        "upgrade-not-supported",
        "upgrade to h2 port",
    );
    assert!(m.h2_app.seen().is_empty(), "the h2 app must not see it");
    // An ordinary request to the same port works.
    let r = get_h1(m.outbound(), &format!("{SVC}:9090"), "/plain").await;
    assert_app_ok(&r, 9090, "plain request to the h2 port");
}

/// Half-close: the client ends its side, the app still answers, and the client gets it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_crosses_an_upgraded_connection() {
    let m = Mesh::start().await;
    let (mut s, head) = m.raw_upgrade(9003, "x-echo").await;
    assert_eq!(head.status, 101);
    assert_eq!(head.header("upgrade"), Some("x-echo"));
    assert!(head
        .header("connection")
        .is_some_and(|v| v.eq_ignore_ascii_case("upgrade")));
    // What the app received: the upgrade headers, and the server sidecar's XFCC.
    let heads = m.raw.heads();
    let h = heads.last().expect("the app saw the request");
    assert!(h.contains("\r\nupgrade: x-echo\r\n"), "{h}");
    assert!(h.contains("\r\nconnection: upgrade\r\n"), "{h}");
    assert!(h.contains("\r\nx-forwarded-client-cert: by="), "{h}");

    s.write_all(b"hello").await.unwrap();
    let mut echo = [0u8; 5];
    within(IO_TIMEOUT, "echo", s.read_exact(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echo, b"hello");
    s.write_all(b", world").await.unwrap();
    s.shutdown().await.unwrap();
    let mut rest = Vec::new();
    within(IO_TIMEOUT, "after half-close", s.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&rest), ", worldbye after 12 bytes");

    // Each side leaves one line when the upgraded connection closes (SPEC section 12): payload
    // bytes each way, and both sides finished.
    let upgraded = |v: &serde_json::Value| v["protocol"] == "upgrade";
    let client = m.client.wait_access_log(IO_TIMEOUT, upgraded).await;
    let server = m.server.wait_access_log(IO_TIMEOUT, upgraded).await;
    for (line, direction) in [(&client, "outbound"), (&server, "inbound")] {
        assert_eq!(line["direction"], direction, "{line}");
        assert_eq!(line["bytes_received"], 12, "{line}");
        assert_eq!(line["bytes_sent"], 5 + 7 + 18, "{line}");
        assert_eq!(line["end_reason"], "eof", "{line}");
        assert!(line["duration_ms"].as_f64().unwrap() > 0.0, "{line}");
    }
    assert_eq!(client["authority"], format!("{SVC}:9003"));
    assert_eq!(client["peer_identity"], m._certs.spiffe_id(PAYMENTS));
    assert_eq!(server["peer_identity"], m._certs.spiffe_id(FRONTEND));
    assert_eq!(
        client["request_id"], server["request_id"],
        "one request id on both sides"
    );
    assert!(client["request_id"].as_str().is_some_and(|s| !s.is_empty()));
}

/// The tcp idle timeout ends an upgraded connection that moves no bytes; bytes either way keep
/// it open, and the HTTP stream idle timer (shorter here) does not apply to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idle_timeout_closes_an_idle_upgraded_connection() {
    let m = Mesh::start_with_timers("tunnel_idle=1s,stream_idle=300ms").await;
    let (mut s, head) = m.raw_upgrade(9003, "x-echo").await;
    assert_eq!(head.status, 101);
    let mut buf = [0u8; 4];
    for _ in 0..3 {
        // Longer than the stream idle timer, shorter than the tunnel's.
        tokio::time::sleep(Duration::from_millis(600)).await;
        s.write_all(b"ping").await.unwrap();
        within(IO_TIMEOUT, "echo", s.read_exact(&mut buf))
            .await
            .unwrap()
            .expect("still open while bytes move");
        assert_eq!(&buf, b"ping");
    }
    let quiet = Instant::now();
    let mut rest = Vec::new();
    // The cut: EOF or a reset, either way the read ends.
    let _ = within(IO_TIMEOUT, "idle cut", s.read_to_end(&mut rest))
        .await
        .expect("an idle upgraded connection must be closed");
    let took = quiet.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "closed after {took:?} of silence, want about 1 s"
    );
    let cut = metric(
        &m.client,
        "aether_http_protocol_errors_total",
        &["reason=\"tunnel_idle\""],
    )
    .await
        + metric(
            &m.server,
            "aether_http_protocol_errors_total",
            &["reason=\"tunnel_idle\""],
        )
        .await;
    assert!(cut >= 1.0, "the idle cut is counted");
    let stream_cut = metric(
        &m.client,
        "aether_http_protocol_errors_total",
        &["reason=\"stream_idle\""],
    )
    .await;
    assert_eq!(
        stream_cut, 0.0,
        "the stream idle timer must not cut a tunnel"
    );
    // The side whose timer fired says so in its line; the other saw its peer go.
    let upgraded = |v: &serde_json::Value| v["protocol"] == "upgrade";
    let client = m.client.wait_access_log(IO_TIMEOUT, upgraded).await;
    let server = m.server.wait_access_log(IO_TIMEOUT, upgraded).await;
    let reasons = [&client["end_reason"], &server["end_reason"]];
    assert!(
        reasons.contains(&&serde_json::json!("idle-timeout")),
        "{client}\n{server}"
    );
    assert_eq!(client["bytes_received"], 12, "{client}");
    assert_eq!(client["bytes_sent"], 12, "{client}");
}

/// A real Envoy 1.40 as the client pod (fed by the test control plane, `upgrade_configs:
/// [websocket]` on its listener), an aether-proxy server pod: the same WebSocket exchange.
async fn websocket_from_an_envoy_client_pod_to_an_aether_server_pod(
    server: crate::common::xds::Server,
) {
    use crate::common::envoy::{envoy_bin, Bootstrap, Envoy};
    use crate::common::xds::{cp_addr, ControlPlane, Endpoint, Fixture, Listen, Service};

    let (envoy_path, envoy_version) = envoy_bin();
    let net = Net::fresh();
    let certs = certs();
    let (envoy_pod, server_pod) = (net.pod(5), net.pod(1));
    let _ws = ws_echo(server_pod.app(9002)).await;
    let _server = server_proxy(
        &certs,
        server_pod,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 9002, protocol: auto }",
        ],
    )
    .await;
    let fx = Fixture::new()
        .identity(&certs, "frontend")
        .with_default_port_aliases()
        .service(
            "payments",
            Service::new(&certs.spiffe_id(PAYMENTS))
                .endpoint(Endpoint::new(server_pod.proxy_ip(), &[9002])),
        );
    let _cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fx).await;
    let node_id = format!("sidecar~{}~frontend-envoy.default", envoy_pod.proxy_ip());
    let envoy = Envoy::start(
        &envoy_path,
        &envoy_version,
        &Bootstrap {
            node_id: &node_id,
            node_cluster: "frontend",
            xds: cp_addr(&net),
            outbound: envoy_pod.outbound(),
            admin: envoy_pod.admin(),
            mesh_domain: "aether.internal",
            warm: &[("payments", 8080, &[9002])],
            odcds_timeout: Duration::from_secs(2),
            upgrades: &["websocket"],
        },
    )
    .await;

    let tcp = tcp_connect(envoy_pod.outbound()).await.unwrap();
    let url = format!("ws://{SVC}:9002/chat");
    let (mut ws, resp) = within(IO_TIMEOUT, "websocket handshake via Envoy", async {
        tokio_tungstenite::client_async(url.as_str(), tcp).await
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("websocket via Envoy: {e}; Envoy log:\n{}", envoy.log()));
    assert_eq!(resp.status(), 101);
    ws.send(Message::text("through envoy")).await.unwrap();
    let got = within(IO_TIMEOUT, "text echo", ws.next()).await.unwrap();
    assert_eq!(got.unwrap().unwrap(), Message::text("through envoy"));
    let big: Vec<u8> = (0..1024 * 1024).map(|i| (i % 253) as u8).collect();
    ws.send(Message::binary(big.clone())).await.unwrap();
    let got = within(IO_TIMEOUT, "1 MiB echo", ws.next()).await.unwrap();
    assert!(got.unwrap().unwrap().into_data() == big);
    ws.send(Message::Ping(b"p".to_vec().into())).await.unwrap();
    let got = within(IO_TIMEOUT, "pong", ws.next()).await.unwrap();
    assert_eq!(got.unwrap().unwrap(), Message::Pong(b"p".to_vec().into()));
    ws.close(None).await.unwrap();
    let got = within(IO_TIMEOUT, "close", ws.next()).await.unwrap();
    assert!(
        matches!(got, Some(Ok(Message::Close(_)))),
        "the close comes back: {got:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// h2c is never a tunnel
// ---------------------------------------------------------------------------------------------

/// An h2c upgrade request (RFC 7540's, deprecated by RFC 9113), then a second request on the
/// same connection carrying a forged XFCC.
const H2C_UPGRADE: &str = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n\
                           HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n";
const FORGED_XFCC: &str = "By=forged;URI=spiffe://aether.local/ns/default/sa/admin";

/// A raw HTTP/1.1 app that answers every request `101` to `h2c`, whatever it asked; it records
/// each request head and every byte that follows a `101`.
struct SwitchApp {
    seen: Arc<SeenH1>,
    _task: tokio::task::JoinHandle<()>,
}

impl SwitchApp {
    async fn start(addr: SocketAddr) -> SwitchApp {
        let listener = TcpListener::bind(addr).await.unwrap();
        let seen: Arc<SeenH1> = Arc::default();
        let all = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let seen = all.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let Some(end) = read_http_head(&mut tcp, &mut buf).await else {
                        return;
                    };
                    seen.heads
                        .lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase());
                    let switch = "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\n\
                                  upgrade: h2c\r\n\r\n";
                    if tcp.write_all(switch.as_bytes()).await.is_err() {
                        return;
                    }
                    seen.after_switch
                        .lock()
                        .unwrap()
                        .extend_from_slice(&buf[end..]);
                    let mut chunk = [0u8; 4096];
                    while let Ok(n) = tcp.read(&mut chunk).await {
                        if n == 0 {
                            break;
                        }
                        seen.after_switch
                            .lock()
                            .unwrap()
                            .extend_from_slice(&chunk[..n]);
                    }
                });
            }
        });
        SwitchApp { seen, _task: task }
    }

    fn heads(&self) -> Vec<String> {
        self.seen.heads.lock().unwrap().clone()
    }

    fn after(&self) -> Vec<u8> {
        self.seen.after_switch.lock().unwrap().clone()
    }
}

/// Sends the h2c upgrade request and the forged second request on `s`, one at a time; returns
/// both answers' heads. Each must be the proxy's own 502, in HTTP.
async fn h2c_then_forged<S>(s: &mut S, authority: &str) -> [RawHead; 2]
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let first = format!("GET /h2c HTTP/1.1\r\nHost: {authority}\r\n{H2C_UPGRADE}\r\n");
    let second = format!(
        "GET /next HTTP/1.1\r\nHost: {authority}\r\nx-forwarded-client-cert: {FORGED_XFCC}\r\n\
         content-length: 0\r\n\r\n"
    );
    let mut heads = Vec::new();
    for (what, req) in [("the h2c request", first), ("the request after it", second)] {
        s.write_all(req.as_bytes()).await.unwrap();
        let h = read_head(s).await.unwrap();
        assert_eq!(h.status, 502, "{what}: {h:?}");
        assert_eq!(
            h.header("x-aether-error"),
            Some("upstream-protocol-error"),
            "{what}"
        );
        assert_eq!(h.header("upgrade"), None, "{what}");
        let len: usize = h.header("content-length").unwrap().parse().unwrap();
        let mut body = vec![0u8; len];
        within(IO_TIMEOUT, "the 502's body", s.read_exact(&mut body))
            .await
            .unwrap()
            .unwrap();
        heads.push(h);
    }
    let b = heads.pop().unwrap();
    let a = heads.pop().unwrap();
    [a, b]
}

/// The server sidecar, attacked straight over mTLS as any mesh peer can: `Upgrade: h2c` and
/// `HTTP2-Settings` never reach the app; the app's `101` is 502, never a tunnel; the next
/// request on the connection is still HTTP, so its forged XFCC is replaced by the proxy's.
#[tokio::test]
async fn the_server_sidecar_never_tunnels_h2c() {
    let net = Net::fresh();
    let pod = net.pod(1);
    let certs = certs();
    let app = SwitchApp::start(pod.app(8086)).await;
    let _server = server_proxy(
        &certs,
        pod,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 8086, protocol: http1 }",
        ],
    )
    .await;
    let tls = TlsClient::with_identity(&certs, "frontend")
        .sni(Some("8086"))
        .alpn(&["http/1.1"]);
    let mut s = tls.connect(pod.inbound()).await.unwrap();
    h2c_then_forged(&mut s, &format!("{SVC}:8086")).await;
    let heads = app.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(!heads[0].contains("\r\nupgrade:"), "{}", heads[0]);
    assert!(!heads[0].contains("http2-settings"), "{}", heads[0]);
    assert!(!heads[1].contains("forged"), "{}", heads[1]);
    assert!(
        heads[1].contains(&certs.spiffe_id(FRONTEND)),
        "the proxy's XFCC: {}",
        heads[1]
    );
    assert!(
        app.after().is_empty(),
        "bytes reached the app raw after its 101"
    );
}

/// The client sidecar, with a peer on the mTLS hop that answers `101` to anything: the peer
/// never sees `Upgrade: h2c`; its `101` is 502; the client's next request is still parsed (the
/// proxy gives it a request id) and travels on a connection of its own, never raw after a 101.
#[tokio::test]
async fn the_client_sidecar_never_tunnels_h2c() {
    let net = Net::fresh();
    let certs = certs();
    let (client_pod, peer) = (net.pod(0), net.pod(1));
    let rogue = RoguePod::start(&certs, peer.inbound(), Misbehaviour::H1SwitchProtocols).await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(peer.proxy_ip(), &[8080])],
    )]);
    let _client = client_proxy(&certs, client_pod, &cat, "").await;
    let mut s = tcp_connect(client_pod.outbound()).await.unwrap();
    h2c_then_forged(&mut s, SVC).await;
    let heads: Vec<String> = rogue
        .heads()
        .iter()
        .map(|h| h.to_ascii_lowercase())
        .collect();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(!heads[0].contains("\r\nupgrade:"), "{}", heads[0]);
    assert!(!heads[0].contains("http2-settings"), "{}", heads[0]);
    assert!(heads[1].contains("\r\nx-request-id: "), "{}", heads[1]);
    assert!(heads[1].starts_with("get /next "), "{}", heads[1]);
    assert!(
        rogue.after_switch().is_empty(),
        "bytes crossed raw after the peer's 101: {:?}",
        String::from_utf8_lossy(&rogue.after_switch())
    );
}

crate::on_both_control_planes!(websocket_from_an_envoy_client_pod_to_an_aether_server_pod,);
