//! The transport: tonic serving delta ADS and SDS on a TCP or unix listener, and connections the
//! test can cut at once (a killed control plane closes its connections, it does not drain them).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::{
    SecretDiscoveryService, SecretDiscoveryServiceServer,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::body::Body;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status, Streaming};

use super::state::State;

/// Where a control plane listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl Listen {
    /// The address as a proxy config spells it: `host:port` or `unix:///path`.
    pub fn config_address(&self) -> String {
        match self {
            Listen::Tcp(a) => a.to_string(),
            Listen::Unix(p) => format!("unix://{}", p.display()),
        }
    }
}

struct Ads(Arc<State>);
struct Sds(Arc<State>);

type Stream<T> = UnboundedReceiverStream<Result<T, Status>>;
type Unimplemented<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Unimplemented<DiscoveryResponse>;
    async fn stream_aggregated_resources(
        &self,
        _: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "state-of-the-world ADS is not served here; use DeltaAggregatedResources",
        ))
    }

    type DeltaAggregatedResourcesStream = Stream<DeltaDiscoveryResponse>;
    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        let state = self.0.clone();
        let id = state.lock().open_ads(tx.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    m = inbound.message() => match m {
                        Ok(Some(m)) => state.lock().on_delta(id, m),
                        _ => break,
                    },
                    _ = tx.closed() => break,
                }
            }
            state.lock().close(id);
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl SecretDiscoveryService for Sds {
    type DeltaSecretsStream = Unimplemented<DeltaDiscoveryResponse>;
    async fn delta_secrets(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented(
            "delta SDS is not served here; use StreamSecrets",
        ))
    }

    type StreamSecretsStream = Stream<DiscoveryResponse>;
    async fn stream_secrets(
        &self,
        req: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        let state = self.0.clone();
        let id = state.lock().open_sds(tx.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    m = inbound.message() => match m {
                        Ok(Some(m)) => state.lock().on_sds(id, m),
                        _ => break,
                    },
                    _ = tx.closed() => break,
                }
            }
            state.lock().close(id);
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn fetch_secrets(
        &self,
        _: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented("use StreamSecrets"))
    }
}

/// Both services on one listener: requests go by the gRPC service in their path.
#[derive(Clone)]
struct Both {
    ads: AggregatedDiscoveryServiceServer<Ads>,
    sds: SecretDiscoveryServiceServer<Sds>,
}

type BoxResponse =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send + 'static>>;

impl tower_service::Service<http::Request<Body>> for Both {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxResponse;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: http::Request<Body>) -> BoxResponse {
        if req
            .uri()
            .path()
            .starts_with("/envoy.service.secret.v3.SecretDiscoveryService/")
        {
            Box::pin(self.sds.call(req))
        } else {
            Box::pin(self.ads.call(req))
        }
    }
}

/// A serving control plane: the accept loop and the switch that cuts its connections.
pub struct Running {
    kill: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Running {
    /// Cuts every connection, stops accepting, and returns once the listener is closed.
    pub async fn stop(mut self) {
        let _ = self.kill.send(true);
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.kill.send(true);
        self.task.abort();
    }
}

/// Binds `listen` and serves ADS and SDS on it.
pub async fn serve(state: Arc<State>, listen: &Listen) -> Running {
    let (kill, kill_rx) = watch::channel(false);
    let svc = Both {
        ads: AggregatedDiscoveryServiceServer::new(Ads(state.clone())),
        sds: SecretDiscoveryServiceServer::new(Sds(state)),
    };
    let server = tonic::transport::Server::builder();
    let task = match listen {
        Listen::Tcp(addr) => {
            let l = TcpListener::bind(addr)
                .await
                .unwrap_or_else(|e| panic!("control plane cannot bind {addr}: {e}"));
            let incoming = futures_util::stream::unfold((l, kill_rx), |(l, k)| async move {
                let r = l.accept().await.map(|(s, _)| {
                    let _ = s.set_nodelay(true);
                    Cuttable::new(s, k.clone())
                });
                Some((r, (l, k)))
            });
            tokio::spawn(async move {
                let _ = server.serve_with_incoming(svc, incoming).await;
            })
        }
        Listen::Unix(path) => {
            let _ = std::fs::remove_file(path);
            let l = UnixListener::bind(path)
                .unwrap_or_else(|e| panic!("control plane cannot bind {}: {e}", path.display()));
            let incoming = futures_util::stream::unfold((l, kill_rx), |(l, k)| async move {
                let r = l.accept().await.map(|(s, _)| Cuttable::new(s, k.clone()));
                Some((r, (l, k)))
            });
            let path = path.clone();
            tokio::spawn(async move {
                let _cleanup = RemoveOnDrop(path);
                let _ = server.serve_with_incoming(svc, incoming).await;
            })
        }
    };
    Running { kill, task }
}

/// Removes a unix socket's file when the server stops, so clients see it gone.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A connection that fails every read and write once the kill switch is set, so the server's
/// connection task ends and the socket closes (a killed process, not a graceful drain).
struct Cuttable<T> {
    io: T,
    cut: Pin<Box<dyn Future<Output = ()> + Send>>,
    is_cut: bool,
}

impl<T> Cuttable<T> {
    fn new(io: T, mut kill: watch::Receiver<bool>) -> Cuttable<T> {
        Cuttable {
            io,
            cut: Box::pin(async move {
                let _ = kill.wait_for(|k| *k).await;
            }),
            is_cut: false,
        }
    }

    fn check(&mut self, cx: &mut Context<'_>) -> Result<(), io::Error> {
        if !self.is_cut && self.cut.as_mut().poll(cx).is_ready() {
            self.is_cut = true;
        }
        if self.is_cut {
            Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "control plane stopped",
            ))
        } else {
            Ok(())
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Cuttable<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Cuttable<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T> Connected for Cuttable<T> {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}
