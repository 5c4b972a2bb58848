//! What the DNS listener says to one query: mesh names are answered here from one catalog
//! snapshot; every other name is left to the forwarder. Pure functions of the bytes and the
//! catalog, so the benchmark and the listener run the same code.

use std::net::IpAddr;

use hickory_proto::op::{Edns, Header, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{DNSClass, RData, Record, RecordType};
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder};

use crate::catalog::Catalog;

/// TTL of every mesh answer (SPEC section 10).
pub const TTL: u32 = 30;

/// The UDP payload size advertised in our EDNS answers (the DNS flag day 2020 value).
const EDNS_PAYLOAD: u16 = 1232;

/// What became of a query, the `result` label of `aether_dns_queries_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A mesh name answered with its address.
    Mesh,
    /// A mesh name that exists, with no record of the asked type.
    NoData,
    /// A mesh-shaped name the catalog does not hold.
    NxDomain,
    /// Relayed from an upstream resolver.
    Forwarded,
    /// No upstream answered in time, too much in flight, or a discovery that timed out.
    ServFail,
    /// A query whose header parsed but whose body did not.
    FormErr,
    /// An opcode other than QUERY, or a class other than IN for a mesh name.
    Refused,
    /// Not answered at all (not even a header, or not a query).
    Dropped,
}

impl Outcome {
    pub const ALL: [Outcome; 8] = [
        Outcome::Mesh,
        Outcome::NoData,
        Outcome::NxDomain,
        Outcome::Forwarded,
        Outcome::ServFail,
        Outcome::FormErr,
        Outcome::Refused,
        Outcome::Dropped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Mesh => "mesh",
            Outcome::NoData => "nodata",
            Outcome::NxDomain => "nxdomain",
            Outcome::Forwarded => "forwarded",
            Outcome::ServFail => "servfail",
            Outcome::FormErr => "formerr",
            Outcome::Refused => "refused",
            Outcome::Dropped => "dropped",
        }
    }
}

/// The next step for one query.
#[derive(Debug)]
pub enum Step {
    /// Send these bytes back.
    Reply(Vec<u8>, Outcome),
    /// Not a mesh name: relay the query bytes unchanged. `max_udp` is the largest answer the
    /// client takes over UDP (512, or its EDNS size).
    Forward { query: Message, max_udp: u16 },
    /// A mesh name an on-demand catalog does not hold yet: ask for `service`, then answer.
    Discover { service: String, query: Message },
    /// Say nothing.
    Drop,
}

/// Answers for one mesh domain.
#[derive(Debug, Clone)]
pub struct Answerer {
    mesh_domain: String,
    /// Lower-case labels of the mesh domain, last label first.
    domain: Vec<Vec<u8>>,
    ipv6: bool,
}

/// Where a name sits relative to the mesh domain.
enum Place {
    Outside,
    /// The mesh domain itself.
    Apex,
    /// `<service>.<mesh_domain>`, the service lower-cased.
    Service(String),
    /// Deeper names, or a first label a service name cannot have.
    Other,
}

impl Answerer {
    pub fn new(mesh_domain: &str, ipv6: bool) -> Answerer {
        let domain = mesh_domain
            .trim_end_matches('.')
            .split('.')
            .rev()
            .map(|l| l.to_ascii_lowercase().into_bytes())
            .collect();
        Answerer {
            mesh_domain: mesh_domain.to_string(),
            domain,
            ipv6,
        }
    }

    pub fn mesh_domain(&self) -> &str {
        &self.mesh_domain
    }

    /// The step for the bytes of one query, against one catalog snapshot.
    pub fn handle(&self, packet: &[u8], catalog: &Catalog) -> Step {
        let Ok(header) = Header::read(&mut BinDecoder::new(packet)) else {
            return Step::Drop;
        };
        // Never answer an answer: two DNS speakers could otherwise bounce packets forever.
        if header.message_type != MessageType::Query {
            return Step::Drop;
        }
        let query = match Message::from_vec(packet) {
            Ok(m) => m,
            Err(_) => {
                let mut m = Message::error_msg(header.id, header.op_code, ResponseCode::FormErr);
                m.metadata.recursion_desired = header.recursion_desired;
                return reply(&m, Outcome::FormErr);
            }
        };
        if query.metadata.op_code != OpCode::Query {
            return reply(&answer_to(&query, ResponseCode::NotImp), Outcome::Refused);
        }
        if query.queries.len() != 1 {
            return reply(&answer_to(&query, ResponseCode::FormErr), Outcome::FormErr);
        }
        let q = &query.queries[0];
        let service = match self.place(q) {
            Place::Outside => {
                let max_udp = query.max_payload();
                return Step::Forward { query, max_udp };
            }
            _ if q.query_class() != DNSClass::IN => {
                return reply(&answer_to(&query, ResponseCode::Refused), Outcome::Refused);
            }
            // The domain exists (names live under it) but holds no records itself.
            Place::Apex => return reply(&mesh_answer(&query, &[]), Outcome::NoData),
            Place::Other => return nxdomain(&query),
            Place::Service(s) => s,
        };
        match self.answer_held(&query, &service, catalog) {
            Some(step) => step,
            None => Step::Discover { service, query },
        }
    }

