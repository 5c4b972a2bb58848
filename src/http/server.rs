//! HTTP server settings shared by the inbound and outbound listeners (SPEC section 8 limits),
//! and serving a connection until it ends or the drain finishes it.

use std::time::Duration;

use hyper_util::rt::TokioTimer;

use super::limits::{
    timers, Timers, H1_MAX_HEAD, H2_CONNECTION_WINDOW, H2_MAX_CONCURRENT_STREAMS, H2_MAX_FRAME,
    H2_MAX_HEADER_LIST, H2_MAX_LOCAL_ERROR_RESETS, H2_MAX_PENDING_ACCEPT_RESETS, H2_STREAM_WINDOW,
    HYPER_MAX_BUF,
};

/// Server builders, made once and shared by every connection.
pub struct Servers {
    pub h1: hyper::server::conn::http1::Builder,
    pub h2: hyper::server::conn::http2::Builder<StreamExecutor>,
}

impl Servers {
    pub fn new() -> Servers {
        let mut h1 = hyper::server::conn::http1::Builder::new();
        configure_h1(&mut h1);
        let mut h2 = hyper::server::conn::http2::Builder::new(StreamExecutor);
        configure_h2(&mut h2);
        Servers { h1, h2 }
    }
}

/// Runs each HTTP/2 stream hyper hands over as its own task, boxed first. tokio moves the
/// future it is given through each layer of `spawn` and again when the task completes; boxed,
/// those moves are of one pointer. The exchange itself (routing, forwarding and logging
/// state, KiBs) is boxed by each service where it is built, so what is boxed here is hyper's
/// stream (about 260 bytes); spawning that unboxed still cost about 200 instructions a request
/// more on each side of scenario h (callgrind). `drain::accept_until_closing` boxes each
/// connection's future for the same reason.
#[derive(Clone, Copy, Debug)]
pub struct StreamExecutor;

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(Box::pin(fut));
    }
}

impl Default for Servers {
    fn default() -> Self {
        Servers::new()
    }
}

fn configure_h1(b: &mut hyper::server::conn::http1::Builder) {
    // hyper answers past its own limits without `x-aether-error`, so `Timed` refuses heads
    // before they reach them (over 100 fields, over `H1_MAX_HEAD`). hyper's field count stays
    // at its default, which is SPEC's 100: any other value, larger included, makes hyper
    // allocate its two field arrays on the heap for every head it parses (2 x 32 KiB at 1024).
    b.timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(HYPER_MAX_BUF)
        .keep_alive(true);
}

fn configure_h2(b: &mut hyper::server::conn::http2::Builder<StreamExecutor>) {
    b.timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .max_header_list_size(H2_MAX_HEADER_LIST)
        // Rapid reset (CVE-2023-44487): h2 closes connections that reset too many streams.
        .max_pending_accept_reset_streams(Some(H2_MAX_PENDING_ACCEPT_RESETS))
        .max_local_error_reset_streams(Some(H2_MAX_LOCAL_ERROR_RESETS));
}

/// Serves one HTTP connection until it ends, is cut for rapid-reset abuse, or is finished
/// gracefully once the drain closes. Cut-offs are counted for `$listener`.
#[macro_export]
#[doc(hidden)]
macro_rules! __serve_until_drained {
    ($conn:expr, $drain:expr, $requests:expr, $listener:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let closing = $crate::drain::Drain::reached($drain.watch(), $crate::drain::Phase::Closing);
        let r: Result<(), String> = tokio::select! {
            r = $crate::http::server::Batched::new(conn.as_mut(), Some(&*$requests)) => r.map_err(|e| {
                let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                $crate::http::server::count_codec_error($listener, &*e);
                e.to_string()
            }),
            _ = $requests.abused() => {
                $crate::metrics::get().cut_off($listener, "rapid_reset");
                Err("closed: the peer resets most of its streams early (rapid reset)".to_string())
            }
            _ = closing => {
                conn.as_mut().graceful_shutdown();
                $crate::http::server::Batched::new(conn.as_mut(), Some(&*$requests))
                    .await
                    .map_err(|e| e.to_string())
            }
        };
        r
    }};
}

/// Polls an HTTP/2 connection one scheduler turn after it was woken. A stream's task wakes
/// its connection as soon as it queues a head or data; polled at once (tokio runs a task woken
/// by the running one next), the connection writes and flushes that frame alone: one syscall,
/// and on TLS one record, per response or request. One turn later, the other streams that were
/// ready have queued theirs too, and one write carries them all.
///
/// `downstream` is the state of a downstream connection (`None` for an upstream HTTP/2
/// connection, which is always batched). For a downstream one, batching starts once it is
/// known to be HTTP/2 (HTTP/1.1 has one exchange at a time and nothing to gain from the wait),
/// and each poll that leaves it pending pushes what an HTTP/1 write held back for a FIN that
/// did not follow (`fin`).
pub struct Batched<'a, F> {
    inner: F,
    waited: bool,
    downstream: Option<&'a ConnRequests>,
}

impl<'a, F> Batched<'a, F> {
    pub fn new(inner: F, downstream: Option<&'a ConnRequests>) -> Batched<'a, F> {
        Batched {
            inner,
            waited: false,
            downstream,
        }
    }
}

impl<F: std::future::Future + Unpin> std::future::Future for Batched<'_, F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let batch = self
            .downstream
            .is_none_or(|r| r.multiplexed.load(std::sync::atomic::Ordering::Relaxed));
        if batch && !self.waited {
            self.waited = true;
            // A task that wakes itself goes to the back of the run queue.
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        self.waited = false;
        let r = std::pin::Pin::new(&mut self.inner).poll(cx);
        if r.is_pending() {
            if let Some(requests) = self.downstream {
                requests.fin.push_held();
            }
        }
        r
    }
}

/// Counts a connection the HTTP/2 codec ended with a GOAWAY of its own (a header list far over
/// the limit, a CONTINUATION flood, too many resets, malformed frames).
pub fn count_codec_error(listener: &'static str, e: &(dyn std::error::Error + 'static)) {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h2e) = err.downcast_ref::<h2::Error>() {
            if !(h2e.is_go_away() && h2e.is_library()) {
                return;
            }
            let reason = match h2e.reason() {
                None | Some(h2::Reason::NO_ERROR) => return,
                Some(
                    h2::Reason::ENHANCE_YOUR_CALM
                    | h2::Reason::COMPRESSION_ERROR
                    | h2::Reason::FRAME_SIZE_ERROR,
                ) => "h2_too_much",
                Some(_) => "h2_protocol_error",
            };
            crate::metrics::get().cut_off(listener, reason);
            return;
        }
        cur = err.source();
    }
}

pub use crate::__serve_until_drained as serve_until_drained;

