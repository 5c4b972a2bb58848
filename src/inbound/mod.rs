//! The inbound side: mTLS on :15008, chain chosen by the ClientHello's SNI, forwarded in the
//! chain's protocol to `app_host:<port>`.

pub mod clienthello;
pub mod prefixed;
