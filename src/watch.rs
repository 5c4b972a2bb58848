//! Watching files for change: the catalog and the identity files.
//!
//! The parent directories are watched (not the files), so editors and tools that replace a file
//! by rename, and Kubernetes' symlink swaps, are seen too. Events only wake the watcher up; what
//! counts is the files' content fingerprint, so a touched-but-unchanged file does nothing. A
//! short debounce lets a writer finish before the files are read, and a slow poll backs up
//! inotify on file systems that miss events.

use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

/// Quiet time after the last event before the files are read.
pub const DEBOUNCE: Duration = Duration::from_millis(150);
/// Longest the debounce waits: other files in the same directory may never go quiet.
pub const DEBOUNCE_MAX: Duration = Duration::from_secs(1);
/// Fallback poll period.
pub const POLL: Duration = Duration::from_secs(2);

/// Content fingerprint of a set of files; an unreadable file counts as its error kind.
pub fn fingerprint(paths: &[PathBuf]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in paths {
        match std::fs::read(p) {
            Ok(bytes) => bytes.hash(&mut h),
            Err(e) => format!("{:?}", e.kind()).hash(&mut h),
        }
    }
    h.finish()
}

/// Calls `on_change` (on a dedicated thread) each time the content of `paths` changes.
pub fn spawn(name: &str, paths: Vec<PathBuf>, mut on_change: impl FnMut() + Send + 'static) {
    let name = name.to_string();
    let thread_name = format!("watch-{name}");
    let spawned = std::thread::Builder::new().name(thread_name).spawn(move || {
        let (tx, rx) = mpsc::channel::<()>();
        let watcher = notify::recommended_watcher(move |_res: notify::Result<notify::Event>| {
            let _ = tx.send(());
        });
        let mut watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(watch = %name, "file watching unavailable, polling every {POLL:?}: {e}");
                None
            }
        };
        let dirs: BTreeSet<PathBuf> = paths.iter().map(|p| parent_dir(p)).collect();
        if let Some(w) = watcher.as_mut() {
            for d in &dirs {
                if let Err(e) = w.watch(d, RecursiveMode::NonRecursive) {
                    tracing::warn!(watch = %name, dir = %d.display(), "cannot watch directory, polling: {e}");
                }
            }
        }
        let mut last = fingerprint(&paths);
        loop {
            match rx.recv_timeout(POLL) {
                Ok(()) => {
                    // Let the writer finish: wait until events stop for a moment, but not
                    // forever (a log file next door may be written all the time).
                    let since = std::time::Instant::now();
                    while since.elapsed() < DEBOUNCE_MAX && rx.recv_timeout(DEBOUNCE).is_ok() {}
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(POLL);
                }
            }
            let now = fingerprint(&paths);
            if now != last {
                last = now;
                on_change();
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start the file watcher thread: {e}");
    }
}

fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
