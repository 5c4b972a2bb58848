//! One JSON line per request on stdout (SPEC section 6), and one per spliced connection (tcp
//! chain, CONNECT tunnel, upgrade) when it closes (SPEC section 12).
//!
//! Lines are queued and written by a background thread every 50 ms, or sooner once 32 KiB wait
//! (and at exit), so the data path never waits on a stdout write.

use std::io::Write;

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use hyper::body::Incoming;
use serde::Serialize;

use crate::http::answer::Reason;
use crate::http::body::{Metered, RespBody};
use crate::identity::SpiffeId;
use crate::metrics::{self, Direction};
use crate::trace::{context::hex_into, RequestTrace, SpanInfo};

#[derive(Serialize)]
pub struct Entry<'a> {
    pub time: Rfc3339,
    pub direction: &'a str,
    pub method: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    pub status: u16,
    pub error: Option<&'a str>,
    pub upstream: Option<std::net::SocketAddr>,
    pub duration_ms: f64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub peer_identity: Option<&'a str>,
    pub request_id: Option<&'a str>,
    /// The trace the request was forwarded in (hex), when it has one.
    pub trace_id: Option<&'a str>,
    /// This proxy's span for the request (hex), when it recorded one.
    pub span_id: Option<&'a str>,
}

/// The line a spliced connection leaves when it closes.
#[derive(Serialize)]
pub struct ConnEntry<'a> {
    pub time: Rfc3339,
    pub direction: &'a str,
    /// `tcp` (an inbound tcp chain), `connect`, `upgrade`, `capture` (a captured connection
    /// tunnelled to a service's tcp port), `egress` (a captured connection leaving the mesh).
    pub protocol: &'a str,
    pub authority: &'a str,
    pub upstream: Option<std::net::SocketAddr>,
    pub duration_ms: f64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub end_reason: &'a str,
    /// Why the proxy closed a captured connection itself (an `x-aether-error` reason, or
    /// `egress-denied`); absent on every other line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'a str>,
    pub peer_identity: Option<&'a str>,
    pub request_id: Option<&'a str>,
}

/// A spliced connection's record, started when it opens; `finish` writes its line.
pub struct ConnLog {
    pub start: std::time::Instant,
    pub direction: Direction,
    pub protocol: &'static str,
    pub authority: String,
    pub upstream: Option<std::net::SocketAddr>,
    pub peer_identity: Option<SpiffeId>,
    pub request_id: Option<http::HeaderValue>,
    /// See `ConnEntry::error`.
    pub error: Option<&'static str>,
}

impl ConnLog {
    pub fn new(direction: Direction, protocol: &'static str, authority: String) -> ConnLog {
        ConnLog {
            start: std::time::Instant::now(),
            direction,
            protocol,
            authority,
            upstream: None,
            peer_identity: None,
            request_id: None,
            error: None,
        }
    }

    pub fn finish(self, s: &crate::sockets::Spliced) {
        log(&ConnEntry {
            time: Rfc3339::now(),
            direction: match self.direction {
                Direction::inbound => "inbound",
                Direction::outbound => "outbound",
            },
            protocol: self.protocol,
            authority: &self.authority,
            upstream: self.upstream,
            duration_ms: self.start.elapsed().as_secs_f64() * 1000.0,
            bytes_received: s.received,
            bytes_sent: s.sent,
            end_reason: s.end.as_str(),
            error: self.error,
            peer_identity: self.peer_identity.as_ref().map(SpiffeId::as_str),
            request_id: self.request_id.as_ref().and_then(|v| v.to_str().ok()),
        });
    }
}

/// Lines waiting for stdout, with the writer thread's wake-up.
struct Shared {
    queue: Mutex<LineQueue>,
    wake: Condvar,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(writer)
            .ok();
        Shared {
            queue: Mutex::new(LineQueue::default()),
            wake: Condvar::new(),
        }
    })
}

fn lock_queue() -> std::sync::MutexGuard<'static, LineQueue> {
    shared().queue.lock().unwrap_or_else(|e| e.into_inner())
}

