//! `aether-proxy control-plane`: a small delta ADS server for a catalog file, so that xDS mode
//! can be tried (and soaked) without a mesh's control plane. The file is read with the catalog
//! source's own parser and validation, turned into Clusters and ClusterLoadAssignments
//! (`resources.rs`) and served per stream on demand (`session.rs`, the protocol as plain data;
//! `server.rs`, tonic and the listeners). A rewrite of the file is pushed to the streams
//! subscribed to what changed; a broken rewrite keeps the last good catalog.

pub mod resources;
mod server;
pub mod session;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use tokio::sync::watch;

use crate::catalog::Catalog;
use crate::config::GrpcAddress;
use crate::validation::{read_file, FieldError, FieldErrors, Origin};
use resources::Snapshot;

/// The command line of `control-plane`.
pub struct Options {
    pub catalog: PathBuf,
    pub listen: String,
    pub mesh_domain: String,
    pub trust_domain: String,
}

/// Runs until SIGTERM or SIGINT (exit 0); 1 when the listener, the address or the first
/// catalog is refused.
pub fn main(opts: Options) -> ExitCode {
    init_logging();
    let listen = match GrpcAddress::parse(&opts.listen) {
        Ok(a) if a.is_local() => a,
        Ok(a) => {
            // Plaintext only: a sidecar speaks mTLS to any other address.
            eprintln!("--listen {a}: serve on a loopback host:port or unix:///path");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("--listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let catalog = match load(&opts.catalog, &opts.trust_domain) {
        Ok(c) => c,
        Err(errors) => {
            for e in errors.0 {
                eprintln!("{e}");
            }
            return ExitCode::FAILURE;
        }
    };
    let first = Snapshot::build(&catalog, &opts.mesh_domain, 1, None);
    tracing::info!(
        services = catalog.services.len(),
        clusters = first.clusters.len(),
        "catalog loaded"
    );
    let (snapshots, served) = watch::channel(Arc::new(first));
    watch_catalog(&opts, snapshots);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("stopping");
            let _ = stop_tx.send(true);
            // Kept until the end: a dropped sender would read as a stop to every stream.
            std::future::pending::<()>().await;
        });
        server::serve(&listen, served, stop).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Each good new content of the catalog file becomes the snapshot served; a bad one is logged
/// (once per distinct error) and the last good one stays.
fn watch_catalog(opts: &Options, snapshots: watch::Sender<Arc<Snapshot>>) {
    let path = opts.catalog.clone();
    let (mesh_domain, trust_domain) = (opts.mesh_domain.clone(), opts.trust_domain.clone());
    let mut last_error: Option<String> = None;
    crate::watch::spawn("catalog", vec![path.clone()], move || {
        let previous = snapshots.borrow().clone();
        match load(&path, &trust_domain) {
            Ok(catalog) => {
                let next = Snapshot::build(
                    &catalog,
                    &mesh_domain,
                    previous.generation + 1,
                    Some(&previous),
                );
                tracing::info!(
                    generation = next.generation,
                    services = catalog.services.len(),
                    changed = changed(&previous, &next),
                    "catalog reloaded"
                );
                snapshots.send_replace(Arc::new(next));
                last_error = None;
            }
            Err(e) => {
                let msg = e.to_string();
                if last_error.as_deref() != Some(msg.as_str()) {
                    tracing::error!(
                        generation = previous.generation,
                        "catalog reload failed; still serving the last good catalog: {msg}"
                    );
                    last_error = Some(msg);
                }
            }
        }
    });
}

/// The catalog file, read and validated as a sidecar does, except that an empty file is refused:
/// it is what a writer that truncates before writing leaves for a moment, and served it would
/// empty every subscribed sidecar's mesh at once. `services: {}` is a catalog with no service.
fn load(path: &Path, trust_domain: &str) -> Result<Catalog, FieldErrors> {
    let text = read_file(path)?;
    if text.trim().is_empty() {
        let origin = Origin::File(path.to_path_buf());
        let reason = "empty file (a catalog with no service is `services: {}`)";
        return Err(FieldError::new(&origin, "", reason).into());
    }
    Catalog::parse(path, &text, trust_domain)
}

/// How many resources (either type) differ between two snapshots, removed ones included.
fn changed(a: &Snapshot, b: &Snapshot) -> usize {
    resources::Kind::ALL
        .into_iter()
        .map(|k| {
            let (a, b) = (a.of(k), b.of(k));
            let gone = a.keys().filter(|n| !b.contains_key(*n)).count();
            let new = b
                .iter()
                .filter(|(n, r)| a.get(*n).is_none_or(|o| o.version != r.version))
                .count();
            gone + new
        })
        .sum()
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot watch SIGTERM: {e}");
            std::future::pending::<()>().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_refused_and_an_empty_catalog_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.yaml");
        std::fs::write(&path, " \n").unwrap();
        let e = load(&path, "aether.local").unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{}: empty file", path.display())),
            "{e}"
        );
        std::fs::write(&path, "services: {}\n").unwrap();
        assert!(load(&path, "aether.local").unwrap().services.is_empty());
        // Everything else is the sidecar's validation.
        std::fs::write(&path, "services: [\n").unwrap();
        let e = load(&path, "aether.local").unwrap_err().to_string();
        assert!(e.contains("expected a map"), "{e}");
    }
}
