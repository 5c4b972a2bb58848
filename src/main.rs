use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    Demo,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run {
            config,
            concurrency,
        } => aether_proxy::run::main(&config, concurrency),
        Cmd::Check { config } => aether_proxy::run::check(&config),
        Cmd::Certs {
            out,
            trust_domain,
            workloads,
        } => aether_proxy::identity::certgen::main(&out, &trust_domain, &workloads),
        Cmd::Demo => aether_proxy::demo::main(),
    }
}
