//! BoringSSL contexts built from an `Identity`.
//!
//! Servers (the inbound listener) get one acceptor per chain protocol, because the chain decides
//! which ALPN the server agrees to. Clients (the outbound side) get one connector per client
//! identity; SNI and ALPN are set per connection by the caller.

use boring::ssl::{
    AlpnError, SslAcceptor, SslConnector, SslContextBuilder, SslMethod, SslVerifyMode, SslVersion,
};
use boring::x509::store::X509StoreBuilder;

use super::{san, Identity};
use crate::config::Protocol;

/// Envoy 1.40's default key-exchange preference.
pub const CURVES: &str = "X25519MLKEM768:X25519:P-256";

pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

fn common(b: &mut SslContextBuilder, id: &Identity) -> Result<(), String> {
    let e = |what: &str, err: boring::error::ErrorStack| format!("{what}: {err}");
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|x| e("min version", x))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))
        .map_err(|x| e("max version", x))?;
    b.set_curves_list(CURVES).map_err(|x| e("curves", x))?;
    b.set_certificate(&id.chain[0])
        .map_err(|x| e("certificate", x))?;
    for extra in &id.chain[1..] {
        b.add_extra_chain_cert(extra.clone())
            .map_err(|x| e("chain", x))?;
    }
    b.set_private_key(&id.key).map_err(|x| e("key", x))?;
    b.check_private_key().map_err(|x| e("key", x))?;
    let mut store = X509StoreBuilder::new().map_err(|x| e("store", x))?;
    for ca in &id.ca {
        store
            .add_cert(ca.clone())
            .map_err(|x| e("trust bundle", x))?;
    }
    b.set_cert_store(store.build());
    Ok(())
}

/// The acceptor for one inbound chain protocol. The client certificate is required, must chain
/// to the bundle and must carry a SPIFFE id in `trust_domain`.
pub fn acceptor(id: &Identity, trust_domain: &str, proto: Protocol) -> Result<SslAcceptor, String> {
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls())
        .map_err(|e| format!("acceptor: {e}"))?;
    common(&mut b, id)?;
    let td = trust_domain.to_string();
    b.set_verify_callback(
        SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT,
        move |ok, ctx| {
            if !ok {
                return false;
            }
            // Intermediates only need to chain; the identity lives in the leaf.
            if ctx.error_depth() != 0 {
                return true;
            }
            match ctx.current_cert().and_then(|c| c.to_der().ok()) {
                Some(der) => san::spiffe_id_in(&der, &td).is_some(),
                None => false,
            }
        },
    );
    b.set_alpn_select_callback(move |_, client| select_alpn(proto, client));
    Ok(b.build())
}

/// Server-side ALPN by chain: `h2` chains only take h2, `http1` only http/1.1, `auto` the
/// client's first choice of the two, `tcp` nothing.
pub fn select_alpn(proto: Protocol, client: &[u8]) -> Result<&[u8], AlpnError> {
    let want = |p: &[u8]| p == ALPN_H2 || p == ALPN_HTTP1;
    let offered = AlpnIter(client);
    let pick = match proto {
        Protocol::H2 => AlpnIter(client).find(|p| *p == ALPN_H2),
        Protocol::Http1 => AlpnIter(client).find(|p| *p == ALPN_HTTP1),
        Protocol::Auto => offered.into_iter().find(|p| want(p)),
        Protocol::Tcp => None,
    };
    pick.ok_or(AlpnError::NOACK)
}

/// Iterates the protocols of an ALPN wire-format list.
struct AlpnIter<'a>(&'a [u8]);

impl<'a> Iterator for AlpnIter<'a> {
    type Item = &'a [u8];
    fn next(&mut self) -> Option<&'a [u8]> {
        let (&len, rest) = self.0.split_first()?;
        let len = len as usize;
        if rest.len() < len {
            self.0 = &[];
            return None;
        }
        let (p, rest) = rest.split_at(len);
        self.0 = rest;
        Some(p)
    }
}

/// The client context for one client identity. The peer chain is verified against the bundle
/// during the handshake; the caller pins the peer's SPIFFE id afterwards (`san::has_uri_san`).
pub fn connector(id: &Identity) -> Result<SslConnector, String> {
    let mut b = SslConnector::builder(SslMethod::tls()).map_err(|e| format!("connector: {e}"))?;
    common(&mut b, id)?;
    b.set_verify(SslVerifyMode::PEER);
    Ok(b.build())
}

/// ALPN wire list with the caller's own protocol first (SPEC "Upstream connection").
pub fn alpn_wire(h2_first: bool) -> &'static [u8] {
    if h2_first {
        b"\x02h2\x08http/1.1"
    } else {
        b"\x08http/1.1\x02h2"
    }
}
