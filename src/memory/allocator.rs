//! The process's global allocator: glibc's, with over-aligned blocks served by plain `malloc`
//! and medium blocks kept per thread for reuse (`reuse.rs`).

use std::alloc::{GlobalAlloc, Layout, System};

use super::reuse;

/// The process's allocator: glibc's, with over-aligned blocks (tokio's task cells and I/O
/// registrations ask for 128-byte alignment against false sharing) served by plain `malloc`.
/// glibc's `posix_memalign` never uses the thread cache and splits a larger chunk each time,
/// many times the cost of a `malloc`, and every h2 stream and every accepted connection makes
/// one or two. Here such a block is `malloc(size + align)`, handed out at the first aligned
/// address past the start, with the distance back to the start stored in the word just before
/// it (there are always at least 16 bytes: glibc's blocks are 16-aligned and the alignments
/// taken here are 32 or more). Alignments above a page go to glibc as before.
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

#[cfg(test)]
mod tests {
    use super::*;

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
