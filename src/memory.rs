//! The allocator: a larger per-thread cache of freed blocks (for speed), one malloc arena per
//! worker thread, and freed memory given back to the system after catalog churn and after
//! tunnels give back their bulk buffers.
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

/// How long a trim waits after it is asked for, so that the changes (or give-backs) meanwhile
/// gather into one.
const SETTLE: Duration = Duration::from_secs(1);

/// Trims the allocator after catalog changes, for the life of the store.
pub fn trim_after_changes(store: &Arc<CatalogStore>) {
    let mut changed = store.subscribe();
    tokio::spawn(async move {
        while changed.changed().await.is_ok() {
            trim_soon();
        }
    });
}

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
        let _ = tokio::task::spawn_blocking(trim).await;
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
/// A worker has many requests in flight at once, each holding blocks of the same few sizes;
/// past the cache's count, frees and the allocations after them go through the arena's bins,
/// about 250 instructions each instead of 20, and a later block over 1 KiB (a TLS record
/// buffer) first sweeps everything freed there (`malloc_consolidate`). 128 covered 32 requests
/// in flight (callgrind: -4.3% on the server side of scenario c against 7). 100 HTTP/2 streams
/// on one connection hold about 1,000 blocks of the smallest size (the h2 crate copies each
/// decoded header value into one, and a count shared on clone into another), so 1024: -4.6%
/// on the server side of scenario h against 128, -1.6% on c's, -1.9% on h's client side. The
/// cache holds only blocks up to 1 KiB that were in use together at some moment; peak RSS
/// under load rose by 0.2-0.8 MiB and idle connections cost what they did.
pub const TCACHE_COUNT: u32 = 1024;

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

/// Freed blocks of a few exact sizes just above glibc's thread-cache limit (1,032 bytes), kept
/// per runtime thread for reuse. glibc serves every block of that size from its arena's bins:
/// about 230 instructions to allocate and 150 to free, where its thread cache takes 20. A
/// request makes several such blocks, nearly all of a handful of sizes fixed by their types
/// (hyper's 8 KiB read buffers, the boxed exchange and connection futures): 8 a request on the
/// client side of scenario e, 2 or 3 on a and c.
///
/// Blocks are matched by their exact size, never rounded up to a class: a rounded block is
/// bigger than what was asked for, and across every allocation of the process that cost
/// 1.3 MiB of idle RSS when it was tried. Each thread has [`SLOTS`] slots, each holding freed
/// blocks of one size (taken by the first size freed into an empty slot), at most
/// [`KEEP_BYTES`] of them; other sizes and the rest go to glibc. Only the runtime's threads
/// turn it on, and give their blocks back when they stop. A block may be freed on another
/// thread than the one that made it: every block here is a plain `malloc` block of its size.
mod reuse {
    use std::cell::UnsafeCell;

    /// The smallest size kept: one past the largest glibc's thread cache holds.
    pub const MIN: usize = 1033;
    /// The largest size kept.
    pub const MAX: usize = 16 * 1024;
    /// Sizes a thread keeps at once.
    pub const SLOTS: usize = 8;
    /// Freed bytes a slot keeps.
    pub const KEEP_BYTES: usize = 64 * 1024;
    // Every kept size fits at least twice, so no slot needs a floor of its own.
    const _: () = assert!(2 * MAX <= KEEP_BYTES);

    #[derive(Clone, Copy)]
    struct Slot {
        size: usize,
        /// Freed blocks, linked through their first word.
        head: *mut u8,
        count: u16,
    }

    const EMPTY: Slot = Slot {
        size: 0,
        head: std::ptr::null_mut(),
        count: 0,
    };

    /// A thread's slots, and whether the thread keeps blocks at all.
    struct Kept {
        on: bool,
        slots: [Slot; SLOTS],
    }

    thread_local! {
        // Needs no dropping, so registers no destructor: safe to touch from inside the
        // allocator.
        static KEPT: UnsafeCell<Kept> = const {
            UnsafeCell::new(Kept { on: false, slots: [EMPTY; SLOTS] })
        };
    }