/// Which codec a plaintext (or ALPN-less) connection speaks (`Timed::sniff`); `None` when it
/// ended first, failed, ran out its timer, or the drain closed while it was still silent.
pub async fn sniff_codec<S>(timed: &mut Timed<S>, drain: &crate::drain::Drain) -> Option<Codec>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let closing = crate::drain::Drain::reached(drain.watch(), crate::drain::Phase::Closing);
    tokio::select! {
        r = timed.sniff() => r.unwrap_or_else(|e| {
            tracing::debug!("connection ended before its first request: {e}");
            None
        }),
        _ = closing => None,
    }
}

/// Rapid reset (CVE-2023-44487), Envoy's rule: once a connection has carried this many
/// requests, it is closed when more than half of them were reset before their response and
/// within `PREMATURE_RESET`.
pub const RAPID_RESET_MIN_STREAMS: u64 = 500;
pub const PREMATURE_RESET: Duration = Duration::from_secs(1);

/// Per-connection request accounting shared between a connection's IO and its service: the
/// service counts requests in and out, the IO knows from it whether the connection is between
/// requests (waiting for a head) or inside one, and resets are counted for abuse.
#[derive(Default)]
pub struct ConnRequests {
    started: std::sync::atomic::AtomicU64,
    finished: std::sync::atomic::AtomicU64,
    premature: std::sync::atomic::AtomicU64,
    abusive: tokio::sync::Notify,
    /// The connection became a tunnel (CONNECT, an upgrade): the splice's idle timer governs
    /// it from then on, not the HTTP timers.
    tunnelled: std::sync::atomic::AtomicBool,
    /// The HTTP/2 preface arrived: the connection multiplexes streams.
    multiplexed: std::sync::atomic::AtomicBool,
    /// The last response and the FIN in one segment (`FinTcp`).
    fin: std::sync::Arc<super::fin::Fin>,
}

impl ConnRequests {
    /// Called when a request's head is complete; the returned guard ends it when dropped (at
    /// the end of its response).
    pub fn start(self: &std::sync::Arc<Self>) -> RequestOpen {
        self.started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        RequestOpen {
            conn: self.clone(),
            since: std::time::Instant::now(),
            answered: false,
        }
    }

    /// The state a [`super::fin::FinTcp`] for this connection shares.
    pub fn fin(&self) -> std::sync::Arc<super::fin::Fin> {
        self.fin.clone()
    }

    /// Resolves when the peer is resetting streams abusively.
    pub async fn abused(&self) {
        self.abusive.notified().await
    }

    fn tunnelled(&self) -> bool {
        self.tunnelled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// (between requests, number of requests finished)
    fn between(&self) -> (bool, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let finished = self.finished.load(Relaxed);
        (self.started.load(Relaxed) == finished, finished)
    }
}

/// One open request of a connection.
pub struct RequestOpen {
    conn: std::sync::Arc<ConnRequests>,
    since: std::time::Instant,
    answered: bool,
}

impl RequestOpen {
    /// Marks that a response was produced: from here on an early end is not a reset.
    pub fn answered(mut self) -> RequestOpen {
        self.answered = true;
        self
    }

    /// Marks this request's response as its HTTP/1 connection's last (the request asked to
    /// close; not CONNECT or an upgrade): a `FinTcp` sends it along with its FIN.
    pub fn last_on_connection(&self) {
        self.conn.fin.last_response();
    }

    /// Marks that the connection carries a tunnel from now on: its HTTP timers stop (the
    /// tunnel has its own idle timer, `sockets::splice`). Hold the result as long as the tunnel.
    pub fn tunnel(self) -> RequestOpen {
        self.conn
            .tunnelled
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.answered()
    }
}

impl Drop for RequestOpen {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.conn;
        let finished = c.finished.fetch_add(1, Relaxed) + 1;
        if !self.answered && self.since.elapsed() < PREMATURE_RESET {
            let premature = c.premature.fetch_add(1, Relaxed) + 1;
            if finished >= RAPID_RESET_MIN_STREAMS && premature * 2 > finished {
                c.abusive.notify_one();
            }
        }
    }
}

