//! `aether-proxy demo` as a new user runs it: the whole local mesh comes up and its first
//! requests show SPEC's addressing table. It uses the 127.0.0.x addresses, which the other
//! tests never take (`Net::fresh` hands out 127.100.0.0 and up).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn demo_brings_up_a_mesh_and_shows_the_addressing_table() {
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
