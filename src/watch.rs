//! Watching files for change: the catalog and the identity files.
//!
//! The parent directories are watched (not the files), so editors and tools that replace a file
//! by rename, and Kubernetes' `..data` symlink swaps, are seen too. Only creations, removals,
//! renames and closes-after-write wake the watcher: per-write events would make every busy
//! neighbour in the directory (a log file) cost CPU here. What counts is the files' content
//! fingerprint, so a wake-up that changed nothing does nothing. A short debounce lets a writer
//! finish, and a slow poll catches writers that never close the file.

use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use inotify::{Inotify, WatchMask};

/// Quiet time after the last event before the files are read.
pub const DEBOUNCE: Duration = Duration::from_millis(150);
/// Longest the debounce waits: a directory may never go quiet.
pub const DEBOUNCE_MAX: Duration = Duration::from_secs(1);
/// Poll period: the content is compared at least this often whatever the events say.
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

/// Waits up to `timeout` for the inotify fd to be readable, then drains what is queued.
/// Returns whether there were events.
fn wait_events(ino: &mut Inotify, buf: &mut [u8], timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: ino.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
    if n <= 0 {
        return false;
    }
    let mut any = false;
    while let Ok(mut events) = ino.read_events(buf) {
        if events.next().is_none() {
            break;
        }
        any = true;
    }
    any
}

/// Calls `on_change` (on a dedicated thread) each time the content of `paths` changes.
pub fn spawn(name: &str, paths: Vec<PathBuf>, mut on_change: impl FnMut() + Send + 'static) {
    let name = name.to_string();
    let thread_name = format!("watch-{name}");
    let spawned = std::thread::Builder::new().name(thread_name).spawn(move || {
        let dirs: BTreeSet<PathBuf> = paths.iter().map(|p| parent_dir(p)).collect();
        let mut ino = match Inotify::init() {
            Ok(i) => Some(i),
            Err(e) => {
                tracing::warn!(watch = %name, "inotify unavailable, polling every {POLL:?}: {e}");
                None
            }
        };
        if let Some(i) = ino.as_mut() {
            let mask = WatchMask::CREATE
                | WatchMask::DELETE
                | WatchMask::MOVED_FROM
                | WatchMask::MOVED_TO
                | WatchMask::CLOSE_WRITE;
            for d in &dirs {
                if let Err(e) = i.watches().add(d, mask) {
                    tracing::warn!(watch = %name, dir = %d.display(), "cannot watch directory, polling: {e}");
                }
            }
        }
        let mut buf = [0u8; 4096];
        let mut last = fingerprint(&paths);
        loop {
            match ino.as_mut() {
                Some(i) => {
                    if wait_events(i, &mut buf, POLL) {
                        // Let the writer finish, but not forever.
                        let since = Instant::now();
                        while since.elapsed() < DEBOUNCE_MAX && wait_events(i, &mut buf, DEBOUNCE) {
                        }
                    }
                }
                None => std::thread::sleep(POLL),
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
