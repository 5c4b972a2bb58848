//! Memory: the allocator and giving freed memory back, futures built in their box (`boxed.rs`),
//! and the resident-memory gauge (`metrics.rs`).
//!
//! The default build runs glibc's allocator, tuned: the global allocator (`allocator.rs`) with
//! its per-thread reuse of medium blocks (`reuse.rs`), glibc's tunables and trimming
//! (`policy.rs`). The `jemalloc` feature builds jemalloc in instead (`jemalloc.rs`), with its
//! decay and an arena purge where glibc gets `malloc_trim`; the glibc layers are then left out
//! and their functions do nothing. Why glibc stays the default:
//! docs/decisions/0002-allocator.md.

#[cfg(not(feature = "jemalloc"))]
mod allocator;
mod boxed;
#[cfg(feature = "jemalloc")]
mod jemalloc;
pub mod metrics;
mod policy;
#[cfg(not(feature = "jemalloc"))]
mod reuse;

#[cfg(not(feature = "jemalloc"))]
pub use allocator::Allocator;
pub use boxed::box_future;
#[cfg(feature = "jemalloc")]
pub use jemalloc::{release_medium_blocks, reuse_medium_blocks, Allocator};
pub use policy::{limit_arenas, resident_bytes, trim_now, trim_soon, tune_allocator};
#[cfg(not(feature = "jemalloc"))]
pub use reuse::{release_medium_blocks, reuse_medium_blocks};
