//! A fake server pod: a BoringSSL server with the `payments` identity that records the
//! handshake (SNI, the ALPN list offered, the client's identity) and the requests exactly
//! as the client proxy sends them, before any server proxy could rewrite them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use boring::ssl::{AlpnError, NameType, SslAcceptor, SslFiletype, SslMethod, SslVerifyMode};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use crate::common::{spiffe_ids_of, Certs, IO_TIMEOUT};

/// (version, uri, headers) of one request.
pub type WireRequest = (String, String, Vec<(String, String)>);

#[derive(Debug, Clone, Default)]
pub struct WireConn {
    pub sni: Option<String>,
    pub alpn_offered: Vec<String>,
    pub alpn_selected: Option<String>,
    pub peer_ids: Vec<String>,
    pub requests: Vec<WireRequest>,
}

pub struct Observer {
    pub conns: Arc<Mutex<Vec<WireConn>>>,
    task: JoinHandle<()>,
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The `payments` leaf, its key and the CA, as owned paths.
struct CertPaths {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    ca: std::path::PathBuf,
}

fn acceptor(certs: &CertPaths, offered: Arc<Mutex<Vec<String>>>) -> SslAcceptor {
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
    b.set_certificate_chain_file(&certs.cert).unwrap();
    b.set_private_key_file(&certs.key, SslFiletype::PEM)
        .unwrap();
    b.set_ca_file(&certs.ca).unwrap();
    b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    b.set_alpn_select_callback(move |_, client| {
        let mut list = Vec::new();
        let mut rest = client;
        while let Some((&n, tail)) = rest.split_first() {
            let n = n as usize;
            if tail.len() < n {
                break;
            }
            list.push(String::from_utf8_lossy(&tail[..n]).into_owned());
            rest = &tail[n..];
        }
        *offered.lock().unwrap() = list;
        // Like an `auto` chain: the client's first choice.
        let n = *client.first().ok_or(AlpnError::NOACK)? as usize;
        client.get(1..1 + n).ok_or(AlpnError::NOACK)
    });
    b.build()
}

impl Observer {
    pub async fn start(certs: &Certs, addr: SocketAddr) -> Observer {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("observer cannot bind {addr}: {e}"));
        let conns: Arc<Mutex<Vec<WireConn>>> = Arc::new(Mutex::new(Vec::new()));
        // The acceptor is built per connection so the ALPN offer is recorded per connection.
        let certs = CertPaths {
            cert: certs.cert("payments"),
            key: certs.key("payments"),
            ca: certs.ca(),
        };
        let task = {
            let conns = conns.clone();
            tokio::spawn(async move {
                let mut tasks = JoinSet::new();
                loop {
                    tokio::select! {
                        r = listener.accept() => {
                            let Ok((tcp, _)) = r else { continue };
                            let offered = Arc::new(Mutex::new(Vec::new()));
                            let acc = acceptor(&certs, offered.clone());
                            let conns = conns.clone();
                            tasks.spawn(async move {
                                let Ok(Ok(tls)) = tokio::time::timeout(
                                    IO_TIMEOUT,
                                    tokio_boring::accept(&acc, tcp),
                                )
                                .await
                                else {
                                    return;
                                };
                                let ssl = tls.ssl();
                                let rec = WireConn {
                                    sni: ssl.servername(NameType::HOST_NAME).map(str::to_string),
                                    alpn_offered: offered.lock().unwrap().clone(),
                                    alpn_selected: ssl
                                        .selected_alpn_protocol()
                                        .map(|p| String::from_utf8_lossy(p).into_owned()),
                                    peer_ids: ssl
                                        .peer_certificate()
                                        .and_then(|c| c.to_der().ok())
                                        .map(|d| spiffe_ids_of(&d))
                                        .unwrap_or_default(),
                                    requests: Vec::new(),
                                };
                                let h2 = rec.alpn_selected.as_deref() == Some("h2");
                                let idx = {
                                    let mut c = conns.lock().unwrap();
                                    c.push(rec);
                                    c.len() - 1
                                };
                                let svc = {
                                    let conns = conns.clone();
                                    service_fn(move |req: Request<Incoming>| {
                                        let conns = conns.clone();
                                        async move {
                                            let headers = req
                                                .headers()
                                                .iter()
                                                .map(|(k, v)| {
                                                    (
                                                        k.to_string(),
                                                        String::from_utf8_lossy(v.as_bytes())
                                                            .into_owned(),
                                                    )
                                                })
                                                .collect();
                                            let entry = (
                                                format!("{:?}", req.version()),
                                                req.uri().to_string(),
                                                headers,
                                            );
                                            let _ = req.into_body().collect().await;
                                            conns.lock().unwrap()[idx].requests.push(entry);
                                            Ok::<_, Infallible>(http::Response::new(Full::new(
                                                Bytes::from_static(b"observed\n"),
                                            )))
                                        }
                                    })
                                };
                                let io = TokioIo::new(tls);
                                if h2 {
                                    let _ = hyper::server::conn::http2::Builder::new(
                                        TokioExecutor::new(),
                                    )
                                    .serve_connection(io, svc)
                                    .await;
                                } else {
                                    let _ = hyper::server::conn::http1::Builder::new()
                                        .serve_connection(io, svc)
                                        .await;
                                }
                            });
                        }
                        Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                    }
                }
            })
        };
        Observer { conns, task }
    }

    pub fn conns(&self) -> Vec<WireConn> {
        self.conns.lock().unwrap().clone()
    }
}