/// The writer thread: flushes every [`FLUSH_EVERY`], or as soon as [`FLUSH_AT`] bytes wait.
fn writer() {
    loop {
        {
            let q = lock_queue();
            let _ = shared()
                .wake
                .wait_timeout_while(q, FLUSH_EVERY, |q| q.lines.len() < FLUSH_AT);
        }
        flush();
    }
}

/// The longest a line waits for stdout when traffic is light.
const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// Queued bytes that wake the writer before [`FLUSH_EVERY`]: at 20,000 requests a second 50 ms
/// of lines is about 400 KiB, and a buffer grown to that (twice: one filling while the other
/// is written) was the largest single block of a busy sidecar's heap.
const FLUSH_AT: usize = 32 * 1024;

/// What a buffer starts with and what the spare is cut back to after a backlog, so a burst
/// while stdout was slow does not stay resident.
const KEEP: usize = 2 * FLUSH_AT;

/// Two buffers that trade places: lines fill one while the writer empties the other, and the
/// emptied one comes back as the spare, so a steady stream allocates nothing.
#[derive(Default)]
struct LineQueue {
    lines: Vec<u8>,
    spare: Vec<u8>,
}

/// What [`LineQueue::push`] did with a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pushed {
    Queued,
    /// Queued, and the queue has just reached [`FLUSH_AT`]: wake the writer.
    QueuedWake,
    /// Over [`MAX_BUFFERED`]: dropped (stdout is not keeping up).
    Dropped,
}

impl LineQueue {
    fn push(&mut self, line: &[u8]) -> Pushed {
        let before = self.lines.len();
        if before + line.len() > MAX_BUFFERED {
            return Pushed::Dropped;
        }
        if self.lines.capacity() == 0 {
            self.lines.reserve(KEEP);
        }
        self.lines.extend_from_slice(line);
        if before < FLUSH_AT && self.lines.len() >= FLUSH_AT {
            Pushed::QueuedWake
        } else {
            Pushed::Queued
        }
    }

    fn queued(&self) -> usize {
        self.lines.len()
    }

    /// Everything queued, for the writer; the spare takes its place.
    fn take(&mut self) -> Vec<u8> {
        let spare = std::mem::take(&mut self.spare);
        std::mem::replace(&mut self.lines, spare)
    }

    /// A written buffer back, emptied, as the next spare.
    fn give_back(&mut self, mut buf: Vec<u8>) {
        buf.clear();
        buf.shrink_to(KEEP);
        if buf.capacity() > self.spare.capacity() {
            self.spare = buf;
        }
    }
}

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
    /// (the `time` crate's formatter was 440 instructions a request, callgrind).
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

/// One request's record, started when its headers arrive and finished when its response body
/// ends: the access-log line and the request metrics.
pub struct RequestLog {
    pub start: std::time::Instant,
    pub direction: Direction,
    pub method: http::Method,
    pub authority: String,
    pub path: String,
    pub request_id: http::HeaderValue,
    pub peer_identity: Option<SpiffeId>,
    /// Request body bytes, counted as they go upstream.
    pub received: Arc<crate::http::body::Received>,
    /// The request's trace; its span (when recorded) ends with the log line.
    pub trace: RequestTrace,
}

/// What the routing decided, known once the response headers are ready.
pub struct Decided {
    pub status: u16,
    pub reason: Option<Reason>,
    pub upstream: Option<std::net::SocketAddr>,
    /// Metric labels (catalog names only). Shared, not copied: every request of a service
    /// carries the same name.
    pub service: Option<Arc<str>>,
    pub port: u16,
    /// Outbound: the identity pinned on the upstream connection (inbound logs the client's).
    pub peer: Option<SpiffeId>,
}

impl RequestLog {
    pub fn new(
        direction: Direction,
        req: &http::Request<Incoming>,
        authority: String,
        request_id: http::HeaderValue,
        peer_identity: Option<SpiffeId>,
    ) -> RequestLog {
        RequestLog {
            start: std::time::Instant::now(),
            direction,
            method: req.method().clone(),
            authority,
            path: req.uri().path().to_string(),
            request_id,
            peer_identity,
            received: Default::default(),
            trace: RequestTrace::default(),
        }
    }

