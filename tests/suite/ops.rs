//! The operator's dashboard and alerts (`deploy/grafana/aether-proxy.json`,
//! `deploy/prometheus/aether-proxy-rules.yaml`) against the real thing: `promtool` checks the
//! rule file, runs its unit tests and checks the documented scrape configs; a real Prometheus
//! scrapes live sidecars that carry traffic of every kind and answers every panel query and
//! every recording rule, and raises the alerts the traffic calls for; every metric and label
//! the two files name is one the sidecars export, so a renamed metric or label fails here.
//!
//! Prometheus and promtool are Debian's `prometheus` package (`bash .ci/run` installs it);
//! without them the tests fail, never skip.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::xds::*;
use crate::common::*;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn deploy(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(rel)
}

fn rules_path() -> PathBuf {
    deploy("prometheus/aether-proxy-rules.yaml")
}

fn dashboard() -> serde_json::Value {
    let path = deploy("grafana/aether-proxy.json");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One rule of the rule file: a recording rule (`record`) or an alert.
struct Rule {
    record: Option<String>,
    alert: Option<String>,
    expr: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

fn rules() -> Vec<Rule> {
    let text = fs::read_to_string(rules_path()).unwrap();
    let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("the rule file is YAML");
    let strings = |v: &serde_yaml_ng::Value| -> BTreeMap<String, String> {
        v.as_mapping()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| {
                        let s =
                            |x: &serde_yaml_ng::Value| x.as_str().unwrap_or_default().to_string();
                        (s(k), s(v))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for group in v["groups"].as_sequence().expect("groups") {
        for r in group["rules"].as_sequence().expect("rules") {
            let s = |k: &str| r.get(k).and_then(|x| x.as_str()).map(str::to_string);
            out.push(Rule {
                record: s("record"),
                alert: s("alert"),
                expr: s("expr").expect("every rule has an expr"),
                labels: strings(&r["labels"]),
                annotations: strings(&r["annotations"]),
            });
        }
    }
    out
}

/// Every query target of the dashboard: (panel title, expr as written).
fn panel_targets(d: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        let title = p["title"].as_str().unwrap_or_default().to_string();
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default().to_string();
            out.push((title.clone(), expr));
        }
    }
    out
}

/// The dashboard's query variables: name -> `label_values(...)` query.
fn variables(d: &serde_json::Value) -> BTreeMap<String, String> {
    d["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let q = v["query"]["query"]
                .as_str()
                .or_else(|| v["query"].as_str())
                .unwrap_or_default();
            (v["name"].as_str().unwrap().to_string(), q.to_string())
        })
        .collect()
}

/// `label_values(selector, label)` split into its selector and label.
fn label_values_parts(q: &str) -> (String, String) {
    let inner = q
        .trim()
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not a label_values(...) query: {q}"));
    let (sel, label) = inner
        .rsplit_once(',')
        .unwrap_or_else(|| panic!("label_values without a label: {q}"));
    (sel.trim().to_string(), label.trim().to_string())
}

/// The expr with Grafana's variables replaced: `$pod`, `$service`, `$port` by the given
/// values, `$__rate_interval` by 15s.
fn substitute(expr: &str, pod: &str, service: &str, port: &str) -> String {
    expr.replace("$__rate_interval", "15s")
        .replace("${pod}", pod)
        .replace("$pod", pod)
        .replace("${service}", service)
        .replace("$service", service)
        .replace("${port}", port)
        .replace("$port", port)
}

// ---------------------------------------------------------------------------------------------
// What a PromQL expression names
// ---------------------------------------------------------------------------------------------

/// A series selector: metric name (empty for a bare `{...}`) and its (label, op, value)
/// matchers.
type Selector = (String, Vec<(String, String, String)>);

/// The selectors of a PromQL expression and the labels of its grouping clauses (`by`,
/// `without`, `on`, `ignoring`, `group_left`, `group_right`). Function and aggregation names,
/// keywords, numbers, durations and string literals are skipped.
fn promql_names(expr: &str) -> (Vec<Selector>, Vec<String>) {
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const KEYWORDS: [&str; 18] = [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "atan2",
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "group",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
    ];
    let b = expr.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let ident = |i: &mut usize| {
        let start = *i;
        while *i < b.len() && is_ident(b[*i]) {
            *i += 1;
        }
        expr[start..*i].to_string()
    };
    let string = |i: &mut usize| {
        let quote = b[*i];
        *i += 1;
        let start = *i;
        while *i < b.len() && b[*i] != quote {
            if b[*i] == b'\\' {
                *i += 1;
            }
            *i += 1;
        }
        let s = expr[start..(*i).min(b.len())].to_string();
        *i += 1;
        s
    };
    let matchers = |i: &mut usize| {
        assert_eq!(b[*i], b'{');
        *i += 1;
        let mut out = Vec::new();
        loop {
            skip_ws(i);
            match b.get(*i) {
                None => panic!("unclosed {{ in {expr}"),
                Some(b'}') => {
                    *i += 1;
                    return out;
                }
                Some(b',') => *i += 1,
                Some(_) => {
                    let label = ident(i);
                    skip_ws(i);
                    let start = *i;
                    while *i < b.len() && matches!(b[*i], b'=' | b'!' | b'~') {
                        *i += 1;
                    }
                    let op = expr[start..*i].to_string();
                    skip_ws(i);
                    assert!(
                        !label.is_empty()
                            && !op.is_empty()
                            && matches!(b.get(*i), Some(b'"' | b'\'')),
                        "cannot read the matchers of {expr}"
                    );
                    let value = string(i);
                    out.push((label, op, value));
                }
            }
        }
    };
    let (mut selectors, mut grouping) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'"' || c == b'\'' {
            string(&mut i);
        } else if c == b'[' {
            while i < b.len() && b[i] != b']' {
                i += 1;
            }
            i += 1;
        } else if c.is_ascii_digit() || c == b'.' {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                i += 1;
            }
        } else if c == b'{' {
            let m = matchers(&mut i);
            selectors.push((String::new(), m));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let name = ident(&mut i);
            let mut j = i;
            skip_ws(&mut j);
            let next = b.get(j).copied();
            if GROUPING.contains(&name.as_str()) {
                if next == Some(b'(') {
                    i = j + 1;
                    loop {
                        skip_ws(&mut i);
                        match b.get(i) {
                            Some(b')') | None => {
                                i += 1;
                                break;
                            }
                            Some(b',') => i += 1,
                            Some(_) => grouping.push(ident(&mut i)),
                        }
                    }
                }
            } else if KEYWORDS.contains(&name.as_str()) || next == Some(b'(') {
                // An operator, an aggregation or a function.
            } else if next == Some(b'{') {
                i = j;
                let m = matchers(&mut i);
                selectors.push((name, m));
            } else {
                selectors.push((name, Vec::new()));
            }
        } else {
            i += 1;
        }
    }
    (selectors, grouping)
}

