//! The `jemalloc` feature: jemalloc as the allocator of the whole process. It is linked
//! unprefixed, so BoringSSL's and glibc's own `malloc` calls go to it too and the process has
//! one allocator, not two each keeping free pages of its own. glibc's tuning (the thread
//! cache's re-exec, the arena cap, the medium-block reuse and the padded over-aligned blocks)
//! is left out: jemalloc has a larger thread cache, size classes, and aligned allocation of its
//! own. What it gets instead is a shorter decay and a purge of every arena where the default
//! build calls `malloc_trim`. The comparison: docs/decisions/0002-allocator.md.

use std::ffi::c_char;

/// The process's allocator: jemalloc, through the same `memory::Allocator` name `main.rs`
/// installs.
pub use tikv_jemallocator::Jemalloc as Allocator;

/// jemalloc's options, read at its first allocation (before `main`; `MALLOC_CONF` in the
/// environment is read after this, so an operator's values win).
///
/// - `dirty_decay_ms:1000`: freed pages an arena no longer uses go back to the system over a
///   second instead of jemalloc's ten, the delay `trim_soon` waits for glibc. Shorter would
///   mean `madvise` calls under load for pages the next burst takes again.
/// - `muzzy_decay_ms:0`: pages go straight back (`MADV_DONTNEED`) rather than first lazily
///   (`MADV_FREE`), which leaves them counted in the resident set, and in the pod's memory,
///   until the kernel runs short.
///
/// No background thread: it would purge on the decay's schedule while the sidecar idles, but
/// costs a thread per sidecar, and the one case where an idle sidecar holds much (after catalog
/// churn) is the purge's.
#[repr(transparent)]
pub struct Conf(*const c_char);

// SAFETY: the pointer is to a constant string that nothing writes.
unsafe impl Sync for Conf {}

/// jemalloc's weak `malloc_conf` is replaced by this definition at link time.
#[no_mangle]
#[used]
#[allow(non_upper_case_globals)]
pub static malloc_conf: Conf = Conf(CONF.as_ptr());

const CONF: &std::ffi::CStr = c"dirty_decay_ms:1000,muzzy_decay_ms:0";

/// Hands every arena's unused dirty pages back to the system now (`arena.<all>.purge`, all
/// being `MALLCTL_ARENAS_ALL`, 4096 in jemalloc 5): the counterpart of `malloc_trim`.
pub(super) fn purge() -> bool {
    // SAFETY: a void control: no value read or written.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            c"arena.4096.purge".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        ) == 0
    }
}

/// Nothing to turn on: the medium-block reuse is glibc's layer (`reuse.rs`).
pub fn reuse_medium_blocks() {}

/// Nothing to give back: see [`reuse_medium_blocks`].
pub fn release_medium_blocks() {}

#[cfg(test)]
mod tests {
    use super::*;

    fn opt(name: &std::ffi::CStr) -> isize {
        let mut v: isize = 0;
        let mut len = std::mem::size_of::<isize>();
        // SAFETY: `opt.*_decay_ms` are ssize_t values, read into one of that size.
        let r = unsafe {
            tikv_jemalloc_sys::mallctl(
                name.as_ptr(),
                (&mut v as *mut isize).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        assert_eq!(r, 0, "{name:?}");
        v
    }

    #[test]
    fn jemalloc_reads_our_options_and_purges_every_arena() {
        // Some allocation first, so that jemalloc has initialised (it has: the test harness
        // allocates), then its options as it took them.
        let v = vec![0u8; 1 << 20];
        drop(v);
        if std::env::var_os("MALLOC_CONF").is_none() {
            assert_eq!(opt(c"opt.dirty_decay_ms"), 1000);
            assert_eq!(opt(c"opt.muzzy_decay_ms"), 0);
        }
        assert!(purge());
    }
}
