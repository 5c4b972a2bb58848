//! The DNS listener (SPEC section 10) of a real `aether-proxy run`, asked by a real DNS client
//! (hickory-proto's messages over UDP and TCP sockets): mesh names from the catalog (file or
//! xDS), NODATA and NXDOMAIN, IPv6 on and off, answers that follow catalog reloads, bad
//! packets; and forwarding, with the proxy inside a network namespace whose resolv.conf names a
//! fake upstream server run by the test in that namespace.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::*;
use aether_proxy::catalog::vip;
use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

// ---------------------------------------------------------------------------------------------
// A DNS client
// ---------------------------------------------------------------------------------------------

/// A query for `name`/`t` with a random id; `edns` advertises a 4096-byte UDP payload.
fn query(name: &str, t: RecordType, edns: bool) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), t));
    if edns {
        let mut e = Edns::new();
        e.set_max_payload(4096);
        m.set_edns(e);
    }
    m
}

/// Sends `bytes` from `sock` to `server` and waits (bounded) for one datagram back.
async fn udp_raw(sock: &UdpSocket, server: SocketAddr, bytes: &[u8]) -> Option<Vec<u8>> {
    sock.send_to(bytes, server).await.unwrap();
    let mut buf = vec![0u8; 65535];
    match tokio::time::timeout(Duration::from_secs(5), sock.recv_from(&mut buf)).await {
        Ok(Ok((n, _))) => Some(buf[..n].to_vec()),
        _ => None,
    }
}

/// One query over UDP, its answer parsed; the id must come back as sent.
async fn udp_ask(sock: &UdpSocket, server: SocketAddr, q: &Message) -> Message {
    let raw = udp_raw(sock, server, &q.to_vec().unwrap())
        .await
        .unwrap_or_else(|| panic!("no UDP answer from {server} to {:?}", q.queries));
    let m = Message::from_vec(&raw).expect("answer parses");
    assert_eq!(m.metadata.id, q.metadata.id, "the query id comes back");
    assert_eq!(m.metadata.message_type, MessageType::Response);
    m
}

/// One query over an open TCP connection (length-prefixed).
async fn tcp_ask(conn: &mut TcpStream, q: &Message) -> Message {
    let bytes = q.to_vec().unwrap();
    let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(&bytes);
    conn.write_all(&out).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        let len = conn.read_u16().await?;
        let mut b = vec![0u8; len as usize];
        conn.read_exact(&mut b).await?;
        Ok::<_, std::io::Error>(b)
    })
    .await
    .expect("a TCP answer within 5 s")
    .expect("a TCP answer");
    let m = Message::from_vec(&answer).expect("answer parses");
    assert_eq!(m.metadata.id, q.metadata.id, "the query id comes back");
    m
}

async fn client_socket(near: IpAddr) -> UdpSocket {
    UdpSocket::bind(SocketAddr::new(near, 0)).await.unwrap()
}

fn v4s(m: &Message) -> Vec<Ipv4Addr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

/// NOERROR with no answer.
fn assert_nodata(m: &Message, what: &str) {
    assert_eq!(
        m.metadata.response_code,
        ResponseCode::NoError,
        "{what}: {m}"
    );
    assert!(m.answers.is_empty(), "{what}: {m}");
}

fn assert_nxdomain(m: &Message, what: &str) {
    assert_eq!(
        m.metadata.response_code,
        ResponseCode::NXDomain,
        "{what}: {m}"
    );
    assert!(m.answers.is_empty(), "{what}: {m}");
}

// ---------------------------------------------------------------------------------------------
// Pods
// ---------------------------------------------------------------------------------------------

fn one_service(certs: &Certs, name: &str, ip: IpAddr) -> String {
    service(
        name,
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(ip, &[8080])],
    )
}

/// Where a pod's DNS listener is: next to its other listeners.
fn dns_addr(pod: PodNet) -> SocketAddr {
    SocketAddr::new(pod.proxy_ip(), 15053)
}

