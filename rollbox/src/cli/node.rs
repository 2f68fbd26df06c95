//! `rollbox node ...`: this daemon as a node of a fleet (an admin key's to run): what it holds
//! and has room for, and drain.

use clap::Subcommand;
use serde_json::json;

use rollbox::daemon::api::{NodeInfo, NodeStatus};
use rollbox::daemon::client::Response;

use super::conn::{parse, print_json, CliError, Conn};

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
    };
    show(conn, &response)
}
