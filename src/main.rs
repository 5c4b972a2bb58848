use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOCATOR: aether_proxy::cli::Allocator = aether_proxy::cli::Allocator;

#[derive(Parser)]
#[command(
    name = "aether-proxy",
    version,
    about = "Aether mesh data-plane sidecar"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the sidecar.
    Run {
        #[arg(short, long)]
        config: PathBuf,
        /// Worker threads (default: the CPUs available).
        #[arg(long)]
        concurrency: Option<usize>,
    },
    /// Validate a config file and the catalog it names; exit 0, or 1 with the errors.
    Check {
        #[arg(short, long)]
        config: PathBuf,
    },
    /// Write a test CA and one certificate + key per workload.
    Certs {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "aether.local")]
        trust_domain: String,
        /// `<namespace>/<service account>`, repeatable.
        #[arg(long = "workload", required = true)]
        workloads: Vec<String>,
    },
    /// Run a complete local mesh on loopback (two server pods, a client pod, demo apps).
    Demo {
        /// After the first requests, send traffic of every kind (h1, h2c, raw TCP) for this
        /// many seconds, print what came back, and stop.
        #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=3600))]
        load: Option<u64>,
        /// With --load: a chaos soak. Inject faults on a printed schedule (rollouts, sidecar
        /// and app restarts, certificate rotation, abuse bursts) and account for every failure.
        #[arg(long, requires = "load")]
        chaos: bool,
    },
    /// Ask a running sidecar where a request would go, without sending it.
    Explain {
        /// The sidecar's admin listener.
        #[arg(long, default_value = "127.0.0.1:15000")]
        admin: std::net::SocketAddr,
        /// The request's authority, as an app sends it: `<service>.<mesh domain>[:<port>]`.
        authority: String,
        /// A request header the service's routes may match (`name: value`), repeatable.
        #[arg(short = 'H', long = "header", value_name = "NAME: VALUE")]
        headers: Vec<String>,
        /// Explain a CONNECT (a tunnel to a tcp port) instead of an HTTP request.
        #[arg(long)]
        connect: bool,
        /// Print the JSON the admin endpoint answers.
        #[arg(long)]
        json: bool,
    },
    /// Serve a catalog file over delta ADS (Clusters and assignments), for sidecars in xDS mode.
    ControlPlane {
        /// The catalog file (the format of `catalog.path`), watched for changes.
        #[arg(long)]
        catalog: PathBuf,
        /// `host:port` on loopback, or `unix:///absolute/path` (plaintext gRPC).
        #[arg(long)]
        listen: String,
        /// The mesh domain in cluster names (`<service>.<mesh domain>[:<port>]`).
        #[arg(long, default_value = "aether.internal")]
        mesh_domain: String,
        /// The trust domain every service identity must be in.
        #[arg(long, default_value = "aether.local")]
        trust_domain: String,
    },
    /// The pod's capture rules: print them as `iptables-restore` input, apply or remove them.
    Redirect {
        /// The proxy's uid; its own connections are never captured.
        #[arg(long, required_unless_present = "clean")]
        proxy_uid: Option<u32>,
        #[arg(long, default_value_t = 15001, value_parser = clap::value_parser!(u16).range(1..))]
        outbound_port: u16,
        /// Send DNS (UDP and TCP port 53) to this port.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
        dns_port: Option<u16>,
        /// Destination ports never captured, comma-separated.
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..))]
        exclude_outbound_ports: Vec<u16>,
        /// Also write the IPv6 rules (ip6tables).
        #[arg(long)]
        ipv6: bool,
        /// Install the rules (idempotent).
        #[arg(long, conflicts_with = "clean")]
        apply: bool,
        /// Remove the rules (exit 0 when there are none).
        #[arg(long)]
        clean: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run {
            config,
            concurrency,
        } => {
            // First, before any thread: it may start this process again, with the same pid.
            aether_proxy::cli::tune_allocator();
            aether_proxy::cli::run(&config, concurrency)
        }
        Cmd::Check { config } => aether_proxy::cli::check(&config),
        Cmd::Certs {
            out,
            trust_domain,
            workloads,
        } => aether_proxy::cli::certs(&out, &trust_domain, &workloads),
        Cmd::Demo { load, chaos } => aether_proxy::cli::demo(load, chaos),
        Cmd::Explain {
            admin,
            authority,
            headers,
            connect,
            json,
        } => aether_proxy::cli::explain(admin, &authority, &headers, connect, json),
        Cmd::ControlPlane {
            catalog,
            listen,
            mesh_domain,
            trust_domain,
        } => aether_proxy::cli::control_plane(aether_proxy::cli::ControlPlaneOptions {
            catalog,
            listen,
            mesh_domain,
            trust_domain,
        }),
        Cmd::Redirect {
            proxy_uid,
            outbound_port,
            dns_port,
            mut exclude_outbound_ports,
            ipv6,
            apply,
            clean,
        } => {
            use aether_proxy::cli::{redirect, RedirectAction as Action, Rules};
            exclude_outbound_ports.sort_unstable();
            exclude_outbound_ports.dedup();
            let rules = proxy_uid.map(|proxy_uid| Rules {
                proxy_uid,
                outbound_port,
                dns_port,
                exclude_ports: exclude_outbound_ports,
            });
            let action = match (apply, clean) {
                (true, _) => Action::Apply,
                (_, true) => Action::Clean,
                _ => Action::Print,
            };
            redirect(rules, ipv6, action)
        }
    }
}
