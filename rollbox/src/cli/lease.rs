//! `rollbox lease`: hold one sandbox for the life of this process and serve its E2B/envd API
//! (the container of an agent-sandbox pod; see `rollbox::lease` and docs/kubernetes.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde_json::json;

use rollbox::lease::LeaseOptions;

use super::conn::{key_values, CliError, Conn, ConnArgs};

/// Where `rollbox serve --e2b-socket` listens in the DaemonSet.
pub const DEFAULT_E2B_SOCKET: &str = "/run/rollbox/e2b.sock";

#[derive(Args)]
pub struct LeaseArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// The template to boot.
    #[arg(required_unless_present = "snapshot", conflicts_with = "snapshot")]
    template: Option<String>,
    /// Restore this snapshot instead of booting a template.
    #[arg(long, value_name = "SNAPSHOT_ID")]
    snapshot: Option<String>,
    /// The daemon's E2B socket (`rollbox serve --e2b-socket`).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_E2B_SOCKET)]
    e2b_socket: PathBuf,
    /// Serve the sandbox's E2B/envd API here (in a pod: all addresses, envd's port).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:49983")]
    listen: SocketAddr,
    /// The pod's UID, the sandbox's `rollbox.dev/pod-uid` label [default: $POD_UID, which the
    /// downward API sets].
    #[arg(long, value_name = "UID")]
    pod_uid: Option<String>,
    /// Hard TTL in seconds [default: the longest the daemon allows, 30 days: the pod's life
    /// is the sandbox's, and its end, SIGTERM or the daemon's pod reaper end the sandbox].
    #[arg(long, value_name = "SECS", default_value_t = rollbox::daemon::api::MAX_TTL_S)]
    ttl: u64,
    #[arg(long)]
    vcpus: Option<u32>,
    #[arg(long, value_name = "MIB")]
    memory_mib: Option<u32>,
    /// KEY=VALUE (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    labels: Vec<String>,
    /// KEY=VALUE (repeatable): environment of every command in the sandbox.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// How long the guest agent may take to answer after the create.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    ready_timeout: u64,
}

pub fn run(args: LeaseArgs) -> Result<(), CliError> {
    let options = options(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Usage(format!("cannot start the runtime: {e}")))?;
    Ok(runtime.block_on(rollbox::lease::run(options))?)
}

fn options(args: LeaseArgs) -> Result<LeaseOptions, CliError> {
    let conn = Conn::new(&args.conn)?;
    let mut create = json!({
        "labels": key_values(&args.labels, "label")?,
        "env": key_values(&args.env, "env")?,
        "ttl_s": args.ttl,
    });
    match (args.template, args.snapshot) {
        (_, Some(snapshot)) => create["snapshot"] = json!(snapshot),
        (Some(template), None) => create["template"] = json!(template),
        (None, None) => {}
    }
    if let Some(vcpus) = args.vcpus {
        create["vcpus"] = json!(vcpus);
    }
    if let Some(memory) = args.memory_mib {
        create["memory_mib"] = json!(memory);
    }
    let pod_uid = args
        .pod_uid
        .or_else(|| std::env::var("POD_UID").ok())
        .filter(|uid| !uid.is_empty());
    Ok(LeaseOptions {
        daemon: conn.endpoint,
        api_key: conn.key,
        e2b_socket: args.e2b_socket,
        listen: args.listen,
        create,
        pod_uid,
        ready_timeout: Duration::from_secs(args.ready_timeout),
        watch_interval: Duration::from_secs(2),
    })
}
