//! Where a request would go, worked out without sending it (`GET /explain` on the admin
//! listener, `aether-proxy explain`). It calls the functions the outbound path calls (authority
//! parsing, the addressing table, route choice, endpoint levels), so it cannot tell a different
//! story from the one a request lives.

use std::borrow::Cow;

use http::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{json, Value};

use super::cluster::Cluster;
use super::{lb, route, Outbound};
use crate::catalog::{Catalog, PortProtocol, RouteTarget, Service};
use crate::http::answer::Reason;

/// A request to explain: its authority, the headers routes may match, and whether it is a
/// CONNECT (a tunnel) rather than an HTTP request.
pub struct Question {
    pub authority: String,
    pub headers: HeaderMap,
    pub connect: bool,
}

impl Question {
    /// From `/explain`'s query: `authority=<a>`, any number of `header=<name>:<value>`, and
    /// `connect=1`; values percent-encoded.
    pub fn from_query(query: &str) -> Result<Question, String> {
        let mut q = Question {
            authority: String::new(),
            headers: HeaderMap::new(),
            connect: false,
        };
        let mut authority = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, raw) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_encoding::percent_decode_str(&raw.replace('+', " "))
                .decode_utf8()
                .map_err(|_| format!("{key}: not UTF-8 once decoded"))?
                .into_owned();
            match key {
                "authority" => authority = Some(value),
                "header" => {
                    let (name, v) = value
                        .split_once(':')
                        .ok_or_else(|| format!("header {value:?}: expected name:value"))?;
                    let name = HeaderName::from_bytes(name.trim().as_bytes())
                        .map_err(|_| format!("header name {name:?} is not a field name"))?;
                    let v = HeaderValue::from_str(v.trim())
                        .map_err(|_| format!("header {name}: value is not a field value"))?;
                    q.headers.append(name, v);
                }
                "connect" => q.connect = matches!(value.as_str(), "" | "1" | "true"),
                _ => return Err(format!("unknown parameter {key:?}")),
            }
        }
        q.authority = authority.ok_or("missing authority=<host[:port]>")?;
        Ok(q)
    }
}

/// The explanation as JSON: the rule that applied, the answer if the request would be refused,
/// else the service, port, cluster, route, endpoints, SNI and pinned identity.
pub fn explain(outbound: &Outbound, q: &Question) -> Value {
    let mut out = json!({ "authority": q.authority, "connect": q.connect });
    let refuse = |mut out: Value, rule: &str, r: Reason| {
        out["rule"] = json!(rule);
        out["answer"] = json!({ "status": r.status().as_u16(), "reason": r.as_str() });
        out
    };
    let auth = match route::parse_authority(&q.authority, &outbound.mesh_domain) {
        Ok(a) => a,
        Err(r @ Reason::NoRoute) => {
            let rule = format!(
                "not <service>.{}[:<port>]: not a mesh service",
                outbound.mesh_domain
            );
            return refuse(out, &rule, r);
        }
        Err(r) => return refuse(out, "a malformed authority or port", r),
    };
    out["service"] = json!(auth.service);
    let catalog = outbound.catalog.load();
    let target = match route::lookup(&catalog, &auth, &outbound.mesh_domain) {
        route::Lookup::Found(t) => t,
        route::Lookup::Refused(r) => {
            out["discovery"] = json!(discovery_state(&catalog, &auth, r));
            let rule = match r {
                Reason::UnknownService => "no such service in the catalog",
                _ => "the service does not expose this port",
            };
            return refuse(out, rule, r);
        }
        route::Lookup::Unknown { cluster, absent } => {
            out["cluster"] = json!(cluster);
            out["discovery"] = json!("to be discovered");
            out["rule"] =
                json!(format!(
                "not known yet: the control plane is asked for {cluster} and the request waits \
                 up to {:?}",
                catalog.on_demand.as_ref().map(|o| o.timeout).unwrap_or_default()
            ));
            out["if_absent"] =
                json!({ "status": absent.status().as_u16(), "reason": absent.as_str() });
            out["if_no_answer"] = json!({
                "status": Reason::DiscoveryTimeout.status().as_u16(),
                "reason": Reason::DiscoveryTimeout.as_str(),
            });
            return out;
        }
    };
    let service = target.service;
    let port = target.port;
    out["discovery"] = json!("known");
    out["port"] = json!(port);
    out["rule"] = json!(match auth.port {
        Some(_) => "<service>.<mesh domain>:<port>, a port the service exposes",
        None => "<service>.<mesh domain> without a port: the service's default port",
    });
    out["protocol"] = json!(match target.protocol {
        PortProtocol::Http => "http",
        PortProtocol::Tcp => "tcp",
    });
    match (q.connect, target.protocol) {
        (true, PortProtocol::Http) => {
            return refuse(out, "CONNECT to an HTTP port", Reason::NotATcpPort)
        }
        (false, PortProtocol::Tcp) => {
            return refuse(out, "an HTTP request to a tcp port", Reason::NotAnHttpPort)
        }
        _ => {}
    }
    let Some(cluster) = outbound.clusters.get(&catalog, &service.name, port) else {
        return refuse(
            out,
            "no such service in the catalog",
            Reason::UnknownService,
        );
    };
    out["cluster"] = json!(cluster.name);
    out["sni"] = json!(port.to_string());
    out["identity"] = json!(service.identity.to_string());
    let (route_json, subsets) = route_of(service, &q.headers);
    out["route"] = route_json;
    out["endpoints"] = endpoints(outbound, &cluster, &subsets);
    // As `lb::pick` counts them: eligible for one of the route's subsets, then healthy.
    let now = cluster.now_ms();
    let eligible: Vec<_> = cluster
        .endpoints
        .iter()
        .filter(|e| eligible_in_route(e, &subsets))
        .collect();
    if eligible.is_empty() {
        return refuse(
            out,
            "no endpoint of the route is serving",
            Reason::NoEndpoints,
        );
    }
    if eligible.iter().all(|e| e.is_ejected(now)) {
        let rule = "every endpoint of the route is ejected";
        return refuse(out, rule, Reason::NoHealthyUpstream);
    }
    out["answer"] = Value::Null;
    out
}

