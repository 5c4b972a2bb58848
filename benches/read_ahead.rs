//! Reading TLS-shaped records (a 5-byte header, then the body it announces, as BoringSSL
//! asks for them) from a loopback socket, straight and through `ReadAhead`: 16 records of
//! 16 KiB (bulk, scenario g) and one 100-byte record (a small request or response). Real
//! sockets, because what read-ahead saves is `recv` calls.

use std::time::{Duration, Instant};

use aether_proxy::sockets::ReadAhead;
use criterion::{criterion_group, criterion_main, Criterion};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn records(count: usize, body: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * (5 + body));
    for _ in 0..count {
        out.extend_from_slice(&[23, 3, 3]);
        out.extend_from_slice(&(body as u16).to_be_bytes());
        out.extend(std::iter::repeat_n(0x5a, body));
    }
    out
}

/// Reads `count` records the way the TLS layer does.
async fn read_records<R: AsyncRead + Unpin>(r: &mut R, count: usize, body: &mut [u8]) {
    for _ in 0..count {
        let mut head = [0u8; 5];
        r.read_exact(&mut head).await.unwrap();
        let len = u16::from_be_bytes([head[3], head[4]]) as usize;
        r.read_exact(&mut body[..len]).await.unwrap();
    }
}

async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let w = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (r, _) = l.accept().await.unwrap();
    w.set_nodelay(true).unwrap();
    (w, r)
}

/// Writes `wire` and reads it back as records, `iters` times; the time all that took.
async fn time_reads<R: AsyncRead + Unpin>(
    iters: u64,
    w: &mut TcpStream,
    r: &mut R,
    wire: &[u8],
    count: usize,
) -> Duration {
    let mut body = vec![0u8; 16 * 1024 + 64];
    let start = Instant::now();
    for _ in 0..iters {
        let (written, ()) = tokio::join!(w.write_all(wire), read_records(r, count, &mut body));
        written.unwrap();
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (name, count, body) in [("16 x 16 KiB", 16, 16 * 1024 + 16), ("1 x 100 B", 1, 100)] {
        let wire = records(count, body);
        c.bench_function(&format!("records {name}, socket"), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let (mut w, mut r) = pair().await;
                    time_reads(iters, &mut w, &mut r, &wire, count).await
                })
            })
        });
        c.bench_function(&format!("records {name}, read ahead"), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let (mut w, r) = pair().await;
                    let mut r = ReadAhead::new(r);
                    time_reads(iters, &mut w, &mut r, &wire, count).await
                })
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
