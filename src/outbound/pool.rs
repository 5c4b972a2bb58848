//! Upstream connection pools: multiplexed HTTP/2 connections per key, and a keep-alive list
//! of idle HTTP/1.1 connections per key. The key says everything that makes two connections
//! interchangeable (for the outbound side, `connect::PoolKey`: endpoint, SNI port, negotiated
//! protocol, client cert, pinned identity). The inbound side pools its app connections here too.
//!
//! The lock guards only the map; it is never held across an `.await`.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::client::conn::http1;
use hyper::rt::{Read, Write};

use super::abandon::AbortUnlessAnswered;
use super::h2_client::H2SendError;
pub use super::h2_client::{handshake as handshake_h2, H2};
use crate::http::body::{BoxedRequest, ReqBody, UpBody};
use crate::http::limits::{HYPER_MAX_BUF, UPSTREAM_IDLE_TIMEOUT as IDLE_TIMEOUT};
use crate::http::upstream_body::ReturnToPool;

/// An HTTP/1.1 client connection: its sender, and its task, which is aborted when an exchange
/// is abandoned before its response arrives (the client went away, or the first-byte timer
/// fired). A peer that stopped reading would otherwise keep the task, and the request body it
/// is still sending, for good.
pub struct H1 {
    send: http1::SendRequest<ReqBody>,
    task: tokio::task::AbortHandle,
}

impl std::ops::Deref for H1 {
    type Target = http1::SendRequest<ReqBody>;
    fn deref(&self) -> &Self::Target {
        &self.send
    }
}

impl std::ops::DerefMut for H1 {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.send
    }
}

/// Streams one pooled HTTP/2 connection carries before another is opened. 100 is the floor
/// RFC 9113 asks every peer to allow, so requests never queue behind a smaller peer limit.
pub const H2_STREAMS_PER_CONN: u32 = 100;

/// Use counts of one pooled HTTP/2 connection.
#[derive(Default)]
pub struct H2Stats {
    /// Requests sent on it so far (for `max_requests_per_connection`).
    uses: AtomicU32,
    /// Streams open now.
    open: AtomicU32,
}

