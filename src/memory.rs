//! Giving freed memory back to the system after catalog churn.
//!
//! A catalog update frees the previous services and clusters while requests allocate on
//! other threads; glibc keeps most of the freed space in per-thread arenas, so a sidecar that
//! took thousands of xDS updates could hold twice its live heap. `malloc_trim` hands the free
//! pages back. It runs a second after a change (the changes meanwhile ride along), so at most
//! once a second while the catalog keeps changing, and off the runtime's worker threads.

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
