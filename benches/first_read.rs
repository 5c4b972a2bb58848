//! One HTTP/1.1 request on a new plaintext connection (scenario e's client side, without the
//! proxying): a loopback client connects, sends an 88-byte head with `Connection: close` and
//! reads the answer; the server side accepts and serves it with hyper's HTTP/1.1 codec behind
//! the proxy's `Guarded` wrapper, once after the proxy's own sniff (`sniff_codec`, which keeps
//! the first read for the codec) and once behind hyper-util's auto codec (which hands hyper
//! the 24 bytes it sniffed on their own). Real sockets: the difference is a `recv` and a copy
//! of hyper's read buffer per connection.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proxy::drain::Drain;
use aether_proxy::http::server::{sniff_codec, Codec, ConnRequests, Guarded, Servers, Wire};
use criterion::{criterion_group, criterion_main, Criterion};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const HEAD: &[u8] =
    b"GET /small HTTP/1.1\r\nHost: payments.aether.internal\r\nConnection: close\r\nUser-Agent: b\r\n\r\n";

async fn answer(_req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
}

#[derive(Clone, Copy)]
enum Way {
    Sniffed,
    AutoCodec,
}

async fn serve(tcp: TcpStream, way: Way, servers: &Servers, drain: &Drain) {
    let requests = Arc::new(ConnRequests::default());
    let mut conn = Guarded::new(tcp, requests, "outbound", Wire::Sniff);
    match way {
        Way::Sniffed => {
            if let Some(Codec::H1) = sniff_codec(&mut conn, drain).await {
                let conn = servers
                    .h1
                    .serve_connection(TokioIo::new(conn), service_fn(answer))
                    .with_upgrades();
                let _ = conn.await;
            }
        }
        Way::AutoCodec => {
            let auto = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let conn = auto.serve_connection_with_upgrades(TokioIo::new(conn), service_fn(answer));
            let _ = conn.await;
        }
    }
}

/// `iters` connections, one request each; the time all that took.
async fn connections(iters: u64, way: Way) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let servers = Servers::new();
    let drain = Drain::default();
    let mut answer = vec![0u8; 1024];
    let start = Instant::now();
    for _ in 0..iters {
        let client = async {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(HEAD).await.unwrap();
            let mut got = 0;
            loop {
                let n = c.read(&mut answer[got..]).await.unwrap();
                if n == 0 {
                    break;
                }
                got += n;
            }
            assert!(answer.starts_with(b"HTTP/1.1 200"));
        };
        let server = async {
            let (tcp, _) = listener.accept().await.unwrap();
            serve(tcp, way, &servers, &drain).await;
        };
        tokio::join!(client, server);
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (name, way) in [
        ("sniffed, then hyper's HTTP/1.1", Way::Sniffed),
        ("hyper-util's auto codec", Way::AutoCodec),
    ] {
        c.bench_function(&format!("new connection, one request: {name}"), |b| {
            b.iter_custom(|iters| rt.block_on(connections(iters, way)))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
