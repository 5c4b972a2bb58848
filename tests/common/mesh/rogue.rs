//! A server pod that misbehaves on purpose: real mTLS with the `payments` identity, HTTP/2 chosen
//! by ALPN, then raw HTTP/2 frames written by hand, so each test decides exactly what the client
//! proxy sees for a request (a refused stream, a GOAWAY below it, a reset before or after the
//! response head). It records the path of every request it got, in order.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use boring::ssl::{AlpnError, SslAcceptor, SslFiletype, SslMethod, SslVerifyMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use crate::common::{Certs, IO_TIMEOUT};

/// What the pod does with each request (each HEADERS frame that opens a stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misbehaviour {
    /// `RST_STREAM(REFUSED_STREAM)`.
    Refuse,
    /// `GOAWAY` with a last-stream-id below the request's stream (NO_ERROR), then the
    /// connection stays open until the client closes it.
    GoAwayBelow,
    /// `RST_STREAM(INTERNAL_ERROR)` before any response byte.
    ResetBeforeResponse,
    /// The TCP connection closes before any response byte.
    CloseBeforeResponse,
    /// A `200` head and a few body bytes, then `RST_STREAM(INTERNAL_ERROR)`.
    ResetAfterHead,
    /// A complete, empty `200` for a connection's first request; the connection closes when
    /// its second request arrives (a pooled connection that dies under its next request).
    ServeOnceThenClose,
}

pub struct RoguePod {
    paths: Arc<Mutex<Vec<String>>>,
    conns: Arc<Mutex<usize>>,
    task: JoinHandle<()>,
}

impl Drop for RoguePod {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const ACK: u8 = 0x1;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;
const INTERNAL_ERROR: u32 = 0x2;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn acceptor(certs: &Certs) -> SslAcceptor {
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
    b.set_certificate_chain_file(certs.cert("payments"))
        .unwrap();
    b.set_private_key_file(certs.key("payments"), SslFiletype::PEM)
        .unwrap();
    b.set_ca_file(certs.ca()).unwrap();
    b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    // An h2 chain: HTTP/2 whatever the client offered first.
    b.set_alpn_select_callback(|_, client| {
        boring::ssl::select_next_proto(b"\x02h2", client).ok_or(AlpnError::NOACK)
    });
    b.build()
}

/// The `:path` of a header block, when the client proxy sent it as a literal (HPACK: a
/// literal whose name is static index 4 or 5, value not Huffman-coded) or Huffman-coded
/// (then the raw bytes, hex). Enough to tell requests apart by path.
fn path_of(block: &[u8]) -> String {
    let mut i = 0;
    while i < block.len() {
        let b = block[i];
        // Literal with indexed name: 0100xxxx (incremental), 0000xxxx / 0001xxxx (4-bit index).
        let (index, prefix) = if b & 0xc0 == 0x40 {
            (b & 0x3f, 6)
        } else if b & 0xe0 == 0x00 || b & 0xf0 == 0x10 {
            (b & 0x0f, 4)
        } else {
            i += 1;
            continue;
        };
        let full = (1u8 << prefix) - 1;
        if (index == 4 || index == 5) && index != full && i + 1 < block.len() {
            let huffman = block[i + 1] & 0x80 != 0;
            let len = (block[i + 1] & 0x7f) as usize;
            if let Some(v) = block.get(i + 2..i + 2 + len) {
                return if huffman {
                    format!("huffman:{}", hex::encode(v))
                } else {
                    String::from_utf8_lossy(v).into_owned()
                };
            }
        }
        i += 1;
    }
    String::from("?")
}

impl RoguePod {
    pub async fn start(certs: &Certs, addr: SocketAddr, how: Misbehaviour) -> RoguePod {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("rogue pod cannot bind {addr}: {e}"));
        let acc = Arc::new(acceptor(certs));
        let paths: Arc<Mutex<Vec<String>>> = Arc::default();
        let conns: Arc<Mutex<usize>> = Arc::default();
        let task = {
            let (paths, conns) = (paths.clone(), conns.clone());
            tokio::spawn(async move {
                let mut tasks = JoinSet::new();
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acc, paths, conns) = (acc.clone(), paths.clone(), conns.clone());
                    tasks.spawn(async move {
                        let Ok(Ok(tls)) =
                            tokio::time::timeout(IO_TIMEOUT, tokio_boring::accept(&acc, tcp)).await
                        else {
                            return;
                        };
                        *conns.lock().unwrap() += 1;
                        let _ = serve(tls, how, paths).await;
                    });
                }
            })
        };
        RoguePod { paths, conns, task }
    }

    /// The paths of the requests it got, in order.
    pub fn paths(&self) -> Vec<String> {
        self.paths.lock().unwrap().clone()
    }

    /// Connections that completed the TLS handshake.
    pub fn connections(&self) -> usize {
        *self.conns.lock().unwrap()
    }
}

