//! Loopback addressing: one /24 per test, pods inside it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// The `suite` octet of each test file (`127.<suite>.<test>.<host>`).
pub mod suite {
    pub const INBOUND: u8 = 1;
    pub const OUTBOUND: u8 = 2;
    pub const DRAIN: u8 = 3;
    pub const READINESS: u8 = 4;
    pub const ADMIN: u8 = 5;
    pub const CLI: u8 = 6;
    pub const LIVE: u8 = 7;
}

/// One test's loopback /24: `127.<suite>.<test>.0/24`.
#[derive(Debug, Clone, Copy)]
pub struct Net {
    suite: u8,
    test: u8,
}

impl Net {
    pub fn new(suite: u8, test: u8) -> Net {
        assert!(
            suite >= 1,
            "suite 0 (127.0.x.x) is reserved for configs/ and manual runs"
        );
        assert!(
            (1..=254).contains(&test),
            "test number {test} is not in 1..=254"
        );
        Net { suite, test }
    }

    /// `127.<suite>.<test>.<host>`.
    pub fn ip(&self, host: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, self.suite, self.test, host))
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
