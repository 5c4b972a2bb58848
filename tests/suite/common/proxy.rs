//! The proxy process: `aether-proxy run` in a temp dir, with its logs captured.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

use super::{http_get, poll_until, tcp_connect, HttpClient, Reply, BIN, PACE, READY_TIMEOUT};

/// The last `n` lines of `text`.
fn last_lines(text: &str, n: usize) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// Prints the last `n` lines of a process's `log` (kept in `dir`) under a header, for a test
/// that failed.
pub fn eprint_tail(what: &str, dir: &Path, log: &str, n: usize) {
    let tail = last_lines(log, n);
    eprintln!(
        "---- {what} (last {} lines, {}) ----",
        tail.len(),
        dir.display()
    );
    for l in tail {
        eprintln!("{l}");
    }
}

/// Resident memory (VmRSS) of process `pid` in KiB; `None` once the process is gone.
pub fn rss_kib_of(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let value = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    value.split_whitespace().next()?.parse().ok()
}

/// A running `aether-proxy run`, killed (SIGKILL) and reaped on drop.
///
/// Its config and catalog live in a temp dir next to `stdout.log` (the JSON access log) and
/// `stderr.log` (its logs). When a test panics, dropping the proxy prints the tail of its stderr.
pub struct Proxy {
    child: Option<Child>,
    dir: tempfile::TempDir,
    admin: SocketAddr,
    exit: Option<ExitStatus>,
    /// The read end of a stdout pipe nobody reads ([`ProxyBuilder::stdout_stuck`]), held so
    /// the proxy's writes block instead of failing.
    _stuck_stdout: Option<std::io::PipeReader>,
}

/// Options for [`Proxy`]; [`Proxy::start`] is `Proxy::builder(..).start()`.
pub struct ProxyBuilder {
    config: String,
    catalog: String,
    env: Vec<(String, String)>,
    args: Vec<String>,
    wait_ready: bool,
    stdout_stuck: bool,
    wrapper: Vec<String>,
}

impl ProxyBuilder {
    /// Sets an environment variable (default: `RUST_LOG=info,aether_proxy=debug`).
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }
    /// Extra arguments after `run --config <file>` (e.g. `--concurrency 1`).
    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.into());
        self
    }
    /// Stdout (the access log) goes to a pipe that nobody reads: once its kernel buffer is full,
    /// every write blocks, like a stuck log collector.
    pub fn stdout_stuck(mut self) -> Self {
        self.stdout_stuck = true;
        self
    }
    /// Runs the proxy inside network namespace `ns` (`ip netns exec`, so it sees
    /// `/etc/netns/<ns>/resolv.conf` as `/etc/resolv.conf`). Its admin listener is then out of
    /// the test's reach: the proxy is not waited for (the test checks readiness itself).
    pub fn netns(mut self, ns: &str) -> Self {
        self.wrapper = vec!["ip".into(), "netns".into(), "exec".into(), ns.into()];
        self.wait_ready = false;
        self
    }
    /// Runs the binary through `prefix` (e.g. `ip netns exec <ns> setpriv --reuid=...`), which
    /// must exec it in place (so the child's pid is the proxy's). The temp dir is made readable
    /// by every uid, since a wrapped proxy may run as another.
    pub fn wrap(mut self, prefix: &[&str]) -> Self {
        self.wrapper = prefix.iter().map(|s| s.to_string()).collect();
        self
    }
    /// Do not wait for `/readyz` 200 (readiness tests wait themselves).
    pub fn no_wait(mut self) -> Self {
        self.wait_ready = false;
        self
    }

    pub async fn start(self) -> Proxy {
        let dir = tempfile::Builder::new()
            .prefix("aether-proxy-")
            .tempdir()
            .expect("temp dir");
        let catalog_path = dir.path().join("catalog.yaml");
        fs::write(&catalog_path, &self.catalog).expect("write catalog");

        // The harness owns three things in the config: the catalog path (unless the test set
        // one, or the config has `discovery:`), and it insists on explicit listen addresses, so
        // two tests never share a port.
        let mut cfg: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&self.config).expect("config is YAML");
        let map = cfg.as_mapping_mut().expect("config is a YAML mapping");
        let get = |map: &serde_yaml_ng::Mapping, a: &str, b: &str| {
            map.get(a)
                .and_then(|v| v.get(b))
                .and_then(|v| v.as_str())
                .map(str::to_string)
        };
        for section in ["inbound", "outbound", "admin"] {
            assert!(
                get(map, section, "listen").is_some(),
                "test configs must set {section}.listen (the default is shared by every test)"
            );
        }
        let admin: SocketAddr = get(map, "admin", "listen")
            .unwrap()
            .parse()
            .expect("admin.listen is host:port");
        // A pod fed by a control plane (`discovery:`) has no catalog file.
        if get(map, "catalog", "path").is_none() && !map.contains_key("discovery") {
            let mut c = serde_yaml_ng::Mapping::new();
            c.insert(
                "path".into(),
                catalog_path.to_string_lossy().into_owned().into(),
            );
            map.insert("catalog".into(), c.into());
        }
        let config_path = dir.path().join("config.yaml");
        fs::write(&config_path, serde_yaml_ng::to_string(&cfg).unwrap()).expect("write config");

        let (stdout, stuck): (Stdio, _) = if self.stdout_stuck {
            let (r, w) = std::io::pipe().expect("pipe");
            (w.into(), Some(r))
        } else {
            let f = fs::File::create(dir.path().join("stdout.log")).expect("stdout.log");
            (f.into(), None)
        };
        let stderr = fs::File::create(dir.path().join("stderr.log")).expect("stderr.log");
        let mut cmd = match self.wrapper.split_first() {
            None => Command::new(BIN),
            Some((first, rest)) => {
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))
                    .expect("chmod the proxy's temp dir");
                let mut c = Command::new(first);
                c.args(rest).arg(BIN);
                c
            }
        };
        cmd.arg("run")
            .arg("--config")
            .arg(&config_path)
            .args(&self.args)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .env("RUST_LOG", "info,aether_proxy=debug");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn aether-proxy run");
        let mut proxy = Proxy {
            child: Some(child),
            dir,
            admin,
            exit: None,
            _stuck_stdout: stuck,
        };
        if self.wait_ready {
            proxy.wait_ready(READY_TIMEOUT).await;
        }
        proxy
    }
}