/// Labels Prometheus puts on every scraped series.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

/// Checks that every metric and label `expr` names exists: `aether_*` metrics among the
/// sidecars' exported series (`exported`: sample name -> label names), recording rules among
/// `records` (name -> labels), and Prometheus's own `up`. Problems are pushed with `what`.
fn check_expr(
    what: &str,
    expr: &str,
    exported: &BTreeMap<String, BTreeSet<String>>,
    records: &BTreeMap<String, BTreeSet<String>>,
    problems: &mut Vec<String>,
) -> BTreeSet<String> {
    let (selectors, grouping) = promql_names(expr);
    let mut available: BTreeSet<String> = TARGET_LABELS.iter().map(|s| s.to_string()).collect();
    for (metric, matchers) in &selectors {
        let labels: BTreeSet<String> = if metric.contains(':') {
            match records.get(metric) {
                Some(l) => l.clone(),
                None => {
                    problems.push(format!("{what}: {metric} is no recording rule of the file"));
                    continue;
                }
            }
        } else if metric == "up" {
            BTreeSet::new()
        } else if metric.starts_with("aether_") {
            match exported.get(metric) {
                Some(l) => l.clone(),
                None => {
                    problems.push(format!("{what}: the sidecars export no {metric}"));
                    continue;
                }
            }
        } else {
            problems.push(format!(
                "{what}: {metric:?} is not a metric of the sidecars (in {expr})"
            ));
            continue;
        };
        for (label, _, _) in matchers {
            if !labels.contains(label) && !TARGET_LABELS.contains(&label.as_str()) {
                problems.push(format!("{what}: {metric} has no label {label:?}"));
            }
        }
        available.extend(labels);
    }
    for label in grouping {
        if !available.contains(&label) {
            problems.push(format!(
                "{what}: no metric of the expression has the label {label:?} it groups by"
            ));
        }
    }
    available
}

/// The sample names of a classic text exposition with their label names.
fn exposition_labels(text: &str, into: &mut BTreeMap<String, BTreeSet<String>>) {
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = into.entry(line[..end].to_string()).or_default();
        if let Some(rest) = line[end..].strip_prefix('{') {
            let (selectors, _) =
                promql_names(&format!("x{{{}}}", rest.rsplit_once('}').unwrap().0));
            for (_, m) in selectors {
                labels.extend(m.into_iter().map(|(l, _, _)| l));
            }
        }
    }
}

/// Every `aether_*` word in `text` (metric names in descriptions and annotations included),
/// leaving out recording-rule names (`level:metric:operations`).
fn aether_words(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("aether_") && !w.contains(':'))
        .map(str::to_string)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The files on their own
// ---------------------------------------------------------------------------------------------

