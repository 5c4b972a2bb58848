//! `aether-proxy certs`: a local test CA plus one SPIFFE leaf certificate per workload.
//!
//! The output is what `identity.cert` / `identity.key` / `identity.ca` expect (SPEC 3):
//! `ca.crt` + `ca.key`, and `<sa>.crt` (leaf only, PEM) + `<sa>.key` (PKCS#8 PEM, mode 0600)
//! per workload, with exactly one URI SAN `spiffe://<td>/ns/<ns>/sa/<sa>`.
//! An existing `ca.crt` + `ca.key` in the output directory is reused, so workloads can be
//! added later and "another CA" is simply another directory.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use time::{Duration, OffsetDateTime};

const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
/// Ten years: these files are checked in as the repo's test certs and must not expire soon.
const VALIDITY: Duration = Duration::days(3652);
/// Backdated so a peer whose clock is slightly behind still accepts a fresh cert.
const BACKDATE: Duration = Duration::days(1);

/// One workload identity, `<namespace>/<service account>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Workload {
    pub namespace: String,
    pub service_account: String,
}

impl Workload {
    /// Parses `ns/sa`. Both parts must be non-empty names of `[a-z0-9-.]` that start and end
    /// with a letter or digit (Kubernetes name rules; also keeps `.`/`..` out of the SPIFFE
    /// path and `-x` out of file names that tools would read as flags).
    pub fn parse(s: &str) -> Result<Workload, String> {
        let mut parts = s.split('/');
        let (Some(namespace), Some(service_account), None) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!(
                "workload {s:?}: expected <namespace>/<service account>, e.g. default/payments"
            ));
        };
        check_name(s, "namespace", namespace)?;
        check_name(s, "service account", service_account)?;
        Ok(Workload {
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        })
    }

    /// The SPIFFE ID this workload's certificate carries.
    pub fn spiffe_id(&self, trust_domain: &str) -> String {
        format!(
            "spiffe://{trust_domain}/ns/{}/sa/{}",
            self.namespace, self.service_account
        )
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.service_account)
    }
}

fn check_name(workload: &str, what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("workload {workload:?}: empty {what}"));
    }
    if name.len() > 253 {
        return Err(format!(
            "workload {workload:?}: {what} is longer than 253 characters"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '-' | '.'))
    {
        return Err(format!(
            "workload {workload:?}: {what} {name:?} contains {c:?}; allowed are a-z, 0-9, '-' and '.'"
        ));
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !alnum(name.chars().next()) || !alnum(name.chars().last()) {
        return Err(format!(
            "workload {workload:?}: {what} {name:?} must start and end with a letter or digit"
        ));
    }
    Ok(())
}

/// The trust domain becomes the SPIFFE URI authority, so it must be a lowercase DNS-like name.
fn check_trust_domain(td: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("trust domain {td:?}: {why}"));
    if td.is_empty() {
        return bad("empty");
    }
    if td.len() > 253 {
        return bad("longer than 253 characters");
    }
    for label in td.split('.') {
        if label.is_empty() {
            return bad("empty label (leading, trailing or double '.')");
        }
        if label.len() > 63 {
            return bad("a label is longer than 63 characters");
        }
        if let Some(c) = label
            .chars()
            .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '-'))
        {
            return bad(&format!(
                "contains {c:?}; expected a lowercase DNS name (a-z, 0-9, '-', '.')"
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return bad("a label starts or ends with '-'");
        }
    }
    Ok(())
}

/// File stem per workload: `<sa>`, or `<ns>-<sa>` when the SA name is used in more than one
/// namespace (or is `ca`, which would overwrite the CA). Errors on duplicates and on any
/// remaining clash (e.g. `a-b/c` and `a/b-c` both give `a-b-c`) rather than overwrite.
fn file_stems(workloads: &[Workload]) -> Result<Vec<String>, String> {
    let mut seen = HashSet::new();
    let mut namespaces_per_sa: HashMap<&str, usize> = HashMap::new();
    for w in workloads {
        if !seen.insert(w) {
            return Err(format!("workload {w} is given more than once"));
        }
        *namespaces_per_sa.entry(&w.service_account).or_default() += 1;
    }
    let mut stems = Vec::with_capacity(workloads.len());
    let mut taken: HashMap<String, &Workload> = HashMap::new();
    for w in workloads {
        let sa = w.service_account.as_str();
        let stem = if namespaces_per_sa[sa] > 1 || sa == "ca" {
            format!("{}-{}", w.namespace, sa)
        } else {
            sa.to_string()
        };
        if let Some(other) = taken.insert(stem.clone(), w) {
            return Err(format!(
                "workloads {other} and {w} would both be written to {stem}.crt; rename one"
            ));
        }
        stems.push(stem);
    }
    Ok(stems)
}

/// What `generate_report` did; `main` prints it.
struct Report {
    /// Subject CN of a CA found in the output directory, if one was reused.
    reused_ca: Option<String>,
    written: Vec<PathBuf>,
}

