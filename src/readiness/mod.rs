//! Readiness gated on local listeners (SPEC 5).
//!
//! `/readyz` asks [`ListenerCheck::check`] whether every port in
//! `readiness.required_listeners` has a LISTEN socket in the pod's network
//! namespace. The answer comes from `/proc/net/tcp` and `/proc/net/tcp6`.
//!
//! Three rules shape this module:
//! * Fail open. A table that cannot be read, or whose header is not the
//!   kernel's, must not take the pod out of rotation: ports not seen in the
//!   readable tables are then "not enforced" rather than missing. A port that
//!   simply never listens is not fail-open.
//! * Quiet logs. Each outcome is logged once per transition, each unreadable
//!   table once (and once more when it recovers), so a probe every second does
//!   not flood the log.
//! * Bounded cost. `/readyz` is unauthenticated and the tables grow with the
//!   socket count, so a result is cached for about a second and concurrent
//!   callers share the scan in flight. The scan runs on the blocking pool,
//!   outside the mutex, and a panic in it cannot wedge later callers.
//!
//! The tables themselves are read and parsed in `table.rs`; this file is the gate: the cache,
//! the scan callers share, and the log lines.

mod table;

use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::watch;

pub use table::{scan_tables, TableScan, PROC_NET_TCP, PROC_NET_TCP6};
#[cfg(feature = "testing")] // the `proc_net_tcp` fuzz target
pub use table::parse_listening_ports;

/// How long a result is reused before the tables are read again.
pub const DEFAULT_TTL: Duration = Duration::from_secs(1);

/// Stands in for a table name when the scan itself failed (panicked or was
/// cancelled), so no table can be blamed.
const SCAN_FAILED: &str = "<listener scan failed>";

/// The outcome of one readiness check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenerStatus {
    /// Every required port has a LISTEN socket.
    Present,
    /// These required ports have no LISTEN socket, and every table was read.
    Missing(Vec<u16>),
    /// These required ports were not seen, but some tables could not be read,
    /// so their absence is not trusted (fail open).
    NotEnforced {
        ports: Vec<u16>,
        unreadable: Vec<String>,
    },
}

/// Produces one [`TableScan`] per table. Runs on the blocking pool.
pub type ScanFn = dyn Fn() -> Vec<TableScan> + Send + Sync;
/// The check's notion of "now"; injectable so cache tests need not sleep.
pub type ClockFn = dyn Fn() -> Instant + Send + Sync;

/// Reads `/proc/net/tcp` and `/proc/net/tcp6` (or stand-ins) and keeps the
/// last answer for a short while. Share it behind the `Arc` the constructors
/// return.
pub struct ListenerCheck {
    /// Sorted and deduplicated, so statuses compare and log stably.
    required: Vec<u16>,
    scan: Arc<ScanFn>,
    clock: Arc<ClockFn>,
    ttl: Duration,
    state: Mutex<State>,
}

/// Everything the mutex guards: the cache, the in-flight marker and what has
/// been logged. Never held across an await or during a scan.
#[derive(Default)]
struct State {
    cached: Option<(Instant, ListenerStatus)>,
    /// Present while a scan runs; callers clone it and wait for the answer.
    inflight: Option<watch::Receiver<Option<ListenerStatus>>>,
    /// The last outcome logged; a new line is written only when it changes.
    last_logged: Option<ListenerStatus>,
    /// Tables currently logged as unreadable.
    unreadable_logged: BTreeSet<String>,
}