async fn serve<S>(
    mut s: S,
    how: Misbehaviour,
    paths: Arc<Mutex<Vec<String>>>,
) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    s.read_exact(&mut preface).await?;
    if preface != PREFACE {
        return Ok(());
    }
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await?;
    // The header block of the stream being opened, across CONTINUATION frames.
    let mut block: Vec<u8> = Vec::new();
    let mut served = 0;
    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).await?;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await?;
        match kind {
            SETTINGS if flags & ACK == 0 => s.write_all(&frame(SETTINGS, ACK, 0, &[])).await?,
            PING if flags & ACK == 0 => s.write_all(&frame(PING, ACK, 0, &payload)).await?,
            HEADERS | CONTINUATION => {
                let mut p = &payload[..];
                if kind == HEADERS {
                    // Padding and priority fields, when flagged.
                    if flags & 0x8 != 0 {
                        let n = usize::from(p[0]);
                        p = &p[1..p.len() - n];
                    }
                    if flags & 0x20 != 0 {
                        p = &p[5..];
                    }
                }
                block.extend_from_slice(p);
                if flags & END_HEADERS == 0 {
                    continue;
                }
                paths.lock().unwrap().push(path_of(&block));
                block.clear();
                if how == Misbehaviour::ServeOnceThenClose && served == 0 {
                    served += 1;
                    // `:status: 200` (static table entry 8), and the stream ends.
                    s.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, stream, &[0x88]))
                        .await?;
                    continue;
                }
                act(&mut s, how, stream).await?;
                if matches!(
                    how,
                    Misbehaviour::CloseBeforeResponse | Misbehaviour::ServeOnceThenClose
                ) {
                    return Ok(());
                }
            }
            // DATA, RST_STREAM, GOAWAY, WINDOW_UPDATE...: read and ignored.
            _ => {}
        }
    }
}

async fn act<S>(s: &mut S, how: Misbehaviour, stream: u32) -> std::io::Result<()>
where
    S: tokio::io::AsyncWrite + Unpin,
{
    match how {
        Misbehaviour::Refuse => {
            s.write_all(&frame(RST_STREAM, 0, stream, &REFUSED_STREAM.to_be_bytes()))
                .await
        }
        Misbehaviour::GoAwayBelow => {
            let mut p = stream.saturating_sub(2).to_be_bytes().to_vec();
            p.extend_from_slice(&0u32.to_be_bytes());
            s.write_all(&frame(GOAWAY, 0, 0, &p)).await
        }
        Misbehaviour::ResetBeforeResponse => {
            s.write_all(&frame(RST_STREAM, 0, stream, &INTERNAL_ERROR.to_be_bytes()))
                .await
        }
        Misbehaviour::CloseBeforeResponse | Misbehaviour::ServeOnceThenClose => s.shutdown().await,
        Misbehaviour::ResetAfterHead => {
            // `:status: 200` is static table entry 8.
            s.write_all(&frame(HEADERS, END_HEADERS, stream, &[0x88]))
                .await?;
            s.write_all(&frame(DATA, 0, stream, b"partial")).await?;
            s.flush().await?;
            tokio::time::sleep(Duration::from_millis(50)).await;
            s.write_all(&frame(RST_STREAM, 0, stream, &INTERNAL_ERROR.to_be_bytes()))
                .await
        }
    }
}
