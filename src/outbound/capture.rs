//! Connections the pod's rules redirected to the outbound listener (SPEC section 10), decided
//! by their original destination before any client byte is awaited:
//!
//! 1. the listener's own address (or no conntrack entry): an explicit client, served as
//!    always (not here);
//! 2. a service's virtual address on a port the service marks `tcp`: a tunnel to that service
//!    and port at once, as `CONNECT` opens one (`tunnel::open`), so the server may speak first;
//! 3. a service's virtual address on another port: HTTP/1 or h2 routed by Host, as an explicit
//!    client's (a portless Host takes the destination port when the service exposes it);
//!    anything else is closed and counted;
//! 4. any other destination: `outbound.egress` (closed without a byte, or connected as is).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use tokio::net::TcpStream;

use super::cluster::{ActiveGuard, Cluster};
use super::connect::Upstream;
use super::metrics::{self, EgressLabels};
use super::tunnel;
use crate::accesslog::metrics::count_request;
use crate::accesslog::ConnLog;
use crate::config::{Egress, Locality};
use crate::drain::Drain;
use crate::http::answer::Reason;
use crate::metrics::Direction;
use crate::sockets::Spliced;

/// Captured apps share the pod's address: per-source identities (SPEC section 3) are for
/// explicit clients only, so captured connections present the workload's own identity.
pub const CAPTURED_SOURCE: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);

/// How long a passthrough connect may take (the catalog's default connect timeout).
const EGRESS_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where a connection was going, when the pod's rules redirected it here; `None` for an
/// explicit client (its destination is the listener itself, or conntrack has no entry).
pub fn redirected(tcp: &TcpStream, listen: SocketAddr) -> Option<SocketAddr> {
    let dst = match crate::capture::original_dst::original_dst(tcp, listen.is_ipv6()) {
        Ok(d) => d,
        // A dual-stack listener's IPv4 clients have an IPv4 conntrack entry.
        Err(_) if listen.is_ipv6() => {
            crate::capture::original_dst::original_dst(tcp, false).ok()?
        }
        Err(_) => return None,
    };
    let own = if listen.ip().is_unspecified() {
        tcp.local_addr().ok()?
    } else {
        listen
    };
    let same = dst.ip().to_canonical() == own.ip().to_canonical() && dst.port() == own.port();
    (!same).then_some(dst)
}

/// A captured connection whose port's protocol cannot be known (e.g. the control plane did not
/// answer for it): closed, since guessing could hand a tcp port HTTP or the reverse.
pub fn unresolved(service: &str, mesh_domain: &str, port: u16, r: Reason) {
    let authority = format!("{service}.{mesh_domain}:{port}");
    let mut log = ConnLog::new(Direction::outbound, "capture", authority);
    log.error = Some(r.as_str());
    count(service, 0, r.status().as_u16());
    log.finish(&Spliced::refused());
}

/// A tunnel to the service's tcp port, opened before any client byte is read (with CONNECT's
/// endpoint choice, retries, breakers and pins), then bytes both ways until either side ends,
/// the idle timeout or the drain's end.
pub async fn tunnel_to(
    up: &Upstream,
    locality: Option<&Locality>,
    cluster: &Cluster,
    drain: &Drain,
    mut tcp: TcpStream,
) {
    let mut log = ConnLog::new(Direction::outbound, "capture", cluster.name.clone());
    let service = &cluster.service;
    let fail = |mut log: ConnLog, r: Reason| {
        count(&service.name, cluster.port, r.status().as_u16());
        log.error = Some(r.as_str());
        log.finish(&Spliced::refused());
    };
    let Some(admitted) = cluster.admit() else {
        return fail(log, Reason::Overflow);
    };
    let no_headers = http::HeaderMap::new();
    let opened = tunnel::open(up, locality, cluster, &no_headers, CAPTURED_SOURCE);
    let (mut tls, slot, ep) = match opened.await {
        Ok(v) => v,
        Err(r) => return fail(log, r),
    };
    log.upstream = Some(ep.address);
    log.peer_identity = Some(service.identity.clone());
    let held = (ActiveGuard::new(ep.clone()), admitted, slot);
    count(&service.name, cluster.port, 200);
    let idle = crate::http::limits::timers().tunnel_idle;
    tls.batch_writes();
    let spliced = crate::sockets::splice(&mut tcp, &mut tls, idle, "outbound", drain).await;
    drop(held);
    log.finish(&spliced);
}

