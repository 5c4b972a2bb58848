//! Allocator policy: glibc's tunables (the thread cache's size, one arena per worker) and
//! giving freed memory back to the system.
//!
//! A catalog update frees the previous services and clusters while requests allocate on
//! other threads; glibc keeps most of the freed space in per-thread arenas, so a sidecar that
//! took thousands of xDS updates could hold far more than its live heap. `malloc_trim` hands
//! the free pages back. It runs a second after it is asked for (`run` asks after each catalog
//! change; the changes meanwhile ride along), so at most once a second while the catalog keeps
//! changing, and off the runtime's worker threads. Built with the `jemalloc` feature, the
//! same call purges jemalloc's arenas instead, and the glibc tunables are left alone.

use std::time::Duration;

/// How long a trim waits after it is asked for, so that the changes (or give-backs) meanwhile
/// gather into one.
const SETTLE: Duration = Duration::from_secs(1);

/// Gives freed memory back to the system [`SETTLE`] from now, once for however many ask
/// meanwhile: after catalog changes, and after spliced connections give back the buffers a
/// bulk burst grew (`sockets::splice`; glibc keeps freed blocks of that size, 256 KiB, in its
/// heap, resident and counted in the pod's memory, until a trim).
pub fn trim_soon() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static ASKED: AtomicBool = AtomicBool::new(false);
    if ASKED.swap(true, Ordering::Relaxed) {
        return;
    }
    tokio::spawn(async {
        tokio::time::sleep(SETTLE).await;
        ASKED.store(false, Ordering::Relaxed);
        let _ = tokio::task::spawn_blocking(trim_now).await;
    });
}

/// Gives freed memory back to the system now (`overload`, off the runtime's threads): glibc's
/// `malloc_trim`, or with the `jemalloc` feature a purge of every arena.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc")))]
pub fn trim_now() {
    // SAFETY: malloc_trim only walks the allocator's own free lists; 0 keeps no pad.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(feature = "jemalloc")]
pub fn trim_now() {
    super::jemalloc::purge();
}

#[cfg(not(any(feature = "jemalloc", all(target_os = "linux", target_env = "gnu"))))]
pub fn trim_now() {}

/// Caps glibc's malloc arenas at one per worker thread, set before any thread starts. glibc
/// otherwise gives each thread that allocates (workers, the access-log writer, the watchers,
/// the admin thread) an arena of its own, and each keeps the free space of its busiest moment,
/// raising the sidecar's peak memory under load. Workers still get an arena each, so they do
/// not contend; the helper threads share.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc")))]
pub fn limit_arenas(workers: usize) {
    let n = libc::c_int::try_from(workers.max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only sets a tunable of the allocator; no thread is allocating yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, n);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc"))))]
pub fn limit_arenas(_workers: usize) {}

/// How many freed blocks of each size glibc keeps in a thread's cache (its default is 7).
/// A worker has many requests in flight at once, each holding blocks of the same few sizes;
/// past the cache's count, frees and the allocations after them go through the arena's bins,
/// several times slower, and a later block over 1 KiB (a TLS record buffer) first sweeps
/// everything freed there (`malloc_consolidate`). 100 HTTP/2 streams on one connection hold
/// about 1,000 blocks of the smallest size (the h2 crate copies each decoded header value into
/// one, and a count shared on clone into another), hence 1024. The cache holds only blocks up
/// to 1 KiB that were in use together at some moment, so peak memory under load rises a
/// little and idle connections cost what they did.
#[cfg(not(feature = "jemalloc"))]
const TCACHE_COUNT: u32 = 1024;

/// Set in the environment of the process `tune_allocator` started, so it never starts another.
#[cfg(not(feature = "jemalloc"))]
const TUNED: &str = "AETHER_MALLOC_TUNED";
#[cfg(not(feature = "jemalloc"))]
const TCACHE_TUNABLE: &str = "glibc.malloc.tcache_count";

/// glibc reads its malloc tunables from `GLIBC_TUNABLES` only when a process starts, and has no
/// call to change the thread cache's size later. So `run` re-executes itself, once, at its
/// very start (no thread yet; the pid stays the same) with `glibc.malloc.tcache_count` added
/// to whatever `GLIBC_TUNABLES` already holds. An operator who sets `tcache_count` there keeps
/// their value, and `AETHER_MALLOC_TUNED=1` skips the step. If the exec fails (no `/proc`),
/// the process carries on with glibc's defaults.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc")))]
pub fn tune_allocator() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(TUNED).is_some() {
        return;
    }
    let Some(tunables) = with_tcache(std::env::var("GLIBC_TUNABLES").ok().as_deref()) else {
        return;
    };
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| "aether-proxy".into());
    let e = std::process::Command::new("/proc/self/exe")
        .arg0(arg0)
        .args(args)
        .env("GLIBC_TUNABLES", tunables)
        .env(TUNED, "1")
        .exec();
    eprintln!("aether-proxy: running with glibc's default thread cache (re-exec failed: {e})");
}

/// Nothing to do for other targets, or with the `jemalloc` feature (its options are set at link
/// time: `jemalloc.rs`).
#[cfg(not(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc"))))]
pub fn tune_allocator() {}

/// `GLIBC_TUNABLES` with our thread-cache size added; `None` when the operator set one.
#[cfg(not(feature = "jemalloc"))]
fn with_tcache(current: Option<&str>) -> Option<String> {
    let ours = format!("{TCACHE_TUNABLE}={TCACHE_COUNT}");
    match current.map(str::trim).filter(|c| !c.is_empty()) {
        None => Some(ours),
        Some(c)
            if c.split(':')
                .any(|t| t.split('=').next() == Some(TCACHE_TUNABLE)) =>
        {
            None
        }
        Some(c) => Some(format!("{c}:{ours}")),
    }
}

/// The process's resident set in bytes, from `/proc/self/statm`; `None` where it cannot be read.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|page| pages * page)
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_resident_set_is_read_and_plausible() {
        let rss = super::resident_bytes().expect("/proc/self/statm is readable");
        assert!((1 << 20..1 << 40).contains(&rss), "{rss} bytes");
    }

    #[cfg(not(feature = "jemalloc"))]
    #[test]
    fn the_tcache_tunable_is_added_to_the_operators_and_never_replaces_theirs() {
        use super::with_tcache;
        assert_eq!(
            with_tcache(None).as_deref(),
            Some("glibc.malloc.tcache_count=1024")
        );
        assert_eq!(
            with_tcache(Some("")).as_deref(),
            Some("glibc.malloc.tcache_count=1024")
        );
        assert_eq!(
            with_tcache(Some("glibc.malloc.arena_max=2")).as_deref(),
            Some("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=1024")
        );
        assert_eq!(with_tcache(Some("glibc.malloc.tcache_count=7")), None);
        assert_eq!(
            with_tcache(Some("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0")),
            None
        );
        // A longer name that only starts like ours is not ours.
        assert!(with_tcache(Some("glibc.malloc.tcache_count_x=1")).is_some());
    }
}