    /// Records the request; `sent` is the response body bytes.
    pub fn finish(self, d: &Decided, sent: u64) {
        let elapsed = self.start.elapsed();
        let m = metrics::get();
        let service = d.service.as_deref().unwrap_or_default();
        metrics::count_request(self.direction, service, d.port, d.status);
        m.duration(self.direction).observe(elapsed.as_secs_f64());
        let (mut trace_hex, mut span_hex) = ([0u8; 32], [0u8; 16]);
        let trace_id = self.trace.trace_id.map(|t| {
            hex_into(&t, &mut trace_hex);
            std::str::from_utf8(&trace_hex).unwrap_or_default()
        });
        let span_id = self.trace.span_id().map(|s| {
            hex_into(&s, &mut span_hex);
            std::str::from_utf8(&span_hex).unwrap_or_default()
        });
        log_request(&Entry {
            time: Rfc3339::now(),
            direction: match self.direction {
                Direction::inbound => "inbound",
                Direction::outbound => "outbound",
            },
            method: self.method.as_str(),
            authority: &self.authority,
            path: &self.path,
            status: d.status,
            error: d.reason.map(Reason::as_str),
            upstream: d.upstream,
            duration_ms: elapsed.as_secs_f64() * 1000.0,
            bytes_received: self.received.bytes(),
            bytes_sent: sent,
            peer_identity: self
                .peer_identity
                .as_ref()
                .or(d.peer.as_ref())
                .map(SpiffeId::as_str),
            request_id: self.request_id.to_str().ok(),
            trace_id,
            span_id,
        });
        // The span ends with the line: same end, same status and reason.
        let peer = self.peer_identity.or_else(|| d.peer.clone());
        self.trace.finish(elapsed, || SpanInfo {
            method: self.method,
            authority: self.authority,
            path: self.path,
            status: d.status,
            error: d.reason.map(Reason::as_str),
            peer,
        });
    }
}

/// Wraps a response so that, when its body ends, the request is logged and counted and
/// `guard` (in-flight counters and the like) is released.
pub fn finish_with<G: Send + Sync + 'static>(
    resp: http::Response<crate::http::answer::Body>,
    log: RequestLog,
    decided: Decided,
    guard: G,
) -> http::Response<RespBody> {
    resp.map(move |b| {
        Metered::counted_here(b).on_end(Box::new(move |_clean, sent| {
            drop(guard);
            log.finish(&decided, sent);
        }))
    })
}

/// Most bytes of lines waiting for stdout; past it, lines are dropped (and counted). 1 MiB holds
/// a few thousand lines, far more than 50 ms of traffic when stdout keeps up.
pub const MAX_BUFFERED: usize = 1 << 20;

pub fn log(entry: &impl Serialize) {
    let mut line = Vec::with_capacity(512);
    if serde_json::to_writer(&mut line, entry).is_err() {
        return;
    }
    push_line(line);
}

