//! `rollbox node ...`: this daemon as a node of a fleet (an admin key's to run): what it holds
//! and has room for, and drain; and `probe`, which needs no key (a Kubernetes exec probe).

use clap::Subcommand;
use serde_json::json;

use rollbox::daemon::api::{NodeInfo, NodeStatus};
use rollbox::daemon::client::Response;

use super::conn::{parse, print_json, CliError, Conn};
use super::kube::{InCluster, SLOTS_RESOURCE};

#[derive(Subcommand)]
pub enum NodeCommand {
    /// The node: id, status, slots, memory, CPU fingerprint, templates and snapshots.
    Info,
    /// Take no new sandboxes (creates, batches and forks get 503); running ones go on.
    Drain {
        /// End what is still running this many seconds from now.
        #[arg(long, value_name = "SECS")]
        deadline: Option<u64>,
    },
    /// Take new sandboxes again.
    Undrain,
    /// Publish this node's slots (`rollbox serve --max-sandboxes`) as the extended resource
    /// rollbox.dev/slots on its Kubernetes Node, again every SECS seconds: the DaemonSet's
    /// sidecar, whose service account may patch nodes/status.
    Advertise {
        /// The Node's name [default: $NODE_NAME, which the downward API sets].
        #[arg(long, value_name = "NAME")]
        node_name: Option<String>,
        /// Publish again this often, in seconds.
        #[arg(long, value_name = "SECS", default_value_t = 60,
              value_parser = clap::value_parser!(u64).range(1..=86_400))]
        every: u64,
        /// Publish once and exit (its status says whether it worked).
        #[arg(long)]
        once: bool,
        /// The service account's directory: its token and the API server's ca.crt.
        #[arg(
            long,
            value_name = "DIR",
            default_value = "/var/run/secrets/kubernetes.io/serviceaccount"
        )]
        service_account: std::path::PathBuf,
    },
    /// Exit 0 when the daemon is alive (`live`) or ready for sandboxes (`ready`: not draining),
    /// 1 otherwise; needs no key. For Kubernetes exec probes.
    Probe {
        #[arg(value_enum)]
        what: Probe,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Probe {
    Live,
    Ready,
}

impl NodeCommand {
    /// Whether the command needs an API key (every one but `probe`).
    pub fn needs_key(&self) -> bool {
        !matches!(self, NodeCommand::Probe { .. })
    }
}

/// Publishes the daemon's slot total on the Node, once or every `every` seconds; while it
/// repeats, a failure is printed and tried again at the next turn.
fn advertise(
    conn: &Conn,
    cluster: &InCluster,
    node_name: &str,
    every: u64,
    once: bool,
) -> Result<(), CliError> {
    loop {
        let published = conn
            .call("GET", "/node", None)
            .and_then(|response| parse::<NodeInfo>(&response))
            .and_then(|node| {
                let total = node.slots.total.ok_or_else(|| {
                    CliError::Usage(
                        "the daemon has no slot limit to publish: start it with --max-sandboxes N"
                            .into(),
                    )
                })?;
                cluster.publish_slots(node_name, total)?;
                Ok(total)
            });
        match published {
            Ok(total) => println!("published {SLOTS_RESOURCE}={total} on node {node_name}"),
            Err(e) if once => return Err(e),
            Err(e) => eprintln!("rollbox node advertise: {e}; trying again in {every} s"),
        }
        if once {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(every));
    }
}

/// GET /livez or /readyz within 5 s: Ok when it answers 200.
fn probe(conn: &Conn, what: Probe) -> Result<(), CliError> {
    let path = match what {
        Probe::Live => "/livez",
        Probe::Ready => "/readyz",
    };
    let response = conn
        .endpoint
        .request("GET", path, &[], None, std::time::Duration::from_secs(5))
        .map_err(CliError::NotRunning)?;
    let body = String::from_utf8_lossy(&response.body);
    if response.status == 200 {
        print!("{body}");
        return Ok(());
    }
    Err(CliError::Refused {
        status: response.status,
        message: format!("{path}: {}", body.trim()),
        hint: "",
    })
}

fn show(conn: &Conn, response: &Response) -> Result<(), CliError> {
    if conn.json {
        print_json(response);
        return Ok(());
    }
    let node: NodeInfo = parse(response)?;
    let status = match node.status {
        NodeStatus::Ready => "ready".to_string(),
        NodeStatus::Draining => match node.drain_deadline_ms {
            Some(ms) => format!("draining (what is left ends at {ms} ms since the epoch)"),
            None => "draining".to_string(),
        },
    };
    let limit = |value: Option<u64>| value.map_or("no limit".to_string(), |v| v.to_string());
    println!("node      {} (rollbox {})", node.node_id, node.version);
    println!("status    {status}");
    println!(
        "slots     {} used, {} being created, of {}",
        node.slots.used,
        node.slots.pending,
        limit(node.slots.total)
    );
    println!(
        "memory    {} MiB committed of {}; host available {} MiB",
        node.memory_mib.committed,
        limit(node.memory_mib.budget),
        node.memory_mib.host_available
    );
    println!(
        "cpu       {} family {} model {} stepping {} (fingerprint {})",
        node.cpu.vendor, node.cpu.family, node.cpu.model, node.cpu.stepping, node.cpu.id
    );
    let names: Vec<&str> = node.templates.iter().map(|t| t.name.as_str()).collect();
    println!("templates {}", names.join(" "));
    println!("snapshots {}", node.snapshots.len());
    Ok(())
}

pub fn run(conn: &Conn, command: NodeCommand) -> Result<(), CliError> {
    let response = match command {
        NodeCommand::Info => conn.call("GET", "/node", None)?,
        NodeCommand::Drain { deadline } => {
            let body = match deadline {
                Some(s) => json!({ "deadline_s": s }),
                None => json!({}),
            };
            conn.call("POST", "/node/drain", Some(body))?
        }
        NodeCommand::Undrain => conn.call("DELETE", "/node/drain", None)?,
        NodeCommand::Probe { what } => return probe(conn, what),
        NodeCommand::Advertise {
            node_name,
            every,
            once,
            service_account,
        } => {
            let node_name = node_name
                .or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()))
                .ok_or_else(|| {
                    CliError::Usage("no Node name: pass --node-name or set NODE_NAME".into())
                })?;
            let cluster = InCluster::from_env(&service_account)?;
            return advertise(conn, &cluster, &node_name, every, once);
        }
    };
    show(conn, &response)
}
