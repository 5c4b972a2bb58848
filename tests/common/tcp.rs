//! Plain TCP: bounded connects (from a chosen source address too), raw reads, and the
//! segments an address sends on loopback.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;

use super::{within, IO_TIMEOUT};

pub async fn tcp_connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let tcp = within(
        IO_TIMEOUT,
        &format!("connect {addr}"),
        TcpStream::connect(addr),
    )
    .await?
    .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// TCP connect from a chosen local address (e.g. a pod's [`PodNet::extra`] host, for
/// `source_identities`), bounded by [`IO_TIMEOUT`].
pub async fn tcp_connect_from(local: IpAddr, addr: SocketAddr) -> Result<TcpStream, String> {
    let sock = match local {
        IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(|e| format!("socket: {e}"))?;
    sock.bind(SocketAddr::new(local, 0))
        .map_err(|e| format!("bind {local}: {e}"))?;
    let tcp = within(IO_TIMEOUT, &format!("connect {addr}"), sock.connect(addr))
        .await?
        .map_err(|e| format!("connect {addr} from {local}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// How a read-until-end ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadEnd {
    /// Clean end of stream.
    Eof,
    /// A read error (reset, TLS alert, ...), with its text.
    Error(String),
    /// Still open when the bound passed.
    TimedOut,
}

/// Reads until EOF, an error or `limit`; returns what was read and how it ended.
pub async fn read_to_end_within<S: AsyncRead + Unpin>(
    s: &mut S,
    limit: Duration,
) -> (Vec<u8>, ReadEnd) {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return (out, ReadEnd::TimedOut),
            Ok(Ok(0)) => return (out, ReadEnd::Eof),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => return (out, ReadEnd::Error(e.to_string())),
        }
    }
}

/// One TCP segment seen on loopback: its flags and how many payload bytes it carried.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub fin: bool,
    pub payload: usize,
}

/// The TCP segments one address sends on loopback, read from a packet socket (root only)
/// whose kernel filter keeps only that source, so other tests' traffic cannot crowd them out.
/// Open it before the connection whose segments it should see.
pub struct LoopbackSegments {
    fd: std::os::fd::OwnedFd,
}

impl LoopbackSegments {
    pub fn from(from: SocketAddr) -> LoopbackSegments {
        use std::os::fd::FromRawFd;
        let SocketAddr::V4(v4) = from else {
            panic!("IPv4 only")
        };
        // SAFETY: plain socket calls on a descriptor this function owns; every pointer is to
        // a live local of the size passed with it.
        unsafe {
            // Protocol 0 until bound: nothing is queued before the filter is in place.
            let raw = libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
            assert!(
                raw >= 0,
                "packet socket (needs root): {}",
                std::io::Error::last_os_error()
            );
            let fd = std::os::fd::OwnedFd::from_raw_fd(raw);
            // IPv4 TCP from `from` only (the packet starts at its IP header).
            let ip = u32::from(*v4.ip());
            let port = u32::from(v4.port());
            let code = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
            let prog = [
                code(0x30, 0, 0, 9),      // ldb [9]: protocol
                code(0x15, 0, 6, 6),      // jeq TCP
                code(0x20, 0, 0, 12),     // ld [12]: source address
                code(0x15, 0, 4, ip),     // jeq from's address
                code(0xb1, 0, 0, 0),      // ldxb 4*([0]&0xf): IP header length
                code(0x48, 0, 0, 0),      // ldh [x+0]: source port
                code(0x15, 0, 1, port),   // jeq from's port
                code(0x06, 0, 0, 0xffff), // accept
                code(0x06, 0, 0, 0),      // drop
            ];
            let fprog = libc::sock_fprog {
                len: prog.len() as u16,
                filter: prog.as_ptr() as *mut libc::sock_filter,
            };
            let r = libc::setsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                (&fprog as *const libc::sock_fprog).cast(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            );
            assert_eq!(r, 0, "filter: {}", std::io::Error::last_os_error());
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 100_000,
            };
            let r = libc::setsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            assert_eq!(r, 0);
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = (libc::ETH_P_IP as u16).to_be();
            sll.sll_ifindex = libc::if_nametoindex(c"lo".as_ptr()) as i32;
            let r = libc::bind(
                raw,
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            );
            assert_eq!(r, 0, "bind to lo: {}", std::io::Error::last_os_error());
            LoopbackSegments { fd }
        }
    }

    /// The segments sent to `to`, in order, until one with FIN (or `limit`). Blocking: call
    /// once the exchange is over, when they are all queued.
    pub fn to_fin(&self, to: SocketAddr, limit: Duration) -> Vec<Segment> {
        use std::os::fd::AsRawFd;
        let SocketAddr::V4(to) = to else {
            panic!("IPv4 only")
        };
        let deadline = std::time::Instant::now() + limit;
        let mut seen = Vec::new();
        let mut buf = [0u8; 65536];
        while std::time::Instant::now() < deadline {
            // SAFETY: recvfrom into a live buffer and a sockaddr_ll of the size passed.
            let (n, sll) = unsafe {
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                let n = libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    (&mut sll as *mut libc::sockaddr_ll).cast(),
                    &mut len,
                );
                (n, sll)
            };
            // Loopback shows each packet twice, leaving and arriving; count it arriving.
            if n < 20 || sll.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            let p = &buf[..n as usize];
            let ihl = usize::from(p[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
            let dst = std::net::Ipv4Addr::new(p[16], p[17], p[18], p[19]);
            let t = &p[ihl..];
            let dport = u16::from_be_bytes([t[2], t[3]]);
            if dst != *to.ip() || dport != to.port() {
                continue;
            }
            let doff = usize::from(t[12] >> 4) * 4;
            let fin = t[13] & 0x01 != 0;
            seen.push(Segment {
                fin,
                payload: total - ihl - doff,
            });
            if fin {
                break;
            }
        }
        seen
    }
}
