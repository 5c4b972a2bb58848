//! gRPC channels to the control plane: a unix socket, a loopback TCP address (plaintext, as
//! node agents serve), or any other TCP address over mTLS with the workload's identity
//! (BoringSSL, like every other TLS connection of the proxy).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Status, Streaming};

use crate::config::GrpcAddress;
use crate::identity::IdentityStore;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Reconnect backoff for control-plane streams: full jitter, from 0.5 s doubling up to 5 s
/// (SPEC section 9). `failures` counts the attempts since the server last answered.
pub fn backoff(failures: u32) -> Duration {
    const BASE: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(5);
    let cap = BASE
        .saturating_mul(1u32 << failures.min(16).saturating_sub(1))
        .min(MAX);
    cap.mul_f64(fastrand::f64())
}

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("{addr}: {source}")]
    Connect {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("{addr}: mTLS to a non-local control plane needs the workload identity first")]
    NoIdentity { addr: String },
}

/// Connects to `addr`; `identity` is used for mTLS when the address is not local.
pub async fn connect(
    addr: &GrpcAddress,
    identity: Option<Arc<IdentityStore>>,
) -> Result<Channel, ChannelError> {
    let name = addr.to_string();
    let err = |source| ChannelError::Connect {
        addr: name.clone(),
        source,
    };
    match addr {
        GrpcAddress::Unix(path) => {
            let path = path.clone();
            // The URI is required by the API and unused: the connector ignores it.
            Endpoint::from_static("http://control-plane")
                .connect_timeout(CONNECT_TIMEOUT)
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        Ok::<_, io::Error>(TokioIo::new(
                            tokio::net::UnixStream::connect(path).await?,
                        ))
                    }
                }))
                .await
                .map_err(err)
        }
        GrpcAddress::Tcp(hostport) if addr.is_local() => {
            Endpoint::from_shared(format!("http://{hostport}"))
                .map_err(err)?
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
                .connect()
                .await
                .map_err(err)
        }
        GrpcAddress::Tcp(hostport) => {
            let identity =
                identity.ok_or_else(|| ChannelError::NoIdentity { addr: name.clone() })?;
            let target = hostport.clone();
            Endpoint::from_shared(format!("http://{hostport}"))
                .map_err(err)?
                .connect_timeout(CONNECT_TIMEOUT)
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let (identity, target) = (identity.clone(), target.clone());
                    async move { mtls(&identity, &target).await.map(TokioIo::new) }
                }))
                .await
                .map_err(err)
        }
    }
}

/// TCP, then TLS with the workload's client certificate, ALPN h2, the server chain verified
/// against the trust bundle (a control plane has no mesh SAN to pin).
async fn mtls(
    identity: &IdentityStore,
    target: &str,
) -> io::Result<tokio_boring::SslStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(target).await?;
    crate::sockets::tune(&tcp);
    let contexts = identity.current();
    let mut cfg = contexts
        .connector_for(None)
        .ctx
        .configure()
        .map_err(io::Error::other)?;
    cfg.set_alpn_protos(b"\x02h2").map_err(io::Error::other)?;
    cfg.set_verify_hostname(false);
    let host = target.rsplit_once(':').map_or(target, |(h, _)| h);
    tokio_boring::connect(cfg, host, tcp)
        .await
        .map_err(|e| io::Error::other(e.to_string()))
}

type Opening<T> =
    Pin<Box<dyn Future<Output = Result<tonic::Response<Streaming<T>>, Status>> + Send>>;

/// The response side of a streaming call, opened as it is read.
///
/// A tonic call resolves only once the server's response headers arrive, and gRPC servers
/// (grpc-go, grpcio, gRPC C++) send those with the first response message. An xDS server
/// answers nothing before the client's first request, so a client that awaits the call before
/// it sends would wait for ever. The call is started at once (its request stream flows from
/// then on) and awaited inside [`Responses::message`], which the session polls beside its
/// demand; requests never wait on headers.
pub struct Responses<T> {
    state: ResponseState<T>,
}

enum ResponseState<T> {
    Opening(Opening<T>),
    Open(Box<Streaming<T>>),
}

impl<T> Responses<T> {
    /// Starts `call` (it is first polled by the first `message`).
    pub fn new(
        call: impl Future<Output = Result<tonic::Response<Streaming<T>>, Status>> + Send + 'static,
    ) -> Responses<T> {
        Responses {
            state: ResponseState::Opening(Box::pin(call)),
        }
    }

    /// The next response: `Ok(None)` once the server ended the stream. Cancel-safe: a call
    /// still opening stays where it was.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        if let ResponseState::Opening(call) = &mut self.state {
            let streaming = call.as_mut().await?.into_inner();
            self.state = ResponseState::Open(Box::new(streaming));
        }
        match &mut self.state {
            ResponseState::Open(streaming) => streaming.message().await,
            ResponseState::Opening(_) => unreachable!("replaced above"),
        }
    }
}
