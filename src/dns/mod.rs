//! The DNS listener (SPEC section 10): UDP and TCP on `dns.listen`. Mesh names are answered
//! from the current catalog (`answer.rs`), every other name is relayed to the pod's resolvers
//! (`forward.rs`). Each query reads the catalog snapshot of its moment, so answers follow the
//! store with nothing to keep in step.

pub mod answer;
pub mod forward;
pub mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::catalog::CatalogStore;
use crate::drain::{accept_until_closing, Drain, Phase, Tracker};
use answer::{Answerer, Outcome, Step};

/// Queries waiting on an upstream or on discovery at once; past it, SERVFAIL at once.
pub const MAX_IN_FLIGHT: usize = 1024;
/// Open TCP connections from clients.
pub const MAX_TCP_CONNECTIONS: usize = 256;
/// A TCP connection with no query for this long is closed (RFC 7766 leaves it to the server).
pub const TCP_IDLE: Duration = Duration::from_secs(10);
/// The largest query taken over TCP; real queries are a few hundred bytes.
pub const MAX_TCP_QUERY: usize = 4096;
/// The largest datagram read from a client; anything longer is cut and answered FORMERR.
const MAX_UDP_QUERY: usize = 4096;

pub struct Dns {
    answerer: Answerer,
    catalog: Arc<CatalogStore>,
    /// The pod's resolvers, replaced whole when resolv.conf changes (`set_resolv_conf`).
    upstreams: arc_swap::ArcSwap<Vec<SocketAddr>>,
    listen: SocketAddr,
    in_flight: Arc<Semaphore>,
}

impl Dns {
    /// Upstreams come from `resolv_conf` (the text of `/etc/resolv.conf`), and follow it
    /// through `set_resolv_conf`.
    pub fn new(
        mesh_domain: &str,
        ipv6: bool,
        listen: SocketAddr,
        resolv_conf: &str,
        catalog: Arc<CatalogStore>,
    ) -> Dns {
        let upstreams = forward::nameservers(resolv_conf, listen);
        if upstreams.is_empty() {
            tracing::warn!(
                "dns: no upstream resolver in /etc/resolv.conf; other names get SERVFAIL"
            );
        }
        metrics::metrics();
        Dns {
            answerer: Answerer::new(mesh_domain, ipv6),
            catalog,
            upstreams: arc_swap::ArcSwap::from_pointee(upstreams),
            listen,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        }
    }

    /// Takes the nameservers of new resolv.conf text; queries already relayed finish with the
    /// ones they started with.
    pub fn set_resolv_conf(&self, resolv_conf: &str) {
        let upstreams = forward::nameservers(resolv_conf, self.listen);
        if **self.upstreams.load() != upstreams {
            tracing::info!(
                ?upstreams,
                "dns: resolv.conf changed; relaying to its nameservers"
            );
            self.upstreams.store(Arc::new(upstreams));
        }
    }

    /// Serves both sockets until the drain closes listeners.
    pub async fn serve(
        self: Arc<Self>,
        udp: UdpSocket,
        tcp: TcpListener,
        drain: Drain,
        tracker: Tracker,
    ) {
        let udp_task = tokio::spawn(self.clone().serve_udp(Arc::new(udp), drain.clone()));
        let me = self.clone();
        let d = drain.clone();
        accept_until_closing(
            "dns",
            tcp,
            (MAX_TCP_CONNECTIONS, false),
            &drain,
            &tracker,
            move |conn, _| me.clone().serve_tcp(conn, d.clone()),
        )
        .await;
        let _ = udp_task.await;
    }