/// Writes (or reuses) the CA in `out` and a certificate + key per workload.
/// Returns the paths written; `ca.crt`/`ca.key` are among them only if the CA was created.
pub fn generate(
    out: &Path,
    trust_domain: &str,
    workloads: &[Workload],
) -> Result<Vec<PathBuf>, String> {
    generate_report(out, trust_domain, workloads).map(|r| r.written)
}

fn generate_report(
    out: &Path,
    trust_domain: &str,
    workloads: &[Workload],
) -> Result<Report, String> {
    // Validate everything before touching the filesystem, so bad input writes nothing.
    check_trust_domain(trust_domain)?;
    let stems = file_stems(workloads)?;

    fs::create_dir_all(out)
        .map_err(|e| format!("cannot create output directory {}: {e}", out.display()))?;

    let now = OffsetDateTime::now_utc();
    let mut written = Vec::new();
    let ca = match load_ca(out, now)? {
        Some(ca) => ca,
        None => create_ca(out, trust_domain, now, &mut written)?,
    };

    for (w, stem) in workloads.iter().zip(&stems) {
        let key = new_key()?;
        let uri = w.spiffe_id(trust_domain);
        let uri = uri
            .clone()
            .try_into()
            .map_err(|e| format!("SPIFFE ID {uri:?}: {e}"))?;
        let mut params = leaf_params(vec![SanType::URI(uri)]);
        params.distinguished_name = common_name(&w.service_account);
        params.serial_number = Some(random_serial()?);
        params.not_before = now - BACKDATE;
        // A leaf must not outlive a reused CA.
        params.not_after = (now + VALIDITY).min(ca.not_after);
        let cert = params
            .signed_by(&key, &ca.issuer)
            .map_err(|e| format!("signing the certificate for {w}: {e}"))?;

        let key_path = out.join(format!("{stem}.key"));
        let cert_path = out.join(format!("{stem}.crt"));
        write_file(&key_path, &key.serialize_pem(), true)?;
        write_file(&cert_path, &cert.pem(), false)?;
        written.push(cert_path);
        written.push(key_path);
    }
    Ok(Report {
        reused_ca: ca.reused_cn,
        written,
    })
}

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    not_after: OffsetDateTime,
    reused_cn: Option<String>,
}

fn create_ca(
    out: &Path,
    trust_domain: &str,
    now: OffsetDateTime,
    written: &mut Vec<PathBuf>,
) -> Result<Ca, String> {
    let key = new_key()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = common_name(&format!("aether-proxy test CA ({trust_domain})"));
    // Path length 0: this CA only ever signs leaves directly.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.serial_number = Some(random_serial()?);
    params.not_before = now - BACKDATE;
    params.not_after = now + VALIDITY;
    let cert = params
        .self_signed(&key)
        .map_err(|e| format!("self-signing the CA: {e}"))?;

    // Key first: a run cut short leaves ca.key without ca.crt, which load_ca reports,
    // instead of a CA certificate whose key is lost.
    let key_path = out.join(CA_KEY);
    let cert_path = out.join(CA_CERT);
    write_file(&key_path, &key.serialize_pem(), true)?;
    write_file(&cert_path, &cert.pem(), false)?;
    written.push(cert_path);
    written.push(key_path);
    Ok(Ca {
        not_after: params.not_after,
        issuer: Issuer::new(params, key),
        reused_cn: None,
    })
}

/// Loads `ca.crt` + `ca.key` from `out` if both exist; `None` if neither does.
fn load_ca(out: &Path, now: OffsetDateTime) -> Result<Option<Ca>, String> {
    let cert_path = out.join(CA_CERT);
    let key_path = out.join(CA_KEY);
    match (cert_path.exists(), key_path.exists()) {
        (false, false) => return Ok(None),
        (true, true) => {}
        (has_cert, _) => {
            let (present, missing) = if has_cert {
                (&cert_path, &key_path)
            } else {
                (&key_path, &cert_path)
            };
            return Err(format!(
                "{} exists but {} does not; remove it to create a new CA, or supply both",
                present.display(),
                missing.display()
            ));
        }
    }
    let read =
        |p: &Path| fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let cert_pem = read(&cert_path)?;
    let key_pem = read(&key_path)?;
    let bad_cert = |why: &str| format!("{}: {why}", cert_path.display());

    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| bad_cert(&format!("not a PEM certificate: {e}")))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| bad_cert(&format!("not an X.509 certificate: {e}")))?;
    if !cert.is_ca() {
        return Err(bad_cert(
            "not a CA certificate (basicConstraints CA:TRUE missing)",
        ));
    }
    let not_after = cert.validity().not_after.to_datetime();
    if not_after <= now {
        return Err(bad_cert(
            "the CA has expired; remove ca.crt and ca.key to create a new one",
        ));
    }
    let key = KeyPair::from_pem(&key_pem)
        .map_err(|e| format!("{}: not a PKCS#8 private key: {e}", key_path.display()))?;
    // Signing with a key that doesn't belong to the CA cert would produce leaves nothing verifies.
    if key.public_key_raw() != cert.public_key().subject_public_key.data.as_ref() {
        return Err(format!(
            "{} does not match {}",
            key_path.display(),
            cert_path.display()
        ));
    }
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or("")
        .to_string();
    let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)
        .map_err(|e| bad_cert(&format!("cannot use as issuer: {e}")))?;
    Ok(Some(Ca {
        issuer,
        not_after,
        reused_cn: Some(cn),
    }))
}

