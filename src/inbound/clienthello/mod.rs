//! Reading a TLS ClientHello before any TLS state exists.
//!
//! The inbound listener chooses a per-port chain (certificate, ALPN, codec) from the ClientHello's
//! SNI, so it must see the SNI and the ALPN list before BoringSSL does. `record.rs` reads the
//! record layer from the socket ([`read`], [`parse`]); `hello.rs` parses the message body. The
//! caller then replays the very same bytes into the TLS stack (see `crate::sockets::ReadAhead`).

pub mod hello;
pub mod record;

pub use hello::{ClientHello, HelloError, MAX_CLIENT_HELLO};
pub use record::{parse, read, read_with, HelloReader, ReadError, MAX_BUFFERED};

#[cfg(test)]
mod tests;
