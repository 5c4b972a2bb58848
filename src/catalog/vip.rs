//! Virtual addresses for services (SPEC section 10): what the DNS listener answers for a mesh
//! name and what a captured connection's original destination is matched against.
//!
//! An address is a function of the service name: a stable hash picks one of the 65,534 usable
//! slots of 240.240.0.0/16 (the same slot in 2001:2::/48 for IPv6), so every pod and every
//! restart agree without talking to each other. Two names on one slot are settled by name
//! order: the name that sorts first keeps the slot, the other probes the next hash. A service
//! therefore moves only when a new name that sorts before it lands on its exact slot.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

/// Slots 0 (240.240.0.0) and 65535 (240.240.255.255) look like network and broadcast
/// addresses to some tools; neither is handed out.
const SLOTS: u32 = 65_534;

/// The slot a name takes on its `attempt`th probe. FNV-1a over the name and the attempt
/// number: fixed by this code, not by a library's or the standard library's hasher, which may
/// change between versions and would move every address.
pub fn slot(name: &str, attempt: u32) -> u16 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes().chain(attempt.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Fold the high bits in: FNV's low bits mix least.
    let folded = (h ^ (h >> 32)) as u32;
    (folded % SLOTS + 1) as u16
}

pub fn v4_of(slot: u16) -> Ipv4Addr {
    let [hi, lo] = slot.to_be_bytes();
    Ipv4Addr::new(240, 240, hi, lo)
}

pub fn v6_of(slot: u16) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, slot)
}

/// The slot of a virtual address, if it is one (in either range).
fn slot_of_v4(ip: Ipv4Addr) -> Option<u16> {
    let [a, b, hi, lo] = ip.octets();
    (a == 240 && b == 240).then_some(u16::from_be_bytes([hi, lo]))
}

fn slot_of_v6(ip: Ipv6Addr) -> Option<u16> {
    let s = ip.segments();
    (s[..7] == [0x2001, 2, 0, 0, 0, 0, 0]).then_some(s[7])
}

/// The addresses of one catalog's services, both ways.
#[derive(Debug, Default)]
pub struct VirtualIps {
    slot_of: HashMap<Arc<str>, u16>,
    name_of: HashMap<u16, Arc<str>>,
}

