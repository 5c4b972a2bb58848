//! The allocator: a larger per-thread cache of freed blocks (for speed), one malloc arena per
//! worker thread, and freed memory given back to the system after catalog churn.
//!
//! A catalog update frees the previous services and clusters while requests allocate on
//! other threads; glibc keeps most of the freed space in per-thread arenas, so a sidecar that
//! took thousands of xDS updates could hold twice its live heap. `malloc_trim` hands the free
//! pages back. It runs a second after a change (the changes meanwhile ride along), so at most
//! once a second while the catalog keeps changing, and off the runtime's worker threads.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::time::Duration;

use crate::catalog::CatalogStore;

/// How long after a catalog change the trim waits for more changes to gather.
const SETTLE: Duration = Duration::from_secs(1);

/// Trims the allocator after catalog changes, for the life of the store.
pub fn trim_after_changes(store: &Arc<CatalogStore>) {
    let mut changed = store.subscribe();
    tokio::spawn(async move {
        while changed.changed().await.is_ok() {
            tokio::time::sleep(SETTLE).await;
            changed.borrow_and_update();
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim only walks the allocator's own free lists; 0 keeps no pad.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

/// Caps glibc's malloc arenas at one per worker thread, set before any thread starts. glibc
/// otherwise gives each thread that allocates (workers, the access-log writer, the watchers,
/// the admin thread) an arena of its own, and each keeps the free space of its busiest moment:
/// a one-worker sidecar's peak RSS under load was 0.6-0.8 MiB higher. Workers still get an
/// arena each, so they do not contend; the helper threads share.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn limit_arenas(workers: usize) {
    let n = libc::c_int::try_from(workers.max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only sets a tunable of the allocator; no thread is allocating yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, n);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn limit_arenas(_workers: usize) {}

/// How many freed blocks of each size glibc keeps in a thread's cache (its default is 7).
/// A worker has many requests in flight at once (32 connections or streams in the benchmarks),
/// each holding blocks of the same few sizes; past the seventh, frees and the allocations after
/// them go through the arena's bins, about 250 instructions each instead of 20. At 128,
/// callgrind counts 3.8k fewer instructions per request on the server side of scenario c (4.3%)
/// and 2.6k at 256 on a (4.4%), at 64 3.1k and 2.1k. The cache holds only blocks up to 1 KiB
/// that were in use together at some moment, so it adds little to the peak.
pub const TCACHE_COUNT: u32 = 128;

/// Set in the environment of the process `tune_allocator` started, so it never starts another.
const TUNED: &str = "AETHER_MALLOC_TUNED";
const TCACHE_TUNABLE: &str = "glibc.malloc.tcache_count";

/// glibc reads its malloc tunables from `GLIBC_TUNABLES` only when a process starts, and has no
/// call to change the thread cache's size later. So `run` re-executes itself, once, at its
/// very start (no thread yet; the pid stays the same) with `glibc.malloc.tcache_count` added
/// to whatever `GLIBC_TUNABLES` already holds. An operator who sets `tcache_count` there keeps
/// their value, and `AETHER_MALLOC_TUNED=1` skips the step. If the exec fails (no `/proc`),
/// the process carries on with glibc's defaults.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
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

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune_allocator() {}

/// `GLIBC_TUNABLES` with our thread-cache size added; `None` when the operator set one.
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

/// Blocks from just above glibc's thread-cache limit (1,032 bytes) to 16 KiB, kept per worker
/// thread for reuse. glibc serves every block of that size from its arena's bins: about 230
/// instructions to allocate and 150 to free, where its thread cache takes 20. A request makes
/// several such blocks (hyper's 8 KiB read buffers, the boxed exchange and connection futures,
/// a response's header entries): 8 a request on the client side of e, 2 to 5 on the others.
///
/// Sizes are rounded up to one of 16 classes (four steps per power of two), so any block of a
/// class can serve any request of it; each class keeps at most [`medium::KEEP_BYTES`] of freed
/// blocks a thread (at most 16 x 64 KiB, blocks that were all in use at once before), and the
/// rest go back to glibc. Only threads that turned the cache on use it: the runtime's threads,
/// which give their blocks back when they stop, so a blocking-pool thread that exits after idling
/// leaves nothing behind. A block may be freed on another thread than the one that made it:
/// every block of a class is a plain `malloc` block of the class's size, whoever holds it.
mod medium {
    use std::cell::{Cell, UnsafeCell};

    /// The smallest size served here: one past the largest glibc's thread cache holds.
    pub const MIN: usize = 1033;
    /// The largest size served here.
    pub const MAX: usize = 16 * 1024;
    const CLASSES: usize = 16;
    /// Freed bytes a class keeps per thread.
    pub const KEEP_BYTES: usize = 64 * 1024;

    /// The class of a size in `MIN..=MAX`: four classes per power of two, 1280 to 16384.
    pub fn class(size: usize) -> usize {
        debug_assert!((MIN..=MAX).contains(&size));
        let s = size - 1;
        let exp = (usize::BITS - 1 - s.leading_zeros()) as usize; // 10..=13
        (exp - 10) * 4 + ((s >> (exp - 2)) & 3)
    }

    /// The size every block of class `c` has.
    pub fn class_size(c: usize) -> usize {
        let exp = 10 + c / 4;
        (4 + c % 4 + 1) << (exp - 2)
    }

    fn keep(c: usize) -> u16 {
        (KEEP_BYTES / class_size(c)).max(2) as u16
    }

    struct Bins {
        /// Freed blocks of each class, linked through their first word.
        head: [*mut u8; CLASSES],
        count: [u16; CLASSES],
    }

    thread_local! {
        // Neither needs dropping, so neither registers a destructor: safe to touch from inside
        // the allocator.
        static BINS: UnsafeCell<Bins> = const {
            UnsafeCell::new(Bins { head: [std::ptr::null_mut(); CLASSES], count: [0; CLASSES] })
        };
        static ON: Cell<bool> = const { Cell::new(false) };
    }

    pub fn enable() {
        ON.with(|on| on.set(true));
    }

    /// A cached block of class `c`, if this thread has one.
    pub fn take(c: usize) -> Option<*mut u8> {
        if !ON.with(Cell::get) {
            return None;
        }
        BINS.with(|b| {
            // SAFETY: the bins are this thread's alone and no reference to them outlives this
            // call; a cached block is at least a class size long, so its first word is ours.
            unsafe {
                let b = &mut *b.get();
                let p = b.head[c];
                if p.is_null() {
                    return None;
                }
                b.head[c] = (p as *mut *mut u8).read();
                b.count[c] -= 1;
                Some(p)
            }
        })
    }

    /// Keeps a freed block of class `c`; false when this thread does not cache or the class is
    /// full (the caller frees it).
    pub fn keep_block(p: *mut u8, c: usize) -> bool {
        if !ON.with(Cell::get) {
            return false;
        }
        BINS.with(|b| {
            // SAFETY: as in `take`; `p` is a freed block of class `c` that nothing else uses.
            unsafe {
                let b = &mut *b.get();
                if b.count[c] >= keep(c) {
                    return false;
                }
                (p as *mut *mut u8).write(b.head[c]);
                b.head[c] = p;
                b.count[c] += 1;
                true
            }
        })
    }

    /// Turns this thread's cache off and frees what it holds.
    pub fn release() {
        ON.with(|on| on.set(false));
        BINS.with(|b| {
            // SAFETY: as in `take`; each block leaves the list before it is freed.
            unsafe {
                let b = &mut *b.get();
                for c in 0..CLASSES {
                    while !b.head[c].is_null() {
                        let p = b.head[c];
                        b.head[c] = (p as *mut *mut u8).read();
                        libc::free(p as *mut libc::c_void);
                    }
                    b.count[c] = 0;
                }
            }
        })
    }
}

/// Turns on the medium-block cache for this thread (a runtime thread, at its start).
pub fn cache_medium_blocks() {
    medium::enable();
}

/// Gives this thread's cached medium blocks back to glibc (a runtime thread, as it stops).
pub fn release_medium_blocks() {
    medium::release();
}

/// The process's allocator: glibc's, with over-aligned blocks (tokio's task cells and I/O
/// registrations ask for 128-byte alignment against false sharing) served by plain `malloc`.
/// glibc's `posix_memalign` never uses the thread cache and splits a larger chunk each time:
/// about 1,000 instructions an allocation where `malloc` takes 20-100, and every h2 stream and
/// every accepted connection makes one or two. Here such a block is `malloc(size + align)`,
/// handed out at the first aligned address past the start, with the distance back to the start
/// stored in the word just before it (there are always at least 16 bytes: glibc's blocks are
/// 16-aligned and the alignments taken here are 32 or more). Alignments above a page go to
/// glibc as before.
pub struct Allocator;

/// What glibc's `malloc` guarantees on 64-bit targets.
const MALLOC_ALIGN: usize = 16;
/// The largest alignment served by over-allocating; larger ones would waste too much.
const MAX_PADDED_ALIGN: usize = 4096;

impl Allocator {
    fn padded(layout: Layout) -> bool {
        layout.align() > MALLOC_ALIGN && layout.align() <= MAX_PADDED_ALIGN
    }

    /// The medium class of a block with `size` and `align`, if it is one (`medium`).
    fn medium(size: usize, align: usize) -> Option<usize> {
        (align <= MALLOC_ALIGN && (medium::MIN..=medium::MAX).contains(&size))
            .then(|| medium::class(size))
    }
}

// SAFETY: every block is either glibc's own (malloc/calloc/realloc or System for the rest) and
// freed the same way, a medium block (a `malloc` block of its class's size, cached or freed
// whole), or a padded block whose start is recovered from the word before it. `padded` and
// `medium` depend only on the layout, which the caller passes unchanged to `dealloc`.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(c) = Self::medium(layout.size(), layout.align()) {
            return match medium::take(c) {
                Some(p) => p,
                // SAFETY: a plain allocation of the class's size.
                None => unsafe { libc::malloc(medium::class_size(c)) as *mut u8 },
            };
        }
        if Self::padded(layout) {
            // SAFETY: the size cannot overflow (a Layout's size rounded up to its align fits
            // in isize); the pointer arithmetic stays inside the block just allocated.
            unsafe {
                let start = libc::malloc(layout.size() + layout.align()) as *mut u8;
                if start.is_null() {
                    return start;
                }
                let lead = layout.align() - (start as usize & (layout.align() - 1));
                let block = start.add(lead);
                (block as *mut usize).sub(1).write(lead);
                block
            }
        } else {
            // SAFETY: forwarded unchanged.
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if let Some(c) = Self::medium(layout.size(), layout.align()) {
            if !medium::keep_block(ptr, c) {
                // SAFETY: a medium block is a plain `malloc` block.
                unsafe { libc::free(ptr as *mut libc::c_void) };
            }
            return;
        }
        if Self::padded(layout) {
            // SAFETY: `alloc` wrote the lead into the word before `ptr`.
            unsafe {
                let lead = (ptr as *const usize).sub(1).read();
                libc::free(ptr.sub(lead) as *mut libc::c_void);
            }
        } else {
            // SAFETY: forwarded unchanged.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if Self::medium(layout.size(), layout.align()).is_some() || Self::padded(layout) {
            // SAFETY: `alloc` returns `layout.size()` writable bytes or null.
            unsafe {
                let p = self.alloc(layout);
                if !p.is_null() {
                    p.write_bytes(0, layout.size());
                }
                p
            }
        } else {
            // SAFETY: forwarded unchanged.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (was, will) = (
            Self::medium(layout.size(), layout.align()),
            Self::medium(new_size, layout.align()),
        );
        if was.is_some() || will.is_some() {
            if was.is_some() && was == will {
                // The block already has its class's size.
                return ptr;
            }
            // A medium block is a plain `malloc` block, and a block that becomes one gets its
            // class's full size, so glibc's realloc serves every case.
            let size = will.map_or(new_size, medium::class_size);
            // SAFETY: `ptr` is a plain `malloc` block (medium, or glibc's own at align <= 16).
            return unsafe { libc::realloc(ptr as *mut libc::c_void, size) as *mut u8 };
        }
        if Self::padded(layout) {
            // SAFETY: the new block has room for both sizes' minimum; the old one is ours.
            unsafe {
                let new = Layout::from_size_align_unchecked(new_size, layout.align());
                let p = self.alloc(new);
                if !p.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                p
            }
        } else {
            // SAFETY: forwarded unchanged.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tcache_tunable_is_added_to_the_operators_and_never_replaces_theirs() {
        assert_eq!(
            with_tcache(None).as_deref(),
            Some("glibc.malloc.tcache_count=128")
        );
        assert_eq!(
            with_tcache(Some("")).as_deref(),
            Some("glibc.malloc.tcache_count=128")
        );
        assert_eq!(
            with_tcache(Some("glibc.malloc.arena_max=2")).as_deref(),
            Some("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=128")
        );
        assert_eq!(with_tcache(Some("glibc.malloc.tcache_count=7")), None);
        assert_eq!(
            with_tcache(Some("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0")),
            None
        );
        // A longer name that only starts like ours is not ours.
        assert!(with_tcache(Some("glibc.malloc.tcache_count_x=1")).is_some());
    }

    #[test]
    fn every_medium_size_has_the_smallest_class_that_holds_it() {
        let mut last = 0;
        for c in 0..16 {
            assert!(medium::class_size(c) > last, "classes grow");
            last = medium::class_size(c);
        }
        assert_eq!(medium::class_size(0), 1280);
        assert_eq!(medium::class_size(15), medium::MAX);
        for size in medium::MIN..=medium::MAX {
            let c = medium::class(size);
            assert!(medium::class_size(c) >= size, "size {size} class {c}");
            if c > 0 {
                assert!(
                    medium::class_size(c - 1) < size,
                    "size {size} fits class {}",
                    c - 1
                );
            }
        }
    }

    #[test]
    fn medium_blocks_are_reused_kept_within_bounds_and_given_back() {
        let a = Allocator;
        let l = Layout::from_size_align(8192, 8).unwrap();
        cache_medium_blocks();
        // SAFETY: each block is used within its layout and freed with it.
        unsafe {
            let p = a.alloc(l);
            p.write_bytes(0x5A, l.size());
            a.dealloc(p, l);
            // The same class, another size in it: the block just freed comes back.
            let q = a.alloc(Layout::from_size_align(7500, 8).unwrap());
            assert_eq!(p, q);
            a.dealloc(q, Layout::from_size_align(7500, 8).unwrap());

            // More frees than a class keeps: the rest go to glibc, none are lost or kept twice.
            let many: Vec<_> = (0..40).map(|_| a.alloc(l)).collect();
            let mut distinct = many.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 40);
            for &p in &many {
                a.dealloc(p, l);
            }
            let kept = medium::KEEP_BYTES / 8192;
            let again: Vec<_> = (0..40).map(|_| a.alloc(l)).collect();
            let reused = again.iter().filter(|p| many.contains(p)).count();
            assert!(reused >= kept, "{reused} of {kept} kept blocks reused");
            for &p in &again {
                a.dealloc(p, l);
            }

            // Growing and shrinking keep the bytes, across classes and to and from glibc's sizes.
            let small = Layout::from_size_align(600, 8).unwrap();
            let p = a.alloc(small);
            p.write_bytes(0x11, 600);
            let p = a.realloc(p, small, 3000);
            assert!(std::slice::from_raw_parts(p, 600)
                .iter()
                .all(|&b| b == 0x11));
            p.add(600).write_bytes(0x22, 2400);
            let same = a.realloc(p, Layout::from_size_align(3000, 8).unwrap(), 3072);
            assert_eq!(same, p, "a size within the block's class keeps the block");
            let p = a.realloc(same, Layout::from_size_align(3072, 8).unwrap(), 12_000);
            assert!(std::slice::from_raw_parts(p.add(600), 2400)
                .iter()
                .all(|&b| b == 0x22));
            let p = a.realloc(p, Layout::from_size_align(12_000, 8).unwrap(), 40_000);
            assert!(std::slice::from_raw_parts(p, 600)
                .iter()
                .all(|&b| b == 0x11));
            let p = a.realloc(p, Layout::from_size_align(40_000, 8).unwrap(), 2000);
            assert!(std::slice::from_raw_parts(p, 600)
                .iter()
                .all(|&b| b == 0x11));
            let p = a.realloc(p, Layout::from_size_align(2000, 8).unwrap(), 100);
            assert!(std::slice::from_raw_parts(p, 100)
                .iter()
                .all(|&b| b == 0x11));
            a.dealloc(p, Layout::from_size_align(100, 8).unwrap());

            let z = a.alloc_zeroed(l);
            assert!(std::slice::from_raw_parts(z, l.size())
                .iter()
                .all(|&b| b == 0));
            a.dealloc(z, l);

            // A thread that stops gives its blocks back and caches no more.
            let p = a.alloc(l);
            a.dealloc(p, l);
            release_medium_blocks();
            assert_eq!(medium::take(medium::class(8192)), None);
            let q = a.alloc(l);
            a.dealloc(q, l);
            assert_eq!(medium::take(medium::class(8192)), None);
        }
    }

    #[test]
    fn a_medium_block_freed_on_another_thread_serves_that_thread() {
        let a = Allocator;
        let l = Layout::from_size_align(5000, 16).unwrap();
        // SAFETY: the block is freed once, with its layout, and then reused whole.
        let p = unsafe { a.alloc(l) } as usize;
        std::thread::spawn(move || {
            cache_medium_blocks();
            // SAFETY: as above.
            unsafe {
                a.dealloc(p as *mut u8, l);
                let q = a.alloc(l);
                assert_eq!(q as usize, p);
                q.write_bytes(0x33, l.size());
                a.dealloc(q, l);
            }
            release_medium_blocks();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn over_aligned_blocks_are_aligned_usable_and_freed_whole() {
        let a = Allocator;
        for align in [32usize, 64, 128, 256, 4096, 8192] {
            for size in [1usize, 8, 100, 128, 1000, 5000] {
                let l = Layout::from_size_align(size, align).unwrap();
                // SAFETY: sizes are non-zero; each block is freed with its own layout.
                unsafe {
                    let p = a.alloc(l);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    p.write_bytes(0xAB, size);
                    let z = a.alloc_zeroed(l);
                    assert_eq!(z as usize % align, 0);
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    let grown = a.realloc(p, l, size * 3);
                    assert_eq!(grown as usize % align, 0);
                    assert!(std::slice::from_raw_parts(grown, size)
                        .iter()
                        .all(|&b| b == 0xAB));
                    a.dealloc(grown, Layout::from_size_align(size * 3, align).unwrap());
                    a.dealloc(z, l);
                }
            }
        }
    }
}
