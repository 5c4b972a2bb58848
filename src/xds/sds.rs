//! The workload identity over SDS (`identity.sds`, SPEC section 9): Envoy's
//! `SecretDiscoveryService/StreamSecrets`, the node-agent API Istio's sidecars use. One stream
//! per secret, as Envoy opens them: `default` (certificate chain and key) and `ROOTCA` (the
//! trust bundle). The first complete pair becomes the identity; every later push rotates it
//! exactly like a changed file.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{data_source::Specifier, DataSource, Node};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{secret, Secret};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::channel;
use super::resources::SECRET_TYPE;
use crate::config::GrpcAddress;
use crate::identity::{Contexts, IdentitySpec, IdentityStore};

pub const WORKLOAD: &str = "default";

/// The largest SDS response accepted: a certificate chain and key, or a bundle, are kilobytes,
/// and a secret file read for one is capped at 1 MiB (`MAX_SECRET_FILE`).
pub const MAX_RESPONSE: usize = 4 << 20;
pub const ROOT_CA: &str = "ROOTCA";

/// What one secret carried.
pub(crate) enum Pushed {
    Workload { cert: Vec<u8>, key: Vec<u8> },
    RootCa(Vec<u8>),
}

/// Starts the SDS streams; the identity store arrives on the returned channel once the first
/// complete identity has (there is no timeout: until then the proxy is not ready).
pub fn spawn(
    addr: GrpcAddress,
    spec: IdentitySpec,
    node: Node,
) -> oneshot::Receiver<Arc<IdentityStore>> {
    let (first_tx, first_rx) = oneshot::channel();
    let (tx, rx) = mpsc::channel(8);
    for name in [WORKLOAD, ROOT_CA] {
        tokio::spawn(stream(addr.clone(), name, node.clone(), tx.clone()));
    }
    tokio::spawn(combine(rx, spec, first_tx));
    first_rx
}

async fn combine(
    mut rx: mpsc::Receiver<(Pushed, oneshot::Sender<Result<(), String>>)>,
    spec: IdentitySpec,
    first: oneshot::Sender<Arc<IdentityStore>>,
) {
    let mut first = Some(first);
    let mut workload: Option<(Vec<u8>, Vec<u8>)> = None;
    let mut ca: Option<Vec<u8>> = None;
    let mut store: Option<Arc<IdentityStore>> = None;
    while let Some((pushed, done)) = rx.recv().await {
        let (prev_workload, prev_ca) = (workload.clone(), ca.clone());
        match pushed {
            Pushed::Workload { cert, key } => workload = Some((cert, key)),
            Pushed::RootCa(pem) => ca = Some(pem),
        }
        let (Some((cert, key)), Some(ca_pem)) = (&workload, &ca) else {
            let _ = done.send(Ok(()));
            continue;
        };
        match Contexts::from_pem(&spec, cert, key, ca_pem) {
            Ok(contexts) => {
                let _ = done.send(Ok(()));
                match &store {
                    Some(s) => s.replace(contexts),
                    None => {
                        tracing::info!(id = %contexts.identity.spiffe_id, "identity received over SDS");
                        let s = IdentityStore::with(spec.clone(), contexts);
                        store = Some(s.clone());
                        if let Some(tx) = first.take() {
                            let _ = tx.send(s);
                        }
                    }
                }
            }
            Err(e) => {
                // A half-rotated pair (new leaf, old bundle, ...) keeps the identity in use; the
                // secret is NACKed so the node agent hears of it.
                workload = prev_workload;
                ca = prev_ca;
                let _ = done.send(Err(e.to_string()));
            }
        }
    }
}

/// One secret's stream, reconnecting with backoff for as long as the process runs.
async fn stream(
    addr: GrpcAddress,
    name: &'static str,
    node: Node,
    tx: mpsc::Sender<(Pushed, oneshot::Sender<Result<(), String>>)>,
) {
    let mut failures = 0u32;
    loop {
        match session(&addr, name, &node, &tx).await {
            Ok(()) => return,
            Err(heard) => failures = if heard { 1 } else { failures.saturating_add(1) },
        }
        tokio::time::sleep(channel::backoff(failures)).await;
    }
}