impl Proxy {
    /// Writes `config_yaml` and `catalog_yaml` into a temp dir, runs the proxy and waits until
    /// its `/readyz` answers 200. The config must set `inbound.listen`, `outbound.listen` and
    /// `admin.listen`; `catalog.path` is filled in unless the config names one or has a
    /// `discovery:` section.
    pub async fn start(config_yaml: &str, catalog_yaml: &str) -> Proxy {
        Proxy::builder(config_yaml, catalog_yaml).start().await
    }

    pub fn builder(config_yaml: &str, catalog_yaml: &str) -> ProxyBuilder {
        ProxyBuilder {
            config: config_yaml.to_string(),
            catalog: catalog_yaml.to_string(),
            env: Vec::new(),
            args: Vec::new(),
            wait_ready: true,
            stdout_stuck: false,
            wrapper: Vec::new(),
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    pub fn catalog_path(&self) -> PathBuf {
        self.dir.path().join("catalog.yaml")
    }
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The proxy's resident memory (VmRSS) in KiB.
    pub fn rss_kib(&self) -> u64 {
        let pid = self.pid().expect("the proxy runs");
        rss_kib_of(pid).expect("VmRSS in /proc/<pid>/status")
    }

    /// Polls `GET /readyz` until 200; panics (with the proxy's stderr) if the process exits or
    /// the deadline passes.
    pub async fn wait_ready(&mut self, limit: Duration) {
        let ready = poll_until(limit, Duration::from_millis(25), async || {
            if let Some(status) = self.try_exit() {
                panic!(
                    "aether-proxy exited before it was ready ({status}); stderr:\n{}",
                    self.stderr()
                );
            }
            match http_get(self.admin, "/readyz").await {
                Ok(r) if r.status == StatusCode::OK => Ok(()),
                Ok(r) => Err(format!("{} {}", r.status, r.text())),
                Err(e) => Err(e),
            }
        })
        .await;
        if let Err(last) = ready {
            panic!(
                "aether-proxy not ready after {limit:?} (last /readyz: {last}); stderr:\n{}",
                self.stderr()
            );
        }
    }

    /// `GET` on the admin listener.
    pub async fn admin_get(&self, path: &str) -> Result<Reply, String> {
        http_get(self.admin, path).await
    }

    /// `POST` on the admin listener.
    pub async fn admin_post(&self, path: &str) -> Result<Reply, String> {
        let tcp = tcp_connect(self.admin).await?;
        let req = Request::post(path)
            .header(http::header::HOST, self.admin.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap();
        HttpClient::h1(tcp).await?.send(req).await
    }

    /// Everything the proxy wrote to stdout so far, line by line.
    pub fn stdout_lines(&self) -> Vec<String> {
        fs::read_to_string(self.dir.path().join("stdout.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The stdout lines that are JSON objects (the access log).
    pub fn access_log(&self) -> Vec<serde_json::Value> {
        self.stdout_lines()
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.is_object())
            .collect()
    }

    /// Polls the access log until a line matches `pred`; returns it, or panics after `limit`.
    pub async fn wait_access_log(
        &self,
        limit: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let line = poll_until(limit, PACE, async || {
            self.access_log().into_iter().find(|v| pred(v)).ok_or(())
        })
        .await;
        line.unwrap_or_else(|()| {
            panic!(
                "no matching access-log line after {limit:?}; stdout:\n{}",
                self.stdout_lines().join("\n")
            )
        })
    }

    /// Everything the proxy wrote to stderr so far.
    pub fn stderr(&self) -> String {
        fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// The last `n` lines the proxy wrote to stderr.
    pub fn stderr_tail(&self, n: usize) -> String {
        last_lines(&self.stderr(), n).join("\n")
    }

    /// Sends a signal (e.g. `libc::SIGTERM`) to the process.
    pub fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) with our own child's pid; no memory is involved.
            unsafe {
                libc::kill(pid as i32, sig);
            }
        }
    }

    /// The exit status if the process has exited (non-blocking).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            if let Some(c) = self.child.as_mut() {
                self.exit = c.try_wait().ok().flatten();
            }
        }
        self.exit
    }

    /// Polls until the process exits; `None` if it is still running after `limit`.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        poll_until(limit, PACE, async || self.try_exit().ok_or(()))
            .await
            .ok()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprint_tail("aether-proxy stderr", self.dir.path(), &self.stderr(), 60);
        }
    }
}
