//! The test control plane (`crate::common::xds`) on its own, with a plain tonic client of Envoy's v3
//! APIs: proof that it speaks delta ADS and SDS as SPEC section 9 and Envoy expect, before
//! any proxy talks to it.

use std::future::Future;
use std::net::IpAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::common::mesh::{certs, FRONTEND, PAYMENTS};
use crate::common::xds::*;
use crate::common::*;
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, socket_address, HealthStatus, Locality, Node,
};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context, secret, Secret,
};
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::rpc;
use hyper_util::rt::TokioIo;
use prost::Message;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint as TonicEndpoint, Uri};
use tonic::Streaming;

const SVC: &str = "payments.aether.internal";

fn fixture(c: &Certs, p1: IpAddr, p2: IpAddr) -> Fixture {
    Fixture::new()
        .service(
            "payments",
            Service::new(&c.spiffe_id(PAYMENTS))
                .tcp(5432)
                .request_timeout(Duration::from_secs(15))
                .max_requests_per_connection(7)
                .routes(serde_json::json!([
                    {"match": {"header": "x-canary", "value": "1"}, "subset": {"version": "v2"}}
                ]))
                .endpoint(
                    Endpoint::new(p1, &[8080, 9090, 5432])
                        .locality("us-east1/us-east1-b/rack1")
                        .label("version", "v2")
                        .weight(3),
                )
                .endpoint(Endpoint::new(p2, &[8080]).draining()),
        )
        .identity(c, "frontend")
}

/// A streaming call's responses. The call is awaited in a task of its own: a gRPC server may
/// send its response headers only with its first response (grpcio does), so awaiting the call
/// before sending would wait for ever. Dropping it cancels the call.
struct Responses<T> {
    rx: UnboundedReceiver<Result<T, tonic::Status>>,
    task: tokio::task::JoinHandle<()>,
}

impl<T: Send + 'static> Responses<T> {
    fn start(
        call: impl Future<Output = Result<tonic::Response<Streaming<T>>, tonic::Status>>
            + Send
            + 'static,
    ) -> Responses<T> {
        let (tx, rx) = unbounded_channel();
        let task = tokio::spawn(async move {
            let mut stream = match call.await {
                Ok(r) => r.into_inner(),
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            loop {
                let m = stream.message().await;
                let end = !matches!(m, Ok(Some(_)));
                if let Some(m) = m.transpose() {
                    if tx.send(m).is_err() {
                        return;
                    }
                }
                if end {
                    return;
                }
            }
        });
        Responses { rx, task }
    }

    /// As `Streaming::message`: `Ok(None)` once the stream ended.
    async fn message(&mut self) -> Result<Option<T>, tonic::Status> {
        self.rx.recv().await.transpose()
    }
}

impl<T> Drop for Responses<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A delta ADS client: requests go in through `tx`, responses come out of `rx`.
struct DeltaClient {
    tx: UnboundedSender<DeltaDiscoveryRequest>,
    rx: Responses<DeltaDiscoveryResponse>,
}

impl DeltaClient {
    async fn open(channel: Channel) -> DeltaClient {
        let (tx, reqs) = unbounded_channel();
        let mut client = AggregatedDiscoveryServiceClient::new(channel);
        let rx = Responses::start(async move {
            client
                .delta_aggregated_resources(UnboundedReceiverStream::new(reqs))
                .await
        });
        DeltaClient { tx, rx }
    }

    fn send(&self, r: DeltaDiscoveryRequest) {
        self.tx.send(r).expect("stream open");
    }

    fn subscribe(&self, type_url: &str, names: &[&str], node: Option<Node>) {
        self.send(DeltaDiscoveryRequest {
            node,
            type_url: type_url.into(),
            resource_names_subscribe: names.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        });
    }

    fn ack(&self, r: &DeltaDiscoveryResponse) {
        self.send(DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        });
    }

    async fn next(&mut self) -> DeltaDiscoveryResponse {
        within(IO_TIMEOUT, "a delta response", self.rx.message())
            .await
            .unwrap()
            .expect("no stream error")
            .expect("the stream is still open")
    }

    /// Asserts nothing arrives within `d`.
    async fn quiet(&mut self, d: Duration, what: &str) {
        if let Ok(m) = tokio::time::timeout(d, self.rx.message()).await {
            panic!("{what}: expected no response, got {m:?}");
        }
    }
}