/// Why the catalog refuses a name or port: remembered as absent from the control plane, or
/// simply not in a complete catalog.
fn discovery_state(catalog: &Catalog, auth: &route::MeshAuthority<'_>, r: Reason) -> &'static str {
    let Some(od) = &catalog.on_demand else {
        return "not in the catalog file";
    };
    match r {
        Reason::UnknownService if od.absent.contains(auth.service.as_ref()) => {
            "remembered as absent"
        }
        Reason::PortNotExposed => match catalog.services.get(auth.service.as_ref()) {
            Some(s)
                if s.absent_ports
                    .contains(&auth.port.unwrap_or(s.default_port)) =>
            {
                "remembered as absent"
            }
            _ => "not among the ports the control plane listed",
        },
        _ => "not known",
    }
}

/// The route that applies and why, and the subsets it may send to (empty: every endpoint).
fn route_of<'s>(
    service: &'s Service,
    headers: &HeaderMap,
) -> (Value, Vec<&'s crate::catalog::Labels>) {
    let Some((index, r)) = route::route_for(service, headers) else {
        let why = if service.routes.is_empty() {
            "the service has no routes"
        } else {
            "no route matched"
        };
        return (
            json!({ "index": null, "why": why, "to": "every endpoint of the port" }),
            Vec::new(),
        );
    };
    let why: Cow<'_, str> = match &r.matches {
        Some(m) => format!("{}: {} matched", m.header, m.value).into(),
        None => "it matches every request".into(),
    };
    match &r.target {
        RouteTarget::Subset(subset) => (
            json!({ "index": index, "why": why, "subset": subset }),
            vec![subset],
        ),
        RouteTarget::Split(split) => (
            json!({
                "index": index,
                "why": why,
                "split": split.iter().map(|w| json!({ "subset": w.subset, "weight": w.weight })).collect::<Vec<_>>(),
            }),
            split
                .iter()
                .filter(|w| w.weight > 0)
                .map(|w| &w.subset)
                .collect(),
        ),
    }
}

fn in_route(labels: &crate::catalog::Labels, subsets: &[&crate::catalog::Labels]) -> bool {
    subsets.is_empty() || subsets.iter().any(|s| route::labels_match(labels, s))
}

/// `lb::eligible` for a route that may choose any of `subsets` (none: the whole cluster).
fn eligible_in_route(
    e: &super::cluster::EndpointState,
    subsets: &[&crate::catalog::Labels],
) -> bool {
    match subsets {
        [] => lb::eligible(e, None),
        _ => subsets.iter().any(|s| lb::eligible(e, Some(s))),
    }
}

/// The cluster's endpoints in the order traffic prefers them: by level (the control plane's
/// priority, else locality against this pod's), each with what makes it a candidate or not.
fn endpoints(outbound: &Outbound, cluster: &Cluster, subsets: &[&crate::catalog::Labels]) -> Value {
    let now = cluster.now_ms();
    let own = outbound.locality.as_ref();
    let mut v: Vec<_> = cluster
        .endpoints
        .iter()
        .map(|e| (lb::level(cluster, own, e), e))
        .collect();
    v.sort_by_key(|(level, e)| (*level, e.address));
    json!(v
        .iter()
        .map(|(level, e)| json!({
            "address": e.address.to_string(),
            "level": level,
            "locality": e.locality.as_ref().map(|l| l.to_string()),
            "weight": e.weight,
            "labels": e.labels,
            "in_route": in_route(&e.labels, subsets),
            "draining": e.draining,
            "ejected": e.is_ejected(now),
            "active_requests": e.active(),
        }))
        .collect::<Vec<_>>())
}

