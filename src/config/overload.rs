//! `overload:` shedding inside a memory limit (SPEC section 13).

use serde::Deserialize;

use super::bytes;

/// `overload:` what the sidecar does as its memory use nears its limit. The thresholds are
/// shares of the limit; `docs/decisions/0012-overload-thresholds.md` explains the defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverloadConfig {
    /// False: never shed, whatever the limit.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Bytes (`67108864`) or a Kubernetes quantity (`64Mi`, `1G`); overrides the cgroup's limit.
    #[serde(default, deserialize_with = "bytes::deserialize_opt")]
    pub memory_limit: Option<u64>,
    /// Step 1 (refuse new connections and requests, release idle memory) from this share on.
    #[serde(default = "default_shed_at")]
    pub shed_at: f64,
    /// Step 2 (close the idlest client connections) from this share on.
    #[serde(default = "default_close_at")]
    pub close_at: f64,
    /// Step 1 ends this far below `shed_at`, so a sidecar at the edge does not flap.
    #[serde(default = "default_resume_gap")]
    pub resume_gap: f64,
}

fn default_true() -> bool {
    true
}
fn default_shed_at() -> f64 {
    0.85
}
fn default_close_at() -> f64 {
    0.95
}
fn default_resume_gap() -> f64 {
    0.05
}

impl Default for OverloadConfig {
    fn default() -> Self {
        OverloadConfig {
            enabled: true,
            memory_limit: None,
            shed_at: default_shed_at(),
            close_at: default_close_at(),
            resume_gap: default_resume_gap(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;

    #[test]
    fn overload_limits_take_bytes_or_quantities_and_thresholds_must_be_ordered() {
        let cfg = |o: &str| Config::parse(Path::new("cfg.yaml"), &format!("{ID}overload: {o}\n"));
        let limit = |o: &str| cfg(o).unwrap().overload.memory_limit;
        assert_eq!(limit("{memory_limit: 67108864}"), Some(64 << 20));
        assert_eq!(limit("{memory_limit: 64Mi}"), Some(64 << 20));
        assert_eq!(limit("{memory_limit: 1G}"), Some(1_000_000_000));
        assert_eq!(limit("{}"), None);
        let d = cfg("{}").unwrap().overload;
        assert!(d.enabled && d.shed_at == 0.85 && d.close_at == 0.95 && d.resume_gap == 0.05);
        let e = one_error(&format!("{ID}overload: {{memory_limit: 64MB}}\n"));
        assert!(e.contains("unknown unit"), "{e}");
        let e = one_error(&format!("{ID}overload: {{shed_at: 0.9, close_at: 0.8}}\n"));
        assert!(e.contains("0 < shed_at < close_at <= 1"), "{e}");
        let e = one_error(&format!("{ID}overload: {{resume_gap: 0.9}}\n"));
        assert!(e.contains("overload.resume_gap"), "{e}");
        let e = one_error(&format!("{ID}overload: {{memory_limit: 0}}\n"));
        assert!(e.contains("overload.memory_limit"), "{e}");
    }
}