fn node() -> Node {
    Node {
        id: "sidecar~127.0.0.9~test.default".into(),
        cluster: "frontend".into(),
        user_agent_name: "a-test-client".into(),
        locality: Some(Locality {
            region: "us-east1".into(),
            zone: "us-east1-b".into(),
            sub_zone: String::new(),
        }),
        ..Default::default()
    }
}

fn resources_named(r: &DeltaDiscoveryResponse) -> Vec<String> {
    let mut v: Vec<String> = r.resources.iter().map(|r| r.name.clone()).collect();
    v.sort();
    v
}

fn decode<M: Message + Default>(r: &DeltaDiscoveryResponse, name: &str) -> M {
    let res = r
        .resources
        .iter()
        .find(|x| x.name == name)
        .unwrap_or_else(|| panic!("{name} is not in the response {r:?}"));
    let any = res.resource.as_ref().expect("resource body");
    M::decode(any.value.as_slice()).expect("decodes")
}

async fn tcp_channel(addr: std::net::SocketAddr) -> Channel {
    within(
        IO_TIMEOUT,
        "connect",
        TonicEndpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect(),
    )
    .await
    .unwrap()
    .expect("connects to the control plane")
}

/// A tonic connector dialling a unix socket.
#[derive(Clone)]
struct UnixConnector(PathBuf);

impl tower_service::Service<Uri> for UnixConnector {
    type Response = TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _: Uri) -> Self::Future {
        let p = self.0.clone();
        Box::pin(async move { Ok(TokioIo::new(tokio::net::UnixStream::connect(p).await?)) })
    }
}

async fn unix_channel(path: PathBuf) -> Channel {
    within(
        IO_TIMEOUT,
        "connect",
        TonicEndpoint::from_static("http://control-plane")
            .connect_with_connector(UnixConnector(path)),
    )
    .await
    .unwrap()
    .expect("connects to the control plane's unix socket")
}

