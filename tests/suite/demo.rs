//! `aether-proxy demo` as a new user runs it: the whole local mesh comes up and its first
//! requests show SPEC's addressing table. It uses the 127.0.0.x addresses, which the other
//! tests never take (`Net::fresh` hands out 127.100.0.0 and up).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Both tests take the demo's fixed addresses: one at a time.
static DEMO: Mutex<()> = Mutex::new(());

#[test]
fn demo_brings_up_a_mesh_and_shows_the_addressing_table() {
    let _one = DEMO.lock().unwrap_or_else(|p| p.into_inner());
    let mut child = Command::new(env!("CARGO_BIN_EXE_aether-proxy"))
        .arg("demo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("demo starts");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut lines = Vec::new();
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => {
                let done = l.starts_with("Ctrl-C stops the demo");
                lines.push(l);
                if done {
                    break;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(_) => break,
        }
    }
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    let out = lines.join("\n");
    let line = |prefix: &str| {
        lines
            .iter()
            .find(|l| l.trim_start().starts_with(prefix))
            .cloned()
            .unwrap_or_else(|| panic!("no line for {prefix} in:\n{out}"))
    };
    assert!(
        line("payments.aether.internal ").contains("-> 200 hello from payments-v"),
        "{out}"
    );
    assert!(
        line("payments.aether.internal:9090")
            .contains("-> 200 hello from payments-v2, port 9090, HTTP/2.0"),
        "{out}"
    );
    assert!(
        line("payments.aether.internal:7777").contains("-> 503 port-not-exposed"),
        "{out}"
    );
    assert!(
        line("ghost.aether.internal").contains("-> 503 unknown-service"),
        "{out}"
    );
    assert!(line("evil.com").contains("-> 404 no-route"), "{out}");
    assert!(
        line("CONNECT").contains("echoed \"ping through the tunnel\""),
        "{out}"
    );
    assert!(status.success(), "demo exit status {status}");
}

/// `demo --load`: every kind of traffic flows for the time asked, each line counts answers and
/// failures, and the demo ends by itself with a status that says whether all succeeded.
#[test]
fn demo_load_sends_every_kind_of_traffic_and_stops() {
    let _one = DEMO.lock().unwrap_or_else(|p| p.into_inner());
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_aether-proxy"))
        .args(["demo", "--load", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("demo starts");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let Ok(out) = rx.recv_timeout(Duration::from_secs(90)) else {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
        panic!("demo --load 3 still running after 90 s");
    };
    let out = out.unwrap();
    let status = out.status;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(status.success(), "status {status}\n{stdout}\n{stderr}");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "ended before its load time: {stdout}"
    );
    let load = stdout
        .split("Load for 3 s")
        .nth(1)
        .unwrap_or_else(|| panic!("no load section:\n{stdout}"));
    for kind in [
        "h1 GET /,",
        "h1 GET /16k",
        "a new connection each",
        "h2c :9090",
        "tcp :5432",
    ] {
        let line = load
            .lines()
            .find(|l| l.contains(kind))
            .unwrap_or_else(|| panic!("no line for {kind}:\n{stdout}"));
        assert!(line.ends_with(", 0 failed"), "{line}");
        // "<n> requests," or "<n> MiB echoed,".
        let words: Vec<&str> = line.split_whitespace().collect();
        let count: u64 = words
            .windows(3)
            .find(|w| w[1] == "requests," || (w[1] == "MiB" && w[2] == "echoed,"))
            .and_then(|w| w[0].parse().ok())
            .unwrap_or_else(|| panic!("no count in {line}"));
        assert!(count > 0, "{line}");
    }
    assert!(!load.contains("first failure"), "{stdout}");
}
