//! Two-phase drain (SPEC section 1): report not ready while still serving for `drain.notify`,
//! then stop accepting, ask open connections to finish (GOAWAY / `Connection: close`) and wait
//! up to `drain.timeout` for in-flight work.
//!
//! The listeners' accept loop is here too, with the families of open and rejected connections.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

use crate::metrics::ListenerLabels;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Serving,
    /// `/readyz` is 503; listeners still accept and serve.
    Notifying,
    /// Listeners closed; connections are finishing.
    Closing,
    /// `drain.timeout` passed: what is still open (tunnels) ends now, logged as `drain`.
    Cut,
}

#[derive(Clone)]
pub struct Drain {
    tx: watch::Sender<Phase>,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            tx: watch::Sender::new(Phase::Serving),
        }
    }
}

impl Drain {
    pub fn phase(&self) -> Phase {
        *self.tx.borrow()
    }

    /// Moves forward only; returns true when this call changed the phase.
    pub fn advance(&self, to: Phase) -> bool {
        self.tx.send_if_modified(|p| {
            if *p < to {
                *p = to;
                true
            } else {
                false
            }
        })
    }

    pub fn watch(&self) -> watch::Receiver<Phase> {
        self.tx.subscribe()
    }

    /// Resolves once the phase reaches `at`.
    pub async fn reached(mut rx: watch::Receiver<Phase>, at: Phase) {
        let _ = rx.wait_for(|p| *p >= at).await;
    }
}

/// Counts open connections so the drain can wait for them.
#[derive(Clone, Default)]
pub struct Tracker {
    inner: std::sync::Arc<TrackerInner>,
}

#[derive(Default)]
struct TrackerInner {
    open: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

pub struct TrackGuard(std::sync::Arc<TrackerInner>);

impl Tracker {
    pub fn track(&self) -> TrackGuard {
        self.inner
            .open
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        TrackGuard(self.inner.clone())
    }

    pub fn open(&self) -> usize {
        self.inner.open.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until nothing is open, or `limit` passes; returns what is still open.
    pub async fn wait_idle(&self, limit: std::time::Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.inner.idle.notified();
            if self.open() == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.open();
            }
        }
    }
}

impl Drop for TrackGuard {
    fn drop(&mut self) {
        if self
            .0
            .open
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.0.idle.notify_waiters();
        }
    }
}

/// How long a listener waits after a failed accept (EMFILE and friends) before the next.
pub const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);

/// Accepts connections until the drain reaches `Closing`, then drops the listener (new
/// connections are refused). Each connection runs `handle` in its own task, tracked so the
/// drain can wait for it. Past `max_open` connections of this listener, new ones are closed at
/// accept (and counted), so a flood cannot exhaust the process's descriptors. A `shed`
/// listener (inbound, outbound) also closes new connections at accept while overload sheds,
/// and enters the rest for overload's step 2.
pub async fn accept_until_closing<F, Fut>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    (max_open, shed): (usize, bool),
    drain: &Drain,
    tracker: &Tracker,
    handle: F,
) where
    F: Fn(tokio::net::TcpStream, std::net::SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let closing = Drain::reached(drain.watch(), Phase::Closing);
    tokio::pin!(closing);
    let open = Tracker::default();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, addr)) => {
                    if open.open() >= max_open {
                        tracing::debug!(%addr, "{name}: connection limit ({max_open}) reached, closing");
                        connection_rejected(name, "limit");
                        drop(tcp);
                        continue;
                    }
                    if shed && crate::overload::shedding() {
                        connection_rejected(name, "overload");
                        crate::overload::count("refuse-connection");
                        drop(tcp);
                        continue;
                    }
                    let watched = if shed { crate::overload::watch(&tcp) } else { None };
                    let guards = (tracker.track(), open.track());
                    // Boxed before the spawn: a connection's future is several KiB (its whole
                    // HTTP state), and tokio moves the future it is given through each layer of
                    // `spawn` and again when the task completes; a box moves as one pointer.
                    // Built in its box, so not even the first copy is made.
                    let conn = crate::memory::box_future(|| handle(tcp, addr));
                    tokio::spawn(async move {
                        match watched {
                            None => conn.await,
                            // Step 2 may pick this connection: dropping it closes the socket.
                            Some(w) => tokio::select! {
                                _ = conn => {}
                                _ = w.closed() => {}
                            },
                        }
                        drop(guards);
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("{name} accept failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
            _ = &mut closing => break,
        }
    }
    tracing::info!("{name} listener closed");
}

/// The listeners' connection families: open downstream connections, and those closed at
/// accept; registered with the rest when first used.
pub struct Metrics {
    pub connections_active: Family<ListenerLabels, Gauge>,
    pub connections_rejected: Family<RejectedLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectedLabels {
    pub listener: &'static str,
    /// `limit` (the listener's connection cap) or `handshake-evicted` (the oldest connection
    /// still in its TLS handshake, closed to admit a new one).
    pub reason: &'static str,
}

/// The families, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: std::sync::OnceLock<Metrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = Metrics {
            connections_active: Family::default(),
            connections_rejected: Family::default(),
        };
        // Pre-create the series operators alert on, so they read 0 rather than absent.
        for listener in ["inbound", "outbound"] {
            let _ = m
                .connections_active
                .get_or_create(&ListenerLabels { listener });
            let _ = m.connections_rejected.get_or_create(&RejectedLabels {
                listener,
                reason: "limit",
            });
        }
        let _ = m.connections_rejected.get_or_create(&RejectedLabels {
            listener: "inbound",
            reason: "handshake-evicted",
        });
        crate::metrics::register(|registry| {
            registry.register(
                "aether_connections_rejected",
                "Downstream connections closed at accept: a listener cap, or overload",
                m.connections_rejected.clone(),
            );
            registry.register(
                "aether_connections_active",
                "Open downstream connections",
                m.connections_active.clone(),
            );
        });
        m
    })
}

/// Counts a downstream connection of `listener` closed at accept for `reason`.
pub fn connection_rejected(listener: &'static str, reason: &'static str) {
    metrics()
        .connections_rejected
        .get_or_create(&RejectedLabels { listener, reason })
        .inc();
}

/// Counts a connection as active until dropped.
pub struct ActiveConnection(&'static str);

impl ActiveConnection {
    pub fn new(listener: &'static str) -> ActiveConnection {
        metrics()
            .connections_active
            .get_or_create(&ListenerLabels { listener })
            .inc();
        ActiveConnection(listener)
    }
}

impl Drop for ActiveConnection {
    fn drop(&mut self) {
        metrics()
            .connections_active
            .get_or_create(&ListenerLabels { listener: self.0 })
            .dec();
    }
}
