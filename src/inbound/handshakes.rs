//! The cap on inbound connections that have not finished their TLS handshake (SPEC section 8).
//! When it is full, the OLDEST such connection is closed to admit the new one: a flood of silent
//! connections then only ever pushes out its own members, while a real peer's handshake (which
//! takes milliseconds) completes long before it becomes the oldest.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::drain;

pub struct Handshakes {
    max: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// By admission order: the first entry is the oldest.
    pending: BTreeMap<u64, oneshot::Sender<()>>,
}

/// One connection's place among the handshaking ones; dropping it (handshake over) frees it.
pub struct Pending {
    id: u64,
    evicted: oneshot::Receiver<()>,
    owner: Arc<Handshakes>,
}

impl Handshakes {
    pub fn new(max: usize) -> Arc<Handshakes> {
        Arc::new(Handshakes {
            max: max.max(1),
            state: Mutex::new(State::default()),
        })
    }

    /// Admits a new connection, evicting the oldest pending one when full.
    pub fn enter(self: &Arc<Self>) -> Pending {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.pending.len() >= self.max {
            if let Some((_, oldest)) = st.pending.pop_first() {
                let _ = oldest.send(());
                drain::connection_rejected("inbound", "handshake-evicted");
            }
        }
        let id = st.next;
        st.next += 1;
        st.pending.insert(id, tx);
        Pending {
            id,
            evicted: rx,
            owner: self.clone(),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.pending.len()
    }
}

impl Pending {
    /// Resolves when a newer connection took this one's place.
    pub async fn evicted(&mut self) {
        let _ = (&mut self.evicted).await;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut st = self.owner.state.lock().unwrap_or_else(|e| e.into_inner());
        st.pending.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_full_set_evicts_its_oldest_member_only() {
        let h = Handshakes::new(2);
        let mut first = h.enter();
        let mut second = h.enter();
        let mut third = h.enter();
        assert_eq!(h.len(), 2);
        tokio::time::timeout(Duration::from_secs(1), first.evicted())
            .await
            .expect("the oldest is evicted");
        let short = Duration::from_millis(50);
        assert!(tokio::time::timeout(short, second.evicted()).await.is_err());
        assert!(tokio::time::timeout(short, third.evicted()).await.is_err());
        // A finished handshake frees its place: the next one evicts nobody.
        drop(second);
        let _fourth = h.enter();
        assert!(tokio::time::timeout(short, third.evicted()).await.is_err());
        drop(first);
        assert_eq!(h.len(), 2);
    }
}
