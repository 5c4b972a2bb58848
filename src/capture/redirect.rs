//! `aether-proxy redirect`: the pod's netfilter rules (SPEC section 10), as an init container
//! installs them before the app starts.
//!
//! Everything lives in two chains of the `nat` table that belong to us, `AETHER_OUTPUT` (the
//! decisions) and `AETHER_REDIRECT` (the redirect to the outbound port), plus one jump from
//! `OUTPUT`, in the style of Istio's `ISTIO_*` chains. Applying declares both chains, which
//! flushes and refills them, and replaces every jump already there by one, all in one
//! `iptables-restore --noflush` transaction: applying twice leaves one copy of each rule.
//! The rules go in through the system's `iptables-restore` (`iptables-nft-restore` when the
//! system has it, so they land in nftables, as Istio's init container puts them).

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

pub const OUTPUT_CHAIN: &str = "AETHER_OUTPUT";
pub const REDIRECT_CHAIN: &str = "AETHER_REDIRECT";
/// Chains of ours are recognised by this prefix when cleaning up.
const PREFIX: &str = "AETHER_";

/// What the rules are made from (the command line).
#[derive(Debug, Clone)]
pub struct Rules {
    /// The proxy's own uid: its connections are never captured.
    pub proxy_uid: u32,
    pub outbound_port: u16,
    /// DNS (UDP and TCP 53) goes here when set.
    pub dns_port: Option<u16>,
    /// Destination ports left alone.
    pub exclude_ports: Vec<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn loopback(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.0/8",
            Family::V6 => "::1/128",
        }
    }

    /// `(save, restore)` commands: the nft variants when installed, else the system's default.
    fn tools(self) -> (PathBuf, PathBuf) {
        let (nft, plain) = match self {
            Family::V4 => ("iptables-nft", "iptables"),
            Family::V6 => ("ip6tables-nft", "ip6tables"),
        };
        let pick = |suffix: &str| {
            find_in_path(&format!("{nft}-{suffix}"))
                .or_else(|| find_in_path(&format!("{plain}-{suffix}")))
                .unwrap_or_else(|| PathBuf::from(format!("{plain}-{suffix}")))
        };
        (pick("save"), pick("restore"))
    }

    fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// An executable `name` in `PATH` (or the sbin directories, which a non-login `PATH` may lack).
fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

impl Rules {
    /// The rules of the two chains (no table header, no jump from `OUTPUT`).
    fn chain_rules(&self, family: Family) -> String {
        let uid = self.proxy_uid;
        let mut r = String::new();
        let _ = writeln!(
            r,
            "-A {REDIRECT_CHAIN} -p tcp -j REDIRECT --to-ports {}",
            self.outbound_port
        );
        // DNS first: a resolver on loopback (127.0.0.53) is still the pod's DNS.
        if let Some(dns) = self.dns_port {
            for proto in ["udp", "tcp"] {
                let _ = writeln!(
                    r,
                    "-A {OUTPUT_CHAIN} -p {proto} --dport 53 -m owner ! --uid-owner {uid} -j REDIRECT --to-ports {dns}"
                );
            }
        }
        let _ = writeln!(r, "-A {OUTPUT_CHAIN} -d {} -j RETURN", family.loopback());
        for p in &self.exclude_ports {
            let _ = writeln!(r, "-A {OUTPUT_CHAIN} -p tcp --dport {p} -j RETURN");
        }
        let _ = writeln!(
            r,
            "-A {OUTPUT_CHAIN} -p tcp -m owner ! --uid-owner {uid} -j {REDIRECT_CHAIN}"
        );
        r
    }

    /// The `iptables-restore` input for a namespace without our rules (what the command prints).
    pub fn restore_input(&self, family: Family) -> String {
        self.apply_input(family, "")
    }

