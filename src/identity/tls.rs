//! BoringSSL contexts built from an `Identity`.
//!
//! Servers (the inbound listener) get one acceptor per served port: the port's chain decides
//! which ALPN the server agrees to, and each context has its own session-ticket keys, so a
//! session never resumes into another port's chain. Clients (the outbound side) get one
//! connector per client identity; SNI and ALPN are set per connection by the caller.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use boring::ex_data::Index;
use boring::ssl::{
    AlpnError, ConnectConfiguration, Ssl, SslAcceptor, SslConnector, SslContextBuilder, SslMethod,
    SslRef, SslSession, SslSessionCacheMode, SslVerifyMode, SslVersion,
};
use boring::x509::store::X509StoreBuilder;

use super::san;
use super::workload::{Identity, IdentityError};

/// Envoy 1.40's default key-exchange preference.
pub const CURVES: &str = "X25519MLKEM768:X25519:P-256";

/// Session tickets a server sends after each TLS 1.3 handshake.
pub const SERVER_TICKETS: usize = 1;

pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

fn common(b: &mut SslContextBuilder, id: &Identity) -> Result<(), IdentityError> {
    let e = IdentityError::tls;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(e("min version"))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))
        .map_err(e("max version"))?;
    b.set_curves_list(CURVES).map_err(e("curves"))?;
    b.set_certificate(&id.chain[0]).map_err(e("certificate"))?;
    for extra in &id.chain[1..] {
        b.add_extra_chain_cert(extra.clone()).map_err(e("chain"))?;
    }
    b.set_private_key(&id.key).map_err(e("key"))?;
    b.check_private_key().map_err(e("key"))?;
    let mut store = X509StoreBuilder::new().map_err(e("store"))?;
    for ca in &id.ca {
        store.add_cert(ca.clone()).map_err(e("trust bundle"))?;
    }
    b.set_cert_store(store.build());
    Ok(())
}

/// The DER of the peer's leaf as the handshake (or the resumed session) holds it, borrowed
/// from the connection: no `X509` object is made for it and nothing is copied.
pub fn peer_leaf_der(ssl: &SslRef) -> Option<&[u8]> {
    peer_der(ssl, 0)
}

/// The DER of the `i`th certificate the peer sent, the leaf first.
fn peer_der(ssl: &SslRef, i: usize) -> Option<&[u8]> {
    use foreign_types::ForeignTypeRef;
    // SAFETY: `ssl` is a live SSL. The stack and its buffers belong to its session, which
    // lives as long as the connection, and so as long as the borrow of `ssl`.
    unsafe {
        let chain = boring_sys::SSL_get0_peer_certificates(ssl.as_ptr());
        if chain.is_null() || i >= boring_sys::OPENSSL_sk_num(chain.cast()) {
            return None;
        }
        let cert =
            boring_sys::OPENSSL_sk_value(chain.cast(), i) as *const boring_sys::CRYPTO_BUFFER;
        let (data, len) = (
            boring_sys::CRYPTO_BUFFER_data(cert),
            boring_sys::CRYPTO_BUFFER_len(cert),
        );
        if data.is_null() {
            return None;
        }
        Some(std::slice::from_raw_parts(data, len))
    }
}

/// Which ALPN protocol a server context agrees to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerAlpn {
    /// Only this protocol; a client that does not offer it gets no ALPN.
    Only(&'static [u8]),
    /// The client's first choice of h2 and http/1.1.
    ClientFirst,
    /// No ALPN at all (raw TCP chains).
    Refuse,
}

/// The acceptor for one served port. The client certificate is required, must chain to the
/// bundle and must carry a SPIFFE id in `trust_domain`.
pub fn acceptor(
    id: &Identity,
    trust_domain: &str,
    port: u16,
    alpn: ServerAlpn,
) -> Result<SslAcceptor, IdentityError> {
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls())
        .map_err(IdentityError::tls("acceptor"))?;
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
            let Some(der) = ctx.current_cert().and_then(|c| c.to_der().ok()) else {
                return false;
            };
            match san::leaf_id_in(&der, &td) {
                Ok(_) => true,
                Err(e) => {
                    // Refused at the handshake, so no request ever carries an empty XFCC.
                    tracing::debug!("inbound: client certificate refused: {e}");
                    crate::metrics::get().identity_refused("inbound");
                    false
                }
            }
        },
    );
    b.set_alpn_select_callback(move |_, client| select_alpn(alpn, client));
    // Resumption with a required client certificate needs a session context; one per port,
    // so a session never crosses into a chain with other rules.
    b.set_session_id_context(format!("aether-port-{port}").as_bytes())
        .map_err(IdentityError::tls("session id context"))?;
    // One session ticket per handshake instead of BoringSSL's two: the client keeps one session
    // per endpoint and port and offers it again (`Sessions`), so a second ticket would be
    // serialized, sealed, sent and parsed on every handshake only to replace the first.
    // SAFETY: a valid SSL_CTX owned by the builder; the call only stores a count.
    unsafe { boring_sys::SSL_CTX_set_num_tickets(b.as_ptr(), SERVER_TICKETS) };
    Ok(b.build())
}