    async fn serve_udp(self: Arc<Self>, sock: Arc<UdpSocket>, drain: Drain) {
        let closing = Drain::reached(drain.watch(), Phase::Closing);
        tokio::pin!(closing);
        let mut buf = vec![0u8; MAX_UDP_QUERY];
        loop {
            let (n, from) = tokio::select! {
                r = sock.recv_from(&mut buf) => match r {
                    Ok(v) => v,
                    Err(e) => {
                        // ICMP errors from earlier sends land here; nothing to do but go on.
                        tracing::debug!("dns udp: {e}");
                        continue;
                    }
                },
                _ = &mut closing => break,
            };
            let packet = &buf[..n];
            match self.step(packet) {
                Step::Reply(bytes, outcome) => {
                    count(outcome);
                    let _ = sock.send_to(&bytes, from).await;
                }
                Step::Drop => count(Outcome::Dropped),
                step => {
                    let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
                        self.overloaded(&step, |b| {
                            let _ = sock.try_send_to(&b, from);
                        });
                        continue;
                    };
                    let (me, sock, packet) = (self.clone(), sock.clone(), packet.to_vec());
                    tokio::spawn(async move {
                        let bytes = me.finish(step, &packet, true).await;
                        drop(permit);
                        let _ = sock.send_to(&bytes, from).await;
                    });
                }
            }
        }
        tracing::info!("dns listener closed");
    }

    /// Queries on one TCP connection, one after the other, until it is idle, misbehaves or the
    /// drain closes listeners.
    async fn serve_tcp(self: Arc<Self>, mut conn: TcpStream, drain: Drain) {
        conn.set_nodelay(true).ok();
        let mut closing = drain.watch();
        loop {
            if *closing.borrow_and_update() >= Phase::Closing {
                return;
            }
            let len = tokio::select! {
                r = tokio::time::timeout(TCP_IDLE, conn.read_u16()) => match r {
                    Ok(Ok(len)) => len as usize,
                    _ => return,
                },
                _ = closing.changed() => return,
            };
            if len > MAX_TCP_QUERY {
                count(Outcome::Dropped);
                return;
            }
            let mut packet = vec![0u8; len];
            match tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut packet)).await {
                Ok(Ok(_)) => {}
                _ => return,
            }
            let bytes = match self.step(&packet) {
                Step::Reply(bytes, outcome) => {
                    count(outcome);
                    bytes
                }
                Step::Drop => {
                    // Not even a header: the stream cannot be trusted to be framed right.
                    count(Outcome::Dropped);
                    return;
                }
                step => match self.in_flight.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let b = self.finish(step, &packet, false).await;
                        drop(permit);
                        b
                    }
                    Err(_) => {
                        let mut out = Vec::new();
                        self.overloaded(&step, |b| out = b);
                        out
                    }
                },
            };
            if bytes.is_empty() || bytes.len() > usize::from(u16::MAX) {
                return;
            }
            let mut framed = Vec::with_capacity(bytes.len() + 2);
            framed.extend_from_slice(&(bytes.len() as u16).to_be_bytes());
            framed.extend_from_slice(&bytes);
            match tokio::time::timeout(TCP_IDLE, conn.write_all(&framed)).await {
                Ok(Ok(())) => {}
                _ => return,
            }
        }
    }

    fn step(&self, packet: &[u8]) -> Step {
        self.answerer.handle(packet, &self.catalog.load())
    }

    /// SERVFAIL for a query that found every in-flight place taken.
    fn overloaded(&self, step: &Step, send: impl FnOnce(Vec<u8>)) {
        metrics::metrics().overloaded.inc();
        count(Outcome::ServFail);
        if let Step::Forward { query, .. } | Step::Discover { query, .. } = step {
            send(answer::servfail(query));
        }
    }

    /// The answer to a query that waits: on an upstream, or on the catalog's source.
    async fn finish(&self, step: Step, packet: &[u8], over_udp: bool) -> Vec<u8> {
        match step {
            Step::Reply(bytes, outcome) => {
                count(outcome);
                bytes
            }
            Step::Drop => Vec::new(),
            Step::Forward { query, max_udp } => {
                let deadline = Instant::now() + forward::DEADLINE;
                let upstreams = self.upstreams.load_full();
                match forward::exchange(&upstreams, packet, deadline).await {
                    Some(answer) => {
                        count(Outcome::Forwarded);
                        if over_udp && answer.len() > usize::from(max_udp) {
                            answer::truncated(&query, &answer)
                        } else {
                            answer
                        }
                    }
                    None => {
                        count(Outcome::ServFail);
                        answer::servfail(&query)
                    }
                }
            }
            Step::Discover { service, query } => self.discover(&service, &query).await,
        }
    }

    /// Asks the on-demand source for `service` and answers once the catalog holds it or lists
    /// it absent; SERVFAIL when the source does not say within its timeout. The same wait as
    /// a first HTTP request to an unknown name (outbound `discover`).
    async fn discover(&self, service: &str, query: &Message) -> Vec<u8> {
        let mut changes = self.catalog.subscribe();
        let mut deadline = None;
        loop {
            changes.borrow_and_update();
            let catalog = self.catalog.load();
            if let Some(Step::Reply(bytes, outcome)) =
                self.answerer.answer_held(query, service, &catalog)
            {
                count(outcome);
                return bytes;
            }
            let timeout = catalog
                .on_demand
                .as_ref()
                .map_or_else(Default::default, |o| o.timeout);
            drop(catalog);
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            self.catalog
                .want(format!("{service}.{}", self.answerer.mesh_domain()));
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => continue,
                _ => {
                    count(Outcome::ServFail);
                    return answer::servfail(query);
                }
            }
        }
    }
}

fn count(outcome: Outcome) {
    metrics::count(outcome);
}
