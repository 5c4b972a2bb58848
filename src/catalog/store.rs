//! The catalog in use. Sources (the file today, the control plane next) hand a new validated
//! catalog to [`CatalogStore::apply`]; readers take the current one lock-free, and whatever is
//! derived from it (clusters, pooled connections, later DNS addresses) follows the version
//! itself, so no caller orders reload steps by hand.

use std::sync::Arc;

use std::sync::OnceLock;

use arc_swap::{ArcSwap, Guard};
use tokio::sync::{mpsc, watch};

use super::model::Catalog;
use super::vip::VirtualIps;

pub struct CatalogStore {
    current: ArcSwap<Catalog>,
    /// The applied version, for whatever wants to hear of a change rather than check for one.
    changed: watch::Sender<u64>,
    /// Where names a request needs go, for a source that discovers on demand.
    wants: OnceLock<mpsc::UnboundedSender<String>>,
}

impl CatalogStore {
    /// A store holding `first` as version 1.
    pub fn new(mut first: Catalog) -> CatalogStore {
        first.version = 1;
        first.vips = Arc::new(VirtualIps::build(first.services.keys().map(String::as_str)));
        CatalogStore {
            current: ArcSwap::from_pointee(first),
            changed: watch::Sender::new(1),
            wants: OnceLock::new(),
        }
    }

    /// Connects an on-demand source: it receives the names requests ask for (`want`).
    pub fn take_wants(&self) -> Option<mpsc::UnboundedReceiver<String>> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.wants.set(tx).ok()?;
        Some(rx)
    }

    /// Asks the on-demand source for a cluster name (`svc.<domain>[:port]`); the answer comes
    /// as a new catalog. Repeated asks are cheap: the source subscribes once.
    pub fn want(&self, name: String) {
        if let Some(tx) = self.wants.get() {
            let _ = tx.send(name);
        }
    }

    /// The current catalog: a request routes on one snapshot, never a mix of two.
    pub fn load(&self) -> Guard<Arc<Catalog>> {
        self.current.load()
    }

    /// `load`, for holding on to.
    pub fn load_full(&self) -> Arc<Catalog> {
        self.current.load_full()
    }

    /// The one entry point for a new catalog: it replaces the current one whole and gets the
    /// next version. Returns that version.
    pub fn apply(&self, mut next: Catalog) -> u64 {
        let services = next.services.len();
        // Most updates change endpoints, not the set of names: keep the table then.
        let current = self.current.load();
        let names = || next.services.keys().map(String::as_str);
        next.vips = if current.vips.same_names(names()) {
            current.vips.clone()
        } else {
            Arc::new(VirtualIps::build(names()))
        };
        drop(current);
        // Sources apply from one thread each; the send_modify below orders concurrent ones.
        let mut version = 0;
        self.changed.send_modify(|v| {
            *v += 1;
            version = *v;
            next.version = version;
            self.current.store(Arc::new(next));
        });
        tracing::info!(version, services, "catalog reloaded");
        version
    }

    /// Starts at 1 and grows by one per applied catalog.
    pub fn version(&self) -> u64 {
        self.current.load().version
    }

    /// Hears of every applied catalog (the latest version when several came at once).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn apply_replaces_the_catalog_whole_and_tells_subscribers() {
        let store = CatalogStore::new(Catalog::default());
        assert_eq!(store.version(), 1);
        let mut changed = store.subscribe();
        let held = Guard::into_inner(store.load());
        assert_eq!(store.apply(Catalog::default()), 2);
        assert_eq!(store.version(), 2);
        // A reader that took the old catalog keeps it, whole.
        assert_eq!(held.version, 1);
        changed.changed().await.unwrap();
        assert_eq!(*changed.borrow_and_update(), 2);
        // Two applies before the subscriber looks: it hears of the latest.
        store.apply(Catalog::default());
        store.apply(Catalog::default());
        changed.changed().await.unwrap();
        assert_eq!(*changed.borrow_and_update(), 4);
        assert_eq!(store.load().version, 4);
    }

    #[test]
    fn apply_gives_every_service_its_virtual_address() {
        let yaml = |names: &[&str]| {
            let mut y = String::from("services:\n");
            for n in names {
                y += &format!(
                    "  {n}:\n    default_port: 80\n    identity: spiffe://aether.local/ns/default/sa/{n}\n    endpoints: [{{ address: 10.0.0.1, ports: [80] }}]\n"
                );
            }
            Catalog::parse(std::path::Path::new("catalog.yaml"), &y, "aether.local").unwrap()
        };
        let store = CatalogStore::new(yaml(&["payments"]));
        let first = store.load_full();
        let ip = first.vips.v4("payments").unwrap();
        assert_eq!(
            first.vips.service_at(ip.into()).map(|s| &**s),
            Some("payments")
        );
        // Same names: the table is kept, not rebuilt.
        store.apply(yaml(&["payments"]));
        assert!(Arc::ptr_eq(&first.vips, &store.load().vips));
        // A new name: a new table, the old name where it was.
        store.apply(yaml(&["payments", "orders"]));
        let now = store.load_full();
        assert!(!Arc::ptr_eq(&first.vips, &now.vips));
        assert_eq!(now.vips.v4("payments"), Some(ip));
        assert!(now.vips.v4("orders").is_some());
    }
}
