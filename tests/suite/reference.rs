//! `docs/reference.md` stays true to the code: every field of the config and catalog files,
//! every error reason and every metric family it can meet is named there. Read from the source,
//! so a new field, reason or metric without its line in the reference fails here.

use std::path::Path;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))
        .unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The YAML names of the fields of every struct that derives `Deserialize` in `src`: the field's
/// name, or its `#[serde(rename = "...")]`.
fn deserialized_fields(src: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = src.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim();
        if !(t.starts_with("#[derive(") && t.contains("Deserialize")) {
            continue;
        }
        // Attributes, then the item itself.
        let mut item = String::new();
        for l in lines.by_ref() {
            let l = l.trim();
            if !l.starts_with("#[") && !l.starts_with("//") {
                item = l.to_string();
                break;
            }
        }
        let Some(name) = item
            .strip_prefix("pub struct ")
            .or_else(|| item.strip_prefix("struct "))
            .and_then(|r| r.strip_suffix(" {"))
        else {
            continue; // an enum, or a unit/tuple struct: no fields of its own
        };
        let mut rename = None;
        let mut in_attr = false;
        for l in lines.by_ref() {
            let l = l.trim();
            if l == "}" {
                break;
            }
            if in_attr {
                in_attr = !l.ends_with(")]");
                if let Some(r) = l.split("rename = \"").nth(1) {
                    rename = r.split('"').next().map(str::to_string);
                }
                continue;
            }
            if l.starts_with("#[") {
                if let Some(r) = l.split("rename = \"").nth(1) {
                    rename = r.split('"').next().map(str::to_string);
                }
                in_attr = !l.ends_with(")]");
                continue;
            }
            if l.starts_with("//") || l.is_empty() {
                continue;
            }
            let field = l
                .trim_start_matches("pub ")
                .split(':')
                .next()
                .unwrap()
                .trim();
            if !field.is_empty() && field.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                out.push((name.to_string(), rename.take().unwrap_or(field.to_string())));
            }
        }
    }
    out
}

/// A source file, or every Rust file of a source directory one after another.
fn read_source(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    if !path.is_dir() {
        return read(rel);
    }
    let mut files = rust_files(path);
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_config_and_catalog_field_is_in_the_reference() {
    let reference = read("docs/reference.md");
    for file in ["src/config/", "src/catalog/file.rs"] {
        let fields = deserialized_fields(&read_source(file));
        assert!(fields.len() > 10, "{file}: found only {fields:?}");
        let missing: Vec<_> = fields
            .iter()
            // Named alone (`port`) or as the last step of a path (`discovery.xds.idle`).
            .filter(|(_, f)| {
                !reference.contains(&format!("`{f}`")) && !reference.contains(&format!(".{f}`"))
            })
            .collect();
        assert!(
            missing.is_empty(),
            "{file}: fields docs/reference.md does not name: {missing:?}"
        );
    }
}

#[test]
fn every_error_reason_is_in_the_reference() {
    let answer = read("src/http/answer.rs");
    let as_str = answer
        .split("fn as_str(self)")
        .nth(1)
        .and_then(|s| s.split("\n    }\n").next())
        .expect("Reason::as_str");
    let reasons: Vec<&str> = as_str
        .split("=> \"")
        .skip(1)
        .map(|r| r.split('"').next().unwrap())
        .collect();
    assert!(reasons.len() > 20, "found only {reasons:?}");
    let reference = read("docs/reference.md");
    let table = reference
        .split("## Error answers")
        .nth(1)
        .expect("an Error answers section");
    let missing: Vec<_> = reasons
        .iter()
        .filter(|r| !table.contains(&format!("| `{r}` |")))
        .collect();
    assert!(missing.is_empty(), "reasons not in its table: {missing:?}");
}

fn rust_files(dir: std::path::PathBuf) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

#[test]
fn every_metric_family_is_in_the_reference() {
    // Subsystems register their own families (`metrics::register`): every source file.
    let sources: Vec<String> = rust_files(Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    let names: Vec<&str> = sources
        .iter()
        .flat_map(|s| s.split("registry.register(").skip(1))
        .filter_map(|r| r.split('"').nth(1))
        .collect();
    assert!(names.len() > 20, "found only {names:?}");
    let reference = read("docs/reference.md");
    let missing: Vec<_> = names
        .iter()
        .filter(|n| !reference.contains(&format!("`{n}")))
        .collect();
    assert!(missing.is_empty(), "metric families not named: {missing:?}");
}
