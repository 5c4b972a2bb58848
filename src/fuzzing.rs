//! What the fuzz targets in `fuzz/` need that is private to its module. Not an API: nothing
//! else may use it, and it may change with the code it reaches.

/// Decodes `value` as the SDS Secret `name` (`default` or `ROOTCA`) exactly as a pushed one
/// is read. `Ok` carries the lengths of the PEM blobs the secret holds.
pub fn sds_secret(name: &str, value: &[u8]) -> Result<Vec<usize>, String> {
    use crate::xds::sds::{decode_secret, Pushed};
    Ok(match decode_secret(name, value)? {
        Pushed::Workload { cert, key } => vec![cert.len(), key.len()],
        Pushed::RootCa(pem) => vec![pem.len()],
    })
}
