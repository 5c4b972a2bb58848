//! `locality:` the pod's `region/zone[/subzone]`, which the outbound side prefers endpoints by.

use std::fmt;

use serde::Deserialize;

/// `region/zone[/subzone]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Locality {
    pub region: String,
    pub zone: String,
    pub subzone: String,
}

impl Locality {
    pub fn parse(s: &str) -> Result<Locality, String> {
        let parts: Vec<&str> = s.split('/').collect();
        if !(2..=3).contains(&parts.len()) || parts.iter().any(|p| p.is_empty()) {
            return Err(format!("{s:?} is not region/zone[/subzone]"));
        }
        Ok(Locality {
            region: parts[0].to_string(),
            zone: parts[1].to_string(),
            subzone: parts.get(2).unwrap_or(&"").to_string(),
        })
    }
}

impl fmt::Display for Locality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.region, self.zone)?;
        if !self.subzone.is_empty() {
            write!(f, "/{}", self.subzone)?;
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for Locality {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Locality::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Locality {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;

    #[test]
    fn locality_shape() {
        let e = one_error(&format!("{ID}locality: justone\n"));
        assert!(
            e.starts_with("cfg.yaml: locality: ") && e.contains("region/zone"),
            "{e}"
        );
    }
}
