//! One JSON line per request on stdout (SPEC section 6).
//!
//! Lines are buffered and flushed by a background thread every 50 ms (and at exit), so the data
//! path never waits on a stdout write.

use std::io::Write;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use serde::Serialize;

#[derive(Serialize)]
pub struct Entry<'a> {
    pub time: String,
    pub direction: &'a str,
    pub method: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    pub status: u16,
    pub error: Option<&'a str>,
    pub upstream: Option<String>,
    pub duration_ms: f64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub peer_identity: Option<&'a str>,
    pub request_id: Option<&'a str>,
}

fn buffer() -> &'static Mutex<Vec<u8>> {
    static BUF: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    BUF.get_or_init(|| {
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(|| loop {
                std::thread::sleep(Duration::from_millis(50));
                flush();
            })
            .ok();
        Mutex::new(Vec::with_capacity(64 * 1024))
    })
}

pub fn now_rfc3339() -> String {
    let now: time::OffsetDateTime = SystemTime::now().into();
    now.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

pub fn log(entry: &Entry<'_>) {
    let mut buf = buffer().lock().unwrap_or_else(|e| e.into_inner());
    if serde_json::to_writer(&mut *buf, entry).is_ok() {
        buf.push(b'\n');
    }
    // Bound the buffer if stdout is slow: better a late flush here than unbounded memory.
    if buf.len() > 1 << 20 {
        let data = std::mem::take(&mut *buf);
        drop(buf);
        let _ = std::io::stdout().lock().write_all(&data);
    }
}

/// Writes out buffered lines; called periodically and before exit.
pub fn flush() {
    let data = {
        let mut buf = buffer().lock().unwrap_or_else(|e| e.into_inner());
        if buf.is_empty() {
            return;
        }
        std::mem::replace(&mut *buf, Vec::with_capacity(64 * 1024))
    };
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&data);
    let _ = out.flush();
}
