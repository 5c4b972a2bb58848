//! The control plane (SPEC section 9): a delta ADS client that discovers clusters and endpoint
//! assignments on demand and feeds them to the catalog store as the file does (`ads.rs`,
//! `resources.rs`), and an SDS client for the workload identity (`sds.rs`), both over gRPC
//! channels to a unix socket or a TCP address (`channel.rs`).

pub mod ads;
pub mod channel;
pub mod resources;
pub mod sds;
