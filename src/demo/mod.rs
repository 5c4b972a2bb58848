//! `aether-proxy demo`: a complete mesh on loopback. Two `payments` pods (v1 serves 8080; v2
//! serves 8080, gRPC-style h2c on 9090 and raw TCP on 5432), a `frontend` client pod, their
//! sidecars as real child processes, demo apps served by this process, and a first round of
//! requests through the mesh so the addressing table is visible at once. With `--load`, traffic
//! of every kind for a set time after that (`load`), then the demo ends; with `--chaos` as well,
//! faults are injected meanwhile on a printed schedule (`chaos`). The mesh itself, and what
//! the faults do to it, is `mesh`.

mod apps;
mod chaos;
mod load;
mod mesh;

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use mesh::{get, start, CLIENT_ADMIN, CLIENT_OUTBOUND, PODS};

/// `load`: seconds of traffic after the first requests, then stop (instead of waiting for
/// Ctrl-C); the exit status says whether every request and tunnel succeeded (with `chaos`,
/// whether every failure was one an injected fault explains).
pub fn main(load: Option<u64>, chaos: bool) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dir = std::env::temp_dir().join(format!("aether-demo-{}", std::process::id()));
    let code = rt.block_on(run(&dir, load, chaos));
    let _ = std::fs::remove_dir_all(&dir);
    code
}

async fn run(dir: &Path, load: Option<u64>, chaos: bool) -> ExitCode {
    let mesh = match start(dir, chaos).await {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Listening before saying "Ctrl-C stops the demo": a signal sent on reading that line
    // must stop the demo, not kill it.
    let stop = stop_signals();
    println!("aether-proxy demo: a frontend pod calls two payments pods through their sidecars.\n");
    println!("  frontend sidecar   outbound {CLIENT_OUTBOUND}   admin http://{CLIENT_ADMIN}");
    for p in &PODS {
        println!(
            "  {} sidecar  inbound {}:15008   apps {} ports {:?}",
            p.name, p.proxy, p.apps, p.ports
        );
    }
    println!("\nFirst requests through the mesh:");
    for (host, path) in [
        ("payments.aether.internal", "/"),
        ("payments.aether.internal:8080", "/"),
        ("payments.aether.internal:9090", "/"),
        ("payments.aether.internal:7777", "/"),
        ("ghost.aether.internal", "/"),
        ("evil.com", "/"),
    ] {
        println!("  {:<34} {}", host, probe(host, path).await);
    }
    println!(
        "  {:<34} {}",
        "CONNECT payments...:5432 (echo)",
        connect_probe().await
    );
    if let Some(secs) = load {
        let clean = if chaos {
            chaos::run(mesh, CLIENT_OUTBOUND, secs).await
        } else {
            let clean = load::run(CLIENT_OUTBOUND, secs).await;
            drop(mesh);
            clean
        };
        return if clean {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    println!(
        "\nTry it yourself:\n  curl -H 'Host: payments.aether.internal:9090' http://{CLIENT_OUTBOUND}/\n  curl --http2-prior-knowledge http://{CLIENT_OUTBOUND}/ -H 'Host: payments.aether.internal:9090'\n  curl http://{CLIENT_ADMIN}/clusters\n  curl http://{CLIENT_ADMIN}/metrics\n  openssl s_client -connect {}:15008 -servername 9090 -alpn h2 -cert {c}/frontend.crt -key {c}/frontend.key -CAfile {c}/ca.crt\n\nCtrl-C stops the demo.",
        PODS[1].proxy,
        c = dir.join("certs").display()
    );
    wait_for_stop(stop).await;
    println!("stopping");
    drop(mesh);
    ExitCode::SUCCESS
}

type Signals = Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>;

/// SIGINT and SIGTERM, listened for from now on.
fn stop_signals() -> Signals {
    use tokio::signal::unix::{signal, SignalKind};
    Some((
        signal(SignalKind::interrupt()).ok()?,
        signal(SignalKind::terminate()).ok()?,
    ))
}

async fn wait_for_stop(signals: Signals) {
    match signals {
        Some((mut int, mut term)) => tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        },
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn probe(host: &str, path: &str) -> String {
    match get(CLIENT_OUTBOUND, path, host).await {
        Ok((status, reason, _)) if !reason.is_empty() => format!("-> {status} {reason}"),
        Ok((status, _, body)) => {
            let short = body
                .split(", x-forwarded")
                .next()
                .unwrap_or(&body)
                .to_string();
            format!("-> {status} {short}")
        }
        Err(e) => format!("-> failed: {e}"),
    }
}

async fn connect_probe() -> String {
    let attempt = async {
        let mut tcp = TcpStream::connect(CLIENT_OUTBOUND).await?;
        tcp.write_all(
            b"CONNECT payments.aether.internal:5432 HTTP/1.1\r\nHost: payments.aether.internal:5432\r\n\r\n",
        )
        .await?;
        let mut head = [0u8; 1024];
        let n = tcp.read(&mut head).await?;
        let head = String::from_utf8_lossy(&head[..n]).to_string();
        if !head.starts_with("HTTP/1.1 200") {
            return Ok::<_, std::io::Error>(format!("-> {}", head.lines().next().unwrap_or("")));
        }
        tcp.write_all(b"ping through the tunnel").await?;
        tcp.shutdown().await?;
        let mut echo = String::new();
        tcp.read_to_string(&mut echo).await?;
        Ok(format!("-> 200, echoed {echo:?}"))
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => format!("-> failed: {e}"),
        Err(_) => "-> timed out".into(),
    }
}