/// Holds one stream of a pooled HTTP/2 connection open until the response ends.
pub struct StreamGuard(Arc<H2Stats>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A ready-to-use upstream connection.
pub enum Conn {
    H1(H1, u32),
    H2(H2, StreamGuard),
}

#[derive(Default)]
struct Slot {
    /// With the time each was last handed out.
    h2: Vec<(H2, Arc<H2Stats>, Instant)>,
    h1: Vec<(H1, Instant, u32)>,
    /// Whose turn it is to dial this key (one connect in flight per key).
    dialer: Arc<tokio::sync::Mutex<LastDial>>,
    /// The last connection dialled for this key could not be shared (HTTP/1.1, or one request
    /// per connection): waiting for another request's dial would gain nothing, so requests
    /// dial side by side (`parallel`).
    unshared: bool,
    parallel: Arc<Parallel>,
}

impl Slot {
    fn in_use(&self) -> bool {
        !self.h2.is_empty()
            || !self.h1.is_empty()
            || Arc::strong_count(&self.dialer) > 1
            || Arc::strong_count(&self.parallel) > 1
    }
}

/// Dials in flight for a key whose connections are not shared. Without a bound, a burst of
/// requests that finds the pool empty (a step in load, a stall that let requests pile up)
/// starts one TLS handshake each: a thousand handshakes cost far more than the requests, every
/// request waits for its own handshake while connections freed by the others sit idle, and the
/// queue grows into the request breaker. With a bound, the requests past it wait for whichever
/// comes first, a connection handed back or a free dial.
pub const PARALLEL_DIALS: u32 = 8;

#[derive(Default)]
struct Parallel {
    dialing: AtomicU32,
    /// Woken when a connection comes back, a dial ends, or a dial fails.
    freed: tokio::sync::Notify,
    /// When a dial of this key last failed: requests waiting since before then move on.
    failed_at: Mutex<Option<Instant>>,
}

/// One of a key's parallel dials; dropping it frees the place for a waiting request.
pub struct DialPlace(Arc<Parallel>);

impl DialPlace {
    /// The dial failed: requests waiting for this key stop waiting and move on.
    fn failed(&self) {
        *self.0.failed_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.0.freed.notify_waiters();
    }
}

impl Drop for DialPlace {
    fn drop(&mut self) {
        self.0.dialing.fetch_sub(1, Ordering::AcqRel);
        self.0.freed.notify_one();
    }
}

// A request that finds no pooled connection waits before it dials, in one of two ways, each
// with its own word: a key whose connections may be shared is dialled in *turn* (one dial at
// a time, `DialTurn`), a key whose connections are not shared in one of `PARALLEL_DIALS`
// *places* (`DialPlace`). What the wait ends with is `Waited`.

/// What `Pool::wait_to_dial` waits on: the key's turn, or one of its parallel places.
enum Wait {
    Turn(Arc<tokio::sync::Mutex<LastDial>>),
    Place(Arc<Parallel>),
}

/// What a request that found no pooled connection ends its wait with (`Pool::wait_to_dial`).
pub enum Waited {
    /// Dial, holding the right to.
    Dial(DialRight),
    /// A connection came back to the pool while the request waited.
    Pooled(Conn),
    /// The dial this request waited for failed; not dialled again.
    DialFailed,
}

/// The right to dial a key: its turn, or one of its places.
pub enum DialRight {
    /// The key's turn (its connections may be shared).
    Turn(DialTurn),
    /// One of the parallel dials of a key whose connections are not shared.
    Place(DialPlace),
}

impl DialRight {
    /// The dial failed: the requests that waited for it move on instead of dialling again.
    pub fn failed(&mut self) {
        match self {
            DialRight::Turn(t) => t.failed(),
            DialRight::Place(p) => p.failed(),
        }
    }
}

#[derive(Default)]
pub struct LastDial {
    failed_at: Option<Instant>,
}

/// The right to dial a key. Requests that find no pooled connection take turns, so a burst of
/// them opens one connection at a time instead of one each (a new HTTP/2 connection then serves
/// them all); a failed dial fails the requests that waited for it instead of being repeated.
pub struct DialTurn {
    last: tokio::sync::OwnedMutexGuard<LastDial>,
    since: Instant,
}

impl DialTurn {
    /// The dial this request waited for failed.
    fn waited_for_a_failure(&self) -> bool {
        self.last.failed_at.is_some_and(|t| t >= self.since)
    }

    fn failed(&mut self) {
        self.last.failed_at = Some(Instant::now());
    }
}

pub struct Pool<K> {
    // Looked up on every request with a key holding an identity string: SipHash cost more
    // than the rest of the lookup.
    map: Mutex<HashMap<K, Slot, foldhash::fast::RandomState>>,
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Default for Pool<K> {
    fn default() -> Self {
        Pool {
            map: Mutex::new(HashMap::default()),
        }
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Pool<K> {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A pooled connection for `key`, if one is usable now. `max_uses` 0 means unlimited.
    pub fn get(&self, key: &K, max_uses: u32) -> Option<Conn> {
        self.get_with_idle(key, max_uses).map(|(c, _)| c)
    }

    /// As `get`, with how long an HTTP/1.1 connection sat in the pool (zero for HTTP/2): the
    /// longer, the likelier its peer is closing it for idleness just as a request goes out.
    pub fn get_with_idle(&self, key: &K, max_uses: u32) -> Option<(Conn, Duration)> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let slot = map.get_mut(key)?;
        slot.h2.retain(|(h2, _, _)| !h2.is_closed());
        let free = slot
            .h2
            .iter()
            .position(|(_, st, _)| st.open.load(Ordering::Relaxed) < H2_STREAMS_PER_CONN);
        if let Some(i) = free {
            let (h2, st, last) = &mut slot.h2[i];
            *last = Instant::now();
            st.open.fetch_add(1, Ordering::Relaxed);
            let n = st.uses.fetch_add(1, Ordering::Relaxed) + 1;
            let conn = Conn::H2(h2.clone(), StreamGuard(st.clone()));
            if max_uses != 0 && n >= max_uses {
                // Its streams finish; new requests get a new connection.
                slot.h2.swap_remove(i);
            }
            return Some((conn, Duration::ZERO));
        }
        let now = Instant::now();
        while let Some((h1, since, uses)) = slot.h1.pop() {
            let idle = now.duration_since(since);
            if h1.is_ready() && idle < IDLE_TIMEOUT {
                return Some((Conn::H1(h1, uses), idle));
            }
        }
        None
    }

    /// Waits for the right to dial `key`: its turn when its connections may be shared, else
    /// one of `PARALLEL_DIALS` places; a connection pooled meanwhile (`max_uses` as in `get`)
    /// is taken instead.
    pub async fn wait_to_dial(&self, key: &K, max_uses: u32) -> Waited {
        let since = Instant::now();
        match self.wait_for(key) {
            Wait::Turn(dialer) => self.wait_for_turn(key, max_uses, dialer, since).await,
            Wait::Place(parallel) => self.wait_for_place(key, max_uses, parallel, since).await,
        }
    }

    /// What a request for `key` waits on before dialling (the map's lock is not held then).
    fn wait_for(&self, key: &K) -> Wait {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let slot = map.entry(key.clone()).or_default();
        if slot.unshared {
            Wait::Place(slot.parallel.clone())
        } else {
            Wait::Turn(slot.dialer.clone())
        }
    }

    /// The key's one dial at a time: after the turn, the dial before it may have left a
    /// shareable connection, or failed.
    async fn wait_for_turn(
        &self,
        key: &K,
        max_uses: u32,
        dialer: Arc<tokio::sync::Mutex<LastDial>>,
        since: Instant,
    ) -> Waited {
        let turn = DialTurn {
            last: dialer.lock_owned().await,
            since,
        };
        match self.get(key, max_uses) {
            Some(c) => Waited::Pooled(c),
            None if turn.waited_for_a_failure() => Waited::DialFailed,
            None => Waited::Dial(DialRight::Turn(turn)),
        }
    }

    /// One of `PARALLEL_DIALS` places, or a connection handed back while waiting for one.
    async fn wait_for_place(
        &self,
        key: &K,
        max_uses: u32,
        parallel: Arc<Parallel>,
        since: Instant,
    ) -> Waited {
        loop {
            // Armed before looking, so a hand-back between the look and the wait is not lost.
            let freed = parallel.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let failed_at = *parallel.failed_at.lock().unwrap_or_else(|e| e.into_inner());
            if failed_at.is_some_and(|t| t >= since) {
                return Waited::DialFailed;
            }
            if let Some(c) = self.get(key, max_uses) {
                return Waited::Pooled(c);
            }
            let free_place =
                parallel
                    .dialing
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < PARALLEL_DIALS).then_some(n + 1)
                    });
            if free_place.is_ok() {
                return Waited::Dial(DialRight::Place(DialPlace(parallel.clone())));
            }
            freed.await;
        }
    }

    /// Records whether the connection just dialled for `key` serves other requests too.
    pub fn dialled(&self, key: &K, shared: bool) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key.clone()).or_default().unshared = !shared;
    }

    /// Shares a new HTTP/2 connection for later requests; the caller's request is its first
    /// stream (the returned guard).
    pub fn put_h2(&self, key: K, h2: H2, max_uses: u32) -> StreamGuard {
        let st = Arc::new(H2Stats {
            uses: AtomicU32::new(1),
            open: AtomicU32::new(1),
        });
        if max_uses != 1 {
            let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(key)
                .or_default()
                .h2
                .push((h2, st.clone(), Instant::now()));
        }
        StreamGuard(st)
    }

    /// What returns an HTTP/1.1 connection to the pool once its current exchange is
    /// complete: nothing when it is back already (a response read whole with its head, the
    /// common small one) or retired, else a hand-back for the end of the response body.
    fn return_h1(
        self: &Arc<Self>,
        key: &K,
        h1: H1,
        uses: u32,
        max_uses: u32,
    ) -> Option<ReturnToPool> {
        if max_uses != 0 && uses >= max_uses {
            return None;
        }
        if h1.is_ready() {
            self.put_h1(key.clone(), h1, uses);
            return None;
        }
        let pool = Arc::downgrade(self);
        let key = key.clone();
        Some(Box::new(move || {
            if let Some(pool) = pool.upgrade() {
                pool.put_h1_when_ready(key, h1, uses);
            }
        }))
    }

    /// Pools `h1` now if it is idle, else once it is (the request body may still be going
    /// out; a task waits for that).
    fn put_h1_when_ready(self: &Arc<Self>, key: K, mut h1: H1, uses: u32) {
        if h1.is_ready() {
            self.put_h1(key, h1, uses);
            return;
        }
        // A body dropped outside the runtime (at exit) has nowhere to wait.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = Arc::downgrade(self);
        rt.spawn(async move {
            if h1.ready().await.is_err() {
                return;
            }
            if let Some(pool) = pool.upgrade() {
                pool.put_h1(key, h1, uses);
            }
        });
    }

    fn put_h1(&self, key: K, h1: H1, uses: u32) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let slot = map.entry(key).or_default();
        slot.h1.push((h1, Instant::now(), uses));
        // Requests may be waiting for a connection (`wait_to_dial`); without them, one load.
        if Arc::strong_count(&slot.parallel) > 1 {
            slot.parallel.freed.notify_one();
        }
    }

    /// Drops pooled connections whose key fails `keep` (endpoints that left the catalog), and
    /// ones idle past the idle timeout (h2: no open stream for that long). In-flight requests
    /// keep their connections alive.
    pub fn retain(&self, keep: impl FnMut(&K) -> bool) {
        self.retain_at(Instant::now(), IDLE_TIMEOUT, keep)
    }

    /// Drops every pooled connection no request is using (overload step 1).
    pub fn release_idle(&self) {
        self.retain_at(Instant::now(), Duration::ZERO, |_| true)
    }

    fn retain_at(&self, now: Instant, idle_limit: Duration, mut keep: impl FnMut(&K) -> bool) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|k, slot| {
            if !keep(k) {
                return false;
            }
            slot.h1.retain(|(h1, since, _)| {
                !h1.is_closed() && now.duration_since(*since) < idle_limit
            });
            slot.h2.retain(|(h2, st, last)| {
                let idle =
                    st.open.load(Ordering::Relaxed) == 0 && now.duration_since(*last) >= idle_limit;
                !h2.is_closed() && !idle
            });
            slot.in_use()
        });
    }

    /// Sweeps idle connections every few seconds for as long as the pool exists.
    pub fn spawn_sweeper(self: &Arc<Self>) {
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                match pool.upgrade() {
                    Some(p) => p.retain(|_| true),
                    None => return,
                }
            }
        });
    }
}