fn run_promtool(args: &[&str], dir: &Path) -> std::process::Output {
    Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): install Debian's prometheus package \
                 (apt-get install prometheus; bash .ci/run does it)"
            )
        })
}

/// `promtool check rules` accepts the rule file, and `promtool test rules` runs its unit tests
/// (every alert fires on the input that should fire it and stays quiet on its near miss);
/// `promtool check config` accepts the scrape configs docs/operating.md shows. Every alert has
/// a severity and both annotations, and a unit test; every recording rule a unit test too.
#[test]
fn promtool_accepts_the_rules_and_passes_their_unit_tests() {
    let dir = rules_path().parent().unwrap().to_path_buf();
    let check = run_promtool(&["check", "rules", "aether-proxy-rules.yaml"], &dir);
    assert!(
        check.status.success(),
        "promtool check rules:\n{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let test = run_promtool(&["test", "rules", "aether-proxy-rules.test.yaml"], &dir);
    assert!(
        test.status.success(),
        "promtool test rules:\n{}{}",
        String::from_utf8_lossy(&test.stdout),
        String::from_utf8_lossy(&test.stderr)
    );

    // The scrape configs docs/operating.md shows, each with the rule file beside it. Debian's
    // build has no Kubernetes discovery: there a static target stands in for it, the relabelling
    // is checked all the same.
    let doc = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operating.md"))
        .unwrap();
    let section = doc
        .split_once("## Dashboard and alerts\n")
        .expect("docs/operating.md has a Dashboard and alerts section")
        .1
        .split("\n## ")
        .next()
        .unwrap();
    let configs: Vec<&str> = section
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split_once("```").map(|(yaml, _)| yaml))
        .collect();
    assert_eq!(configs.len(), 2, "two prometheus.yml examples");
    for config in configs {
        assert!(config.contains("job_name: aether-proxy"), "{config}");
        let mut config = config.replace(
            "kubernetes_sd_configs:\n      - role: pod\n",
            "static_configs:\n      - targets: ['10.0.0.1:15021']\n",
        );
        if !config.contains("rule_files:") {
            config = format!("rule_files:\n  - aether-proxy-rules.yaml\n{config}");
        }
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("prometheus.yml"), &config).unwrap();
        fs::copy(rules_path(), tmp.path().join("aether-proxy-rules.yaml")).unwrap();
        let out = run_promtool(&["check", "config", "prometheus.yml"], tmp.path());
        assert!(
            out.status.success(),
            "promtool check config, docs/operating.md's example:\n{config}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // What the unit tests cover: alerts expected to fire, recording rules evaluated.
    let tests: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &fs::read_to_string(dir.join("aether-proxy-rules.test.yaml")).unwrap(),
    )
    .unwrap();
    let mut fired = BTreeSet::new();
    let mut evaluated = BTreeSet::new();
    for t in tests["tests"].as_sequence().expect("tests") {
        for a in t["alert_rule_test"].as_sequence().into_iter().flatten() {
            if a["exp_alerts"].as_sequence().is_some_and(|e| !e.is_empty()) {
                fired.insert(a["alertname"].as_str().unwrap().to_string());
            }
        }
        for e in t["promql_expr_test"].as_sequence().into_iter().flatten() {
            evaluated.insert(e["expr"].as_str().unwrap().to_string());
        }
    }
    let rules = rules();
    let alerts: Vec<&Rule> = rules.iter().filter(|r| r.alert.is_some()).collect();
    assert!(alerts.len() >= 6, "{} alerts", alerts.len());
    for r in &alerts {
        let name = r.alert.as_deref().unwrap();
        assert!(
            matches!(
                r.labels.get("severity").map(String::as_str),
                Some("critical" | "warning" | "info")
            ),
            "{name}: severity critical, warning or info: {:?}",
            r.labels
        );
        for a in ["summary", "description"] {
            assert!(
                r.annotations.get(a).is_some_and(|s| s.len() > 20),
                "{name}: no {a} annotation"
            );
        }
        assert!(
            fired.contains(name),
            "{name} has no unit test in aether-proxy-rules.test.yaml that fires it"
        );
    }
    for r in rules.iter().filter_map(|r| r.record.as_deref()) {
        assert!(
            evaluated.contains(r),
            "the recording rule {r} has no unit test"
        );
    }
}