/// Subscribes, gets resources shaped as SPEC 9 describes, absences in `removed_resources`,
/// pushes after `set`, nothing after an unsubscribe; ACKs, NACKs and the node are recorded.
async fn delta_ads_answers_pushes_and_records(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let c = certs();
    let (p1, p2, p3) = (
        net.pod(1).proxy_ip(),
        net.pod(2).proxy_ip(),
        net.pod(3).proxy_ip(),
    );
    let cp = ControlPlane::start(server, Listen::Tcp(cp_addr(&net)), fixture(&c, p1, p2)).await;
    // Exactly what changed, nothing more (the Istio-style assignment resend is tested below).
    cp.resend_assignments(false);
    let mut s = DeltaClient::open(tcp_channel(cp_addr(&net)).await).await;

    // The default Cluster, and an absence.
    s.subscribe(CLUSTER_TYPE, &[SVC, "ghost.aether.internal"], Some(node()));
    let r = s.next().await;
    assert_eq!(r.type_url, CLUSTER_TYPE);
    assert!(!r.nonce.is_empty());
    assert_eq!(resources_named(&r), vec![SVC.to_string()]);
    assert_eq!(
        r.removed_resources,
        vec!["ghost.aether.internal".to_string()]
    );
    assert!(!r.resources[0].version.is_empty());
    let def: Cluster = decode(&r, SVC);
    assert_eq!(
        def.cluster_discovery_type,
        Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32
        ))
    );
    let eds = def.eds_cluster_config.as_ref().unwrap();
    assert_eq!(eds.service_name, "outbound|8080||payments.aether.internal");
    assert!(eds.eds_config.is_some());
    assert_eq!(def.connect_timeout.as_ref().unwrap().seconds, 5);
    let ts = def.transport_socket.as_ref().unwrap();
    assert_eq!(ts.name, "envoy.transport_sockets.tls");
    let tls = tls_of(&def);
    assert_eq!(tls.sni, "8080");
    let ctx = tls.common_tls_context.as_ref().unwrap();
    assert_eq!(ctx.tls_certificate_sds_secret_configs[0].name, "default");
    let Some(common_tls_context::ValidationContextType::CombinedValidationContext(comb)) =
        &ctx.validation_context_type
    else {
        panic!("combined validation context: {ctx:?}")
    };
    assert_eq!(
        comb.validation_context_sds_secret_config
            .as_ref()
            .unwrap()
            .name,
        "ROOTCA"
    );
    let sans = &comb
        .default_validation_context
        .as_ref()
        .unwrap()
        .match_typed_subject_alt_names;
    assert_eq!(sans.len(), 1);
    assert_eq!(sans[0].san_type, 3, "URI");
    assert_eq!(
        sans[0].matcher.as_ref().unwrap().match_pattern,
        Some(string_matcher::MatchPattern::Exact(c.spiffe_id(PAYMENTS)))
    );
    let meta = &def.metadata.as_ref().unwrap().filter_metadata["aether.io"].fields;
    let Some(Kind::ListValue(ports)) = &meta["ports"].kind else {
        panic!("ports: {meta:?}")
    };
    let ports: Vec<f64> = ports
        .values
        .iter()
        .map(|v| match v.kind {
            Some(Kind::NumberValue(n)) => n,
            _ => panic!("{v:?}"),
        })
        .collect();
    assert_eq!(ports, vec![5432.0, 8080.0, 9090.0]);
    assert_eq!(
        meta["request_timeout"].kind,
        Some(Kind::StringValue("15s".into()))
    );
    assert!(matches!(meta["routes"].kind, Some(Kind::ListValue(_))));
    assert!(!meta.contains_key("protocol"), "8080 is not tcp");
    let opts = &def.typed_extension_protocol_options
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    let opts =
        envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions::decode(
            opts.value.as_slice(),
        )
        .unwrap();
    assert_eq!(
        opts.common_http_protocol_options
            .unwrap()
            .max_requests_per_connection
            .unwrap()
            .value,
        7
    );
    s.ack(&r);

    // Another port: its own Cluster, no `ports`; the tcp port says so; `svc:<default>` never
    // exists.
    s.subscribe(
        CLUSTER_TYPE,
        &[
            "payments.aether.internal:9090",
            "payments.aether.internal:5432",
            "payments.aether.internal:8080",
        ],
        None,
    );
    let r = s.next().await;
    assert_eq!(
        resources_named(&r),
        vec![
            "payments.aether.internal:5432".to_string(),
            "payments.aether.internal:9090".to_string()
        ]
    );
    assert_eq!(
        r.removed_resources,
        vec!["payments.aether.internal:8080".to_string()]
    );
    let c9090: Cluster = decode(&r, "payments.aether.internal:9090");
    assert_eq!(tls_of(&c9090).sni, "9090");
    assert_eq!(
        c9090.eds_cluster_config.unwrap().service_name,
        "outbound|9090||payments.aether.internal"
    );
    assert!(!c9090.metadata.unwrap().filter_metadata["aether.io"]
        .fields
        .contains_key("ports"));
    let c5432: Cluster = decode(&r, "payments.aether.internal:5432");
    assert_eq!(
        c5432.metadata.unwrap().filter_metadata["aether.io"].fields["protocol"].kind,
        Some(Kind::StringValue("tcp".into()))
    );
    s.ack(&r);

    // Endpoints per port: only pods advertising it; draining, locality, labels, weight.
    s.subscribe(
        CLA_TYPE,
        &[
            "outbound|9090||payments.aether.internal",
            "outbound|8080||payments.aether.internal",
        ],
        None,
    );
    let r = s.next().await;
    assert_eq!(r.type_url, CLA_TYPE);
    let cla: ClusterLoadAssignment = decode(&r, "outbound|9090||payments.aether.internal");
    assert_eq!(cla.endpoints.len(), 1);
    let loc = cla.endpoints[0].locality.clone().unwrap();
    assert_eq!(
        (
            loc.region.as_str(),
            loc.zone.as_str(),
            loc.sub_zone.as_str()
        ),
        ("us-east1", "us-east1-b", "rack1")
    );
    let ep = &cla.endpoints[0].lb_endpoints[0];
    assert_eq!(ep.health_status, HealthStatus::Healthy as i32);
    assert_eq!(ep.load_balancing_weight.unwrap().value, 3);
    assert_eq!(
        ep.metadata.as_ref().unwrap().filter_metadata["envoy.lb"].fields["version"].kind,
        Some(Kind::StringValue("v2".into()))
    );
    let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &ep.host_identifier else {
        panic!()
    };
    let Some(address::Address::SocketAddress(sa)) = &e.address.as_ref().unwrap().address else {
        panic!()
    };
    assert_eq!(sa.address, p1.to_string());
    assert_eq!(
        sa.port_specifier,
        Some(socket_address::PortSpecifier::PortValue(15008))
    );
    let cla8080: ClusterLoadAssignment = decode(&r, "outbound|8080||payments.aether.internal");
    let statuses: Vec<i32> = cla8080
        .endpoints
        .iter()
        .flat_map(|l| l.lb_endpoints.iter().map(|e| e.health_status))
        .collect();
    assert_eq!(statuses.len(), 2);
    assert!(statuses.contains(&(HealthStatus::Draining as i32)));
    s.ack(&r);

    // A change: a pod joins 9090. Only the changed assignment is pushed (the Clusters did not
    // change: same ports).
    cp.update(|f| {
        f.svc("payments").endpoints.push(Endpoint::new(p3, &[9090]));
    });
    let r = s.next().await;
    assert_eq!(r.type_url, CLA_TYPE);
    assert_eq!(
        resources_named(&r),
        vec!["outbound|9090||payments.aether.internal".to_string()]
    );
    let cla: ClusterLoadAssignment = decode(&r, "outbound|9090||payments.aether.internal");
    assert_eq!(
        cla.endpoints
            .iter()
            .map(|l| l.lb_endpoints.len())
            .sum::<usize>(),
        2,
        "two localities, one pod each"
    );
    // A NACK of it is recorded with its message.
    s.send(DeltaDiscoveryRequest {
        type_url: CLA_TYPE.into(),
        response_nonce: r.nonce.clone(),
        error_detail: Some(rpc::Status {
            code: 3,
            message: "outbound|9090||payments.aether.internal: bad".into(),
            details: vec![],
        }),
        ..Default::default()
    });
    // An unchanged set pushes nothing.
    cp.set(cp.fixture());
    s.quiet(Duration::from_millis(300), "unchanged fixture")
        .await;

    // Unsubscribe 9090; a change to it is not pushed, a change to the default Cluster is.
    s.send(DeltaDiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        resource_names_unsubscribe: vec!["payments.aether.internal:9090".into()],
        ..Default::default()
    });
    cp.wait_until(IO_TIMEOUT, "the unsubscribe", |cp| {
        cp.unsubscribes("payments.aether.internal:9090") == 1
    })
    .await;
    cp.update(|f| f.svc("payments").identity = c.spiffe_id(FRONTEND));
    let r = s.next().await;
    assert_eq!(r.type_url, CLUSTER_TYPE);
    assert_eq!(
        resources_named(&r),
        vec![SVC.to_string(), "payments.aether.internal:5432".to_string()],
        "the unsubscribed 9090 Cluster is not pushed"
    );
    s.ack(&r);
    // Removing the service: removed_resources for every subscribed Cluster.
    cp.update(|f| {
        f.services.remove("payments");
    });
    let mut removed = Vec::new();
    for _ in 0..2 {
        let r = s.next().await;
        removed.extend(r.removed_resources.clone());
        s.ack(&r);
    }
    removed.sort();
    assert_eq!(
        removed,
        vec![
            "outbound|8080||payments.aether.internal".to_string(),
            "outbound|9090||payments.aether.internal".to_string(),
            SVC.to_string(),
            "payments.aether.internal:5432".to_string(),
        ]
    );

    // Held names get no answer until released.
    cp.hold("slow.aether.internal");
    s.subscribe(CLUSTER_TYPE, &["slow.aether.internal"], None);
    s.quiet(Duration::from_millis(300), "held name").await;
    cp.release("slow.aether.internal");
    let r = s.next().await;
    assert_eq!(
        r.removed_resources,
        vec!["slow.aether.internal".to_string()]
    );
    s.ack(&r);

    // What was recorded.
    cp.wait_until(IO_TIMEOUT, "the last ACK", |cp| {
        cp.answer_to(&r.nonce).is_some()
    })
    .await;
    let streams = cp.ads_streams();
    assert_eq!(streams.len(), 1);
    let n = streams[0].first_node().expect("node on the first request");
    assert_eq!(n.id, "sidecar~127.0.0.9~test.default");
    assert_eq!(n.cluster, "frontend");
    assert_eq!(n.user_agent_name, "a-test-client");
    assert_eq!(
        (n.region.as_str(), n.zone.as_str()),
        ("us-east1", "us-east1-b")
    );
    assert_eq!(cp.subscribes(SVC), 1);
    assert_eq!(cp.subscribes("payments.aether.internal:9090"), 1);
    assert_eq!(cp.subscribes("payments.aether.internal:8080"), 1);
    assert!(cp.subscribed_names().contains("ghost.aether.internal"));
    let nacks = cp.nacks();
    assert_eq!(nacks.len(), 1);
    assert_eq!(
        nacks[0].error.as_deref(),
        Some("outbound|9090||payments.aether.internal: bad")
    );
    assert!(cp.acks().len() >= 6, "{}", cp.summary());
    assert_eq!(
        streams[0].unanswered_nonces(),
        Vec::<String>::new(),
        "every response was answered"
    );
    assert_eq!(cp.sent_removed("ghost.aether.internal").len(), 1);
}

