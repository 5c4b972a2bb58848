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
    AlpnError, ConnectConfiguration, Ssl, SslAcceptor, SslAlert, SslConnector, SslContextBuilder,
    SslMethod, SslRef, SslSession, SslSessionCacheMode, SslVerifyError, SslVerifyMode, SslVersion,
};
use boring::x509::store::{X509Store, X509StoreBuilder};
use boring::x509::X509;

use super::san;
use super::workload::{Identity, IdentityError};

/// Envoy 1.40's default key-exchange preference.
pub const CURVES: &str = "X25519MLKEM768:X25519:P-256";

/// Session tickets a server sends after each TLS 1.3 handshake.
pub const SERVER_TICKETS: usize = 1;

pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// What both sides share: the versions and the key-exchange groups.
fn common(b: &mut SslContextBuilder) -> Result<(), IdentityError> {
    let e = IdentityError::tls;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(e("min version"))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))
        .map_err(e("max version"))?;
    b.set_curves_list(CURVES).map_err(e("curves"))?;
    Ok(())
}

/// The trust bundle (`Identity::ca`) as a verifier's store.
fn bundle(cas: &[X509]) -> Result<X509Store, IdentityError> {
    let mut store = X509StoreBuilder::new().map_err(IdentityError::tls("store"))?;
    for ca in cas {
        store
            .add_cert(ca.clone())
            .map_err(IdentityError::tls("trust bundle"))?;
    }
    Ok(store.build())
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
    // Certificates as buffers, not `X509` objects. With objects, every session resumed from a
    // ticket would parse the client's leaf into one and free it again, a cost paid on every
    // new connection, though nothing reads it: the chain is verified below on full handshakes
    // only, and the data path reads the leaf's DER (`peer_leaf_der`).
    // SAFETY: nothing calls an `X509`-object function on this context or its connections:
    // the builder's own such calls panic on a buffers context, and the inbound side reads
    // peers with `peer_leaf_der` only.
    let method = unsafe { SslMethod::tls_with_buffer() };
    let mut b =
        SslAcceptor::mozilla_intermediate_v5(method).map_err(IdentityError::tls("acceptor"))?;
    common(&mut b)?;
    own_chain_as_buffers(&mut b, id)?;
    let (bundle, td) = (bundle(&id.ca)?, trust_domain.to_string());
    b.set_custom_verify_callback(
        SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT,
        move |ssl| verify_client(ssl, &bundle, &td),
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

/// The server's chain and key, set as buffers (`acceptor`).
fn own_chain_as_buffers(b: &mut SslContextBuilder, id: &Identity) -> Result<(), IdentityError> {
    use foreign_types::ForeignTypeRef;
    let e = IdentityError::tls;
    let mut bufs = Vec::with_capacity(id.chain.len());
    for cert in &id.chain {
        let der = cert.to_der().map_err(e("certificate"))?;
        // SAFETY: BoringSSL copies `der` into a new buffer, which `bufs` owns until freed below.
        let buf =
            unsafe { boring_sys::CRYPTO_BUFFER_new(der.as_ptr(), der.len(), std::ptr::null_mut()) };
        if buf.is_null() {
            break;
        }
        bufs.push(buf);
    }
    // SAFETY: a valid SSL_CTX owned by the builder, `bufs` live buffers and `id.key` a live
    // key; BoringSSL takes its own references to each.
    let set = bufs.len() == id.chain.len()
        && unsafe {
            boring_sys::SSL_CTX_set_chain_and_key(
                b.as_ptr(),
                bufs.as_ptr(),
                bufs.len(),
                id.key.as_ptr(),
                std::ptr::null(),
            )
        } == 1;
    for buf in bufs {
        // SAFETY: each buffer was made above and is freed once.
        unsafe { boring_sys::CRYPTO_BUFFER_free(buf) };
    }
    if !set {
        return Err(e("certificate")(boring::error::ErrorStack::get()));
    }
    Ok(())
}

/// The inbound verifier, run on full handshakes (a resumed one was verified when its session
/// began): the client's chain must reach the bundle, as BoringSSL's own verifier would check
/// it for a server, and its leaf must prove exactly one SPIFFE id of `trust_domain`.
fn verify_client(
    ssl: &SslRef,
    bundle: &X509Store,
    trust_domain: &str,
) -> Result<(), SslVerifyError> {
    use boring::stack::Stack;
    use boring::x509::X509StoreContext;
    let refuse = |alert| Err(SslVerifyError::Invalid(alert));
    let Some(leaf_der) = peer_leaf_der(ssl) else {
        return refuse(SslAlert::CERTIFICATE_REQUIRED);
    };
    let Ok(leaf) = X509::from_der(leaf_der) else {
        return refuse(SslAlert::BAD_CERTIFICATE);
    };
    let Ok(mut sent) = Stack::new() else {
        return refuse(SslAlert::INTERNAL_ERROR);
    };
    for der in (1..).map_while(|i| peer_der(ssl, i)) {
        let Ok(cert) = X509::from_der(der) else {
            return refuse(SslAlert::BAD_CERTIFICATE);
        };
        if sent.push(cert).is_err() {
            return refuse(SslAlert::INTERNAL_ERROR);
        }
    }
    let verdict = X509StoreContext::new().and_then(|mut ctx| {
        ctx.init(bundle, &leaf, &sent, |c| {
            use foreign_types::ForeignTypeRef;
            // The checks a server makes of a client's chain (the leaf's extended key usage
            // allows clientAuth), as BoringSSL's verifier sets them.
            // SAFETY: `c` is an initialised store context; the name is a static C string.
            let purpose = unsafe {
                boring_sys::X509_STORE_CTX_set_default(c.as_ptr(), c"ssl_client".as_ptr())
            };
            if purpose != 1 {
                return Ok((false, None));
            }
            Ok((c.verify_cert()?, c.verify_result().err()))
        })
    });
    match verdict {
        Ok((true, _)) => {}
        Ok((false, why)) => {
            let alert = why.map_or(SslAlert::CERTIFICATE_UNKNOWN, |e| {
                tracing::debug!("inbound: client certificate refused: {e}");
                alert_for(e.as_raw())
            });
            return refuse(alert);
        }
        Err(_) => return refuse(SslAlert::INTERNAL_ERROR),
    }
    match san::leaf_id_in(leaf_der, trust_domain) {
        Ok(_) => Ok(()),
        Err(e) => {
            // Refused at the handshake, so no request ever carries an empty XFCC.
            tracing::debug!("inbound: client certificate refused: {e}");
            super::metrics::identity_refused("inbound");
            // A sound certificate that is not one workload of this mesh. (BoringSSL's own
            // verifier, failed from its callback, answered internal_error: the server's fault.)
            refuse(SslAlert::BAD_CERTIFICATE)
        }
    }
}

/// The alert BoringSSL's own verifier sends for an `X509_V_ERR_*` code.
fn alert_for(verify_error: std::os::raw::c_int) -> SslAlert {
    // SAFETY: a pure lookup.
    let raw = unsafe { boring_sys::SSL_alert_from_verify_result(verify_error.into()) };
    let known = [
        (
            boring_sys::SSL_AD_CERTIFICATE_EXPIRED,
            SslAlert::CERTIFICATE_EXPIRED,
        ),
        (
            boring_sys::SSL_AD_BAD_CERTIFICATE,
            SslAlert::BAD_CERTIFICATE,
        ),
        (boring_sys::SSL_AD_DECRYPT_ERROR, SslAlert::DECRYPT_ERROR),
        (boring_sys::SSL_AD_UNKNOWN_CA, SslAlert::UNKNOWN_CA),
        (
            boring_sys::SSL_AD_CERTIFICATE_REVOKED,
            SslAlert::CERTIFICATE_REVOKED,
        ),
        (
            boring_sys::SSL_AD_UNSUPPORTED_CERTIFICATE,
            SslAlert::UNSUPPORTED_CERTIFICATE,
        ),
        (
            boring_sys::SSL_AD_HANDSHAKE_FAILURE,
            SslAlert::HANDSHAKE_FAILURE,
        ),
        (boring_sys::SSL_AD_INTERNAL_ERROR, SslAlert::INTERNAL_ERROR),
    ];
    known
        .into_iter()
        .find(|(r, _)| *r as std::os::raw::c_int == raw)
        .map_or(SslAlert::CERTIFICATE_UNKNOWN, |(_, a)| a)
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
            super::metrics::metrics().tls_client_sessions.inc();
        }
    }

    /// Forgets a session the peer no longer takes (or that a failed connection used).
    pub fn forget(&self, key: &SessionKey) {
        if self.map().remove(key).is_some() {
            super::metrics::metrics().tls_client_sessions.dec();
        }
    }

    /// Keeps only the sessions `keep` accepts (the endpoints still in the catalog).
    pub fn retain(&self, mut keep: impl FnMut(&SessionKey) -> bool) {
        let mut map = self.map();
        let before = map.len();
        map.retain(|k, _| keep(k));
        let gone = before - map.len();
        if gone > 0 {
            super::metrics::metrics()
                .tls_client_sessions
                .dec_by(gone as i64);
        }
    }
}