/// What a downstream connection speaks, as far as is known before its first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// ALPN (or the chain) said HTTP/1.1.
    H1,
    /// ALPN (or the chain) said HTTP/2; the preface must still arrive, in time.
    H2,
    /// Plaintext, or TLS without ALPN: the full 24-byte HTTP/2 preface decides, never a
    /// shorter guess.
    Sniff,
}

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a sniffed connection speaks (`Timed::sniff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    H1,
    H2,
}

/// What the bytes so far say the connection speaks.
enum Seen {
    /// This many bytes of the HTTP/2 preface matched so far.
    Preface(usize),
    H1,
    H2(Frames),
}

/// Follows HTTP/2 frame boundaries (after the preface) just far enough to know when a header
/// block (HEADERS or PUSH_PROMISE, then CONTINUATION up to END_HEADERS) is open.
#[derive(Default)]
struct Frames {
    head: [u8; 9],
    head_len: usize,
    payload_left: usize,
    /// The frame being read ends the open header block.
    ends_block: bool,
    /// When the open header block began.
    block_since: Option<tokio::time::Instant>,
}

impl Frames {
    const HEADERS: u8 = 0x1;
    const PUSH_PROMISE: u8 = 0x5;
    const CONTINUATION: u8 = 0x9;
    const END_HEADERS: u8 = 0x4;

    fn feed(&mut self, mut bytes: &[u8], now: tokio::time::Instant) {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let k = self.payload_left.min(bytes.len());
                self.payload_left -= k;
                bytes = &bytes[k..];
                if self.payload_left == 0 {
                    self.frame_done();
                }
                continue;
            }
            let k = (9 - self.head_len).min(bytes.len());
            self.head[self.head_len..self.head_len + k].copy_from_slice(&bytes[..k]);
            self.head_len += k;
            bytes = &bytes[k..];
            if self.head_len < 9 {
                return;
            }
            self.head_len = 0;
            let h = self.head;
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            let (kind, flags) = (h[3], h[4]);
            if matches!(kind, Self::HEADERS | Self::PUSH_PROMISE) && self.block_since.is_none() {
                self.block_since = Some(now);
            }
            let in_block = matches!(
                kind,
                Self::HEADERS | Self::PUSH_PROMISE | Self::CONTINUATION
            );
            self.ends_block = in_block && flags & Self::END_HEADERS != 0;
            self.payload_left = len;
            if len == 0 {
                self.frame_done();
            }
        }
    }

    fn frame_done(&mut self) {
        if self.ends_block {
            self.block_since = None;
            self.ends_block = false;
        }
    }
}

/// Counts an HTTP/1 request head's field lines as they arrive, up to the blank line that ends
/// it. A field counts from its first byte, as hyper's parser counts it, so the field too many
/// is seen here before hyper could parse it. It also notes the framing fields: hyper quietly
/// drops a `Content-Length` beside `Transfer-Encoding`, and a second equal one, so only the
/// bytes show a head whose framing is ambiguous (SPEC 11: 400 and close, as Envoy answers).
#[derive(Default)]
struct HeadLines {
    at: LineAt,
    fields: usize,
    /// The field being read, lowercased up to its colon, while it may still be a framing one.
    name: [u8; FRAMING_NAME_MAX],
    name_len: usize,
    naming: bool,
    lengths: u8,
    coded: bool,
    /// Refused for ambiguous framing (else, when `feed` refused, for too many fields).
    ambiguous: bool,
}

/// `transfer-encoding`, the longer of the two framing field names.
const FRAMING_NAME_MAX: usize = 17;

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum LineAt {
    /// Before the request line (empty lines there are skipped, as parsers do).
    #[default]
    Lead,
    /// Inside a line.
    Line,
    /// At the start of a line; `Cr` after its first byte was `\r`.
    Start,
    Cr,
    /// Past the blank line: the rest is body or the next request, counted when it begins.
    End,
}

impl HeadLines {
    /// True once the head has more fields than SPEC section 8 allows, or framing fields that
    /// contradict each other (`ambiguous`).
    fn feed(&mut self, bytes: &[u8]) -> bool {
        // A field name split between two reads goes on here.
        if self.naming && self.name_more(bytes) {
            return true;
        }
        let mut i = 0;
        // Byte by byte only where a line begins; inside lines, from one `\n` to the next.
        loop {
            let Some(&b) = bytes.get(i) else {
                return false;
            };
            match self.at {
                LineAt::End => return false,
                LineAt::Lead => {
                    if b != b'\r' && b != b'\n' {
                        self.at = LineAt::Line;
                    }
                    i += 1;
                }
                LineAt::Start | LineAt::Cr => {
                    if b == b'\n' {
                        self.at = LineAt::End;
                        return false;
                    } else if b == b'\r' && self.at == LineAt::Start {
                        self.at = LineAt::Cr;
                        i += 1;
                    } else {
                        if self.field_begins(&bytes[i..]) {
                            return true;
                        }
                        self.at = LineAt::Line;
                        i += 1;
                    }
                }
                LineAt::Line => {
                    let rest = &bytes[i..];
                    let mut ends = memchr::memchr_iter(b'\n', rest);
                    let mut next = ends.next();
                    loop {
                        let Some(lf) = next else {
                            return false;
                        };
                        // The common line: a field starts right after its predecessor's end.
                        match rest.get(lf + 1) {
                            Some(&c) if c != b'\r' && c != b'\n' => {
                                if self.field_begins(&rest[lf + 1..]) {
                                    return true;
                                }
                                next = ends.next();
                            }
                            _ => {
                                self.at = LineAt::Start;
                                i += lf + 1;
                                break;
                            }
                        }
                    }
                }
            }
        }
    }

    /// A field line begins at `from[0]`; true when the head must be refused.
    fn field_begins(&mut self, from: &[u8]) -> bool {
        self.fields += 1;
        if self.fields > super::headers::MAX_HEADERS {
            return true;
        }
        // Only `content-length` and `transfer-encoding` are looked at; other fields cost
        // this one comparison.
        self.naming = matches!(from[0], b'c' | b'C' | b't' | b'T');
        self.name_len = 0;
        self.naming && self.name_more(from)
    }

    /// Reads more of the current field's name from `bytes`, which continue it; true when its
    /// framing now contradicts an earlier field's.
    fn name_more(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            if b == b':' {
                self.naming = false;
                return self.framing_field();
            }
            if b == b'\n' || self.name_len == FRAMING_NAME_MAX {
                self.naming = false;
                return false;
            }
            self.name[self.name_len] = b.to_ascii_lowercase();
            self.name_len += 1;
        }
        false
    }

    fn framing_field(&mut self) -> bool {
        match &self.name[..self.name_len] {
            b"content-length" => self.lengths = self.lengths.saturating_add(1),
            b"transfer-encoding" => self.coded = true,
            _ => return false,
        }
        self.ambiguous = self.lengths > 1 || (self.coded && self.lengths > 0);
        self.ambiguous
    }
}

/// Which timer is armed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timer {
    Head,
    HeaderBlock,
    ConnectionIdle,
    StreamIdle,
}

impl Timer {
    /// (error message, `aether_http_protocol_errors_total` reason)
    fn describe(self) -> (&'static str, &'static str) {
        match self {
            Timer::Head => ("request head not complete in time", "head_timeout"),
            Timer::HeaderBlock => (
                "HTTP/2 header block not complete in time",
                "header_block_timeout",
            ),
            Timer::ConnectionIdle => ("connection idle too long", "connection_idle"),
            Timer::StreamIdle => ("request moved no bytes for too long", "stream_idle"),
        }
    }
}

/// The downstream timers and the HTTP/1 head limit hyper lacks (SPEC section 8):
/// * a request head (or the HTTP/2 preface) must be complete within `head_read` of its first
///   byte; which protocol the connection speaks comes from ALPN or the full preface;
/// * an HTTP/2 header block must be complete within `header_block` of its HEADERS frame;
/// * a connection with nothing in flight closes after `connection_idle` (hyper's own
///   `header_read_timeout` would also run between keep-alive requests, closing pooled peer
///   connections after 10 s);
/// * an HTTP/1 request that moves no bytes either way for `stream_idle` ends its connection
///   (HTTP/2 streams have the same timer on their bodies, `body::Metered`);
/// * an HTTP/1 head over `H1_MAX_HEAD`, or with more than 100 fields, is answered 431
///   `headers-too-large` here, before hyper buffers more or parses the field too many (hyper's
///   own limits would answer without `x-aether-error`).
pub struct Timed<S> {
    inner: S,
    requests: std::sync::Arc<ConnRequests>,
    listener: &'static str,
    timers: Timers,
    seen: Seen,
    /// (finished requests, when) the next request's head began, and its bytes so far.
    head_since: Option<(u64, tokio::time::Instant)>,
    head_bytes: usize,
    head_lines: HeadLines,
    /// (finished requests, when) the connection fell idle.
    idle_since: Option<(u64, tokio::time::Instant)>,
    /// The last byte read or written.
    last_io: tokio::time::Instant,
    armed: Option<(Timer, tokio::time::Instant)>,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// The 431 answer to an oversized HTTP/1 head, once there is one.
    refusal: Option<Refusal>,
    /// Judges the connection's first bytes when they are sniffed (see [`Timed::first_bytes`]).
    first_check: Option<fn(&[u8]) -> bool>,
    /// What sniffing read, not yet handed to the codec (see [`Timed::sniff`]).
    fetched: Option<bytes::Bytes>,
    /// The answer written instead of one hyper made itself, and how much of it went out.
    replacing: Option<(bytes::Bytes, usize)>,
}

/// How much one read while sniffing fetches: a whole ordinary request head, or an HTTP/2
/// client's first flight.
const FIRST_READ: usize = 4096;

impl<S> Timed<S> {
    pub fn new(
        inner: S,
        requests: std::sync::Arc<ConnRequests>,
        listener: &'static str,
        wire: Wire,
    ) -> Timed<S> {
        Timed::with_timers(inner, requests, listener, wire, *timers())
    }

    pub fn with_timers(
        inner: S,
        requests: std::sync::Arc<ConnRequests>,
        listener: &'static str,
        wire: Wire,
        timers: Timers,
    ) -> Timed<S> {
        Timed {
            inner,
            requests,
            listener,
            timers,
            seen: match wire {
                Wire::H1 => Seen::H1,
                Wire::H2 | Wire::Sniff => Seen::Preface(0),
            },
            head_since: None,
            head_bytes: 0,
            head_lines: HeadLines::default(),
            idle_since: None,
            last_io: tokio::time::Instant::now(),
            armed: None,
            sleep: Box::pin(tokio::time::sleep(timers.connection_idle)),
            refusal: None,
            first_check: None,
            fetched: None,
            replacing: None,
        }
    }

    /// A connection that must begin with bytes `check` accepts, within the head timer counted
    /// from now rather than from the first byte: a captured connection to an HTTP port, which
    /// is closed (without an answer) when it speaks something else. Judged on the bytes
    /// [`Timed::sniff`] reads anyway, so no extra `peek` per connection.
    pub fn first_bytes(mut self, check: fn(&[u8]) -> bool) -> Timed<S> {
        self.first_check = Some(check);
        self.head_since = Some((0, tokio::time::Instant::now()));
        self
    }

    fn is_h2(&self) -> bool {
        matches!(self.seen, Seen::H2(_))
    }

    /// Notes bytes that arrived: the preface, HTTP/2 frames, the HTTP/1 head's size and fields.
    /// True when the HTTP/1 head now has more fields than SPEC allows.
    fn arrived(&mut self, got: &[u8], between: bool, n: u64) -> bool {
        let now = tokio::time::Instant::now();
        self.last_io = now;
        let mut rest = got;
        if let Seen::Preface(matched) = self.seen {
            let k = (PREFACE.len() - matched).min(rest.len());
            if rest[..k] != PREFACE[matched..matched + k] {
                self.seen = Seen::H1;
            } else if matched + k == PREFACE.len() {
                self.seen = Seen::H2(Frames::default());
                self.requests
                    .multiplexed
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                rest = &rest[k..];
            } else {
                self.seen = Seen::Preface(matched + k);
            }
        }
        if let Seen::H2(frames) = &mut self.seen {
            frames.feed(rest, now);
            return false;
        }
        if between {
            if !matches!(self.head_since, Some((m, _)) if m == n) {
                self.head_since = Some((n, now));
                self.head_bytes = 0;
                self.head_lines = HeadLines::default();
            }
            self.head_bytes += got.len();
            return self.head_lines.feed(got);
        }
        false
    }

    /// The timer that applies now, if any.
    fn wanted(&mut self, between: bool, n: u64) -> Option<(Timer, tokio::time::Instant)> {
        if self.requests.tunnelled() {
            return None;
        }
        let t = self.timers;
        if let Seen::H2(Frames {
            block_since: Some(since),
            ..
        }) = self.seen
        {
            return Some((Timer::HeaderBlock, since + t.header_block));
        }
        if between {
            if let Some((m, since)) = self.head_since {
                if m == n && !self.is_h2() {
                    return Some((Timer::Head, since + t.head_read));
                }
            }
            let since = match self.idle_since {
                Some((m, since)) if m == n => since,
                _ => {
                    let now = tokio::time::Instant::now();
                    self.idle_since = Some((n, now));
                    now
                }
            };
            return Some((Timer::ConnectionIdle, since + t.connection_idle));
        }
        if self.is_h2() {
            // Streams carry their own timers.
            return None;
        }
        Some((Timer::StreamIdle, self.last_io + t.stream_idle))
    }

    /// Polls the timer that applies; an error once it ran out.
    fn expired(
        &mut self,
        cx: &mut std::task::Context<'_>,
        between: bool,
        n: u64,
    ) -> Option<std::io::Error> {
        use std::future::Future;
        let want = self.wanted(between, n)?;
        loop {
            match self.armed {
                // The same timer, pushed later by activity: let the armed one fire first and
                // look again then, instead of re-arming on every read.
                Some((kind, at)) if kind == want.0 && at <= want.1 => {}
                _ => {
                    self.armed = Some(want);
                    self.sleep.as_mut().reset(want.1);
                }
            }
            if self.sleep.as_mut().poll(cx).is_pending() {
                return None;
            }
            if tokio::time::Instant::now() >= want.1 {
                break;
            }
            self.armed = None;
        }
        let (what, reason) = want.0.describe();
        crate::metrics::get().cut_off(self.listener, reason);
        Some(std::io::Error::new(std::io::ErrorKind::TimedOut, what))
    }
}

/// After the 431 for an oversized head, what the client still sends is read and dropped for up
/// to this long or this much, so that closing with unread bytes (a TCP reset) does not destroy
/// the answer before the client reads it.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 4 << 20;

/// The answer to an oversized HTTP/1 head, on its way out.
enum Refusal {
    Writing(bytes::Bytes, usize),
    Lingering(usize),
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> Timed<S> {
    /// Reads until the first bytes say which codec the connection speaks: the full HTTP/2
    /// preface, or anything that departs from it (HTTP/1). `None` when the peer closed without
    /// a byte. What was read stays here for the codec's first read, so the codec gets the
    /// whole head at once (hyper-util's auto codec hands hyper's HTTP/1 codec the 24 bytes it
    /// sniffed on their own; hyper then grows its 8 KiB read buffer to 16 KiB, copying it, on
    /// every new connection). Runs the connection's timers as reads do, and the check of
    /// [`Timed::first_bytes`] on the first bytes (an `InvalidData` error when it refuses them).
    pub async fn sniff(&mut self) -> std::io::Result<Option<Codec>> {
        std::future::poll_fn(|cx| self.poll_sniff(cx)).await
    }

    fn poll_sniff(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<Option<Codec>>> {
        use std::task::Poll;
        loop {
            let have = self.fetched.as_deref().unwrap_or_default();
            let k = have.len().min(PREFACE.len());
            if have[..k] != PREFACE[..k] {
                return Poll::Ready(Ok(Some(Codec::H1)));
            }
            if k == PREFACE.len() {
                return Poll::Ready(Ok(Some(Codec::H2)));
            }
            let mut ahead = [std::mem::MaybeUninit::<u8>::uninit(); FIRST_READ];
            let mut ahead = tokio::io::ReadBuf::uninit(&mut ahead);
            match std::pin::Pin::new(&mut self.inner).poll_read(cx, &mut ahead) {
                Poll::Ready(Ok(())) if ahead.filled().is_empty() => {
                    // A partial preface, then the end: HTTP/1's codec answers or closes.
                    let any = self.fetched.is_some();
                    return Poll::Ready(Ok(any.then_some(Codec::H1)));
                }
                Poll::Ready(Ok(())) => {
                    let got = ahead.filled();
                    if let Some(check) = self.first_check.take() {
                        if !check(got) {
                            return Poll::Ready(Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                "not the protocol this port serves",
                            )));
                        }
                    }
                    self.fetched = Some(match self.fetched.take() {
                        None => bytes::Bytes::copy_from_slice(got),
                        Some(before) => [&before[..], got].concat().into(),
                    });
                    // Bytes have begun: the head timer runs from here, as for any head.
                    let now = tokio::time::Instant::now();
                    self.head_since.get_or_insert((0, now));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    return match self.expired(cx, true, 0) {
                        Some(e) => Poll::Ready(Err(e)),
                        None => Poll::Pending,
                    }
                }
            }
        }
    }

    /// Reads what sniffing fetched, then the stream: the codec's first read gets the whole
    /// head that arrived, not just the preface-sized part the sniff looked at.
    fn read_inner(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use bytes::Buf;
        let Some(fetched) = &mut self.fetched else {
            return std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        };
        let k = fetched.len().min(buf.remaining());
        buf.put_slice(&fetched[..k]);
        fetched.advance(k);
        if fetched.is_empty() {
            self.fetched = None;
        }
        std::task::Poll::Ready(Ok(()))
    }

    /// Answers an oversized HTTP/1 head 431 (see [`Timed::poll_refusal`]).
    fn refuse_head(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        crate::metrics::get().cut_off(self.listener, "headers_too_large");
        self.refusal = Some(Refusal::Writing(head_too_large_answer(), 0));
        self.poll_refusal(cx)
    }

    /// Answers an HTTP/1 head with ambiguous framing 400 `bad-request` and closes: after it,
    /// where the next request would begin is unknown.
    fn refuse_framing(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        crate::metrics::get().cut_off(self.listener, "ambiguous_framing");
        let answer = refusal_answer(super::answer::Reason::BadRequest, "400 Bad Request");
        self.refusal = Some(Refusal::Writing(answer, 0));
        self.poll_refusal(cx)
    }

    /// Writes the 431 answer for an oversized HTTP/1 head, reads what the client still sends
    /// for a moment, then fails the read so that hyper closes the connection without answering
    /// again.
    fn poll_refusal(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        use std::task::Poll;
        let done = || {
            Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "request head too large",
            )))
        };
        loop {
            match self.refusal.as_mut().expect("a refusal is under way") {
                Refusal::Writing(answer, sent) => {
                    while *sent < answer.len() {
                        match std::pin::Pin::new(&mut self.inner).poll_write(cx, &answer[*sent..]) {
                            Poll::Ready(Ok(0)) => return done(),
                            Poll::Ready(Ok(k)) => *sent += k,
                            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                            Poll::Pending => return Poll::Pending,
                        }
                    }
                    std::task::ready!(std::pin::Pin::new(&mut self.inner).poll_flush(cx))?;
                    self.refusal = Some(Refusal::Lingering(0));
                    self.sleep
                        .as_mut()
                        .reset(tokio::time::Instant::now() + LINGER);
                    self.armed = None;
                }
                Refusal::Lingering(dropped) => {
                    let mut scratch = [0u8; 8192];
                    let mut b = tokio::io::ReadBuf::new(&mut scratch);
                    match std::pin::Pin::new(&mut self.inner).poll_read(cx, &mut b) {
                        Poll::Ready(Ok(())) if !b.filled().is_empty() => {
                            *dropped += b.filled().len();
                            if *dropped >= LINGER_BYTES {
                                return done();
                            }
                        }
                        Poll::Ready(_) => return done(),
                        Poll::Pending => {
                            if self.sleep.as_mut().poll(cx).is_ready() {
                                return done();
                            }
                            return Poll::Pending;
                        }
                    }
                }
            }
        }
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncRead for Timed<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.refusal.is_some() {
            return this.poll_refusal(cx);
        }
        let (between, n) = this.requests.between();
        // Bytes of an HTTP/1 head (or of what may still become the HTTP/2 preface).
        let in_head = between && !this.is_h2();
        let head_bytes = match this.head_since {
            Some((m, _)) if m == n && in_head => this.head_bytes,
            _ => 0,
        };
        if in_head && head_bytes >= H1_MAX_HEAD {
            return this.refuse_head(cx);
        }
        let before = buf.filled().len();
        let r = if in_head && buf.remaining() > H1_MAX_HEAD - head_bytes {
            // Never hand the codec more of a head than the limit.
            let room = H1_MAX_HEAD - head_bytes;
            let mut part = tokio::io::ReadBuf::new(buf.initialize_unfilled_to(room));
            let r = this.read_inner(cx, &mut part);
            let k = part.filled().len();
            buf.advance(k);
            r
        } else {
            this.read_inner(cx, buf)
        };
        match r {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && this.arrived(&buf.filled()[before..], between, n)
                {
                    // The field too many (or the contradicting one) never reaches hyper, which
                    // would answer its own 431 (or pass the request on).
                    buf.set_filled(before);
                    if this.head_lines.ambiguous {
                        return this.refuse_framing(cx);
                    }
                    return this.refuse_head(cx);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.expired(cx, between, n) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
            r => r,
        }
    }
}

/// The 431 `headers-too-large` answer (SPEC section 7), written raw: hyper never parsed the
/// request.
fn head_too_large_answer() -> bytes::Bytes {
    refusal_answer(
        super::answer::Reason::HeadersTooLarge,
        "431 Request Header Fields Too Large",
    )
}

/// An error answer written raw, before hyper parsed the request, with a close.
fn refusal_answer(reason: super::answer::Reason, status: &str) -> bytes::Bytes {
    let body = reason.body_line();
    bytes::Bytes::from(format!(
        "HTTP/1.1 {status}\r\n{}: {}\r\ncontent-type: text/plain\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        super::answer::X_AETHER_ERROR,
        reason.as_str(),
        body.len()
    ))
}

impl<S: tokio::io::AsyncWrite + Unpin> Timed<S> {
    /// Writes count as activity; a write that cannot go out (the peer reads nothing) runs the
    /// HTTP/1 stream idle timer.
    fn wrote(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<usize>>,
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        match r {
            Poll::Ready(Ok(k)) if k > 0 => {
                self.last_io = tokio::time::Instant::now();
                r
            }
            Poll::Pending => {
                let (between, n) = self.requests.between();
                if between || self.is_h2() {
                    return r;
                }
                match self.expired(cx, between, n) {
                    Some(e) => Poll::Ready(Err(e)),
                    None => Poll::Pending,
                }
            }
            r => r,
        }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> Timed<S> {
    /// The reason for an answer hyper wrote on its own. The proxy writes nothing of its own
    /// for a head that never became a request, so an answer written after the bytes of a new
    /// head began, with no request started for them, and shaped exactly as hyper's refusals
    /// are (a `4xx` status line, `connection: close`, `content-length: 0` and `date`, nothing
    /// else), is hyper
    /// refusing a head it could not parse: obs-fold, a bare CR or NUL in a field, a request
    /// target over its limit. SPEC 7 wants every such answer to carry `x-aether-error`. An
    /// app's own empty 400 has other fields and is written before the next head begins.
    fn library_answer(&self, buf: &[u8]) -> Option<(super::answer::Reason, &'static str)> {
        use super::answer::Reason;
        if self.is_h2() || buf.len() > 256 || self.requests.tunnelled() {
            return None;
        }
        let (between, n) = self.requests.between();
        if !between || !matches!(self.head_since, Some((m, _)) if m == n) {
            return None;
        }
        let head = buf.strip_prefix(b"HTTP/1.1 ")?.strip_suffix(b"\r\n\r\n")?;
        let mut lines = head.split(|b| *b == b'\n');
        let status = lines.next()?;
        let only_hypers_fields = lines.all(|l| {
            l.eq_ignore_ascii_case(b"content-length: 0\r")
                || l.eq_ignore_ascii_case(b"connection: close\r")
                || l.starts_with(b"date: ")
        });
        if !only_hypers_fields {
            return None;
        }
        match status.get(..3)? {
            b"400" => Some((Reason::BadRequest, "400 Bad Request")),
            b"414" => Some((Reason::UriTooLong, "414 URI Too Long")),
            b"431" => Some((
                Reason::HeadersTooLarge,
                "431 Request Header Fields Too Large",
            )),
            _ => None,
        }
    }

    /// Writes the proxy's answer in place of hyper's (`buf`), reporting `buf` as written once
    /// the replacement is out.
    fn poll_replace(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf_len: usize,
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let (answer, sent) = self.replacing.as_mut().expect("a replacement is under way");
        while *sent < answer.len() {
            match std::pin::Pin::new(&mut self.inner).poll_write(cx, &answer[*sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(0)),
                Poll::Ready(Ok(k)) => *sent += k,
                r @ (Poll::Ready(Err(_)) | Poll::Pending) => return self.wrote(cx, r),
            }
        }
        self.replacing = None;
        self.last_io = tokio::time::Instant::now();
        Poll::Ready(Ok(buf_len))
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Timed<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = &mut *self;
        if this.replacing.is_none() {
            if let Some((reason, status)) = this.library_answer(buf) {
                crate::metrics::get().cut_off(this.listener, "malformed_request");
                this.replacing = Some((refusal_answer(reason, status), 0));
            }
        }
        if this.replacing.is_some() {
            return this.poll_replace(cx, buf.len());
        }
        let r = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(cx, r)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        // hyper's own answers are one buffer, with nothing after it.
        let mut filled = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(first), None) = (filled.next(), filled.next()) {
            if self.replacing.is_some() || self.library_answer(first).is_some() {
                return self.poll_write(cx, first);
            }
        }
        let r = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HEAD: Duration = Duration::from_millis(100);
    const IDLE: Duration = Duration::from_millis(400);
    const BLOCK: Duration = Duration::from_millis(150);
    const STREAM: Duration = Duration::from_millis(1000);

    fn timed_with(
        wire: Wire,
        capacity: usize,
    ) -> (
        Timed<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Arc<ConnRequests>,
    ) {
        let (server, client) = tokio::io::duplex(capacity);
        let (io, requests) = timed_over(server, wire);
        (io, client, requests)
    }

    /// `inner` behind `Timed`, with the short timers above.
    fn timed_over<S>(inner: S, wire: Wire) -> (Timed<S>, Arc<ConnRequests>) {
        let requests = Arc::new(ConnRequests::default());
        let timers = Timers {
            head_read: HEAD,
            header_block: BLOCK,
            connection_idle: IDLE,
            stream_idle: STREAM,
            ..Timers::default()
        };
        let io = Timed::with_timers(inner, requests.clone(), "outbound", wire, timers);
        (io, requests)
    }

    fn timed() -> (
        Timed<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Arc<ConnRequests>,
    ) {
        timed_with(Wire::Sniff, 1024)
    }

    /// Reads until an error; returns how long that took.
    async fn time_to_error(io: &mut Timed<tokio::io::DuplexStream>) -> (Duration, std::io::Error) {
        let start = std::time::Instant::now();
        let mut buf = [0u8; 64];
        loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(_) => continue,
                Err(e) => return (start.elapsed(), e),
            }
        }
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_outlives_the_head_timeout() {
        let (mut io, _client, _) = timed();
        let (took, e) = time_to_error(&mut io).await;
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(
            took >= IDLE - Duration::from_millis(20),
            "closed after {took:?}"
        );
    }

    #[tokio::test]
    async fn a_started_head_must_complete_in_time() {
        let (mut io, mut client, _) = timed();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n")
            .await
            .unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(
            took < IDLE && took >= HEAD - Duration::from_millis(20),
            "took {took:?}"
        );
    }

    #[tokio::test]
    async fn nothing_times_out_inside_a_request_and_the_clock_restarts_after_it() {
        let (mut io, mut client, requests) = timed();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let _ = io.read(&mut buf).await.unwrap();
        // The head is complete: the service has the request for longer than both timeouts.
        let open = requests.start();
        let waited = tokio::time::timeout(STREAM / 2, io.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "a request in progress must not be timed out"
        );
        drop(open.answered());
        // Between requests again: the idle clock starts afresh.
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(took >= IDLE - Duration::from_millis(20), "took {took:?}");
    }

    /// A stream that counts the reads that reached it.
    struct Counted {
        inner: tokio::io::DuplexStream,
        reads: usize,
    }

    impl tokio::io::AsyncRead for Counted {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
            if r.is_ready() {
                self.reads += 1;
            }
            r
        }
    }

    impl tokio::io::AsyncWrite for Counted {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
        }
        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    fn counted(wire: Wire) -> (Timed<Counted>, tokio::io::DuplexStream) {
        let (server, client) = tokio::io::duplex(1 << 16);
        let inner = Counted {
            inner: server,
            reads: 0,
        };
        (timed_over(inner, wire).0, client)
    }

    #[tokio::test]
    async fn what_the_sniff_fetched_serves_small_reads_without_asking_the_stream() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let head = b"GET / HTTP/1.1\r\nHost: payments.aether.internal\r\nUser-Agent: x\r\n\r\n";
        client.write_all(head).await.unwrap();
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        // Even a codec that reads 24 bytes first, then a large read, gets the rest of the head
        // from what the sniff fetched.
        let mut first = [0u8; 24];
        io.read_exact(&mut first).await.unwrap();
        let mut rest = vec![0u8; 16 << 10];
        let n = io.read(&mut rest).await.unwrap();
        assert_eq!([&first[..], &rest[..n]].concat(), head);
        assert_eq!(
            io.inner.reads, 1,
            "the rest of the head came from the first read"
        );
        // Then the stream again, in order.
        client.write_all(b"more").await.unwrap();
        let n = io.read(&mut rest).await.unwrap();
        assert_eq!(&rest[..n], b"more");
        assert_eq!(io.inner.reads, 2);
    }

    #[tokio::test]
    async fn sniffing_an_http1_head_hands_the_codec_all_of_it_in_one_read() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let head = b"GET / HTTP/1.1\r\nHost: payments.aether.internal\r\n\r\n";
        client.write_all(head).await.unwrap();
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        let mut buf = vec![0u8; 8 << 10];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], head);
        assert_eq!(io.inner.reads, 1);
    }

    #[tokio::test]
    async fn sniffing_waits_for_the_whole_preface_across_reads() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let mut bytes = PREFACE.to_vec();
        bytes.extend_from_slice(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00");
        client.write_all(&bytes[..10]).await.unwrap();
        let sniffed = tokio::spawn(async move {
            let codec = io.sniff().await.unwrap();
            (io, codec)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&bytes[10..]).await.unwrap();
        let (mut io, codec) = sniffed.await.unwrap();
        assert_eq!(codec, Some(Codec::H2));
        let mut buf = vec![0u8; 1024];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], &bytes[..]);
        assert!(
            io.is_h2(),
            "the preface went through the timers' accounting once"
        );
    }

    #[tokio::test]
    async fn sniffing_a_connection_that_ends_at_once_or_mid_preface() {
        let (mut io, client) = counted(Wire::Sniff);
        drop(client);
        assert_eq!(io.sniff().await.unwrap(), None);
        let (mut io, mut client) = counted(Wire::Sniff);
        client.write_all(b"PRI * HTTP/2").await.unwrap();
        drop(client);
        // HTTP/1's codec then answers the fragment (or closes).
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
    }

    #[tokio::test]
    async fn sniffing_runs_the_idle_timer_then_the_head_timer_once_bytes_begin() {
        let (mut io, _client, _) = timed();
        let start = std::time::Instant::now();
        let e = io.sniff().await.unwrap_err();
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(start.elapsed() >= IDLE - Duration::from_millis(20));
        let (mut io, mut client, _) = timed();
        client.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let start = std::time::Instant::now();
        let e = io.sniff().await.unwrap_err();
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(start.elapsed() < IDLE, "took {:?}", start.elapsed());
    }

    #[tokio::test]
    async fn a_silent_connection_stops_waiting_for_its_first_bytes_when_the_drain_closes() {
        let (mut io, _client, _) = timed();
        let drain = crate::drain::Drain::default();
        let closer = drain.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            closer.advance(crate::drain::Phase::Closing);
        });
        let start = std::time::Instant::now();
        assert_eq!(sniff_codec(&mut io, &drain).await, None);
        assert!(start.elapsed() < IDLE / 2, "took {:?}", start.elapsed());
        // While serving, bytes tell the codec.
        let (mut io, mut client, _) = timed();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let serving = crate::drain::Drain::default();
        assert_eq!(sniff_codec(&mut io, &serving).await, Some(Codec::H1));
    }

    #[tokio::test]
    async fn what_the_sniff_fetched_is_handed_out_in_order_in_small_pieces() {
        let (mut io, mut client) = counted(Wire::Sniff);
        let sent: Vec<u8> = (0..3 * FIRST_READ).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).await.unwrap();
        drop(client);
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        let mut got = Vec::new();
        let mut piece = [0u8; 100];
        loop {
            let n = io.read(&mut piece).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&piece[..n]);
        }
        assert_eq!(got, sent);
    }

    #[tokio::test]
    async fn a_connection_whose_codec_is_known_reads_only_what_is_asked() {
        // Under TLS (ALPN said which codec) the stream below has its own read-ahead.
        let (mut io, mut client) = counted(Wire::H1);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut first = [0u8; 4];
        io.read_exact(&mut first).await.unwrap();
        let mut rest = [0u8; 64];
        let n = io.read(&mut rest).await.unwrap();
        assert_eq!(&rest[..n], b"/ HTTP/1.1\r\n\r\n");
        assert_eq!(io.inner.reads, 2);
    }

    fn starts_with_g(first: &[u8]) -> bool {
        first.starts_with(b"G")
    }

    #[tokio::test]
    async fn a_connection_that_must_speak_first_gets_the_head_timer_from_the_start() {
        let (io, _client, _) = timed();
        let mut io = io.first_bytes(starts_with_g);
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(
            took < IDLE && took >= HEAD - Duration::from_millis(20),
            "took {took:?}"
        );
    }

    #[tokio::test]
    async fn first_bytes_the_check_refuses_fail_the_sniff_and_hand_over_nothing() {
        let (io, mut client, _) = timed();
        let mut io = io.first_bytes(starts_with_g);
        client.write_all(b"\x00\x00\x00\x08GET").await.unwrap();
        let e = io.sniff().await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(io.fetched.is_none(), "nothing is kept for a codec");
    }

    #[tokio::test]
    async fn first_bytes_the_check_accepts_pass_through_and_are_judged_once() {
        let (io, mut client, _) = timed();
        let mut io = io.first_bytes(starts_with_g);
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        assert_eq!(io.sniff().await.unwrap(), Some(Codec::H1));
        let mut buf = [0u8; 64];
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"GET / HTTP/1.1\r\n");
        // Later bytes are the codec's business, whatever they are.
        client.write_all(b"\x00x: y\r\n").await.unwrap();
        let n = io.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"\x00x: y\r\n");
    }

    #[tokio::test]
    async fn http2_gets_only_the_idle_timer() {
        let (mut io, mut client, _) = timed();
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(took >= IDLE - Duration::from_millis(20), "took {took:?}");
    }

    #[tokio::test]
    async fn a_partial_preface_is_a_head_and_gets_the_head_timer() {
        // Four bytes that look like HTTP/2 are not the preface: a slow client cannot dodge the
        // head timer with them.
        let (mut io, mut client, _) = timed();
        client.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(took < IDLE, "took {took:?}");
    }

    #[tokio::test]
    async fn alpn_http1_is_timed_as_http1_whatever_the_bytes() {
        let (mut io, mut client, _) = timed_with(Wire::H1, 1024);
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("request head"), "{e}");
        assert!(took < IDLE, "took {took:?}");
    }

    /// An HTTP/2 frame header.
    fn frame(len: usize, kind: u8, flags: u8, stream: u32) -> Vec<u8> {
        let mut f = (len as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f
    }

    #[tokio::test]
    async fn an_h2_header_block_must_complete_in_time() {
        let (mut io, mut client, _) = timed_with(Wire::H2, 1024);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0, 0x4, 0, 0)); // SETTINGS
        bytes.extend(frame(3, 0x1, 0, 1)); // HEADERS without END_HEADERS
        bytes.extend([0x82, 0x86, 0x84]);
        bytes.extend(frame(1, 0x9, 0, 1)); // CONTINUATION without END_HEADERS
        bytes.push(0x41);
        client.write_all(&bytes).await.unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("header block"), "{e}");
        assert!(took < IDLE, "took {took:?}");
    }

    #[tokio::test]
    async fn a_complete_h2_header_block_stops_the_block_timer() {
        let (mut io, mut client, _) = timed_with(Wire::H2, 1024);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(3, 0x1, 0, 1));
        bytes.extend([0x82, 0x86, 0x84]);
        bytes.extend(frame(0, 0x9, 0x4, 1)); // CONTINUATION with END_HEADERS
        client.write_all(&bytes).await.unwrap();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("idle"), "{e}");
        assert!(took >= IDLE - Duration::from_millis(20), "took {took:?}");
    }

    #[tokio::test]
    async fn a_head_over_the_limit_is_answered_431_before_the_codec_sees_it_all() {
        let (mut io, mut client, _) = timed_with(Wire::H1, 512 << 10);
        let mut head = b"GET / HTTP/1.1\r\nx-big: ".to_vec();
        head.resize(H1_MAX_HEAD + 4096, b'a');
        client.write_all(&head).await.unwrap();
        let mut handed = 0;
        let mut buf = vec![0u8; 200 << 10];
        let e = loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(k) => handed += k,
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(handed, H1_MAX_HEAD, "the codec got more than the limit");
        let mut answer = vec![0u8; 1024];
        let k = client.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..k]);
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        assert!(
            answer.contains("x-aether-error: headers-too-large"),
            "{answer}"
        );
    }

    /// A request head with `fields` fields, each line `x-hN: v`.
    fn head_with(fields: usize) -> Vec<u8> {
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..fields {
            head.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        head
    }

    #[test]
    fn head_lines_count_fields_in_any_split_and_stop_at_the_blank_line() {
        let exact = head_with(100);
        for piece in [1, 2, 3, 7, 64, exact.len()] {
            let mut lines = HeadLines::default();
            for part in exact.chunks(piece) {
                assert!(!lines.feed(part), "100 fields, pieces of {piece}");
            }
            assert_eq!(lines.fields, 100, "pieces of {piece}");
            assert!(lines.at == LineAt::End, "pieces of {piece}");
            // What follows the blank line (a body of header-like lines) is not counted.
            assert!(!lines.feed(&b"a: b\r\n".repeat(200)));
        }
        // The field too many counts from its first byte, CRLF or bare LF line ends alike, and
        // empty lines before the request line are skipped.
        let mut over = head_with(100);
        over.truncate(over.len() - 2);
        let mut lines = HeadLines::default();
        assert!(!lines.feed(b"\r\n"));
        assert!(!lines.feed(&over));
        assert!(lines.feed(b"x"), "the 101st field");
        let mut lines = HeadLines::default();
        let bare = "GET / HTTP/1.1\n".to_string() + &"a: b\n".repeat(101);
        assert!(lines.feed(bare.as_bytes()));
        let mut lines = HeadLines::default();
        assert!(
            !lines.feed(("GET / HTTP/1.1\n".to_string() + &"a: b\n".repeat(100) + "\n").as_bytes())
        );
    }

    #[test]
    fn head_lines_find_ambiguous_framing_in_any_split() {
        let heads: [(&[u8], bool); 7] = [
            (
                b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
                true,
            ),
            (
                b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
                true,
            ),
            (
                b"POST / HTTP/1.1\r\nCONTENT-LENGTH: 5\r\nx: y\r\nContent-Length: 5\r\n\r\n",
                true,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Type: a\r\n\r\n",
                false,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTE: trailers\r\n\r\n",
                false,
            ),
            (
                b"POST / HTTP/1.1\r\nx-content-length: 5\r\ncontent-length: 5\r\n\r\n",
                false,
            ),
            (
                b"POST / HTTP/1.1\r\ncontent-length-x: 5\r\ncontent-length: 5\r\n\r\n",
                false,
            ),
        ];
        for (head, ambiguous) in heads {
            for piece in [1, 2, 3, 5, 16, head.len()] {
                let mut lines = HeadLines::default();
                let refused = head.chunks(piece).any(|part| lines.feed(part));
                let what = String::from_utf8_lossy(head);
                assert_eq!(refused, ambiguous, "{what} in pieces of {piece}");
                assert_eq!(lines.ambiguous, ambiguous, "{what} in pieces of {piece}");
            }
        }
    }

    #[tokio::test]
    async fn a_head_with_a_field_too_many_is_answered_431_and_the_codec_never_sees_it() {
        let (mut io, mut client, _) = timed_with(Wire::Sniff, 64 << 10);
        let head = head_with(101);
        let cut = head_with(100).len() - 2;
        // The first 100 fields in one write, the rest (the 101st field and the end) in another.
        client.write_all(&head[..cut]).await.unwrap();
        let mut handed = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let k = io.read(&mut buf).await.unwrap();
        handed.extend_from_slice(&buf[..k]);
        client.write_all(&head[cut..]).await.unwrap();
        let e = loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("unexpected EOF"),
                Ok(k) => handed.extend_from_slice(&buf[..k]),
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(handed, &head[..cut], "the codec got the field too many");
        let mut answer = vec![0u8; 1024];
        let k = client.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..k]);
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        assert!(
            answer.contains("x-aether-error: headers-too-large"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn each_keep_alive_head_gets_its_own_field_count() {
        let (mut io, mut client, requests) = timed_with(Wire::H1, 64 << 10);
        let mut buf = vec![0u8; 64 << 10];
        for _ in 0..3 {
            let head = head_with(100);
            client.write_all(&head).await.unwrap();
            let mut got = 0;
            while got < head.len() {
                got += io.read(&mut buf).await.unwrap();
            }
            // The codec parsed the head and the request was answered: the next head is new.
            drop(requests.start().answered());
        }
    }

    #[tokio::test]
    async fn an_http1_request_that_moves_no_bytes_times_out() {
        let (mut io, mut client, requests) = timed_with(Wire::H1, 1024);
        client.write_all(b"POST / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let _ = io.read(&mut buf).await.unwrap();
        let _open = requests.start();
        let (took, e) = time_to_error(&mut io).await;
        assert!(e.to_string().contains("no bytes"), "{e}");
        assert!(took >= STREAM - Duration::from_millis(20), "took {took:?}");
    }

    #[test]
    fn most_streams_reset_early_is_abuse_and_answered_ones_are_not() {
        let requests = Arc::new(ConnRequests::default());
        for _ in 0..RAPID_RESET_MIN_STREAMS {
            drop(requests.start().answered());
        }
        // Answered requests never count, however many.
        let notified = requests.abusive.notified();
        tokio::pin!(notified);
        assert!(futures_util::FutureExt::now_or_never(notified.as_mut()).is_none());
        // A burst of early resets past half of all streams is.
        for _ in 0..RAPID_RESET_MIN_STREAMS + 1 {
            drop(requests.start());
        }
        assert!(futures_util::FutureExt::now_or_never(notified).is_some());
    }
}
