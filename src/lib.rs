//! aether-proxy: the Aether mesh's data-plane sidecar.
//!
//! Data flows one way: listener -> chain/route -> cluster -> pool -> connection.

pub mod admin;
pub mod catalog;
pub mod config;
pub mod identity;
pub mod inbound;
pub mod readiness;
pub mod run;
