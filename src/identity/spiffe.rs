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
    #[error("{0:?}: a trust domain is [a-z0-9._-]+")]
    BadTrustDomain(String),
    #[error("{0:?}: path segments are non-empty [A-Za-z0-9._-], never `.` or `..`")]
    BadPath(String),
    #[error("a SPIFFE id is at most {MAX_LEN} bytes")]
    TooLong,
    #[error("{id:?} is outside the trust domain {trust_domain:?}")]
    OtherTrustDomain { id: String, trust_domain: String },
}

/// A SPIFFE id. Cheap to clone (shared text); equal when the text is equal.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId(Arc<str>);

const SCHEME: &str = "spiffe://";

/// The SPIFFE standard's limit on an id's length.
pub const MAX_LEN: usize = 2048;

impl SpiffeId {
    /// Checks the shape strictly (SPEC section 8, the SPIFFE standard): the scheme, a trust
    /// domain of `[a-z0-9._-]`, and a non-empty path whose segments are `[A-Za-z0-9._-]` (not
    /// `.` or `..`). Nothing else gets in, so an id can be written into XFCC, logs and labels
    /// without escaping.
    pub fn parse(s: &str) -> Result<SpiffeId, SpiffeIdError> {
        if s.len() > MAX_LEN {
            return Err(SpiffeIdError::TooLong);
        }
        let Some(rest) = s.strip_prefix(SCHEME) else {
            return Err(SpiffeIdError::NotSpiffe(s.to_string()));
        };
        let (td, path) = rest.split_once('/').unwrap_or((rest, ""));
        if td.is_empty() {
            return Err(SpiffeIdError::NotSpiffe(s.to_string()));
        }
        let td_ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b);
        if !td.bytes().all(td_ok) {
            return Err(SpiffeIdError::BadTrustDomain(s.to_string()));
        }
        if path.is_empty() {
            return Err(SpiffeIdError::NoPath(s.to_string()));
        }
        let seg_ok = |seg: &str| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        if !path.split('/').all(seg_ok) {
            return Err(SpiffeIdError::BadPath(s.to_string()));
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
        for bad in [
            "spiffe://aether.local/ns/a;b/sa/c",
            "spiffe://aether.local/ns/a,b",
            "spiffe://aether.local/ns/a=b",
            "spiffe://aether.local/ns/\"a\"",
            "spiffe://aether.local/ns/a%2Fb",
            "spiffe://aether.local/ns//sa",
            "spiffe://aether.local/ns/a/",
            "spiffe://aether.local/ns/../sa",
            "spiffe://aether.local/ns/a b",
            "spiffe://aether.local/ns/a?b",
            "spiffe://aether.local/ns/a#b",
        ] {
            assert!(
                matches!(SpiffeId::parse(bad), Err(SpiffeIdError::BadPath(_))),
                "{bad}"
            );
        }
        for bad in [
            "spiffe://Aether.local/a",
            "spiffe://user@td/a",
            "spiffe://td:8/a",
        ] {
            assert!(
                matches!(SpiffeId::parse(bad), Err(SpiffeIdError::BadTrustDomain(_))),
                "{bad}"
            );
        }
        let long = format!("spiffe://td/{}", "a".repeat(MAX_LEN));
        assert_eq!(SpiffeId::parse(&long), Err(SpiffeIdError::TooLong));
        assert!(SpiffeId::parse("spiffe://aether.local/A.b_c-9/x").is_ok());
        let e = SpiffeId::parse_in("spiffe://other/ns/a/sa/b", "aether.local").unwrap_err();
        assert!(e.to_string().contains("outside the trust domain"), "{e}");
    }
}
