//! Transparent capture (SPEC section 10) in real network namespaces: a client pod namespace
//! joined to the root namespace by a veth pair, the capture rules applied inside it by
//! `aether-proxy redirect --apply`, the client pod's proxy running there as uid 1337, and
//! unmodified clients (curl with no proxy settings, a plain TCP client) running as root in it.
//! Server pods (their proxies and apps) live in the root namespace, reached over the veth.
//!
//! Every namespace, link and rule a test makes is removed when it ends, pass or fail
//! ([`PodNs`]'s `Drop`); names carry the process id, so parallel runs do not collide. Without
//! `ip` or `iptables` the tests say so and skip (`.ci/run` installs both).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use crate::common::mesh::*;
use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PROXY_UID: u32 = 1337;

/// Why these tests cannot run here, if they cannot.
fn missing_tools() -> Option<String> {
    let missing: Vec<&str> = ["ip", "iptables-save", "iptables-restore", "setpriv", "curl"]
        .into_iter()
        .filter(|t| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .env(
                    "PATH",
                    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                )
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "SKIPPED: capture tests need {} (apt-get install -y iproute2 iptables util-linux curl)",
            missing.join(", ")
        )
    })
}

macro_rules! need_tools {
    () => {
        if let Some(why) = missing_tools() {
            eprintln!("{why}");
            return;
        }
    };
}

fn run(cmd: &str, args: &[&str]) -> Output {
    Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"))
}