impl Drop for Sessions {
    fn drop(&mut self) {
        let n = self.map().len();
        super::metrics::metrics()
            .tls_client_sessions
            .dec_by(n as i64);
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
    common(&mut b)?;
    let e = IdentityError::tls;
    b.set_certificate(&id.chain[0]).map_err(e("certificate"))?;
    for extra in &id.chain[1..] {
        b.add_extra_chain_cert(extra.clone()).map_err(e("chain"))?;
    }
    b.set_private_key(&id.key).map_err(e("key"))?;
    b.check_private_key().map_err(e("key"))?;
    b.set_cert_store(bundle(&id.ca)?);
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

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
        KeyUsagePurpose, SanType,
    };
    use time::{Duration, OffsetDateTime};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    const TD: &str = "aether.local";
    const SERVER_ID: &str = "spiffe://aether.local/ns/default/sa/payments";
    const CLIENT_ID: &str = "spiffe://aether.local/ns/default/sa/frontend";

    /// A signing CA: the root of a bundle or an intermediate.
    struct Ca {
        issuer: Issuer<'static, KeyPair>,
        pem: String,
    }

    fn name(cn: &str) -> DistinguishedName {
        let mut n = DistinguishedName::new();
        n.push(DnType::CommonName, cn);
        n
    }

