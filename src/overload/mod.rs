//! Overload (SPEC section 13): shed load as memory use nears the limit, so the kernel never
//! kills the sidecar, and with it every connection of the pod.
//!
//! A thread of its own measures use every [`INTERVAL`] (the runtime's threads may be the
//! busy ones) and sets the state the data path reads with one atomic load:
//! * 0: normal;
//! * 1 (from `shed_at`): the inbound and outbound listeners close new connections at once,
//!   new requests are answered 503 `overloaded`, idle pooled connections and freed memory are
//!   given back;
//! * 2 (from `close_at`): as 1, and the client connections idle longest are closed, an eighth
//!   of them every [`SETTLE_TICKS`] ticks, until use is back under `shed_at`.
//!
//! State 1 ends `resume_gap` below `shed_at`. Admin and the health listener run on their own
//! thread and are never shed; `/readyz` answers 503 `overloaded` from state 1 on.

mod connections;
pub mod limit;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub use connections::Watched;

/// How often use is measured: a flood of connections each holding tens of KiB can add a few
/// MiB in this time, which the room between the steps absorbs.
pub const INTERVAL: Duration = Duration::from_millis(50);
/// Ticks step 2 waits after closing connections before it closes more.
const SETTLE_TICKS: u32 = 4;
/// In state 1, how often idle memory is given back again.
const RELEASE_EVERY: Duration = Duration::from_secs(1);

static STATE: AtomicU8 = AtomicU8::new(0);
/// A limit is in force: accepted connections are entered for step 2.
static WATCHING: AtomicBool = AtomicBool::new(false);

/// 0, 1 or 2, as above.
pub fn state() -> u8 {
    STATE.load(Ordering::Relaxed)
}

/// Step 1 or beyond holds: refuse new connections and requests.
pub fn shedding() -> bool {
    state() >= 1
}

/// Enters an accepted client connection for step 2, while a limit is in force.
pub fn watch(socket: &impl std::os::fd::AsRawFd) -> Option<Watched> {
    WATCHING
        .load(Ordering::Relaxed)
        .then(|| Watched::new(socket))
}

/// Counts one overload action (`aether_overload_actions_total{action}`).
pub fn count(action: &'static str) {
    metrics()
        .actions
        .get_or_create(&ActionLabels { action })
        .inc();
}

/// The overload families, registered with the rest on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            state: Gauge::default(),
            actions: Family::default(),
            limit: Gauge::default(),
            used: Gauge::default(),
        };
        // Present from the start with 0, so a rate or an alert sees 0 rather than nothing.
        for action in ACTIONS {
            let _ = m.actions.get_or_create(&ActionLabels { action });
        }
        crate::metrics::register(|registry| m.register(registry));
        m
    })
}

pub struct Metrics {
    pub state: Gauge,
    pub actions: Family<ActionLabels, Counter>,
    pub limit: Gauge,
    pub used: Gauge,
}

/// Every value of `ActionLabels::action`.
pub const ACTIONS: [&str; 4] = [
    "refuse-connection",
    "refuse-request",
    "release-idle",
    "close-connection",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// `refuse-connection`, `refuse-request`, `release-idle` or `close-connection`.
    pub action: &'static str,
}

impl Metrics {
    fn register(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "aether_overload_state",
            "Overload step in force: 0 normal, 1 shedding new work, 2 closing idle connections",
            m.state.clone(),
        );
        registry.register(
            "aether_overload_actions",
            "Overload actions taken: connections and requests refused, idle memory released, connections closed",
            m.actions.clone(),
        );
        registry.register(
            "aether_memory_limit_bytes",
            "The memory limit overload acts against (0: none, overload actions off)",
            m.limit.clone(),
        );
        registry.register(
            "aether_memory_used_bytes",
            "Memory in use as measured against the limit (cgroup working set, or resident set for a configured limit)",
            m.used.clone(),
        );
    }
}

/// The thresholds as shares of the limit.
#[derive(Debug, Clone, Copy)]
pub struct Thresholds {
    pub shed_at: f64,
    pub close_at: f64,
    pub resume_gap: f64,
}

