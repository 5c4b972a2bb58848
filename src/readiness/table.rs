//! The kernel's TCP socket tables (`/proc/net/tcp`, `/proc/net/tcp6`): read, and the local
//! ports of their LISTEN entries parsed out, columns located by the header.

use std::collections::BTreeSet;
use std::path::Path;

/// Where the kernel publishes the IPv4 TCP socket table.
pub const PROC_NET_TCP: &str = "/proc/net/tcp";
/// Where the kernel publishes the IPv6 TCP socket table.
pub const PROC_NET_TCP6: &str = "/proc/net/tcp6";

/// The kernel's `st` value for a socket in TCP_LISTEN.
const TCP_LISTEN: u8 = 0x0A;

/// What one socket table yielded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableScan {
    /// The table's path, as it appears in logs and in `NotEnforced`.
    pub path: String,
    /// The local ports in LISTEN state, or why the table could not be used.
    pub result: Result<BTreeSet<u16>, String>,
}

/// Reads both tables. A missing tcp6 (IPv6 disabled) is an empty table; a
/// missing tcp is a failure like any other.
pub fn scan_tables(tcp: &Path, tcp6: &Path) -> Vec<TableScan> {
    vec![read_table(tcp, false), read_table(tcp6, true)]
}

/// Reads one table and collects its listening ports.
pub fn read_table(path: &Path, absent_is_empty: bool) -> TableScan {
    let result = match std::fs::read_to_string(path) {
        Ok(text) => parse_listening_ports(&text),
        Err(err) if absent_is_empty && err.kind() == std::io::ErrorKind::NotFound => {
            Ok(BTreeSet::new())
        }
        Err(err) => Err(err.to_string()),
    };
    TableScan {
        path: path.display().to_string(),
        result,
    }
}

/// Parses a `/proc/net/tcp{,6}` table and returns the local ports of its
/// LISTEN entries. Columns are located by the header, which must look like
/// the kernel's; any row that does not fit makes the whole table untrusted.
pub fn parse_listening_ports(text: &str) -> Result<BTreeSet<u16>, String> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines
        .next()
        .ok_or("empty table: no header line")?
        .split_whitespace()
        .collect();
    // The kernel's header starts with "sl". Only the columns up to "st" line
    // up with row fields one to one (later headers name halves of a field),
    // and those are the only ones needed.
    let column = |name: &str| header.iter().position(|h| *h == name);
    let (local_col, state_col) = match (header.first(), column("local_address"), column("st")) {
        (Some(&"sl"), Some(local), Some(st)) => (local, st),
        _ => return Err("header is not the kernel's format".to_string()),
    };

    let mut listening = BTreeSet::new();
    // Line numbers count from 1 and include the header.
    for (index, line) in lines.enumerate() {
        let line_no = index + 2;
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.is_empty() {
            continue;
        }
        let (Some(local), Some(state)) = (fields.get(local_col), fields.get(state_col)) else {
            return Err(format!("line {line_no}: too few fields"));
        };
        let state =
            parse_hex_u8(state).ok_or_else(|| format!("line {line_no}: bad state {state:?}"))?;
        let port = parse_local_port(local)
            .ok_or_else(|| format!("line {line_no}: bad local address {local:?}"))?;
        if state == TCP_LISTEN {
            listening.insert(port);
        }
    }
    Ok(listening)
}

/// `ADDR:PORT` with ADDR 8 (IPv4) or 32 (IPv6) hex digits and PORT 4.
fn parse_local_port(field: &str) -> Option<u16> {
    let (addr, port) = field.rsplit_once(':')?;
    let addr_ok = (addr.len() == 8 || addr.len() == 32) && is_hex(addr);
    if !addr_ok || port.len() != 4 || !is_hex(port) {
        return None;
    }
    u16::from_str_radix(port, 16).ok()
}

fn parse_hex_u8(field: &str) -> Option<u8> {
    if field.len() != 2 || !is_hex(field) {
        return None;
    }
    u8::from_str_radix(field, 16).ok()
}

fn is_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readiness::tests::fixture;

    #[test]
    fn parser_reads_ports_by_header_columns() {
        let tcp6 = std::fs::read_to_string(fixture("tcp6_listen_8080")).expect("fixture");
        let ports = parse_listening_ports(&tcp6).expect("kernel format");
        assert_eq!(ports, BTreeSet::from([8080, 5432]));

        let tcp = std::fs::read_to_string(fixture("tcp_listen_8080")).expect("fixture");
        let ports = parse_listening_ports(&tcp).expect("kernel format");
        assert_eq!(ports, BTreeSet::from([8080, 15000, 15001, 15008]));

        assert!(parse_listening_ports("").is_err());
        // The right column names are not enough without the leading "sl".
        let no_sl = "local_address rem_address st\n00000000:1F90 00000000:0000 0A\n";
        assert!(parse_listening_ports(no_sl).is_err());
        let bad_port =
            "  sl  local_address rem_address   st\n   0: 00000000:1F9G 00000000:0000 0A\n";
        assert!(parse_listening_ports(bad_port).is_err());
    }

    #[test]
    fn parser_accepts_this_machines_tables() {
        // Guards against the fixtures drifting from what the kernel writes.
        for path in [PROC_NET_TCP, PROC_NET_TCP6] {
            let scan = read_table(Path::new(path), true);
            assert!(scan.result.is_ok(), "{path}: {:?}", scan.result);
        }
    }
}
