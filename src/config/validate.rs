//! The checks a configuration must pass after parsing, beyond what its types enforce; every
//! error names the file and the field.

use std::path::Path;

use super::listeners::Protocol;
use super::Config;
use crate::validation::{FieldError, Origin};

impl Config {
    pub(super) fn validate(&self, file: &Path) -> Vec<FieldError> {
        let origin = Origin::File(file.to_path_buf());
        let mut errs = Vec::new();
        let mut err =
            |field: String, reason: String| errs.push(FieldError::new(&origin, field, reason));
        let id = &self.identity;
        match (&id.cert, &id.key, &id.ca, &id.sds) {
            (Some(_), Some(_), Some(_), None) | (None, None, None, Some(_)) => {}
            (_, _, _, Some(_)) => err(
                "identity.sds".into(),
                "either cert, key and ca files or sds, not both".into(),
            ),
            _ => err(
                "identity".into(),
                "needs cert, key and ca (files) or sds (a secret discovery server)".into(),
            ),
        }
        if self.catalog.is_none() && self.discovery.is_none() {
            err(
                "catalog".into(),
                "missing field `catalog` (or `discovery` for a control plane)".into(),
            );
        }
        if !is_dns_name(&self.mesh_domain) {
            err(
                "mesh_domain".into(),
                format!("{:?} is not a domain name", self.mesh_domain),
            );
        }
        if !is_dns_name(&self.trust_domain) {
            err(
                "trust_domain".into(),
                format!("{:?} is not a trust domain", self.trust_domain),
            );
        }
        if self.inbound.default_port == 0 {
            err(
                "inbound.default_port".into(),
                "port must be in 1..65535".into(),
            );
        }
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.inbound.ports.iter().enumerate() {
            if p.port == 0 {
                err(
                    format!("inbound.ports[{i}].port"),
                    "port must be in 1..65535".into(),
                );
            } else if !seen.insert(p.port) {
                err(
                    format!("inbound.ports[{i}].port"),
                    format!("duplicate port {}", p.port),
                );
            }
            for (j, id) in p.allow.iter().enumerate() {
                if let Err(reason) = id.check_trust_domain(&self.trust_domain) {
                    err(format!("inbound.ports[{i}].allow[{j}]"), reason.to_string());
                }
            }
            if let Some(upgrades) = &p.upgrades {
                if matches!(p.protocol, Protocol::H2 | Protocol::Tcp) {
                    err(
                        format!("inbound.ports[{i}].upgrades"),
                        "only http1 and auto ports tunnel HTTP/1.1 upgrades".into(),
                    );
                }
                for (j, t) in upgrades.iter().enumerate() {
                    let token = t.split('/').next().unwrap_or_default();
                    if token.eq_ignore_ascii_case("h2c") {
                        err(
                            format!("inbound.ports[{i}].upgrades[{j}]"),
                            "h2c is never tunnelled: HTTP must stay HTTP through the proxy".into(),
                        );
                    } else if t.is_empty() || !t.bytes().all(is_tchar_or_slash) {
                        err(
                            format!("inbound.ports[{i}].upgrades[{j}]"),
                            format!("{t:?} is not an upgrade token (RFC 9110 7.8)"),
                        );
                    }
                }
            }
        }
        if !self
            .inbound
            .ports
            .iter()
            .any(|p| p.port == self.inbound.default_port)
        {
            err(
                "inbound.default_port".into(),
                format!(
                    "default port {} is not listed in inbound.ports",
                    self.inbound.default_port
                ),
            );
        }
        let mut seen = std::collections::HashSet::new();
        if self.readiness.required_listeners.len() > 16 {
            err(
                "readiness.required_listeners".into(),
                "at most 16 ports".into(),
            );
        }
        for (i, p) in self.readiness.required_listeners.iter().enumerate() {
            if *p == 0 {
                err(
                    format!("readiness.required_listeners[{i}]"),
                    "port must be in 1..65535".into(),
                );
            } else if !seen.insert(*p) {
                err(
                    format!("readiness.required_listeners[{i}]"),
                    format!("duplicate port {p}"),
                );
            }
        }
        let rate = self.tracing.sample_rate;
        if !(0.0..=1.0).contains(&rate) {
            err(
                "tracing.sample_rate".into(),
                format!("{rate} is not in 0..=1"),
            );
        }
        let o = &self.overload;
        if !(o.shed_at > 0.0 && o.shed_at < o.close_at && o.close_at <= 1.0) {
            err(
                "overload".into(),
                format!(
                    "shed_at {} and close_at {} must satisfy 0 < shed_at < close_at <= 1",
                    o.shed_at, o.close_at
                ),
            );
        }
        if !(0.0..o.shed_at).contains(&o.resume_gap) {
            err(
                "overload.resume_gap".into(),
                format!("{} is not in 0..shed_at", o.resume_gap),
            );
        }
        if o.memory_limit == Some(0) {
            err(
                "overload.memory_limit".into(),
                "0 bytes; leave it out to use the cgroup's limit, or set enabled: false".into(),
            );
        }
        if let Some(dns) = &self.dns {
            if dns.listen.port() == 0 {
                err("dns.listen".into(), "port must be in 1..65535".into());
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, s) in self.source_identities.iter().enumerate() {
            if !seen.insert(s.source) {
                err(
                    format!("source_identities[{i}].source"),
                    format!("duplicate source {}", s.source),
                );
            }
        }
        errs
    }
}

/// A byte of an upgrade token: an RFC 9110 `tchar`, or the `/` before a version.
fn is_tchar_or_slash(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~/".contains(&b)
}

/// Lower-case DNS-ish name: labels of `[a-z0-9-]`, separated by dots.
fn is_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn upgrade_tokens_are_checked() {
        let c = Config::parse(
            Path::new("cfg.yaml"),
            &format!(
                "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto, upgrades: [WebSocket, x-echo]}}\n"
            ),
        )
        .unwrap();
        assert_eq!(c.inbound.ports[0].upgrade_tokens(), ["websocket", "x-echo"]);
        let c = Config::parse(Path::new("cfg.yaml"), ID).unwrap();
        assert_eq!(c.inbound.ports[0].upgrade_tokens(), ["websocket"]);
        let e = one_error(&format!(
            "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto, upgrades: [websocket, h2c]}}\n"
        ));
        assert!(
            e.starts_with("cfg.yaml: inbound.ports[0].upgrades[1]: h2c is never tunnelled"),
            "{e}"
        );
        let e = one_error(&format!(
            "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto, upgrades: [\"a b\"]}}\n"
        ));
        assert!(e.contains("is not an upgrade token"), "{e}");
        let e = errors(&format!(
            "{ID}inbound:\n  ports:\n    - {{port: 8080, protocol: auto}}\n    - {{port: 9090, protocol: h2, upgrades: [websocket]}}\n"
        ));
        assert!(
            e.iter().any(|e| e
                == "cfg.yaml: inbound.ports[1].upgrades: only http1 and auto ports tunnel HTTP/1.1 upgrades"),
            "{e:?}"
        );
    }