fn dns_yaml(pod: PodNet, ipv6: bool) -> String {
    format!("dns:\n  listen: {}\n  ipv6: {ipv6}\n", dns_addr(pod))
}

// ---------------------------------------------------------------------------------------------
// Mesh names
// ---------------------------------------------------------------------------------------------

/// A, AAAA (IPv6 off), other types, unknown names, any case with or without the trailing dot,
/// over UDP and TCP; the address is the name's first hash slot (one service: no collision).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_names_over_udp_and_tcp() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = certs();
    let cat = catalog(&[one_service(&certs, "payments", net.pod(1).proxy_ip())]);
    let proxy = client_proxy(&certs, pod, &cat, &dns_yaml(pod, false)).await;
    let server = dns_addr(pod);
    let sock = client_socket(pod.extra(0)).await;
    let want = vip::v4_of(vip::slot("payments", 0));

    for name in [
        "payments.aether.internal",
        "payments.aether.internal.",
        "PayMents.AETHER.internal",
    ] {
        for edns in [false, true] {
            let q = query(name, RecordType::A, edns);
            let m = udp_ask(&sock, server, &q).await;
            assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{name}");
            assert!(m.metadata.authoritative, "{name}");
            assert!(m.metadata.recursion_desired, "RD copied");
            assert_eq!(v4s(&m), vec![want], "{name}");
            assert_eq!(m.answers[0].ttl, 30, "{name}");
            // The answer names the question as asked (resolvers match it case for case).
            // On the wire every name is fully qualified.
            let asked = format!("{}.", q.queries[0].name().to_ascii().trim_end_matches('.'));
            assert_eq!(m.answers[0].name.to_ascii(), asked, "{name}");
            assert_eq!(m.queries[0].name().to_ascii(), asked, "{name}");
            assert_eq!(m.edns.is_some(), edns, "EDNS answered with EDNS: {name}");
        }
    }
    let m = udp_ask(
        &sock,
        server,
        &query("payments.aether.internal", RecordType::AAAA, false),
    )
    .await;
    assert_nodata(&m, "AAAA with ipv6 off");
    for t in [RecordType::TXT, RecordType::MX, RecordType::SRV] {
        let m = udp_ask(&sock, server, &query("payments.aether.internal", t, false)).await;
        assert_nodata(&m, &format!("{t} of a known name"));
    }
    for ghost in [
        "ghost.aether.internal",
        "GHOST.aether.internal.",
        "v1.payments.aether.internal",
        "pay_ments.aether.internal",
    ] {
        let m = udp_ask(&sock, server, &query(ghost, RecordType::A, false)).await;
        assert_nxdomain(&m, ghost);
        assert!(m.metadata.authoritative, "{ghost}");
    }

    // TCP: the same answers, several on one connection.
    let mut conn = TcpStream::connect(server).await.unwrap();
    for _ in 0..3 {
        let m = tcp_ask(
            &mut conn,
            &query("Payments.aether.internal.", RecordType::A, false),
        )
        .await;
        assert_eq!(v4s(&m), vec![want]);
    }
    let m = tcp_ask(
        &mut conn,
        &query("ghost.aether.internal", RecordType::A, false),
    )
    .await;
    assert_nxdomain(&m, "ghost over TCP");
    let m = tcp_ask(
        &mut conn,
        &query("payments.aether.internal", RecordType::AAAA, false),
    )
    .await;
    assert_nodata(&m, "AAAA over TCP");

    assert_eq!(
        metric(&proxy, "aether_dns_queries_total", &["result=\"mesh\""]).await,
        9.0
    );
    assert_eq!(
        metric(&proxy, "aether_dns_queries_total", &["result=\"nxdomain\""]).await,
        5.0
    );
    assert_eq!(
        metric(&proxy, "aether_dns_queries_total", &["result=\"nodata\""]).await,
        5.0
    );
}