/// A hand-made invalid Cluster is served instead of the fixture's; a resend keeps the version;
/// a new stream with `initial_resource_versions` gets only what changed; `drop_streams` ends
/// streams with UNAVAILABLE; `stop` cuts the connection and `serve` comes back on the same
/// address; `StreamAggregatedResources` is unimplemented.
async fn overrides_resends_reconnects_and_restarts(server: crate::common::xds::Server) {
    let net = Net::fresh();
    let c = certs();
    let (p1, p2) = (net.pod(1).proxy_ip(), net.pod(2).proxy_ip());
    let addr = cp_addr(&net);
    let cp = ControlPlane::start(server, Listen::Tcp(addr), fixture(&c, p1, p2)).await;
    let mut s = DeltaClient::open(tcp_channel(addr).await).await;
    let name = "payments.aether.internal:9090";
    s.subscribe(CLUSTER_TYPE, &[SVC, name], Some(node()));
    let r = s.next().await;
    s.ack(&r);
    let v_default = r
        .resources
        .iter()
        .find(|x| x.name == SVC)
        .unwrap()
        .version
        .clone();
    let v9090 = r
        .resources
        .iter()
        .find(|x| x.name == name)
        .unwrap()
        .version
        .clone();
    assert_eq!(cp.version(CLUSTER_TYPE, name), Some(v9090.clone()));
    let eds9090 = "outbound|9090||payments.aether.internal";
    s.subscribe(CLA_TYPE, &[eds9090], None);
    let r = s.next().await;
    s.ack(&r);
    let v_cla = r.resources[0].version.clone();

    // An invalid override, and back; each changed Cluster is followed by its assignment,
    // unchanged (Istio's habit for Envoy).
    let mut bad = cp.cluster(name);
    let mut tls = tls_of(&bad);
    tls.sni = "abc".into();
    set_tls(&mut bad, &tls);
    cp.serve_invalid(name, bad);
    let r = s.next().await;
    assert_eq!(resources_named(&r), vec![name.to_string()]);
    let got: Cluster = decode(&r, name);
    assert_eq!(tls_of(&got).sni, "abc");
    assert_ne!(r.resources[0].version, v9090);
    let r = s.next().await;
    assert_eq!(r.type_url, CLA_TYPE);
    assert_eq!(resources_named(&r), vec![eds9090.to_string()]);
    assert_eq!(r.resources[0].version, v_cla, "resent unchanged");
    cp.clear_invalid(name);
    let r = s.next().await;
    assert_eq!(r.resources[0].version, v9090, "the fixture's version again");
    let r = s.next().await;
    assert_eq!(r.type_url, CLA_TYPE);
    // Off: a changed Cluster comes alone.
    cp.resend_assignments(false);
    cp.update(|f| f.svc("payments").request_timeout = Some(Duration::from_secs(3)));
    let r = s.next().await;
    assert_eq!(r.type_url, CLUSTER_TYPE);
    assert_eq!(
        resources_named(&r),
        vec![SVC.to_string(), name.to_string()],
        "request_timeout is on every Cluster of the service"
    );
    s.ack(&r);
    s.quiet(Duration::from_millis(300), "no assignment resend")
        .await;
    cp.resend_assignments(true);

    // A resend: same version, new nonce.
    let nonces = cp.resend(SVC);
    assert_eq!(nonces.len(), 1);
    let r = s.next().await;
    assert_eq!(r.nonce, nonces[0]);
    assert_ne!(Some(&v_default), cp.version(CLUSTER_TYPE, SVC).as_ref());
    assert_eq!(
        Some(&r.resources[0].version),
        cp.version(CLUSTER_TYPE, SVC).as_ref()
    );
    s.ack(&r);
    cp.wait_until(IO_TIMEOUT, "ACK of the resend", |cp| {
        cp.answer_to(&nonces[0]) == Some(None)
    })
    .await;

    // drop_streams: the client sees UNAVAILABLE.
    cp.drop_streams();
    let m = within(IO_TIMEOUT, "stream end", s.rx.message())
        .await
        .unwrap();
    match m {
        Err(st) => assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}"),
        Ok(x) => panic!("expected UNAVAILABLE, got {x:?}"),
    }

    // A new stream that already has both: only what differs comes.
    cp.update(|f| f.svc("payments").identity = c.spiffe_id(FRONTEND));
    let mut s2 = DeltaClient::open(tcp_channel(addr).await).await;
    s2.send(DeltaDiscoveryRequest {
        node: Some(node()),
        type_url: CLUSTER_TYPE.into(),
        resource_names_subscribe: vec![SVC.into(), name.into()],
        initial_resource_versions: [
            (SVC.to_string(), "stale".to_string()),
            (name.to_string(), "x".to_string()),
        ]
        .into_iter()
        .collect(),
        ..Default::default()
    });
    let r = s2.next().await;
    assert_eq!(resources_named(&r), vec![SVC.to_string(), name.to_string()]);
    s2.ack(&r);
    let v_now = cp.version(CLUSTER_TYPE, SVC).unwrap();
    let mut s3 = DeltaClient::open(tcp_channel(addr).await).await;
    s3.send(DeltaDiscoveryRequest {
        node: Some(node()),
        type_url: CLUSTER_TYPE.into(),
        resource_names_subscribe: vec![SVC.into()],
        initial_resource_versions: [(SVC.to_string(), v_now)].into_iter().collect(),
        ..Default::default()
    });
    s3.quiet(Duration::from_millis(300), "a current initial version")
        .await;
    let recs = cp.ads_streams();
    assert_eq!(recs.len(), 3);
    assert_eq!(recs[2].requests[0].initial_versions.len(), 1);
    assert!(recs[0].closed.is_some(), "the dropped stream is closed");

    // Stop: the streams end (the connection is cut); serve again on the same address.
    cp.stop().await;
    let m = within(IO_TIMEOUT, "stream end on stop", s2.rx.message())
        .await
        .unwrap();
    assert!(!matches!(m, Ok(Some(_))), "{m:?}");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "nothing listens while stopped"
    );
    cp.update(|f| {
        f.svc("payments")
            .endpoints
            .push(Endpoint::new(net.pod(3).proxy_ip(), &[8080]))
    });
    cp.serve().await;
    let mut s4 = DeltaClient::open(tcp_channel(addr).await).await;
    s4.subscribe(
        CLA_TYPE,
        &["outbound|8080||payments.aether.internal"],
        Some(node()),
    );
    let r = s4.next().await;
    let cla: ClusterLoadAssignment = decode(&r, "outbound|8080||payments.aether.internal");
    assert_eq!(
        cla.endpoints
            .iter()
            .map(|l| l.lb_endpoints.len())
            .sum::<usize>(),
        3,
        "the change made while stopped is served"
    );
    assert_eq!(cp.open_streams(Api::DeltaAds), 1);

    // State of the world ADS: unimplemented.
    let mut client = AggregatedDiscoveryServiceClient::new(tcp_channel(addr).await);
    let (_tx, reqs) = unbounded_channel::<DiscoveryRequest>();
    let r = within(
        IO_TIMEOUT,
        "StreamAggregatedResources",
        client.stream_aggregated_resources(UnboundedReceiverStream::new(reqs)),
    )
    .await
    .unwrap();
    assert_eq!(r.err().map(|e| e.code()), Some(tonic::Code::Unimplemented));
}

