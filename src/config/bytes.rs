//! Byte counts written as plain numbers or Kubernetes quantities.

use serde::Deserialize;

/// `64Mi` (binary), `64M` (decimal), `64k`, or a plain count of bytes.
pub fn parse(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(digits);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (for example 67108864 or 64Mi)"))?;
    let scale: u64 = match unit {
        "" => 1,
        "k" | "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (use Ki, Mi, Gi, k, M or G)"
            ))
        }
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("{s:?} is too large"))
}

pub fn deserialize_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Count(u64),
        Text(String),
    }
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Count(n)) => Ok(Some(n)),
        Some(Raw::Text(t)) => parse(&t).map(Some).map_err(serde::de::Error::custom),
    }
}