/// With `dns.ipv6: true`, AAAA gets the name's slot in 2001:2::/48 and A still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_answers_when_enabled() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = certs();
    let cat = catalog(&[one_service(&certs, "payments", net.pod(1).proxy_ip())]);
    let _proxy = client_proxy(&certs, pod, &cat, &dns_yaml(pod, true)).await;
    let sock = client_socket(pod.extra(0)).await;
    let server = dns_addr(pod);
    let m = udp_ask(
        &sock,
        server,
        &query("payments.aether.internal", RecordType::AAAA, false),
    )
    .await;
    let v6: Vec<_> = m
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::AAAA(a) => Some(a.0),
            _ => None,
        })
        .collect();
    assert_eq!(v6, vec![vip::v6_of(vip::slot("payments", 0))], "{m}");
    assert_eq!(m.answers[0].ttl, 30);
    let m = udp_ask(
        &sock,
        server,
        &query("payments.aether.internal", RecordType::A, false),
    )
    .await;
    assert_eq!(v4s(&m), vec![vip::v4_of(vip::slot("payments", 0))]);
    let m = udp_ask(
        &sock,
        server,
        &query("ghost.aether.internal", RecordType::AAAA, false),
    )
    .await;
    assert_nxdomain(&m, "AAAA of an unknown name");
}

/// The listener reads the catalog in use: a service added to the file resolves, one removed
/// from it gets NXDOMAIN, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_follow_catalog_reloads() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = certs();
    let p1 = net.pod(1).proxy_ip();
    let cat = catalog(&[one_service(&certs, "payments", p1)]);
    let proxy = client_proxy(&certs, pod, &cat, &dns_yaml(pod, false)).await;
    let sock = client_socket(pod.extra(0)).await;
    let server = dns_addr(pod);
    let ask = |name: &'static str| {
        let sock = &sock;
        async move { udp_ask(sock, server, &query(name, RecordType::A, false)).await }
    };
    assert_nxdomain(&ask("orders.aether.internal").await, "before the reload");

    let both = catalog(&[
        one_service(&certs, "payments", p1),
        one_service(&certs, "orders", p1),
    ]);
    // Replaced whole (written aside, renamed over), as a kubelet or a control plane does.
    crate::common::live::write_atomic(&proxy.catalog_path(), both.as_bytes());
    let (ten_s, pace) = (Duration::from_secs(10), Duration::from_millis(50));
    let got = eventually_every(ten_s, pace, "orders known", async || {
        let m = ask("orders.aether.internal").await;
        if m.metadata.response_code == ResponseCode::NoError {
            Ok(m)
        } else {
            Err(format!("{:?}", m.metadata.response_code))
        }
    })
    .await;
    let orders = v4s(&got);
    assert_eq!(orders.len(), 1);
    // Both names are in the table; whichever way their slots fall, each has one address.
    let payments = v4s(&ask("payments.aether.internal").await);
    assert_eq!(payments.len(), 1);
    assert_ne!(orders, payments);

    crate::common::live::write_atomic(
        &proxy.catalog_path(),
        catalog(&[one_service(&certs, "orders", p1)]).as_bytes(),
    );
    eventually_every(ten_s, pace, "payments unknown", async || {
        let m = ask("payments.aether.internal").await;
        if m.metadata.response_code == ResponseCode::NXDomain {
            Ok(())
        } else {
            Err(format!("still answered: {:?}", m.metadata.response_code))
        }
    })
    .await;
    assert_eq!(
        v4s(&ask("orders.aether.internal").await),
        orders,
        "orders stays put"
    );
}

