//! `tracing:` the sample rate of new traces and the OTLP collector spans go to.

use std::fmt;

use serde::Deserialize;

/// The sample rate of traces the client side starts, unless `tracing.sample_rate` says.
pub const DEFAULT_SAMPLE_RATE: f64 = 0.01;

/// `tracing: { sample_rate, otlp }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The share of new traces (requests without `traceparent`) marked sampled, 0..=1.
    #[serde(default = "default_sample_rate")]
    pub sample_rate: f64,
    /// The OTLP/gRPC collector (`host:port`, plaintext); no spans are exported without it.
    #[serde(default)]
    pub otlp: Option<HostPort>,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            sample_rate: DEFAULT_SAMPLE_RATE,
            otlp: None,
        }
    }
}

fn default_sample_rate() -> f64 {
    DEFAULT_SAMPLE_RATE
}

/// `host:port` with a port in 1..65535 (the host is a name or an address, IPv6 in brackets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort(String);

impl HostPort {
    pub fn parse(s: &str) -> Result<HostPort, String> {
        let bad = || format!("{s:?} is not host:port");
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let host_ok = match host.strip_prefix('[') {
            Some(v6) => v6
                .strip_suffix(']')
                .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok()),
            None => {
                !host.is_empty()
                    && host
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
            }
        };
        let port_ok = !port.starts_with('0')
            && port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u16>().is_ok_and(|p| p > 0);
        if host_ok && port_ok {
            Ok(HostPort(s.to_string()))
        } else {
            Err(bad())
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for HostPort {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HostPort::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;

    #[test]
    fn tracing_is_optional_and_checked() {
        let c = Config::parse(Path::new("cfg.yaml"), ID).unwrap();
        assert_eq!(c.tracing.sample_rate, 0.01);
        assert!(c.tracing.otlp.is_none());
        let c = Config::parse(
            Path::new("cfg.yaml"),
            &format!(
                "{ID}tracing: {{sample_rate: 1, otlp: \"otel-collector.observability:4317\"}}\n"
            ),
        )
        .unwrap();
        assert_eq!(c.tracing.sample_rate, 1.0);
        assert_eq!(
            c.tracing.otlp.unwrap().as_str(),
            "otel-collector.observability:4317"
        );
        assert!(errors(&format!("{ID}tracing: {{otlp: \"[::1]:4317\"}}\n")).is_empty());
        for (yaml, want) in [
            (
                "{sample_rate: 1.5}",
                "cfg.yaml: tracing.sample_rate: 1.5 is not in 0..=1",
            ),
            (
                "{sample_rate: -0.1}",
                "cfg.yaml: tracing.sample_rate: -0.1 is not in 0..=1",
            ),
            (
                "{sample_rate: .nan}",
                "cfg.yaml: tracing.sample_rate: NaN is not in 0..=1",
            ),
            (
                "{otlp: collector}",
                "cfg.yaml: tracing.otlp: \"collector\" is not host:port",
            ),
            (
                "{otlp: \"c:0\"}",
                "cfg.yaml: tracing.otlp: \"c:0\" is not host:port",
            ),
            (
                "{otlp: \"http://c:4317\"}",
                "cfg.yaml: tracing.otlp: \"http://c:4317\" is not host:port",
            ),
            ("{sample_rate: often}", "cfg.yaml: tracing.sample_rate: "),
            (
                "{endpoint: x}",
                "cfg.yaml: tracing.endpoint: unknown field `endpoint`",
            ),
        ] {
            let e = one_error(&format!("{ID}tracing: {yaml}\n"));
            assert!(e.starts_with(want), "{yaml}: {e}");
        }
    }
}
