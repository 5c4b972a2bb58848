//! The TLS client side: a BoringSSL client with a chosen identity, SNI and ALPN, and a tap on
//! the raw bytes the server sent (plaintext alerts).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use boring::ssl::{SslConnector, SslFiletype, SslMethod, SslVerifyMode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::{spiffe_ids_of, tcp_connect, within, Certs, IO_TIMEOUT};

/// A TCP stream that keeps a copy of the first bytes it read (up to 64 KiB), so a test can see
/// exactly what the server sent, e.g. a plaintext alert before any TLS state exists.
pub struct Tap<S> {
    inner: S,
    read: Arc<Mutex<Vec<u8>>>,
}

const TAP_LIMIT: usize = 64 * 1024;

impl<S> Tap<S> {
    pub fn new(inner: S) -> Tap<S> {
        Tap {
            inner,
            read: Arc::new(Mutex::new(Vec::new())),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tap<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let mut rec = this.read.lock().unwrap();
            let new = &buf.filled()[before..];
            let room = TAP_LIMIT.saturating_sub(rec.len());
            rec.extend_from_slice(&new[..new.len().min(room)]);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A client-side TLS connection made by [`TlsClient`].
pub type TlsStream = tokio_boring::SslStream<Tap<TcpStream>>;

/// Why a TLS connection attempt failed.
#[derive(Debug)]
pub struct TlsFailure {
    /// BoringSSL's error, or the I/O error / timeout.
    pub error: String,
    /// The raw bytes the server sent before the failure.
    pub received: Vec<u8>,
}

impl TlsFailure {
    /// The description of the fatal alert the server sent in plaintext as its first record
    /// (e.g. 112 = `unrecognized_name`), if it did.
    pub fn plaintext_alert(&self) -> Option<u8> {
        alert_description(&self.received)
    }
}

/// If `bytes` starts with a complete TLS alert record, its description byte.
pub fn alert_description(bytes: &[u8]) -> Option<u8> {
    match bytes {
        [0x15, 0x03, _, 0x00, 0x02, _level, desc, ..] => Some(*desc),
        _ => None,
    }
}

/// The TLS alert number of `unrecognized_name` (RFC 6066).
pub const ALERT_UNRECOGNIZED_NAME: u8 = 112;

/// A BoringSSL client: chosen client certificate (or none), SNI (or none), ALPN list; the server
/// is verified against the given CA, hostname verification is off (the mesh pins SPIFFE ids;
/// see [`peer_spiffe_id`]).
#[derive(Debug, Clone)]
pub struct TlsClient {
    ca: PathBuf,
    cert: Option<(PathBuf, PathBuf)>,
    sni: Option<String>,
    alpn: Vec<String>,
}

impl TlsClient {
    /// Trusts `ca` for the server; no client certificate, no SNI, no ALPN.
    pub fn new(ca: &Path) -> TlsClient {
        TlsClient {
            ca: ca.to_path_buf(),
            cert: None,
            sni: None,
            alpn: Vec::new(),
        }
    }
    /// Trusts `certs`' CA and presents its leaf `stem`.
    pub fn with_identity(certs: &Certs, stem: &str) -> TlsClient {
        TlsClient::new(&certs.ca()).cert(&certs.cert(stem), &certs.key(stem))
    }
    /// Presents this certificate chain and key.
    pub fn cert(mut self, cert: &Path, key: &Path) -> TlsClient {
        self.cert = Some((cert.to_path_buf(), key.to_path_buf()));
        self
    }
    /// Presents no certificate.
    pub fn no_cert(mut self) -> TlsClient {
        self.cert = None;
        self
    }
    /// The SNI to send; `None` sends no server_name extension at all.
    pub fn sni(mut self, sni: Option<&str>) -> TlsClient {
        self.sni = sni.map(str::to_string);
        self
    }
    /// ALPN protocols to offer, in preference order; empty offers no ALPN extension.
    pub fn alpn(mut self, protos: &[&str]) -> TlsClient {
        self.alpn = protos.iter().map(|p| p.to_string()).collect();
        self
    }

    /// The connector this client's settings make; [`TlsClient::connect_using`] takes it, so
    /// a test that opens thousands of connections builds it once.
    pub fn connector(&self) -> Result<SslConnector, String> {
        fn e(what: &'static str) -> impl Fn(boring::error::ErrorStack) -> String {
            move |err| format!("{what}: {err}")
        }
        let mut b = SslConnector::builder(SslMethod::tls()).map_err(e("connector"))?;
        b.set_ca_file(&self.ca).map_err(e("CA file"))?;
        b.set_verify(SslVerifyMode::PEER);
        if let Some((cert, key)) = &self.cert {
            b.set_certificate_chain_file(cert)
                .map_err(e("client certificate"))?;
            b.set_private_key_file(key, SslFiletype::PEM)
                .map_err(e("client key"))?;
        }
        if !self.alpn.is_empty() {
            let mut wire = Vec::new();
            for p in &self.alpn {
                wire.push(p.len() as u8);
                wire.extend_from_slice(p.as_bytes());
            }
            b.set_alpn_protos(&wire).map_err(e("ALPN"))?;
        }
        Ok(b.build())
    }

    fn config(
        &self,
        connector: &SslConnector,
    ) -> Result<boring::ssl::ConnectConfiguration, String> {
        Ok(connector
            .configure()
            .map_err(|err| format!("configure: {err}"))?
            .verify_hostname(false)
            .use_server_name_indication(self.sni.is_some()))
    }

    /// TCP connect plus TLS handshake, each bounded by [`IO_TIMEOUT`].
    ///
    /// With TLS 1.3 the server checks the client certificate after the client has finished, so
    /// a refused client certificate usually shows up on the first read, not here.
    pub async fn connect(&self, addr: SocketAddr) -> Result<TlsStream, TlsFailure> {
        let connector = self.connector().map_err(|error| TlsFailure {
            error,
            received: Vec::new(),
        })?;
        self.connect_using(&connector, addr).await
    }

    /// As [`TlsClient::connect`], with a connector made by [`TlsClient::connector`].
    pub async fn connect_using(
        &self,
        connector: &SslConnector,
        addr: SocketAddr,
    ) -> Result<TlsStream, TlsFailure> {
        let fail = |error: String| TlsFailure {
            error,
            received: Vec::new(),
        };
        let cfg = self.config(connector).map_err(fail)?;
        let tcp = tcp_connect(addr).await.map_err(fail)?;
        let tap = Tap::new(tcp);
        let received = tap.read.clone();
        let domain = self.sni.clone().unwrap_or_else(|| "no-sni.invalid".into());
        match within(
            IO_TIMEOUT,
            "TLS handshake",
            tokio_boring::connect(cfg, &domain, tap),
        )
        .await
        {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(TlsFailure {
                error: e.to_string(),
                received: received.lock().unwrap().clone(),
            }),
            Err(e) => Err(TlsFailure {
                error: e,
                received: received.lock().unwrap().clone(),
            }),
        }
    }
}

/// The ALPN protocol the server selected, if any.
pub fn negotiated_alpn(tls: &TlsStream) -> Option<String> {
    tls.ssl()
        .selected_alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned())
}

/// The SPIFFE ids in the server's leaf certificate.
pub fn peer_spiffe_ids(tls: &TlsStream) -> Vec<String> {
    tls.ssl()
        .peer_certificate()
        .and_then(|c| c.to_der().ok())
        .map(|d| spiffe_ids_of(&d))
        .unwrap_or_default()
}

/// The server's single SPIFFE id, if it has exactly one.
pub fn peer_spiffe_id(tls: &TlsStream) -> Option<String> {
    let ids = peer_spiffe_ids(tls);
    (ids.len() == 1).then(|| ids[0].clone())
}
