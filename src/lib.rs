//! aether-proxy: the Aether mesh's data-plane sidecar.
//!
//! Data flows one way: listener -> chain/route -> cluster -> pool -> connection.
//! `inbound` terminates mTLS from peer proxies; `identity` owns certificates and TLS contexts;
//! `admin`, `readiness`, `drain` and `metrics` are the operator's side.

pub mod accesslog;
pub mod admin;
pub mod body;
pub mod catalog;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod drain;
pub mod errors;
pub mod headers;
pub mod http_server;
pub mod identity;
pub mod inbound;
pub mod lb;
pub mod metrics;
pub mod outbound;
pub mod pool;
pub mod readiness;
pub mod routing;
pub mod run;
pub mod watch;