/// Bad bytes never stop the listener: garbage and short headers are dropped, a header with a
/// broken body gets FORMERR with the client's id, an oversized TCP frame closes that
/// connection only; good queries are answered throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_packets_are_answered_or_dropped() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = certs();
    let cat = catalog(&[one_service(&certs, "payments", net.pod(1).proxy_ip())]);
    let proxy = client_proxy(&certs, pod, &cat, &dns_yaml(pod, false)).await;
    let sock = client_socket(pod.extra(0)).await;
    let server = dns_addr(pod);
    let good = query("payments.aether.internal", RecordType::A, false);

    let silent: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xab],
        b"\x12\x34\x01\x00\x00".to_vec(),
        // An answer (QR set) is never answered.
        {
            let mut b = good.to_vec().unwrap();
            b[2] |= 0x80;
            b
        },
    ];
    for bad in &silent {
        sock.send_to(bad, server).await.unwrap();
    }
    // One datagram of random garbage with a header-sized prefix: FORMERR or nothing, never a
    // crash; whatever comes back must be an answer to its id.
    let mut formerr = vec![
        0x77, 0x01, 0x01, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];
    formerr.extend_from_slice(&[0xc0, 0xff, 0x3f]); // a compression pointer to nowhere
    let raw = udp_raw(&sock, server, &formerr).await.expect("FORMERR");
    let m = Message::from_vec(&raw).unwrap();
    assert_eq!(m.metadata.id, 0x7701);
    assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
    // The silent ones produced nothing: the next datagram is the good query's answer.
    let m = udp_ask(&sock, server, &good).await;
    assert_eq!(v4s(&m).len(), 1);

    for seed in 0..200u32 {
        let len = (seed as usize * 7) % 300;
        let junk: Vec<u8> = (0..len)
            .map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i as u32 * 40503) >> 13) as u8)
            .collect();
        sock.send_to(&junk, server).await.unwrap();
    }
    // Drain whatever the junk got back, then ask again.
    let mut buf = vec![0u8; 4096];
    while let Ok(Ok(_)) =
        tokio::time::timeout(Duration::from_millis(300), sock.recv_from(&mut buf)).await
    {}
    let m = udp_ask(&sock, server, &good).await;
    assert_eq!(v4s(&m).len(), 1, "still answering after junk");

    // TCP: an oversized length closes the connection; a short frame of garbage too.
    let mut conn = TcpStream::connect(server).await.unwrap();
    conn.write_all(&[0xff, 0xff]).await.unwrap();
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut b))
        .await
        .expect("closed within 5 s");
    assert!(
        matches!(n, Ok(0) | Err(_)),
        "an oversized frame closes: {n:?}"
    );
    let mut conn = TcpStream::connect(server).await.unwrap();
    conn.write_all(&[0x00, 0x03, 1, 2, 3]).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut b))
        .await
        .expect("closed within 5 s");
    assert!(
        matches!(n, Ok(0) | Err(_)),
        "a headerless frame closes: {n:?}"
    );
    let mut conn = TcpStream::connect(server).await.unwrap();
    let m = tcp_ask(&mut conn, &good).await;
    assert_eq!(v4s(&m).len(), 1, "TCP still answering");
    assert!(metric(&proxy, "aether_dns_queries_total", &["result=\"dropped\""]).await >= 4.0);
    assert!(proxy.pid().is_some());
}

/// A TCP connection that sends nothing is closed after the idle timeout (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tcp_connections_are_closed() {
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = certs();
    let cat = catalog(&[one_service(&certs, "payments", net.pod(1).proxy_ip())]);
    let _proxy = client_proxy(&certs, pod, &cat, &dns_yaml(pod, false)).await;
    let mut conn = TcpStream::connect(dns_addr(pod)).await.unwrap();
    let t = Instant::now();
    let mut b = [0u8; 4];
    let n = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut b))
        .await
        .expect("closed within 20 s");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(15),
        "closed after {took:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// On demand (xDS)
// ---------------------------------------------------------------------------------------------