/// The dashboard is Grafana's JSON model: its data source a template variable of type
/// prometheus, every panel's queries on it and filtered by the pod variable, the service and
/// port variables where the metric has those labels (checked against the live exposition in
/// the live test), panel ids unique.
#[test]
fn the_dashboard_is_templated_by_data_source_and_pod() {
    let d = dashboard();
    assert!(
        d["schemaVersion"]
            .as_u64()
            .is_some_and(|v| (36..=41).contains(&v)),
        "schemaVersion: {}",
        d["schemaVersion"]
    );
    assert_eq!(d["uid"], "aether-proxy");
    assert!(d["id"].is_null(), "an importable dashboard has no id");
    let vars = d["templating"]["list"].as_array().unwrap();
    let ds = vars
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let q = variables(&d);
    for v in ["pod", "service", "port"] {
        assert!(q.contains_key(v), "no {v} variable: {q:?}");
        let var = vars.iter().find(|x| x["name"] == v).unwrap();
        assert_eq!(var["datasource"]["uid"], "${datasource}", "{v}");
        assert_eq!(var["allValue"], ".*", "{v}: All is the regex .*");
        assert_eq!(var["includeAll"], true, "{v}");
    }
    assert_eq!(label_values_parts(&q["pod"]).1, "instance");
    assert_eq!(label_values_parts(&q["service"]).1, "service");
    assert_eq!(label_values_parts(&q["port"]).1, "port");

    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in d["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "{title}: id repeated"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["type"], "prometheus", "{title}");
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            queries += 1;
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            assert!(refs.insert(t["refId"].as_str().unwrap()), "{title}: refId");
            let expr = t["expr"].as_str().unwrap();
            let (selectors, _) = promql_names(expr);
            assert!(!selectors.is_empty(), "{title}: no metric in {expr}");
            for (metric, matchers) in selectors {
                assert!(
                    matchers
                        .iter()
                        .any(|(l, op, v)| l == "instance" && op == "=~" && v == "$pod"),
                    "{title}: {metric} is not filtered by instance=~\"$pod\": {expr}"
                );
            }
        }
    }
    assert!(queries >= 20, "{queries} queries");
}

// ---------------------------------------------------------------------------------------------
// A real Prometheus
// ---------------------------------------------------------------------------------------------

/// `prometheus` scraping `targets` every second as the job `aether-proxy`, with the rule file
/// evaluated every second; its storage and log in a temp dir. Killed on drop.
struct Prometheus {
    child: Option<Child>,
    dir: tempfile::TempDir,
    addr: SocketAddr,
}