impl fmt::Debug for ListenerCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenerCheck")
            .field("required", &self.required)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl ListenerCheck {
    /// Checks the real `/proc` tables with a 1 s cache. With no required
    /// ports every check is `Present` and no table is ever read.
    pub fn new(required: Vec<u16>) -> Arc<ListenerCheck> {
        Self::with_paths(
            required,
            PathBuf::from(PROC_NET_TCP),
            PathBuf::from(PROC_NET_TCP6),
            DEFAULT_TTL,
        )
    }

    /// Checks the given table files, with the real clock.
    pub fn with_paths(
        required: Vec<u16>,
        tcp: PathBuf,
        tcp6: PathBuf,
        ttl: Duration,
    ) -> Arc<ListenerCheck> {
        Self::with_source(
            required,
            move || scan_tables(&tcp, &tcp6),
            Instant::now,
            ttl,
        )
    }

    /// Fully injected form, for tests: any scan, any clock, any TTL.
    pub fn with_source(
        required: Vec<u16>,
        scan: impl Fn() -> Vec<TableScan> + Send + Sync + 'static,
        clock: impl Fn() -> Instant + Send + Sync + 'static,
        ttl: Duration,
    ) -> Arc<ListenerCheck> {
        let mut required = required;
        required.sort_unstable();
        required.dedup();
        Arc::new(ListenerCheck {
            required,
            scan: Arc::new(scan),
            clock: Arc::new(clock),
            ttl,
            state: Mutex::new(State::default()),
        })
    }

    /// The current outcome: cached if fresh, else the scan in flight's, else
    /// a new scan's.
    pub async fn check(&self) -> ListenerStatus {
        if self.required.is_empty() {
            return ListenerStatus::Present;
        }
        loop {
            // Decide under the lock, act after it is released: the guard must
            // not live across an await (it would also make the future !Send).
            let next = {
                let mut state = self.lock();
                match (&state.cached, &state.inflight) {
                    (Some((at, status)), _)
                        if (self.clock)().saturating_duration_since(*at) < self.ttl =>
                    {
                        Next::Done(status.clone())
                    }
                    (_, Some(rx)) => Next::Wait(rx.clone()),
                    (_, None) => {
                        let (tx, rx) = watch::channel(None);
                        state.inflight = Some(rx);
                        Next::Lead(tx)
                    }
                }
            };
            match next {
                Next::Done(status) => return status,
                Next::Lead(tx) => return self.lead(tx).await,
                Next::Wait(mut rx) => {
                    // An error means the leader went away without an answer
                    // (its future was dropped); go round and either use a
                    // newer result or scan ourselves.
                    let answer = match rx.wait_for(Option::is_some).await {
                        Ok(value) => value.clone(),
                        Err(_) => None,
                    };
                    if let Some(status) = answer {
                        return status;
                    }
                }
            }
        }
    }

    /// Runs the scan this caller registered as in flight, publishes the
    /// result and hands it to everyone waiting.
    async fn lead(&self, tx: watch::Sender<Option<ListenerStatus>>) -> ListenerStatus {
        // If this future is dropped mid-scan, the guard clears the marker so
        // the next caller does not wait forever on an answer that never comes.
        let mut guard = InflightGuard {
            check: self,
            armed: true,
        };
        let scan = Arc::clone(&self.scan);
        // spawn_blocking keeps file reads off the async workers and turns a
        // panic into a JoinError instead of unwinding through this task.
        let scanned = tokio::task::spawn_blocking(move || scan()).await;

        let status = {
            let mut state = self.lock();
            let status = match scanned {
                Ok(tables) => {
                    log_tables(&mut state, &tables);
                    let status = evaluate(&self.required, &tables);
                    state.cached = Some(((self.clock)(), status.clone()));
                    status
                }
                Err(_) => {
                    // A failed scan (a panic, or the runtime shutting down)
                    // is a failed check: fail open, and do not cache it, so
                    // the next caller scans again. The panic hook has already
                    // reported the panic; the transition line below says the
                    // check was not enforced, once, however often it repeats.
                    ListenerStatus::NotEnforced {
                        ports: self.required.clone(),
                        unreadable: vec![SCAN_FAILED.to_string()],
                    }
                }
            };
            log_transition(&mut state, &self.required, &status);
            // Cleared under the same lock that stored the cache, so a new
            // caller sees either the scan in flight or its result.
            state.inflight = None;
            guard.armed = false;
            status
        };
        tx.send_replace(Some(status.clone()));
        status
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock, but if something ever did,
        // the state is still consistent enough to keep serving /readyz.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a caller does after looking at the shared state.
enum Next {
    Done(ListenerStatus),
    Wait(watch::Receiver<Option<ListenerStatus>>),
    Lead(watch::Sender<Option<ListenerStatus>>),
}

/// Clears the in-flight marker if the leader never got to publish.
struct InflightGuard<'a> {
    check: &'a ListenerCheck,
    armed: bool,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            // Only the leader clears the marker, so while armed it is ours.
            self.check.lock().inflight = None;
        }
    }
}