/// With a control plane, a mesh name the client has never asked for resolves on its first
/// query: the listener asks the control plane and waits for the answer; a name the control
/// plane does not know gets NXDOMAIN.
async fn on_demand_names_resolve_on_first_query(server: crate::common::xds::Server) {
    use crate::common::xds::*;
    let net = Net::fresh();
    let pod = net.pod(0);
    let certs = certs();
    let fixture = Fixture::new().service(
        "payments",
        Service::new(&certs.spiffe_id(PAYMENTS))
            .endpoint(Endpoint::new(net.pod(1).proxy_ip(), &[8080])),
    );
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fixture).await;
    let _client = xds_client(&certs, pod, &cp.address(), &[], &dns_yaml(pod, false)).await;
    let sock = client_socket(pod.extra(0)).await;
    let server = dns_addr(pod);
    assert_eq!(
        cp.subscribes("payments.aether.internal"),
        0,
        "nothing asked yet"
    );

    let m = udp_ask(
        &sock,
        server,
        &query("payments.aether.internal", RecordType::A, false),
    )
    .await;
    assert_eq!(v4s(&m), vec![vip::v4_of(vip::slot("payments", 0))], "{m}");
    assert_eq!(cp.subscribes("payments.aether.internal"), 1);

    let m = udp_ask(
        &sock,
        server,
        &query("ghost.aether.internal", RecordType::A, false),
    )
    .await;
    assert_nxdomain(&m, "unknown to the control plane");
}

// ---------------------------------------------------------------------------------------------
// Forwarding, in a network namespace
// ---------------------------------------------------------------------------------------------

/// A network namespace with loopback up and its own resolv.conf (`/etc/netns/<ns>/`, which
/// `ip netns exec` mounts over `/etc/resolv.conf`); both are removed on drop, pass or fail.
struct NetNs {
    name: String,
}

impl NetNs {
    fn new(resolv_conf: &str) -> NetNs {
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "aether-dns-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let ns = NetNs { name };
        run("ip", &["netns", "add", &ns.name]);
        run("ip", &["-n", &ns.name, "link", "set", "lo", "up"]);
        let dir = ns.etc();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("resolv.conf"), resolv_conf).unwrap();
        ns
    }

    fn etc(&self) -> std::path::PathBuf {
        std::path::Path::new("/etc/netns").join(&self.name)
    }

    /// Runs `f` on a thread that has entered the namespace: sockets it makes live there (and
    /// stay there when used from other threads).
    fn enter<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let fd = std::fs::File::open(&path).expect("namespace handle");
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("namespace thread")
    }

    fn udp(&self, addr: &str) -> UdpSocket {
        let addr: SocketAddr = addr.parse().unwrap();
        let s = self.enter(move || std::net::UdpSocket::bind(addr).unwrap());
        s.set_nonblocking(true).unwrap();
        UdpSocket::from_std(s).unwrap()
    }

    fn tcp_listener(&self, addr: &str) -> tokio::net::TcpListener {
        let addr: SocketAddr = addr.parse().unwrap();
        let l = self.enter(move || std::net::TcpListener::bind(addr).unwrap());
        l.set_nonblocking(true).unwrap();
        tokio::net::TcpListener::from_std(l).unwrap()
    }

    fn tcp_connect(&self, addr: SocketAddr) -> TcpStream {
        let s = self.enter(move || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap()
        });
        s.set_nonblocking(true).unwrap();
        TcpStream::from_std(s).unwrap()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
        let _ = std::fs::remove_dir_all(self.etc());
    }
}

/// Waits until the DNS listener of a proxy in `ns` answers (its admin is out of reach), asking
/// from a socket of its own so no late answer reaches the test's client.
async fn wait_answering(ns: &NetNs, server: SocketAddr) {
    let sock = ns.udp("127.0.0.1:0");
    let ping = query("payments.aether.internal", RecordType::A, false)
        .to_vec()
        .unwrap();
    eventually_every(
        READY_TIMEOUT,
        Duration::ZERO,
        "the DNS listener answering",
        async || {
            let answered =
                tokio::time::timeout(Duration::from_millis(500), udp_raw(&sock, server, &ping))
                    .await;
            match answered {
                Ok(Some(_)) => Ok(()),
                _ => Err(String::new()),
            }
        },
    )
    .await
}

fn run(cmd: &str, args: &[&str]) {
    let st = std::process::Command::new(cmd).args(args).status().unwrap();
    assert!(st.success(), "{cmd} {args:?}: {st}");
}

