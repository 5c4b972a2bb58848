//! Workload identity: certificates, SPIFFE ids and SAN checks, TLS contexts and their rotation.
//!
//! `spiffe.rs` is the `SpiffeId` type; `workload.rs` loads a certificate, key and trust bundle;
//! `san.rs` reads SPIFFE ids out of certificates (the pin); `tls.rs` builds BoringSSL contexts;
//! `store.rs` holds the contexts in use and swaps them on rotation; `expiry.rs` is what admin
//! shows of the certificates (serials, SANs, expiry); `certgen.rs` makes test certificates;
//! `metrics.rs` holds the TLS and identity metric families.

pub mod certgen;
pub mod expiry;
pub mod metrics;
pub mod san;
pub mod spiffe;
pub mod store;
pub mod tls;
pub mod workload;

pub use spiffe::SpiffeId;
pub use store::{Contexts, IdentityPaths, IdentitySpec, IdentityStore};
pub use workload::IdentityError;
