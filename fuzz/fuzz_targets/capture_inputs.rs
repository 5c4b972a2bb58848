//! What the capture side reads from the pod it runs in: the rules `redirect` writes for any
//! flags, applied over any `iptables-save` text (never a panic; the output always ends with
//! the one jump into our chain), and the nameservers of any `resolv.conf` (never the DNS
//! listener itself, at most three, all on port 53).
#![no_main]

use std::net::SocketAddr;

use aether_proxy::capture::redirect::{clean_input, Family, Rules};
use aether_proxy::dns::forward::nameservers;
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    proxy_uid: u32,
    outbound_port: u16,
    dns_port: Option<u16>,
    exclude_ports: Vec<u16>,
    v6: bool,
    saved: String,
    resolv_conf: String,
}

fuzz_target!(|input: Input| {
    let rules = Rules {
        proxy_uid: input.proxy_uid,
        outbound_port: input.outbound_port,
        dns_port: input.dns_port,
        exclude_ports: input.exclude_ports,
    };
    let family = if input.v6 { Family::V6 } else { Family::V4 };
    let out = rules.apply_input(family, &input.saved);
    assert!(out.starts_with("*nat\n"), "{out}");
    assert!(out.ends_with("COMMIT\n"), "{out}");
    // Each line is one rule or chain: nothing from `saved` may break a line apart.
    assert!(out.lines().all(|l| l.starts_with(['*', ':', '-']) || l == "COMMIT"), "{out}");
    let _ = clean_input(&input.saved);

    let own: SocketAddr = "127.0.0.1:53".parse().unwrap();
    let servers = nameservers(&input.resolv_conf, own);
    assert!(servers.len() <= 3);
    assert!(servers.iter().all(|s| *s != own && s.port() == 53));
});