/// An upstream resolver on 127.0.0.1:53 of a namespace: `example.test` has one address,
/// `big.test` is truncated over UDP and whole (40 addresses) over TCP, `slow.test` is never
/// answered. Records every name it was asked for, with the transport.
struct Upstream {
    seen: Arc<Mutex<Vec<(String, &'static str)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn upstream_answer(q: &Message, over_udp: bool) -> Option<Message> {
    let question = q.queries.first()?;
    let name = question.name().to_ascii().to_ascii_lowercase();
    let mut m = Message::response(q.metadata.id, OpCode::Query);
    m.metadata.recursion_desired = q.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.queries = q.queries.clone();
    let a = |ip: Ipv4Addr| Record::from_rdata(question.name().clone(), 60, RData::A(A(ip)));
    match name.as_str() {
        "example.test." => {
            m.add_answer(a(Ipv4Addr::new(192, 0, 2, 7)));
        }
        "big.test." if over_udp => m.metadata.truncation = true,
        "big.test." => {
            for i in 0..40 {
                m.add_answer(a(Ipv4Addr::new(198, 51, 100, i)));
            }
        }
        "slow.test." => return None,
        "v6.test." => {
            m.add_answer(Record::from_rdata(
                question.name().clone(),
                60,
                RData::AAAA(AAAA("2001:db8::7".parse().unwrap())),
            ));
        }
        _ => m.metadata.response_code = ResponseCode::NXDomain,
    }
    Some(m)
}

impl Upstream {
    fn start(ns: &NetNs) -> Upstream {
        let seen: Arc<Mutex<Vec<(String, &'static str)>>> = Default::default();
        let udp = ns.udp("127.0.0.1:53");
        let tcp = ns.tcp_listener("127.0.0.1:53");
        let s = seen.clone();
        let udp_task = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((n, from)) = udp.recv_from(&mut buf).await else {
                    continue;
                };
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                if let Some(qq) = q.queries.first() {
                    s.lock()
                        .unwrap()
                        .push((qq.name().to_ascii().to_ascii_lowercase(), "udp"));
                }
                if let Some(m) = upstream_answer(&q, true) {
                    let _ = udp.send_to(&m.to_vec().unwrap(), from).await;
                }
            }
        });
        let s = seen.clone();
        let tcp_task = tokio::spawn(async move {
            loop {
                let Ok((mut c, _)) = tcp.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(len) = c.read_u16().await else { return };
                    let mut b = vec![0u8; len as usize];
                    if c.read_exact(&mut b).await.is_err() {
                        return;
                    }
                    let Ok(q) = Message::from_vec(&b) else { return };
                    if let Some(qq) = q.queries.first() {
                        s.lock()
                            .unwrap()
                            .push((qq.name().to_ascii().to_ascii_lowercase(), "tcp"));
                    }
                    if let Some(m) = upstream_answer(&q, false) {
                        let bytes = m.to_vec().unwrap();
                        let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
                        out.extend_from_slice(&bytes);
                        let _ = c.write_all(&out).await;
                    }
                });
            }
        });
        Upstream {
            seen,
            tasks: vec![udp_task, tcp_task],
        }
    }

    fn seen(&self) -> Vec<(String, &'static str)> {
        self.seen.lock().unwrap().clone()
    }
}

/// A client pod's sidecar serving DNS inside `ns` (catalog: `payments`), answering; what
/// must outlive the test (the network claim, the certificates, the proxy) and the DNS
/// listener's address.
async fn relaying_sidecar(ns: &NetNs) -> ((Net, Certs, Proxy), SocketAddr) {
    let certs = certs();
    let net = Net::fresh();
    let pod = net.pod(0);
    let cat = catalog(&[one_service(&certs, "payments", net.pod(1).proxy_ip())]);
    let proxy = client_proxy_builder(&certs, pod, &cat, &dns_yaml(pod, false))
        .netns(&ns.name)
        .start()
        .await;
    let server = dns_addr(pod);
    wait_answering(ns, server).await;
    ((net, certs, proxy), server)
}

