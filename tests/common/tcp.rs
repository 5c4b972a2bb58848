//! Plain TCP: bounded connects (from a chosen source address too) and raw reads.

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
