//! `aether-proxy demo --load SECONDS --chaos`: the demo's traffic of every kind while faults
//! are injected on a fixed, printed schedule, with every failure accounted for.
//!
//! A fault explains a failure only when the failure falls inside the fault's window (from its
//! start to a short grace after its end) and its class is one that fault can cause: a sidecar
//! restart may refuse connections, it may not corrupt an echo. Whatever no fault explains is
//! counted as unexplained, and any such failure fails the soak. Meanwhile each sidecar's
//! resident memory, open files and live tasks are sampled; over a long enough run the last
//! ten minutes must be flat for the sidecars that were never restarted.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::load::{Failure, Load};
use super::mesh::{get, wait_ready, Mesh, CLIENT_OUTBOUND, PODS, ROLLOUT_PORT};

/// The schedule repeats every cycle.
const CYCLE: Duration = Duration::from_secs(60);
/// A failure this long after a fault ended is still its doing (clients notice late).
const GRACE: Duration = Duration::from_secs(3);
/// How often the sidecars' resources are read.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// The stretch at the end of a run whose resources must be flat, once the run is long enough.
const FLAT_WINDOW: Duration = Duration::from_secs(600);

/// payments-v1's sidecar, by index in `Mesh::sidecars` (the frontend's is 0, v2's 2).
const V1: usize = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Rollout,
    SidecarRestart,
    AppRestart,
    CertRotation,
    ControlPlaneRestart,
    Abuse,
}

impl Fault {
    const ALL: [Fault; 6] = [
        Fault::Rollout,
        Fault::SidecarRestart,
        Fault::AppRestart,
        Fault::CertRotation,
        Fault::ControlPlaneRestart,
        Fault::Abuse,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::Rollout => "rollout",
            Fault::SidecarRestart => "sidecar",
            Fault::AppRestart => "app",
            Fault::CertRotation => "certs",
            Fault::ControlPlaneRestart => "control",
            Fault::Abuse => "abuse",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Fault::Rollout => "rollout: the catalog the control plane serves drops v1 and gives v2 port 8081; v1 drains (SIGTERM), restarts, and the catalog rolls back",
            Fault::SidecarRestart => "sidecar: payments-v1's sidecar SIGTERMed, then started again",
            Fault::AppRestart => "app: payments-v1's app on 8080 killed (port closed, connections dropped), started again 3 s later",
            Fault::CertRotation => "certs: every workload certificate re-issued from the same CA",
            Fault::ControlPlaneRestart => "control: the control plane SIGKILLed, started again 3 s later; every sidecar must reconnect",
            Fault::Abuse => "abuse: slowloris (100 connections, a byte a second, for up to 12 s) and 6 s of rapid reset (4 h2c connections) at the frontend",
        }
    }

    /// Offset of the fault within a cycle.
    fn offset(self) -> Duration {
        Duration::from_secs(match self {
            Fault::Rollout => 5,
            Fault::SidecarRestart => 14,
            Fault::AppRestart => 23,
            Fault::CertRotation => 32,
            Fault::ControlPlaneRestart => 41,
            Fault::Abuse => 46,
        })
    }

    /// How long the fault needs to run its course while traffic still flows.
    fn needs(self) -> Duration {
        Duration::from_secs(match self {
            Fault::Abuse => 14,
            _ => 8,
        })
    }

    /// The failure classes this fault can cause (see `load::Fail`).
    fn explains(self, class: &str) -> bool {
        match self {
            // A stopped sidecar refuses connections until it is back: the frontend tries
            // another endpoint, but a request can meet the refusal on every try; a session
            // it carried (WebSocket, a tunnel) ends when its drain does.
            // A request written on a pooled HTTP/1 connection just as the draining sidecar
            // closes it cannot be told from one it lost, so one that is not retried (an
            // upgrade) gets 502 upstream-protocol-error.
            Fault::SidecarRestart | Fault::Rollout => matches!(
                class,
                "503 upstream-connect-failure"
                    | "502 upstream-protocol-error"
                    | "503 no-healthy-upstream"
                    | "websocket cut"
                    | "tunnel cut"
            ),
            // The app's port is closed: its sidecar answers for it; what was in flight on a
            // dropped connection is cut.
            Fault::AppRestart => matches!(
                class,
                "503 app-unavailable"
                    | "502 upstream-protocol-error"
                    | "503 no-healthy-upstream"
                    | "websocket cut"
                    | "body cut"
            ),
            // Neither may cost a single request.
            Fault::CertRotation | Fault::ControlPlaneRestart | Fault::Abuse => false,
        }
    }
}

