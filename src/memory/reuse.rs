//! Freed blocks of a few exact sizes just above glibc's thread-cache limit (1,032 bytes), kept
//! per runtime thread for reuse. glibc serves every block of that size from its arena's bins,
//! several times slower than from its thread cache. A request makes several such blocks,
//! nearly all of a handful of sizes fixed by their types (hyper's 8 KiB read buffers, the
//! boxed exchange and connection futures), more on a new connection than on a reused one.
//!
//! Blocks are matched by their exact size, never rounded up to a class: a rounded block is
//! bigger than what was asked for, and across every allocation of the process that raised
//! idle memory when it was tried. Each thread has [`SLOTS`] slots, each holding freed
//! blocks of one size (taken by the first size freed into an empty slot), at most
//! [`KEEP_BYTES`] of them; other sizes and the rest go to glibc. Only the runtime's threads
//! turn it on, and give their blocks back when they stop. A block may be freed on another
//! thread than the one that made it: every block here is a plain `malloc` block of its size.
//!
//! `AETHER_ALLOC_CACHE=off` in the environment keeps it off on every thread, so that valgrind
//! or a sanitizer sees every free as the code makes it (a kept block is freed only when its
//! thread stops, and reused without the tool seeing a new allocation).

use std::cell::UnsafeCell;
use std::sync::OnceLock;

/// The environment variable that turns the reuse off: `off`; `on`, empty or unset leave it on.
pub(super) const SWITCH: &str = "AETHER_ALLOC_CACHE";

/// The smallest size kept: one past the largest glibc's thread cache holds.
pub(super) const MIN: usize = 1033;
/// The largest size kept.
pub(super) const MAX: usize = 16 * 1024;
/// Sizes a thread keeps at once.
const SLOTS: usize = 8;
/// Freed bytes a slot keeps.
const KEEP_BYTES: usize = 64 * 1024;
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

fn enable() {
    // SAFETY: as in `with_kept`.
    KEPT.with(|k| unsafe { (*k.get()).on = true });
}

/// Whether a slot of `size` blocks holding `count` has room for one more within
/// `KEEP_BYTES` (a multiplication, not a division, on every free).
fn has_room(count: u16, size: usize) -> bool {
    (count as usize + 1) * size <= KEEP_BYTES
}

/// A kept block of exactly `size` bytes, if this thread has one.
pub(super) fn take(size: usize) -> Option<*mut u8> {
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
pub(super) fn put(p: *mut u8, size: usize) -> bool {
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
fn release() {
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

/// What `AETHER_ALLOC_CACHE` asks for: `Ok(true)` to keep blocks, `Ok(false)` not to, an error
/// naming the value it does not know.
fn switch(value: Option<&std::ffi::OsStr>) -> Result<bool, String> {
    match value.map(|v| v.to_str().map(str::trim)) {
        None | Some(Some("" | "on")) => Ok(true),
        Some(Some("off")) => Ok(false),
        Some(_) => Err(format!(
            "{SWITCH}={value:?} ignored (on or off); the medium-block cache stays on",
            value = value.unwrap_or_default()
        )),
    }
}

/// Whether the runtime's threads keep blocks: `AETHER_ALLOC_CACHE`, read once, at the first
/// runtime thread's start.
fn wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| match switch(std::env::var_os(SWITCH).as_deref()) {
        Ok(true) => true,
        Ok(false) => {
            tracing::info!("{SWITCH}=off: freed medium blocks go straight back to glibc");
            false
        }
        Err(e) => {
            tracing::warn!("{e}");
            true
        }
    })
}

/// Turns the reuse on for this thread when `on`.
fn start(on: bool) {
    if on {
        enable();
    }
}

/// Turns on the reuse of freed medium blocks for this thread (a runtime thread, at its start),
/// unless `AETHER_ALLOC_CACHE=off`.
pub fn reuse_medium_blocks() {
    start(wanted());
}

/// Gives this thread's kept medium blocks back to glibc (a runtime thread, as it stops).
pub fn release_medium_blocks() {
    release();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout};

    use crate::memory::allocator::Allocator;

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
            let kept = KEEP_BYTES / 8192;
            let again: Vec<_> = (0..40).map(|_| a.alloc(l)).collect();
            let reused = again.iter().filter(|p| many.contains(p)).count();
            assert!(reused >= kept, "{reused} of {kept} kept blocks reused");
            for &p in &again {
                a.dealloc(p, l);
            }
            // Exactly what the bound allows stayed kept, all of them blocks of this size.
            let mut drained = 0;
            while let Some(p) = take(8192) {
                assert!(again.contains(&p));
                libc::free(p as *mut libc::c_void);
                drained += 1;
            }
            assert_eq!(drained, kept);

            // More sizes than slots: each size beyond them goes to glibc, and every block
            // comes back whole and writable.
            let sizes: Vec<_> = (0..SLOTS + 4).map(|i| 2000 + i * 100).collect();
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
                .filter(|&&n| match take(n) {
                    Some(p) => {
                        libc::free(p as *mut libc::c_void);
                        true
                    }
                    None => false,
                })
                .collect();
            assert!(kept_sizes.len() < SLOTS, "{kept_sizes:?}");
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
            assert_eq!(take(8192), None);
            let q = a.alloc(l);
            a.dealloc(q, l);
            assert_eq!(take(8192), None);
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
                assert_eq!(take(medium.size()), None);
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
    fn the_switch_turns_the_cache_off_only_when_it_says_off() {
        use std::ffi::OsStr;
        assert_eq!(switch(None), Ok(true));
        assert_eq!(switch(Some(OsStr::new(""))), Ok(true));
        assert_eq!(switch(Some(OsStr::new("on"))), Ok(true));
        assert_eq!(switch(Some(OsStr::new("off"))), Ok(false));
        assert_eq!(switch(Some(OsStr::new(" off\n"))), Ok(false));
        for bad in ["OFF", "0", "false", "no"] {
            let e = switch(Some(OsStr::new(bad))).unwrap_err();
            assert!(e.contains("AETHER_ALLOC_CACHE") && e.contains(bad), "{e}");
        }
        // Not UTF-8: refused the same way, and the cache stays on.
        use std::os::unix::ffi::OsStrExt;
        assert!(switch(Some(OsStr::from_bytes(b"of\xff"))).is_err());
    }

    #[test]
    fn a_thread_started_with_the_cache_off_frees_every_block_to_glibc() {
        for on in [false, true] {
            std::thread::spawn(move || {
                let a = Allocator;
                let l = Layout::from_size_align(4096, 8).unwrap();
                start(on);
                // SAFETY: the block is used within its layout and freed with it; a kept one
                // is taken back and freed by glibc.
                unsafe {
                    let p = a.alloc(l);
                    a.dealloc(p, l);
                    match take(l.size()) {
                        Some(kept) => {
                            assert!(on, "a block was kept with the cache off");
                            libc::free(kept as *mut libc::c_void);
                        }
                        None => assert!(!on, "no block kept with the cache on"),
                    }
                }
                release_medium_blocks();
            })
            .join()
            .unwrap();
        }
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
}
