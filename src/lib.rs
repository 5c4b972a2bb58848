//! aether-proxy: the Aether mesh's data-plane sidecar.
//!
//! Data flows one way: listener -> chain/route -> cluster -> pool -> connection.
//! `inbound` terminates mTLS from peer proxies and picks a chain by SNI; `outbound` routes app
//! requests by authority to clusters, endpoints and pooled mTLS connections; `catalog` holds
//! what the mesh knows (a store fed by sources); `identity` owns SPIFFE ids, certificates and
//! TLS contexts; `http` is what both listeners share of HTTP; `admin`, `readiness`, `drain`,
//! `metrics`, `accesslog` and `trace` are the operator's side; `overload` sheds load inside a
//! memory limit. `validation` is how bad input is
//! reported; `sockets` is what every TCP socket of the data path shares (keepalive, idle splicing);
//! `capture` is transparent capture's netfilter rules and the original-destination read;
//! `control_plane` is a small delta ADS server for a catalog file (a command of its own).

pub mod accesslog;
pub mod admin;
pub mod capture;
pub mod catalog;
pub mod config;
pub mod control_plane;
pub mod demo;
pub mod dns;
pub mod drain;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod identity;
pub mod inbound;
pub mod memory;
pub mod metrics;
pub mod outbound;
pub mod overload;
pub mod readiness;
pub mod run;
pub mod sockets;
pub mod trace;
pub mod validation;
pub mod watch;
pub mod xds;