/// Classifies one scan against the required ports.
fn evaluate(required: &[u16], tables: &[TableScan]) -> ListenerStatus {
    let seen: BTreeSet<u16> = tables
        .iter()
        .filter_map(|t| t.result.as_ref().ok())
        .flatten()
        .copied()
        .collect();
    let unseen: Vec<u16> = required
        .iter()
        .copied()
        .filter(|p| !seen.contains(p))
        .collect();
    let unreadable: Vec<String> = tables
        .iter()
        .filter(|t| t.result.is_err())
        .map(|t| t.path.clone())
        .collect();
    if unseen.is_empty() {
        // Seen is seen, even if another table could not be read.
        ListenerStatus::Present
    } else if unreadable.is_empty() {
        ListenerStatus::Missing(unseen)
    } else {
        ListenerStatus::NotEnforced {
            ports: unseen,
            unreadable,
        }
    }
}

/// Logs each table once when it becomes unreadable and once when it recovers.
fn log_tables(state: &mut State, tables: &[TableScan]) {
    for table in tables {
        match &table.result {
            Err(reason) => {
                if state.unreadable_logged.insert(table.path.clone()) {
                    tracing::warn!(path = %table.path, %reason, "cannot read TCP socket table");
                }
            }
            Ok(_) => {
                if state.unreadable_logged.remove(&table.path) {
                    tracing::info!(path = %table.path, "TCP socket table readable again");
                }
            }
        }
    }
}

/// Logs the outcome only when it differs from the last one logged. The key is
/// the whole status, so a change in which ports are missing is logged too.
fn log_transition(state: &mut State, required: &[u16], status: &ListenerStatus) {
    if state.last_logged.as_ref() == Some(status) {
        return;
    }
    match status {
        ListenerStatus::Present => {
            tracing::info!(ports = ?required, "required listeners present; reporting ready");
        }
        ListenerStatus::Missing(ports) => {
            tracing::warn!(missing = ?ports, "required listeners missing; reporting not ready");
        }
        ListenerStatus::NotEnforced { ports, unreadable } => {
            tracing::warn!(
                ports = ?ports,
                unreadable = ?unreadable,
                "required listeners not enforced; reporting ready"
            );
        }
    }
    state.last_logged = Some(status.clone());
}

#[cfg(test)]
impl ListenerStatus {
    /// Whether `/readyz` may answer ready on this outcome's account.
    pub fn is_ready(&self) -> bool {
        !matches!(self, ListenerStatus::Missing(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    const PRESENT: &str = "required listeners present; reporting ready";
    const MISSING: &str = "required listeners missing; reporting not ready";
    const NOT_ENFORCED: &str = "required listeners not enforced; reporting ready";
    const CANNOT_READ: &str = "cannot read TCP socket table";
    const READABLE_AGAIN: &str = "TCP socket table readable again";

    pub(super) fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/proc")
            .join(name)
    }

    /// A directory: reading it fails even as root, unlike a chmod 000 file.
    fn unreadable_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/proc")
    }

    /// Collects everything the scoped subscriber writes.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Capture {
        fn text(&self) -> String {
            let bytes = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            String::from_utf8_lossy(&bytes).into_owned()
        }
        fn count(&self, needle: &str) -> usize {
            self.text().matches(needle).count()
        }
    }

    /// Installs a capturing subscriber for this thread. Tests that look at
    /// logs use the current-thread runtime so every event lands here.
    fn capture_logs() -> (Capture, tracing::subscriber::DefaultGuard) {
        let capture = Capture::default();
        let writer = capture.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .without_time()
            .with_max_level(tracing::Level::INFO)
            .finish();
        (capture, tracing::subscriber::set_default(subscriber))
    }

    /// Runs two consecutive uncached checks on the given tables and returns
    /// both answers and the captured log.
    async fn check_twice(tcp: PathBuf, tcp6: PathBuf) -> (ListenerStatus, ListenerStatus, Capture) {
        let (logs, _guard) = capture_logs();
        let check = ListenerCheck::with_paths(vec![8080], tcp, tcp6, Duration::ZERO);
        let first = check.check().await;
        let second = check.check().await;
        (first, second, logs)
    }

    /// Exactly one of the three state lines, exactly once.
    fn assert_state_logged_once(logs: &Capture, expected: &str) {
        for line in [PRESENT, MISSING, NOT_ENFORCED] {
            let want = usize::from(line == expected);
            assert_eq!(logs.count(line), want, "{line:?} in log:\n{}", logs.text());
        }
    }

    #[tokio::test]
    async fn listen_in_tcp_only_is_present() {
        let (first, second, logs) =
            check_twice(fixture("tcp_listen_8080"), fixture("tcp6_empty")).await;
        assert_eq!(first, ListenerStatus::Present);
        assert_eq!(second, ListenerStatus::Present);
        assert_state_logged_once(&logs, PRESENT);
        assert_eq!(logs.count(CANNOT_READ), 0);
    }