pub enum SendError {
    /// The connection was gone before the request went out: safe to retry elsewhere.
    NotSent(BoxedRequest),
    Failed(Failed),
}

/// How an exchange that had started broke, as the client that carried it reports it.
#[derive(Debug)]
pub enum Failed {
    H1(hyper::Error),
    H2(h2::Error),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::H1(e) => e.fmt(f),
            Failed::H2(e) => e.fmt(f),
        }
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Pool<K> {
    /// Sends `req` on `conn`. An HTTP/1.1 connection goes back to the pool once the exchange
    /// is over; for HTTP/2 the returned guard holds the stream's place until the caller drops
    /// it at the end of the response.
    pub async fn send(
        self: &Arc<Self>,
        key: &K,
        conn: Conn,
        mut req: BoxedRequest,
        max_uses: u32,
    ) -> Result<(http::Response<UpBody>, Option<StreamGuard>), SendError> {
        let gate = req.body().continue_gate().cloned();
        crate::http::expect::arm(&mut *req, gate, matches!(conn, Conn::H2(..)));
        let unsent = |mut e: hyper::client::conn::TrySendError<http::Request<ReqBody>>| match e
            .take_message()
        {
            Some(r) => SendError::NotSent(Box::new(r)),
            None => SendError::Failed(Failed::H1(e.into_error())),
        };
        match conn {
            Conn::H1(mut s, uses) => {
                let abandoned = AbortUnlessAnswered(Some(s.task.clone()));
                let resp = s.try_send_request(*req).await.map_err(unsent)?;
                abandoned.answered();
                let back = self.return_h1(key, s, uses + 1, max_uses);
                Ok((resp.map(|b| UpBody::h1_pooled(b, back)), None))
            }
            Conn::H2(mut s, guard) => match s.send(req).await {
                Ok(resp) => Ok((resp.map(UpBody::H2), Some(guard))),
                Err(H2SendError::NotSent(req)) => Err(SendError::NotSent(req)),
                Err(H2SendError::Failed(e)) => Err(SendError::Failed(Failed::H2(e))),
            },
        }
    }
}

