//! HTTP as both listeners speak it: server settings, limits and downstream timers
//! (`server/`, `limits.rs`), metered bodies (`body.rs`), header rules (`headers/`),
//! `Expect: 100-continue` (`expect.rs`), response bodies from the next hop
//! (`upstream_body.rs`), a connection's last response sent with its FIN (`fin.rs`), the proxy's
//! own error answers (`answer.rs`, SPEC section 7), and the families of cut-offs and dropped
//! headers (`metrics.rs`).

pub mod answer;
pub mod body;
pub mod expect;
pub mod fin;
pub mod headers;
pub mod limits;
pub mod metrics;
pub mod server;
pub mod upstream_body;