fn run_ok(cmd: &str, args: &[&str]) -> String {
    let out = run(cmd, args);
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A client pod's network namespace: `eth0` inside (`10.250.t.(b+1)/28`) is one end of a veth
/// pair whose other end stays in the root namespace with `.b+2` (the server pod) and `.b+3`
/// (a host outside the mesh). The default route inside goes over the veth, so virtual
/// addresses and outside hosts are routable. Removed on drop.
struct PodNs {
    name: String,
    host_if: String,
    t: u8,
    b: u8,
}

impl PodNs {
    fn new() -> PodNs {
        static NEXT: AtomicU8 = AtomicU8::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let ns = PodNs {
            name: format!("aecap-{pid}-{n}"),
            // Interface names have at most 15 bytes.
            host_if: format!("aec{}x{n}", pid % 100_000),
            t: (pid % 250) as u8,
            b: 16 * (n % 16),
        };
        // From here on, drop cleans up whatever was made.
        run_ok("ip", &["netns", "add", &ns.name]);
        run_ok(
            "ip",
            &[
                "link",
                "add",
                &ns.host_if,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &ns.name,
            ],
        );
        for host in [2, 3] {
            let a = format!("{}/28", ns.ip(host));
            run_ok("ip", &["addr", "add", &a, "dev", &ns.host_if]);
        }
        run_ok("ip", &["link", "set", &ns.host_if, "up"]);
        let pod = format!("{}/28", ns.pod_ip());
        run_ok("ip", &["-n", &ns.name, "addr", "add", &pod, "dev", "eth0"]);
        run_ok("ip", &["-n", &ns.name, "link", "set", "lo", "up"]);
        run_ok("ip", &["-n", &ns.name, "link", "set", "eth0", "up"]);
        let via = ns.server_ip().to_string();
        run_ok(
            "ip",
            &["-n", &ns.name, "route", "add", "default", "via", &via],
        );
        ns
    }

    fn ip(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 250, self.t, self.b + host)
    }
    /// The client pod's own address.
    fn pod_ip(&self) -> Ipv4Addr {
        self.ip(1)
    }
    /// The server pod's proxy, in the root namespace.
    fn server_ip(&self) -> Ipv4Addr {
        self.ip(2)
    }
    /// A host outside the mesh, in the root namespace.
    fn outside_ip(&self) -> Ipv4Addr {
        self.ip(3)
    }

    /// IPv6 on the pod's link: `fd00:ae:t:b::1` inside, `::2` outside, the default route over
    /// it (a connect to a service's `2001:2::/48` address needs a route before the rules see it).
    fn enable_ipv6(&self) {
        let (pod, host) = (self.ip6(1), self.ip6(2));
        run_ok(
            "ip",
            &[
                "addr",
                "add",
                &format!("{host}/64"),
                "dev",
                &self.host_if,
                "nodad",
            ],
        );
        let pod = format!("{pod}/64");
        run_ok(
            "ip",
            &[
                "-n", &self.name, "addr", "add", &pod, "dev", "eth0", "nodad",
            ],
        );
        let via = host.to_string();
        run_ok(
            "ip",
            &[
                "-n", &self.name, "-6", "route", "add", "default", "via", &via,
            ],
        );
    }

    fn ip6(&self, host: u16) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0xae, self.t.into(), self.b.into(), 0, 0, 0, host)
    }

    /// What `ip netns exec` shows the pod as /etc/resolv.conf: a cluster DNS address (routed
    /// out of the pod, never answered) that only the capture rules make useful.
    fn cluster_resolv_conf(&self) {
        let etc = format!("/etc/netns/{}", self.name);
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(
            format!("{etc}/resolv.conf"),
            "nameserver 10.96.0.10\noptions timeout:2 attempts:1\n",
        )
        .unwrap();
    }

    /// Runs a command inside the namespace (as root).
    fn exec(&self, args: &[&str]) -> Output {
        let mut all = vec!["netns", "exec", &self.name];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// `aether-proxy redirect ARGS` in the namespace; it must succeed.
    fn redirect(&self, args: &[&str]) {
        let mut all = vec![crate::common::BIN, "redirect"];
        all.extend_from_slice(args);
        let out = self.exec(&all);
        assert!(
            out.status.success(),
            "redirect {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn nat_rules(&self) -> String {
        let out = self.exec(&["iptables-save", "-t", "nat"]);
        assert!(out.status.success(), "iptables-save failed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `curl` inside the namespace with no proxy settings; `(status, body)`.
    fn curl(&self, args: &[&str]) -> (String, String) {
        let mut all = vec![
            "env",
            "-u",
            "http_proxy",
            "-u",
            "HTTP_PROXY",
            "-u",
            "all_proxy",
            "curl",
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
        ];
        all.extend_from_slice(args);
        let out = self.exec(&all);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
        assert!(
            out.status.success(),
            "curl {args:?} failed: {}{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        (status.to_string(), body.to_string())
    }

    /// Runs `f` on a thread that has entered the namespace (sockets it opens live there).
    async fn within<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        tokio::task::spawn_blocking(move || {
            let ns = std::fs::File::open(&path).expect("open the namespace");
            let home = std::fs::File::open("/proc/thread-self/ns/net").expect("own namespace");
            // SAFETY: setns(2) with a namespace file we hold open; it moves only this thread.
            let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
            let out = f();
            // Threads of tokio's blocking pool are reused: go back before returning this one.
            // SAFETY: as above.
            let r = unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns back: {}", std::io::Error::last_os_error());
            out
        })
        .await
        .expect("namespace thread")
    }
}

impl Drop for PodNs {
    fn drop(&mut self) {
        // Deleting one end of the veth removes the other; the namespace takes its rules along.
        let _ = run("ip", &["link", "del", &self.host_if]);
        let _ = run("ip", &["netns", "del", &self.name]);
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{}", self.name));
    }
}

/// A plain TCP connect inside the namespace; what the server sent first (within 2 s) and
/// whether the connection then ended, after writing `send`.
fn tcp_exchange(dst: SocketAddr, send: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut s = std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(5))
        .map_err(|e| format!("connect {dst}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_millis(1500)))
        .unwrap();
    let mut first = vec![0u8; 256];
    let n = match s.read(&mut first) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => 0,
        Err(e) => return Err(format!("read {dst}: {e}")),
    };
    first.truncate(n);
    let mut after = Vec::new();
    if !send.is_empty() {
        s.write_all(send).map_err(|e| format!("write {dst}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut buf = vec![0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    after.extend_from_slice(&buf[..k]);
                    if after.len() >= send.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => return Err(format!("read {dst} after writing: {e}")),
            }
        }
    }
    Ok((first, after))
}

/// True when the connection to `dst` ends with no byte from the far side.
fn closed_without_a_byte(dst: SocketAddr, send: &[u8]) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(5)) else {
        return true;
    };
    let _ = s.write_all(send);
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = [0u8; 64];
    // A close with the client's bytes unread is a reset rather than a FIN; both are a close.
    match s.read(&mut buf) {
        Ok(n) => n == 0,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

/// A server-speaks-first app: a banner on accept, then an echo.
async fn banner_app(addr: SocketAddr, banner: &'static str) -> tokio::task::JoinHandle<()> {
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = l.accept().await {
            tokio::spawn(async move {
                if tcp.write_all(banner.as_bytes()).await.is_err() {
                    return;
                }
                let mut buf = [0u8; 1024];
                while let Ok(n) = tcp.read(&mut buf).await {
                    if n == 0 || tcp.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    })
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn vip(service: &str) -> Ipv4Addr {
    aether_proxy::catalog::vip::VirtualIps::build([service])
        .v4(service)
        .unwrap()
}

/// Makes the certificates readable by the proxy's uid.
fn share(certs: &Certs) {
    run_ok("chmod", &["-R", "a+rX", &certs.dir().display().to_string()]);
}

/// The client pod's proxy, in the namespace, as uid 1337; outbound on the namespace's
/// `127.0.0.1:15001`, admin on the pod's address (so the test reaches it over the veth).
async fn client_proxy_in(ns: &PodNs, certs: &Certs, catalog: &str, egress: &str) -> Proxy {
    client_proxy_with(ns, certs, catalog, egress, "").await
}

/// [`client_proxy_in`] whose config ends with `extra` (e.g. a `dns:` section).
async fn client_proxy_with(
    ns: &PodNs,
    certs: &Certs,
    catalog: &str,
    egress: &str,
    extra: &str,
) -> Proxy {
    let pod = ns.pod_ip();
    let config = format!(
        "trust_domain: {TD}\n{}inbound:\n  listen: {pod}:15008\noutbound:\n  listen: 127.0.0.1:15001\n  egress: {egress}\nadmin:\n  listen: {pod}:15000\n{extra}",
        certs.identity_yaml("frontend"),
    );
    let uid = format!("--reuid={PROXY_UID}");
    let gid = format!("--regid={PROXY_UID}");
    Proxy::builder(&config, catalog)
        .wrap(&[
            "ip",
            "netns",
            "exec",
            &ns.name,
            "setpriv",
            &uid,
            &gid,
            "--clear-groups",
        ])
        .start()
        .await
}

/// The server pod's `inbound.ports` in the tests that reach its h2 and tcp ports.
const SERVED_PORTS: &str = "  ports:\n    - {port: 8080, protocol: auto}\n    - {port: 9090, protocol: h2}\n    - {port: 5432, protocol: tcp}\n";

/// The client pod's catalog for [`server_pod`] with [`SERVED_PORTS`]: `payments` on the veth's
/// far address, 5432 marked tcp.
fn payments_catalog(ns: &PodNs, certs: &Certs) -> String {
    catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    protocols: { 5432: tcp }\n",
        &[endpoint(IpAddr::V4(ns.server_ip()), &[8080, 9090, 5432])],
    )])
}

/// The server pod's proxy, in the root namespace on the veth's far address, apps on `server`;
/// `ports` is its `inbound.ports` section (empty: every port is auto).
async fn server_pod(ns: &PodNs, certs: &Certs, server: &PodNet, ports: &str) -> Proxy {
    let config = format!(
        "trust_domain: {TD}\n{}inbound:\n  listen: {}:15008\n  app_host: {}\n  default_port: 8080\n{ports}outbound:\n  listen: {}\nadmin:\n  listen: {}\n",
        certs.identity_yaml("payments"),
        ns.server_ip(),
        server.app_host(),
        server.outbound(),
        server.admin(),
    );
    Proxy::start(&config, "services: {}\n").await
}

fn uid_of(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmodified_clients_reach_service_ports_and_other_destinations_are_denied() {
    need_tools!();
    let ns = PodNs::new();
    let certs = certs();
    share(&certs);
    let net = Net::fresh();
    let server = net.pod(1);

    // The server pod, in the root namespace, on the veth's far address.
    let _web = HttpApp::auto(server.app(8080)).await;
    let _grpc = HttpApp::h2c(server.app(9090)).await;
    let _db = banner_app(server.app(5432), "HELLO payments\n").await;
    let _server = server_pod(&ns, &certs, &server, SERVED_PORTS).await;
    // A host outside the mesh that must never see a connection.
    let outside = tokio::net::TcpListener::bind((ns.outside_ip(), 7000))
        .await
        .unwrap();

    // The init container's step, twice: one copy of each rule.
    for _ in 0..2 {
        ns.redirect(&["--proxy-uid", "1337", "--apply"]);
    }
    let rules = ns.nat_rules();
    let ours: Vec<&str> = rules.lines().filter(|l| l.contains("AETHER_")).collect();
    let mut unique = ours.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(ours.len(), unique.len(), "a rule appears twice:\n{rules}");
    assert_eq!(
        ours.iter().filter(|l| l.starts_with("-A OUTPUT")).count(),
        1,
        "{rules}"
    );
    assert!(
        rules.contains("-m owner ! --uid-owner 1337 -j AETHER_REDIRECT"),
        "the proxy's uid is not excluded:\n{rules}"
    );
    assert!(rules.contains("-d 127.0.0.0/8 -j RETURN"), "{rules}");

    let svc = "payments";
    let vip = vip(svc);
    let catalog = payments_catalog(&ns, &certs);
    let client = client_proxy_in(&ns, &certs, &catalog, "deny").await;
    assert_eq!(uid_of(client.pid().unwrap()), PROXY_UID.to_string());
    let dump = client.admin_get("/config_dump").await.unwrap().json();
    assert_eq!(dump["catalog"]["virtual_ips"]["payments"], vip.to_string());
    assert_eq!(dump["config"]["outbound"]["egress"], "deny");

    // HTTP/1.1 to a service port, Host naming it: the 9090 app answers (over h2 behind).
    let resolve = format!("{SVC}:9090:{vip}");
    let (status, body) = ns.curl(&["--resolve", &resolve, &format!("http://{SVC}:9090/h1")]);
    assert_eq!(status, "200", "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["port"], 9090, "{body}");
    assert!(json["uri"].as_str().unwrap().ends_with("/h1"), "{body}");

    // h2 with prior knowledge, as gRPC channels send it.
    let (status, body) = ns.curl(&[
        "--http2-prior-knowledge",
        "--resolve",
        &resolve,
        &format!("http://{SVC}:9090/h2"),
    ]);
    assert_eq!(status, "200", "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["port"],
        9090
    );

    // A portless Host takes the dialled port when the service exposes it...
    let (status, body) = ns.curl(&[
        "-H",
        &format!("Host: {SVC}"),
        &format!("http://{vip}:9090/portless"),
    ]);
    assert_eq!(status, "200", "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["port"],
        9090
    );
    // ... else the default port (curl to port 80 sends no port in Host).
    let (status, body) = ns.curl(&[
        "--resolve",
        &format!("{SVC}:80:{vip}"),
        &format!("http://{SVC}/default"),
    ]);
    assert_eq!(status, "200", "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["port"],
        8080
    );

    // Raw TCP to the tcp port: the server speaks first, the tunnel is open before any byte.
    let dst = SocketAddr::new(IpAddr::V4(vip), 5432);
    let (first, echo) = ns
        .within(move || tcp_exchange(dst, b"select 1;"))
        .await
        .unwrap();
    assert_eq!(first, b"HELLO payments\n");
    assert_eq!(echo, b"select 1;");

    // Bytes that are not HTTP, to an HTTP port: closed and counted.
    let http_port = SocketAddr::new(IpAddr::V4(vip), 8080);
    let tls_hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03".to_vec();
    assert!(
        ns.within(move || closed_without_a_byte(http_port, &tls_hello))
            .await
    );

    // Anything else is egress: denied, closed without a byte, never reaching the host, and
    // with a FIN though the client had sent bytes (not a reset).
    let elsewhere = SocketAddr::new(IpAddr::V4(ns.outside_ip()), 7000);
    let refused = ns.within(move || {
        let mut s = std::net::TcpStream::connect_timeout(&elsewhere, Duration::from_secs(5))?;
        s.write_all(b"GET / HTTP/1.1\r\nhost: elsewhere\r\n\r\n")?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.read(&mut [0u8; 64])
    });
    assert_eq!(
        refused.await.map_err(|e| e.kind()),
        Ok(0),
        "a denied egress"
    );
    let reached = tokio::time::timeout(Duration::from_millis(300), outside.accept()).await;
    assert!(
        reached.is_err(),
        "a denied connection reached the outside host"
    );

    // An explicit client in the same pod still works.
    let (status, body) = ns.curl(&[
        "-H",
        &format!("Host: {SVC}:9090"),
        "http://127.0.0.1:15001/explicit",
    ]);
    assert_eq!(status, "200", "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["port"],
        9090
    );

    // The captured TCP connection is named for its service in the log and the metrics.
    let line = client
        .wait_access_log(LOG_TIMEOUT, |v| {
            v["protocol"] == "capture" && v["authority"] == format!("{SVC}:5432")
        })
        .await;
    assert_eq!(
        line["upstream"],
        format!("{}:15008", ns.server_ip()),
        "{line}"
    );
    assert_eq!(line["peer_identity"], certs.spiffe_id(PAYMENTS), "{line}");
    assert_eq!(line["bytes_received"], 9, "{line}");
    assert_eq!(line["bytes_sent"], 15 + 9, "{line}");
    assert_eq!(line["end_reason"], "eof", "{line}");
    assert!(line.get("error").is_none(), "{line}");
    let denied = client
        .wait_access_log(LOG_TIMEOUT, |v| v["protocol"] == "egress")
        .await;
    assert_eq!(denied["authority"], elsewhere.to_string(), "{denied}");
    assert_eq!(denied["error"], "egress-denied", "{denied}");
    let metrics = client.admin_get("/metrics").await.unwrap().text();
    assert_eq!(
        metric(
            &metrics,
            "aether_requests_total{direction=\"outbound\",service=\"payments\",port=\"5432\",code=\"200\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "aether_egress_total{action=\"deny\"}"),
        1.0
    );
    assert_eq!(
        metric(&metrics, "aether_egress_total{action=\"passthrough\"}"),
        0.0
    );
    assert_eq!(metric(&metrics, "aether_captured_not_http_total"), 1.0);

    // --clean removes every rule, and a second --clean has nothing to do (still exit 0).
    for _ in 0..2 {
        ns.redirect(&["--clean"]);
    }
    let rules = ns.nat_rules();
    assert!(!rules.contains("AETHER"), "{rules}");
    // Without the rules, the same client goes straight to the virtual address (and fails).
    let (status, _) = {
        let out = ns.exec(&[
            "curl",
            "-s",
            "--max-time",
            "2",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--resolve",
            &resolve,
            &format!("http://{SVC}:9090/"),
        ]);
        (String::from_utf8_lossy(&out.stdout).into_owned(), ())
    };
    assert_eq!(status, "000");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_egress_reaches_the_original_destination_as_the_proxy() {
    need_tools!();
    let ns = PodNs::new();
    let certs = certs();
    share(&certs);
    // A server outside the mesh that speaks first, and a plain HTTP server.
    let _plain = banner_app(
        SocketAddr::new(IpAddr::V4(ns.outside_ip()), 7000),
        "plain\n",
    )
    .await;
    let web = HttpApp::http1(SocketAddr::new(IpAddr::V4(ns.outside_ip()), 8081)).await;

    ns.redirect(&[
        "--proxy-uid",
        "1337",
        "--apply",
        "--exclude-outbound-ports",
        "7001",
    ]);
    assert!(ns.nat_rules().contains("--dport 7001 -j RETURN"));
    let client = client_proxy_in(&ns, &certs, "services: {}\n", "passthrough").await;

    let dst = SocketAddr::new(IpAddr::V4(ns.outside_ip()), 7000);
    let (first, echo) = ns.within(move || tcp_exchange(dst, b"ping")).await.unwrap();
    assert_eq!(first, b"plain\n");
    assert_eq!(echo, b"ping");

    // An excluded port is never captured: it reaches the host directly (not counted below).
    let _direct = banner_app(
        SocketAddr::new(IpAddr::V4(ns.outside_ip()), 7001),
        "direct\n",
    )
    .await;
    let excluded = SocketAddr::new(IpAddr::V4(ns.outside_ip()), 7001);
    let (first, _) = ns
        .within(move || tcp_exchange(excluded, b""))
        .await
        .unwrap();
    assert_eq!(first, b"direct\n");

    // HTTP to a destination outside the mesh goes as it is.
    let (status, body) = ns.curl(&[&format!("http://{}:8081/out", ns.outside_ip())]);
    assert_eq!(status, "200", "{body}");
    assert_eq!(web.seen().len(), 1);

    let metrics = client.admin_get("/metrics").await.unwrap().text();
    assert_eq!(
        metric(&metrics, "aether_egress_total{action=\"passthrough\"}"),
        2.0
    );
    assert_eq!(
        metric(&metrics, "aether_egress_total{action=\"deny\"}"),
        0.0
    );
    let line = client
        .wait_access_log(LOG_TIMEOUT, |v| v["authority"] == dst.to_string())
        .await;
    assert_eq!(line["protocol"], "egress", "{line}");
    assert_eq!(line["upstream"], dst.to_string(), "{line}");
    assert_eq!(line["bytes_received"], 4, "{line}");
    assert_eq!(line["bytes_sent"], 6 + 4, "{line}");
    assert!(line.get("error").is_none(), "{line}");
}

/// The whole pod as Kubernetes would run it: the pod's resolver points at a cluster DNS address
/// that does not exist here, the rules send its queries to the sidecar's DNS listener, which
/// answers the mesh name with the service's virtual address, and a curl by name (no
/// `--resolve`, no proxy settings) reaches the app through both sidecars.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_system_resolver_and_a_curl_by_name_need_no_settings() {
    need_tools!();
    let ns = PodNs::new();
    let certs = certs();
    share(&certs);
    let net = Net::fresh();
    let server = net.pod(1);
    let _web = HttpApp::auto(server.app(8080)).await;
    let _server = server_pod(&ns, &certs, &server, "").await;

    ns.cluster_resolv_conf();
    ns.redirect(&["--proxy-uid", "1337", "--dns-port", "15053", "--apply"]);
    let rules = ns.nat_rules();
    assert_eq!(
        rules
            .lines()
            .filter(|l| l.contains("--dport 53") && l.ends_with("--to-ports 15053"))
            .count(),
        2,
        "UDP and TCP 53 go to the DNS listener:\n{rules}"
    );

    let catalog = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "",
        &[endpoint(IpAddr::V4(ns.server_ip()), &[8080])],
    )]);
    let client = client_proxy_with(
        &ns,
        &certs,
        &catalog,
        "deny",
        "dns:\n  listen: 127.0.0.1:15053\n",
    )
    .await;

    // The system resolver (glibc, as any app uses it) gets the virtual address.
    let out = ns.exec(&["getent", "ahostsv4", SVC]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "getent {SVC}: {out:?}");
    let vip = vip("payments");
    assert!(text.starts_with(&format!("{vip} ")), "{text}");
    // A mesh name that does not exist is NXDOMAIN at once (getent's exit 2: not found).
    let started = std::time::Instant::now();
    let out = ns.exec(&["getent", "ahostsv4", "nosuch.aether.internal"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(2));

    // curl by name, nothing else: resolver, capture, both sidecars, the app.
    let (status, body) = ns.curl(&[&format!("http://{SVC}:8080/by-name")]);
    assert_eq!(status, "200", "{body}");
    assert!(body.contains("/by-name"), "{body}");

    let metrics = client.admin_get("/metrics").await.unwrap().text();
    assert!(
        metric(&metrics, "aether_dns_queries_total{result=\"mesh\"}") >= 1.0,
        "{metrics}"
    );
    assert!(metric(&metrics, "aether_dns_queries_total{result=\"nxdomain\"}") >= 1.0);
    let line = client
        .wait_access_log(LOG_TIMEOUT, |v| v["path"] == "/by-name")
        .await;
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["peer_identity"], certs.spiffe_id(PAYMENTS), "{line}");
}

/// A gRPC client from the gRPC project's own library (grpcio, Python), run in the pod as an
/// app would run it: a channel to `payments.aether.internal:9090` with default settings, no
/// proxy settings. Prints one JSON object: a unary reply, a server stream, a refused call.
const GRPC_APP: &str = r#"
import json, grpc

def field(buf, want):
    # The replies' fields: 1, 3 and 4 are strings, 2 a varint (EchoReply in crate::common::mesh::grpc).
    i, out = 0, {}
    while i < len(buf):
        key = buf[i]; i += 1
        if key & 7 == 0:
            v = 0; s = 0
            while True:
                b = buf[i]; i += 1; v |= (b & 0x7f) << s; s += 7
                if b < 0x80: break
            out[key >> 3] = v
        else:
            n = buf[i]; i += 1
            if n & 0x80: n = (n & 0x7f) | (buf[i] << 7); i += 1
            out[key >> 3] = buf[i:i + n].decode(); i += n
    return out.get(want, "")

def request(message, count=0):
    raw = message.encode()
    return b"\x0a" + bytes([len(raw)]) + raw + (b"\x10" + bytes([count]) if count else b"")

channel = grpc.insecure_channel("payments.aether.internal:9090")
unary = channel.unary_unary("/aether.test.Echo/Unary")
stream = channel.unary_stream("/aether.test.Echo/Stream")
reply, call = unary.with_call(request("hello"), timeout=10)
replies = [field(r, 1) for r in stream(request("tick", 3), timeout=10)]
try:
    unary(request("decline"), timeout=10)
    refused = None
except grpc.RpcError as e:
    refused = [e.code().name, e.details()]
print(json.dumps({
    "message": field(reply, 1), "xfcc": field(reply, 3), "served_by": field(reply, 4),
    "served_by_header": dict(call.initial_metadata()).get("x-served-by"),
    "stream": replies, "refused": refused,
}))
"#;

/// IPv6 and a real gRPC library, both by name: the pod's rules for both families (`--ipv6`), the
/// DNS listener answering AAAA (`dns.ipv6`), and the outbound side listening on `[::1]` where
/// ip6tables sends captured IPv6. Clients: getent, curl forced to IPv6, a plain TCP client to
/// the service's IPv6 address on its tcp port, and a grpcio channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_clients_and_a_grpc_channel_by_name_are_captured() {
    need_tools!();
    let ns = PodNs::new();
    ns.enable_ipv6();
    ns.cluster_resolv_conf();
    let certs = certs();
    share(&certs);
    let net = Net::fresh();
    let server = net.pod(1);
    let _web = HttpApp::auto(server.app(8080)).await;
    let grpc_app = grpc::GrpcServer::start(server.app(9090), "payments-grpc").await;
    let _db = banner_app(server.app(5432), "HELLO v6\n").await;
    let _server = server_pod(&ns, &certs, &server, SERVED_PORTS).await;

    ns.redirect(&[
        "--proxy-uid",
        "1337",
        "--dns-port",
        "15053",
        "--ipv6",
        "--apply",
    ]);
    let out = ns.exec(&["ip6tables-save", "-t", "nat"]);
    let rules6 = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        rules6.contains("-m owner ! --uid-owner 1337 -j AETHER_REDIRECT"),
        "{rules6}"
    );
    assert!(rules6.contains("-d ::1/128 -j RETURN"), "{rules6}");
    assert!(rules6.contains("--to-ports 15001"), "{rules6}");

    let catalog = payments_catalog(&ns, &certs);
    let client = client_proxy_with(
        &ns,
        &certs,
        &catalog,
        "deny",
        "dns:\n  listen: 127.0.0.1:15053\n  ipv6: true\n",
    )
    .await;
    let dump = client.admin_get("/config_dump").await.unwrap().json();
    assert_eq!(dump["config"]["outbound"]["listen_ipv6"], "[::1]:15001");
    let vip6 = aether_proxy::catalog::vip::VirtualIps::build(["payments"])
        .v6("payments")
        .unwrap();
    assert_eq!(vip6.segments()[..3], [0x2001, 2, 0]);

    // The system resolver gets the IPv6 virtual address.
    let out = ns.exec(&["getent", "ahostsv6", SVC]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "getent ahostsv6 {SVC}: {out:?}");
    assert!(text.starts_with(&format!("{vip6} ")), "{text}");

    // curl by name over IPv6 only: AAAA, ip6tables, the [::1] listener, both sidecars.
    let (status, body) = ns.curl(&["-6", &format!("http://{SVC}:8080/over-v6")]);
    assert_eq!(status, "200", "{body}");
    assert!(body.contains("/over-v6"), "{body}");
    let line = client
        .wait_access_log(LOG_TIMEOUT, |v| v["path"] == "/over-v6")
        .await;
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["peer_identity"], certs.spiffe_id(PAYMENTS), "{line}");

    // An explicit client of the [::1] listener is still an explicit client.
    let (status, body) = ns.curl(&[
        "-g",
        "-H",
        &format!("Host: {SVC}:8080"),
        "http://[::1]:15001/explicit-v6",
    ]);
    assert_eq!(status, "200", "{body}");
    assert!(body.contains("/explicit-v6"), "{body}");

    // Raw TCP to the IPv6 address of the tcp port: the banner first, then the echo.
    let dst = SocketAddr::new(IpAddr::V6(vip6), 5432);
    let (first, echo) = ns
        .within(move || tcp_exchange(dst, b"ping6"))
        .await
        .unwrap();
    assert_eq!(first, b"HELLO v6\n");
    assert_eq!(echo, b"ping6");

    // A grpcio channel by name: unary, server streaming and a refused call with its status.
    let out = ns.exec(&[
        "env",
        "-u",
        "http_proxy",
        "-u",
        "https_proxy",
        "-u",
        "grpc_proxy",
        "python3",
        "-c",
        GRPC_APP,
    ]);
    assert!(
        out.status.success(),
        "the grpcio client failed (python3 -m pip install grpcio): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["message"], "hello", "{got}");
    assert_eq!(got["served_by"], "payments-grpc", "{got}");
    assert_eq!(got["served_by_header"], "payments-grpc", "{got}");
    assert!(
        got["xfcc"]
            .as_str()
            .unwrap()
            .contains(&certs.spiffe_id(FRONTEND)),
        "the app saw the client pod's identity: {got}"
    );
    assert_eq!(
        got["stream"],
        serde_json::json!(["tick#0", "tick#1", "tick#2"]),
        "{got}"
    );
    assert_eq!(
        got["refused"],
        serde_json::json!(["FAILED_PRECONDITION", "card declined: insufficient funds"]),
        "{got}"
    );
    assert_eq!(grpc_app.calls.load(Ordering::SeqCst), 3);
}
