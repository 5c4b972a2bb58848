//! `run` and `check`: load everything, bind the listeners, serve, drain, exit.

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::net::TcpListener;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter};

use crate::admin::{Admin, SetLogFilter};
use crate::catalog::{Catalog, CatalogStore};
use crate::config::Config;
use crate::drain::{Drain, Phase, Tracker};
use crate::identity::{Contexts, IdentityError, IdentityStore};
use crate::inbound::Inbound;
use crate::metrics::ResultLabels;
use crate::outbound::cluster::Clusters;
use crate::outbound::Outbound;
use crate::readiness::ListenerCheck;

/// Why the proxy could not start serving.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("{what} {addr}: {step}: {source}")]
    Listener {
        what: &'static str,
        addr: SocketAddr,
        step: &'static str,
        source: std::io::Error,
    },
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("admin thread: {0}")]
    AdminThread(std::io::Error),
    #[error("the SDS client stopped before an identity arrived")]
    NoIdentity,
}

/// `aether-proxy check`: exit 0 when the config, its catalog and its identity files are good.
pub fn check(path: &Path) -> ExitCode {
    match load(path) {
        Ok((cfg, catalog)) => {
            let source = match (&cfg.discovery, &cfg.catalog) {
                (Some(d), _) => format!("control plane {}", d.xds.address),
                (None, Some(c)) => format!(
                    "{} service(s) in {}",
                    catalog.map_or(0, |c| c.services.len()),
                    c.path.display()
                ),
                (None, None) => "no catalog".into(),
            };
            println!(
                "{}: ok ({} inbound port(s), {source})",
                path.display(),
                cfg.inbound.ports.len(),
            );
            if !cfg.admin.listen.ip().is_loopback() {
                // SPEC section 12: allowed, but worth a second look.
                eprintln!(
                    "warning: {}: admin.listen {} is not a loopback address; anyone who can reach \
                     it can read config and metrics and drain the proxy",
                    path.display(),
                    cfg.admin.listen
                );
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in errors {
                eprintln!("error: {e}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The config, and its catalog file unless a control plane provides the catalog; identity
/// files are checked when the identity does not come over SDS.
fn load(path: &Path) -> Result<(Config, Option<Catalog>), Vec<String>> {
    let cfg =
        Config::load(path).map_err(|e| e.0.iter().map(|e| e.to_string()).collect::<Vec<_>>())?;
    let mut errors = Vec::new();
    let catalog = match (&cfg.discovery, &cfg.catalog) {
        (None, Some(c)) => match Catalog::load(&c.path, &cfg.trust_domain) {
            Ok(c) => Some(c),
            Err(e) => {
                errors.extend(e.0.iter().map(|e| e.to_string()));
                None
            }
        },
        _ => None,
    };
    if cfg.identity.sds.is_none() {
        if let Err(e) = Contexts::build(&cfg.identity_spec()) {
            errors.push(format!("{}: identity: {e}", path.display()));
        }
    }
    if errors.is_empty() {
        Ok((cfg, catalog))
    } else {
        Err(errors)
    }
}

fn init_logging() -> SetLogFilter {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .try_init();
    Box::new(move |level: &str| {
        let f = EnvFilter::try_new(level).map_err(|e| format!("bad log filter {level:?}: {e}"))?;
        handle.reload(f).map_err(|e| e.to_string())
    })
}

/// `aether-proxy run`.
pub fn main(path: &Path, concurrency: Option<usize>) -> ExitCode {
    let workers = concurrency.filter(|n| *n > 0).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    crate::memory::limit_arenas(workers);
    let set_log_filter = init_logging();
    let (cfg, catalog) = match load(path) {
        Ok(v) => v,
        Err(errors) => {
            for e in errors {
                eprintln!("error: {e}");
            }
            return ExitCode::FAILURE;
        }
    };
    // One worker: the current-thread scheduler. Accept loops and connections then share the one
    // thread (the multi-thread scheduler keeps `block_on` on the main thread and wakes across),
    // and no work-stealing queue sits between a wake and its poll. linkerd2-proxy does the same.
    let mut builder = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(workers);
        b
    };
    // The runtime's threads reuse freed medium blocks (`memory`); with one worker, that is the
    // main thread, which runs `block_on`.
    builder
        .on_thread_start(crate::memory::reuse_medium_blocks)
        .on_thread_stop(crate::memory::release_medium_blocks);
    if workers == 1 {
        crate::memory::reuse_medium_blocks();
    }
    let rt = match builder.thread_name("aether-worker").enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = rt.block_on(serve(Arc::new(cfg), catalog, set_log_filter));
    crate::accesslog::flush_at_exit(std::time::Duration::from_secs(1));
    // Connections still open past drain.timeout are abandoned, not waited for.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    code
}

/// Where the DNS listener finds the pod's own resolvers.
const RESOLV_CONF: &str = "/etc/resolv.conf";

/// Asked of `listen(2)`; the kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 65535;

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    let err = |step| {
        move |source| StartError::Listener {
            what,
            addr,
            step,
            source,
        }
    };
    let sock = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(err("socket"))?;
    sock.set_reuseaddr(true).map_err(err("socket"))?;
    // Accepted connections inherit these: the data path sets nothing per connection.
    crate::sockets::tune_listener(&sock);
    sock.bind(addr).map_err(err("cannot bind"))?;
    // The kernel takes the smaller of this and `net.core.somaxconn` (4096 by default), so the
    // node's setting decides the accept queue, as with Envoy: a burst of new connections
    // (a client opening thousands a second) then queues instead of overflowing into SYN
    // cookies, which 1024 did under such a burst.
    sock.listen(LISTEN_BACKLOG).map_err(err("cannot listen"))
}

/// With `dns.ipv6`, the pod's ip6tables rules redirect IPv6 connections to `[::1]` on the
/// outbound port (REDIRECT of locally made traffic goes to loopback), so the outbound side
/// listens there too, unless its configured address is IPv6 already.
fn ipv6_outbound(cfg: &Config) -> Option<SocketAddr> {
    let ipv6 = cfg.dns.as_ref().is_some_and(|d| d.ipv6);
    let listen = cfg.outbound.listen;
    (ipv6 && listen.is_ipv4())
        .then(|| SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, listen.port())))
}

/// The DNS listener's two sockets, on one address.
async fn bind_dns(addr: SocketAddr) -> Result<(tokio::net::UdpSocket, TcpListener), StartError> {
    let udp = tokio::net::UdpSocket::bind(addr)
        .await
        .map_err(|source| StartError::Listener {
            what: "dns",
            addr,
            step: "cannot bind udp",
            source,
        })?;
    Ok((udp, bind("dns", addr).await?))
}

/// Creates every subsystem's metric families, so each is in /metrics from the first scrape,
/// whatever is configured and whether or not the subsystem has done anything yet.
fn register_metrics() {
    crate::outbound::metrics::metrics();
    crate::drain::metrics();
    crate::memory::metrics::metrics();
    crate::accesslog::metrics::metrics();
    crate::admin::metrics();
    crate::identity::metrics::metrics();
    crate::http::metrics::metrics();
    crate::catalog::metrics::metrics();
    crate::overload::metrics();
    crate::dns::metrics::metrics();
    crate::trace::metrics::metrics();
    crate::xds::metrics::metrics();
}

/// Binds every listener and starts serving; any failure here is a start-up error. With SDS,
/// the admin listener serves (not ready) while the first identity is awaited; the data
/// listeners are bound once it has arrived.
async fn start(
    cfg: Arc<Config>,
    catalog: Option<Catalog>,
    set_log_filter: SetLogFilter,
) -> Result<Running, StartError> {
    register_metrics();
    let drain = Drain::default();
    let tracker = Tracker::default();
    let admin = Arc::new(Admin {
        drain: drain.clone(),
        bound: Default::default(),
        listeners: ListenerCheck::new(cfg.readiness.required_listeners.clone()),
        set_log_filter,
        views: Default::default(),
        explain: Default::default(),
        before_scrape: Default::default(),
    });
    let admin_listener = bind("admin", cfg.admin.listen)
        .await?
        .into_std()
        .map_err(|source| StartError::Listener {
            what: "admin",
            addr: cfg.admin.listen,
            step: "detach",
            source,
        })?;
    let health_listener = match &cfg.health {
        Some(h) => Some(
            bind("health", h.listen)
                .await?
                .into_std()
                .map_err(|source| StartError::Listener {
                    what: "health",
                    addr: h.listen,
                    step: "detach",
                    source,
                })?,
        ),
        None => None,
    };
    {
        // Its own thread and runtime: scrapes and probes never queue behind data-path work.
        let admin = admin.clone();
        std::thread::Builder::new()
            .name("aether-admin".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(rt) = rt {
                    rt.block_on(async move {
                        if let Some(Ok(l)) = health_listener.map(TcpListener::from_std) {
                            tokio::spawn(admin.clone().serve(l, true));
                        }
                        if let Ok(l) = TcpListener::from_std(admin_listener) {
                            admin.serve(l, false).await;
                        }
                    });
                }
            })
            .map_err(StartError::AdminThread)?;
    }
    let identity = match &cfg.identity.sds {
        None => IdentityStore::load(cfg.identity_spec())?,
        Some(addr) => {
            tracing::info!(sds = %addr, "waiting for the workload identity");
            let xds = cfg.discovery.as_ref().map(|d| &d.xds);
            let node = crate::xds::node::build(&cfg, xds, None);
            crate::xds::sds::spawn(addr.clone(), cfg.identity_spec(), node)
                .await
                .map_err(|_| StartError::NoIdentity)?
        }
    };
    let catalog = Arc::new(CatalogStore::new(catalog.unwrap_or_else(|| Catalog {
        on_demand: cfg.discovery.as_ref().map(|d| crate::catalog::OnDemand {
            timeout: d.xds.cluster_timeout,
            absent: Default::default(),
        }),
        ..Default::default()
    })));
    crate::trace::start(&cfg.tracing, &identity.current().identity.spiffe_id);
    let inbound = Arc::new(Inbound::new(
        &cfg,
        identity.clone(),
        drain.clone(),
        tracker.clone(),
    ));
    let outbound = Arc::new(Outbound::new(
        &cfg,
        catalog.clone(),
        identity.clone(),
        drain.clone(),
        tracker.clone(),
    ));
    let xds = cfg
        .discovery
        .as_ref()
        .map(|d| crate::xds::session::Ads::new(&cfg, &d.xds, catalog.clone(), identity.clone()));
    let _ = admin.views.set(admin_views(
        &cfg,
        &catalog,
        &outbound.clusters,
        &identity,
        xds.as_ref().map(|x| x.status.clone()),
    ));
    let _ = admin.explain.set({
        let outbound = outbound.clone();
        Box::new(move |query: &str| {
            let q = crate::outbound::explain::Question::from_query(query)?;
            Ok(crate::outbound::explain::explain(&outbound, &q))
        })
    });
    runtime_tasks();
    let _ = admin.before_scrape.set({
        let identity = identity.clone();
        // Scrapes run on the admin thread's runtime; the count is the data path's.
        let data_runtime = tokio::runtime::Handle::current();
        Box::new(move || {
            use crate::identity::expiry::{seconds_left, unix_now, Kind};
            let current = identity.current();
            let now = unix_now();
            for kind in [Kind::Workload, Kind::Trust] {
                if let Some(left) = seconds_left(&current.identity.certs, kind, now) {
                    let cert = kind.as_str();
                    crate::identity::metrics::metrics()
                        .certificate_expiry
                        .get_or_create(&crate::identity::metrics::CertLabels { cert })
                        .set(left);
                }
            }
            if let Some(rss) = crate::memory::resident_bytes() {
                let rss = i64::try_from(rss).unwrap_or(i64::MAX);
                crate::memory::metrics::metrics().resident_memory.set(rss);
            }
            let tasks = data_runtime.metrics().num_alive_tasks();
            runtime_tasks().set(i64::try_from(tasks).unwrap_or(i64::MAX));
        })
    });
    if cfg.overload.enabled {
        let o = &cfg.overload;
        let thresholds = crate::overload::Thresholds {
            shed_at: o.shed_at,
            close_at: o.close_at,
            resume_gap: o.resume_gap,
        };
        crate::overload::start(
            o.memory_limit,
            thresholds,
            vec![
                {
                    let pool = outbound.upstream.pool.clone();
                    Box::new(move || pool.release_idle())
                },
                {
                    let pool = inbound.http.app_pool.clone();
                    Box::new(move || pool.release_idle())
                },
            ],
        );
    } else {
        tracing::info!("overload actions off (overload.enabled: false)");
    }
    let inbound_listener = bind("inbound", cfg.inbound.listen).await?;
    let mut outbound_listeners = vec![bind("outbound", cfg.outbound.listen).await?];
    if let Some(v6) = ipv6_outbound(&cfg) {
        outbound_listeners.push(bind("outbound", v6).await?);
    }
    let mut listeners = vec![
        tokio::spawn(inbound.serve(inbound_listener)),
        tokio::spawn(outbound.serve(outbound_listeners)),
    ];
    if let Some(d) = &cfg.dns {
        let (udp, tcp) = bind_dns(d.listen).await?;
        let resolv_conf = std::fs::read_to_string(RESOLV_CONF).unwrap_or_default();
        let dns = Arc::new(crate::dns::Dns::new(
            &cfg.mesh_domain,
            d.ipv6,
            d.listen,
            &resolv_conf,
            catalog.clone(),
        ));
        // A pod's resolv.conf rarely changes after start, a node's often does (DHCP,
        // NetworkManager, systemd-resolved): the relay follows it.
        let watched = dns.clone();
        crate::watch::spawn("resolv-conf", vec![RESOLV_CONF.into()], move || {
            watched.set_resolv_conf(&std::fs::read_to_string(RESOLV_CONF).unwrap_or_default());
        });
        listeners.push(tokio::spawn(dns.serve(
            udp,
            tcp,
            drain.clone(),
            tracker.clone(),
        )));
    }
    // A catalog change frees the previous services and clusters: hand the free pages back.
    let mut changed = catalog.subscribe();
    tokio::spawn(async move {
        while changed.changed().await.is_ok() {
            crate::memory::trim_soon();
        }
    });
    match (xds, &cfg.catalog) {
        (Some(xds), _) => xds.spawn(),
        (None, Some(c)) => {
            crate::catalog::file::watch(c.path.clone(), cfg.trust_domain.clone(), catalog)
        }
        (None, None) => {}
    }
    if cfg.identity.sds.is_none() {
        watch_identity(identity.clone());
    }
    admin.bound.store(true, Ordering::Release);
    tracing::info!(
        inbound = %cfg.inbound.listen,
        outbound = %cfg.outbound.listen,
        admin = %cfg.admin.listen,
        dns = ?cfg.dns.as_ref().map(|d| d.listen),
        identity = %identity.current().identity.spiffe_id,
        "aether-proxy serving"
    );
    Ok(Running {
        drain,
        tracker,
        listeners,
    })
}

/// What `start` leaves running.
struct Running {
    drain: Drain,
    tracker: Tracker,
    listeners: Vec<tokio::task::JoinHandle<()>>,
}

async fn serve(
    cfg: Arc<Config>,
    catalog: Option<Catalog>,
    set_log_filter: SetLogFilter,
) -> ExitCode {
    let Running {
        drain,
        tracker,
        listeners,
    } = match start(cfg.clone(), catalog, set_log_filter).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::spawn(signals(drain.clone()));
    Drain::reached(drain.watch(), Phase::Notifying).await;
    tracing::info!(notify = ?cfg.drain.notify, "drain: reporting not ready, still serving");
    tokio::time::sleep(cfg.drain.notify).await;
    drain.advance(Phase::Closing);
    for l in listeners {
        let _ = l.await;
    }
    tracing::info!(open = tracker.open(), timeout = ?cfg.drain.timeout, "drain: listeners closed, waiting for in-flight work");
    let deadline = tokio::time::Instant::now() + cfg.drain.timeout;
    let left = tracker.wait_idle(cfg.drain.timeout).await;
    if left > 0 {
        tracing::warn!(open = left, "drain timeout reached; closing what is left");
        // Tunnels end now and leave their access-log lines (end_reason "drain").
        drain.advance(Phase::Cut);
        tracker
            .wait_idle(std::time::Duration::from_millis(200))
            .await;
    } else {
        tracing::info!("drain complete");
    }
    // Spans of the last requests would otherwise wait for their batch and go with the process.
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    if !crate::trace::flush(left.max(std::time::Duration::from_millis(200))).await {
        tracing::warn!("drain: spans still queued could not be sent in time");
    }
    ExitCode::SUCCESS
}

/// Rotates the identity on change of any of its files. A half-written or invalid set keeps
/// the previous identity; each distinct error is logged once.
fn watch_identity(identity: Arc<IdentityStore>) {
    let paths = identity.spec().files();
    let mut last_error: Option<String> = None;
    crate::watch::spawn("identity", paths, move || {
        let m = crate::identity::metrics::metrics();
        match identity.reload() {
            Ok(()) => {
                let _ = m
                    .identity_reloads
                    .get_or_create(&ResultLabels { result: "ok" })
                    .inc();
                last_error = None;
            }
            Err(e) => {
                let _ = m
                    .identity_reloads
                    .get_or_create(&ResultLabels { result: "error" })
                    .inc();
                let msg = e.to_string();
                if last_error.as_deref() != Some(msg.as_str()) {
                    tracing::error!("identity reload failed; keeping the current identity: {msg}");
                    last_error = Some(msg);
                }
            }
        }
    });
}

/// `/config_dump` and `/clusters`.
fn admin_views(
    cfg: &Arc<Config>,
    catalog: &Arc<CatalogStore>,
    clusters: &Arc<Clusters>,
    identity: &Arc<IdentityStore>,
    xds: Option<Arc<std::sync::Mutex<crate::xds::session::Status>>>,
) -> Vec<(&'static str, crate::admin::View)> {
    let c = clusters.clone();
    let clusters_view: crate::admin::View = Box::new(move || c.to_json());
    let id = identity.clone();
    let certs_view: crate::admin::View = Box::new(move || {
        let current = id.current();
        let certs: Vec<_> = current.identity.certs.iter().map(|c| c.to_json()).collect();
        serde_json::to_vec(&serde_json::json!({ "certificates": certs })).unwrap_or_default()
    });
    let (cfg, catalog, c, identity) = (
        cfg.clone(),
        catalog.clone(),
        clusters.clone(),
        identity.clone(),
    );
    let dump: crate::admin::View = Box::new(move || {
        let id = identity.current();
        // Keys in sorted order, as a `serde_json::Value` map writes them; the clusters are
        // serialized as they are written (`outbound::cluster::ClusterList`).
        #[derive(serde::Serialize)]
        struct Dump<'a> {
            catalog: serde_json::Value,
            clusters: crate::outbound::cluster::ClusterList<'a>,
            config: serde_json::Value,
            xds: Option<serde_json::Value>,
        }
        let config = serde_json::json!({
                "mesh_domain": cfg.mesh_domain,
                "trust_domain": cfg.trust_domain,
                "locality": cfg.locality.as_ref().map(|l| l.to_string()),
                "identity": {
                    "cert": cfg.identity.cert, "key": cfg.identity.key, "ca": cfg.identity.ca,
                    "sds": cfg.identity.sds.as_ref().map(|a| a.to_string()),
                    "spiffe_id": id.identity.spiffe_id, "serial": id.identity.serial,
                },
                "source_identities": cfg.source_identities.iter().map(|s| serde_json::json!({
                    "source": s.source.to_string(), "cert": s.cert, "key": s.key,
                })).collect::<Vec<_>>(),
                "inbound": {
                    "listen": cfg.inbound.listen.to_string(),
                    "app_host": cfg.inbound.app_host.to_string(),
                    "default_port": cfg.inbound.default_port,
                    "ports": cfg.inbound.ports.iter().map(|p| serde_json::json!({
                        "port": p.port, "protocol": p.protocol.as_str(), "allow": p.allow,
                    })).collect::<Vec<_>>(),
                },
                "outbound": {
                    "listen": cfg.outbound.listen.to_string(),
                    "listen_ipv6": ipv6_outbound(&cfg).map(|a| a.to_string()),
                    "egress": cfg.outbound.egress.as_str(),
                },
                "dns": cfg.dns.as_ref().map(|d| serde_json::json!({
                    "listen": d.listen.to_string(), "ipv6": d.ipv6,
                })),
                "admin": { "listen": cfg.admin.listen.to_string() },
                "readiness": { "required_listeners": cfg.readiness.required_listeners },
                "catalog": { "path": cfg.catalog.as_ref().map(|c| &c.path) },
                "discovery": cfg.discovery.as_ref().map(|d| serde_json::json!({
                    "xds": {
                        "address": d.xds.address.to_string(),
                        "cluster_timeout": humantime::format_duration(d.xds.cluster_timeout).to_string(),
                        "idle": humantime::format_duration(d.xds.idle).to_string(),
                    }
                })),
                "drain": {
                    "notify": humantime::format_duration(cfg.drain.notify).to_string(),
                    "timeout": humantime::format_duration(cfg.drain.timeout).to_string(),
                },
        });
        let catalog_json = serde_json::json!({
            "version": catalog.version(),
            "services": catalog.load().services.keys().collect::<Vec<_>>(),
            // Where captured apps reach each service (SPEC section 10).
            "virtual_ips": virtual_ips(&catalog),
        });
        let xds = xds.as_ref().map(|x| {
            serde_json::to_value(&*x.lock().unwrap_or_else(|e| e.into_inner())).unwrap_or_default()
        });
        let clusters = c.snapshot();
        serde_json::to_vec(&Dump {
            catalog: catalog_json,
            clusters: crate::outbound::cluster::ClusterList(&clusters),
            config,
            xds,
        })
        .unwrap_or_default()
    });
    vec![
        ("/clusters", clusters_view),
        ("/config_dump", dump),
        ("/certs", certs_view),
    ]
}

/// Each service's virtual address, for `/config_dump`.
fn virtual_ips(catalog: &CatalogStore) -> serde_json::Map<String, serde_json::Value> {
    let now = catalog.load();
    now.services
        .keys()
        .filter_map(|n| Some((n.clone(), now.vips.v4(n)?.to_string().into())))
        .collect()
}

async fn signals(drain: Drain) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: starting drain"),
        _ = int.recv() => tracing::info!("SIGINT: starting drain"),
    }
    drain.advance(Phase::Notifying);
}

/// `aether_runtime_tasks`: tasks alive on the data-path runtime, set when scraped. A count
/// that only grows under steady traffic is a leak (a soak watches it).
fn runtime_tasks() -> &'static prometheus_client::metrics::gauge::Gauge {
    static TASKS: std::sync::OnceLock<prometheus_client::metrics::gauge::Gauge> =
        std::sync::OnceLock::new();
    TASKS.get_or_init(|| {
        let g = prometheus_client::metrics::gauge::Gauge::default();
        crate::metrics::register(|registry| {
            registry.register(
                "aether_runtime_tasks",
                "Tasks alive on the data-path runtime, read when scraped",
                g.clone(),
            );
        });
        g
    })
}