/// Err(heard anything) when the stream ends; Ok when the proxy is going away.
async fn session(
    addr: &GrpcAddress,
    name: &'static str,
    node: &Node,
    tx: &mpsc::Sender<(Pushed, oneshot::Sender<Result<(), String>>)>,
) -> Result<(), bool> {
    let channel = channel::connect(addr, None).await.map_err(|e| {
        tracing::warn!("SDS {name}: {e}");
        false
    })?;
    let (req_tx, req_rx) = mpsc::unbounded_channel::<DiscoveryRequest>();
    let request = |version: String, nonce: String, error: Option<String>| DiscoveryRequest {
        version_info: version,
        node: Some(node.clone()),
        resource_names: vec![name.to_string()],
        type_url: SECRET_TYPE.into(),
        response_nonce: nonce,
        error_detail: error.map(|message| RpcStatus {
            code: 3,
            message,
            details: Vec::new(),
        }),
        ..Default::default()
    };
    let _ = req_tx.send(request(String::new(), String::new(), None));
    let mut client =
        SecretDiscoveryServiceClient::new(channel).max_decoding_message_size(MAX_RESPONSE);
    // Never awaited on its own: the server's headers may come only with its first answer
    // (see `channel::Responses`).
    let mut responses = channel::Responses::new(async move {
        client
            .stream_secrets(UnboundedReceiverStream::new(req_rx))
            .await
    });
    let mut heard = false;
    let mut version = String::new();
    loop {
        let resp: DiscoveryResponse = match responses.message().await {
            Ok(Some(r)) => r,
            Ok(None) => {
                tracing::warn!("SDS {name}: stream ended");
                return Err(heard);
            }
            Err(e) => {
                tracing::warn!("SDS {name}: stream failed: {e}");
                return Err(heard);
            }
        };
        heard = true;
        let outcome = match decode(name, &resp) {
            Ok(pushed) => {
                let (done_tx, done_rx) = oneshot::channel();
                if tx.send((pushed, done_tx)).await.is_err() {
                    return Ok(());
                }
                done_rx.await.unwrap_or(Ok(()))
            }
            Err(e) => Err(e),
        };
        let error = match outcome {
            Ok(()) => {
                version = resp.version_info.clone();
                super::metrics::update("secret", true);
                None
            }
            Err(e) => {
                tracing::warn!("SDS {name}: refused: {e}");
                super::metrics::update("secret", false);
                Some(format!("{name}: {e}"))
            }
        };
        let _ = req_tx.send(request(version.clone(), resp.nonce.clone(), error));
    }
}

fn decode(name: &str, resp: &DiscoveryResponse) -> Result<Pushed, String> {
    let any = resp
        .resources
        .iter()
        .find(|a| a.type_url == SECRET_TYPE)
        .ok_or("no Secret in the response")?;
    decode_secret(name, &any.value)
}

/// One encoded Secret, checked against the name it was asked for.
pub(crate) fn decode_secret(name: &str, value: &[u8]) -> Result<Pushed, String> {
    let secret = Secret::decode(value).map_err(|e| format!("cannot decode: {e}"))?;
    if !secret.name.is_empty() && secret.name != name {
        return Err(format!("asked for {name:?}, got {:?}", secret.name));
    }
    match (name, secret.r#type) {
        (WORKLOAD, Some(secret::Type::TlsCertificate(t))) => Ok(Pushed::Workload {
            cert: bytes(
                t.certificate_chain.as_ref(),
                "tls_certificate.certificate_chain",
            )?,
            key: bytes(t.private_key.as_ref(), "tls_certificate.private_key")?,
        }),
        (ROOT_CA, Some(secret::Type::ValidationContext(v))) => Ok(Pushed::RootCa(bytes(
            v.trusted_ca.as_ref(),
            "validation_context.trusted_ca",
        )?)),
        _ => Err(format!("{name}: not the expected secret type")),
    }
}

fn bytes(d: Option<&DataSource>, field: &str) -> Result<Vec<u8>, String> {
    match d.and_then(|d| d.specifier.as_ref()) {
        Some(Specifier::InlineBytes(b)) => Ok(b.clone()),
        Some(Specifier::InlineString(s)) => Ok(s.clone().into_bytes()),
        Some(Specifier::Filename(f)) => {
            read_secret_file(f).map_err(|e| format!("{field}: {f}: {e}"))
        }
        _ => Err(format!("{field}: missing")),
    }
}

/// Largest secret file read: PEM chains and bundles are kilobytes. A pushed path to a device,
/// a FIFO or a huge file must neither exhaust memory nor block the stream.
const MAX_SECRET_FILE: u64 = 1 << 20;

fn read_secret_file(path: &str) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking open: opening a FIFO for reading would otherwise wait for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    let mut out = Vec::new();
    file.take(MAX_SECRET_FILE + 1).read_to_end(&mut out)?;
    if out.len() as u64 > MAX_SECRET_FILE {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("larger than {MAX_SECRET_FILE} bytes"),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::CertificateValidationContext;

    fn root_ca_from_file(path: &str) -> Result<Pushed, String> {
        let secret = Secret {
            name: ROOT_CA.into(),
            r#type: Some(secret::Type::ValidationContext(
                CertificateValidationContext {
                    trusted_ca: Some(DataSource {
                        specifier: Some(Specifier::Filename(path.into())),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            )),
        };
        decode_secret(ROOT_CA, &secret.encode_to_vec())
    }

    #[test]
    fn secret_files_are_bounded_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("ca.pem");
        std::fs::write(&small, b"-----BEGIN CERTIFICATE-----\n").unwrap();
        match root_ca_from_file(small.to_str().unwrap()) {
            Ok(Pushed::RootCa(pem)) => assert_eq!(pem, b"-----BEGIN CERTIFICATE-----\n"),
            _ => panic!("a small regular file is read"),
        }
        let big = dir.path().join("big.pem");
        std::fs::write(&big, vec![b'a'; MAX_SECRET_FILE as usize + 1]).unwrap();
        let err = root_ca_from_file(big.to_str().unwrap()).err().unwrap();
        assert!(err.contains("larger than"), "{err}");
        // A device that never ends, and a FIFO with no writer (would block forever).
        let err = root_ca_from_file("/dev/zero").err().unwrap();
        assert!(err.contains("not a regular file"), "{err}");
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = root_ca_from_file(fifo.to_str().unwrap()).err().unwrap();
        assert!(err.contains("not a regular file"), "{err}");
    }
}
