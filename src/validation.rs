//! Validation errors that say where they came from: a file and a field path today (config,
//! catalog), a control-plane resource and a field path later. Validation keeps going after the
//! first problem, so one run names them all.

use std::fmt;
use std::path::{Path, PathBuf};

/// Where validated input came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    /// A control-plane resource, by name.
    Resource(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(p) => write!(f, "{}", p.display()),
            Origin::Resource(name) => f.write_str(name),
        }
    }
}

/// One problem: where, which field, why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {}{reason}", field_prefix(.field))]
pub struct FieldError {
    pub origin: Origin,
    /// Field path such as `inbound.ports[1].port`; empty when the whole input is at fault.
    pub field: String,
    pub reason: String,
}

fn field_prefix(field: &str) -> String {
    if field.is_empty() {
        String::new()
    } else {
        format!("{field}: ")
    }
}

impl FieldError {
    pub fn new(origin: &Origin, field: impl Into<String>, reason: impl Into<String>) -> FieldError {
        FieldError {
            origin: origin.clone(),
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Every problem found in one input, one per line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", join_lines(.0))]
pub struct FieldErrors(pub Vec<FieldError>);

fn join_lines(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

impl From<FieldError> for FieldErrors {
    fn from(e: FieldError) -> Self {
        FieldErrors(vec![e])
    }
}

/// Reads a whole config or catalog file; the error names the file.
pub fn read_file(path: &Path) -> Result<String, FieldErrors> {
    std::fs::read_to_string(path).map_err(|e| {
        FieldError::new(
            &Origin::File(path.to_path_buf()),
            "",
            format!("cannot read: {e}"),
        )
        .into()
    })
}

/// Deserializes `text` as YAML into `T`, reporting the failing field path.
pub fn from_yaml<T: serde::de::DeserializeOwned>(file: &Path, text: &str) -> Result<T, FieldError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." { String::new() } else { field };
        let mut reason = e.into_inner().to_string();
        // The YAML library prefixes its own notion of the path; ours is already in `field`.
        let mut prefix = field.as_str();
        while !prefix.is_empty() {
            if let Some(rest) = reason.strip_prefix(&format!("{prefix}: ")) {
                reason = rest.to_string();
                break;
            }
            prefix = prefix.rsplit_once('.').map_or("", |(p, _)| p);
        }
        FieldError::new(&Origin::File(file.to_path_buf()), field, reason)
    })
}
