//! The DNS listener's answers to any packet a pod sends: never a panic, never an answer to an
//! answer, and every reply is a well-formed DNS message with the query's id that says it is a
//! response.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use aether_proxy::catalog::{Catalog, OnDemand};
use aether_proxy::dns::answer::{Answerer, Step};
use hickory_proto::op::{Message, MessageType};
use libfuzzer_sys::fuzz_target;

const CATALOG: &str = "services:
  payments:
    default_port: 8080
    identity: spiffe://aether.local/ns/default/sa/payments
    endpoints:
      - { address: 10.0.0.5, ports: [8080, 9090] }
  orders:
    default_port: 8080
    identity: spiffe://aether.local/ns/default/sa/orders
    endpoints:
      - { address: 10.0.0.6, ports: [8080] }
";

fn catalogs() -> &'static [Catalog; 2] {
    static C: OnceLock<[Catalog; 2]> = OnceLock::new();
    C.get_or_init(|| {
        let file = Catalog::parse(Path::new("c.yaml"), CATALOG, "aether.local").unwrap();
        let mut on_demand = file.clone();
        on_demand.on_demand = Some(OnDemand::default());
        [file, on_demand]
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, packet)) = data.split_first() else {
        return;
    };
    let answerer = Answerer::new("aether.internal", flags & 1 == 1);
    let catalog = &catalogs()[usize::from(flags >> 1 & 1)];
    match answerer.handle(packet, catalog) {
        Step::Reply(bytes, _) => {
            let reply = Message::from_vec(&bytes).expect("a reply parses");
            assert_eq!(reply.metadata.message_type, MessageType::Response);
            let id = u16::from_be_bytes([packet[0], packet[1]]);
            assert_eq!(reply.metadata.id, id, "the query's id");
            let query = Message::from_vec(packet);
            if let Ok(q) = query {
                assert_eq!(q.metadata.message_type, MessageType::Query, "never answer an answer");
            }
        }
        Step::Forward { query, .. } | Step::Discover { query, .. } => {
            assert_eq!(query.metadata.message_type, MessageType::Query, "never relay an answer");
        }
        Step::Drop => {}
    }
});
