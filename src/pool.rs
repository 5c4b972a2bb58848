//! Upstream connection pools: one multiplexed HTTP/2 connection per key, and a keep-alive list
//! of idle HTTP/1.1 connections per key. The key says everything that makes two connections
//! interchangeable (for the outbound side: endpoint, SNI port, negotiated protocol, client cert).
//!
//! The lock guards only the map; it is never held across an `.await`.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::body::ReqBody;
use hyper::client::conn::{http1, http2};
use hyper::rt::{Read, Write};
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Idle upstream connections close after this long (SPEC section 8).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

pub type H1 = http1::SendRequest<ReqBody>;
pub type H2 = http2::SendRequest<ReqBody>;

/// A ready-to-use upstream connection.
pub enum Conn {
    H1(H1, u32),
    H2(H2, Arc<AtomicU32>),
}

struct Slot {
    h2: Option<(H2, Arc<AtomicU32>)>,
    h1: Vec<(H1, Instant, u32)>,
}

pub struct Pool<K> {
    map: Mutex<HashMap<K, Slot>>,
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Default for Pool<K> {
    fn default() -> Self {
        Pool {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Pool<K> {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A pooled connection for `key`, if one is usable now. `max_uses` 0 means unlimited.
    pub fn get(&self, key: &K, max_uses: u32) -> Option<Conn> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let slot = map.get_mut(key)?;
        if let Some((h2, uses)) = &slot.h2 {
            if h2.is_closed() {
                slot.h2 = None;
            } else {
                let n = uses.fetch_add(1, Ordering::Relaxed) + 1;
                let conn = Conn::H2(h2.clone(), uses.clone());
                if max_uses != 0 && n >= max_uses {
                    // Its streams finish; new requests get a new connection.
                    slot.h2 = None;
                }
                return Some(conn);
            }
        }
        let now = Instant::now();
        while let Some((h1, since, uses)) = slot.h1.pop() {
            if h1.is_ready() && now.duration_since(since) < IDLE_TIMEOUT {
                return Some(Conn::H1(h1, uses));
            }
        }
        None
    }

    /// Shares a new HTTP/2 connection for later requests (its first use is the caller's).
    pub fn put_h2(&self, key: K, h2: H2, max_uses: u32) -> Arc<AtomicU32> {
        let uses = Arc::new(AtomicU32::new(1));
        if max_uses == 1 {
            return uses;
        }
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let slot = map.entry(key).or_insert_with(|| Slot {
            h2: None,
            h1: Vec::new(),
        });
        slot.h2 = Some((h2, uses.clone()));
        uses
    }

    /// Returns an HTTP/1.1 connection to the pool once its current exchange is complete.
    pub fn put_h1_when_ready(self: &Arc<Self>, key: K, mut h1: H1, uses: u32, max_uses: u32) {
        if max_uses != 0 && uses >= max_uses {
            return;
        }
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            if h1.ready().await.is_err() {
                return;
            }
            let Some(pool) = pool.upgrade() else { return };
            let mut map = pool.map.lock().unwrap_or_else(|e| e.into_inner());
            let slot = map.entry(key).or_insert_with(|| Slot {
                h2: None,
                h1: Vec::new(),
            });
            slot.h1.push((h1, Instant::now(), uses));
        });
    }

    /// Drops pooled connections whose key fails `keep` (endpoints that left the catalog), and
    /// idle ones past the idle timeout. In-flight requests keep their connections alive.
    pub fn retain(&self, mut keep: impl FnMut(&K) -> bool) {
        let now = Instant::now();
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|k, slot| {
            if !keep(k) {
                return false;
            }
            slot.h1.retain(|(h1, since, _)| {
                !h1.is_closed() && now.duration_since(*since) < IDLE_TIMEOUT
            });
            if slot.h2.as_ref().is_some_and(|(h2, _)| h2.is_closed()) {
                slot.h2 = None;
            }
            slot.h2.is_some() || !slot.h1.is_empty()
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

/// Starts an HTTP/1.1 client connection on `io`.
pub async fn handshake_h1<T>(io: T) -> hyper::Result<H1>
where
    T: Read + Write + Unpin + Send + 'static,
{
    let (send, conn) = http1::Builder::new().handshake(io).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!("upstream h1 connection ended: {e}");
        }
    });
    Ok(send)
}

/// Starts an HTTP/2 client connection on `io`, with Envoy's flow-control windows.
pub async fn handshake_h2<T>(io: T) -> hyper::Result<H2>
where
    T: Read + Write + Unpin + Send + 'static,
{
    let (send, conn) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .initial_stream_window_size(16 << 20)
        .initial_connection_window_size(24 << 20)
        .max_frame_size(64 << 10)
        .keep_alive_interval(Duration::from_secs(60))
        .keep_alive_while_idle(false)
        .handshake(io)
        .await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!("upstream h2 connection ended: {e}");
        }
    });
    Ok(send)
}