    #[tokio::test]
    async fn listen_in_tcp6_only_is_present() {
        let (first, second, logs) =
            check_twice(fixture("tcp_other_port"), fixture("tcp6_listen_8080")).await;
        assert_eq!(first, ListenerStatus::Present);
        assert_eq!(second, ListenerStatus::Present);
        assert_state_logged_once(&logs, PRESENT);
    }

    #[tokio::test]
    async fn established_on_the_port_is_missing() {
        // Both fixtures carry 8080 as local port, remote port and both, in
        // states other than LISTEN; none of that may count.
        let (first, second, logs) = check_twice(
            fixture("tcp_established_8080"),
            fixture("tcp6_established_8080"),
        )
        .await;
        assert_eq!(first, ListenerStatus::Missing(vec![8080]));
        assert_eq!(second, ListenerStatus::Missing(vec![8080]));
        assert!(!first.is_ready());
        assert_state_logged_once(&logs, MISSING);
        assert!(logs.text().contains("missing=[8080]"), "{}", logs.text());
    }

    #[tokio::test]
    async fn another_port_listening_is_missing() {
        let (first, second, logs) =
            check_twice(fixture("tcp_other_port"), fixture("tcp6_empty")).await;
        assert_eq!(first, ListenerStatus::Missing(vec![8080]));
        assert_eq!(second, first);
        assert_state_logged_once(&logs, MISSING);
    }

    #[tokio::test]
    async fn unreadable_table_is_not_enforced() {
        let dir = unreadable_path();
        let (first, second, logs) = check_twice(dir.clone(), fixture("tcp6_empty")).await;
        let expected = ListenerStatus::NotEnforced {
            ports: vec![8080],
            unreadable: vec![dir.display().to_string()],
        };
        assert_eq!(first, expected);
        assert_eq!(second, expected);
        assert!(first.is_ready());
        assert_state_logged_once(&logs, NOT_ENFORCED);
        assert_eq!(logs.count(CANNOT_READ), 1, "{}", logs.text());
        assert!(logs.text().contains(&dir.display().to_string()));
    }

