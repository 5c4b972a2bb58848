//! The control plane (SPEC section 9): a delta ADS client that discovers clusters and endpoint
//! assignments on demand and feeds them to the catalog store as the file does, and an SDS
//! client for the workload identity (`sds.rs`), both over gRPC channels to a unix socket or a
//! TCP address (`channel.rs`). The ADS client is the stream loop (`session.rs`), what it is
//! subscribed to (`subscriptions.rs`), the routing model built from what it holds
//! (`assembly.rs`) and Envoy resources read into the model (`resources.rs`); both streams
//! identify with the same node (`node.rs`).

mod assembly;
pub mod channel;
pub mod metrics;
pub mod node;
pub mod resources;
pub mod sds;
pub mod session;
mod subscriptions;
