//! Reading a TLS ClientHello before any TLS state exists.
//!
//! The inbound listener chooses a per-port chain (certificate, ALPN, codec) from the ClientHello's
//! SNI, so it must see the SNI and the ALPN list before BoringSSL does. `record.rs` reads the
//! record layer from the socket ([`read`]); `hello.rs` parses the message body. The
//! caller then replays the very same bytes into the TLS stack (see `crate::sockets::ReadAhead`).

pub mod hello;
pub mod record;

pub use record::read;
// The benches, fuzz targets and tests/suite/rules.rs drive the parser by hand.
#[cfg(feature = "testing")]
pub use {
    hello::{ClientHello, HelloError},
    record::{parse, HelloReader, MAX_BUFFERED},
};

#[cfg(test)]
mod tests;
