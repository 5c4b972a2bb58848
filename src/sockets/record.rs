//! The sizes of a TLS record, which the TLS stream, the read-ahead and the splice all size
//! their buffers by. A file of its own so that each of them can use it without importing the
//! others.

/// The most plaintext one TLS record carries.
pub const RECORD: usize = 16 * 1024;

/// Room for one full record as it travels: its plaintext plus header and tag (22 bytes more
/// in TLS 1.3, 29 with TLS 1.2's AES-GCM).
pub const SEALED_RECORD: usize = RECORD + 64;
