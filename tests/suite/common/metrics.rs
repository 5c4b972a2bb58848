//! The proxy's `/metrics`, read and waited on.

use std::time::Duration;

use super::{poll_until, Proxy, PACE};

/// The sum of the samples of metric `name` whose label set contains every `labels` item (such
/// as `result="ok"`); 0 while it has none.
pub async fn metric(p: &Proxy, name: &str, labels: &[&str]) -> f64 {
    samples(p, name, labels).await.unwrap_or(0.0)
}

/// Polls [`metric`] until `pred` holds for it (a metric without a matching sample never
/// does); returns its value, or panics after `limit` with the last value and the stderr tail.
pub async fn wait_metric(
    p: &Proxy,
    name: &str,
    labels: &[&str],
    limit: Duration,
    pred: impl Fn(f64) -> bool,
) -> f64 {
    let got = poll_until(limit, PACE, async || match samples(p, name, labels).await {
        Some(v) if pred(v) => Ok(v),
        last => Err(last),
    })
    .await;
    got.unwrap_or_else(|last| {
        panic!(
            "{name}{labels:?} is {} after {limit:?}; stderr tail:\n{}",
            last.map_or("without a sample".to_string(), |v| format!("still {v}")),
            p.stderr_tail(30)
        )
    })
}

/// The sum of the matching samples, `None` if there is none.
async fn samples(p: &Proxy, name: &str, labels: &[&str]) -> Option<f64> {
    let r = p.admin_get("/metrics").await.expect("GET /metrics");
    assert_eq!(r.status.as_u16(), 200, "/metrics: {r:?}");
    let values: Vec<f64> = r
        .text()
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| labels.iter().all(|kv| l.contains(kv)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}