fn sds_request(names: &[&str], nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(node()),
        type_url: SECRET_TYPE.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

async fn sds_next(rx: &mut Responses<DiscoveryResponse>) -> DiscoveryResponse {
    within(IO_TIMEOUT, "an SDS response", rx.message())
        .await
        .unwrap()
        .expect("no stream error")
        .expect("stream open")
}

fn secret_of(r: &DiscoveryResponse) -> Secret {
    assert_eq!(r.resources.len(), 1, "{r:?}");
    Secret::decode(r.resources[0].value.as_slice()).unwrap()
}

/// SDS on a unix socket: one stream per secret, answered once the secret exists, pushed when it
/// changes; the same secrets over delta ADS.
async fn sds_over_a_unix_socket(server: crate::common::xds::Server) {
    let c = certs();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("xds.sock");
    // No secrets yet: the stream waits.
    let cp = ControlPlane::start(server, Listen::Unix(sock.clone()), Fixture::new()).await;
    assert_eq!(cp.address(), format!("unix://{}", sock.display()));
    let channel = unix_channel(sock.clone()).await;
    let mut client = SecretDiscoveryServiceClient::new(channel.clone());
    let (tx, reqs) = unbounded_channel();
    tx.send(sds_request(&["default"], "")).unwrap();
    let mut rx = {
        let mut client = client.clone();
        Responses::start(async move {
            client
                .stream_secrets(UnboundedReceiverStream::new(reqs))
                .await
        })
    };
    if let Ok(m) = tokio::time::timeout(Duration::from_millis(300), rx.message()).await {
        panic!("no secret exists yet, got {m:?}");
    }

    cp.set(Fixture::new().identity(&c, "frontend"));
    let r = sds_next(&mut rx).await;
    assert_eq!(r.type_url, SECRET_TYPE);
    let s = secret_of(&r);
    assert_eq!(s.name, "default");
    let Some(secret::Type::TlsCertificate(tc)) = s.r#type else {
        panic!("tls_certificate: {s:?}")
    };
    let bytes = |d: Option<envoy_types::pb::envoy::config::core::v3::DataSource>| match d
        .and_then(|d| d.specifier)
    {
        Some(envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineBytes(b)) => b,
        other => panic!("inline bytes: {other:?}"),
    };
    assert_eq!(
        bytes(tc.certificate_chain),
        std::fs::read(c.cert("frontend")).unwrap()
    );
    assert_eq!(
        bytes(tc.private_key),
        std::fs::read(c.key("frontend")).unwrap()
    );
    tx.send(sds_request(&["default"], &r.nonce)).unwrap();

    // ROOTCA on its own stream.
    let (tx2, reqs2) = unbounded_channel();
    tx2.send(sds_request(&["ROOTCA"], "")).unwrap();
    let mut rx2 = Responses::start(async move {
        client
            .stream_secrets(UnboundedReceiverStream::new(reqs2))
            .await
    });
    let r2 = sds_next(&mut rx2).await;
    let s2 = secret_of(&r2);
    assert_eq!(s2.name, "ROOTCA");
    let Some(secret::Type::ValidationContext(vc)) = s2.r#type else {
        panic!("validation_context: {s2:?}")
    };
    assert_eq!(bytes(vc.trusted_ca), std::fs::read(c.ca()).unwrap());
    tx2.send(sds_request(&["ROOTCA"], &r2.nonce)).unwrap();

    // Rotation: a new leaf is pushed to the `default` stream only.
    c.issue(&[FRONTEND]);
    cp.set(Fixture::new().identity(&c, "frontend"));
    let r3 = sds_next(&mut rx).await;
    assert_ne!(r3.version_info, r.version_info);
    let Some(secret::Type::TlsCertificate(tc)) = secret_of(&r3).r#type else {
        panic!()
    };
    assert_eq!(
        bytes(tc.certificate_chain),
        std::fs::read(c.cert("frontend")).unwrap(),
        "the new leaf"
    );
    tx.send(sds_request(&["default"], &r3.nonce)).unwrap();
    if let Ok(m) = tokio::time::timeout(Duration::from_millis(300), rx2.message()).await {
        panic!("ROOTCA did not change, got {m:?}");
    }
    cp.wait_until(IO_TIMEOUT, "the SDS ACKs", |cp| {
        cp.answer_to(&r3.nonce) == Some(None) && cp.answer_to(&r2.nonce) == Some(None)
    })
    .await;
    let sds = cp.sds_streams();
    assert_eq!(sds.len(), 2);
    assert_eq!(
        sds[0].requests[0].resource_names,
        vec!["default".to_string()]
    );
    assert_eq!(
        sds[0].first_node().map(|n| n.cluster.as_str()),
        Some("frontend")
    );

    // The same secrets over delta ADS.
    let mut d = DeltaClient::open(channel).await;
    d.subscribe(SECRET_TYPE, &["default", "ROOTCA"], Some(node()));
    let r = d.next().await;
    assert_eq!(
        resources_named(&r),
        vec!["ROOTCA".to_string(), "default".to_string()]
    );

    // Stop removes the socket; serve brings it back.
    cp.stop().await;
    assert!(!sock.exists(), "the socket file is gone while stopped");
    cp.serve().await;
    let mut d = DeltaClient::open(unix_channel(sock).await).await;
    d.subscribe(SECRET_TYPE, &["ROOTCA"], Some(node()));
    assert_eq!(resources_named(&d.next().await), vec!["ROOTCA".to_string()]);
}

