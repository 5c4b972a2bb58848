//! The demo's apps, served by the demo process itself: HTTP on 8080 (h1 or h2c; `/16k` answers
//! 16 KiB; a WebSocket upgrade echoes frames), h2c on 9090 (gRPC-style calls echo every
//! message as it arrives, then `grpc-status: 0`), a TCP echo on 5432. Each listener is an
//! [`App`] the chaos soak can kill (its port closes and every connection drops, as when the
//! process dies) and start again.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

type AppBody = BoxBody<Bytes, Infallible>;

/// One listening app; dropping it (or [`App::kill`]) closes the port and every connection.
pub struct App {
    pub addr: SocketAddr,
    pod: &'static str,
    task: JoinHandle<()>,
}

impl App {
    pub async fn start(addr: SocketAddr, pod: &'static str) -> std::io::Result<App> {
        let listener = TcpListener::bind(addr).await?;
        let port = addr.port();
        // The connections live in a set the accept task owns: aborting it drops them all.
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        if let Ok((tcp, _)) = accepted {
                            conns.spawn(serve(tcp, pod, port));
                        }
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(App { addr, pod, task })
    }

    /// Closes the port and drops every connection.
    pub fn kill(&self) {
        self.task.abort();
    }

    /// Starts it again on the same address (after [`App::kill`]).
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.task.abort();
        // The aborted task drops its listener when it next runs; retry the bind until then.
        let mut tries = 0;
        loop {
            match App::start(self.addr, self.pod).await {
                Ok(app) => {
                    *self = app;
                    return Ok(());
                }
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut tcp: TcpStream, pod: &'static str, port: u16) {
    if port == 5432 {
        let (mut r, mut w) = tcp.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
        let _ = w.shutdown().await;
        return;
    }
    let svc = service_fn(move |req: Request<Incoming>| async move {
        Ok::<_, Infallible>(answer(req, pod, port))
    });
    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .serve_connection_with_upgrades(TokioIo::new(tcp), svc)
        .await;
}

fn answer(req: Request<Incoming>, pod: &'static str, port: u16) -> Response<AppBody> {
    let grpc = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if grpc {
        return grpc_echo(req);
    }
    if req
        .headers()
        .get(http::header::UPGRADE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"))
    {
        return websocket(req);
    }
    if req.uri().path() == "/16k" {
        return Response::new(Full::new(Bytes::from_static(&[b'x'; 16 * 1024])).boxed());
    }
    let body = format!(
        "hello from {pod}, port {port}, {:?}, x-forwarded-client-cert: {}\n",
        req.version(),
        req.headers()
            .get("x-forwarded-client-cert")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
    );
    Response::new(Full::new(Bytes::from(body)).boxed())
}

/// A gRPC-style echo: every length-prefixed message is sent back as soon as it is whole, then
/// `grpc-status: 0` in the trailers when the request ends.
fn grpc_echo(req: Request<Incoming>) -> Response<AppBody> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
    tokio::spawn(async move {
        let mut body = req.into_body();
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            while let Some(len) = grpc_message_len(&buf) {
                let msg = buf.split_to(len).freeze();
                if tx.send(Ok(Frame::data(msg))).await.is_err() {
                    return;
                }
            }
        }
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let _ = tx.send(Ok(Frame::trailers(trailers))).await;
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut resp = Response::new(BodyExt::boxed(body));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    resp
}

/// The length of the whole first gRPC message in `buf` (prefix included), if it is all there.
pub(super) fn grpc_message_len(buf: &[u8]) -> Option<usize> {
    let prefix: [u8; 4] = buf.get(1..5)?.try_into().ok()?;
    let len = 5 + u32::from_be_bytes(prefix) as usize;
    (buf.len() >= len).then_some(len)
}

/// The value of `Sec-WebSocket-Accept` for a key (RFC 6455 section 4.2.2).
pub(super) fn websocket_accept(key: &[u8]) -> String {
    let mut data = key.to_vec();
    data.extend_from_slice(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    boring::base64::encode_block(&boring::sha::sha1(&data))
}

fn websocket(req: Request<Incoming>) -> Response<AppBody> {
    let Some(key) = req.headers().get("sec-websocket-key").cloned() else {
        let mut r = Response::new(Full::new(Bytes::from_static(b"no key\n")).boxed());
        *r.status_mut() = StatusCode::BAD_REQUEST;
        return r;
    };
    tokio::spawn(async move {
        if let Ok(upgraded) = hyper::upgrade::on(req).await {
            let _ = websocket_echo(TokioIo::new(upgraded)).await;
        }
    });
    let mut r = Response::new(Full::new(Bytes::new()).boxed());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(http::header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("upgrade"),
    );
    if let Ok(v) = HeaderValue::from_str(&websocket_accept(key.as_bytes())) {
        h.insert("sec-websocket-accept", v);
    }
    r
}

/// Echoes each (masked) client frame back unmasked until a close frame, which it answers.
async fn websocket_echo<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) -> std::io::Result<()> {
    loop {
        let (opcode, payload) = read_frame(&mut s).await?;
        if opcode == 0x8 {
            s.write_all(&[0x88, 0x00]).await?;
            return s.shutdown().await;
        }
        s.write_all(&frame_head(opcode, payload.len(), false))
            .await?;
        s.write_all(&payload).await?;
    }
}

/// A frame's first bytes: FIN and `opcode`, then the length (and the mask bit for a client).
pub(super) fn frame_head(opcode: u8, len: usize, masked: bool) -> Vec<u8> {
    let mask = if masked { 0x80 } else { 0 };
    let mut head = vec![0x80 | opcode];
    if len < 126 {
        head.push(mask | len as u8);
    } else {
        head.push(mask | 126);
        head.extend_from_slice(&(len as u16).to_be_bytes());
    }
    head
}

/// Reads one frame (at most 64 KiB; unmasks it if masked): its opcode and payload.
pub(super) async fn read_frame<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<(u8, Bytes)> {
    let mut head = [0u8; 2];
    s.read_exact(&mut head).await?;
    let opcode = head[0] & 0x0f;
    let masked = head[1] & 0x80 != 0;
    let len = match head[1] & 0x7f {
        126 => s.read_u16().await? as usize,
        127 => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "frames over 64 KiB are not used here",
            ))
        }
        n => n as usize,
    };
    let mut mask = [0u8; 4];
    if masked {
        s.read_exact(&mut mask).await?;
    }
    let mut payload = BytesMut::zeroed(len);
    s.read_exact(&mut payload).await?;
    if masked {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
    }
    Ok((opcode, payload.freeze()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn websocket_accept_matches_the_rfc_example() {
        assert_eq!(
            websocket_accept(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn grpc_message_len_waits_for_the_whole_message() {
        assert_eq!(grpc_message_len(&[0, 0, 0, 0]), None);
        assert_eq!(grpc_message_len(&[0, 0, 0, 0, 2, 9]), None);
        assert_eq!(grpc_message_len(&[0, 0, 0, 0, 2, 9, 9, 1]), Some(7));
    }
}