    /// The answer for `service` from `catalog`, or `None` when the catalog discovers on demand
    /// and has not heard of the service either way yet.
    pub fn answer_held(&self, query: &Message, service: &str, catalog: &Catalog) -> Option<Step> {
        if !catalog.services.contains_key(service) {
            return match &catalog.on_demand {
                Some(od) if !od.absent.contains(service) => None,
                _ => Some(nxdomain(query)),
            };
        }
        let q = &query.queries[0];
        let v4 = || catalog.vips.v4(service).map(IpAddr::V4);
        let v6 = || {
            self.ipv6
                .then(|| catalog.vips.v6(service).map(IpAddr::V6))
                .flatten()
        };
        let addrs: Vec<IpAddr> = match q.query_type() {
            RecordType::A => v4().into_iter().collect(),
            RecordType::AAAA => v6().into_iter().collect(),
            RecordType::ANY => v4().into_iter().chain(v6()).collect(),
            _ => Vec::new(),
        };
        let outcome = if addrs.is_empty() {
            Outcome::NoData
        } else {
            Outcome::Mesh
        };
        Some(reply(&mesh_answer(query, &addrs), outcome))
    }

    fn place(&self, q: &Query) -> Place {
        let name = q.name();
        let labels: Vec<&[u8]> = name.iter().collect();
        let n = self.domain.len();
        if labels.len() < n {
            return Place::Outside;
        }
        let in_domain = labels
            .iter()
            .rev()
            .zip(&self.domain)
            .all(|(l, d)| l.eq_ignore_ascii_case(d));
        if !in_domain {
            return Place::Outside;
        }
        match &labels[..labels.len() - n] {
            [] => Place::Apex,
            [label]
                if label
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || *b == b'-') =>
            {
                // Checked ASCII above.
                Place::Service(String::from_utf8_lossy(label).to_ascii_lowercase())
            }
            _ => Place::Other,
        }
    }
}

fn reply(m: &Message, outcome: Outcome) -> Step {
    match m.to_vec() {
        Ok(bytes) => Step::Reply(bytes, outcome),
        Err(_) => Step::Drop,
    }
}

/// The answer skeleton: same id, question and RD bit; RA set, since other names are resolved
/// for the client; EDNS when the client used it (RFC 6891 asks for that).
fn answer_to(query: &Message, code: ResponseCode) -> Message {
    let mut m = Message::response(query.metadata.id, query.metadata.op_code);
    m.metadata.recursion_desired = query.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.metadata.checking_disabled = query.metadata.checking_disabled;
    m.metadata.response_code = code;
    m.queries = query.queries.clone();
    if query.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(EDNS_PAYLOAD);
        m.set_edns(edns);
    }
    m
}

/// An authoritative NOERROR answer with `addrs` (empty: NODATA).
fn mesh_answer(query: &Message, addrs: &[IpAddr]) -> Message {
    let mut m = answer_to(query, ResponseCode::NoError);
    m.metadata.authoritative = true;
    let name = query.queries[0].name().clone();
    for ip in addrs {
        let rdata = match ip {
            IpAddr::V4(v4) => RData::A(A(*v4)),
            IpAddr::V6(v6) => RData::AAAA(AAAA(*v6)),
        };
        m.add_answer(Record::from_rdata(name.clone(), TTL, rdata));
    }
    m
}

pub fn nxdomain(query: &Message) -> Step {
    let mut m = answer_to(query, ResponseCode::NXDomain);
    m.metadata.authoritative = true;
    reply(&m, Outcome::NxDomain)
}

/// SERVFAIL for `query` (parsed) — no upstream answered, or discovery timed out.
pub fn servfail(query: &Message) -> Vec<u8> {
    answer_to(query, ResponseCode::ServFail)
        .to_vec()
        .unwrap_or_default()
}

