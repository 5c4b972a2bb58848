//! `aether-proxy certs`, checked from the outside: the real binary writes into temp dirs and
//! independent tools (the `openssl` CLI, x509-parser, BoringSSL) judge the output.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use boring::nid::Nid;
use boring::pkey::{PKey, Private};
use boring::x509::X509;
use time::{Duration, OffsetDateTime};
use x509_parser::extensions::GeneralName;
use x509_parser::pem::{parse_x509_pem, Pem};

fn certs_cmd(out: &Path, trust_domain: &str, workloads: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_aether-proxy"));
    // `--flag=value` so values starting with '-' reach our validation, not clap's.
    cmd.arg("certs")
        .arg("--out")
        .arg(out)
        .arg(format!("--trust-domain={trust_domain}"));
    for w in workloads {
        cmd.arg(format!("--workload={w}"));
    }
    cmd.output().expect("spawn aether-proxy")
}

/// Runs `certs` and insists it succeeded; returns stdout.
fn certs_ok(out: &Path, trust_domain: &str, workloads: &[&str]) -> String {
    let o = certs_cmd(out, trust_domain, workloads);
    assert!(
        o.status.success(),
        "certs failed: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs `certs` and insists on exit 1 with an `error:` line and no panic; returns stderr.
fn certs_fail(out: &Path, trust_domain: &str, workloads: &[&str]) -> String {
    let o = certs_cmd(out, trust_domain, workloads);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.starts_with("error: "), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
    stderr
}

/// `openssl verify` in strict mode, for both TLS purposes the mesh uses (mTLS both ways).
/// Returns whether it passed and what openssl said.
fn openssl_verify(ca: &Path, cert: &Path) -> (bool, String) {
    let mut said = String::new();
    let mut ok = true;
    for purpose in ["sslserver", "sslclient"] {
        let o = Command::new("openssl")
            .args(["verify", "-x509_strict", "-purpose", purpose, "-CAfile"])
            .arg(ca)
            .arg(cert)
            .output()
            .expect("run openssl (install the openssl CLI)");
        ok &= o.status.success();
        said.push_str(&String::from_utf8_lossy(&o.stdout));
        said.push_str(&String::from_utf8_lossy(&o.stderr));
    }
    (ok, said)
}

fn read_pem(path: &Path) -> Pem {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let (rest, pem) = parse_x509_pem(&bytes).expect("PEM certificate");
    // The leaf file is the leaf only; the CA lives in ca.crt.
    assert!(
        String::from_utf8_lossy(rest).trim().is_empty(),
        "{} holds more than one PEM block",
        path.display()
    );
    pem
}

fn uri_sans(path: &Path) -> Vec<String> {
    let pem = read_pem(path);
    let cert = pem.parse_x509().expect("X.509");
    let san = cert
        .subject_alternative_name()
        .expect("well-formed SAN")
        .expect("SAN present");
    san.value
        .general_names
        .iter()
        .map(|n| match n {
            GeneralName::URI(u) => u.to_string(),
            other => format!("non-URI SAN {other:?}"),
        })
        .collect()
}

fn boring_cert(path: &Path) -> X509 {
    X509::from_pem(&fs::read(path).expect("read cert")).expect("BoringSSL parses cert")
}

fn boring_key(path: &Path) -> PKey<Private> {
    let pem = fs::read(path).expect("read key");
    assert!(
        pem.starts_with(b"-----BEGIN PRIVATE KEY-----"),
        "{} is not PKCS#8 PEM",
        path.display()
    );
    PKey::private_key_from_pem(&pem).expect("BoringSSL parses key")
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("stat").permissions().mode() & 0o777
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

#[test]
fn leaf_verifies_against_its_ca_with_openssl() {
    let dir = tempdir();
    certs_ok(
        dir.path(),
        "aether.local",
        &["default/payments", "default/frontend"],
    );
    for leaf in ["payments.crt", "frontend.crt"] {
        let (ok, said) = openssl_verify(&dir.path().join("ca.crt"), &dir.path().join(leaf));
        assert!(ok, "{leaf}: {said}");
    }
}

#[test]
fn leaf_san_is_exactly_the_spiffe_uri() {
    let dir = tempdir();
    certs_ok(dir.path(), "mesh.example", &["shop/payments"]);
    assert_eq!(
        uri_sans(&dir.path().join("payments.crt")),
        ["spiffe://mesh.example/ns/shop/sa/payments"]
    );
}

#[test]
fn leaf_and_ca_carry_the_promised_extensions() {
    let dir = tempdir();
    certs_ok(
        dir.path(),
        "aether.local",
        &["default/payments", "default/orders"],
    );
    let now = OffsetDateTime::now_utc();

    let ca_pem = read_pem(&dir.path().join("ca.crt"));
    let ca = ca_pem.parse_x509().expect("CA X.509");
    let cn = |c: &x509_parser::certificate::X509Certificate<'_>| {
        c.subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_string)
    };
    assert_eq!(
        cn(&ca).as_deref(),
        Some("aether-proxy test CA (aether.local)")
    );
    assert_eq!(ca.subject(), ca.issuer(), "CA is self-signed");
    assert!(ca.is_ca());
    let ku = ca.key_usage().expect("KU").expect("CA has key usage").value;
    assert!(ku.key_cert_sign() && ku.crl_sign() && !ku.digital_signature());

    let leaf_pem = read_pem(&dir.path().join("payments.crt"));
    let leaf = leaf_pem.parse_x509().expect("leaf X.509");
    assert_eq!(cn(&leaf).as_deref(), Some("payments"));
    assert_eq!(leaf.issuer(), ca.subject());
    let bc = leaf
        .basic_constraints()
        .expect("BC")
        .expect("explicit CA:FALSE");
    assert!(!bc.value.ca);
    let ku = leaf
        .key_usage()
        .expect("KU")
        .expect("leaf has key usage")
        .value;
    assert!(ku.digital_signature() && !ku.key_cert_sign() && !ku.crl_sign());
    let eku = leaf
        .extended_key_usage()
        .expect("EKU")
        .expect("leaf has EKU")
        .value;
    assert!(eku.server_auth && eku.client_auth && !eku.any);

    // Validity: already valid (backdated) and long-lived, since these become checked-in certs.
    let v = leaf.validity();
    assert!(v.not_before.to_datetime() < now - Duration::hours(12));
    assert!(v.not_after.to_datetime() > now + Duration::days(9 * 365));

    // Serials are random, not derived from anything shared.
    let other_pem = read_pem(&dir.path().join("orders.crt"));
    let other = other_pem.parse_x509().expect("X.509");
    assert_ne!(leaf.raw_serial(), other.raw_serial());
    assert!(leaf.raw_serial().len() >= 8, "serial has at least 64 bits");

    for f in ["ca.crt", "payments.crt"] {
        let key = boring_cert(&dir.path().join(f))
            .public_key()
            .expect("pubkey");
        let curve = key.ec_key().expect("EC key").group().curve_name();
        assert_eq!(curve, Some(Nid::X9_62_PRIME256V1), "{f} is P-256");
    }
}

#[test]
fn key_matches_cert_and_is_private() {
    let dir = tempdir();
    certs_ok(
        dir.path(),
        "aether.local",
        &["default/payments", "default/frontend"],
    );
    let d = dir.path();
    let payments_cert = boring_cert(&d.join("payments.crt"))
        .public_key()
        .expect("pub");
    let payments_key = boring_key(&d.join("payments.key"));
    let frontend_key = boring_key(&d.join("frontend.key"));
    assert!(payments_key.public_eq(&payments_cert));
    assert!(
        !frontend_key.public_eq(&payments_cert),
        "keys are per workload"
    );
    let ca_cert = boring_cert(&d.join("ca.crt")).public_key().expect("pub");
    assert!(boring_key(&d.join("ca.key")).public_eq(&ca_cert));

    for key in ["ca.key", "payments.key", "frontend.key"] {
        assert_eq!(mode(&d.join(key)), 0o600, "{key}");
    }
}

#[test]
fn cert_from_another_ca_does_not_verify() {
    let (a, b) = (tempdir(), tempdir());
    certs_ok(a.path(), "aether.local", &["default/payments"]);
    certs_ok(b.path(), "aether.local", &["default/payments"]);
    assert_ne!(
        fs::read(a.path().join("ca.crt")).expect("read"),
        fs::read(b.path().join("ca.crt")).expect("read"),
        "each directory gets its own CA"
    );
    let (ok, said) = openssl_verify(&a.path().join("ca.crt"), &b.path().join("payments.crt"));
    assert!(!ok, "foreign leaf verified: {said}");
    assert!(said.contains("unable to get local issuer"), "{said}");
}

#[test]
fn rerun_in_same_dir_reuses_the_ca() {
    let dir = tempdir();
    let d = dir.path();
    let first = certs_ok(d, "aether.local", &["default/payments"]);
    assert!(first.contains("created new CA"), "{first}");
    let ca_crt = fs::read(d.join("ca.crt")).expect("read");
    let ca_key = fs::read(d.join("ca.key")).expect("read");

    let second = certs_ok(d, "aether.local", &["default/orders"]);
    assert!(second.contains("reusing existing CA"), "{second}");
    assert!(
        !second
            .lines()
            .any(|l| l.starts_with("wrote") && l.ends_with("ca.crt")),
        "{second}"
    );
    assert_eq!(fs::read(d.join("ca.crt")).expect("read"), ca_crt);
    assert_eq!(fs::read(d.join("ca.key")).expect("read"), ca_key);
    for leaf in ["payments.crt", "orders.crt"] {
        let (ok, said) = openssl_verify(&d.join("ca.crt"), &d.join(leaf));
        assert!(ok, "{leaf}: {said}");
    }

    // Re-issuing an existing workload replaces its pair and keeps the key private.
    let old = fs::read(d.join("payments.crt")).expect("read");
    certs_ok(d, "aether.local", &["default/payments"]);
    assert_ne!(fs::read(d.join("payments.crt")).expect("read"), old);
    assert_eq!(mode(&d.join("payments.key")), 0o600);
    let (ok, said) = openssl_verify(&d.join("ca.crt"), &d.join("payments.crt"));
    assert!(ok, "{said}");
}

#[test]
fn shared_service_account_gets_namespace_prefixed_files() {
    let dir = tempdir();
    let d = dir.path();
    certs_ok(
        d,
        "aether.local",
        &["default/api", "prod/api", "default/web"],
    );
    assert!(!d.join("api.crt").exists());
    assert_eq!(
        uri_sans(&d.join("default-api.crt")),
        ["spiffe://aether.local/ns/default/sa/api"]
    );
    assert_eq!(
        uri_sans(&d.join("prod-api.crt")),
        ["spiffe://aether.local/ns/prod/sa/api"]
    );
    assert!(d.join("prod-api.key").exists() && d.join("web.crt").exists());
}

#[test]
fn bad_workload_exits_1_and_writes_nothing() {
    for bad in [
        "nonsense",
        "a/b/c",
        "/payments",
        "Default/payments",
        "default/pay_ments",
    ] {
        let dir = tempdir();
        let out = dir.path().join("out");
        let stderr = certs_fail(&out, "aether.local", &["default/payments", bad]);
        assert!(stderr.contains(bad), "message names the input: {stderr}");
        assert!(!out.exists(), "{bad}: nothing should be written");
    }
}

#[test]
fn bad_trust_domain_exits_1() {
    for bad in [
        "Aether.Local",
        "aether_local",
        "aether..local",
        "-aether.local",
        "",
    ] {
        let dir = tempdir();
        let stderr = certs_fail(dir.path(), bad, &["default/payments"]);
        assert!(stderr.contains("trust domain"), "{stderr}");
        assert!(!dir.path().join("ca.crt").exists());
    }
}

#[test]
fn unwritable_out_exits_1() {
    let dir = tempdir();
    let file = dir.path().join("regular-file");
    fs::write(&file, "not a directory").expect("write");
    let stderr = certs_fail(&file.join("certs"), "aether.local", &["default/payments"]);
    assert!(
        stderr.contains("regular-file"),
        "message names the path: {stderr}"
    );
}

#[test]
fn half_or_mismatched_ca_is_refused_not_overwritten() {
    let (a, b) = (tempdir(), tempdir());
    certs_ok(a.path(), "aether.local", &["default/payments"]);
    certs_ok(b.path(), "aether.local", &["default/payments"]);

    // ca.key from another CA: signing with it would yield leaves nothing verifies.
    fs::copy(b.path().join("ca.key"), a.path().join("ca.key")).expect("copy");
    let stderr = certs_fail(a.path(), "aether.local", &["default/orders"]);
    assert!(stderr.contains("does not match"), "{stderr}");
    assert!(!a.path().join("orders.crt").exists());

    // Only ca.crt present.
    let c = tempdir();
    let ca_crt = fs::read(a.path().join("ca.crt")).expect("read");
    fs::write(c.path().join("ca.crt"), &ca_crt).expect("write");
    let stderr = certs_fail(c.path(), "aether.local", &["default/orders"]);
    assert!(stderr.contains("ca.key"), "{stderr}");
    assert_eq!(fs::read(c.path().join("ca.crt")).expect("read"), ca_crt);
    assert!(!c.path().join("ca.key").exists());
}

/// The checked-in test certs (`certs/`) must stay a consistent, valid set.
#[test]
fn checked_in_certs_are_consistent() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("certs");
    let ca = dir.join("ca.crt");
    for sa in ["payments", "frontend", "orders"] {
        let cert = dir.join(format!("{sa}.crt"));
        let (ok, said) = openssl_verify(&ca, &cert);
        assert!(ok, "{sa}: {said}");
        assert_eq!(
            uri_sans(&cert),
            [format!("spiffe://aether.local/ns/default/sa/{sa}")]
        );
        let key = boring_key(&dir.join(format!("{sa}.key")));
        assert!(key.public_eq(&boring_cert(&cert).public_key().expect("pub")));
    }
}
