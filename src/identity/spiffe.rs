//! `SpiffeId`: a workload identity, `spiffe://<trust domain>/<path>`, parsed once where it enters
//! the proxy (config, catalog, peer certificates) and compared as a value everywhere else.

use std::fmt;
use std::sync::Arc;

/// Why a string is not an acceptable SPIFFE id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpiffeIdError {
    #[error("{0:?} is not a SPIFFE id (spiffe://<trust domain>/<path>)")]
    NotSpiffe(String),
    #[error("{0:?} has no workload path")]
    NoPath(String),
    #[error("{id:?} is outside the trust domain {trust_domain:?}")]
    OtherTrustDomain { id: String, trust_domain: String },
}

/// A SPIFFE id. Cheap to clone (shared text); equal when the text is equal.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId(Arc<str>);

const SCHEME: &str = "spiffe://";

impl SpiffeId {
    /// Checks the shape: the scheme, a trust domain and a non-empty path.
    pub fn parse(s: &str) -> Result<SpiffeId, SpiffeIdError> {
        let Some(rest) = s.strip_prefix(SCHEME) else {
            return Err(SpiffeIdError::NotSpiffe(s.to_string()));
        };
        let (td, path) = rest.split_once('/').unwrap_or((rest, ""));
        if td.is_empty() {
            return Err(SpiffeIdError::NotSpiffe(s.to_string()));
        }
        if path.is_empty() {
            return Err(SpiffeIdError::NoPath(s.to_string()));
        }
        Ok(SpiffeId(s.into()))
    }

    /// `parse`, and the id must belong to `trust_domain`.
    pub fn parse_in(s: &str, trust_domain: &str) -> Result<SpiffeId, SpiffeIdError> {
        let id = SpiffeId::parse(s)?;
        id.check_trust_domain(trust_domain)?;
        Ok(id)
    }

    pub fn check_trust_domain(&self, trust_domain: &str) -> Result<(), SpiffeIdError> {
        if self.trust_domain() == trust_domain {
            Ok(())
        } else {
            Err(SpiffeIdError::OtherTrustDomain {
                id: self.0.to_string(),
                trust_domain: trust_domain.to_string(),
            })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn trust_domain(&self) -> &str {
        let rest = &self.0[SCHEME.len()..];
        rest.split_once('/').map_or(rest, |(td, _)| td)
    }

    /// The last path segment: the service account for `/ns/<ns>/sa/<sa>` ids, used as the
    /// workload's service name in metrics.
    pub fn last_segment(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or_default()
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl PartialEq<str> for SpiffeId {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl<'de> serde::Deserialize<'de> for SpiffeId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        SpiffeId::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for SpiffeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_and_trust_domain() {
        let id = SpiffeId::parse_in(
            "spiffe://aether.local/ns/default/sa/payments",
            "aether.local",
        )
        .unwrap();
        assert_eq!(id.trust_domain(), "aether.local");
        assert_eq!(id.last_segment(), "payments");
        assert_eq!(id, *"spiffe://aether.local/ns/default/sa/payments");
        assert!(matches!(
            SpiffeId::parse("frontend"),
            Err(SpiffeIdError::NotSpiffe(_))
        ));
        assert!(matches!(
            SpiffeId::parse("spiffe:///ns/a"),
            Err(SpiffeIdError::NotSpiffe(_))
        ));
        assert!(matches!(
            SpiffeId::parse("spiffe://aether.local"),
            Err(SpiffeIdError::NoPath(_))
        ));
        let e = SpiffeId::parse_in("spiffe://other/ns/a/sa/b", "aether.local").unwrap_err();
        assert!(e.to_string().contains("outside the trust domain"), "{e}");
    }
}