/// The header and question of `answer` with TC set: what a UDP client gets when the full
/// answer exceeds what it takes (it retries over TCP).
pub fn truncated(query: &Message, answer: &[u8]) -> Vec<u8> {
    match Message::from_vec(answer) {
        Ok(full) => {
            let mut m = full.truncate();
            // `truncate` keeps the answer's header; the question is the client's own.
            m.queries = query.queries.clone();
            m.to_vec().unwrap_or_else(|_| servfail(query))
        }
        Err(_) => servfail(query),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::rr::Name;

    fn catalog(names: &[&str]) -> Catalog {
        let mut y = String::from("services:\n");
        for n in names {
            y += &format!(
                "  {n}:\n    default_port: 80\n    identity: spiffe://aether.local/ns/default/sa/{n}\n    endpoints: [{{ address: 10.0.0.1, ports: [80] }}]\n"
            );
        }
        let mut c =
            Catalog::parse(std::path::Path::new("catalog.yaml"), &y, "aether.local").unwrap();
        c.vips = std::sync::Arc::new(crate::catalog::vip::VirtualIps::build(
            c.services.keys().map(String::as_str),
        ));
        c
    }

    fn ask(name: &str, t: RecordType) -> Vec<u8> {
        let mut m = Message::query();
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), t));
        m.to_vec().unwrap()
    }

    fn reply_of(step: Step) -> (Message, Outcome) {
        match step {
            Step::Reply(b, o) => (Message::from_vec(&b).unwrap(), o),
            other => panic!("not a reply: {other:?}"),
        }
    }

    #[test]
    fn mesh_names_and_the_rest() {
        let a = Answerer::new("aether.internal", false);
        let c = catalog(&["payments"]);
        let (m, o) = reply_of(a.handle(&ask("Payments.Aether.Internal.", RecordType::A), &c));
        assert_eq!(o, Outcome::Mesh);
        assert!(m.metadata.authoritative);
        assert_eq!(m.answers[0].ttl, TTL);
        assert_eq!(m.answers[0].name.to_ascii(), "Payments.Aether.Internal.");
        let (m, o) = reply_of(a.handle(&ask("payments.aether.internal", RecordType::AAAA), &c));
        assert_eq!((o, m.answers.len()), (Outcome::NoData, 0));
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        let (m, o) = reply_of(a.handle(&ask("ghost.aether.internal", RecordType::A), &c));
        assert_eq!(o, Outcome::NxDomain);
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
        let (_, o) = reply_of(a.handle(&ask("a.payments.aether.internal", RecordType::A), &c));
        assert_eq!(o, Outcome::NxDomain);
        let (_, o) = reply_of(a.handle(&ask("aether.internal", RecordType::A), &c));
        assert_eq!(o, Outcome::NoData);
        for outside in [
            "example.com",
            "internal",
            "xaether.internal",
            "payments.aether.internal.com",
        ] {
            assert!(
                matches!(
                    a.handle(&ask(outside, RecordType::A), &c),
                    Step::Forward { .. }
                ),
                "{outside}"
            );
        }
        let six = Answerer::new("aether.internal", true);
        let (m, o) = reply_of(six.handle(&ask("payments.aether.internal", RecordType::AAAA), &c));
        assert_eq!(o, Outcome::Mesh);
        assert_eq!(
            m.answers[0].data,
            RData::AAAA(AAAA(c.vips.v6("payments").unwrap()))
        );
    }

    #[test]
    fn bad_bytes_get_formerr_or_nothing() {
        let a = Answerer::new("aether.internal", false);
        let c = catalog(&["payments"]);
        assert!(matches!(a.handle(b"", &c), Step::Drop));
        assert!(matches!(a.handle(b"\x12\x34\x01", &c), Step::Drop));
        // A header that promises a question it does not carry.
        let (m, o) = reply_of(a.handle(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00", &c));
        assert_eq!((o, m.metadata.id), (Outcome::FormErr, 0x1234));
        // An answer is never answered.
        let mut q = ask("payments.aether.internal", RecordType::A);
        q[2] |= 0x80;
        assert!(matches!(a.handle(&q, &c), Step::Drop));
        // Two questions.
        let mut m = Message::query();
        for _ in 0..2 {
            m.add_query(Query::query(
                Name::from_ascii("payments.aether.internal").unwrap(),
                RecordType::A,
            ));
        }
        let (_, o) = reply_of(a.handle(&m.to_vec().unwrap(), &c));
        assert_eq!(o, Outcome::FormErr);
    }
}
