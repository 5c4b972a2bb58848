//! Workload identity: certificates, SPIFFE SAN checks, TLS contexts and their rotation.

pub mod certgen;
