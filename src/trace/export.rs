//! The OTLP exporter: finished spans go into a bounded queue (a full queue drops the span and
//! counts it, never waits), and one background task sends them in batches over gRPC
//! (`TraceService/Export`), reconnecting with backoff while the collector is unreachable.

use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{
    span, status, ResourceSpans, ScopeSpans, Span, Status,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use super::metrics::metrics;
use super::span::{Finished, Side};

/// Spans waiting for export; past it new spans are dropped (and counted).
pub const QUEUE: usize = 2048;
/// Most spans in one export request.
pub const MAX_BATCH: usize = 512;
/// A batch goes out at the latest this long after its first span was queued.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Collectors answer in milliseconds; these only bound a collector that never does.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// OTLP span flags: the parent's remoteness is known, and the parent is remote (always, for a
/// proxy: its parent is the app or the other proxy).
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
const FLAG_IS_REMOTE: u32 = 0x200;

pub struct Exporter {
    queue: mpsc::Sender<Finished>,
    /// Asks the task to send everything queued now, and to say when it has.
    flushes: mpsc::Sender<oneshot::Sender<()>>,
}

/// What the export task reads: the spans, and requests to flush them.
pub struct Queue {
    spans: mpsc::Receiver<Finished>,
    flushes: mpsc::Receiver<oneshot::Sender<()>>,
}

impl Exporter {
    /// An exporter and the receiving end of its queue (what the export task reads).
    pub fn with_queue(capacity: usize) -> (Exporter, Queue) {
        let (queue, spans) = mpsc::channel(capacity);
        let (flush, flushes) = mpsc::channel(1);
        (
            Exporter {
                queue,
                flushes: flush,
            },
            Queue { spans, flushes },
        )
    }

    /// Sends what is queued now, waiting at most `limit` (the drain's, at exit: a batch
    /// otherwise waits up to [`FLUSH_EVERY`] and would be lost with the process).
    pub async fn flush(&self, limit: Duration) -> bool {
        let (ack, done) = oneshot::channel();
        let asked = tokio::time::timeout(limit, self.flushes.send(ack));
        let deadline = Instant::now() + limit;
        matches!(asked.await, Ok(Ok(())))
            && matches!(tokio::time::timeout_at(deadline, done).await, Ok(Ok(())))
    }

    /// Starts the export task for the collector at `addr` (`host:port`, plaintext gRPC);
    /// spans are reported under `service`. Needs a running tokio runtime.
    pub fn spawn(addr: &str, service: &str) -> Exporter {
        let (exporter, rx) = Exporter::with_queue(QUEUE);
        let task = Task {
            endpoint: format!("http://{addr}"),
            resource: Resource {
                attributes: vec![string_attr("service.name", service.to_string())],
                ..Default::default()
            },
            client: None,
            failures: 0,
            retry_at: Instant::now(),
        };
        tokio::spawn(task.run(rx));
        exporter
    }

    /// Queues a finished span; a full queue (or a stopped task) drops it and counts it.
    pub fn push(&self, span: Finished) {
        if self.queue.try_send(span).is_err() {
            metrics().dropped.inc();
        }
    }
}

struct Task {
    endpoint: String,
    resource: Resource,
    client: Option<TraceServiceClient<Channel>>,
    /// Failed connects or exports since the collector last answered.
    failures: u32,
    /// No connect is tried before this.
    retry_at: Instant,
}

impl Task {
    async fn run(mut self, mut q: Queue) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            let mut flush = None;
            tokio::select! {
                n = q.spans.recv_many(&mut batch, MAX_BATCH) => if n == 0 {
                    return;
                },
                Some(ack) = q.flushes.recv() => flush = Some(ack),
            }
            let deadline = Instant::now() + FLUSH_EVERY;
            while flush.is_none() && batch.len() < MAX_BATCH {
                let room = MAX_BATCH - batch.len();
                tokio::select! {
                    r = tokio::time::timeout_at(deadline, q.spans.recv_many(&mut batch, room)) => {
                        match r {
                            Ok(0) | Err(_) => break,
                            Ok(_) => {}
                        }
                    }
                    Some(ack) = q.flushes.recv() => flush = Some(ack),
                }
            }
            let Some(ack) = flush else {
                self.send(&mut batch).await;
                continue;
            };
            // Everything queued before the flush was asked for goes now, in batches.
            loop {
                while batch.len() < MAX_BATCH {
                    match q.spans.try_recv() {
                        Ok(span) => batch.push(span),
                        Err(_) => break,
                    }
                }
                if batch.is_empty() {
                    break;
                }
                self.send(&mut batch).await;
            }
            let _ = ack.send(());
        }
    }

    /// Exports `batch` (emptying it) and counts the outcome.
    async fn send(&mut self, batch: &mut Vec<Finished>) {
        {
            let n = batch.len() as u64;
            let spans: Vec<Span> = batch.drain(..).map(to_proto).collect();
            let m = metrics();
            match self.export(spans).await {
                Ok(rejected) => {
                    let rejected = rejected.min(n);
                    m.exported.inc_by(n - rejected);
                    m.dropped.inc_by(rejected);
                }
                Err(e) => {
                    m.dropped.inc_by(n);
                    if self.failures == 1 {
                        tracing::warn!("span export to {} failed: {e}", self.endpoint);
                    } else {
                        tracing::debug!("span export to {} failed: {e}", self.endpoint);
                    }
                }
            }
        }
    }

    /// Sends one batch; `Ok` holds how many spans the collector rejected. While the collector
    /// is unreachable and its backoff runs, batches fail at once (and are dropped).
    async fn export(&mut self, spans: Vec<Span>) -> Result<u64, String> {
        let client = match &mut self.client {
            Some(c) => c,
            None => {
                if Instant::now() < self.retry_at {
                    return Err("collector unreachable, waiting to reconnect".into());
                }
                let connected = match Endpoint::from_shared(self.endpoint.clone()) {
                    Ok(e) => {
                        let e = e.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true);
                        tokio::time::timeout(CONNECT_TIMEOUT, e.connect())
                            .await
                            .map_err(|_| "connect timed out".to_string())
                            .and_then(|r| r.map_err(|e| format!("connect: {e}")))
                    }
                    Err(e) => Err(format!("bad address: {e}")),
                };
                match connected {
                    Ok(ch) => self.client.insert(TraceServiceClient::new(ch)),
                    Err(e) => return Err(self.failed(e)),
                }
            }
        };
        let req = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "aether-proxy".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..Default::default()
                    }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        match tokio::time::timeout(EXPORT_TIMEOUT, client.export(req)).await {
            Ok(Ok(resp)) => {
                self.failures = 0;
                Ok(resp
                    .into_inner()
                    .partial_success
                    .map_or(0, |p| p.rejected_spans.max(0) as u64))
            }
            Ok(Err(status)) => Err(self.failed(format!("export: {status}"))),
            Err(_) => Err(self.failed("export timed out".into())),
        }
    }

    /// Forgets the connection and schedules the next connect: full jitter from 0.5 s, doubling
    /// up to 30 s.
    fn failed(&mut self, e: String) -> String {
        self.client = None;
        self.failures = self.failures.saturating_add(1);
        let cap = Duration::from_millis(500)
            .saturating_mul(1u32 << self.failures.min(7).saturating_sub(1))
            .min(Duration::from_secs(30));
        self.retry_at = Instant::now() + cap.mul_f64(fastrand::f64());
        e
    }
}