    #[tokio::test]
    async fn absent_tcp6_is_an_empty_table() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (first, second, logs) =
            check_twice(fixture("tcp_listen_8080"), tmp.path().join("tcp6")).await;
        assert_eq!(first, ListenerStatus::Present);
        assert_eq!(second, ListenerStatus::Present);
        assert_state_logged_once(&logs, PRESENT);
        assert_eq!(logs.count(CANNOT_READ), 0);
    }

    #[tokio::test]
    async fn absent_tcp6_does_not_excuse_a_missing_port() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (first, second, logs) =
            check_twice(fixture("tcp_other_port"), tmp.path().join("tcp6")).await;
        assert_eq!(first, ListenerStatus::Missing(vec![8080]));
        assert_eq!(second, first);
        assert_state_logged_once(&logs, MISSING);
    }

    #[tokio::test]
    async fn absent_tcp_is_unreadable() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let tcp = tmp.path().join("tcp");
        let (first, _, logs) = check_twice(tcp.clone(), fixture("tcp6_empty")).await;
        assert_eq!(
            first,
            ListenerStatus::NotEnforced {
                ports: vec![8080],
                unreadable: vec![tcp.display().to_string()],
            }
        );
        assert_state_logged_once(&logs, NOT_ENFORCED);
        assert_eq!(logs.count(CANNOT_READ), 1);
    }

    #[tokio::test]
    async fn malformed_header_is_not_enforced() {
        // The fixture has a LISTEN row on 8080 under a foreign header: it must
        // be distrusted, not read as present.
        let (first, second, logs) =
            check_twice(fixture("tcp_bad_header"), fixture("tcp6_empty")).await;
        let expected = ListenerStatus::NotEnforced {
            ports: vec![8080],
            unreadable: vec![fixture("tcp_bad_header").display().to_string()],
        };
        assert_eq!(first, expected);
        assert_eq!(second, expected);
        assert_state_logged_once(&logs, NOT_ENFORCED);
        assert_eq!(logs.count(CANNOT_READ), 1);
        assert!(logs.text().contains("header is not the kernel's format"));
    }

    #[tokio::test]
    async fn truncated_row_is_not_enforced() {
        let (first, _, logs) =
            check_twice(fixture("tcp_truncated_row"), fixture("tcp6_empty")).await;
        assert!(
            matches!(first, ListenerStatus::NotEnforced { .. }),
            "{first:?}"
        );
        assert_state_logged_once(&logs, NOT_ENFORCED);
        assert!(
            logs.text().contains("line 3: too few fields"),
            "{}",
            logs.text()
        );
    }

    #[tokio::test]
    async fn found_in_tcp_while_tcp6_unreadable_is_present() {
        let dir = unreadable_path();
        let (first, second, logs) = check_twice(fixture("tcp_listen_8080"), dir).await;
        assert_eq!(first, ListenerStatus::Present);
        assert_eq!(second, ListenerStatus::Present);
        assert_state_logged_once(&logs, PRESENT);
        assert_eq!(logs.count(CANNOT_READ), 1);
    }

    #[tokio::test]
    async fn fail_open_never_logs_present_and_recovery_logs_once() {
        let (logs, _guard) = capture_logs();
        let tmp = tempfile::tempdir().expect("tempdir");
        let tcp = tmp.path().join("tcp");
        std::fs::create_dir(&tcp).expect("mkdir");
        let check = ListenerCheck::with_paths(
            vec![8080],
            tcp.clone(),
            fixture("tcp6_empty"),
            Duration::ZERO,
        );

        assert!(matches!(
            check.check().await,
            ListenerStatus::NotEnforced { .. }
        ));
        assert!(matches!(
            check.check().await,
            ListenerStatus::NotEnforced { .. }
        ));
        assert_eq!(logs.count(PRESENT), 0);

        // The table becomes readable and shows the listener.
        std::fs::remove_dir(&tcp).expect("rmdir");
        std::fs::copy(fixture("tcp_listen_8080"), &tcp).expect("copy");
        assert_eq!(check.check().await, ListenerStatus::Present);
        assert_eq!(check.check().await, ListenerStatus::Present);

        // And unreadable once more: a second warning, one per transition.
        std::fs::remove_file(&tcp).expect("rm");
        std::fs::create_dir(&tcp).expect("mkdir");
        assert!(matches!(
            check.check().await,
            ListenerStatus::NotEnforced { .. }
        ));

        assert_eq!(logs.count(CANNOT_READ), 2, "{}", logs.text());
        assert_eq!(logs.count(READABLE_AGAIN), 1, "{}", logs.text());
        assert_eq!(logs.count(NOT_ENFORCED), 2, "{}", logs.text());
        assert_eq!(logs.count(PRESENT), 1, "{}", logs.text());
    }

    /// A clock that moves only when told to.
    #[derive(Clone)]
    struct TestClock {
        base: Instant,
        offset_ms: Arc<AtomicU64>,
    }

    impl TestClock {
        fn new() -> Self {
            TestClock {
                base: Instant::now(),
                offset_ms: Arc::new(AtomicU64::new(0)),
            }
        }
        fn advance(&self, ms: u64) {
            self.offset_ms.fetch_add(ms, Ordering::SeqCst);
        }
        fn now(&self) -> Instant {
            self.base + Duration::from_millis(self.offset_ms.load(Ordering::SeqCst))
        }
    }

    fn table(listening: &[u16]) -> Vec<TableScan> {
        vec![TableScan {
            path: "test".to_string(),
            result: Ok(listening.iter().copied().collect()),
        }]
    }

    #[tokio::test]
    async fn empty_required_never_scans() {
        let scans = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&scans);
        let check = ListenerCheck::with_source(
            Vec::new(),
            move || {
                counter.fetch_add(1, Ordering::SeqCst);
                table(&[])
            },
            Instant::now,
            Duration::ZERO,
        );
        assert_eq!(check.check().await, ListenerStatus::Present);
        assert_eq!(check.check().await, ListenerStatus::Present);
        assert_eq!(scans.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn two_calls_within_ttl_scan_once() {
        let clock = TestClock::new();
        let scans = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&scans);
        let now = clock.clone();
        let check = ListenerCheck::with_source(
            vec![8080],
            move || {
                counter.fetch_add(1, Ordering::SeqCst);
                table(&[8080])
            },
            move || now.now(),
            Duration::from_secs(1),
        );
        assert_eq!(check.check().await, ListenerStatus::Present);
        clock.advance(999);
        assert_eq!(check.check().await, ListenerStatus::Present);
        assert_eq!(scans.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn call_after_ttl_rescans_and_sees_change() {
        let clock = TestClock::new();
        let scans = Arc::new(AtomicUsize::new(0));
        let listening = Arc::new(AtomicBool::new(false));
        let (counter, flag, now) = (Arc::clone(&scans), Arc::clone(&listening), clock.clone());
        let check = ListenerCheck::with_source(
            vec![8080, 9090],
            move || {
                counter.fetch_add(1, Ordering::SeqCst);
                if flag.load(Ordering::SeqCst) {
                    table(&[8080, 9090])
                } else {
                    table(&[9090])
                }
            },
            move || now.now(),
            Duration::from_secs(1),
        );
        assert_eq!(check.check().await, ListenerStatus::Missing(vec![8080]));

        listening.store(true, Ordering::SeqCst);
        clock.advance(500);
        // Still inside the TTL: the stale answer stands.
        assert_eq!(check.check().await, ListenerStatus::Missing(vec![8080]));
        assert_eq!(scans.load(Ordering::SeqCst), 1);

        clock.advance(501);
        assert_eq!(check.check().await, ListenerStatus::Present);
        assert_eq!(scans.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_callers_share_one_scan() {
        let scans = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&scans);
        // The clock never moves, so however the tasks interleave a correct
        // check scans exactly once; callers that overlap the slow scan must
        // wait for it rather than start their own.
        let clock = TestClock::new();
        let check = ListenerCheck::with_source(
            vec![8080, 9090],
            move || {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(200));
                // Each scan answers differently, so a second scan would show.
                if n == 0 {
                    table(&[9090])
                } else {
                    table(&[])
                }
            },
            move || clock.now(),
            Duration::from_secs(1),
        );
        let start = Arc::new(tokio::sync::Barrier::new(32));
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let (check, start) = (Arc::clone(&check), Arc::clone(&start));
                tokio::spawn(async move {
                    start.wait().await;
                    check.check().await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            let answer = tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("caller hung")
                .expect("caller panicked");
            answers.push(answer);
        }
        assert_eq!(scans.load(Ordering::SeqCst), 1);
        assert_eq!(answers.len(), 32);
        assert!(answers
            .iter()
            .all(|a| *a == ListenerStatus::Missing(vec![8080])));
    }

    #[tokio::test]
    async fn panicking_scan_does_not_wedge_next_caller() {
        let scans = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&scans);
        let clock = TestClock::new();
        let check = ListenerCheck::with_source(
            vec![8080],
            move || {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("scan blew up");
                }
                table(&[8080])
            },
            move || clock.now(),
            Duration::from_secs(1),
        );
        let first = tokio::time::timeout(Duration::from_secs(5), check.check())
            .await
            .expect("first caller hung");
        assert_eq!(
            first,
            ListenerStatus::NotEnforced {
                ports: vec![8080],
                unreadable: vec![SCAN_FAILED.to_string()],
            }
        );
        // Same instant, so only a rescan (not the cache) can answer this.
        let second = tokio::time::timeout(Duration::from_secs(5), check.check())
            .await
            .expect("next caller hung");
        assert_eq!(second, ListenerStatus::Present);
        assert_eq!(scans.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn repeated_scan_panics_log_not_enforced_once() {
        let (logs, _guard) = capture_logs();
        let scans = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&scans);
        let check = ListenerCheck::with_source(
            vec![8080],
            move || -> Vec<TableScan> {
                counter.fetch_add(1, Ordering::SeqCst);
                panic!("scan blew up again");
            },
            Instant::now,
            Duration::from_secs(1),
        );
        assert!(check.check().await.is_ready());
        assert!(check.check().await.is_ready());
        // Not cached: each caller retried the scan.
        assert_eq!(scans.load(Ordering::SeqCst), 2);
        assert_state_logged_once(&logs, NOT_ENFORCED);
    }

    #[tokio::test]
    async fn abandoned_scan_does_not_wedge_next_caller() {
        let scans = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&scans);
        let check = ListenerCheck::with_source(
            vec![8080],
            move || {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    std::thread::sleep(Duration::from_millis(300));
                }
                table(&[8080])
            },
            Instant::now,
            Duration::from_secs(1),
        );
        // The first caller gives up mid-scan (say its HTTP request was cut).
        let abandoned = tokio::time::timeout(Duration::from_millis(20), check.check()).await;
        assert!(abandoned.is_err(), "first scan should still be running");
        let next = tokio::time::timeout(Duration::from_secs(5), check.check())
            .await
            .expect("next caller hung");
        assert_eq!(next, ListenerStatus::Present);
    }
}
