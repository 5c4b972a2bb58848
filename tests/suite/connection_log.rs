//! The access-log line a spliced connection leaves when it closes (SPEC section 12): CONNECT
//! tunnels on the client side, tcp chains on the server side, with payload bytes each way, the
//! duration, the peer identity and why it ended (`eof`, `reset`, `idle-timeout`, `drain`).
//! Upgraded connections are covered in `tests/upgrade.rs`.
//!
//! Real `aether-proxy run` processes on loopback, real mTLS between the pods.

use std::time::Duration;

use crate::common::mesh::*;
use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Mesh {
    client: Proxy,
    server: Proxy,
    echo: TcpEcho,
    certs: Certs,
    client_pod: PodNet,
    server_pod: PodNet,
}

/// A payments pod with a tcp echo app on 5432 and a client pod; `client_extra` ends the client
/// proxy's config, `timers` is its `AETHER_TEST_TIMERS` when not empty.
async fn mesh(client_extra: &str, timers: &str) -> Mesh {
    let net = Net::fresh();
    let (client_pod, server_pod) = (net.pod(0), net.pod(1));
    let certs = certs();
    let echo = TcpEcho::start(server_pod.app(5432)).await;
    let (server, cat) = payments_with_tcp_port(&certs, server_pod).await;
    let mut client = client_proxy_builder(&certs, client_pod, &cat, client_extra);
    if !timers.is_empty() {
        client = client.env("AETHER_TEST_TIMERS", timers);
    }
    Mesh {
        client: client.start().await,
        server,
        echo,
        certs,
        client_pod,
        server_pod,
    }
}

/// A CONNECT tunnel to payments:5432 through the client pod's sidecar.
async fn tunnel(m: &Mesh) -> tokio::net::TcpStream {
    let mut s = tcp_connect(m.client_pod.outbound()).await.unwrap();
    s.write_all(
        b"CONNECT payments.aether.internal:5432 HTTP/1.1\r\nHost: payments.aether.internal:5432\r\n\
          x-request-id: tunnel-1\r\n\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert_eq!(head.status, 200, "CONNECT answer: {:?}", head.headers);
    s
}

fn connect_line(v: &serde_json::Value) -> bool {
    v["protocol"] == "connect"
}

fn tcp_line(v: &serde_json::Value) -> bool {
    v["protocol"] == "tcp"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_and_its_tcp_chain_each_leave_one_line_at_close() {
    let m = mesh("", "").await;
    let mut s = tunnel(&m).await;
    let payload = vec![b'x'; 100_000];
    s.write_all(&payload).await.unwrap();
    let mut back = vec![0u8; payload.len()];
    within(IO_TIMEOUT, "echo", s.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    // Nothing is logged while the connection is open.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!m.client.access_log().iter().any(connect_line));
    assert!(!m.server.access_log().iter().any(tcp_line));

    s.shutdown().await.unwrap();
    let (rest, end) = read_to_end_within(&mut s, IO_TIMEOUT).await;
    assert_eq!((rest.as_slice(), end), (ECHO_EOF_MARKER, ReadEnd::Eof));
    let sent = (payload.len() + ECHO_EOF_MARKER.len()) as u64;

    let client = m.client.wait_access_log(IO_TIMEOUT, connect_line).await;
    assert_eq!(client["direction"], "outbound", "{client}");
    assert_eq!(client["authority"], "payments.aether.internal:5432");
    assert_eq!(
        client["upstream"],
        m.server_pod.inbound().to_string(),
        "{client}"
    );
    assert_eq!(client["peer_identity"], m.certs.spiffe_id(PAYMENTS));
    assert_eq!(client["request_id"], "tunnel-1");
    assert_eq!(client["bytes_received"], payload.len() as u64);
    assert_eq!(client["bytes_sent"], sent);
    assert_eq!(client["end_reason"], "eof");
    assert!(client["duration_ms"].as_f64().unwrap() >= 200.0, "{client}");
    assert!(client["time"].as_str().is_some_and(|t| t.ends_with('Z')));

    let server = m.server.wait_access_log(IO_TIMEOUT, tcp_line).await;
    assert_eq!(server["direction"], "inbound", "{server}");
    assert_eq!(server["upstream"], m.server_pod.app(5432).to_string());
    assert_eq!(server["peer_identity"], m.certs.spiffe_id(FRONTEND));
    assert_eq!(server["bytes_received"], payload.len() as u64);
    assert_eq!(server["bytes_sent"], sent);
    assert_eq!(server["end_reason"], "eof");
    assert_eq!(m.echo.connections(), 1);

    // One line each, not one per read or per direction.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        m.client
            .access_log()
            .iter()
            .filter(|v| connect_line(v))
            .count(),
        1
    );
    assert_eq!(
        m.server.access_log().iter().filter(|v| tcp_line(v)).count(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_reset_tunnels_say_why_they_ended() {
    let m = mesh("", "tunnel_idle=1s").await;

    // Nothing moves: the client side's timer ends it.
    let mut idle = tunnel(&m).await;
    let (_, _) = read_to_end_within(&mut idle, IO_TIMEOUT).await;
    let line = m.client.wait_access_log(IO_TIMEOUT, connect_line).await;
    assert_eq!(line["end_reason"], "idle-timeout", "{line}");
    assert_eq!(
        (line["bytes_received"].as_u64(), line["bytes_sent"].as_u64()),
        (Some(0), Some(0))
    );

    // The app's client vanishes with a reset in the middle of the exchange.
    let mut s = tunnel(&m).await;
    s.write_all(b"some bytes").await.unwrap();
    let mut back = [0u8; 10];
    within(IO_TIMEOUT, "echo", s.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(s);
    let line = m
        .client
        .wait_access_log(IO_TIMEOUT, |v| {
            connect_line(v) && v["end_reason"] != "idle-timeout"
        })
        .await;
    assert_eq!(line["end_reason"], "reset", "{line}");
    assert_eq!(line["bytes_received"], 10, "{line}");
    assert_eq!(line["bytes_sent"], 10, "{line}");
}

/// A tunnel still open when `drain.timeout` runs out is cut, and its line (`end_reason: drain`)
/// reaches stdout before the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_cut_by_the_drain_is_logged_before_exit() {
    let mut m = mesh("drain: { notify: 100ms, timeout: 1s }\n", "").await;
    let mut s = tunnel(&m).await;
    s.write_all(b"open").await.unwrap();
    let mut back = [0u8; 4];
    within(IO_TIMEOUT, "echo", s.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    m.client.signal(libc::SIGTERM);
    let status = m.client.wait_exit(Duration::from_secs(10)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let lines: Vec<_> = m
        .client
        .access_log()
        .into_iter()
        .filter(connect_line)
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["end_reason"], "drain", "{}", lines[0]);
    assert_eq!(lines[0]["bytes_received"], 4);
}
