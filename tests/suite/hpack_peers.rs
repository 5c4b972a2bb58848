//! Header blocks the proxy encodes, read by a decoder that is not the h2 crate's: Python's
//! `h2`/`hpack` libraries at both ends of a client pod's sidecar and the payments pod's sidecar
//! (docs/decisions/0013-vendored-h2.md). The client sends request fields over h2c to the
//! outbound listener; the app, h2c behind the server sidecar, records the fields it decodes and
//! answers with the same values. Every value, long ones and ones outside ASCII included, must
//! arrive byte for byte, both ways.

use std::net::SocketAddr;
use std::process::Stdio;

use crate::common::mesh::*;
use crate::common::*;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// The app's port on the payments pod, `protocol: h2`.
const PORT: u16 = 8080;

/// Both peers, chosen by the first argument. Fields cross as `name=hex(value)` lines; the
/// libraries' own header checks are off so that they hand over exactly what is on the wire.
const PEER: &str = r#"
import socket, sys
import h2.config, h2.connection, h2.events

def config(client):
    return h2.config.H2Configuration(
        client_side=client, header_encoding=None,
        validate_outbound_headers=False, normalize_outbound_headers=False,
        validate_inbound_headers=False, normalize_inbound_headers=False)

def fields():
    return [tuple(bytes.fromhex(x) for x in line.split("=", 1))
            for line in sys.stdin.read().split()]

def show(headers):
    for n, v in headers:
        print(n.decode("latin-1") + "=" + v.hex())
    sys.stdout.flush()

def app(addr):
    host, port = addr.rsplit(":", 1)
    srv = socket.create_server((host, int(port)))
    print("ready", flush=True)
    sock, _ = srv.accept()
    conn = h2.connection.H2Connection(config(False))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    answered = False
    while True:
        data = sock.recv(65536)
        if not data:
            return
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.RequestReceived) and not answered:
                answered = True
                show(ev.headers)
                print("end", flush=True)
                # Answer with the request's own test fields.
                back = [(b":status", b"200")] + [
                    (n, v) for n, v in ev.headers if n.startswith(b"x-t-")]
                conn.send_headers(ev.stream_id, back, end_stream=True)
        sock.sendall(conn.data_to_send())

def client(addr):
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    conn = h2.connection.H2Connection(config(True))
    conn.initiate_connection()
    req = [(b":method", b"GET"), (b":scheme", b"http"),
           (b":authority", b"payments.aether.internal:8080"), (b":path", b"/hpack")]
    conn.send_headers(1, req + fields(), end_stream=True)
    sock.sendall(conn.data_to_send())
    while True:
        data = sock.recv(65536)
        if not data:
            sys.exit("connection closed before the response")
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived):
                show(ev.headers)
                return
            if isinstance(ev, h2.events.StreamReset):
                sys.exit("stream reset: %r" % ev.error_code)
        sock.sendall(conn.data_to_send())

{"app": app, "client": client}[sys.argv[1]](sys.argv[2])
"#;

/// The test's fields: lengths either side of the 7-bit and 14-bit length prefixes, every
/// visible ASCII octet, every octet from 0x80 up, UTF-8, a tab, and an empty value.
fn test_fields() -> Vec<(String, Vec<u8>)> {
    let ascii: Vec<u8> = (0x21..0x7f).collect();
    let high: Vec<u8> = (0x80..=0xff).collect();
    let long: Vec<u8> = ascii.iter().cycle().take(3000).copied().collect();
    vec![
        ("x-t-ascii".into(), ascii),
        ("x-t-high".into(), high),
        ("x-t-utf8".into(), "grüße, 東京 ☕".as_bytes().to_vec()),
        ("x-t-tab".into(), b"a\tb c".to_vec()),
        ("x-t-empty".into(), Vec::new()),
        ("x-t-126".into(), vec![b'z'; 126]),
        ("x-t-127".into(), vec![b'z'; 127]),
        ("x-t-128".into(), vec![b'7'; 128]),
        ("x-t-long".into(), long),
        // Past one frame (16,384 octets): the block goes on in CONTINUATION frames.
        ("x-t-long2".into(), vec![b'~'; 16_500]),
        ("x-t-repeat".into(), b"same".to_vec()),
    ]
}

fn parse(out: &str) -> Vec<(String, Vec<u8>)> {
    out.lines()
        .take_while(|l| *l != "end")
        .filter(|l| *l != "ready")
        .map(|l| {
            let (n, v) = l.split_once('=').expect("name=hex");
            (n.to_string(), hex::decode(v).expect("hex value"))
        })
        .collect()
}

/// The `x-t-` fields ordered by name (a header map may reorder names; the values of one name
/// keep their order).
fn only_test_fields(all: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = all
        .iter()
        .filter(|(n, _)| n.starts_with("x-t-"))
        .cloned()
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

async fn run_client(outbound: SocketAddr, fields: &[(String, Vec<u8>)]) -> String {
    let mut child = Command::new("python3")
        .args(["-c", PEER, "client", &outbound.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs (with the h2 library)");
    let input: String = fields
        .iter()
        .map(|(n, v)| format!("{}={}\n", hex::encode(n), hex::encode(v)))
        .collect();
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).await.unwrap();
    drop(stdin);
    let out = within(IO_TIMEOUT, "python h2 client", child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "the client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn an_independent_decoder_reads_every_field_byte_for_byte() {
    let net = Net::fresh();
    let (client_pod, server_pod) = (net.pod(0), net.pod(1));
    let certs = certs();

    let mut app = Command::new("python3")
        .args(["-c", PEER, "app", &server_pod.app(PORT).to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs (with the h2 library)");
    let mut app_out = BufReader::new(app.stdout.take().unwrap()).lines();
    let ready = within(IO_TIMEOUT, "python h2 app", app_out.next_line())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ready.as_deref(), Some("ready"));

    let server = server_proxy(
        &certs,
        server_pod,
        "payments",
        &["{ port: 8080, protocol: h2 }"],
    )
    .await;
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(server_pod.proxy_ip(), &[PORT])],
    )]);
    let client = client_proxy(&certs, client_pod, &cat, "").await;

    let mut sent = test_fields();
    // A name twice: the second field goes out with the name from the table.
    sent.push(("x-t-repeat".into(), b"other".to_vec()));
    let answer = run_client(client_pod.outbound(), &sent).await;

    let mut app_lines = String::new();
    loop {
        match within(IO_TIMEOUT, "the app's fields", app_out.next_line()).await {
            Ok(Ok(Some(l))) if l == "end" => break,
            Ok(Ok(Some(l))) => {
                app_lines.push_str(&l);
                app_lines.push('\n');
            }
            other => panic!("the app never reported a request: {other:?}"),
        }
    }

    let sent = only_test_fields(&sent);
    let at_app = only_test_fields(&parse(&app_lines));
    assert_eq!(at_app, sent, "the fields the app decoded");
    let at_client = only_test_fields(&parse(&answer));
    assert_eq!(at_client, sent, "the fields the client decoded");
    drop((client, server));
}