/// An HTTP request's line: the same JSON `serde_json` makes of `Entry`, written by hand because
/// this runs once per request and serde's per-byte string escaping was the largest single cost
/// of it (callgrind).
fn log_request(e: &Entry<'_>) {
    thread_local! {
        // Each line is built here and copied into the queue, so no line allocates.
        static LINE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    LINE.with_borrow_mut(|out| {
        out.clear();
        out.reserve(512);
        e.write_json(out);
        out.push(b'\n');
        queue_line(out);
        out.truncate(0);
        out.shrink_to(2048);
    });
}

impl Entry<'_> {
    /// The line, as `serde_json` would write it (public for the criterion bench).
    pub fn write_json(&self, out: &mut Vec<u8>) {
        let mut time = [0u8; 30];
        let n = self.time.write(&mut time);
        out.extend_from_slice(b"{\"time\":");
        json_plain(out, &time[..n]);
        out.extend_from_slice(b",\"direction\":");
        json_plain(out, self.direction.as_bytes());
        out.extend_from_slice(b",\"method\":");
        // A method is a token (hyper refuses anything else): nothing in it needs escaping.
        json_plain(out, self.method.as_bytes());
        out.extend_from_slice(b",\"authority\":");
        json_str(out, self.authority);
        out.extend_from_slice(b",\"path\":");
        json_str(out, self.path);
        out.extend_from_slice(b",\"status\":");
        json_num(out, self.status);
        out.extend_from_slice(b",\"error\":");
        json_opt_str(out, self.error);
        out.extend_from_slice(b",\"upstream\":");
        match self.upstream {
            Some(a) => {
                out.push(b'"');
                push_addr(out, a);
                out.push(b'"');
            }
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"duration_ms\":");
        json_num(out, self.duration_ms);
        out.extend_from_slice(b",\"bytes_received\":");
        json_num(out, self.bytes_received);
        out.extend_from_slice(b",\"bytes_sent\":");
        json_num(out, self.bytes_sent);
        out.extend_from_slice(b",\"peer_identity\":");
        json_opt_str(out, self.peer_identity);
        out.extend_from_slice(b",\"request_id\":");
        json_opt_str(out, self.request_id);
        // Both are hex this proxy wrote.
        out.extend_from_slice(b",\"trace_id\":");
        json_opt_plain(out, self.trace_id);
        out.extend_from_slice(b",\"span_id\":");
        json_opt_plain(out, self.span_id);
        out.push(b'}');
    }
}

/// `a` as `Display` writes it. IPv4 is written octet by octet through itoa: the formatting machinery cost
/// a thousand instructions a request here (callgrind), more than the rest of the line.
fn push_addr(out: &mut Vec<u8>, a: std::net::SocketAddr) {
    match a {
        std::net::SocketAddr::V4(v4) => {
            for (i, octet) in v4.ip().octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                json_num(out, octet);
            }
            out.push(b':');
            json_num(out, v4.port());
        }
        std::net::SocketAddr::V6(_) => {
            use std::io::Write as _;
            let _ = write!(out, "{a}");
        }
    }
}

/// Numbers go through serde_json (itoa and ryu), so they print exactly as it prints them.
fn json_num(out: &mut Vec<u8>, v: impl Serialize) {
    let _ = serde_json::to_writer(out, &v);
}

