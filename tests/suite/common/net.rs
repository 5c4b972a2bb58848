//! Loopback addressing: one /24 per test, handed out by one allocator, pods inside it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// The second octets [`Net::fresh`] hands out: `127.100.0.0/16 ..= 127.199.0.0/16`, far from
/// `127.0.x.x` (left to the example configs in `configs/` and to people running the proxy by
/// hand).
const SECOND_OCTETS: std::ops::RangeInclusive<u8> = 100..=199;
/// How many /24s there are to hand out.
const NETS: usize = 100 * 256;
/// The port of the claim listener on host 0 of a /24 (no pod uses host 0).
pub const CLAIM_PORT: u16 = 15999;

/// The claim listeners of this process, kept open until it exits.
static CLAIMS: Mutex<Vec<TcpListener>> = Mutex::new(Vec::new());
/// How many /24s this process has tried so far; the walk goes on from there.
static TRIED: AtomicUsize = AtomicUsize::new(0);

/// One test's loopback /24, `127.a.b.0/24`, claimed by [`Net::fresh`].
#[derive(Debug, Clone, Copy)]
pub struct Net {
    a: u8,
    b: u8,
}

impl Net {
    /// Claims a loopback /24 no other test (in this process or any other) is using.
    ///
    /// The claim is a TCP listener on `127.a.b.0:`[`CLAIM_PORT`]: only one socket can listen
    /// there, so whoever binds it owns the /24. The walk over `127.100.0.0 ..= 127.199.255.0`
    /// starts at a point derived from the process id (concurrent test processes start apart)
    /// and goes on where this process's last claim left off, skipping /24s that are taken.
    /// The listener stays open until the process exits, so a claim outlives its `Net` and
    /// every [`PodNet`] copied out of it, and no /24 is handed out twice by one process.
    pub fn fresh() -> Net {
        static START: OnceLock<usize> = OnceLock::new();
        let start = *START.get_or_init(|| std::process::id() as usize % NETS);
        loop {
            let tried = TRIED.fetch_add(1, Ordering::Relaxed);
            assert!(
                tried < NETS,
                "every loopback /24 in 127.100-199.x.0 is taken (claims on port {CLAIM_PORT}); \
                 is something else listening on 0.0.0.0:{CLAIM_PORT}?"
            );
            let i = (start + tried) % NETS;
            let net = Net {
                a: *SECOND_OCTETS.start() + (i / 256) as u8,
                b: (i % 256) as u8,
            };
            let claim = SocketAddr::new(net.ip(0), CLAIM_PORT);
            match TcpListener::bind(claim) {
                Ok(l) => {
                    CLAIMS.lock().unwrap_or_else(|e| e.into_inner()).push(l);
                    return net;
                }
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => continue,
                Err(e) => panic!(
                    "cannot claim {claim} for a test's loopback /24 ({e}); the tests need all \
                     of 127.0.0.0/8 on the loopback interface, as Linux has it"
                ),
            }
        }
    }

    /// `127.a.b.<host>`.
    pub fn ip(&self, host: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, self.a, self.b, host))
    }

    /// Pod `i` (0..=15) of this test.
    pub fn pod(&self, i: u8) -> PodNet {
        assert!(i < 16, "pod index {i} is not in 0..=15");
        PodNet {
            net: *self,
            base: 16 * i,
        }
    }
}

/// The addresses of one pod: its apps, its proxy's three listeners and spare hosts.
#[derive(Debug, Clone, Copy)]
pub struct PodNet {
    net: Net,
    base: u8,
}

impl PodNet {
    /// Where the pod's apps listen; the proxy's `inbound.app_host`.
    pub fn app_host(&self) -> IpAddr {
        self.net.ip(self.base + 1)
    }
    pub fn app(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.app_host(), port)
    }
    /// The proxy's address (all three of its listeners).
    pub fn proxy_ip(&self) -> IpAddr {
        self.net.ip(self.base + 2)
    }
    pub fn inbound(&self) -> SocketAddr {
        SocketAddr::new(self.proxy_ip(), 15008)
    }
    pub fn outbound(&self) -> SocketAddr {
        SocketAddr::new(self.proxy_ip(), 15001)
    }
    pub fn admin(&self) -> SocketAddr {
        SocketAddr::new(self.proxy_ip(), 15000)
    }
    /// Spare host `k` (0..=12) of this pod, e.g. a client's source address.
    pub fn extra(&self, k: u8) -> IpAddr {
        assert!(k <= 12, "extra host {k} is not in 0..=12");
        self.net.ip(self.base + 3 + k)
    }
    /// The `inbound:`, `outbound:` and `admin:` sections for this pod, as YAML: every listener
    /// on [`PodNet::proxy_ip`], `inbound.app_host` = [`PodNet::app_host`], and `inbound.ports`
    /// from `ports`, each a YAML flow mapping such as `"{ port: 9090, protocol: h2 }"` (empty:
    /// the key is left out, so the proxy's default applies).
    pub fn listeners_yaml(&self, default_port: u16, ports: &[&str]) -> String {
        let mut y = format!(
            "inbound:\n  listen: {}\n  app_host: {}\n  default_port: {default_port}\n",
            self.inbound(),
            self.app_host()
        );
        if !ports.is_empty() {
            y.push_str("  ports:\n");
            for p in ports {
                y.push_str(&format!("    - {p}\n"));
            }
        }
        y.push_str(&format!(
            "outbound:\n  listen: {}\nadmin:\n  listen: {}\n",
            self.outbound(),
            self.admin()
        ));
        y
    }
}