/// Server-side ALPN: picks from the client's list (wire format) by the server's policy.
pub fn select_alpn(alpn: ServerAlpn, client: &[u8]) -> Result<&[u8], AlpnError> {
    let pick = match alpn {
        ServerAlpn::Only(want) => AlpnIter(client).find(|p| *p == want),
        ServerAlpn::ClientFirst => AlpnIter(client).find(|p| *p == ALPN_H2 || *p == ALPN_HTTP1),
        ServerAlpn::Refuse => None,
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
/// both sides. Sessions never outlive their context, so a rotated identity starts afresh, and
/// the outbound side drops those of endpoints that left the catalog ([`Sessions::retain`]), so
/// the cache stays as large as the mesh, not as large as its history. The process-wide count
/// is `aether_tls_client_sessions`.
#[derive(Default)]
pub struct Sessions(Mutex<HashMap<SessionKey, Resumption>>);

/// What the client remembers of its last handshake with one endpoint and port.
#[derive(Clone)]
struct Resumption {
    session: SslSession,
    /// The key-exchange group the server chose (an IANA group id).
    group: Option<u16>,
}

impl Sessions {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SessionKey, Resumption>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, key: &SessionKey) -> Option<Resumption> {
        self.map().get(key).cloned()
    }

    fn put(&self, key: SessionKey, r: Resumption) {
        if self.map().insert(key, r).is_none() {
            crate::metrics::get().tls_client_sessions.inc();
        }
    }

    /// Forgets a session the peer no longer takes (or that a failed connection used).
    pub fn forget(&self, key: &SessionKey) {
        if self.map().remove(key).is_some() {
            crate::metrics::get().tls_client_sessions.dec();
        }
    }

    /// Keeps only the sessions `keep` accepts (the endpoints still in the catalog).
    pub fn retain(&self, mut keep: impl FnMut(&SessionKey) -> bool) {
        let mut map = self.map();
        let before = map.len();
        map.retain(|k, _| keep(k));
        let gone = before - map.len();
        if gone > 0 {
            crate::metrics::get()
                .tls_client_sessions
                .dec_by(gone as i64);
        }
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Sessions {
    fn drop(&mut self) {
        let n = self.map().len();
        crate::metrics::get().tls_client_sessions.dec_by(n as i64);
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
/// connections too (`san::is_pinned` on the session's peer certificate).
pub fn connector(id: &Identity) -> Result<Client, IdentityError> {
    let mut b = SslConnector::builder(SslMethod::tls()).map_err(IdentityError::tls("connector"))?;
    common(&mut b, id)?;
    b.set_verify(SslVerifyMode::PEER);
    let sessions = Arc::new(Sessions::default());
    b.set_session_cache_mode(SslSessionCacheMode::CLIENT);
    let cache = sessions.clone();
    b.set_new_session_callback(move |ssl, session| {
        if let Some(key) = ssl.ex_data(session_key_index()) {
            let group = ssl.curve();
            cache.put(*key, Resumption { session, group });
        }
    });
    Ok(Client {
        ctx: b.build(),
        sessions,
    })
}

/// Prepares a client connection to `key`: files the tickets it will receive under `key`, and
/// offers what the last handshake there left: its session, and a key share for the group the
/// server chose then and nothing else. Without that BoringSSL sends two shares (the first
/// post-quantum group and the first classical one, X25519MLKEM768 and X25519 here), and the
/// one the server ignores costs an X25519 key generation on every handshake. A server that
/// has changed its mind answers with a HelloRetryRequest, one round trip, and the next
/// handshake offers its new choice.
pub fn offer(cfg: &mut ConnectConfiguration, sessions: &Sessions, key: SessionKey) {
    cfg.set_ex_data(session_key_index(), key);
    let Some(last) = sessions.get(&key) else {
        return;
    };
    // SAFETY: the session came from this very context (each context has its own cache).
    unsafe {
        let _ = cfg.set_session(&last.session);
    }
    if let Some(group) = last.group {
        use foreign_types::ForeignTypeRef;
        // SAFETY: a valid SSL owned by `cfg`; BoringSSL copies the one-element list.
        unsafe {
            boring_sys::SSL_set1_server_supported_groups_hint(cfg.as_ptr(), &group, 1);
        }
    }
}

/// ALPN wire list with the caller's own protocol first (SPEC "Upstream connection").
pub fn alpn_wire(h2_first: bool) -> &'static [u8] {
    if h2_first {
        b"\x02h2\x08http/1.1"
    } else {
        b"\x08http/1.1\x02h2"
    }
}
