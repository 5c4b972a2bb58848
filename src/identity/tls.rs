//! BoringSSL contexts built from an `Identity`.
//!
//! Servers (the inbound listener) get one acceptor per chain protocol, because the chain decides
//! which ALPN the server agrees to. Clients (the outbound side) get one connector per client
//! identity; SNI and ALPN are set per connection by the caller.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use boring::ex_data::Index;
use boring::ssl::{
    AlpnError, Ssl, SslAcceptor, SslConnector, SslContextBuilder, SslMethod, SslSession,
    SslSessionCacheMode, SslVerifyMode, SslVersion,
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
    // Resumption with a required client certificate needs a session context; one per chain
    // protocol, so a session never crosses into a chain with other rules.
    b.set_session_id_context(format!("aether-{proto:?}").as_bytes())
        .map_err(|e| format!("session id context: {e}"))?;
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

/// Where a client session may be resumed: the endpoint and the SNI port (each server chain has
/// its own ticket keys).
pub type SessionKey = (SocketAddr, u16);

/// The latest TLS session per endpoint and port of one client context, as Envoy keeps one
/// (`max_session_keys: 1`): a resumed handshake skips certificate signing and verification on
/// both sides. Sessions never outlive their context, so a rotated identity starts afresh.
#[derive(Default)]
pub struct Sessions(Mutex<HashMap<SessionKey, SslSession>>);

impl Sessions {
    pub fn get(&self, key: &SessionKey) -> Option<SslSession> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    fn put(&self, key: SessionKey, session: SslSession) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, session);
    }

    /// Forgets a session the peer no longer takes (or that a failed connection used).
    pub fn forget(&self, key: &SessionKey) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    }
}

/// The `SessionKey` a connection is made for, so the new-session callback knows where to file
/// the tickets it receives.
pub fn session_key_index() -> Index<Ssl, SessionKey> {
    static INDEX: OnceLock<Index<Ssl, SessionKey>> = OnceLock::new();
    *INDEX.get_or_init(|| Ssl::new_ex_index().expect("an ex_data index"))
}

/// A client context and its session cache.
pub struct Client {
    pub ctx: SslConnector,
    pub sessions: Arc<Sessions>,
}

/// The client context for one client identity. The peer chain is verified against the bundle
/// during a full handshake; the caller pins the peer's SPIFFE id afterwards, on resumed
/// connections too (`san::has_uri_san` on the session's peer certificate).
pub fn connector(id: &Identity) -> Result<Client, String> {
    let mut b = SslConnector::builder(SslMethod::tls()).map_err(|e| format!("connector: {e}"))?;
    common(&mut b, id)?;
    b.set_verify(SslVerifyMode::PEER);
    let sessions = Arc::new(Sessions::default());
    b.set_session_cache_mode(SslSessionCacheMode::CLIENT);
    let cache = sessions.clone();
    b.set_new_session_callback(move |ssl, session| {
        if let Some(key) = ssl.ex_data(session_key_index()) {
            cache.put(*key, session);
        }
    });
    Ok(Client {
        ctx: b.build(),
        sessions,
    })
}

/// ALPN wire list with the caller's own protocol first (SPEC "Upstream connection").
pub fn alpn_wire(h2_first: bool) -> &'static [u8] {
    if h2_first {
        b"\x02h2\x08http/1.1"
    } else {
        b"\x08http/1.1\x02h2"
    }
}