/// Each sidecar's name, pid (while it runs) and admin address.
type Pids = Arc<Mutex<Vec<(String, Option<u32>, String)>>>;

/// When a fault was in force.
struct Window {
    fault: Fault,
    from: Instant,
    to: Instant,
}

/// One reading of a sidecar's resources.
#[derive(Clone, Copy)]
struct Sample {
    at: Duration,
    rss: u64,
    fds: u64,
    tasks: Option<u64>,
}

/// Every reading, per sidecar name; a restart starts a new life.
#[derive(Default)]
struct Samples {
    lives: BTreeMap<String, Vec<Vec<Sample>>>,
}

/// What the soak observed besides the traffic.
#[derive(Default)]
struct Findings {
    /// (sidecar, exit code) of every drain.
    drains: Vec<(String, Option<i32>)>,
    /// What a fault itself checks and found wrong (the rollout's new port, abuse outcomes).
    problems: Vec<String>,
    notes: Vec<String>,
}

pub(super) async fn run(mesh: Mesh, to: &'static str, secs: u64) -> bool {
    let total = Duration::from_secs(secs);
    let schedule = schedule(total);
    println!("\nChaos soak for {secs} s through the frontend sidecar ({to}).");
    println!("Faults, every {} s:", CYCLE.as_secs());
    for f in Fault::ALL {
        println!("  +{:>2} s  {}", f.offset().as_secs(), f.what());
    }
    println!(
        "{} faults in all; the first at +{} s, the last at +{} s.",
        schedule.len(),
        schedule.first().map_or(0, |s| s.1.as_secs()),
        schedule.last().map_or(0, |s| s.1.as_secs())
    );
    println!("The sidecars get the catalog over xDS from `aether-proxy control-plane`, which serves the demo's catalog file.");
    println!("Capture (iptables) traffic is not part of the demo: it needs a network namespace.");

    let started = Instant::now();
    let mut load = Load::start(to, secs);
    let mesh = Arc::new(tokio::sync::Mutex::new(mesh));
    let pids = Arc::new(Mutex::new(sidecar_pids(&*mesh.lock().await)));
    let samples = Arc::new(Mutex::new(Samples::default()));
    let sampler = tokio::spawn(sample(pids.clone(), samples.clone(), started, total));

    let mut windows = Vec::new();
    let mut findings = Findings::default();
    for (fault, at) in &schedule {
        tokio::time::sleep_until(started + *at).await;
        let from = Instant::now();
        let mut m = mesh.lock().await;
        inject(*fault, &mut m, &mut findings, started).await;
        *pids.lock().unwrap_or_else(|p| p.into_inner()) = sidecar_pids(&m);
        drop(m);
        windows.push(Window {
            fault: *fault,
            from,
            to: Instant::now(),
        });
    }
    load.finish().await;
    let _ = sampler.await;

    // Every sidecar drains at the end too, and must exit 0.
    let mut m = mesh.lock().await;
    for i in 0..m.sidecars.len() {
        let name = m.sidecars[i].name.clone();
        let status = m.stop(i, Duration::from_secs(15)).await;
        findings.drains.push((name, status.and_then(|s| s.code())));
    }
    drop(m);

    println!("\nTraffic ({secs} s):");
    load.print();
    let unexplained = account(&load, &windows, started);
    let flat = report_resources(&samples.lock().unwrap_or_else(|p| p.into_inner()), total);
    let drains_ok = report_drains(&findings);
    for n in &findings.notes {
        println!("  note: {n}");
    }
    for p in &findings.problems {
        println!("  problem: {p}");
    }
    let clean = unexplained == 0 && flat && drains_ok && findings.problems.is_empty();
    println!(
        "\nSoak {}: {unexplained} unexplained failures, {} problems, drains {}, resources {}.",
        if clean { "passed" } else { "FAILED" },
        findings.problems.len(),
        if drains_ok {
            "all exited 0"
        } else {
            "NOT all exited 0"
        },
        if flat { "flat" } else { "NOT flat" }
    );
    clean
}

/// Every fault of every cycle that has time to end before the load does.
fn schedule(total: Duration) -> Vec<(Fault, Duration)> {
    let mut out = Vec::new();
    let mut cycle = Duration::ZERO;
    while cycle < total {
        for f in Fault::ALL {
            let at = cycle + f.offset();
            if at + f.needs() <= total {
                out.push((f, at));
            }
        }
        cycle += CYCLE;
    }
    out
}