    #[test]
    fn ports_are_checked() {
        let e = errors(&format!(
            "{ID}inbound:\n  default_port: 8081\n  ports:\n    - {{port: 8080, protocol: auto}}\n    - {{port: 8080, protocol: h2}}\n    - {{port: 0, protocol: tcp}}\n"
        ));
        assert!(
            e.iter()
                .any(|e| e == "cfg.yaml: inbound.ports[1].port: duplicate port 8080"),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|e| e == "cfg.yaml: inbound.ports[2].port: port must be in 1..65535"),
            "{e:?}"
        );
        assert!(
            e.iter().any(|e| e
                .starts_with("cfg.yaml: inbound.default_port: default port 8081 is not listed")),
            "{e:?}"
        );
        let e = one_error(&format!(
            "{ID}inbound:\n  ports: [{{port: 8080, protocol: quic}}]\n"
        ));
        assert!(
            e.starts_with("cfg.yaml: inbound.ports[0].protocol: unknown variant `quic`"),
            "{e}"
        );
    }

    #[test]
    fn identities_must_be_in_the_trust_domain() {
        let e = one_error(&format!(
            "{ID}inbound:\n  ports: [{{port: 8080, protocol: auto, allow: [spiffe://other.td/ns/a/sa/b]}}]\n"
        ));
        assert!(
            e.starts_with("cfg.yaml: inbound.ports[0].allow[0]: ")
                && e.contains("outside the trust domain"),
            "{e}"
        );
        let e = one_error(&format!(
            "{ID}inbound:\n  ports: [{{port: 8080, protocol: auto, allow: [frontend]}}]\n"
        ));
        assert!(e.contains("is not a SPIFFE id"), "{e}");
    }

    #[test]
    fn required_listeners_are_bounded_and_unique() {
        let e = one_error(&format!(
            "{ID}readiness: {{required_listeners: [8080, 8080]}}\n"
        ));
        assert_eq!(
            e,
            "cfg.yaml: readiness.required_listeners[1]: duplicate port 8080"
        );
        let e = one_error(&format!("{ID}readiness: {{required_listeners: [0]}}\n"));
        assert_eq!(
            e,
            "cfg.yaml: readiness.required_listeners[0]: port must be in 1..65535"
        );
        let e = one_error(&format!("{ID}readiness: {{required_listeners: [65536]}}\n"));
        assert!(
            e.starts_with("cfg.yaml: readiness.required_listeners[0]: "),
            "{e}"
        );
        let many: Vec<String> = (1..=17).map(|p| p.to_string()).collect();
        let e = one_error(&format!(
            "{ID}readiness: {{required_listeners: [{}]}}\n",
            many.join(",")
        ));
        assert_eq!(
            e,
            "cfg.yaml: readiness.required_listeners: at most 16 ports"
        );
        assert!(errors(&format!(
            "{ID}readiness: {{required_listeners: [1, 65535]}}\n"
        ))
        .is_empty());
    }
}