/// Starts an HTTP/1.1 client connection on `io`; `held` (a circuit-breaker place) lives as
/// long as the connection.
pub async fn handshake_h1<T, G>(io: T, held: G) -> hyper::Result<H1>
where
    T: Read + Write + Unpin + Send + 'static,
    G: Send + 'static,
{
    // Response heads are bounded like request heads (SPEC section 8).
    let (send, conn) = http1::Builder::new()
        .max_buf_size(HYPER_MAX_BUF)
        .handshake(io)
        .await?;
    let task = tokio::spawn(async move {
        // Upgradable: after a 101 the connection's IO goes to whoever took the response's
        // upgrade (only upgrade requests, on unpooled connections, can get one).
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("upstream h1 connection ended: {e}");
        }
        drop(held);
    })
    .abort_handle();
    Ok(H1 { send, task })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Either, Empty, Full};
    use hyper_util::rt::TokioIo;

    use crate::http::body::Metered;

    /// An h2c server that accepts connections and never answers (streams are never used here).
    async fn h2_sender() -> H2 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Empty::<bytes::Bytes>::new(),
                        ))
                    });
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
                });
            }
        });
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        handshake_h2(tcp, ()).await.unwrap()
    }

    #[tokio::test]
    async fn an_h2_connection_is_shared_until_its_streams_run_out() {
        let pool: Arc<Pool<u8>> = Pool::new();
        let first = pool.put_h2(1, h2_sender().await, 0);
        let mut held = vec![first];
        for _ in 1..H2_STREAMS_PER_CONN {
            match pool.get(&1, 0) {
                Some(Conn::H2(_, g)) => held.push(g),
                _ => panic!("the pooled connection still has streams to give"),
            }
        }
        assert!(
            pool.get(&1, 0).is_none(),
            "a full connection must not take more streams"
        );
        // A second connection joins the key; new streams go there.
        held.push(pool.put_h2(1, h2_sender().await, 0));
        assert!(matches!(pool.get(&1, 0), Some(Conn::H2(..))));
        // When a stream of the first one ends, it has room again.
        held.truncate(10);
        assert!(matches!(pool.get(&1, 0), Some(Conn::H2(..))));
    }

    #[tokio::test]
    async fn idle_h2_connections_leave_the_pool_busy_ones_stay() {
        let pool: Arc<Pool<u8>> = Pool::new();
        drop(pool.put_h2(1, h2_sender().await, 0));
        let busy = pool.put_h2(2, h2_sender().await, 0);
        let later = Instant::now() + IDLE_TIMEOUT + Duration::from_secs(1);
        pool.retain_at(later, IDLE_TIMEOUT, |_| true);
        assert!(
            pool.get(&1, 0).is_none(),
            "an idle connection must be dropped"
        );
        assert!(
            pool.get(&2, 0).is_some(),
            "a connection with an open stream stays"
        );
        drop(busy);
        // Keys the catalog no longer has go, busy or not.
        pool.retain(|k| *k != 2);
        assert!(pool.get(&2, 0).is_none());
    }

    #[tokio::test]
    async fn max_requests_per_connection_retires_a_connection() {
        let pool: Arc<Pool<u8>> = Pool::new();
        // One request per connection: never pooled at all.
        let _g = pool.put_h2(1, h2_sender().await, 1);
        assert!(pool.get(&1, 1).is_none());
        // Two per connection: the first reuse is the last.
        let _g = pool.put_h2(2, h2_sender().await, 2);
        assert!(pool.get(&2, 2).is_some());
        assert!(pool.get(&2, 2).is_none());
    }

    /// A connection that closed after it was taken from the pool hands the request back
    /// untouched (`SendError::NotSent`), which is what lets `forward` resend it elsewhere (its
    /// `pool-closed` retry): for HTTP/2 and HTTP/1.1 alike.
    #[tokio::test]
    async fn a_connection_closed_before_the_send_hands_the_request_back() {
        let pool: Arc<Pool<u8>> = Pool::new();

        // HTTP/2: the app ends the connection right after the handshake.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(tcp).await.unwrap();
            conn.graceful_shutdown();
            while conn.accept().await.is_some() {}
        });
        let h2 = handshake_h2(tokio::net::TcpStream::connect(addr).await.unwrap(), ())
            .await
            .unwrap();
        let guard = pool.put_h2(1, h2.clone(), 0);
        app.await.unwrap();
        until_closed(|| h2.is_closed()).await;
        assert_handed_back(&pool, 1, Conn::H2(h2, guard), "h2").await;

        // HTTP/1.1: the app closes the socket without a word.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            drop(tcp);
        });
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let h1 = handshake_h1(TokioIo::new(tcp), ()).await.unwrap();
        app.await.unwrap();
        until_closed(|| h1.is_closed()).await;
        assert_handed_back(&pool, 2, Conn::H1(h1, 0), "h1").await;
    }

    /// Waits (at most 5 s) until the client side has seen its connection close.
    async fn until_closed(closed: impl Fn() -> bool) {
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while !closed() {
            assert!(tokio::time::Instant::now() < until, "never seen closed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sends a request marked with `tag` on `conn` and checks it comes back unsent, whole.
    async fn assert_handed_back(pool: &Arc<Pool<u8>>, key: u8, conn: Conn, tag: &'static str) {
        let mut req = get("/again");
        req.headers_mut()
            .insert("x-kept", http::HeaderValue::from_static(tag));
        match pool.send(&key, conn, Box::new(req), 0).await {
            Err(SendError::NotSent(r)) => {
                assert_eq!(r.uri().path(), "/again");
                assert_eq!(r.headers()["x-kept"], tag);
            }
            Err(SendError::Failed(e)) => panic!("must come back unsent, got {e}"),
            Ok(_) => panic!("a closed connection cannot answer"),
        }
    }

    /// An HTTP/1.1 app on loopback: `/small` answers 64 bytes, `/big` 4 MiB (far more than
    /// the socket buffers hold, so it is still arriving when its head is read), anything else
    /// 204. Counts the connections it accepts.
    async fn h1_app() -> (std::net::SocketAddr, Arc<AtomicU32>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU32::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|req: http::Request<_>| async move {
                        let (status, body) = match req.uri().path() {
                            "/small" => (200, Bytes::from(vec![b's'; 64])),
                            "/big" => (200, Bytes::from(vec![b'b'; 4 << 20])),
                            _ => (204, Bytes::new()),
                        };
                        let mut resp = http::Response::new(Full::new(body));
                        *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
                        Ok::<_, std::convert::Infallible>(resp)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        (addr, accepted)
    }

    fn get(path: &str) -> http::Request<ReqBody> {
        let body = Metered::new(Either::Right(Empty::<Bytes>::new()), Arc::default());
        http::Request::get(format!("http://app{path}"))
            .body(body)
            .unwrap()
    }

    /// Sends a GET for `path` on a pooled connection (a new one when the pool has none).
    async fn send(
        pool: &Arc<Pool<u8>>,
        addr: std::net::SocketAddr,
        path: &str,
    ) -> http::Response<UpBody> {
        send_limited(pool, addr, path, 0).await
    }

    /// As `send`, with connections retired after `max_uses` requests (0: never).
    async fn send_limited(
        pool: &Arc<Pool<u8>>,
        addr: std::net::SocketAddr,
        path: &str,
        max_uses: u32,
    ) -> http::Response<UpBody> {
        let conn = match pool.get(&1, max_uses) {
            Some(c) => c,
            None => {
                let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                Conn::H1(handshake_h1(TokioIo::new(tcp), ()).await.unwrap(), 0)
            }
        };
        match pool.send(&1, conn, Box::new(get(path)), max_uses).await {
            Ok((resp, _)) => resp,
            Err(_) => panic!("the app answers every request"),
        }
    }

    #[tokio::test]
    async fn a_connection_is_pooled_as_its_answer_is_read_to_the_end() {
        let (addr, accepted) = h1_app().await;
        let pool: Arc<Pool<u8>> = Pool::new();
        for path in ["/small", "/big", "/small", "/big"] {
            let resp = send(&pool, addr, path).await;
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert!(!body.is_empty());
            // No turn of the scheduler in between: the end of the body itself put it back, so
            // the client's next request cannot miss it and dial another.
            let Some(Conn::H1(h1, uses)) = pool.get(&1, 0) else {
                panic!("after {path}, the connection must be in the pool already");
            };
            pool.put_h1(1, h1, uses);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_answer_without_a_body_frees_its_connection_unread() {
        let (addr, accepted) = h1_app().await;
        let pool: Arc<Pool<u8>> = Pool::new();
        for _ in 0..3 {
            let resp = send(&pool, addr, "/none").await;
            assert_eq!(resp.status(), 204);
            // Never polled: hyper does not read a body it knows is empty.
            drop(resp);
        }
        assert!(pool.get(&1, 0).is_some());
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// `max_requests_per_connection` (SPEC section 4) for HTTP/1.1: the request that reaches
    /// the limit does not return its connection, whichever way the return happens.
    #[tokio::test]
    async fn an_h1_connection_is_retired_at_its_request_limit() {
        let (addr, accepted) = h1_app().await;
        let pool: Arc<Pool<u8>> = Pool::new();
        for path in ["/small", "/big", "/small", "/big", "/none", "/small"] {
            let resp = send_limited(&pool, addr, path, 2).await;
            resp.into_body().collect().await.unwrap();
        }
        // Two requests on each of three connections; the last one's second retired it.
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert!(pool.get(&1, 2).is_none());
    }

    /// End to end, with the pool's own readiness check: a connection whose answer was
    /// dropped half read never carries another request, and the next request is served on a
    /// new one.
    #[tokio::test]
    async fn an_answer_dropped_half_read_does_not_pool_its_connection() {
        let (addr, accepted) = h1_app().await;
        let pool: Arc<Pool<u8>> = Pool::new();
        let mut body = send(&pool, addr, "/big").await.into_body();
        let first = body.frame().await.unwrap().unwrap();
        assert!(first.is_data());
        drop(body);
        // The rest of that answer is still on the connection: it must not carry another.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(pool.get(&1, 0).is_none());
        let resp = send(&pool, addr, "/small").await;
        assert_eq!(
            resp.into_body().collect().await.unwrap().to_bytes().len(),
            64
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }
}
