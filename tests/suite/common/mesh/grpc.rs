//! A hand-written gRPC service (no protoc, no codegen): prost messages, tonic's generic
//! server and client, hyper for the connections.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

use crate::common::{tcp_connect, within, IO_TIMEOUT};

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoRequest {
    #[prost(string, tag = "1")]
    pub message: String,
    /// Server streaming: how many replies.
    #[prost(uint32, tag = "2")]
    pub count: u32,
    /// Server streaming: end with a non-OK status after the replies.
    #[prost(bool, tag = "3")]
    pub fail_at_end: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoReply {
    #[prost(string, tag = "1")]
    pub message: String,
    #[prost(uint32, tag = "2")]
    pub seq: u32,
    /// The XFCC the server app received.
    #[prost(string, tag = "3")]
    pub xfcc: String,
    #[prost(string, tag = "4")]
    pub served_by: String,
}

pub const UNARY: &str = "/aether.test.Echo/Unary";
pub const STREAM: &str = "/aether.test.Echo/Stream";

fn xfcc_of(md: &MetadataMap) -> String {
    md.get("x-forwarded-client-cert")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

#[derive(Clone)]
struct Unary(String);

impl tower_service::Service<tonic::Request<EchoRequest>> for Unary {
    type Response = tonic::Response<EchoReply>;
    type Error = Status;
    type Future = std::future::Ready<Result<Self::Response, Status>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: tonic::Request<EchoRequest>) -> Self::Future {
        let xfcc = xfcc_of(req.metadata());
        let caller = req
            .metadata()
            .get("x-caller")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let msg = req.into_inner();
        if msg.message == "decline" {
            let mut md = MetadataMap::new();
            md.insert("x-decline-code", MetadataValue::from_static("51"));
            md.insert_bin("x-detail-bin", MetadataValue::from_bytes(&[0u8, 1, 2, 255]));
            return std::future::ready(Err(Status::with_metadata(
                Code::FailedPrecondition,
                "card declined: insufficient funds",
                md,
            )));
        }
        let mut resp = tonic::Response::new(EchoReply {
            message: msg.message,
            seq: 0,
            xfcc,
            served_by: self.0.clone(),
        });
        resp.metadata_mut()
            .insert("x-served-by", self.0.parse().unwrap());
        resp.metadata_mut()
            .insert("x-echo-caller", caller.parse().unwrap());
        std::future::ready(Ok(resp))
    }
}

type ReplyStream =
    Pin<Box<dyn futures_util::Stream<Item = Result<EchoReply, Status>> + Send + 'static>>;

#[derive(Clone)]
struct Streamer(String);

impl tower_service::Service<tonic::Request<EchoRequest>> for Streamer {
    type Response = tonic::Response<ReplyStream>;
    type Error = Status;
    type Future = std::future::Ready<Result<Self::Response, Status>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: tonic::Request<EchoRequest>) -> Self::Future {
        let xfcc = xfcc_of(req.metadata());
        let msg = req.into_inner();
        let mut items: Vec<Result<EchoReply, Status>> = (0..msg.count)
            .map(|i| {
                Ok(EchoReply {
                    message: format!("{}#{i}", msg.message),
                    seq: i,
                    xfcc: xfcc.clone(),
                    served_by: self.0.clone(),
                })
            })
            .collect();
        if msg.fail_at_end {
            let mut md = MetadataMap::new();
            md.insert("x-quota-left", MetadataValue::from_static("0"));
            items.push(Err(Status::with_metadata(
                Code::ResourceExhausted,
                "quota exhausted",
                md,
            )));
        }
        let s: ReplyStream = Box::pin(futures_util::stream::iter(items));
        let mut resp = tonic::Response::new(s);
        resp.metadata_mut()
            .insert("x-served-by", self.0.parse().unwrap());
        std::future::ready(Ok(resp))
    }
}

/// A gRPC server over h2c (prior knowledge) on `addr`, answering as `name`.
pub struct GrpcServer {
    pub calls: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl GrpcServer {
    pub async fn start(addr: SocketAddr, name: &str) -> GrpcServer {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("gRPC server cannot bind {addr}: {e}"));
        let calls = Arc::new(AtomicUsize::new(0));
        let name = name.to_string();
        let task = {
            let calls = calls.clone();
            tokio::spawn(async move {
                let mut conns = JoinSet::new();
                loop {
                    tokio::select! {
                        r = listener.accept() => {
                            let Ok((tcp, _)) = r else { continue };
                            let calls = calls.clone();
                            let name = name.clone();
                            conns.spawn(async move {
                                let svc = service_fn(move |req: Request<Incoming>| {
                                    calls.fetch_add(1, Ordering::SeqCst);
                                    let name = name.clone();
                                    async move { Ok::<_, Infallible>(dispatch(req, name).await) }
                                });
                                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                                    .serve_connection(TokioIo::new(tcp), svc)
                                    .await;
                            });
                        }
                        Some(_) = conns.join_next(), if !conns.is_empty() => {}
                    }
                }
            })
        };
        GrpcServer { calls, task }
    }
}

async fn dispatch(req: Request<Incoming>, name: String) -> http::Response<tonic::body::Body> {
    match req.uri().path() {
        UNARY => {
            tonic::server::Grpc::new(ProstCodec::<EchoReply, EchoRequest>::default())
                .unary(Unary(name), req)
                .await
        }
        STREAM => {
            tonic::server::Grpc::new(ProstCodec::<EchoReply, EchoRequest>::default())
                .server_streaming(Streamer(name), req)
                .await
        }
        _ => Status::unimplemented("no such method").into_http(),
    }
}

/// A tower service over one hyper h2c client connection: what tonic's generic client
/// needs, without tonic's transport.
#[derive(Clone)]
pub struct H2Channel(hyper::client::conn::http2::SendRequest<tonic::body::Body>);

impl tower_service::Service<http::Request<tonic::body::Body>> for H2Channel {
    type Response = http::Response<Incoming>;
    type Error = hyper::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }
    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.0.send_request(req))
    }
}

/// A gRPC client dialing `proxy` (plaintext h2c) with `:authority` from `origin`.
pub async fn client(proxy: SocketAddr, origin: &str) -> tonic::client::Grpc<H2Channel> {
    let tcp = tcp_connect(proxy).await.unwrap();
    let (send, conn) = within(
        IO_TIMEOUT,
        "h2 handshake",
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)),
    )
    .await
    .unwrap()
    .unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    tonic::client::Grpc::with_origin(H2Channel(send), origin.parse().unwrap())
}

pub fn codec() -> ProstCodec<EchoRequest, EchoReply> {
    ProstCodec::default()
}
