//! Waiting until something holds: the one poll loop of the harness and the tests.
//!
//! A probe is an async closure that looks once and answers `Ok(value)` when what it waits for
//! holds, or `Err(what it saw)` when not yet:
//!
//! ```ignore
//! let r = eventually(Duration::from_secs(5), "the pushed service", async || {
//!     let r = get_h1(out, "ghost.aether.internal", "/now").await;
//!     if r.status == 200 { Ok(r) } else { Err(format!("{r:?}")) }
//! })
//! .await;
//! ```
//!
//! [`eventually`] panics with the last `Err` once the limit has passed; [`poll_until`] hands it
//! back, for callers that clean up first, add costly context (a log tail, the control plane's
//! record) or do not fail at all.

use std::time::{Duration, Instant};

/// How often [`eventually`] probes again.
pub const PACE: Duration = Duration::from_millis(20);

/// Calls `probe` every `pace` until it returns `Ok`, and returns that. Once `limit` has passed
/// since the first call, the next `Err` is returned. The probe runs at least once; one that
/// panics fails the wait at once.
pub async fn poll_until<T, E>(
    limit: Duration,
    pace: Duration,
    mut probe: impl AsyncFnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + limit;
    loop {
        match probe().await {
            Ok(v) => return Ok(v),
            Err(last) if Instant::now() >= deadline => return Err(last),
            Err(_) => tokio::time::sleep(pace).await,
        }
    }
}

/// A probe's answer when it only says yes or no: `Ok(())` when `cond` holds.
pub fn holds(cond: bool) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(String::new())
    }
}

/// [`poll_until`] every [`PACE`]; panics with `"{what}: not within {limit:?}: {last Err}"`.
pub async fn eventually<T>(
    limit: Duration,
    what: &str,
    probe: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    eventually_every(limit, PACE, what, probe).await
}

/// [`eventually`] probing every `pace` (for probes that send requests, or a pace a test
/// depends on).
pub async fn eventually_every<T>(
    limit: Duration,
    pace: Duration,
    what: &str,
    probe: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    match poll_until(limit, pace, probe).await {
        Ok(v) => v,
        Err(last) if last.is_empty() => panic!("{what}: not within {limit:?}"),
        Err(last) => panic!("{what}: not within {limit:?}: {last}"),
    }
}
