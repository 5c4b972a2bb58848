//! Certificates made by the real binary (`aether-proxy certs`), and small X.509 readers.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::BIN;

/// A temp dir holding a CA (`ca.crt`, `ca.key`) and workload certificates made by the real
/// binary (`aether-proxy certs`). A workload `ns/sa` is written as `<sa>.crt` + `<sa>.key`
/// (the "stem" is the service account, as long as no two workloads share one).
pub struct Certs {
    dir: tempfile::TempDir,
    trust_domain: String,
}

impl Certs {
    /// A new CA for `trust_domain` and one leaf per workload (`"default/payments"`, ...).
    pub fn new(trust_domain: &str, workloads: &[&str]) -> Certs {
        let dir = tempfile::Builder::new()
            .prefix("aether-certs-")
            .tempdir()
            .expect("temp dir");
        let certs = Certs {
            dir,
            trust_domain: trust_domain.to_string(),
        };
        certs.issue(workloads);
        certs
    }

    /// More leaves from the same CA, same trust domain.
    pub fn issue(&self, workloads: &[&str]) {
        run_certs(self.dir.path(), &self.trust_domain, workloads);
    }

    /// A new directory with this CA (copied) and leaves for `workloads` in another trust domain:
    /// certificates that chain to the same CA but carry a foreign SPIFFE id.
    pub fn same_ca_other_trust_domain(&self, trust_domain: &str, workloads: &[&str]) -> Certs {
        let dir = tempfile::Builder::new()
            .prefix("aether-certs-")
            .tempdir()
            .expect("temp dir");
        for f in ["ca.crt", "ca.key"] {
            fs::copy(self.dir.path().join(f), dir.path().join(f)).expect("copy CA");
        }
        run_certs(dir.path(), trust_domain, workloads);
        Certs {
            dir,
            trust_domain: trust_domain.to_string(),
        }
    }

    /// A new directory with this CA (copied) and no leaves yet; [`Certs::mint`] fills it.
    pub fn same_ca(&self) -> Certs {
        let dir = tempfile::Builder::new()
            .prefix("aether-certs-")
            .tempdir()
            .expect("temp dir");
        for f in ["ca.crt", "ca.key"] {
            fs::copy(self.dir.path().join(f), dir.path().join(f)).expect("copy CA");
        }
        Certs {
            dir,
            trust_domain: self.trust_domain.clone(),
        }
    }

    /// Writes `<stem>.crt` + `<stem>.key`: a leaf signed by this CA (rcgen, in the test) whose
    /// SANs are exactly `uris` (URI SANs, any shape) and `dns` (DNS SANs), for certificates
    /// `aether-proxy certs` would never make.
    pub fn mint(&self, stem: &str, uris: &[&str], dns: &[&str]) {
        use rcgen::{Issuer, KeyPair, SanType, PKCS_ECDSA_P256_SHA256};
        let ca_pem = fs::read_to_string(self.ca()).expect("read ca.crt");
        let ca_key = fs::read_to_string(self.dir.path().join("ca.key")).expect("read ca.key");
        let ca_key = KeyPair::from_pem(&ca_key).expect("CA key");
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).expect("CA as issuer");
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("leaf key");
        let mut sans = Vec::new();
        for u in uris {
            sans.push(SanType::URI((*u).try_into().expect("IA5 URI")));
        }
        for d in dns {
            sans.push(SanType::DnsName((*d).try_into().expect("IA5 DNS name")));
        }
        // Shaped as `aether-proxy certs` shapes its leaves, with these SANs instead.
        let params = aether_proxy::identity::certgen::leaf_params(sans);
        let cert = params.signed_by(&key, &issuer).expect("sign the leaf");
        fs::write(self.cert(stem), cert.pem()).expect("write leaf");
        fs::write(self.key(stem), key.serialize_pem()).expect("write key");
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }
    /// The CA certificate (the trust bundle).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }
    pub fn cert(&self, stem: &str) -> PathBuf {
        self.dir.path().join(format!("{stem}.crt"))
    }
    pub fn key(&self, stem: &str) -> PathBuf {
        self.dir.path().join(format!("{stem}.key"))
    }
    /// `spiffe://<td>/ns/<ns>/sa/<sa>` for a workload written `"ns/sa"`.
    pub fn spiffe_id(&self, workload: &str) -> String {
        let (ns, sa) = workload.split_once('/').expect("workload is ns/sa");
        format!("spiffe://{}/ns/{ns}/sa/{sa}", self.trust_domain)
    }
    /// The `identity:` block of a proxy config for the leaf `stem`.
    pub fn identity_yaml(&self, stem: &str) -> String {
        format!(
            "identity:\n  cert: {}\n  key: {}\n  ca: {}\n",
            self.cert(stem).display(),
            self.key(stem).display(),
            self.ca().display()
        )
    }
    /// DER of the leaf `stem` (the first certificate of its PEM file).
    pub fn leaf_der(&self, stem: &str) -> Vec<u8> {
        let pem = fs::read(self.cert(stem)).expect("read cert");
        boring::x509::X509::from_pem(&pem)
            .expect("PEM certificate")
            .to_der()
            .expect("DER")
    }
}

fn run_certs(out: &Path, trust_domain: &str, workloads: &[&str]) {
    let mut cmd = Command::new(BIN);
    cmd.arg("certs")
        .arg("--out")
        .arg(out)
        .arg(format!("--trust-domain={trust_domain}"));
    for w in workloads {
        cmd.arg(format!("--workload={w}"));
    }
    let o = cmd.output().expect("spawn aether-proxy certs");
    assert!(
        o.status.success(),
        "aether-proxy certs failed: {:?}\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Lower-case hex SHA-256.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(boring::sha::sha256(data))
}

/// The SPIFFE URI SANs of a DER certificate, in order.
pub fn spiffe_ids_of(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) if u.starts_with("spiffe://") => {
                Some(u.to_string())
            }
            _ => None,
        })
        .collect()
}
