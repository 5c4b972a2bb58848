//! Names outside the mesh go to the resolvers the pod had before the proxy: the nameservers of
//! `/etc/resolv.conf`, asked over UDP first and over TCP when the UDP answer is truncated. The
//! query bytes are relayed unchanged, so the client's id and flags come back as it sent them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::{timeout_at, Instant};

/// How long all upstreams together get for one query (SPEC section 10).
pub const DEADLINE: Duration = Duration::from_secs(2);

/// The largest UDP answer read from an upstream. Larger datagrams arrive cut and count as
/// truncated, so the TCP retry fetches them whole.
const MAX_UDP_ANSWER: usize = 4096;

/// glibc reads at most three nameservers; so do we.
const MAX_SERVERS: usize = 3;

/// The nameservers of resolv.conf text, port 53, in file order. `own` (the DNS listener) is
/// skipped, so a pod whose resolv.conf names the proxy does not forward to itself. No
/// nameserver line means the local one, as for glibc.
pub fn nameservers(resolv_conf: &str, own: SocketAddr) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    let mut any = false;
    for line in resolv_conf.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        any = true;
        // A link-local IPv6 address may carry a `%zone`: not reachable without it, so skipped.
        let Some(Ok(ip)) = words.next().map(str::parse::<IpAddr>) else {
            continue;
        };
        let addr = SocketAddr::new(ip, 53);
        if addr != own && !out.contains(&addr) && out.len() < MAX_SERVERS {
            out.push(addr);
        }
    }
    let local = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 53);
    if !any && local != own {
        out.push(local);
    }
    out
}

/// An upstream's answer to `query`, or `None` when none answered before `deadline`. Each
/// server gets an even share of the time left.
pub async fn exchange(servers: &[SocketAddr], query: &[u8], deadline: Instant) -> Option<Vec<u8>> {
    for (i, server) in servers.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let until = Instant::now() + left / (servers.len() - i) as u32;
        match timeout_at(until, udp(*server, query)).await {
            Ok(Ok((answer, false))) => return Some(answer),
            Ok(Ok((cut, true))) => {
                // The rest of this server's share goes to TCP; a cut answer still beats none.
                match timeout_at(until, tcp(*server, query)).await {
                    Ok(Ok(whole)) => return Some(whole),
                    _ if cut.len() < MAX_UDP_ANSWER => return Some(cut),
                    _ => continue,
                }
            }
            Ok(Err(e)) => tracing::debug!(%server, "dns upstream: {e}"),
            Err(_) => tracing::debug!(%server, "dns upstream: no answer in time"),
        }
    }
    None
}

/// True when `answer` is an answer (QR set) to the query with id `id`.
fn answers(answer: &[u8], id: [u8; 2]) -> bool {
    answer.len() >= 12 && answer[..2] == id && answer[2] & 0x80 != 0
}

/// One UDP exchange: the answer, and whether it was truncated (TC set, or cut by our buffer).
async fn udp(server: SocketAddr, query: &[u8]) -> std::io::Result<(Vec<u8>, bool)> {
    let local: SocketAddr = match server {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    // A fresh socket (random port) per query: with the query id, that is what keeps a
    // spoofed answer out, as in any stub resolver.
    let sock = UdpSocket::bind(local).await?;
    sock.connect(server).await?;
    sock.send(query).await?;
    let id = [query[0], query[1]];
    let mut buf = vec![0u8; MAX_UDP_ANSWER];
    loop {
        let n = sock.recv(&mut buf).await?;
        if !answers(&buf[..n], id) {
            continue; // a stray or stale datagram; keep waiting for ours
        }
        let truncated = buf[2] & 0x02 != 0 || n == MAX_UDP_ANSWER;
        buf.truncate(n);
        return Ok((buf, truncated));
    }
}

/// One TCP exchange (two-byte length prefix, RFC 1035 4.2.2).
async fn tcp(server: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut conn = TcpStream::connect(server).await?;
    conn.set_nodelay(true).ok();
    let len = u16::try_from(query.len()).map_err(std::io::Error::other)?;
    let mut out = Vec::with_capacity(query.len() + 2);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(query);
    conn.write_all(&out).await?;
    let len = conn.read_u16().await? as usize;
    let mut answer = vec![0u8; len];
    conn.read_exact(&mut answer).await?;
    if !answers(&answer, [query[0], query[1]]) {
        return Err(std::io::Error::other("answer does not match the query"));
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_nameservers() {
        let own: SocketAddr = "127.0.0.1:15053".parse().unwrap();
        let text = "# generated\nsearch default.svc.cluster.local\nnameserver 10.96.0.10\n\
                    options ndots:5\n; comment\nnameserver fe80::1%eth0\nnameserver ::1\n\
                    nameserver 10.96.0.10\nnameserver 10.0.0.2\nnameserver 10.0.0.3\n";
        let got = nameservers(text, own);
        let want: Vec<SocketAddr> = ["10.96.0.10:53", "[::1]:53", "10.0.0.2:53"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(got, want);
        assert_eq!(
            nameservers("search x\n", own),
            vec!["127.0.0.1:53".parse().unwrap()]
        );
        // The listener itself is never an upstream.
        let own53: SocketAddr = "127.0.0.1:53".parse().unwrap();
        assert!(nameservers("nameserver 127.0.0.1\n", own53).is_empty());
        assert!(nameservers("", own53).is_empty());
    }
}