    /// The input that brings a namespace whose `nat` table `iptables-save` printed as `saved`
    /// to exactly our rules: chains declared (so flushed), every jump already in `OUTPUT`
    /// deleted, then one added.
    pub fn apply_input(&self, family: Family, saved: &str) -> String {
        let mut s = String::from("*nat\n");
        let _ = writeln!(s, ":{OUTPUT_CHAIN} - [0:0]");
        let _ = writeln!(s, ":{REDIRECT_CHAIN} - [0:0]");
        for jump in jumps(saved) {
            let _ = writeln!(s, "-D {jump}");
        }
        s.push_str(&self.chain_rules(family));
        let _ = writeln!(s, "-A OUTPUT -j {OUTPUT_CHAIN}");
        s.push_str("COMMIT\n");
        s
    }
}

/// The specs (`OUTPUT ... -j AETHER_...`) of jumps from `OUTPUT` into our chains in `saved`.
fn jumps(saved: &str) -> Vec<&str> {
    nat_lines(saved)
        .filter_map(|l| l.strip_prefix("-A "))
        .filter(|spec| {
            spec.starts_with("OUTPUT ")
                && spec
                    .split_whitespace()
                    .skip_while(|w| *w != "-j")
                    .nth(1)
                    .is_some_and(|target| target.starts_with(PREFIX))
        })
        .collect()
}

/// Our chains declared in `saved`.
fn chains(saved: &str) -> Vec<&str> {
    nat_lines(saved)
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with(PREFIX))
        .collect()
}

/// The lines of the `*nat` table in `iptables-save` output.
fn nat_lines(saved: &str) -> impl Iterator<Item = &str> {
    saved
        .lines()
        .map(str::trim)
        .skip_while(|l| *l != "*nat")
        .skip(1)
        .take_while(|l| *l != "COMMIT")
}

/// The input that removes our jumps and chains from `saved`; `None` when there is nothing.
pub fn clean_input(saved: &str) -> Option<String> {
    let (jumps, chains) = (jumps(saved), chains(saved));
    if jumps.is_empty() && chains.is_empty() {
        return None;
    }
    let mut s = String::from("*nat\n");
    for j in jumps {
        let _ = writeln!(s, "-D {j}");
    }
    // Flushed first: a chain still jumped to by another of ours cannot be deleted.
    for c in &chains {
        let _ = writeln!(s, "-F {c}");
    }
    for c in &chains {
        let _ = writeln!(s, "-X {c}");
    }
    s.push_str("COMMIT\n");
    Some(s)
}

/// What the command does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Print,
    Apply,
    Clean,
}

/// `aether-proxy redirect`. `rules` is `None` only for `--clean` (no uid needed).
pub fn main(rules: Option<Rules>, ipv6: bool, action: Action) -> ExitCode {
    let families: &[Family] = if ipv6 {
        &[Family::V4, Family::V6]
    } else {
        &[Family::V4]
    };
    let result = match (action, &rules) {
        (Action::Print, Some(rules)) => {
            let mut out = String::new();
            for f in families {
                let restore = match f {
                    Family::V4 => "iptables-restore",
                    Family::V6 => "ip6tables-restore",
                };
                let _ = writeln!(out, "# {} rules: input for `{restore} --noflush`", f.name());
                out.push_str(&rules.restore_input(*f));
            }
            print!("{out}");
            Ok(())
        }
        (Action::Apply, Some(rules)) => families.iter().try_for_each(|f| {
            let saved = save(*f)?;
            restore(*f, &rules.apply_input(*f, &saved))?;
            eprintln!("{} capture rules applied", f.name());
            Ok(())
        }),
        (Action::Clean, _) => families.iter().try_for_each(|f| {
            let saved = save(*f)?;
            match clean_input(&saved) {
                None => eprintln!("{}: no capture rules to remove", f.name()),
                Some(input) => {
                    restore(*f, &input)?;
                    eprintln!("{} capture rules removed", f.name());
                }
            }
            Ok(())
        }),
        (_, None) => Err("--proxy-uid is required".to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aether-proxy redirect: {e}");
            ExitCode::from(1)
        }
    }
}