fn string_attr(key: &str, v: String) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v)),
        }),
        ..Default::default()
    }
}

fn int_attr(key: &str, v: i64) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::IntValue(v)),
        }),
        ..Default::default()
    }
}

/// The authority without its port.
fn host_of(authority: &str) -> &str {
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// The OTLP span, named and attributed after OpenTelemetry's HTTP conventions.
pub fn to_proto(f: Finished) -> Span {
    let info = f.info;
    let host = host_of(&info.authority);
    let mut attributes = vec![
        string_attr("http.request.method", info.method.as_str().to_string()),
        string_attr("url.path", info.path),
        int_attr("http.response.status_code", i64::from(info.status)),
        string_attr("server.address", host.to_string()),
    ];
    if let Some(e) = info.error {
        attributes.push(string_attr("error.type", e.to_string()));
    }
    if let Some(peer) = &info.peer {
        attributes.push(string_attr(
            "aether.peer.identity",
            peer.as_str().to_string(),
        ));
    }
    let status = if info.status >= 500 {
        Status {
            code: status::StatusCode::Error as i32,
            message: info.error.unwrap_or_default().to_string(),
        }
    } else {
        Status::default()
    };
    let mut flags = u32::from(f.flags) | FLAG_HAS_IS_REMOTE;
    if f.parent_id.is_some() {
        flags |= FLAG_IS_REMOTE;
    }
    Span {
        trace_id: f.trace_id.to_vec(),
        span_id: f.span_id.to_vec(),
        parent_span_id: f.parent_id.map(|p| p.to_vec()).unwrap_or_default(),
        flags,
        name: format!("{} {host}", info.method),
        kind: match f.side {
            Side::Client => span::SpanKind::Client,
            Side::Server => span::SpanKind::Server,
        } as i32,
        start_time_unix_nano: f.start_unix_nanos,
        end_time_unix_nano: f.end_unix_nanos,
        attributes,
        status: Some(status),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::span::SpanInfo;

    fn finished(status: u16, error: Option<&'static str>) -> Finished {
        Finished {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_id: None,
            flags: 1,
            side: Side::Client,
            start_unix_nanos: 10,
            end_unix_nanos: 20,
            info: SpanInfo {
                method: http::Method::GET,
                authority: "payments.aether.internal:9090".into(),
                path: "/pay".into(),
                status,
                error,
                peer: None,
            },
        }
    }

    #[test]
    fn spans_follow_the_http_conventions() {
        let s = to_proto(finished(200, None));
        assert_eq!(s.name, "GET payments.aether.internal");
        assert_eq!(s.kind, span::SpanKind::Client as i32);
        assert!(s.parent_span_id.is_empty());
        assert_eq!(s.status.unwrap().code, status::StatusCode::Unset as i32);
        let s = to_proto(finished(503, Some("no-healthy-endpoints")));
        assert_eq!(s.status.unwrap().code, status::StatusCode::Error as i32);
        assert!(s.attributes.iter().any(|a| a.key == "error.type"));
    }

    #[tokio::test]
    async fn a_full_queue_drops_and_counts() {
        let (e, _rx) = Exporter::with_queue(1);
        let before = metrics().dropped.get();
        e.push(finished(200, None));
        e.push(finished(200, None));
        assert_eq!(metrics().dropped.get(), before + 1);
    }
}
