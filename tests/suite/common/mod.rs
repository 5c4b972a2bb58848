//! Shared harness for the integration tests: real processes, real sockets, real TLS, loopback only.
//!
//! Include it from a test file with `mod common;` and `use common::*;`.
//!
//! # Loopback addressing
//!
//! Every test owns one /24 of loopback, so tests (and test binaries, and two people's test
//! runs on one machine) can run in parallel without ever sharing an address. A test gets its
//! /24 from [`Net::fresh`], never by picking numbers:
//!
//! * `Net::fresh()` claims a free `127.a.b.0/24` with `a` in 100..=199 by listening on
//!   `127.a.b.0:`[`CLAIM_PORT`]; whoever holds that listener owns the /24. The walk starts at a
//!   point derived from the process id and skips /24s that another test holds. The claim is
//!   kept until the test process exits. `127.0.x.x` is never handed out: it is left to the
//!   example configs in `configs/` and to people running the proxy by hand.
//! * Inside the /24, host 0 is the claim and pod `i` (0..=15) owns the hosts
//!   `16*i + 1 ..= 16*i + 15`:
//!   * `16*i + 1`: the pod's apps (the proxy's `inbound.app_host`), on their real ports;
//!   * `16*i + 2`: the pod's proxy: inbound `:15008`, outbound `:15001`, admin `:15000`;
//!   * `16*i + 3 ..= 16*i + 15`: free for that pod's extras (client source addresses, ...).
//!
//! So a test whose net is `127.a.b.0/24` runs pod 0's proxy on `127.a.b.2:15008`, its apps on
//! `127.a.b.1:<port>` and its admin listener on `127.a.b.2:15000`.
//!
//! # At a glance
//!
//! One module per topic, all re-exported here:
//!
//! * `net`: [`Net`] / [`PodNet`], the addresses above; `PodNet::listeners_yaml` writes the
//!   three listener sections of a proxy config.
//! * `certs`: [`Certs`], a CA plus workload leaves made by `aether-proxy certs`; `Certs::new`
//!   again for a second CA, `same_ca_other_trust_domain` for a foreign SPIFFE id under the
//!   same CA.
//! * `proxy`: [`Proxy`], `aether-proxy run` in a temp dir; waits for `/readyz` 200; stdout (the
//!   access log) and stderr captured to files; killed on drop; signals and exit status for
//!   drain tests; its resident memory (`Proxy::rss_kib`); `ProxyBuilder::wrap` runs it through a
//!   command such as `ip netns exec <ns> setpriv ...` (another namespace, another uid), and
//!   `ProxyBuilder::netns` inside a network namespace (`ip netns exec`).
//! * `apps`: [`HttpApp`] (HTTP/1.1, h2c or both) and [`TcpEcho`], apps that record what they
//!   saw.
//! * `tls`: [`TlsClient`], a BoringSSL client with chosen cert, SNI, ALPN; [`TlsFailure`] keeps
//!   the raw bytes the server sent (plaintext alerts).
//! * `http_client`: [`HttpClient`], HTTP/1.1 or HTTP/2 over any stream; [`http_connect`] for
//!   CONNECT tunnels; [`http_get`] for admin endpoints.
//! * `tcp`: [`tcp_connect`] and [`read_to_end_within`] for raw streams;
//!   [`LoopbackSegments`], the TCP segments one address sends (a packet socket, root only).
//! * `wait`: [`eventually`], the one poll loop: a probe (an async closure answering `Ok` once
//!   what it waits for holds, `Err(what it saw)` until then) asked every 20 ms until a limit,
//!   then a panic with the last `Err`; [`eventually_every`] at another pace; [`poll_until`]
//!   hands the last `Err` back instead of panicking; [`holds`] for yes-or-no probes. Every
//!   "wait until" in the harness and the tests goes through it: no hand-written deadline loop.
//! * `metrics`: [`metric`] (the sum of a metric's samples whose labels contain the given pairs)
//!   and [`wait_metric`] (until a predicate holds for it) on a proxy's `/metrics`.
//!
//! Helpers of one group of tests live in their own module, which is not re-exported:
//!
//! * `inbound`: a `payments` sidecar's proxy, the `frontend` peer dialling its :15008, refusals
//!   and the inbound protocol-error counters, for the tests that play the peer proxy
//!   themselves, `tests/{inbound,abuse,timers,rules}.rs` (`use common::inbound::*;`).
//! * `live`: pod apps with a version, a load generator and admin readers for `tests/live.rs`
//!   (`use common::live::*;`).
//! * `mesh`: client and server pods, catalogs, answer checks, raw HTTP/1.1, a gRPC echo
//!   service and a wire observer for the outbound tests, `tests/outbound_*.rs`
//!   (`use common::mesh::*;`).
//! * `envoy`: a real Envoy 1.40 as a client pod fed by the `xds` control plane, for
//!   `tests/envoy_interop.rs` (`use common::envoy::*;`).
//! * `xds`: a control plane (delta ADS and SDS from Envoy's v3 types) fed by a catalog-shaped
//!   fixture, recording what clients send, and `PaymentsPod`, the server pod most of them
//!   route to, for the xDS tests `tests/xds_*.rs` (`use common::xds::*;`).
//!
//! # Time bounds
//!
//! Every network wait in here is bounded ([`IO_TIMEOUT`], [`READY_TIMEOUT`]); nothing can hang CI.
//! A test that waits for something to happen says so with [`eventually`] and its own limit.
//! Processes and servers are stopped when their handle is dropped.

mod apps;
mod certs;
mod http_client;
mod metrics;
mod net;
mod proxy;
mod tcp;
mod tls;
mod wait;

pub mod envoy;
pub mod inbound;
pub mod live;
pub mod mesh;
pub mod xds;

// Every test binary uses its own part of the harness.
#[allow(unused_imports)]
pub use {
    apps::*, certs::*, http_client::*, metrics::*, net::*, proxy::*, tcp::*, tls::*, wait::*,
};

use std::time::Duration;

/// Bound for any single network step (connect, handshake, request, read).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound for a proxy to become ready after it was spawned.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound for an access-log line to show up (the proxy flushes every 50 ms).
pub const LOG_TIMEOUT: Duration = Duration::from_secs(5);

/// The path of the binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_aether-proxy");

/// `await` with a bound; the error names what timed out.
pub async fn within<F: std::future::Future>(
    limit: Duration,
    what: &str,
    f: F,
) -> Result<F::Output, String> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| format!("{what}: timed out after {limit:?}"))
}