/// The current `nat` table.
fn save(family: Family) -> Result<String, String> {
    let (save, _) = family.tools();
    let out = Command::new(&save)
        .args(["-t", "nat"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            format!(
                "cannot run {}: {e} (the iptables package provides it)",
                save.display()
            )
        })?;
    if !out.status.success() {
        return Err(format!(
            "{} -t nat failed ({}): {}",
            save.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Feeds `input` to `iptables-restore --noflush` (one transaction).
fn restore(family: Family, input: &str) -> Result<(), String> {
    let (_, restore) = family.tools();
    let mut child = Command::new(&restore)
        .arg("--noflush")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!(
                "cannot run {}: {e} (the iptables package provides it)",
                restore.display()
            )
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .map_err(|e| format!("writing to {}: {e}", restore.display()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{}: {e}", restore.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} --noflush refused the rules ({}): {}\ninput was:\n{input}",
            restore.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        Rules {
            proxy_uid: 1337,
            outbound_port: 15001,
            dns_port: Some(15053),
            exclude_ports: vec![22, 15021],
        }
    }

    #[test]
    fn the_rules_exclude_the_proxy_loopback_and_excluded_ports() {
        let v4 = rules().restore_input(Family::V4);
        assert_eq!(
            v4,
            "*nat\n:AETHER_OUTPUT - [0:0]\n:AETHER_REDIRECT - [0:0]\n\
             -A AETHER_REDIRECT -p tcp -j REDIRECT --to-ports 15001\n\
             -A AETHER_OUTPUT -p udp --dport 53 -m owner ! --uid-owner 1337 -j REDIRECT --to-ports 15053\n\
             -A AETHER_OUTPUT -p tcp --dport 53 -m owner ! --uid-owner 1337 -j REDIRECT --to-ports 15053\n\
             -A AETHER_OUTPUT -d 127.0.0.0/8 -j RETURN\n\
             -A AETHER_OUTPUT -p tcp --dport 22 -j RETURN\n\
             -A AETHER_OUTPUT -p tcp --dport 15021 -j RETURN\n\
             -A AETHER_OUTPUT -p tcp -m owner ! --uid-owner 1337 -j AETHER_REDIRECT\n\
             -A OUTPUT -j AETHER_OUTPUT\nCOMMIT\n"
        );
        let v6 = rules().restore_input(Family::V6);
        assert!(
            v6.contains("-A AETHER_OUTPUT -d ::1/128 -j RETURN\n"),
            "{v6}"
        );
        let no_dns = Rules {
            dns_port: None,
            ..rules()
        };
        assert!(!no_dns.restore_input(Family::V4).contains("--dport 53"));
    }

    const SAVED: &str = "# Generated by iptables-save v1.8.9 (nf_tables)\n*filter\n:INPUT ACCEPT [0:0]\n\
        -A INPUT -j AETHER_OUTPUT_NOT_NAT\nCOMMIT\n*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
        :AETHER_OUTPUT - [0:0]\n:AETHER_REDIRECT - [0:0]\n:OTHER - [0:0]\n\
        -A OUTPUT -j AETHER_OUTPUT\n-A OUTPUT -p tcp -j AETHER_OUTPUT\n-A OUTPUT -j OTHER\n\
        -A AETHER_OUTPUT -p tcp -m owner ! --uid-owner 1337 -j AETHER_REDIRECT\nCOMMIT\n";

    #[test]
    fn applying_over_old_rules_replaces_every_jump_by_one() {
        let input = rules().apply_input(Family::V4, SAVED);
        assert!(input.contains("-D OUTPUT -j AETHER_OUTPUT\n-D OUTPUT -p tcp -j AETHER_OUTPUT\n"));
        assert_eq!(input.matches("-A OUTPUT ").count(), 1, "{input}");
        assert!(!input.contains("OTHER"), "{input}");
    }

    #[test]
    fn cleaning_removes_only_ours_and_nothing_is_nothing() {
        let input = clean_input(SAVED).unwrap();
        assert_eq!(
            input,
            "*nat\n-D OUTPUT -j AETHER_OUTPUT\n-D OUTPUT -p tcp -j AETHER_OUTPUT\n\
             -F AETHER_OUTPUT\n-F AETHER_REDIRECT\n-X AETHER_OUTPUT\n-X AETHER_REDIRECT\nCOMMIT\n"
        );
        let empty = "*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        assert_eq!(clean_input(empty), None);
        assert_eq!(clean_input(""), None);
    }
}
