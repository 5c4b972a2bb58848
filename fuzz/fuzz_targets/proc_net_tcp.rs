//! The `/proc/net/tcp{,6}` parser behind readiness: any text gives a port set or a reason; a
//! table it accepts re-renders in the kernel's layout to the same set, and blank lines or the
//! IPv6 spelling of the same rows change nothing.
#![no_main]

use std::collections::BTreeSet;

use aether_proxy::readiness::parse_listening_ports;
use libfuzzer_sys::fuzz_target;

const HEADER: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(ports) = parse_listening_ports(text) else {
        return;
    };
    assert_eq!(
        parse_listening_ports(&format!("{text}\n\n")),
        Ok(ports.clone())
    );
    assert_eq!(
        parse_listening_ports(&render(&ports, false)),
        Ok(ports.clone())
    );
    assert_eq!(parse_listening_ports(&render(&ports, true)), Ok(ports));
});

/// A kernel-shaped table with one LISTEN row per port and one ESTABLISHED row per port.
fn render(ports: &BTreeSet<u16>, v6: bool) -> String {
    let addr = if v6 {
        "0".repeat(32)
    } else {
        "0100007F".to_string()
    };
    let mut out = format!("{HEADER}\n");
    for (i, p) in ports.iter().enumerate() {
        out.push_str(&format!(
            "{i:4}: {addr}:{p:04X} {addr}:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 {i} 1 0000000000000000 100 0 0 10 0\n"
        ));
        out.push_str(&format!(
            "{i:4}: {addr}:{:04X} {addr}:{p:04X} 01 00000000:00000000 00:00000000 00000000  1000        0 {i} 1 0000000000000000 100 0 0 10 0\n",
            p.wrapping_add(1)
        ));
    }
    out
}