    fn root(cn: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        p.distinguished_name = name(cn);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        let pem = p.self_signed(&key).unwrap().pem();
        Ca {
            issuer: Issuer::new(p, key),
            pem,
        }
    }

    fn intermediate(parent: &Ca, cn: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        p.distinguished_name = name(cn);
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        p.use_authority_key_identifier_extension = true;
        let pem = p.signed_by(&key, &parent.issuer).unwrap().pem();
        Ca {
            issuer: Issuer::new(p, key),
            pem,
        }
    }

    /// A workload leaf for `uri`, valid until `not_after`: its PEM and key PEM.
    fn leaf(ca: &Ca, uri: &str, not_after: OffsetDateTime) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut p =
            crate::identity::certgen::leaf_params(vec![SanType::URI(uri.try_into().unwrap())]);
        p.distinguished_name = name("workload");
        p.not_before =
            (OffsetDateTime::now_utc() - Duration::days(1)).min(not_after - Duration::days(30));
        p.not_after = not_after;
        (
            p.signed_by(&key, &ca.issuer).unwrap().pem(),
            key.serialize_pem(),
        )
    }

    fn identity(chain_pem: &str, key_pem: &str, bundle: &Ca, td: &str) -> Identity {
        Identity::from_pem(
            chain_pem.as_bytes(),
            key_pem.as_bytes(),
            bundle.pem.as_bytes(),
            td,
        )
        .unwrap()
    }

    fn in_a_year() -> OffsetDateTime {
        OffsetDateTime::now_utc() + Duration::days(365)
    }

    /// What one connection to the mesh acceptor came to, as each side saw it.
    #[derive(Debug)]
    struct Outcome {
        /// The leaf DER the server read from the connection, or its handshake error.
        server: Result<Vec<u8>, String>,
        /// The server's byte, or the error the client read instead.
        client: Result<u8, String>,
        resumed: bool,
    }

    /// One connection from `client` (its sessions filed under one key) to `server`.
    async fn connect(server: &SslAcceptor, client: &Client) -> Outcome {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = server.clone();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut tls = tokio_boring::accept(&acceptor, tcp)
                .await
                .map_err(|e| e.to_string())?;
            let der = peer_leaf_der(tls.ssl()).map(<[u8]>::to_vec);
            tls.write_all(b"x").await.unwrap();
            let _ = tls.read(&mut [0u8; 1]).await;
            der.ok_or_else(|| "no peer leaf".to_string())
        });
        let mut cfg = client.ctx.configure().unwrap();
        // One key for every connection, so the next one offers this one's session.
        offer(
            &mut cfg,
            &client.sessions,
            (([127, 0, 0, 1], 1).into(), 9090),
        );
        cfg.set_verify_hostname(false);
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (client, resumed) = match tokio_boring::connect(cfg, "9090", tcp).await {
            Ok(mut tls) => {
                let mut b = [0u8; 1];
                let got = tls.read_exact(&mut b).await.map(|_| b[0]);
                let resumed = tls.ssl().session_reused();
                drop(tls);
                (got.map_err(|e| e.to_string()), resumed)
            }
            Err(e) => (Err(e.to_string()), false),
        };
        Outcome {
            server: server.await.unwrap(),
            client,
            resumed,
        }
    }

    fn der_of(pem: &str) -> Vec<u8> {
        X509::from_pem(pem.as_bytes()).unwrap().to_der().unwrap()
    }

    /// The acceptor of a pod whose identity `bundle` signed.
    fn mesh_server(bundle: &Ca) -> SslAcceptor {
        let (crt, key) = leaf(bundle, SERVER_ID, in_a_year());
        let id = identity(&crt, &key, bundle, TD);
        acceptor(&id, TD, 9090, ServerAlpn::Refuse).unwrap()
    }

    /// The server reads the client's leaf on full and resumed handshakes alike, and takes a
    /// leaf that chains to the bundle through an intermediate the client sends with it.
    #[tokio::test]
    async fn the_acceptor_reads_the_client_leaf_on_full_and_resumed_handshakes() {
        let bundle = root("mesh root");
        let server = mesh_server(&bundle);

        let (crt, key) = leaf(&bundle, CLIENT_ID, in_a_year());
        let direct = connector(&identity(&crt, &key, &bundle, TD)).unwrap();
        let first = connect(&server, &direct).await;
        assert_eq!(first.server.as_deref(), Ok(&der_of(&crt)[..]), "{first:?}");
        assert_eq!(first.client, Ok(b'x'));
        assert!(!first.resumed);
        let again = connect(&server, &direct).await;
        assert!(again.resumed, "{again:?}");
        assert_eq!(again.server.as_deref(), Ok(&der_of(&crt)[..]), "{again:?}");

        let mid = intermediate(&bundle, "mesh intermediate");
        let (crt, key) = leaf(&mid, CLIENT_ID, in_a_year());
        let chained =
            connector(&identity(&format!("{crt}{}", mid.pem), &key, &bundle, TD)).unwrap();
        let via = connect(&server, &chained).await;
        assert_eq!(via.server.as_deref(), Ok(&der_of(&crt)[..]), "{via:?}");
        assert_eq!(via.client, Ok(b'x'));
    }

    /// Each way a client leaf fails is refused at the handshake, with the alert that says
    /// why: another CA, an expired leaf, an intermediate the client did not send, another
    /// trust domain, no certificate at all.
    #[tokio::test]
    async fn the_acceptor_refuses_each_bad_client_leaf_with_its_alert() {
        let bundle = root("mesh root");
        let server = mesh_server(&bundle);

        let stranger = root("another root");
        let mid = intermediate(&bundle, "mesh intermediate");
        let expired = OffsetDateTime::now_utc() - Duration::days(1);
        let other_td = "spiffe://other.local/ns/default/sa/frontend";
        let cases = [
            (
                "another CA",
                leaf(&stranger, CLIENT_ID, in_a_year()),
                TD,
                "UNKNOWN_CA",
            ),
            (
                "expired",
                leaf(&bundle, CLIENT_ID, expired),
                TD,
                "CERTIFICATE_EXPIRED",
            ),
            (
                "no intermediate",
                leaf(&mid, CLIENT_ID, in_a_year()),
                TD,
                "UNKNOWN_CA",
            ),
            (
                "another trust domain",
                leaf(&bundle, other_td, in_a_year()),
                "other.local",
                "BAD_CERTIFICATE",
            ),
        ];
        for (what, (crt, key), td, alert) in cases {
            let client = connector(&identity(&crt, &key, &bundle, td)).unwrap();
            let out = connect(&server, &client).await;
            let heard = out.client.expect_err(what);
            assert!(heard.contains(alert), "{what}: the client heard {heard}");
            assert!(out.server.is_err(), "{what}: {:?}", out.server);
        }

        // No certificate: a client context with the bundle and nothing to prove.
        let mut b = SslConnector::builder(SslMethod::tls()).unwrap();
        let ca = X509::from_pem(bundle.pem.as_bytes()).unwrap();
        b.set_cert_store(super::bundle(&[ca]).unwrap());
        let bare = Client {
            ctx: b.build(),
            sessions: Arc::new(Sessions::default()),
        };
        let out = connect(&server, &bare).await;
        let heard = out.client.expect_err("no certificate");
        assert!(
            heard.contains("CERTIFICATE_REQUIRED"),
            "the client heard {heard}"
        );
    }
}
