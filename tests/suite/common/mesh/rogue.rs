//! A server pod that misbehaves on purpose: real mTLS with the `payments` identity, HTTP/2 chosen
//! by ALPN, then raw HTTP/2 frames written by hand, so each test decides exactly what the client
//! proxy sees for a request (a refused stream, a GOAWAY below it, a reset before or after the
//! response head); or HTTP/1.1, closing the connection under the request or answering in
//! HTTP/1.0. It counts the requests it got.

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
    /// HTTP/1.1 chosen by ALPN; the connection closes once the request head is read.
    H1CloseBeforeResponse,
    /// HTTP/1.1 chosen by ALPN; each request is answered `HTTP/1.0 200` with a 2-byte body,
    /// then the connection closes (a peer that speaks HTTP/1.0 on the mesh hop).
    H1AnswerInHttp10,
    /// HTTP/1.1 chosen by ALPN; each request is answered `101 Switching Protocols` to `h2c`,
    /// whatever it asked, and every byte after it is kept ([`RoguePod::after_switch`]).
    H1SwitchProtocols,
    /// HTTP/1.1 chosen by ALPN; each request is answered `200` with
    /// `Transfer-Encoding: gzip, chunked` (a coding the proxy cannot pass on), then a close.
    H1AnswerCoded,
}

impl Misbehaviour {
    fn is_h1(self) -> bool {
        matches!(
            self,
            Misbehaviour::H1CloseBeforeResponse
                | Misbehaviour::H1AnswerInHttp10
                | Misbehaviour::H1SwitchProtocols
                | Misbehaviour::H1AnswerCoded
        )
    }
}

/// What an HTTP/1.1 peer received: each request head, and the bytes that came after a `101`.
#[derive(Default)]
pub struct SeenH1 {
    pub heads: Mutex<Vec<String>>,
    pub after_switch: Mutex<Vec<u8>>,
}

pub struct RoguePod {
    requests: Arc<Mutex<usize>>,
    conns: Arc<Mutex<usize>>,
    seen: Arc<SeenH1>,
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

fn acceptor(certs: &Certs, alpn: &'static [u8]) -> SslAcceptor {
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
    b.set_certificate_chain_file(certs.cert("payments"))
        .unwrap();
    b.set_private_key_file(certs.key("payments"), SslFiletype::PEM)
        .unwrap();
    b.set_ca_file(certs.ca()).unwrap();
    b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    // Like an h2 (or http1) chain: that protocol whatever the client offered first.
    b.set_alpn_select_callback(move |_, client| {
        boring::ssl::select_next_proto(alpn, client).ok_or(AlpnError::NOACK)
    });
    b.build()
}

impl RoguePod {
    pub async fn start(certs: &Certs, addr: SocketAddr, how: Misbehaviour) -> RoguePod {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("rogue pod cannot bind {addr}: {e}"));
        let alpn: &[u8] = if how.is_h1() {
            b"\x08http/1.1"
        } else {
            b"\x02h2"
        };
        let acc = Arc::new(acceptor(certs, alpn));
        let requests: Arc<Mutex<usize>> = Arc::default();
        let conns: Arc<Mutex<usize>> = Arc::default();
        let seen: Arc<SeenH1> = Arc::default();
        let task = {
            let (requests, conns, all_seen) = (requests.clone(), conns.clone(), seen.clone());
            tokio::spawn(async move {
                let mut tasks = JoinSet::new();
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acc, requests, conns) = (acc.clone(), requests.clone(), conns.clone());
                    let seen = all_seen.clone();
                    tasks.spawn(async move {
                        let Ok(Ok(tls)) =
                            tokio::time::timeout(IO_TIMEOUT, tokio_boring::accept(&acc, tcp)).await
                        else {
                            return;
                        };
                        *conns.lock().unwrap() += 1;
                        let _ = if how.is_h1() {
                            serve_h1(tls, how, requests, seen).await
                        } else {
                            serve(tls, how, requests).await
                        };
                    });
                }
            })
        };
        RoguePod {
            requests,
            conns,
            seen,
            task,
        }
    }

    /// Requests it got (header blocks, or HTTP/1.1 heads).
    /// HTTP/1.1 behaviours: every request head received, in order.
    pub fn heads(&self) -> Vec<String> {
        self.seen.heads.lock().unwrap().clone()
    }

    /// [`Misbehaviour::H1SwitchProtocols`]: every byte received after a `101`.
    pub fn after_switch(&self) -> Vec<u8> {
        self.seen.after_switch.lock().unwrap().clone()
    }

    pub fn requests(&self) -> usize {
        *self.requests.lock().unwrap()
    }

    /// Connections that completed the TLS handshake.
    pub fn connections(&self) -> usize {
        *self.conns.lock().unwrap()
    }
}

async fn serve<S>(mut s: S, how: Misbehaviour, requests: Arc<Mutex<usize>>) -> std::io::Result<()>
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
                *requests.lock().unwrap() += 1;
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
        Misbehaviour::CloseBeforeResponse
        | Misbehaviour::ServeOnceThenClose
        | Misbehaviour::H1CloseBeforeResponse
        | Misbehaviour::H1AnswerInHttp10
        | Misbehaviour::H1SwitchProtocols
        | Misbehaviour::H1AnswerCoded => s.shutdown().await,
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

/// A `200` whose body is still gzip-coded under the chunked framing.
pub const CODED_ANSWER: &[u8] =
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";

/// HTTP/1.1: reads a request head, records and counts it, then answers it in HTTP/1.0, with a
/// `101` (keeping what follows), or not at all (`how`), and closes the connection.
async fn serve_h1<S>(
    mut s: S,
    how: Misbehaviour,
    requests: Arc<Mutex<usize>>,
    seen: Arc<SeenH1>,
) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut buf = Vec::new();
    let Some(end) = crate::common::read_http_head(&mut s, &mut buf).await else {
        return Ok(());
    };
    seen.heads
        .lock()
        .unwrap()
        .push(String::from_utf8_lossy(&buf[..end]).into_owned());
    *requests.lock().unwrap() += 1;
    match how {
        Misbehaviour::H1AnswerInHttp10 => {
            s.write_all(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await?;
        }
        Misbehaviour::H1AnswerCoded => {
            s.write_all(CODED_ANSWER).await?;
        }
        Misbehaviour::H1SwitchProtocols => {
            s.write_all(
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n",
            )
            .await?;
            seen.after_switch
                .lock()
                .unwrap()
                .extend_from_slice(&buf[end..]);
            let mut chunk = [0u8; 4096];
            while let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk)).await
            {
                if n == 0 {
                    break;
                }
                seen.after_switch
                    .lock()
                    .unwrap()
                    .extend_from_slice(&chunk[..n]);
            }
        }
        _ => {}
    }
    s.shutdown().await
}
