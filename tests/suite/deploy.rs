//! The Kubernetes pod example (`deploy/kubernetes/`, SPEC section 12) agrees with the proxy:
//! its config passes `aether-proxy check`, and the ports, probes, uid, mounts and init rules in
//! the pod spec are the ones that config and the image use.

use std::path::{Path, PathBuf};

use aether_proxy::config::Config;
use serde_json::Value;

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// The example's documents, as JSON values.
fn documents() -> Vec<Value> {
    let text = std::fs::read_to_string(repo("deploy/kubernetes/payments-pod.yaml")).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("valid YAML"))
        .collect()
}

fn kind<'a>(docs: &'a [Value], k: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == k)
        .unwrap_or_else(|| panic!("no {k} in the example"))
}

fn container<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn args(c: &Value) -> Vec<String> {
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// The value after `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(String::as_str)
}

fn container_ports(c: &Value) -> Vec<u16> {
    c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap() as u16)
        .collect()
}

#[test]
fn the_pod_example_agrees_with_the_proxy() {
    let docs = documents();
    let map = kind(&docs, "ConfigMap");
    let pod = kind(&docs, "Pod");
    let spec = &pod["spec"];
    let sidecar = container(&spec["containers"], "aether-proxy");
    let app = container(&spec["containers"], "payments");
    let init = container(&spec["initContainers"], "aether-init");

    // The sidecar's --config is the ConfigMap's key, mounted where the pod says.
    let sidecar_args = args(sidecar);
    assert_eq!(sidecar_args[0], "run");
    let config_path = PathBuf::from(flag(&sidecar_args, "--config").expect("--config"));
    let key = config_path.file_name().unwrap().to_str().unwrap();
    let text = map["data"][key]
        .as_str()
        .unwrap_or_else(|| panic!("the ConfigMap has no {key}"));
    let mounts = sidecar["volumeMounts"].as_array().unwrap();
    let config_mount = mounts
        .iter()
        .find(|m| Path::new(m["mountPath"].as_str().unwrap()) == config_path.parent().unwrap())
        .expect("the config's directory is mounted");
    let volume = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == config_mount["name"])
        .expect("the mount's volume");
    assert_eq!(volume["configMap"]["name"], map["metadata"]["name"]);

    // `aether-proxy check` accepts the config as it is.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(key);
    std::fs::write(&file, text).unwrap();
    let out = std::process::Command::new(crate::common::BIN)
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "check refused the example's config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "check warned: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cfg = Config::load(&file).unwrap();

    // Probes: the health listener's port, exactly its two paths.
    let health = cfg
        .health
        .as_ref()
        .expect("the example has a health listener");
    let probe = |p: &str| &sidecar[p]["httpGet"];
    assert_eq!(probe("readinessProbe")["path"], "/healthz/ready");
    assert_eq!(probe("livenessProbe")["path"], "/healthz");
    for p in ["readinessProbe", "livenessProbe"] {
        assert_eq!(probe(p)["port"], health.listen.port(), "{p}");
    }
    assert!(
        health.listen.ip().is_unspecified(),
        "the kubelet probes the pod address"
    );
    let ports = container_ports(sidecar);
    assert!(ports.contains(&health.listen.port()));
    assert!(ports.contains(&cfg.inbound.listen.port()));
    // Admin stays on loopback (the check above would have warned otherwise).
    assert!(cfg.admin.listen.ip().is_loopback());
    // Readiness waits for the app's ports, which the app container declares.
    let app_ports = container_ports(app);
    for p in &cfg.readiness.required_listeners {
        assert!(
            app_ports.contains(p),
            "readiness waits for {p}, the app does not expose it"
        );
    }
    for p in &cfg.inbound.ports {
        assert!(
            app_ports.contains(&p.port),
            "inbound port {} is not the app's",
            p.port
        );
    }

    // The sidecar's uid is the one the init container's rules exempt, and the image's.
    let ctx = &sidecar["securityContext"];
    let uid = ctx["runAsUser"].as_u64().unwrap();
    assert_eq!(uid, 1337);
    assert_eq!(ctx["runAsGroup"].as_u64(), Some(uid));
    assert_eq!(ctx["runAsNonRoot"], true);
    let init_args = args(init);
    assert_eq!(&init_args[..2], ["redirect", "--apply"]);
    assert_eq!(
        flag(&init_args, "--proxy-uid"),
        Some(uid.to_string().as_str())
    );
    let outbound_port = flag(&init_args, "--outbound-port").map_or(15001, |p| p.parse().unwrap());
    assert_eq!(outbound_port, cfg.outbound.listen.port());
    // DNS is captured to the proxy's DNS listener, on loopback.
    let dns = cfg.dns.as_ref().expect("the example answers DNS");
    assert!(dns.listen.ip().is_loopback());
    assert_eq!(
        flag(&init_args, "--dns-port"),
        Some(dns.listen.port().to_string().as_str())
    );
    // The real binary takes the init container's arguments; without `--apply` it only prints
    // the rules it would apply.
    let printed = std::process::Command::new(crate::common::BIN)
        .args(init_args.iter().filter(|a| *a != "--apply"))
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&printed.stdout);
    assert!(printed.status.success(), "{printed:?}");
    assert!(rules.contains(&format!("! --uid-owner {uid} ")), "{rules}");
    assert!(
        rules.contains(&format!("--to-ports {outbound_port}\n")),
        "{rules}"
    );
    assert!(
        rules.contains(&format!("--to-ports {}\n", dns.listen.port())),
        "{rules}"
    );
    let caps = &init["securityContext"]["capabilities"]["add"];
    assert!(caps.as_array().unwrap().contains(&Value::from("NET_ADMIN")));
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    assert!(
        dockerfile
            .lines()
            .any(|l| l.trim() == format!("USER {uid}:{uid}")),
        "the image runs as {uid}"
    );
    assert!(
        dockerfile.contains(&format!("\"--config\", \"{}\"", config_path.display())),
        "the image's default config path is the pod's"
    );

    // The SDS socket lives on a mounted volume.
    let sds = cfg
        .identity
        .sds
        .as_ref()
        .expect("identity over SDS")
        .to_string();
    let socket = sds.strip_prefix("unix://").expect("a unix socket");
    assert!(
        mounts
            .iter()
            .any(|m| Path::new(socket).starts_with(m["mountPath"].as_str().unwrap())),
        "{socket} is not on a mounted volume"
    );

    // The example's config uses the proxy's defaults where it states them.
    let defaults = Config::parse(
        Path::new("defaults.yaml"),
        "identity: { sds: unix:///s }\ndiscovery: { xds: { address: 127.0.0.1:1 } }\n",
    )
    .unwrap();
    assert_eq!(cfg.outbound.listen, defaults.outbound.listen);
    assert_eq!(cfg.admin.listen, defaults.admin.listen);
    assert_eq!(cfg.inbound.listen, defaults.inbound.listen);
    assert_eq!(cfg.mesh_domain, defaults.mesh_domain);
    assert_eq!(cfg.trust_domain, defaults.trust_domain);
}
