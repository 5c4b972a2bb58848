//! Plain TCP: bounded connects (from a chosen source address too), raw reads, and the
//! segments an address sends on loopback.

use std::net::SocketAddr;
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
    socket: socket2::Socket,
}

impl LoopbackSegments {
    pub fn from(from: SocketAddr) -> LoopbackSegments {
        use socket2::{Domain, SockAddr, SockAddrStorage, SockFilter, Socket, Type};
        let SocketAddr::V4(v4) = from else {
            panic!("IPv4 only")
        };
        // Protocol 0 until bound: nothing is queued before the filter is in place.
        let socket = Socket::new(Domain::PACKET, Type::DGRAM, None)
            .unwrap_or_else(|e| panic!("packet socket (needs root): {e}"));
        // IPv4 TCP from `from` only (the packet starts at its IP header). Bound to one protocol
        // (not ETH_P_ALL), the socket sees each loopback packet once, arriving: outgoing copies
        // go only to ETH_P_ALL taps.
        let ip = u32::from(*v4.ip());
        let port = u32::from(v4.port());
        let prog = [
            SockFilter::new(0x30, 0, 0, 9),      // ldb [9]: protocol
            SockFilter::new(0x15, 0, 6, 6),      // jeq TCP
            SockFilter::new(0x20, 0, 0, 12),     // ld [12]: source address
            SockFilter::new(0x15, 0, 4, ip),     // jeq from's address
            SockFilter::new(0xb1, 0, 0, 0),      // ldxb 4*([0]&0xf): IP header length
            SockFilter::new(0x48, 0, 0, 0),      // ldh [x+0]: source port
            SockFilter::new(0x15, 0, 1, port),   // jeq from's port
            SockFilter::new(0x06, 0, 0, 0xffff), // accept
            SockFilter::new(0x06, 0, 0, 0),      // drop
        ];
        socket.attach_filter(&prog).expect("filter");
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut storage = SockAddrStorage::zeroed();
        // SAFETY: `sockaddr_ll` is one of this platform's socket address types, and the length
        // given is its size.
        let lo = unsafe {
            let sll = storage.view_as::<libc::sockaddr_ll>();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = (libc::ETH_P_IP as u16).to_be();
            sll.sll_ifindex = libc::if_nametoindex(c"lo".as_ptr()) as i32;
            SockAddr::new(storage, std::mem::size_of::<libc::sockaddr_ll>() as _)
        };
        socket.bind(&lo).expect("bind to lo");
        LoopbackSegments { socket }
    }

    /// The segments sent to `to`, in order, until one with FIN (or `limit`). Blocking: call
    /// once the exchange is over, when they are all queued.
    pub fn to_fin(&self, to: SocketAddr, limit: Duration) -> Vec<Segment> {
        let SocketAddr::V4(to) = to else {
            panic!("IPv4 only")
        };
        let deadline = std::time::Instant::now() + limit;
        let mut seen = Vec::new();
        let mut buf = [0u8; 65536];
        while std::time::Instant::now() < deadline {
            // A read timeout (nothing more queued) just tries again until the deadline.
            let Ok(n) = std::io::Read::read(&mut &self.socket, &mut buf) else {
                continue;
            };
            if n < 20 {
                continue;
            }
            let p = &buf[..n];
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

/// Reads from `tcp` into `buf` until `buf` holds a whole HTTP/1 head (its blank line); the
/// head's length, or `None` when the connection ended or failed first. Bytes read past the head
/// stay in `buf`.
pub async fn read_http_head<S: AsyncRead + Unpin>(tcp: &mut S, buf: &mut Vec<u8>) -> Option<usize> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(i + 4);
        }
        match tcp.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}