impl VirtualIps {
    /// Addresses for `names`, collisions settled by name order (see the module comment).
    pub fn build<'a>(names: impl IntoIterator<Item = &'a str>) -> VirtualIps {
        let mut names: Vec<&str> = names.into_iter().collect();
        names.sort_unstable();
        names.dedup();
        let mut table = VirtualIps {
            slot_of: HashMap::with_capacity(names.len()),
            name_of: HashMap::with_capacity(names.len()),
        };
        for name in names {
            let name: Arc<str> = Arc::from(name);
            // Terminates: there are fewer names than slots in any catalog we accept, and
            // successive attempts hash independently.
            let mut attempt = 0;
            let s = loop {
                let s = slot(&name, attempt);
                if !table.name_of.contains_key(&s) {
                    break s;
                }
                attempt += 1;
            };
            table.name_of.insert(s, name.clone());
            table.slot_of.insert(name, s);
        }
        table
    }

    /// True when `self` was built from exactly these names, none repeated (so it can be kept
    /// as is).
    pub fn same_names<'a>(&self, names: impl ExactSizeIterator<Item = &'a str>) -> bool {
        self.slot_of.len() == names.len() && { names }.all(|n| self.slot_of.contains_key(n))
    }

    pub fn v4(&self, service: &str) -> Option<Ipv4Addr> {
        self.slot_of.get(service).map(|s| v4_of(*s))
    }

    pub fn v6(&self, service: &str) -> Option<Ipv6Addr> {
        self.slot_of.get(service).map(|s| v6_of(*s))
    }

    /// The service whose virtual address `ip` is (IPv4 or IPv6, IPv4-mapped IPv6 included).
    pub fn service_at(&self, ip: std::net::IpAddr) -> Option<&Arc<str>> {
        let slot = match ip {
            std::net::IpAddr::V4(v4) => slot_of_v4(v4),
            std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => slot_of_v4(v4),
                None => slot_of_v6(v6),
            },
        }?;
        self.name_of.get(&slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_a_function_of_the_name() {
        let a = VirtualIps::build(["payments", "orders"]);
        let b = VirtualIps::build(["orders", "payments", "ledger"]);
        assert_eq!(a.v4("payments"), b.v4("payments"));
        assert_eq!(a.v4("orders"), b.v4("orders"));
        // Pinned: a change to the hash would move every address in every pod at once.
        assert_eq!(a.v4("payments"), Some(v4_of(slot("payments", 0))));
        assert_eq!(slot("payments", 0), slot("payments", 0));
        assert_ne!(slot("payments", 0), slot("payments", 1));
    }

    #[test]
    fn every_address_is_in_the_ranges_and_maps_back() {
        let names: Vec<String> = (0..5000).map(|i| format!("svc-{i}")).collect();
        let t = VirtualIps::build(names.iter().map(String::as_str));
        assert_eq!(t.slot_of.len(), 5000);
        let mut seen = std::collections::HashSet::new();
        for n in &names {
            let v4 = t.v4(n).unwrap();
            let [a, b, hi, lo] = v4.octets();
            assert_eq!((a, b), (240, 240));
            assert!((hi, lo) != (0, 0) && (hi, lo) != (255, 255), "{v4}");
            assert!(seen.insert(v4), "{n} shares {v4}");
            assert_eq!(t.service_at(v4.into()).map(|s| &**s), Some(n.as_str()));
            let v6 = t.v6(n).unwrap();
            assert_eq!(v6.segments()[..3], [0x2001, 2, 0]);
            assert_eq!(t.service_at(v6.into()).map(|s| &**s), Some(n.as_str()));
            let mapped = v4.to_ipv6_mapped();
            assert_eq!(t.service_at(mapped.into()).map(|s| &**s), Some(n.as_str()));
        }
        assert!(t.service_at(Ipv4Addr::new(10, 0, 0, 1).into()).is_none());
        assert!(t.service_at(Ipv4Addr::new(240, 241, 0, 1).into()).is_none());
    }

    #[test]
    fn collisions_go_to_the_name_that_sorts_first() {
        // Find two names on one first slot.
        let mut by_slot = HashMap::new();
        let (a, b) = (0..)
            .find_map(|i| {
                let n = format!("n{i}");
                let s = slot(&n, 0);
                by_slot.insert(s, n.clone()).map(|prev| (prev, n))
            })
            .unwrap();
        let (first, second) = if a < b { (a, b) } else { (b, a) };
        let one = VirtualIps::build([second.as_str(), first.as_str()]);
        let other = VirtualIps::build([first.as_str(), second.as_str()]);
        assert_eq!(one.v4(&first), Some(v4_of(slot(&first, 0))));
        assert_eq!(one.v4(&second), other.v4(&second));
        assert_ne!(one.v4(&second), one.v4(&first));
        // Alone, the later name has the slot; a name that sorts before it takes it over.
        assert_eq!(
            VirtualIps::build([second.as_str()]).v4(&second),
            Some(v4_of(slot(&second, 0)))
        );
    }

    #[test]
    fn others_coming_and_going_do_not_move_a_name() {
        let base: Vec<String> = (0..200).map(|i| format!("svc-{i}")).collect();
        let t1 = VirtualIps::build(base.iter().map(String::as_str));
        let fewer = VirtualIps::build(base.iter().skip(50).map(String::as_str));
        for n in base.iter().skip(50) {
            // No collisions among these 200 (checked by the slot being the first probe).
            if t1.v4(n) == Some(v4_of(slot(n, 0))) {
                assert_eq!(t1.v4(n), fewer.v4(n), "{n} moved");
            }
        }
    }
}