impl Prometheus {
    async fn start(addr: SocketAddr, targets: &[SocketAddr]) -> Prometheus {
        let dir = tempfile::Builder::new()
            .prefix("aether-prometheus-")
            .tempdir()
            .unwrap();
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - '{}'\n\
             scrape_configs:\n  - job_name: aether-proxy\n    metrics_path: /metrics\n    \
             static_configs:\n      - targets: [{}]\n",
            rules_path().display(),
            targets.join(", ")
        );
        let config_path = dir.path().join("prometheus.yml");
        fs::write(&config_path, config).unwrap();
        let log = fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run prometheus ({e}): install Debian's prometheus package \
                     (apt-get install prometheus; bash .ci/run does it)"
                )
            });
        let mut p = Prometheus {
            child: Some(child),
            dir,
            addr,
        };
        eventually_every(
            READY_TIMEOUT,
            Duration::from_millis(100),
            "prometheus ready",
            async || {
                if let Some(status) = p.child.as_mut().unwrap().try_wait().unwrap() {
                    panic!("prometheus exited ({status}):\n{}", p.log());
                }
                match http_get(addr, "/-/ready").await {
                    Ok(r) if r.status.as_u16() == 200 => Ok(()),
                    other => Err(format!("{other:?}:\n{}", p.log())),
                }
            },
        )
        .await;
        p
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` on the HTTP API; its `data`, or why not.
    async fn api(&self, path: &str) -> Result<serde_json::Value, String> {
        let r = http_get(self.addr, path).await?;
        let v: serde_json::Value = serde_json::from_slice(&r.body)
            .map_err(|e| format!("{path}: {} {e}: {}", r.status, r.text()))?;
        if v["status"] != "success" {
            return Err(format!("{path}: {v}"));
        }
        Ok(v["data"].clone())
    }

    /// An instant query: the result's series, or the error.
    async fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let data = self
            .api(&format!("/api/v1/query?query={}", encode(expr)))
            .await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The values of `label` over the series `selector` selects (Grafana's `label_values`).
    async fn label_values(&self, selector: &str, label: &str) -> BTreeSet<String> {
        let data = self
            .api(&format!(
                "/api/v1/label/{label}/values?match%5B%5D={}",
                encode(selector)
            ))
            .await
            .unwrap_or_else(|e| panic!("label_values({selector}, {label}): {e}"));
        data.as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    }

    /// The alerts now pending or firing: (name, state, labels).
    async fn alerts(&self) -> Vec<(String, String, serde_json::Value)> {
        let data = self.api("/api/v1/alerts").await.expect("/api/v1/alerts");
        data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap().to_string(),
                    a["state"].as_str().unwrap().to_string(),
                    a["labels"].clone(),
                )
            })
            .collect()
    }

    /// Polls the alerts until `pred` holds for the instances (label `label`) of alert `name`;
    /// returns them.
    async fn wait_alert(
        &self,
        name: &str,
        label: &str,
        what: &str,
        pred: impl Fn(&BTreeSet<String>) -> bool,
    ) -> BTreeSet<String> {
        let limit = Duration::from_secs(20);
        eventually_every(limit, Duration::from_millis(250), what, async || {
            let all = self.alerts().await;
            let got: BTreeSet<String> = all
                .iter()
                .filter(|(n, ..)| n == name)
                .map(|(_, _, l)| l[label].as_str().unwrap_or_default().to_string())
                .collect();
            if pred(&got) {
                Ok(got)
            } else {
                Err(format!("{name} is active for {got:?}; all alerts: {all:?}"))
            }
        })
        .await
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("---- prometheus log (last {} lines) ----", tail.len());
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

// ---------------------------------------------------------------------------------------------
// Traffic
// ---------------------------------------------------------------------------------------------

/// One DNS question over UDP to `server`; the answer's response code.
async fn dns_ask(server: SocketAddr, from: std::net::IpAddr, name: &str) -> ResponseCode {
    let sock = tokio::net::UdpSocket::bind(SocketAddr::new(from, 0))
        .await
        .unwrap();
    let mut q = Message::query();
    q.metadata.recursion_desired = true;
    q.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    sock.send_to(&q.to_vec().unwrap(), server).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let (n, _) = within(IO_TIMEOUT, "DNS answer", sock.recv_from(&mut buf))
        .await
        .unwrap()
        .unwrap();
    Message::from_vec(&buf[..n])
        .expect("a DNS answer")
        .metadata
        .response_code
}

/// Requests of several kinds, over and over until `stop`: HTTP/1.1 and HTTP/2 through the
/// client pod, a no-route 404 and a port-not-exposed 503, and one through the xDS-fed pod.
/// Counts the app's 200s.
fn background_load(
    out: SocketAddr,
    xds_out: SocketAddr,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            let mut replies = Vec::new();
            replies.push(try_get(out, SVC, "/load/h1").await);
            if let Ok(tcp) = tcp_connect(out).await {
                if let Ok(mut h2) = HttpClient::h2(tcp).await {
                    replies.push(h2.send(empty(get(&format!("http://{SVC}/load/h2")))).await);
                }
            }
            replies.push(try_get(out, "nowhere.example", "/load").await);
            replies.push(try_get(out, "payments.aether.internal:7777", "/load").await);
            replies.push(try_get(xds_out, SVC, "/load/xds").await);
            let good = replies
                .iter()
                .filter(|r| matches!(r, Ok(r) if r.status.as_u16() == 200))
                .count();
            ok.fetch_add(good, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

// ---------------------------------------------------------------------------------------------
// The live check
// ---------------------------------------------------------------------------------------------

/// A client pod (file catalog, DNS listener), a server pod (`payments`, an HTTP port and a tcp
/// port), a client pod fed by the test control plane and a pod over its memory limit, scraped
/// by a real Prometheus with the rule file loaded, while traffic of every kind goes through
/// them: HTTP/1.1 and HTTP/2, proxy-made 404 and 503 answers, an app's 404, a CONNECT tunnel,
/// DNS questions, a request breaker overflowing, connect failures to a pod that is gone
/// (retried, then ejected), NACKed Clusters. Then:
/// * every dashboard query (`$pod`, `$service`, `$port` as `.*`) and every recording rule
///   returns a series; with each pod, `payments` and `8080` chosen, each query returns only
///   that pod's series and some pod has one; the variables list the pods, the service, the port;
/// * every rule evaluates without error; the NACK and error-ratio alerts go active, and the
///   overload and not-ready alerts for the pod over its limit only; the control plane stopped,
///   the disconnection alert for the xDS-fed pod only; the server pod killed, the
///   scrape-failure alert for it;
/// * every metric and label name of the dashboard and the rules is in the sidecars' `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_answers_every_panel_and_rule_from_live_sidecars() {
    let started = Instant::now();
    let net = Net::fresh();
    let (client_pod, server_pod, gone_pod, xds_pod) =
        (net.pod(0), net.pod(1), net.pod(2), net.pod(3));
    let certs = certs();
    let app = HttpApp::auto(server_pod.app(8080)).await;
    let _echo = TcpEcho::start(server_pod.app(5432)).await;
    let server = server_proxy(
        &certs,
        server_pod,
        "payments",
        &[
            "{ port: 8080, protocol: auto }",
            "{ port: 5432, protocol: tcp }",
        ],
    )
    .await;
    // payments: the live pod and one whose sidecar is gone (nothing listens there: connect
    // failures, retried on the live pod, eject it); at most 4 requests in flight.
    let cat = catalog(&[service(
        "payments",
        &certs.spiffe_id(PAYMENTS),
        "    protocols: { 5432: tcp }\n    circuit_breakers: { max_requests: 4 }\n",
        &[
            endpoint(server_pod.proxy_ip(), &[8080, 5432]),
            endpoint(gone_pod.proxy_ip(), &[8080]),
        ],
    )]);
    let dns = SocketAddr::new(client_pod.proxy_ip(), 15053);
    let client = client_proxy(
        &certs,
        client_pod,
        &cat,
        &format!("dns:\n  listen: {dns}\n"),
    )
    .await;
    let fx = Fixture::new().service(
        "payments",
        Service::new(&certs.spiffe_id(PAYMENTS))
            .endpoint(Endpoint::new(server_pod.proxy_ip(), &[8080])),
    );
    let cp = ControlPlane::start(Server::Tonic, Listen::Tcp(cp_addr(&net)), fx).await;
    let xds = xds_client(&certs, xds_pod, &cp.address(), &[], "").await;
    // Its resident set is above 4 MiB from the start: overload step 2 and never ready, so the
    // memory panel and the overload and readiness alerts have a sidecar with a limit.
    let overloaded = client_proxy_builder(
        &certs,
        net.pod(4),
        "services: {}\n",
        "overload:\n  memory_limit: 4Mi\n",
    )
    .no_wait()
    .start()
    .await;
    let pods = [
        client.admin_addr(),
        server.admin_addr(),
        xds.admin_addr(),
        overloaded.admin_addr(),
    ];
    let instances: BTreeSet<String> = pods.iter().map(|a| a.to_string()).collect();
    let prom = Prometheus::start(SocketAddr::new(net.pod(14).proxy_ip(), 19090), &pods).await;

    // Every sidecar scraped before the traffic, so counters are seen growing.
    let every = Duration::from_millis(200);
    eventually_every(
        Duration::from_secs(30),
        every,
        "every target up",
        async || {
            let data = prom.api("/api/v1/targets").await.unwrap();
            let up: BTreeSet<String> = data["activeTargets"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|t| t["health"] == "up")
                .map(|t| t["labels"]["instance"].as_str().unwrap().to_string())
                .collect();
            holds(up == instances).map_err(|_| format!("up: {up:?} of {instances:?}: {data}"))
        },
    )
    .await;

    // Traffic of every kind through the client pod.
    let out = client_pod.outbound();
    let r = get_h1(out, SVC, "/h1").await;
    assert_app_ok(&r, 8080, "HTTP/1.1");
    let r = h2_to(out)
        .await
        .send(empty(get(&format!("http://{SVC}/h2"))))
        .await
        .unwrap();
    assert_app_ok(&r, 8080, "HTTP/2");
    let r = get_h1(out, "nowhere.example", "/").await;
    assert_proxy_error(&r, 404, "no-route", "not a mesh service");
    let r = get_h1(out, "payments.aether.internal:7777", "/").await;
    assert_proxy_error(&r, 503, "port-not-exposed", "a port no pod serves");
    let r = h1_to(out)
        .await
        .send(empty(
            get("/missing")
                .header("host", SVC)
                .header("x-app-status", "404"),
        ))
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 404, "the app's own 404");
    assert_eq!(r.aether_error(), None);
    let tunnel = http_connect(
        tcp_connect(out).await.unwrap(),
        "payments.aether.internal:5432",
    );
    let mut tunnel = match tunnel.await {
        Ok(t) => t,
        Err(e) => panic!("CONNECT to the tcp port: {e:?}"),
    };
    tunnel.write_all(b"through the tunnel").await.unwrap();
    let mut back = [0u8; 18];
    within(IO_TIMEOUT, "echo", tunnel.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&back, b"through the tunnel");
    drop(tunnel);
    let from = client_pod.extra(0);
    assert_eq!(
        dns_ask(dns, from, "payments.aether.internal").await,
        ResponseCode::NoError
    );
    assert_eq!(
        dns_ask(dns, from, "ghost.aether.internal").await,
        ResponseCode::NXDomain
    );

    // The request breaker: four slow requests in flight, the fifth refused.
    let mut slow = tokio::task::JoinSet::new();
    for i in 0..4 {
        slow.spawn(async move {
            h2_to(out)
                .await
                .send(empty(
                    get(&format!("http://{SVC}/slow/{i}")).header("x-app-delay-ms", "3000"),
                ))
                .await
        });
    }
    within(
        Duration::from_secs(5),
        "four slow requests at the app",
        async {
            while app
                .seen()
                .iter()
                .filter(|s| s.uri.contains("/slow/"))
                .count()
                < 4
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
    )
    .await
    .unwrap();
    let r = get_h1(out, SVC, "/one-too-many").await;
    assert_proxy_error(&r, 503, "overflow", "a fifth request in flight");
    while let Some(r) = slow.join_next().await {
        assert_app_ok(&r.unwrap().unwrap(), 8080, "a slow request");
    }

    // Requests until the gone pod is ejected (its connect failures retried on the live pod).
    let mut sent = 0;
    let ejected = "the gone pod ejected";
    eventually_every(
        Duration::from_secs(15),
        Duration::ZERO,
        ejected,
        async || {
            let labels = ["service=\"payments\""];
            if metric(&client, "aether_outlier_ejections_total", &labels).await >= 1.0 {
                return Ok(());
            }
            let r = get_h1(out, SVC, &format!("/eject/{sent}")).await;
            assert_app_ok(&r, 8080, "retried on the live pod");
            sent += 1;
            Err(format!("not after {sent} requests"))
        },
    )
    .await;
    assert!(
        metric(
            &client,
            "aether_retries_total",
            &["reason=\"connect-failure\""]
        )
        .await
            >= 1.0
    );

    // The xDS-fed pod: a request (Cluster and assignment ACKed), then two invalid Clusters
    // NACKed, a scrape apart so Prometheus sees the counter grow.
    let xds_out = xds_pod.outbound();
    assert_app_ok(&get_h1(xds_out, SVC, "/xds").await, 8080, "via xDS");
    cp.wait_acked(&[SVC], IO_TIMEOUT).await;
    let mut bad = cp.cluster(SVC);
    bad.connect_timeout = Some(PbDuration {
        seconds: 0,
        nanos: 0,
    });
    for round in 0..2 {
        let before = cp.nacks().len();
        cp.serve_invalid(SVC, bad.clone());
        cp.wait_until(IO_TIMEOUT, "a NACK", |cp| cp.nacks().len() > before)
            .await;
        let want = (round + 1) as f64;
        let every = Duration::from_millis(200);
        let what = format!("Prometheus scraped NACK {want}");
        eventually_every(Duration::from_secs(15), every, &what, async || {
            let got = prom
                .query(&format!(
                    "aether_xds_updates_total{{result=\"nack\", instance=\"{}\"}}",
                    xds.admin_addr()
                ))
                .await
                .unwrap();
            let v: f64 = got
                .first()
                .and_then(|s| s["value"][1].as_str()?.parse().ok())
                .unwrap_or(0.0);
            holds(v >= want).map_err(|_| format!("{got:?}"))
        })
        .await;
        cp.clear_invalid(SVC);
        cp.wait_acked(&[SVC], IO_TIMEOUT).await;
    }

    // Traffic keeps flowing while the queries are asked.
    let stop = Arc::new(AtomicBool::new(false));
    let load_ok = Arc::new(AtomicUsize::new(0));
    let load = background_load(out, xds_out, stop.clone(), load_ok.clone());

    // Every panel query and every recording rule returns a series (with everything selected).
    let d = dashboard();
    let targets = panel_targets(&d);
    let rules = rules();
    let records: Vec<&str> = rules.iter().filter_map(|r| r.record.as_deref()).collect();
    let mut pending: Vec<(String, String)> = targets
        .iter()
        .map(|(title, expr)| (title.clone(), substitute(expr, ".*", ".*", ".*")))
        .chain(records.iter().map(|r| (format!("rule {r}"), r.to_string())))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut still = Vec::new();
        for (what, expr) in pending {
            match prom.query(&expr).await {
                Ok(series) if !series.is_empty() => {}
                Ok(_) => still.push((what, expr)),
                Err(e) => panic!("{what}: Prometheus refused the query: {e}\n{expr}"),
            }
        }
        pending = still;
        if pending.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no series after 30 s for:\n{}",
            pending
                .iter()
                .map(|(w, e)| format!("  {w}: {e}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The variables as Grafana fills them, then each pod in turn with payments:8080 chosen.
    let vars = variables(&d);
    let (sel, label) = label_values_parts(&vars["pod"]);
    assert_eq!(prom.label_values(&sel, &label).await, instances, "$pod");
    let (sel, label) = label_values_parts(&vars["service"]);
    let services = prom
        .label_values(&substitute(&sel, ".*", ".*", ".*"), &label)
        .await;
    assert!(services.contains("payments"), "$service: {services:?}");
    let (sel, label) = label_values_parts(&vars["port"]);
    let ports = prom
        .label_values(&substitute(&sel, ".*", "payments", ""), &label)
        .await;
    assert!(
        ports.contains("8080") && ports.contains("5432"),
        "$port: {ports:?}"
    );
    for (title, expr) in &targets {
        let mut some = false;
        for pod in &instances {
            let q = substitute(expr, pod, "payments", "8080");
            let series = prom
                .query(&q)
                .await
                .unwrap_or_else(|e| panic!("{title}: {e}\n{q}"));
            for s in &series {
                if let Some(i) = s["metric"]["instance"].as_str() {
                    assert_eq!(i, pod, "{title}: a series of another pod\n{q}");
                }
            }
            some |= !series.is_empty();
        }
        assert!(
            some,
            "{title}: no series for any single pod with payments:8080\n{expr}"
        );
    }

    // Every rule evaluates; the alerts the traffic calls for are active, and no other.
    let groups = prom.api("/api/v1/rules").await.unwrap();
    let mut evaluated = 0;
    for g in groups["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            evaluated += 1;
            assert_eq!(r["health"], "ok", "a rule failed to evaluate: {r}");
        }
    }
    assert_eq!(evaluated, rules.len(), "rules loaded: {groups}");
    let xds_instance = xds.admin_addr().to_string();
    prom.wait_alert(
        "AetherProxyXdsUpdateRejected",
        "instance",
        "two NACKs",
        |got| got.contains(&xds_instance),
    )
    .await;
    // port-not-exposed answers count with port="0": the port never became a cluster.
    prom.wait_alert(
        "AetherProxyHighErrorRatio",
        "port",
        "only 503 port-not-exposed for payments:7777",
        |got| got.contains("0"),
    )
    .await;
    // Pending counts: the test does not wait out `for`.
    let overloaded_instance = overloaded.admin_addr().to_string();
    for name in ["AetherProxyOverloaded", "AetherProxyNotReady"] {
        let got = prom
            .wait_alert(name, "instance", "the pod over its memory limit", |got| {
                got.contains(&overloaded_instance)
            })
            .await;
        let only = BTreeSet::from([overloaded_instance.clone()]);
        assert_eq!(got, only, "{name}: only the pod over its limit");
    }
    let alerts = prom.alerts().await;
    assert!(
        !alerts
            .iter()
            .any(|(n, ..)| n == "AetherProxyCertificateExpiresSoon"
                || n == "AetherProxyControlPlaneDisconnected"),
        "nothing calls for these yet: {alerts:?}"
    );
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    assert!(
        load_ok.load(Ordering::Relaxed) > 0,
        "the background load got no 200"
    );

    // Every metric and label the dashboard and the rules name is exported by the sidecars.
    let mut exported = BTreeMap::new();
    for p in [&client, &server, &xds, &overloaded] {
        let r = p.admin_get("/metrics").await.unwrap();
        assert_eq!(r.status.as_u16(), 200);
        exposition_labels(&r.text(), &mut exported);
    }
    let mut problems = Vec::new();
    let mut record_labels = BTreeMap::new();
    for r in &rules {
        let what = r.record.as_deref().or(r.alert.as_deref()).unwrap();
        let labels = check_expr(what, &r.expr, &exported, &record_labels, &mut problems);
        if let Some(name) = &r.record {
            record_labels.insert(name.clone(), labels);
        }
    }
    let no_records = BTreeMap::new();
    for (title, expr) in &targets {
        check_expr(title, expr, &exported, &no_records, &mut problems);
        // Filtered by service and port wherever the metric has them.
        for (metric, matchers) in promql_names(expr).0 {
            let labels = exported.get(&metric).cloned().unwrap_or_default();
            for (label, var) in [("service", "$service"), ("port", "$port")] {
                if labels.contains(label)
                    && !matchers
                        .iter()
                        .any(|(l, op, v)| l == label && op == "=~" && v == var)
                {
                    problems.push(format!(
                        "{title}: {metric} has {label} but is not filtered by {label}=~\"{var}\""
                    ));
                }
            }
        }
    }
    for (name, q) in &vars {
        let (sel, label) = label_values_parts(q);
        let labels = check_expr(
            &format!("variable {name}"),
            &sel,
            &exported,
            &no_records,
            &mut problems,
        );
        if !labels.contains(&label) {
            problems.push(format!("variable {name}: no label {label} on {sel}"));
        }
    }
    let texts = [
        fs::read_to_string(rules_path()).unwrap(),
        fs::read_to_string(deploy("grafana/aether-proxy.json")).unwrap(),
    ];
    for word in texts.iter().flat_map(|t| aether_words(t)) {
        let histogram = format!("{word}_bucket");
        if !exported.contains_key(&word) && !exported.contains_key(&histogram) {
            problems.push(format!("{word} is named but not exported"));
        }
    }
    assert!(
        problems.is_empty(),
        "names the sidecars do not export:\n{}\nexported: {exported:?}",
        problems.join("\n")
    );

    // The control plane gone: the xDS-fed pod is disconnected, the catalog-fed ones are not.
    cp.stop().await;
    let got = prom
        .wait_alert(
            "AetherProxyControlPlaneDisconnected",
            "instance",
            "the control plane stopped",
            |got| !got.is_empty(),
        )
        .await;
    assert_eq!(got, BTreeSet::from([xds_instance]), "only the xDS-fed pod");

    // The server pod's sidecar killed: its scrapes fail.
    let server_instance = server.admin_addr().to_string();
    drop(server);
    prom.wait_alert(
        "AetherProxyScrapeFailing",
        "instance",
        "the server sidecar killed",
        |got| got.contains(&server_instance),
    )
    .await;
    eprintln!("ops: live check took {:?}", started.elapsed());
}