    /// Runs `f` on this thread's slots when the thread keeps blocks.
    fn with_kept<T>(f: impl FnOnce(&mut [Slot; SLOTS]) -> Option<T>) -> Option<T> {
        KEPT.with(|k| {
            // SAFETY: the slots are this thread's alone, `f` never allocates, and no reference
            // to them outlives this call.
            let k = unsafe { &mut *k.get() };
            if k.on {
                f(&mut k.slots)
            } else {
                None
            }
        })
    }

    pub fn enable() {
        // SAFETY: as in `with_kept`.
        KEPT.with(|k| unsafe { (*k.get()).on = true });
    }

    /// Whether a slot of `size` blocks holding `count` has room for one more within
    /// `KEEP_BYTES` (a multiplication, not a division, on every free).
    fn has_room(count: u16, size: usize) -> bool {
        (count as usize + 1) * size <= KEEP_BYTES
    }

    /// A kept block of exactly `size` bytes, if this thread has one.
    pub fn take(size: usize) -> Option<*mut u8> {
        with_kept(|slots| {
            let slot = slots.iter_mut().find(|s| s.size == size && s.count > 0)?;
            let p = slot.head;
            // SAFETY: a kept block is `size` bytes long and its first word links the next.
            slot.head = unsafe { (p as *mut *mut u8).read() };
            slot.count -= 1;
            Some(p)
        })
    }

    /// Keeps a freed block of `size` bytes; false when this thread does not keep blocks, or
    /// has no room for this one (the caller frees it).
    pub fn put(p: *mut u8, size: usize) -> bool {
        with_kept(|slots| {
            // The slot of this size, else an empty one, which takes this size.
            let i = slots
                .iter()
                .position(|s| s.size == size)
                .or_else(|| slots.iter().position(|s| s.count == 0))?;
            let slot = &mut slots[i];
            slot.size = size;
            if !has_room(slot.count, size) {
                return None;
            }
            // SAFETY: `p` is a freed block of `size` bytes that nothing else uses.
            unsafe { (p as *mut *mut u8).write(slot.head) };
            slot.head = p;
            slot.count += 1;
            Some(())
        })
        .is_some()
    }

    /// Turns this thread's reuse off and frees what it keeps.
    pub fn release() {
        KEPT.with(|k| {
            // SAFETY: as in `with_kept`; each block leaves its list before it is freed.
            unsafe {
                let k = &mut *k.get();
                k.on = false;
                for slot in k.slots.iter_mut() {
                    while !slot.head.is_null() {
                        let p = slot.head;
                        slot.head = (p as *mut *mut u8).read();
                        libc::free(p as *mut libc::c_void);
                    }
                    *slot = EMPTY;
                }
            }
        })
    }
}

/// Turns on the reuse of freed medium blocks for this thread (a runtime thread, at its start).
pub fn reuse_medium_blocks() {
    reuse::enable();
}

/// Gives this thread's kept medium blocks back to glibc (a runtime thread, as it stops).
pub fn release_medium_blocks() {
    reuse::release();
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

    /// A block that `reuse` may keep: a plain `malloc` block of a medium size.
    fn medium(layout: Layout) -> bool {
        layout.align() <= MALLOC_ALIGN && (reuse::MIN..=reuse::MAX).contains(&layout.size())
    }
}