/// Not a check: serves a test control plane until interrupted, to try a sidecar (or Envoy)
/// against it by hand (docs/operating.md, "Control plane"). `CP_SERVER=grpcio|tonic` (grpcio by
/// default), `CP_LISTEN` (default 127.0.0.1:18000), `CP_ENDPOINT` (the address of the pod
/// proxy serving `payments` on 8080 and 9090, default 127.0.0.2). It serves `payments` and the
/// `frontend` identity over SDS, and prints where the test certificates are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "serves until interrupted; run by hand"]
async fn serve_by_hand() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let server = match env("CP_SERVER", "grpcio").as_str() {
        "tonic" => Server::Tonic,
        "grpcio" => Server::Grpcio,
        other => panic!("CP_SERVER={other}: tonic or grpcio"),
    };
    let listen: std::net::SocketAddr = env("CP_LISTEN", "127.0.0.1:18000").parse().unwrap();
    let endpoint: IpAddr = env("CP_ENDPOINT", "127.0.0.2").parse().unwrap();
    let c = certs();
    let fx = Fixture::new()
        .service(
            "payments",
            Service::new(&c.spiffe_id(PAYMENTS)).endpoint(Endpoint::new(endpoint, &[8080, 9090])),
        )
        .identity(&c, "frontend");
    let cp = ControlPlane::start(server, Listen::Tcp(listen), fx).await;
    println!(
        "{server:?} control plane on {}; certificates in {} (frontend.crt, frontend.key, ca.crt; trust domain {})",
        cp.address(),
        c.dir().display(),
        c.trust_domain()
    );
    tokio::signal::ctrl_c().await.unwrap();
    println!("{}", cp.summary());
}

crate::on_both_control_planes!(
    delta_ads_answers_pushes_and_records,
    overrides_resends_reconnects_and_restarts,
    sds_over_a_unix_socket,
);