/// The first bytes of a captured connection to a service's HTTP port (`Guarded::first_bytes`):
/// true when they look like HTTP/1 or the h2 preface; otherwise the connection is closed,
/// counted here.
pub fn first_bytes_http(first: &[u8]) -> bool {
    if looks_like_http(first) {
        return true;
    }
    tracing::debug!("captured connection to an HTTP port does not speak HTTP; closed");
    metrics::metrics().captured_not_http.inc();
    false
}

/// A destination outside the mesh: `outbound.egress` decides.
pub async fn egress(action: Egress, drain: &Drain, mut tcp: TcpStream, dst: SocketAddr) {
    metrics::metrics()
        .egress
        .get_or_create(&EgressLabels {
            action: action.as_str(),
        })
        .inc();
    let mut log = ConnLog::new(Direction::outbound, "egress", dst.to_string());
    if action == Egress::Deny {
        refuse_with_fin(tcp).await;
        log.error = Some("egress-denied");
        return log.finish(&Spliced::refused());
    }
    // The proxy's own uid is excluded from the rules, so this connect is not captured.
    let far = tokio::time::timeout(EGRESS_CONNECT_TIMEOUT, TcpStream::connect(dst)).await;
    let mut far = match far {
        Ok(Ok(far)) => far,
        failed => {
            if let Ok(Err(e)) = failed {
                tracing::debug!(%dst, "egress connect failed: {e}");
            }
            log.error = Some(Reason::UpstreamConnectFailure.as_str());
            return log.finish(&Spliced::refused());
        }
    };
    crate::sockets::tune(&far);
    log.upstream = Some(dst);
    let idle = crate::http::limits::timers().tunnel_idle;
    let spliced = crate::sockets::splice(&mut tcp, &mut far, idle, "outbound", drain).await;
    log.finish(&spliced);
}

/// How much of what a denied client already sent is read and dropped, and for how long.
const DENY_DRAIN_BYTES: usize = 64 << 10;
const DENY_DRAIN_TIME: Duration = Duration::from_secs(1);

/// Closes a denied connection without a byte, with a FIN: the client's bytes already sent are
/// read and dropped first (a little, briefly), since closing a socket with unread bytes makes
/// the kernel answer with a reset, which a client reports as a broken connection rather than
/// a refused one.
async fn refuse_with_fin(mut tcp: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.shutdown().await;
    let mut buf = [0u8; 4096];
    let mut left = DENY_DRAIN_BYTES;
    let _ = tokio::time::timeout(DENY_DRAIN_TIME, async {
        while let Ok(n @ 1..) = tcp.read(&mut buf).await {
            left = left.saturating_sub(n);
            if left == 0 {
                return;
            }
        }
    })
    .await;
}

/// Counts a captured tcp connection as a request of the service's port (as CONNECT is).
fn count(service: &str, port: u16, code: u16) {
    count_request(Direction::outbound, service, port, code);
}

/// True when `first` (the first bytes a client sent) can begin an HTTP/1 request line (a
/// method token then a space) or the h2 preface (`PRI * ...`). Method tokens are upper case in
/// practice; a database or TLS client's first bytes are not.
pub fn looks_like_http(first: &[u8]) -> bool {
    let token = first.split(|b| *b == b' ').next().unwrap_or_default();
    let method_byte = |b: &u8| b.is_ascii_uppercase() || *b == b'-' || *b == b'_';
    !token.is_empty() && token.len() <= 15 && token.iter().all(method_byte)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_and_the_h2_preface_look_like_http_other_protocols_do_not() {
        for ok in [
            &b"GET / HTTP/1.1\r\n"[..],
            b"POST /x HTTP/1.1",
            b"PRI * HTTP/2.0\r\n",
            b"G",
            b"OPTIONS * HTTP/1.1",
            b"VERSION-CONTROL ",
            // Shaped like a request line: hyper answers it 400 itself.
            b"HELLO WORLD",
        ] {
            assert!(looks_like_http(ok), "{:?}", String::from_utf8_lossy(ok));
        }
        for bad in [
            &b"\x00\x00\x00\x08\x04\xd2\x16\x2f"[..], // a Postgres SSLRequest
            b"\x16\x03\x01\x02\x00\x01",              // a TLS ClientHello
            b"SSH-2.0-OpenSSH_9.2",
            b" GET / HTTP/1.1",
            b"get / HTTP/1.1",
        ] {
            assert!(!looks_like_http(bad), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
