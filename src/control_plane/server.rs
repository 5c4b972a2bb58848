//! The gRPC side: delta ADS served by tonic on a loopback TCP or unix listener, one task per
//! stream driving a [`Session`] with the client's requests and each new catalog.

use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::resources::Snapshot;
use super::session::{Answer, Sent, Session};
use crate::config::GrpcAddress;

/// Requests are small; a client subscribing to thousands of names at once still fits.
const MAX_REQUEST: usize = 16 << 20;
/// How long open streams get to end once a signal asked the server to stop.
const STOP_GRACE: Duration = Duration::from_secs(3);

struct Ads {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    stop: watch::Receiver<bool>,
    streams: Arc<AtomicU64>,
}

type Unserved = Pin<Box<dyn tokio_stream::Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Unserved;

    async fn stream_aggregated_resources(
        &self,
        _: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Unserved>, Status> {
        Err(Status::unimplemented(
            "only the incremental variant is served: DeltaAggregatedResources",
        ))
    }

    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let id = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        // Bounded: a client that stops reading stops its own session, nobody else's.
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(stream(
            id,
            req.into_inner(),
            tx,
            self.snapshots.clone(),
            self.stop.clone(),
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// One stream, until the client ends it or the server stops.
async fn stream(
    id: u64,
    mut inbound: Streaming<DeltaDiscoveryRequest>,
    tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
    mut snapshots: watch::Receiver<Arc<Snapshot>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut session = Session::new(id);
    let mut node = String::new();
    loop {
        let out = tokio::select! {
            m = inbound.message() => match m {
                Ok(Some(req)) => {
                    if let (true, Some(n)) = (node.is_empty(), &req.node) {
                        node = n.id.clone();
                        tracing::info!(stream = id, node = %node, "stream opened");
                    }
                    // Not marked seen: a catalog newer than the session's is still pushed
                    // whole by the branch below.
                    let snap = snapshots.borrow().clone();
                    let handled = session.request(&req, &snap);
                    log_answer(id, &node, handled.answer);
                    if let Some(t) = handled.unknown_type {
                        tracing::warn!(stream = id, node = %node, type_url = %t, "a type this server does not serve; ignored");
                    }
                    handled.responses
                }
                Ok(None) => {
                    tracing::info!(stream = id, node = %node, "stream closed by the client");
                    return;
                }
                Err(e) => {
                    tracing::info!(stream = id, node = %node, "stream ended: {e}");
                    return;
                }
            },
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return;
                }
                let snap = snapshots.borrow_and_update().clone();
                session.update(&snap)
            }
            _ = stop.changed() => return,
        };
        for r in out {
            tracing::debug!(stream = id, node = %node, type_url = %r.type_url, nonce = %r.nonce,
                resources = r.resources.len(), removed = r.removed_resources.len(), "sent");
            if tx.send(Ok(r)).await.is_err() {
                return;
            }
        }
    }
}

fn log_answer(id: u64, node: &str, answer: Option<Answer>) {
    let what = |sent: &Option<Sent>| match sent {
        Some(s) => format!("{:?} {:?} removed {:?}", s.kind, s.names, s.removed),
        None => "an earlier response".into(),
    };
    match answer {
        None => {}
        Some(Answer::Ack { nonce, sent }) => {
            tracing::debug!(stream = id, node = %node, %nonce, "ACK of {}", what(&sent));
        }
        Some(Answer::Nack {
            nonce,
            sent,
            message,
        }) => {
            tracing::warn!(stream = id, node = %node, %nonce, "NACK of {}: {message}", what(&sent));
        }
    }
}

/// Serves on `listen` until `stop` turns true, then lets streams end for a moment.
pub async fn serve(
    listen: &GrpcAddress,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let ads = Ads {
        snapshots,
        stop: stop.clone(),
        streams: Arc::new(AtomicU64::new(0)),
    };
    let service = AggregatedDiscoveryServiceServer::new(ads).max_decoding_message_size(MAX_REQUEST);
    let server = tonic::transport::Server::builder();
    let mut stopped = stop.clone();
    let signal = async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    let served = async {
        match listen {
            GrpcAddress::Tcp(addr) => {
                let l = TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("{addr}: {e}"))?;
                tracing::info!(address = %addr, "serving delta ADS");
                let incoming =
                    tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
                server
                    .serve_with_incoming_shutdown(service, incoming, signal)
                    .await
                    .map_err(|e| e.to_string())
            }
            GrpcAddress::Unix(path) => {
                let l = bind_unix(path)?;
                tracing::info!(address = %listen, "serving delta ADS");
                let incoming = futures_util::stream::unfold(l, |l| async move {
                    let next = l.accept().await.map(|(s, _)| s);
                    Some((next, l))
                });
                let r = server
                    .serve_with_incoming_shutdown(service, incoming, signal)
                    .await
                    .map_err(|e| e.to_string());
                let _ = std::fs::remove_file(path);
                r
            }
        }
    };
    tokio::select! {
        r = served => r,
        _ = async {
            let _ = stop.wait_for(|s| *s).await;
            tokio::time::sleep(STOP_GRACE).await;
        } => {
            tracing::warn!("streams still open after {STOP_GRACE:?}; stopping anyway");
            if let GrpcAddress::Unix(path) = listen {
                let _ = std::fs::remove_file(path);
            }
            Ok(())
        }
    }
}

/// Binds a unix socket, replacing a socket left by a killed predecessor (never another file).
fn bind_unix(path: &Path) -> Result<UnixListener, String> {
    use std::os::unix::fs::FileTypeExt;
    let shown = path.display();
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(format!("{shown}: exists and is not a socket"));
        }
        std::fs::remove_file(path).map_err(|e| format!("{shown}: {e}"))?;
    }
    UnixListener::bind(path).map_err(|e| format!("{shown}: {e}"))
}
