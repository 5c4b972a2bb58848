//! Numbers every HTTP connection shares, inbound or outbound, server or client side: defined
//! once so the two directions cannot drift apart.

use std::sync::OnceLock;
use std::time::Duration;

/// HTTP/2 flow control and framing, as Envoy sets them: 16 MiB per stream, 24 MiB per
/// connection, 64 KiB frames.
pub const H2_STREAM_WINDOW: u32 = 16 << 20;
pub const H2_CONNECTION_WINDOW: u32 = 24 << 20;
pub const H2_MAX_FRAME: u32 = 64 << 10;
/// Streams a downstream HTTP/2 connection may open at once.
pub const H2_MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Pings on pooled upstream HTTP/2 connections that carry streams.
pub const H2_KEEPALIVE: Duration = Duration::from_secs(60);
/// Rapid reset (CVE-2023-44487): h2's own cap on streams the peer reset before they were
/// accepted (the h2 crate's default, 20), and on streams this side reset for protocol errors.
/// Our own rule on top (`server::ConnRequests`) closes connections that reset most of their
/// streams early.
pub const H2_MAX_PENDING_ACCEPT_RESETS: usize = 20;
pub const H2_MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// SPEC section 8: an HTTP/2 header list (after HPACK decoding, counted as RFC 9113 counts it:
/// name + value + 32 per field) over this ends the stream. Enforced by the h2 codec while it
/// decodes, on both sides; it also bounds what a CONTINUATION sequence may buffer. Trailers
/// are header lists too. The 60 KiB / 100 headers rule of `headers::too_large` fits under it.
pub const H2_MAX_HEADER_LIST: u32 = 64 << 10;
/// SPEC section 8: an HTTP/1 request head larger than this is answered 431
/// `headers-too-large` and the connection closed, before the codec has buffered more
/// (`server::Guarded` counts the head's bytes as they arrive).
pub const H1_MAX_HEAD: usize = 96 << 10;
/// hyper's own HTTP/1 buffer limit, a backstop just above `H1_MAX_HEAD` (past it hyper answers
/// a bare 431); also the limit for response heads from upstreams and apps. HTTP/1 trailers have
/// hyper's own, smaller limits (16 KiB, 100 fields). hyper's field limit is left at its default,
/// 100, which is SPEC's (`server::Guarded` answers the field too many before hyper sees it).
pub const HYPER_MAX_BUF: usize = 112 << 10;

/// How long a request body expecting `100 Continue` waits for the next hop's 100 before it is
/// sent anyway (curl waits as long), for apps that ignore the expectation.
pub const EXPECT_CONTINUE_WAIT: Duration = Duration::from_secs(1);

/// Idle pooled upstream connections close after this long (SPEC section 8).
pub const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Slow clients are cut off after this long without a complete header block (the admin
/// listener uses it as it is; the data listeners through `Timers::head_read`).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP keepalive on every socket, accepted or dialled: the first probe after 5 min of silence,
/// then every 30 s, 10 unanswered probes end it, so a peer that vanished without a FIN is found
/// within 5 min + 10 x 30 s = 10 min (SPEC section 8).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(300);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const KEEPALIVE_PROBES: u32 = 10;

/// The timers of SPEC section 8. Tests shrink them with the environment variable
/// `AETHER_TEST_TIMERS` (e.g. `stream_idle=2s,tunnel_idle=1s`); nothing else sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timers {
    /// From the first byte of an HTTP/1 request head (or of the HTTP/2 preface) to its end.
    pub head_read: Duration,
    /// From an HTTP/2 HEADERS frame to the end of its header block (the END_HEADERS frame).
    pub header_block: Duration,
    /// A downstream HTTP connection with no request in flight.
    pub connection_idle: Duration,
    /// An HTTP stream that moves no bytes either way (Envoy's `stream_idle_timeout`).
    pub stream_idle: Duration,
    /// Inbound: from a request's head to the app's response head (answered 504).
    pub first_byte: Duration,
    /// tcp chains and CONNECT tunnels with no bytes either way.
    pub tunnel_idle: Duration,
}

impl Default for Timers {
    fn default() -> Timers {
        Timers {
            head_read: HEADER_READ_TIMEOUT,
            header_block: Duration::from_secs(10),
            connection_idle: Duration::from_secs(3600),
            stream_idle: Duration::from_secs(300),
            first_byte: Duration::from_secs(15),
            tunnel_idle: Duration::from_secs(3600),
        }
    }
}

impl Timers {
    /// The defaults with `name=duration` pairs (comma-separated) applied.
    pub fn with_overrides(spec: &str) -> Result<Timers, String> {
        let mut t = Timers::default();
        for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not name=duration"))?;
            let d = humantime::parse_duration(value.trim())
                .map_err(|e| format!("{name}: {value:?} is not a duration: {e}"))?;
            if d.is_zero() {
                return Err(format!("{name}: must be greater than zero"));
            }
            let slot = match name.trim() {
                "head_read" => &mut t.head_read,
                "header_block" => &mut t.header_block,
                "connection_idle" => &mut t.connection_idle,
                "stream_idle" => &mut t.stream_idle,
                "first_byte" => &mut t.first_byte,
                "tunnel_idle" => &mut t.tunnel_idle,
                other => return Err(format!("{other:?} is not a timer")),
            };
            *slot = d;
        }
        Ok(t)
    }
}

/// The timers in use, read once.
pub fn timers() -> &'static Timers {
    static T: OnceLock<Timers> = OnceLock::new();
    T.get_or_init(|| match std::env::var("AETHER_TEST_TIMERS") {
        Ok(spec) => Timers::with_overrides(&spec).unwrap_or_else(|e| {
            tracing::warn!("AETHER_TEST_TIMERS ignored: {e}");
            Timers::default()
        }),
        Err(_) => Timers::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalive_finds_a_vanished_peer_within_about_ten_minutes() {
        let worst = KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_PROBES;
        assert_eq!(worst, Duration::from_secs(600));
    }

    #[test]
    fn timer_overrides() {
        let t = Timers::with_overrides("stream_idle=2s, tunnel_idle=500ms").unwrap();
        assert_eq!(t.stream_idle, Duration::from_secs(2));
        assert_eq!(t.tunnel_idle, Duration::from_millis(500));
        assert_eq!(t.head_read, Timers::default().head_read);
        assert!(Timers::with_overrides("nope=1s").is_err());
        assert!(Timers::with_overrides("stream_idle=soon").is_err());
        assert!(Timers::with_overrides("stream_idle=0s").is_err());
        assert_eq!(Timers::with_overrides("").unwrap(), Timers::default());
    }
}