/// Names outside the mesh go to resolv.conf's server unchanged (id kept), over TCP when the UDP
/// answer is truncated; a server that never answers means SERVFAIL after about 2 s; mesh names,
/// known or not, never reach the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_names_are_forwarded_to_resolv_conf() {
    let ns = NetNs::new("# test resolver\nsearch example.invalid\nnameserver 127.0.0.1\n");
    let upstream = Upstream::start(&ns);
    let certs = certs();
    // Inside the namespace every 127/8 address is the test's own: plain addresses do.
    let net = Net::fresh();
    let pod = net.pod(0);
    let cat = catalog(&[one_service(&certs, "payments", net.pod(1).proxy_ip())]);
    let _proxy = client_proxy_builder(&certs, pod, &cat, &dns_yaml(pod, false))
        .netns(&ns.name)
        .start()
        .await;
    let server = dns_addr(pod);
    let sock = ns.udp("127.0.0.1:0");

    wait_answering(&ns, server).await;

    let q = query("example.test", RecordType::A, false);
    let m = udp_ask(&sock, server, &q).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{m}");
    assert_eq!(v4s(&m), vec![Ipv4Addr::new(192, 0, 2, 7)]);
    assert_eq!(m.answers[0].ttl, 60, "the upstream's own answer, not ours");
    assert!(!m.metadata.authoritative);
    let m = udp_ask(&sock, server, &query("v6.test", RecordType::AAAA, true)).await;
    assert_eq!(m.answers.len(), 1, "{m}");
    let m = udp_ask(&sock, server, &query("nothing.test", RecordType::A, false)).await;
    assert_nxdomain(&m, "the upstream's NXDOMAIN");

    // Truncated over UDP: the proxy asks again over TCP; a client that takes 4096 bytes over
    // UDP gets the whole answer, a 512-byte client gets TC and asks over TCP itself.
    let m = udp_ask(&sock, server, &query("big.test", RecordType::A, true)).await;
    assert!(!m.metadata.truncation, "{m}");
    assert_eq!(v4s(&m).len(), 40);
    let m = udp_ask(&sock, server, &query("big.test", RecordType::A, false)).await;
    assert!(m.metadata.truncation, "over 512 bytes: {m}");
    assert!(m.answers.is_empty());
    let mut conn = ns.tcp_connect(server);
    let m = tcp_ask(&mut conn, &query("big.test", RecordType::A, false)).await;
    assert!(!m.metadata.truncation);
    assert_eq!(v4s(&m).len(), 40);
    let m = tcp_ask(&mut conn, &query("example.test", RecordType::A, false)).await;
    assert_eq!(v4s(&m), vec![Ipv4Addr::new(192, 0, 2, 7)]);
    let seen = upstream.seen();
    assert!(
        seen.iter()
            .filter(|s| *s == &("big.test.".to_string(), "tcp"))
            .count()
            >= 3,
        "{seen:?}"
    );

    // No answer: SERVFAIL after the 2 s budget, over UDP and TCP.
    let t = Instant::now();
    let m = udp_ask(&sock, server, &query("slow.test", RecordType::A, false)).await;
    let took = t.elapsed();
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail, "{m}");
    assert!(
        took >= Duration::from_millis(1800) && took < Duration::from_millis(3500),
        "SERVFAIL after {took:?}"
    );
    let t = Instant::now();
    let m = tcp_ask(&mut conn, &query("slow.test", RecordType::A, false)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail, "{m}");
    assert!(t.elapsed() < Duration::from_millis(3500));

    // Mesh names, known or not, never leave the proxy.
    for name in [
        "payments.aether.internal",
        "ghost.aether.internal",
        "a.b.aether.internal",
    ] {
        let _ = udp_ask(&sock, server, &query(name, RecordType::A, false)).await;
    }
    let leaked: Vec<_> = upstream
        .seen()
        .into_iter()
        .filter(|(n, _)| n.ends_with("aether.internal."))
        .collect();
    assert!(leaked.is_empty(), "mesh names forwarded: {leaked:?}");
    // A class other than IN for a mesh name is refused, not forwarded either.
    let mut chaos = query("payments.aether.internal", RecordType::A, false);
    chaos.queries[0].set_query_class(DNSClass::CH);
    let m = udp_ask(&sock, server, &chaos).await;
    assert_eq!(m.metadata.response_code, ResponseCode::Refused);
}

