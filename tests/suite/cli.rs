//! The command line as an operator meets it: `check` on good and broken files, `run` refusing
//! bad input with exit 1 and a clear message, never a panic.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};

use crate::common::{Net, PodNet};

const BIN: &str = env!("CARGO_BIN_EXE_aether-proxy");

fn aether(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn check_accepts_the_example_configs() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    for cfg in [
        "configs/payments.yaml",
        "configs/frontend.yaml",
        "configs/frontend-xds.yaml",
    ] {
        let o = aether(repo, &["check", "--config", cfg]);
        assert!(o.status.success(), "{cfg}: {}", stderr(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(": ok ("),
            "{cfg}"
        );
    }
}

/// A temp dir holding the repository's test certificates and the given files.
fn setup(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir(dir.path().join("certs")).unwrap();
    for f in [
        "ca.crt",
        "payments.crt",
        "payments.key",
        "orders.crt",
        "orders.key",
    ] {
        std::fs::copy(repo.join("certs").join(f), dir.path().join("certs").join(f)).unwrap();
    }
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

const GOOD_CATALOG: &str = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    endpoints: [{ address: 127.0.0.2 }]\n";
const IDENTITY: &str =
    "identity: { cert: certs/payments.crt, key: certs/payments.key, ca: certs/ca.crt }\n";

fn config(rest: &str) -> String {
    format!("{IDENTITY}catalog: {{ path: catalog.yaml }}\n{rest}")
}

#[test]
fn check_reports_every_config_error_with_file_and_field() {
    let cfg = config(
        "inbound:\n  default_port: 8081\n  ports:\n    - { port: 8080, protocol: auto }\n    - { port: 8080, protocol: h2 }\n",
    );
    let dir = setup(&[("bad.yaml", &cfg), ("catalog.yaml", GOOD_CATALOG)]);
    let o = aether(dir.path(), &["check", "--config", "bad.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("error: bad.yaml: inbound.ports[1].port: duplicate port 8080"),
        "{e}"
    );
    assert!(
        e.contains("error: bad.yaml: inbound.default_port: default port 8081 is not listed"),
        "{e}"
    );
    assert!(!e.contains("panicked"), "{e}");
}

#[test]
fn check_names_the_catalog_file_and_field() {
    let bad = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://elsewhere/ns/default/sa/payments\n";
    let dir = setup(&[("cfg.yaml", &config("")), ("catalog.yaml", bad)]);
    let o = aether(dir.path(), &["check", "--config", "cfg.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("error: catalog.yaml: services.payments.identity: "),
        "{e}"
    );
    assert!(e.contains("outside the trust domain"), "{e}");
}

/// A circuit breaker of 0 would refuse every request: refused, naming the field.
#[test]
fn check_refuses_a_zero_circuit_breaker() {
    let bad = "services:\n  payments:\n    default_port: 8080\n    identity: spiffe://aether.local/ns/default/sa/payments\n    circuit_breakers: { max_connections: 0 }\n";
    let dir = setup(&[("cfg.yaml", &config("")), ("catalog.yaml", bad)]);
    let o = aether(dir.path(), &["check", "--config", "cfg.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("error: catalog.yaml: services.payments.circuit_breakers.max_connections: must be at least 1"),
        "{e}"
    );
}

#[test]
fn check_refuses_missing_files_and_broken_yaml() {
    let dir = setup(&[("cfg.yaml", &config("")), ("broken.yaml", "inbound: [\n")]);
    // The catalog file does not exist.
    let o = aether(dir.path(), &["check", "--config", "cfg.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("catalog.yaml: cannot read"),
        "{}",
        stderr(&o)
    );
    let o = aether(dir.path(), &["check", "--config", "broken.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: broken.yaml: "),
        "{}",
        stderr(&o)
    );
    let o = aether(dir.path(), &["check", "--config", "nope.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("nope.yaml: cannot read"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn check_refuses_an_identity_that_does_not_hold_together() {
    // The orders key with the payments certificate.
    let cfg = "identity: { cert: certs/payments.crt, key: certs/orders.key, ca: certs/ca.crt }\ncatalog: { path: catalog.yaml }\n";
    let dir = setup(&[("cfg.yaml", cfg), ("catalog.yaml", GOOD_CATALOG)]);
    let o = aether(dir.path(), &["check", "--config", "cfg.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("the key does not match the certificate"),
        "{}",
        stderr(&o)
    );
    // A certificate outside the configured trust domain.
    let cfg = format!("trust_domain: other.td\n{cfg}").replace("orders.key", "payments.key");
    let dir = setup(&[("cfg.yaml", &cfg), ("catalog.yaml", "")]);
    let o = aether(dir.path(), &["check", "--config", "cfg.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no single SPIFFE URI SAN in trust domain \"other.td\""),
        "{}",
        stderr(&o)
    );
}

#[test]
fn run_refuses_bad_input_with_exit_1_and_no_panic() {
    let dir = setup(&[("bad.yaml", "inbound: {bogus: 1}\n")]);
    let o = aether(dir.path(), &["run", "--config", "bad.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("bad.yaml"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
}

#[test]
fn run_reports_a_listener_it_cannot_bind() {
    let host = Net::fresh().pod(0).app_host();
    let taken = std::net::TcpListener::bind(SocketAddr::new(host, 0)).unwrap();
    let addr = taken.local_addr().unwrap();
    let cfg = config(&format!(
        "inbound: {{ listen: \"{addr}\" }}\noutbound: {{ listen: {host}:0 }}\nadmin: {{ listen: {host}:0 }}\n"
    ));
    let dir = setup(&[("cfg.yaml", &cfg), ("catalog.yaml", GOOD_CATALOG)]);
    let o = aether(dir.path(), &["run", "--config", "cfg.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains(&format!("inbound {addr}: cannot bind")), "{e}");
}

/// `AETHER_ALLOC_CACHE=off` turns the medium-block reuse off as the runtime starts, and the
/// log says so; a value it does not know is logged and ignored (docs/behaviour.md).
#[cfg(not(feature = "jemalloc"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_alloc_cache_switch_is_read_at_start_and_said_in_the_log() {
    let net = Net::fresh();
    let certs = crate::common::Certs::new("aether.local", &["default/payments"]);
    for (i, (value, said)) in [
        (
            "off",
            "AETHER_ALLOC_CACHE=off: freed medium blocks go straight back",
        ),
        ("nope", "AETHER_ALLOC_CACHE=\"nope\" ignored (on or off)"),
    ]
    .into_iter()
    .enumerate()
    {
        let pod = net.pod(i as u8);
        let config = format!(
            "{}{}",
            certs.identity_yaml("payments"),
            pod.listeners_yaml(8080, &[])
        );
        let proxy = crate::common::Proxy::builder(&config, "services: {}\n")
            .env("AETHER_ALLOC_CACHE", value)
            .start()
            .await;
        assert_eq!(
            proxy.admin_get("/readyz").await.unwrap().status.as_u16(),
            200
        );
        let log = proxy.stderr();
        assert!(log.contains(said), "{value}: {log}");
    }
}

/// Built with jemalloc, `run` leaves glibc's tunables alone: no restart.
#[cfg(feature = "jemalloc")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_jemalloc_does_not_restart_itself() {
    let net = Net::fresh();
    let certs = crate::common::Certs::new("aether.local", &["default/payments"]);
    let pod = net.pod(0);
    let config = sidecar_config(&certs, pod);
    let proxy = crate::common::Proxy::start(&config, "services: {}\n").await;
    let env = environ(proxy.pid().unwrap());
    assert!(
        !env.iter().any(|v| v.starts_with("AETHER_MALLOC_TUNED")),
        "{env:?}"
    );
    assert_eq!(
        proxy.admin_get("/readyz").await.unwrap().status.as_u16(),
        200
    );
}

/// `pod`'s sidecar config: payments' identity and listeners, app on 8080.
fn sidecar_config(certs: &crate::common::Certs, pod: PodNet) -> String {
    format!(
        "{}{}",
        certs.identity_yaml("payments"),
        pod.listeners_yaml(8080, &[])
    )
}

/// The variables of a running process's environment.
fn environ(pid: u32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).expect("/proc/<pid>/environ");
    raw.split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

/// `run` starts itself again, once, with glibc's thread cache enlarged (docs/decisions/0002-allocator.md,
/// `memory::tune_allocator`): the same pid serves, with the tunable in its environment. An
/// operator's own `tcache_count` is kept as they set it, and the step is skipped.
#[cfg(not(feature = "jemalloc"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_enlarges_the_allocators_thread_cache_and_keeps_an_operators_choice() {
    let net = Net::fresh();
    let certs = crate::common::Certs::new("aether.local", &["default/payments"]);
    let pod = net.pod(0);
    let config = sidecar_config(&certs, pod);
    let proxy = crate::common::Proxy::start(&config, "services: {}\n").await;
    let env = environ(proxy.pid().unwrap());
    assert!(
        env.iter()
            .any(|v| v == "GLIBC_TUNABLES=glibc.malloc.tcache_count=1024"),
        "{env:?}"
    );
    assert!(env.iter().any(|v| v == "AETHER_MALLOC_TUNED=1"), "{env:?}");
    assert_eq!(
        proxy.admin_get("/readyz").await.unwrap().status.as_u16(),
        200
    );
    drop(proxy);

    let pod = net.pod(1);
    let config = sidecar_config(&certs, pod);
    let proxy = crate::common::Proxy::builder(&config, "services: {}\n")
        .env("GLIBC_TUNABLES", "glibc.malloc.tcache_count=7")
        .start()
        .await;
    let env = environ(proxy.pid().unwrap());
    assert!(
        env.iter()
            .any(|v| v == "GLIBC_TUNABLES=glibc.malloc.tcache_count=7"),
        "{env:?}"
    );
    assert!(
        !env.iter().any(|v| v.starts_with("AETHER_MALLOC_TUNED")),
        "{env:?}"
    );
}
