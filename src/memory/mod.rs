//! Memory: the allocator (`allocator.rs`) with its per-thread reuse of medium blocks
//! (`reuse.rs`), glibc's tunables and trimming (`policy.rs`), and futures built in their box
//! (`boxed.rs`), and the resident-memory gauge (`metrics.rs`).

mod allocator;
mod boxed;
pub mod metrics;
mod policy;
mod reuse;

pub use allocator::Allocator;
pub use boxed::box_future;
pub use policy::{limit_arenas, resident_bytes, trim_now, trim_soon, tune_allocator};
pub use reuse::{release_medium_blocks, reuse_medium_blocks};