/// The state after `current` once `share` of the limit is in use.
pub fn next_state(current: u8, share: f64, t: Thresholds) -> u8 {
    if share >= t.close_at || (current == 2 && share >= t.shed_at) {
        2
    } else if share >= t.shed_at || (current >= 1 && share >= t.shed_at - t.resume_gap) {
        1
    } else {
        0
    }
}

/// What overload can give back: each call releases one holder's idle memory (a pool's idle
/// connections).
pub type Release = Box<dyn Fn() + Send>;

/// Finds the limit (`configured`, else the cgroup's) and, when there is one, starts measuring
/// against it.
pub fn start(configured: Option<u64>, t: Thresholds, release: Vec<Release>) {
    let m = metrics();
    let Some(limit) = limit::find(configured) else {
        tracing::info!("no memory limit found; overload actions off");
        return;
    };
    m.limit.set(i64::try_from(limit.bytes).unwrap_or(i64::MAX));
    tracing::info!(
        limit = limit.bytes,
        source = limit.source.as_str(),
        "shedding load from {:.0}% of the memory limit",
        t.shed_at * 100.0
    );
    WATCHING.store(true, Ordering::Relaxed);
    let spawned = std::thread::Builder::new()
        .name("aether-overload".into())
        .spawn(move || watch_memory(limit, t, release));
    if let Err(e) = spawned {
        WATCHING.store(false, Ordering::Relaxed);
        tracing::error!("overload: cannot start its thread ({e}); overload actions off");
    }
}

fn watch_memory(limit: limit::Limit, t: Thresholds, release: Vec<Release>) {
    let m = metrics();
    let mut released_at: Option<Instant> = None;
    let mut settle = 0u32;
    loop {
        std::thread::sleep(INTERVAL);
        let Some(used) = limit.used() else { continue };
        m.used.set(i64::try_from(used).unwrap_or(i64::MAX));
        let share = used as f64 / limit.bytes as f64;
        let current = state();
        let next = next_state(current, share, t);
        if next != current {
            STATE.store(next, Ordering::Relaxed);
            m.state.set(i64::from(next));
            let pct = share * 100.0;
            if next > current {
                tracing::warn!(
                    used,
                    limit = limit.bytes,
                    "overload: step {next} at {pct:.0}% of the memory limit"
                );
            } else {
                tracing::info!(
                    used,
                    limit = limit.bytes,
                    "overload: down to step {next} at {pct:.0}% of the memory limit"
                );
            }
        }
        if next == 0 {
            (released_at, settle) = (None, 0);
            continue;
        }
        if next == 2 || released_at.is_none_or(|at| at.elapsed() >= RELEASE_EVERY) {
            for r in &release {
                r();
            }
            crate::memory::trim_now();
            count("release-idle");
            released_at = Some(Instant::now());
        }
        if next == 2 && settle == 0 {
            // A share of what is open, then a pause of a few ticks: the memory the closed
            // connections held is freed as their tasks end, and must be seen before more go.
            let open = connections::count();
            let closed = connections::close_idlest((open / 8).max(1));
            for _ in 0..closed {
                count("close-connection");
            }
            settle = SETTLE_TICKS;
        }
        settle = settle.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Thresholds = Thresholds {
        shed_at: 0.85,
        close_at: 0.95,
        resume_gap: 0.05,
    };

    #[test]
    fn steps_rise_at_their_thresholds_and_fall_below_them_with_hysteresis() {
        let walk = [
            (0.50, 0),
            (0.84, 0),
            (0.85, 1),
            (0.81, 1), // within the gap: still shedding
            (0.79, 0),
            (0.96, 2),
            (0.90, 2), // step 2 closes until back under shed_at
            (0.84, 1),
            (0.80, 1),
            (0.799, 0),
        ];
        let mut s = 0;
        for (share, want) in walk {
            s = next_state(s, share, T);
            assert_eq!(s, want, "at {share}");
        }
    }
}
