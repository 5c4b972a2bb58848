//! Access-log timestamps: RFC 3339 in UTC, byte for byte as the `time` crate writes them, with
//! the calendar worked out once a second per thread instead of once a line.

use std::time::{Duration, SystemTime};

use serde::Serialize;

/// A moment as RFC 3339 in UTC, as the `time` crate writes it (`2026-12-01T23:11:55.123456789Z`,
/// trailing zeros of the fraction dropped, no fraction on a whole second).
#[derive(Clone, Copy, Debug)]
pub struct Rfc3339(pub SystemTime);

impl Rfc3339 {
    pub fn now() -> Rfc3339 {
        Rfc3339(SystemTime::now())
    }

    /// Writes the moment into `buf` and returns its length (0 for a moment RFC 3339 cannot
    /// state: before year 0 or after 9999). Each thread keeps the date and time of the last
    /// second it wrote, so a busy sidecar works out the calendar once a second, not once a line
    /// (the `time` crate's formatter is costly enough to show in a request's profile).
    pub fn write(&self, buf: &mut [u8; 30]) -> usize {
        let Ok(since) = self.0.duration_since(SystemTime::UNIX_EPOCH) else {
            return write_calendar(self.0, buf);
        };
        thread_local! {
            static SECOND: std::cell::Cell<(u64, [u8; 19])> = const { std::cell::Cell::new((u64::MAX, [0; 19])) };
        }
        let secs = since.as_secs();
        let (cached, date) = SECOND.get();
        let date = if cached == secs {
            date
        } else {
            let mut full = [0u8; 30];
            if write_calendar(
                SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
                &mut full,
            ) == 0
            {
                return 0;
            }
            let mut date = [0u8; 19];
            date.copy_from_slice(&full[..19]);
            SECOND.set((secs, date));
            date
        };
        buf[..19].copy_from_slice(&date);
        let mut n = 19;
        let nanos = since.subsec_nanos();
        if nanos != 0 {
            buf[n] = b'.';
            let mut digits = [0u8; 9];
            let mut v = nanos;
            for d in digits.iter_mut().rev() {
                *d = b'0' + (v % 10) as u8;
                v /= 10;
            }
            let keep = 9 - digits.iter().rev().take_while(|&&d| d == b'0').count();
            buf[n + 1..n + 1 + keep].copy_from_slice(&digits[..keep]);
            n += 1 + keep;
        }
        buf[n] = b'Z';
        n + 1
    }
}

/// The slow path: the `time` crate's own formatter. (Its `From<SystemTime>` panics past year
/// 9999, so the moment goes in as nanoseconds, which it refuses instead.)
fn write_calendar(t: SystemTime, buf: &mut [u8; 30]) -> usize {
    let nanos = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    };
    let Ok(dt) = time::OffsetDateTime::from_unix_timestamp_nanos(nanos) else {
        return 0;
    };
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    // The cursor's position, not the count `format_into` returns: that one leaves out the
    // fraction of the second.
    match dt.format_into(&mut cursor, &time::format_description::well_known::Rfc3339) {
        Ok(_) => cursor.position() as usize,
        Err(_) => 0,
    }
}

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut buf = [0u8; 30];
        let n = self.write(&mut buf);
        f.write_str(std::str::from_utf8(&buf[..n]).unwrap_or_default())
    }
}

impl Serialize for Rfc3339 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Our timestamps are the `time` crate's RFC 3339, byte for byte: whole seconds, trailing
    /// zeros, the same second twice (the kept date) and seconds interleaved, before 1970, and
    /// past year 9999 (nothing, as before).
    #[test]
    fn timestamps_read_as_the_time_crate_writes_them() {
        use std::time::UNIX_EPOCH;
        let theirs = |t: SystemTime| {
            let nanos = match t.duration_since(UNIX_EPOCH) {
                Ok(d) => d.as_nanos() as i128,
                Err(e) => -(e.duration().as_nanos() as i128),
            };
            time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
                .ok()
                .and_then(|t| {
                    t.format(&time::format_description::well_known::Rfc3339)
                        .ok()
                })
                .unwrap_or_default()
        };
        let at = |s: u64, n: u32| UNIX_EPOCH + Duration::new(s, n);
        let moments = [
            UNIX_EPOCH,
            at(1_796_166_715, 0),
            at(1_796_166_715, 123_456_789),
            at(1_796_166_715, 120_000_000),
            at(1_796_166_715, 1),
            at(1_796_166_715, 999_999_999),
            at(1_796_166_716, 500_000_000),
            at(1_796_166_715, 10),
            at(951_782_400, 7_000),           // 2000-02-29
            at(253_402_300_799, 999_000_000), // 9999-12-31T23:59:59.999Z
            at(253_402_300_800, 0),           // year 10000
            UNIX_EPOCH - Duration::new(1, 500_000_000),
            SystemTime::now(),
        ];
        for t in moments.into_iter().chain(moments) {
            assert_eq!(Rfc3339(t).to_string(), theirs(t), "{t:?}");
        }
        assert_eq!(Rfc3339(at(253_402_300_800, 0)).to_string(), "");
        assert_eq!(
            Rfc3339(at(1_796_166_715, 120_000_000)).to_string(),
            "2026-12-01T23:11:55.12Z"
        );
    }
}
