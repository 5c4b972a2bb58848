//! Durations are written as "5s", "250ms", "1m".

use serde::Deserialize;
use std::time::Duration;

/// The longest duration any file may give.
pub const MAX: Duration = Duration::from_secs(24 * 60 * 60);

pub fn parse(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|_| format!("{s:?} is not a duration like \"5s\" or \"250ms\""))?;
    if d.is_zero() {
        return Err(format!("{s:?} must be greater than zero"));
    }
    // No timer here needs more than a day; the cap keeps deadline arithmetic far from
    // overflow whatever a file says. Fields with tighter bounds check them too.
    if d > MAX {
        return Err(format!("{s:?} is over the limit of 24h"));
    }
    Ok(d)
}

pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    parse(&s).map_err(serde::de::Error::custom)
}

pub fn deserialize_opt<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    deserialize(d).map(Some)
}
