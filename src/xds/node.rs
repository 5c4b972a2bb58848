//! The Envoy `Node` a stream to the control plane identifies with, built in one place for the
//! ADS and SDS streams alike, so both name the sidecar the same way.

use envoy_types::pb::envoy::config::core::v3::{node::UserAgentVersionType, Locality, Node};

use crate::config::{Config, XdsConfig};
use crate::identity::SpiffeId;

/// The node for a stream. `xds.node_id` and `xds.cluster` win when set. `identity` is the
/// workload's, once it is known (ADS): the id then carries the inbound address and the
/// namespace, the cluster defaults to the service account, and the node says its locality and
/// version. SDS streams start before the identity is known, so the id falls back to the
/// loopback address and the namespace `default`, and the cluster to empty.
pub fn build(cfg: &Config, xds: Option<&XdsConfig>, identity: Option<&SpiffeId>) -> Node {
    let id = xds.and_then(|x| x.node_id.clone());
    let cluster = xds.and_then(|x| x.cluster.clone());
    let Some(own) = identity else {
        return Node {
            id: id.unwrap_or_else(|| format!("sidecar~127.0.0.1~{}.default", hostname())),
            cluster: cluster.unwrap_or_default(),
            user_agent_name: "aether-proxy".into(),
            ..Default::default()
        };
    };
    let namespace = own
        .as_str()
        .split('/')
        .skip_while(|s| *s != "ns")
        .nth(1)
        .unwrap_or("default")
        .to_string();
    let ip = match cfg.inbound.listen.ip() {
        ip if ip.is_unspecified() => "127.0.0.1".to_string(),
        ip => ip.to_string(),
    };
    Node {
        id: id.unwrap_or_else(|| format!("sidecar~{ip}~{}.{namespace}", hostname())),
        cluster: cluster.unwrap_or_else(|| own.last_segment().to_string()),
        locality: cfg.locality.as_ref().map(|l| Locality {
            region: l.region.clone(),
            zone: l.zone.clone(),
            sub_zone: l.subzone.clone(),
        }),
        user_agent_name: "aether-proxy".into(),
        user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(
            env!("CARGO_PKG_VERSION").into(),
        )),
        ..Default::default()
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let yaml = format!(
            "identity: {{ sds: unix:///s }}\ndiscovery: {{ xds: {{ address: 127.0.0.1:1{extra} }} }}\n\
             locality: us-east1/us-east1-b\ninbound: {{ listen: 10.1.2.3:15008 }}\n"
        );
        Config::parse(std::path::Path::new("cfg.yaml"), &yaml).unwrap()
    }

    #[test]
    fn the_sds_node_says_what_is_known_before_the_identity() {
        let cfg = config("");
        let xds = cfg.discovery.as_ref().map(|d| &d.xds);
        let node = build(&cfg, xds, None);
        assert_eq!(node.id, format!("sidecar~127.0.0.1~{}.default", hostname()));
        assert_eq!(node.cluster, "");
        assert_eq!(node.user_agent_name, "aether-proxy");
        assert!(node.locality.is_none());
        assert!(node.user_agent_version_type.is_none());
    }

    #[test]
    fn the_ads_node_names_the_workload() {
        let cfg = config("");
        let xds = cfg.discovery.as_ref().map(|d| &d.xds);
        let own = SpiffeId::parse("spiffe://td.example/ns/shop/sa/frontend").unwrap();
        let node = build(&cfg, xds, Some(&own));
        assert_eq!(node.id, format!("sidecar~10.1.2.3~{}.shop", hostname()));
        assert_eq!(node.cluster, "frontend");
        assert_eq!(node.locality.unwrap().zone, "us-east1-b");
        assert!(node.user_agent_version_type.is_some());
    }

    #[test]
    fn the_configured_id_and_cluster_win_on_both_streams() {
        let cfg = config(", node_id: n1, cluster: c1");
        let xds = cfg.discovery.as_ref().map(|d| &d.xds);
        let own = SpiffeId::parse("spiffe://td.example/ns/shop/sa/frontend").unwrap();
        for node in [build(&cfg, xds, None), build(&cfg, xds, Some(&own))] {
            assert_eq!((node.id.as_str(), node.cluster.as_str()), ("n1", "c1"));
        }
    }
}
