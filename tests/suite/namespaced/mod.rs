//! Tests in real network namespaces (they need root): traffic stays on links the test creates,
//! service addresses are in 240.240.0.0/16, and everything is removed when a test ends.

mod capture;
mod dns;
