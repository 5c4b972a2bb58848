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
//!
//! The library is the binary's, not an API: without the `testing` feature every module is
//! crate-private, so rustc reports what nothing uses. The binary (`src/main.rs`) reaches it
//! through [`cli`] only. `--features testing` makes the modules public for the tests, benches
//! and fuzz targets (the dev-dependency on this crate and `fuzz/Cargo.toml` turn it on); what
//! ships is the library without it (docs/development.md).

/// Declares each module public with the `testing` feature and crate-private without it.
macro_rules! modules {
    ($($(#[$attr:meta])* $name:ident;)*) => {$(
        $(#[$attr])*
        #[cfg(feature = "testing")]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "testing"))]
        pub(crate) mod $name;
    )*};
}

modules! {
    accesslog;
    admin;
    capture;
    catalog;
    config;
    control_plane;
    demo;
    dns;
    drain;
    http;
    identity;
    inbound;
    memory;
    metrics;
    outbound;
    overload;
    readiness;
    run;
    sockets;
    trace;
    validation;
    watch;
    xds;
}

/// The fuzz targets' way into what is private to its module (`fuzz/`).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod fuzzing;

/// What the binary runs: the allocator and one entry point per command of `src/main.rs`.
pub mod cli {
    pub use crate::capture::redirect::{main as redirect, Action as RedirectAction, Rules};
    pub use crate::control_plane::{main as control_plane, Options as ControlPlaneOptions};
    pub use crate::demo::main as demo;
    pub use crate::identity::certgen::main as certs;
    pub use crate::memory::{tune_allocator, Allocator};
    pub use crate::outbound::explain::cli as explain;
    pub use crate::run::{check, main as run};
}