/// The explanation as a person reads it.
pub fn to_text(v: &Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let str_of = |k: &str| v[k].as_str().map(str::to_string).unwrap_or_default();
    let _ = writeln!(s, "authority  {}", str_of("authority"));
    let _ = writeln!(s, "rule       {}", str_of("rule"));
    if let Some(a) = v.get("answer").filter(|a| !a.is_null()) {
        let _ = writeln!(
            s,
            "answer     {} x-aether-error: {}",
            a["status"],
            a["reason"].as_str().unwrap_or_default()
        );
    } else if v.get("if_absent").is_some() {
        let _ = writeln!(
            s,
            "answer     forwarded once discovered; {} {} if absent, {} {} if no answer",
            v["if_absent"]["status"],
            v["if_absent"]["reason"].as_str().unwrap_or_default(),
            v["if_no_answer"]["status"],
            v["if_no_answer"]["reason"].as_str().unwrap_or_default()
        );
    } else {
        let _ = writeln!(s, "answer     forwarded");
    }
    for (label, key) in [
        ("discovery", "discovery"),
        ("service", "service"),
        ("cluster", "cluster"),
        ("protocol", "protocol"),
        ("sni", "sni"),
        ("identity", "identity"),
    ] {
        if let Some(x) = v[key].as_str() {
            let _ = writeln!(s, "{label:<10} {x}");
        }
    }
    if let Some(p) = v["port"].as_u64() {
        let _ = writeln!(s, "port       {p}");
    }
    if let Some(r) = v.get("route").filter(|r| !r.is_null()) {
        let to = if let Some(sub) = r.get("subset") {
            format!("subset {sub}")
        } else if let Some(split) = r.get("split") {
            format!("split {split}")
        } else {
            r["to"].as_str().unwrap_or_default().to_string()
        };
        let index = r["index"]
            .as_u64()
            .map_or("none".to_string(), |i| format!("#{i}"));
        let _ = writeln!(
            s,
            "route      {index} ({}) -> {to}",
            r["why"].as_str().unwrap_or_default()
        );
    }
    if let Some(eps) = v["endpoints"].as_array() {
        let _ = writeln!(s, "endpoints  (in the order traffic prefers them)");
        for e in eps {
            let mut state = Vec::new();
            if e["in_route"] == json!(false) {
                state.push("outside the route");
            }
            if e["draining"] == json!(true) {
                state.push("draining");
            }
            if e["ejected"] == json!(true) {
                state.push("ejected");
            }
            if state.is_empty() {
                state.push("healthy");
            }
            let _ = writeln!(
                s,
                "  {:<22} level {} locality {} weight {} labels {} {} active {}",
                e["address"].as_str().unwrap_or_default(),
                e["level"],
                e["locality"].as_str().unwrap_or("-"),
                e["weight"],
                e["labels"],
                state.join(", "),
                e["active_requests"]
            );
        }
    }
    s
}

/// `aether-proxy explain`: asks the admin listener at `admin` and prints the answer (text, or
/// the JSON with `json`). Exit 0 once explained, whatever the answer; 1 when the admin cannot
/// be asked or refuses the question.
pub fn cli(
    admin: std::net::SocketAddr,
    authority: &str,
    headers: &[String],
    connect: bool,
    json: bool,
) -> std::process::ExitCode {
    use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
    let mut query = format!(
        "authority={}",
        utf8_percent_encode(authority, NON_ALPHANUMERIC)
    );
    for h in headers {
        query.push_str("&header=");
        query.extend(utf8_percent_encode(h, NON_ALPHANUMERIC));
    }
    if connect {
        query.push_str("&connect=1");
    }
    match ask(admin, &query) {
        Ok(v) if json => {
            println!("{v}");
            std::process::ExitCode::SUCCESS
        }
        Ok(v) => {
            print!("{}", to_text(&v));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("explain: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// `GET /explain?<query>` over a plain blocking connection: the admin listener is local and
/// answers at once, and the command needs no runtime.
fn ask(admin: std::net::SocketAddr, query: &str) -> Result<Value, String> {
    use std::io::{Read, Write};
    let timeout = std::time::Duration::from_secs(5);
    let mut s = std::net::TcpStream::connect_timeout(&admin, timeout)
        .map_err(|e| format!("cannot reach the admin listener at {admin}: {e}"))?;
    let _ = s.set_read_timeout(Some(timeout));
    write!(
        s,
        "GET /explain?{query} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("{admin}: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("{admin}: {e}"))?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{admin}: not an HTTP answer"))?;
    let status = head.split(' ').nth(1).unwrap_or_default();
    if status != "200" {
        return Err(format!("{admin} answered {status}: {}", body.trim()));
    }
    serde_json::from_str(body).map_err(|e| format!("{admin}: not JSON: {e}"))
}
