//! Transparent capture (SPEC section 10), the parts outside the proxy's data path: the
//! netfilter rules an init container installs (`redirect`), and reading where a redirected
//! connection was going (`original_dst`), which the outbound listener asks for each connection.

pub mod original_dst;
pub mod redirect;