/// A workload leaf as the mesh issues it: `sans` (its SPIFFE id), not a CA, for signatures,
/// for both server and client authentication, and linked to its CA by AKI, which verifiers
/// (and `openssl verify -x509_strict`) use to find the issuer. Name, serial and validity are the
/// caller's. The tests' leaves start from it too.
pub fn leaf_params(sans: Vec<SanType>) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.subject_alt_names = sans;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    params
}

fn new_key() -> Result<KeyPair, String> {
    KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
        .map_err(|e| format!("generating a P-256 key: {e}"))
}

fn common_name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

/// 16 random bytes from BoringSSL's CSPRNG. The top byte is forced to 0b01xxxxxx so the
/// DER INTEGER is positive and minimal at a fixed 16 bytes (126 random bits remain).
fn random_serial() -> Result<SerialNumber, String> {
    let mut bytes = [0u8; 16];
    boring::rand::rand_bytes(&mut bytes).map_err(|e| format!("random serial: {e}"))?;
    bytes[0] = (bytes[0] & 0x3f) | 0x40;
    Ok(SerialNumber::from_slice(&bytes))
}

/// Writes via a temporary file and rename, so the proxy's file watcher never reads a
/// half-written cert. Private keys are created 0600 from the start (no wider window).
fn write_file(path: &Path, contents: &str, private: bool) -> Result<(), String> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("bad output path {}", path.display()))?;
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let fail = |e: std::io::Error| format!("cannot write {}: {e}", path.display());
    // A stale temp file from an interrupted run would make create_new fail.
    let _ = fs::remove_file(&tmp);
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(if private { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = private;
    let result = opts
        .open(&tmp)
        .and_then(|mut f| f.write_all(contents.as_bytes()))
        .and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(fail(e));
    }
    Ok(())
}

/// `aether-proxy certs --out DIR --trust-domain TD --workload NS/SA ...`
pub fn main(out: &Path, trust_domain: &str, workloads: &[String]) -> ExitCode {
    let result = workloads
        .iter()
        .map(|w| Workload::parse(w))
        .collect::<Result<Vec<_>, _>>()
        .and_then(|ws| generate_report(out, trust_domain, &ws));
    match result {
        Ok(report) => {
            match &report.reused_ca {
                Some(cn) => println!(
                    "reusing existing CA {} (CN={cn})",
                    out.join(CA_CERT).display()
                ),
                None => println!("created new CA {}", out.join(CA_CERT).display()),
            }
            for path in &report.written {
                println!("wrote {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_kubernetes_names() {
        let w = Workload::parse("kube-system/my.sa-1").expect("valid");
        assert_eq!(w.namespace, "kube-system");
        assert_eq!(w.service_account, "my.sa-1");
        assert_eq!(
            w.spiffe_id("aether.local"),
            "spiffe://aether.local/ns/kube-system/sa/my.sa-1"
        );
    }

    #[test]
    fn parse_rejects_malformed() {
        for bad in [
            "nonsense", "a/b/c", "/b", "a/", "", "/", "A/b", "a/b_c", "a/b c", "a/..", "a/-b",
            "a/b.",
        ] {
            assert!(Workload::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn trust_domain_rules() {
        for good in ["aether.local", "example", "a-b.c0"] {
            assert!(check_trust_domain(good).is_ok(), "{good:?}");
        }
        for bad in [
            "",
            "Aether.local",
            "a..b",
            ".a",
            "a.",
            "-a.b",
            "a_b",
            "a/b",
            "a:80",
        ] {
            assert!(check_trust_domain(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stems_disambiguate_shared_service_accounts() {
        let ws: Vec<Workload> = ["default/api", "prod/api", "default/web", "x/ca"]
            .iter()
            .map(|s| Workload::parse(s).expect("valid"))
            .collect();
        assert_eq!(
            file_stems(&ws).expect("no clash"),
            ["default-api", "prod-api", "web", "x-ca"]
        );
    }

    #[test]
    fn stems_reject_duplicates_and_clashes() {
        let dup: Vec<Workload> = ["a/b", "a/b"]
            .iter()
            .map(|s| Workload::parse(s).expect("valid"))
            .collect();
        assert!(file_stems(&dup).is_err());
        // `c` is shared, so a-b/c becomes a-b-c: the plain name of q/a-b-c.
        let clash: Vec<Workload> = ["a-b/c", "z/c", "q/a-b-c"]
            .iter()
            .map(|s| Workload::parse(s).expect("valid"))
            .collect();
        assert!(file_stems(&clash).is_err());
    }
}