fn sidecar_pids(mesh: &Mesh) -> Vec<(String, Option<u32>, String)> {
    (0..mesh.sidecars.len())
        .map(|i| {
            (
                mesh.sidecars[i].name.clone(),
                mesh.pid(i),
                mesh.sidecars[i].admin.clone(),
            )
        })
        .collect()
}

async fn inject(fault: Fault, mesh: &mut Mesh, findings: &mut Findings, started: Instant) {
    let t = started.elapsed().as_secs();
    println!("  +{t:>4} s  {}", fault.name());
    match fault {
        Fault::Rollout => {
            if let Err(e) = mesh.write_catalog(true) {
                findings.problems.push(format!("+{t} s rollout: {e}"));
                return;
            }
            // The new port answers once the frontend has the new catalog.
            let host = format!("payments.aether.internal:{ROLLOUT_PORT}");
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut served = false;
            while Instant::now() < deadline && !served {
                served = matches!(get(CLIENT_OUTBOUND, "/", &host).await, Ok((200, _, _)));
                if !served {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            if !served {
                findings.problems.push(format!(
                    "+{t} s rollout: port {ROLLOUT_PORT} never answered 200"
                ));
            }
            restart_sidecar(mesh, V1, findings, t).await;
            if let Err(e) = mesh.write_catalog(false) {
                findings.problems.push(format!("+{t} s rollback: {e}"));
            }
            // Until the rollback is seen, v1 is not in the frontend's catalog; wait for it.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        Fault::SidecarRestart => restart_sidecar(mesh, V1, findings, t).await,
        Fault::AppRestart => {
            let Some(app) = mesh
                .apps
                .iter_mut()
                .find(|a| a.addr.port() == 8080 && a.addr.ip().to_string() == PODS[0].apps)
            else {
                findings.problems.push("no v1 app to kill".into());
                return;
            };
            app.kill();
            tokio::time::sleep(Duration::from_secs(3)).await;
            if let Err(e) = app.restart().await {
                findings.problems.push(format!("+{t} s app restart: {e}"));
            }
        }
        Fault::CertRotation => {
            if let Err(e) = mesh.rotate_certs() {
                findings
                    .problems
                    .push(format!("+{t} s certificate rotation: {e}"));
            }
            // The sidecars pick the files up on their own; give them a moment within the window.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        Fault::ControlPlaneRestart => {
            match mesh.restart_control_plane(Duration::from_secs(3)).await {
                Ok(true) => reconnected(mesh, findings, t).await,
                Ok(false) => findings
                    .notes
                    .push("no control plane to restart: the sidecars read the catalog file".into()),
                Err(e) => findings.problems.push(format!("+{t} s {e}")),
            }
        }
        Fault::Abuse => abuse(CLIENT_OUTBOUND, findings, t).await,
    }
}

/// After the control plane's restart every sidecar's xDS stream must be up again: the
/// sidecars kept serving their last catalog meanwhile, and the next rollout depends on it.
async fn reconnected(mesh: &Mesh, findings: &mut Findings, t: u64) {
    let since = Instant::now();
    let deadline = since + Duration::from_secs(10);
    for sc in &mesh.sidecars {
        while scrape(&sc.admin, "aether_xds_connected").await != Some(1) {
            if Instant::now() >= deadline {
                findings.problems.push(format!(
                    "+{t} s control: {}'s xDS stream not up again 10 s after the restart",
                    sc.name
                ));
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    findings.notes.push(format!(
        "+{t} s control: every sidecar's xDS stream up again {} ms after the restart",
        since.elapsed().as_millis()
    ));
}

/// SIGTERM, wait for the drain's end (its exit status is recorded), start again, wait ready.
async fn restart_sidecar(mesh: &mut Mesh, i: usize, findings: &mut Findings, t: u64) {
    let name = mesh.sidecars[i].name.clone();
    let status = mesh.stop(i, Duration::from_secs(15)).await;
    findings
        .drains
        .push((name.clone(), status.and_then(|s| s.code())));
    if let Err(e) = mesh.spawn(i) {
        findings
            .problems
            .push(format!("+{t} s restarting {name}: {e}"));
        return;
    }
    if !wait_ready(&mesh.sidecars[i].admin, Duration::from_secs(15)).await {
        findings
            .problems
            .push(format!("+{t} s {name} not ready 15 s after its restart"));
    }
}

/// Slowloris and rapid reset at the frontend's outbound listener. The proxy must close the
/// slow heads (its 10 s head timer) and end the resetting connections (GOAWAY); legitimate
/// traffic meanwhile must not fail.
async fn abuse(to: &'static str, findings: &mut Findings, t: u64) {
    let mut slow = tokio::task::JoinSet::new();
    for _ in 0..100 {
        slow.spawn(slowloris(to, Duration::from_secs(12)));
    }
    let mut resets = tokio::task::JoinSet::new();
    for _ in 0..4 {
        resets.spawn(rapid_reset(to, Duration::from_secs(6)));
    }
    let mut slow_closed = 0;
    while let Some(r) = slow.join_next().await {
        slow_closed += usize::from(r.unwrap_or(false));
    }
    let mut reset_ended = 0;
    while let Some(r) = resets.join_next().await {
        reset_ended += usize::from(r.unwrap_or(false));
    }
    findings.notes.push(format!(
        "+{t} s abuse: the proxy closed {slow_closed} of 100 slowloris connections within 12 s and ended {reset_ended} of 4 rapid-reset connections"
    ));
    if slow_closed < 100 {
        findings.problems.push(format!(
            "+{t} s abuse: {} slowloris connections still open after 12 s",
            100 - slow_closed
        ));
    }
    if reset_ended < 4 {
        findings.problems.push(format!(
            "+{t} s abuse: {} rapid-reset connections were never ended by the proxy",
            4 - reset_ended
        ));
    }
}

/// A head sent a byte a second; true if the proxy closed the connection before `lasting`.
async fn slowloris(to: &str, lasting: Duration) -> bool {
    let Ok(mut tcp) = TcpStream::connect(to).await else {
        return true;
    };
    let until = Instant::now() + lasting;
    if tcp
        .write_all(b"GET / HTTP/1.1\r\nHost: payments.aether.internal\r\nx-slow: ")
        .await
        .is_err()
    {
        return true;
    }
    let mut buf = [0u8; 512];
    while Instant::now() < until {
        match tokio::time::timeout(Duration::from_secs(1), tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => {
                if tcp.write_all(b"a").await.is_err() {
                    return true;
                }
            }
        }
    }
    false
}

/// h2c with a HEADERS then RST_STREAM, over and over; true if the proxy ended the connection
/// (GOAWAY or close) before `lasting`.
async fn rapid_reset(to: &str, lasting: Duration) -> bool {
    let Ok(tcp) = TcpStream::connect(to).await else {
        return true;
    };
    let (mut r, mut w) = tcp.into_split();
    let reader = tokio::spawn(async move {
        // Any GOAWAY frame, or the end of the connection, is the proxy ending it.
        let mut buf = vec![0u8; 16 * 1024];
        let mut seen = Vec::new();
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    while seen.len() >= 9 {
                        let len = (usize::from(seen[0]) << 16)
                            | (usize::from(seen[1]) << 8)
                            | usize::from(seen[2]);
                        if seen[3] == 0x7 {
                            return true;
                        }
                        if seen.len() < 9 + len {
                            break;
                        }
                        seen.drain(..9 + len);
                    }
                }
            }
        }
    });
    let mut out = Vec::from(&b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..]);
    out.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    let _ = w.write_all(&out).await;
    let authority = b"payments.aether.internal:9090";
    let until = Instant::now() + lasting;
    let mut stream: u32 = 1;
    while Instant::now() < until && !reader.is_finished() {
        let mut batch = Vec::new();
        for _ in 0..100 {
            // :method GET, :scheme http, :path /, :authority as a literal with an indexed name.
            let mut block = vec![0x82, 0x86, 0x84, 0x41, authority.len() as u8];
            block.extend_from_slice(authority);
            let len = block.len();
            batch.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, 0x1, 0x4]);
            batch.extend_from_slice(&stream.to_be_bytes());
            batch.extend_from_slice(&block);
            // RST_STREAM, CANCEL.
            batch.extend_from_slice(&[0, 0, 4, 0x3, 0]);
            batch.extend_from_slice(&stream.to_be_bytes());
            batch.extend_from_slice(&8u32.to_be_bytes());
            stream += 2;
        }
        if w.write_all(&batch).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ended = tokio::time::timeout(Duration::from_secs(1), reader)
        .await
        .is_ok_and(|r| r.unwrap_or(false));
    ended
}

/// Reads every sidecar's resident memory, open files and live tasks every few seconds.
async fn sample(pids: Pids, samples: Arc<Mutex<Samples>>, started: Instant, total: Duration) {
    let mut last_pid: BTreeMap<String, u32> = BTreeMap::new();
    while started.elapsed() < total {
        let now = pids.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (name, pid, admin) in now {
            let Some(pid) = pid else { continue };
            let Some((rss, fds)) = proc_figures(pid) else {
                continue;
            };
            let tasks = scrape(&admin, "aether_runtime_tasks").await;
            let at = started.elapsed();
            let mut s = samples.lock().unwrap_or_else(|p| p.into_inner());
            let lives = s.lives.entry(name.clone()).or_default();
            if last_pid.get(&name) != Some(&pid) {
                lives.push(Vec::new());
                last_pid.insert(name, pid);
            }
            if let Some(life) = lives.last_mut() {
                life.push(Sample {
                    at,
                    rss,
                    fds,
                    tasks,
                });
            }
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

/// Resident bytes and open file descriptors of a process.
fn proc_figures(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss_kib * 1024, fds))
}

/// A gauge without labels from a sidecar's `/metrics`.
async fn scrape(admin: &str, gauge: &str) -> Option<u64> {
    let (status, _, body) = get(admin, "/metrics", admin).await.ok()?;
    if status != 200 {
        return None;
    }
    body.lines()
        .find_map(|l| l.strip_prefix(gauge)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// Prints the failures per kind and fault; returns how many no fault explains.
fn account(load: &Load, windows: &[Window], started: Instant) -> u64 {
    let explained_by = |f: &Failure| {
        windows
            .iter()
            .find(|w| f.at >= w.from && f.at <= w.to + GRACE && w.fault.explains(&f.fail.class))
            .map(|w| w.fault)
    };
    println!("\nFailures by kind and the fault that explains them:");
    let mut head = format!("  {:<48}", "kind");
    for f in Fault::ALL {
        head.push_str(&format!(" {:>8}", f.name()));
    }
    head.push_str(&format!(" {:>12}", "unexplained"));
    println!("{head}");
    let mut unexplained_total = 0;
    let mut unexplained_classes: BTreeMap<String, (u64, String, u64)> = BTreeMap::new();
    for (what, _, tally) in &load.kinds {
        let mut by_fault: BTreeMap<Fault, u64> = BTreeMap::new();
        let mut unexplained = 0;
        let failures = tally.failures();
        for f in &failures {
            match explained_by(f) {
                Some(fault) => *by_fault.entry(fault).or_default() += 1,
                None => {
                    unexplained += 1;
                    let e = unexplained_classes
                        .entry(format!("{what}: {}", f.fail.class))
                        .or_insert((0, f.fail.detail.clone(), (f.at - started).as_secs()));
                    e.0 += 1;
                }
            }
        }
        // Failures past the kept list count as unexplained: nothing can vouch for them.
        let kept = failures.len() as u64;
        unexplained += tally.failed.load(Ordering::Relaxed).saturating_sub(kept);
        let mut line = format!("  {what:<48}");
        for f in Fault::ALL {
            line.push_str(&format!(" {:>8}", by_fault.get(&f).copied().unwrap_or(0)));
        }
        line.push_str(&format!(" {unexplained:>12}"));
        println!("{line}");
        unexplained_total += unexplained;
    }
    for (class, (n, detail, at)) in &unexplained_classes {
        println!("    unexplained: {class} x{n} (first at +{at} s: {detail})");
    }
    unexplained_total
}

/// Prints each sidecar's resources over time; returns whether the long-lived ones stayed flat
/// over the last [`FLAT_WINDOW`] (judged only when the run is at least twice that long).
fn report_resources(samples: &Samples, total: Duration) -> bool {
    println!("\nSidecar resources (resident MiB / open fds / live tasks), a row a minute:");
    let step = Duration::from_secs(60).min(total / 6).max(SAMPLE_EVERY);
    let mut names: Vec<&String> = samples.lives.keys().collect();
    names.sort();
    let mut head = format!("  {:>6}", "t");
    for n in &names {
        head.push_str(&format!(" {n:>24}"));
    }
    println!("{head}");
    let mut t = Duration::ZERO;
    while t <= total {
        let mut line = format!("  {:>5}s", t.as_secs());
        for n in &names {
            let s = samples.lives[*n]
                .iter()
                .flatten()
                .rfind(|s| s.at <= t + SAMPLE_EVERY);
            let cell = match s {
                Some(s) => format!(
                    "{:.1} / {} / {}",
                    s.rss as f64 / (1 << 20) as f64,
                    s.fds,
                    s.tasks.map_or("-".to_string(), |t| t.to_string())
                ),
                None => "-".into(),
            };
            line.push_str(&format!(" {cell:>24}"));
        }
        println!("{line}");
        t += step;
    }
    let judged = total >= FLAT_WINDOW * 2;
    let mut flat = true;
    for n in &names {
        let lives = &samples.lives[*n];
        if lives.len() != 1 {
            println!(
                "  {n}: {} lives (restarted by the faults); not judged for growth",
                lives.len()
            );
            continue;
        }
        let life = &lives[0];
        let window_start = total.saturating_sub(FLAT_WINDOW.min(total / 2));
        // The floor of each half of the window: five cycles of faults each, so both halves
        // see every phase of the schedule, and a leak raises the second half's floor.
        let middle = window_start + (total - window_start) / 2;
        let first: Vec<&Sample> = life
            .iter()
            .filter(|s| s.at >= window_start && s.at < middle)
            .collect();
        let last: Vec<&Sample> = life
            .iter()
            .filter(|s| s.at >= middle && s.at <= total)
            .collect();
        let floor = |v: &[&Sample], f: fn(&Sample) -> u64| v.iter().map(|s| f(s)).min();
        let (Some(rss0), Some(rss1), Some(fd0), Some(fd1)) = (
            floor(&first, |s| s.rss),
            floor(&last, |s| s.rss),
            floor(&first, |s| s.fds),
            floor(&last, |s| s.fds),
        ) else {
            println!("  {n}: too few samples to judge");
            continue;
        };
        let tasks0 = first.iter().filter_map(|s| s.tasks).min();
        let tasks1 = last.iter().filter_map(|s| s.tasks).min();
        let rss_growth = rss1 as i64 - rss0 as i64;
        let fd_growth = fd1 as i64 - fd0 as i64;
        // Tasks are judged like fds: a task that outlives its connection is a leak.
        let tasks_growth = match (tasks0, tasks1) {
            (Some(a), Some(b)) => Some(b as i64 - a as i64),
            _ => None,
        };
        let ok = rss_growth < (1 << 20) && fd_growth <= 0 && tasks_growth.is_none_or(|g| g <= 0);
        println!(
            "  {n}: from +{} s to the end, resident {:+.2} MiB, fds {:+}, tasks {} (lowest of the window's first and second half){}",
            window_start.as_secs(),
            rss_growth as f64 / (1 << 20) as f64,
            fd_growth,
            tasks_growth.map_or("-".into(), |g| format!("{g:+}")),
            if !judged {
                format!(" (not judged: a run of {} s or more is)", (FLAT_WINDOW * 2).as_secs())
            } else if ok {
                " flat".to_string()
            } else {
                " GROWING".to_string()
            }
        );
        if judged && !ok {
            flat = false;
        }
    }
    flat
}

fn report_drains(findings: &Findings) -> bool {
    let ok = findings.drains.iter().all(|(_, c)| *c == Some(0));
    let bad: Vec<String> = findings
        .drains
        .iter()
        .filter(|(_, c)| *c != Some(0))
        .map(|(n, c)| format!("{n} exited {c:?}"))
        .collect();
    println!(
        "\nDrains: {} sidecar exits, {} with status 0{}",
        findings.drains.len(),
        findings.drains.len() - bad.len(),
        if bad.is_empty() {
            String::new()
        } else {
            format!(" ({})", bad.join(", "))
        }
    );
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minute_holds_every_fault_once() {
        let s = schedule(Duration::from_secs(60));
        let faults: Vec<Fault> = s.iter().map(|(f, _)| *f).collect();
        assert_eq!(faults, Fault::ALL.to_vec());
        // And each leaves time to end before the load does.
        assert!(s
            .iter()
            .all(|(f, at)| *at + f.needs() <= Duration::from_secs(60)));
    }

    #[test]
    fn thirty_minutes_repeat_the_cycle() {
        assert_eq!(
            schedule(Duration::from_secs(1800)).len(),
            30 * Fault::ALL.len()
        );
    }

    #[test]
    fn faults_explain_only_what_they_cause() {
        assert!(Fault::AppRestart.explains("503 app-unavailable"));
        assert!(!Fault::AppRestart.explains("tunnel echo differs"));
        assert!(!Fault::CertRotation.explains("503 upstream-connect-failure"));
        assert!(!Fault::SidecarRestart.explains("timeout"));
    }
}