/// resolv.conf with no reachable server: SERVFAIL, not a hang; with the first server dead and
/// the second alive, the second answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_nameserver_is_tried() {
    let ns = NetNs::new("nameserver 127.0.0.9\nnameserver 127.0.0.1\n");
    let _upstream = Upstream::start(&ns);
    let (_sidecar, server) = relaying_sidecar(&ns).await;
    let sock = ns.udp("127.0.0.1:0");
    // 127.0.0.9:53 refuses (ICMP port unreachable): the second server answers well within 2 s.
    let t = Instant::now();
    let m = udp_ask(&sock, server, &query("example.test", RecordType::A, false)).await;
    assert_eq!(v4s(&m), vec![Ipv4Addr::new(192, 0, 2, 7)], "{m}");
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
}

/// Past 1024 forwarded queries in flight, more get SERVFAIL at once instead of queueing; the
/// ones in flight still get theirs when the 2 s are up, and the listener answers mesh names
/// throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_is_bounded() {
    let ns = NetNs::new("nameserver 127.0.0.1\n");
    let _upstream = Upstream::start(&ns);
    let (_sidecar, server) = relaying_sidecar(&ns).await;

    let sock = Arc::new(ns.udp("127.0.0.1:0"));
    let total = 1100usize;
    let start = Instant::now();
    let receiver = {
        let sock = sock.clone();
        tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = vec![0u8; 4096];
            while got.len() < total {
                match tokio::time::timeout(Duration::from_secs(5), sock.recv_from(&mut buf)).await {
                    Ok(Ok((n, _))) => {
                        let m = Message::from_vec(&buf[..n]).unwrap();
                        got.push((start.elapsed(), m.metadata.response_code));
                    }
                    _ => break,
                }
            }
            got
        })
    };
    for i in 0..total {
        let mut q = query("slow.test", RecordType::A, false);
        q.metadata.id = i as u16;
        sock.send_to(&q.to_vec().unwrap(), server).await.unwrap();
        // Paced, so no datagram is lost to a full socket buffer.
        if i % 10 == 9 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    // Mesh names do not wait for a place.
    let other = ns.udp("127.0.0.1:0");
    let t = Instant::now();
    let m = udp_ask(
        &other,
        server,
        &query("payments.aether.internal", RecordType::A, false),
    )
    .await;
    assert_eq!(v4s(&m).len(), 1);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );

    let got = receiver.await.unwrap();
    assert_eq!(got.len(), total, "every query is answered");
    assert!(got.iter().all(|(_, c)| *c == ResponseCode::ServFail));
    let early = got
        .iter()
        .filter(|(at, _)| *at < Duration::from_millis(1500))
        .count();
    assert_eq!(early, total - 1024, "answered at once: {early}");
}

crate::on_both_control_planes!(on_demand_names_resolve_on_first_query,);

/// The relay follows resolv.conf: a sidecar that started with a nameserver that does not
/// answer answers other names SERVFAIL, and once the file names the working one (written in
/// place, as the bind mounts of `ip netns exec` and of a kubelet need) relays to it, without a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_follows_changes_to_resolv_conf() {
    let ns = NetNs::new("nameserver 127.0.0.9\n");
    let _upstream = Upstream::start(&ns);
    let (_sidecar, server) = relaying_sidecar(&ns).await;
    let sock = ns.udp("127.0.0.1:0");
    let m = udp_ask(&sock, server, &query("example.test", RecordType::A, false)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail, "{m}");

    std::fs::write(ns.etc().join("resolv.conf"), "nameserver 127.0.0.1\n").unwrap();
    eventually(
        Duration::from_secs(10),
        "example.test relayed",
        async || {
            let m = udp_ask(&sock, server, &query("example.test", RecordType::A, false)).await;
            holds(v4s(&m) == vec![Ipv4Addr::new(192, 0, 2, 7)]).map_err(|_| m.to_string())
        },
    )
    .await;
}