/// A JSON string. Most values (names, ids, paths) need no escaping: one branch-free pass over
/// the bytes says so and they are copied; anything else goes through serde_json's escaping.
fn json_str(out: &mut Vec<u8>, s: &str) {
    let needs_escape = s.bytes().fold(false, |acc, b| {
        acc | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if needs_escape {
        let _ = serde_json::to_writer(&mut *out, s);
    } else {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    }
}

/// A JSON string of bytes known to need no escaping (our own timestamps, hex, tokens).
fn json_plain(out: &mut Vec<u8>, s: &[u8]) {
    debug_assert!(!s.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\'));
    out.reserve(s.len() + 2);
    out.push(b'"');
    out.extend_from_slice(s);
    out.push(b'"');
}

fn json_opt_plain(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => json_plain(out, s.as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
}

fn json_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => json_str(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

fn push_line(mut line: Vec<u8>) {
    line.push(b'\n');
    queue_line(&line);
}

/// Queues a whole line, newline included.
fn queue_line(line: &[u8]) {
    let pushed = lock_queue().push(line);
    match pushed {
        Pushed::Queued => {}
        Pushed::QueuedWake => shared().wake.notify_one(),
        Pushed::Dropped => {
            metrics::get().access_log_dropped.inc();
        }
    }
}

/// Writes out queued lines; called by the writer thread. Only that thread (and
/// [`flush_at_exit`]) ever waits on stdout; the queue lock is not held while writing.
pub fn flush() {
    let data = {
        let mut q = lock_queue();
        if q.queued() == 0 {
            return;
        }
        q.take()
    };
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&data);
    let _ = out.flush();
    drop(out);
    lock_queue().give_back(data);
}

/// The last flush before exit, waiting at most `limit`: a stuck stdout must not keep a
/// drained proxy from exiting.
pub fn flush_at_exit(limit: Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("access-log-exit".into())
        .spawn(move || {
            flush();
            let _ = tx.send(());
        });
    if spawned.is_ok() {
        let _ = rx.recv_timeout(limit);
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

    #[test]
    fn the_queue_wakes_the_writer_once_per_fill_and_reuses_its_buffers() {
        let line = [b'x'; 400];
        let mut q = LineQueue::default();
        let mut wakes = 0;
        for _ in 0..FLUSH_AT / line.len() + 1 {
            match q.push(&line) {
                Pushed::QueuedWake => wakes += 1,
                Pushed::Queued => {}
                Pushed::Dropped => panic!("dropped below the cap"),
            }
        }
        assert_eq!(wakes, 1, "one wake-up when the queue reaches FLUSH_AT");
        assert!(q.queued() >= FLUSH_AT);

        // Steady traffic: the two buffers trade places and nothing grows or is allocated.
        let first = q.take();
        let (a, cap) = (first.as_ptr(), first.capacity());
        q.give_back(first);
        q.push(&line);
        let second = q.take();
        let b = second.as_ptr();
        assert_ne!(a, b);
        q.give_back(second);
        q.push(&line);
        let third = q.take();
        assert_eq!(
            third.as_ptr(),
            a,
            "the written buffer came back as the spare"
        );
        assert_eq!(third.capacity(), cap);
        assert!(cap <= KEEP, "{cap}");
        q.give_back(third);

        // A backlog (stdout stalled) grows a buffer up to the cap; past it lines are dropped,
        // and once written the grown buffer is cut back.
        let mut dropped = 0;
        while dropped == 0 {
            if q.push(&line) == Pushed::Dropped {
                dropped += 1;
            }
        }
        assert!(q.queued() <= MAX_BUFFERED && q.queued() + line.len() > MAX_BUFFERED);
        let big = q.take();
        assert!(big.capacity() >= MAX_BUFFERED / 2);
        q.give_back(big);
        assert_eq!(q.queued(), 0);
        q.push(&line);
        assert!(q.take().capacity() <= KEEP);
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        for a in [
            "0.0.0.0:0",
            "255.255.255.255:65535",
            "10.0.100.9:80",
            "127.0.0.1:15008",
            "[::1]:8080",
            "[2001:db8::1]:443",
        ] {
            let a: std::net::SocketAddr = a.parse().unwrap();
            let mut out = Vec::new();
            push_addr(&mut out, a);
            assert_eq!(String::from_utf8(out).unwrap(), a.to_string());
        }
    }

    #[test]
    fn the_hand_written_line_is_the_serde_line() {
        let addr = "127.0.0.2:15008".parse().unwrap();
        for (path, authority, id, err, upstream) in [
            (
                "/",
                "payments.aether.internal",
                Some("spiffe://td/ns/a/sa/b"),
                None,
                Some(addr),
            ),
            ("/q\"uote\\back", "h\u{1}ost", None, Some("no-route"), None),
            (
                "/ünï\ncode\t",
                "",
                Some(""),
                Some(""),
                Some("[::1]:80".parse().unwrap()),
            ),
        ] {
            let e = Entry {
                time: Rfc3339::now(),
                direction: "outbound",
                method: "GET",
                authority,
                path,
                status: 503,
                error: err,
                upstream,
                duration_ms: 15.985048000000003,
                bytes_received: 0,
                bytes_sent: u64::MAX,
                peer_identity: id,
                request_id: Some("9608f6c5-8b4b-4794-a97a-e008c54da785"),
                trace_id: id.map(|_| "4bf92f3577b34da6a3ce929d0e0e4736"),
                span_id: err.map(|_| "00f067aa0ba902b7"),
            };
            let mut mine = Vec::new();
            e.write_json(&mut mine);
            let serde = serde_json::to_vec(&e).unwrap();
            assert_eq!(
                String::from_utf8(mine).unwrap(),
                String::from_utf8(serde).unwrap()
            );
        }
    }
}
