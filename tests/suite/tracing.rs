//! Trace context and spans (SPEC section 12): W3C `traceparent` across a client pod and a
//! server pod, and the spans both proxies export to a real OTLP receiver (a tonic server on
//! the OpenTelemetry collector protos) run by the test.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::mesh::*;
use crate::common::*;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::Span;

/// One exported span with the `service.name` of the resource it came under.
#[derive(Clone, Debug)]
struct Got {
    service: String,
    span: Span,
}

impl Got {
    fn attr(&self, key: &str) -> Option<Value> {
        self.span
            .attributes
            .iter()
            .find(|a| a.key == key)
            .and_then(|a| a.value.clone()?.value)
    }
    fn str_attr(&self, key: &str) -> Option<String> {
        match self.attr(key) {
            Some(Value::StringValue(s)) => Some(s),
            _ => None,
        }
    }
}

#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<Got>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.got.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.clone()?.value {
                    Some(Value::StringValue(s)) => Some(s),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    got.push(Got {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A real OTLP/gRPC trace receiver on a loopback address of its own.
struct Collector {
    addr: SocketAddr,
    receiver: Receiver,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    async fn start() -> Collector {
        let addr = SocketAddr::new(Net::fresh().ip(1), 4317);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("collector cannot bind {addr}: {e}"));
        let receiver = Receiver::default();
        let svc = TraceServiceServer::new(receiver.clone());
        let incoming = futures_util::stream::unfold(listener, |l| async move {
            Some((l.accept().await.map(|(s, _)| s), l))
        });
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .serve_with_incoming(svc, incoming)
                .await;
        });
        Collector {
            addr,
            receiver,
            task,
        }
    }

    fn spans(&self) -> Vec<Got> {
        self.receiver.got.lock().unwrap().clone()
    }

    /// Waits until at least `n` spans arrived; returns them all.
    async fn wait_spans(&self, n: usize) -> Vec<Got> {
        let what = format!("{n} span(s) at the collector");
        eventually_every(
            Duration::from_secs(10),
            Duration::from_millis(50),
            &what,
            async || {
                let got = self.spans();
                if got.len() >= n {
                    Ok(got)
                } else {
                    Err(format!("got {}: {got:#?}", got.len()))
                }
            },
        )
        .await
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn tracing_yaml(sample_rate: &str, otlp: Option<SocketAddr>) -> String {
    match otlp {
        Some(a) => format!("tracing: {{ sample_rate: {sample_rate}, otlp: \"{a}\" }}\n"),
        None => format!("tracing: {{ sample_rate: {sample_rate} }}\n"),
    }
}

async fn mesh(client: &str, server: &str) -> OnePodMesh {
    OnePodMesh::start_with(OnePodExtras {
        server_config: server,
        client_config: client,
        ..Default::default()
    })
    .await
}

/// `GET path` to the payments service through the client pod, with `headers`.
async fn call(m: &OnePodMesh, path: &str, headers: &[(&str, &str)]) -> Reply {
    let mut b = get(path).header("host", SVC);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    m.send(empty(b)).await
}

/// (trace id, parent id, flags) of a `traceparent` value, checked for its W3C shape.
fn parts(tp: &str) -> (String, String, String) {
    let p: Vec<&str> = tp.split('-').collect();
    assert!(
        p.len() == 4
            && p[0] == "00"
            && p[1].len() == 32
            && p[2].len() == 16
            && p[3].len() == 2
            && tp
                .bytes()
                .all(|b| b == b'-' || b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "not a version-00 traceparent: {tp:?}"
    );
    (p[1].into(), p[2].into(), p[3].into())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn one_of_kind(spans: &[Got], kind: SpanKind, path: &str) -> Got {
    let found: Vec<&Got> = spans
        .iter()
        .filter(|g| g.span.kind == kind as i32 && g.str_attr("url.path").as_deref() == Some(path))
        .collect();
    assert_eq!(found.len(), 1, "one {kind:?} span for {path}: {spans:#?}");
    found[0].clone()
}

const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const PARENT: &str = "b7ad6b7169203331";

#[tokio::test]
async fn a_new_trace_gets_a_client_span_and_a_server_span_under_it() {
    let c = Collector::start().await;
    let cfg = tracing_yaml("1", Some(c.addr));
    let m = mesh(&cfg, &cfg).await;
    let r = call(&m, "/new", &[]).await;
    assert_app_ok(&r, 8080, "GET /new");
    let tp = m.seen("/new").header("traceparent").map(str::to_string);
    let tp = tp.expect("the app got no traceparent");
    let (trace_id, app_parent, flags) = parts(&tp);
    assert_eq!(flags, "01", "sample_rate 1 samples every new trace");

    let spans = c.wait_spans(2).await;
    let client = one_of_kind(&spans, SpanKind::Client, "/new");
    let server = one_of_kind(&spans, SpanKind::Server, "/new");
    for s in [&client, &server] {
        assert_eq!(hex(&s.span.trace_id), trace_id, "{s:#?}");
        assert_eq!(s.span.span_id.len(), 8);
        assert_eq!(s.span.name, "GET payments.aether.internal");
        assert_eq!(
            s.str_attr("http.request.method").as_deref(),
            Some("GET"),
            "{s:#?}"
        );
        assert_eq!(
            s.str_attr("server.address").as_deref(),
            Some("payments.aether.internal")
        );
        assert_eq!(
            s.attr("http.response.status_code"),
            Some(Value::IntValue(200))
        );
        assert_eq!(
            s.span.status.clone().unwrap_or_default().code,
            StatusCode::Unset as i32
        );
        assert!(
            s.span.start_time_unix_nano > 0
                && s.span.end_time_unix_nano >= s.span.start_time_unix_nano,
            "{s:#?}"
        );
    }
    assert!(
        client.span.parent_span_id.is_empty(),
        "the client started the trace: a root span"
    );
    assert_eq!(
        server.span.parent_span_id, client.span.span_id,
        "the server span's parent is the client span"
    );
    assert_eq!(
        app_parent,
        hex(&server.span.span_id),
        "the app's parent is the server span"
    );
    assert_eq!(client.service, "frontend");
    assert_eq!(server.service, "payments");
    assert_eq!(
        client.str_attr("aether.peer.identity"),
        Some(m.certs.spiffe_id(PAYMENTS))
    );
    assert_eq!(
        server.str_attr("aether.peer.identity"),
        Some(m.certs.spiffe_id(FRONTEND))
    );
    // The span covers the exchange: it cannot be shorter than the app's delay.
    let r = call(&m, "/slow", &[("x-app-delay-ms", "200")]).await;
    assert_app_ok(&r, 8080, "GET /slow");
    let spans = c.wait_spans(4).await;
    let slow = one_of_kind(&spans, SpanKind::Client, "/slow");
    let took = slow.span.end_time_unix_nano - slow.span.start_time_unix_nano;
    assert!(took >= 200_000_000, "client span of /slow lasted {took} ns");

    // Both access-log lines name the trace and their own span.
    let client_line = m
        .client
        .wait_access_log(LOG_TIMEOUT, |v| v["path"] == "/new")
        .await;
    assert_eq!(client_line["trace_id"], trace_id.as_str(), "{client_line}");
    assert_eq!(
        client_line["span_id"],
        hex(&client.span.span_id).as_str(),
        "{client_line}"
    );
    let server_line = m
        .server
        .wait_access_log(LOG_TIMEOUT, |v| v["path"] == "/new")
        .await;
    assert_eq!(server_line["trace_id"], trace_id.as_str(), "{server_line}");
    assert_eq!(
        server_line["span_id"],
        hex(&server.span.span_id).as_str(),
        "{server_line}"
    );
    assert!(metric(&m.client, "aether_trace_spans_exported_total", &[]).await >= 2.0);
    assert_eq!(
        metric(&m.client, "aether_trace_spans_dropped_total", &[]).await,
        0.0
    );
}

#[tokio::test]
async fn server_errors_are_error_spans_with_the_reason() {
    let c = Collector::start().await;
    let cfg = tracing_yaml("1", Some(c.addr));
    let m = mesh(&cfg, &cfg).await;
    let r = call(&m, "/fail", &[("x-app-status", "503")]).await;
    assert_eq!(r.status.as_u16(), 503, "{r:?}");
    // An answer the client proxy makes itself: its reason is on the span.
    let r = get_h1(m.outbound(), "payments.aether.internal:7777", "/closed").await;
    assert_proxy_error(&r, 503, "port-not-exposed", "unexposed port");
    let spans = c.wait_spans(3).await;
    for kind in [SpanKind::Client, SpanKind::Server] {
        let s = one_of_kind(&spans, kind, "/fail");
        assert_eq!(
            s.span.status.clone().unwrap_or_default().code,
            StatusCode::Error as i32,
            "{s:#?}"
        );
        assert_eq!(
            s.attr("http.response.status_code"),
            Some(Value::IntValue(503))
        );
    }
    let s = one_of_kind(&spans, SpanKind::Client, "/closed");
    assert_eq!(
        s.str_attr("error.type").as_deref(),
        Some("port-not-exposed")
    );
    assert_eq!(
        s.span.status.clone().unwrap_or_default().code,
        StatusCode::Error as i32
    );
}

#[tokio::test]
async fn an_incoming_trace_keeps_its_id_and_the_client_span_hangs_under_its_parent() {
    let c = Collector::start().await;
    let cfg = tracing_yaml("0", Some(c.addr));
    let m = mesh(&cfg, &cfg).await;
    // Sampled by the caller: the proxies record spans even at sample_rate 0.
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    let r = call(&m, "/continued", &[("traceparent", &incoming)]).await;
    assert_app_ok(&r, 8080, "GET /continued");
    let seen = m.seen("/continued");
    let (trace_id, app_parent, flags) = parts(seen.header("traceparent").unwrap());
    assert_eq!(trace_id, TRACE, "the trace id is kept");
    assert_eq!(flags, "01");
    let spans = c.wait_spans(2).await;
    let client = one_of_kind(&spans, SpanKind::Client, "/continued");
    let server = one_of_kind(&spans, SpanKind::Server, "/continued");
    assert_eq!(hex(&client.span.trace_id), TRACE);
    assert_eq!(hex(&server.span.trace_id), TRACE);
    assert_eq!(
        hex(&client.span.parent_span_id),
        PARENT,
        "the client span's parent is the caller's"
    );
    assert_eq!(server.span.parent_span_id, client.span.span_id);
    assert_eq!(app_parent, hex(&server.span.span_id));
    assert_ne!(app_parent, PARENT);

    // An invalid traceparent counts as absent: the client side replaces it.
    let r = call(&m, "/invalid", &[("traceparent", "00-abc-def-01")]).await;
    assert_app_ok(&r, 8080, "GET /invalid");
    let seen = m.seen("/invalid");
    let (trace_id, _, flags) = parts(seen.header("traceparent").unwrap());
    assert_eq!(flags, "00", "a new trace at sample_rate 0");
    assert_ne!(trace_id, TRACE);
}

#[tokio::test]
async fn tracestate_and_b3_headers_arrive_unchanged() {
    let c = Collector::start().await;
    let cfg = tracing_yaml("1", Some(c.addr));
    let m = mesh(&cfg, &cfg).await;
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    let passed = [
        ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
        ("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7"),
        ("x-b3-spanid", "e457b5a2e4d86bd1"),
        ("x-b3-parentspanid", "05e3ac9a4f6e3b90"),
        ("x-b3-sampled", "1"),
        (
            "b3",
            "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90",
        ),
    ];
    let mut headers = vec![("traceparent", incoming.as_str())];
    headers.extend(passed);
    let r = call(&m, "/b3", &headers).await;
    assert_app_ok(&r, 8080, "GET /b3");
    let seen = m.seen("/b3");
    for (k, v) in passed {
        assert_eq!(seen.header_all(k), vec![v], "{k}");
    }
    // The traceparent itself was continued by the proxies' spans (so it was rewritten),
    // while the others were left alone.
    let (trace_id, parent, _) = parts(seen.header("traceparent").unwrap());
    assert_eq!(trace_id, TRACE);
    assert_ne!(parent, PARENT);
    c.wait_spans(2).await;
}

#[tokio::test]
async fn unsampled_requests_export_nothing_and_still_carry_traceparent() {
    let c = Collector::start().await;
    let cfg = tracing_yaml("0", Some(c.addr));
    let m = mesh(&cfg, &cfg).await;
    let r = call(&m, "/fresh", &[]).await;
    assert_app_ok(&r, 8080, "GET /fresh");
    let (_, _, flags) = parts(m.seen("/fresh").header("traceparent").unwrap());
    assert_eq!(flags, "00", "sample_rate 0 never samples a new trace");

    let incoming = format!("00-{TRACE}-{PARENT}-00");
    let r = call(&m, "/unsampled", &[("traceparent", &incoming)]).await;
    assert_app_ok(&r, 8080, "GET /unsampled");
    assert_eq!(
        m.seen("/unsampled").header("traceparent"),
        Some(incoming.as_str()),
        "an unsampled trace passes as it came"
    );
    let line = m
        .client
        .wait_access_log(LOG_TIMEOUT, |v| v["path"] == "/unsampled")
        .await;
    assert_eq!(line["trace_id"], TRACE, "{line}");
    assert!(line["span_id"].is_null(), "{line}");
    // Two batch periods: anything queued would have been sent by now.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(c.spans().is_empty(), "{:#?}", c.spans());
    for p in [&m.client, &m.server] {
        assert_eq!(
            metric(p, "aether_trace_spans_exported_total", &[]).await,
            0.0
        );
        assert_eq!(
            metric(p, "aether_trace_spans_dropped_total", &[]).await,
            0.0
        );
    }
}

#[tokio::test]
async fn without_a_collector_traceparent_passes_unchanged() {
    let cfg = tracing_yaml("1", None);
    let m = mesh(&cfg, &cfg).await;
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    let r = call(&m, "/as-is", &[("traceparent", &incoming)]).await;
    assert_app_ok(&r, 8080, "GET /as-is");
    assert_eq!(
        m.seen("/as-is").header("traceparent"),
        Some(incoming.as_str()),
        "no span recorded, so no new parent id"
    );
    // The client side still starts traces, and both access-log lines name them.
    let r = call(&m, "/started", &[]).await;
    assert_app_ok(&r, 8080, "GET /started");
    let (trace_id, _, flags) = parts(m.seen("/started").header("traceparent").unwrap());
    assert_eq!(flags, "01");
    for p in [&m.client, &m.server] {
        let line = p
            .wait_access_log(LOG_TIMEOUT, |v| v["path"] == "/started")
            .await;
        assert_eq!(line["trace_id"], trace_id.as_str(), "{line}");
        assert!(line["span_id"].is_null(), "{line}");
    }
}

#[tokio::test]
async fn a_collector_that_is_down_or_silent_slows_no_request_and_drops_are_counted() {
    // The client pod's collector accepts connections and never answers; the server pod's
    // has nothing listening.
    let net = Net::fresh();
    let silent_addr = SocketAddr::new(net.ip(1), 4317);
    let silent = tokio::net::TcpListener::bind(silent_addr).await.unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            conns.push(s);
        }
    });
    let down_addr = SocketAddr::new(net.ip(2), 4317);
    let m = mesh(
        &tracing_yaml("1", Some(silent_addr)),
        &tracing_yaml("1", Some(down_addr)),
    )
    .await;
    let mut slowest = Duration::ZERO;
    let started = Instant::now();
    // Spread over more than one batch period, so export attempts overlap requests.
    while started.elapsed() < Duration::from_secs(3) {
        let t = Instant::now();
        let r = call(&m, "/during", &[]).await;
        slowest = slowest.max(t.elapsed());
        assert_app_ok(&r, 8080, "GET /during");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("slowest request while the collectors fail: {slowest:?}");
    assert!(
        slowest < Duration::from_millis(500),
        "a request took {slowest:?}"
    );
    // A drop counted on both sides, within 15 s in all.
    let deadline = Instant::now() + Duration::from_secs(15);
    for p in [&m.client, &m.server] {
        let limit = deadline.saturating_duration_since(Instant::now());
        wait_metric(p, "aether_trace_spans_dropped_total", &[], limit, |v| {
            v > 0.0
        })
        .await;
        assert_eq!(
            metric(p, "aether_trace_spans_exported_total", &[]).await,
            0.0
        );
    }
    held.abort();
}

#[test]
fn check_accepts_a_tracing_section_and_names_what_is_wrong_in_one() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let base = std::fs::read_to_string(repo.join("configs/frontend.yaml")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cfg.yaml");
    for (tracing, error) in [
        ("{ sample_rate: 0.5, otlp: \"127.0.0.1:4317\" }", None),
        ("{}", None),
        (
            "{ sample_rate: 2 }",
            Some("tracing.sample_rate: 2 is not in 0..=1"),
        ),
        (
            "{ otlp: collector }",
            Some("tracing.otlp: \"collector\" is not host:port"),
        ),
        (
            "{ otlp: \"c:4317\", sampling: 1 }",
            Some("tracing.sampling: unknown field `sampling`"),
        ),
    ] {
        std::fs::write(&path, format!("{base}\ntracing: {tracing}\n")).unwrap();
        let o = std::process::Command::new(BIN)
            .current_dir(repo)
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        match error {
            None => assert!(o.status.success(), "{tracing}: {stderr}"),
            Some(e) => {
                assert_eq!(o.status.code(), Some(1), "{tracing}: {stderr}");
                assert!(stderr.contains(e), "{tracing}: {stderr}");
                assert!(!stderr.contains("panicked"), "{stderr}");
            }
        }
    }
}

/// Spans still queued when a sidecar drains reach the collector before it exits: a batch
/// otherwise waits up to a second for company, and the process would leave without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_queued_at_drain_reach_the_collector_before_exit() {
    let c = Collector::start().await;
    let cfg = format!(
        "{}drain: {{ notify: 100ms, timeout: 5s }}\n",
        tracing_yaml("1", Some(c.addr))
    );
    let mut m = mesh(&cfg, &cfg).await;
    let r = call(&m, "/last", &[]).await;
    assert_app_ok(&r, 8080, "GET /last");
    for p in [&m.client, &m.server] {
        p.signal(libc::SIGTERM);
    }
    for p in [&mut m.client, &mut m.server] {
        let exit = p.wait_exit(Duration::from_secs(10)).await;
        assert!(exit.is_some_and(|e| e.success()), "drain exit: {exit:?}");
    }
    let spans = c.spans();
    one_of_kind(&spans, SpanKind::Client, "/last");
    one_of_kind(&spans, SpanKind::Server, "/last");
}