// SAFETY: every block is either glibc's own (malloc/calloc/realloc or System for the rest) and
// freed the same way, or a padded block whose start is recovered from the word before it. A
// medium block is a plain `malloc` block of at least its layout's size whichever path made
// it (System takes `malloc` at these sizes and alignments), so one kept by `reuse` serves any
// later request of that size and is freed by `free` in the end. `padded` and `medium` depend
// only on the layout, which the caller passes unchanged to `dealloc`.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if Self::medium(layout) {
            if let Some(p) = reuse::take(layout.size()) {
                return p;
            }
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
        if Self::medium(layout) && reuse::put(ptr, layout.size()) {
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
        if Self::padded(layout) {
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
            // A growing vector (a header map's entries) reaches a medium size by `realloc`:
            // served by glibc, it would miss the kept blocks and fill their slot with frees
            // that no `alloc` takes again. A shrink stays with glibc, which does it in place.
            let new = Layout::from_size_align(new_size, layout.align());
            if let Some(p) = new
                .ok()
                .filter(|&n| new_size > layout.size() && Self::medium(n))
                .and_then(|n| reuse::take(n.size()))
            {
                // SAFETY: `p` is a kept block of `new_size` bytes and `ptr` a live one of
                // `layout.size()`; the old block is freed the way it was made.
                unsafe {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                return p;
            }
            // SAFETY: forwarded unchanged.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }
}

/// Boxes the future `make` builds, building it in the box. `Box::pin(fut)` builds the future
/// on the stack and then copies all of it into the heap: its size is that of its largest
/// state, several KiB for an exchange with the pool and retries in it, although only its
/// arguments are set when it is made. Written into the box, only those are stored (the
/// optimiser builds the value in place once the closure is inlined).
#[inline(always)]
pub fn box_future<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    let mut slot = Box::<F>::new_uninit();
    slot.write(make());
    // SAFETY: written just above.
    Box::into_pin(unsafe { slot.assume_init() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_future_built_in_its_box_runs_once_and_drops_what_it_holds() {
        struct Counted(std::rc::Rc<std::cell::Cell<u32>>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.set(self.0.get() + 1);
            }
        }
        let drops = std::rc::Rc::new(std::cell::Cell::new(0));
        let held = Counted(drops.clone());
        // A future with a large state (a buffer kept across an await), as the exchange's is.
        let fut = box_future(|| async move {
            let mut big = [0u8; 4096];
            tokio::task::yield_now().await;
            big[4095] = 7;
            let _keep = &held;
            big.iter().map(|&b| b as u32).sum::<u32>()
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(fut), 7);
        assert_eq!(drops.get(), 1);
        // Dropped before it is polled, it drops what it captured too.
        let held = Counted(drops.clone());
        drop(box_future(|| async move { drop(held) }));
        assert_eq!(drops.get(), 2);
    }

    #[test]
    fn the_tcache_tunable_is_added_to_the_operators_and_never_replaces_theirs() {
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

    #[test]
    fn medium_blocks_are_reused_by_exact_size_kept_within_bounds_and_given_back() {
        let a = Allocator;
        let l = Layout::from_size_align(8192, 8).unwrap();
        reuse_medium_blocks();
        // SAFETY: each block is used within its layout and freed with it.
        unsafe {
            let p = a.alloc(l);
            p.write_bytes(0x5A, l.size());
            a.dealloc(p, l);
            // Another size never gets it (it would be bigger than asked for)...
            let other = Layout::from_size_align(7500, 8).unwrap();
            let q = a.alloc(other);
            assert_ne!(p, q);
            a.dealloc(q, other);
            // ...the same size does.
            let r = a.alloc(l);
            assert_eq!(p, r);
            a.dealloc(r, l);

            // More frees than a slot keeps: the rest go to glibc, none are lost or kept twice.
            let many: Vec<_> = (0..40).map(|_| a.alloc(l)).collect();
            let mut distinct = many.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 40);
            for &p in &many {
                a.dealloc(p, l);
            }
            let kept = reuse::KEEP_BYTES / 8192;
            let again: Vec<_> = (0..40).map(|_| a.alloc(l)).collect();
            let reused = again.iter().filter(|p| many.contains(p)).count();
            assert!(reused >= kept, "{reused} of {kept} kept blocks reused");
            for &p in &again {
                a.dealloc(p, l);
            }
            // Exactly what the bound allows stayed kept, all of them blocks of this size.
            let mut drained = 0;
            while let Some(p) = reuse::take(8192) {
                assert!(again.contains(&p));
                libc::free(p as *mut libc::c_void);
                drained += 1;
            }
            assert_eq!(drained, kept);

            // More sizes than slots: each size beyond them goes to glibc, and every block
            // comes back whole and writable.
            let sizes: Vec<_> = (0..reuse::SLOTS + 4).map(|i| 2000 + i * 100).collect();
            let blocks: Vec<_> = sizes
                .iter()
                .map(|&n| (a.alloc(Layout::from_size_align(n, 8).unwrap()), n))
                .collect();
            for &(p, n) in &blocks {
                a.dealloc(p, Layout::from_size_align(n, 8).unwrap());
            }
            // The slot of 8192 is empty again and may be taken, the one of 7500 is not: at
            // most SLOTS - 1 of the new sizes were kept, and the first ones were.
            let kept_sizes: Vec<_> = sizes
                .iter()
                .filter(|&&n| match reuse::take(n) {
                    Some(p) => {
                        libc::free(p as *mut libc::c_void);
                        true
                    }
                    None => false,
                })
                .collect();
            assert!(kept_sizes.len() < reuse::SLOTS, "{kept_sizes:?}");
            assert_eq!(kept_sizes.first(), Some(&&sizes[0]));
            for &n in &sizes {
                let l = Layout::from_size_align(n, 8).unwrap();
                let p = a.alloc(l);
                p.write_bytes(0x44, n);
                a.dealloc(p, l);
            }

            // A kept block grows and shrinks through glibc like any other.
            let p = a.alloc(l);
            p.write_bytes(0x11, l.size());
            let p = a.realloc(p, l, 40_000);
            assert!(std::slice::from_raw_parts(p, 8192)
                .iter()
                .all(|&b| b == 0x11));
            let p = a.realloc(p, Layout::from_size_align(40_000, 8).unwrap(), 3000);
            assert!(std::slice::from_raw_parts(p, 3000)
                .iter()
                .all(|&b| b == 0x11));
            a.dealloc(p, Layout::from_size_align(3000, 8).unwrap());

            // A thread that stops gives its blocks back and keeps no more.
            let p = a.alloc(l);
            a.dealloc(p, l);
            release_medium_blocks();
            assert_eq!(reuse::take(8192), None);
            let q = a.alloc(l);
            a.dealloc(q, l);
            assert_eq!(reuse::take(8192), None);
        }
    }

    #[test]
    fn a_vector_growing_into_a_medium_size_takes_a_kept_block_and_keeps_its_bytes() {
        std::thread::spawn(|| {
            let a = Allocator;
            let small = Layout::from_size_align(600, 8).unwrap();
            let medium = Layout::from_size_align(1248, 8).unwrap();
            reuse_medium_blocks();
            // SAFETY: each block is used within its layout and freed with it.
            unsafe {
                let kept = a.alloc(medium);
                a.dealloc(kept, medium);
                let p = a.alloc(small);
                p.write_bytes(0x7C, small.size());
                let grown = a.realloc(p, small, medium.size());
                assert_eq!(grown, kept, "the grown block is the kept one");
                assert!(std::slice::from_raw_parts(grown, 600)
                    .iter()
                    .all(|&b| b == 0x7C));
                grown.add(600).write_bytes(0x7D, 648);
                // With none kept, glibc grows it as before.
                assert_eq!(reuse::take(medium.size()), None);
                let again = a.realloc(a.alloc(small), small, medium.size());
                assert!(!again.is_null());
                again.write_bytes(0x01, medium.size());
                a.dealloc(again, medium);
                a.dealloc(grown, medium);
                // A shrink into a kept size stays with glibc (in place, no copy).
                let big = Layout::from_size_align(5000, 8).unwrap();
                let p = a.alloc(big);
                p.write_bytes(0x2E, big.size());
                let shrunk = a.realloc(p, big, medium.size());
                assert_ne!(shrunk, grown, "a kept block is not taken by a shrink");
                assert!(std::slice::from_raw_parts(shrunk, medium.size())
                    .iter()
                    .all(|&b| b == 0x2E));
                a.dealloc(shrunk, medium);
            }
            release_medium_blocks();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_medium_block_freed_on_another_thread_serves_that_thread() {
        let a = Allocator;
        let l = Layout::from_size_align(5000, 16).unwrap();
        // SAFETY: the block is freed once, with its layout, and then reused whole.
        let p = unsafe { a.alloc(l) } as usize;
        std::thread::spawn(move || {
            reuse_medium_blocks();
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
