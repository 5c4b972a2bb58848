//! Where a connection the pod's REDIRECT rules sent to the outbound listener was going:
//! `SO_ORIGINAL_DST` (IPv4) or `IP6T_SO_ORIGINAL_DST` (IPv6), read from conntrack by the
//! kernel. One `getsockopt` per accepted connection; nothing is allocated.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsRawFd;

/// The destination the client dialled before NAT. An error (ENOENT) means conntrack has no
/// entry for the connection: nothing redirected it. For a connection nobody redirected but
/// that conntrack follows, the answer is the socket's own local address.
pub fn original_dst(socket: &impl AsRawFd, ipv6: bool) -> io::Result<SocketAddr> {
    let fd = socket.as_raw_fd();
    if ipv6 {
        // SAFETY: a zeroed sockaddr_in6 is valid; the kernel writes at most `len` bytes.
        let mut sa: libc::sockaddr_in6 = unsafe { zeroed() };
        let mut len = size_of::<libc::sockaddr_in6>() as libc::socklen_t;
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_IPV6,
                libc::IP6T_SO_ORIGINAL_DST,
                (&mut sa as *mut libc::sockaddr_in6).cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SocketAddr::V6(SocketAddrV6::new(
            Ipv6Addr::from(sa.sin6_addr.s6_addr),
            u16::from_be(sa.sin6_port),
            sa.sin6_flowinfo,
            sa.sin6_scope_id,
        )))
    } else {
        // SAFETY: as above, for sockaddr_in.
        let mut sa: libc::sockaddr_in = unsafe { zeroed() };
        let mut len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_IP,
                libc::SO_ORIGINAL_DST,
                (&mut sa as *mut libc::sockaddr_in).cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
            u16::from_be(sa.sin_port),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_nobody_redirected_is_its_own_destination_or_unknown() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        // Without conntrack loaded the kernel has no entry (an error); with it, the original
        // tuple is the one the socket already has. Either way, never another address.
        if let Ok(dst) = original_dst(&s, false) {
            assert_eq!(dst, s.local_addr().unwrap());
        }
    }
}
