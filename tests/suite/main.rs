//! The black-box suite: one test binary, so the shared harness in `common` compiles once and
//! every helper in it is used somewhere. Each module is one topic; run one with a name filter,
//! e.g. `cargo test --test suite -- http_semantics::` (tests/README.md).
//!
//! Everything runs on loopback (each test claims its own `127.a.b.0/24`, see `common`), except
//! `namespaced`, whose tests build real network namespaces and capture rules and need root.
//! `envoy_interop` runs a real Envoy 1.40 (`ENVOY_BIN`).

mod common;

// The proxy's own command line and files.
mod certs;
mod cli;
mod demo;
mod deploy;
mod explain;
mod layout;
mod ops;
mod reference;

// Listeners and HTTP.
mod abuse;
mod admin;
mod connection_log;
mod http_semantics;
mod inbound;
mod limits;
mod overload;
mod readiness;
mod rules;
mod timers;
mod tracing;
mod upgrade;

// The outbound side: routing, identity, resilience, tunnels, gRPC, retries.
mod outbound_grpc;
mod outbound_identity;
mod outbound_resilience;
mod outbound_routing;
mod outbound_tunnel;
mod retries;
mod retry_cost;

// Live changes and the control plane.
mod control_plane_command;
mod live;
mod xds_control_plane;
mod xds_identity;
mod xds_routing;
mod xds_updates;

// Against independent implementations and in network namespaces.
mod envoy_interop;
mod hpack_peers;
mod namespaced;
