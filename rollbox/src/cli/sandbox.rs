//! `rollbox sandbox ...`: one function per subcommand, each one request (or a few) to the
//! daemon and a table or the daemon's JSON (`--json`). Exec, cp and port-forward, which reach
//! into a running guest, are in [`super::guest`].

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use rollbox::daemon::api::{Sandbox, SandboxList, Snapshot};
use rollbox::daemon::client::Response;

use super::conn::{
    encode, key_values, local_error, parse, print_json, seconds_left, CliError, Conn,
};
use super::guest;

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox from a template (a boot) or from a snapshot (a restore) and print it.
    Create(Box<CreateArgs>),
    /// List live sandboxes (or those in --state).
    Ls(LsArgs),
    /// Show one sandbox.
    Get {
        id: String,
    },
    /// End sandboxes by id, or every live one with --label (ending one that is gone already
    /// succeeds).
    Rm(RmArgs),
    /// Show a sandbox's usage: running seconds (paused time not counted), vCPU-seconds,
    /// memory-MiB-seconds and measured CPU seconds.
    Usage {
        id: String,
    },
    Pause {
        id: String,
    },
    Resume {
        id: String,
    },
    /// Set the TTL to SECS from now.
    Keepalive(KeepaliveArgs),
    /// Change a sandbox's egress policy (PATCH /sandboxes/ID/network): new connections meet
    /// it at once.
    Network {
        id: String,
        /// none, all, or an allow-list CIDR|HOST[:PORT[-PORT]],...
        #[arg(long, value_name = "POLICY")]
        egress: String,
    },
    /// Run a command in the sandbox, streaming its output; exits with its status (128 +
    /// signal when a signal ended it, 124 on timeout).
    Exec(guest::ExecArgs),
    /// Copy a file or directory between the host and a sandbox, like `docker cp`: one side is
    /// ID:/absolute/path. A directory's contents land in DEST (created if missing); a file
    /// lands at DEST, or in it when DEST is a directory (host) or ends with / (sandbox).
    Cp(guest::CpArgs),
    /// Take a memory snapshot (the sandbox keeps running unless --stop) and print its id.
    Snapshot(SnapshotArgs),
    /// List snapshots (of one sandbox with --sandbox).
    Snapshots {
        #[arg(long, value_name = "ID")]
        sandbox: Option<String>,
    },
    /// Delete snapshots (deleting one that is gone succeeds).
    SnapshotRm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Write a snapshot as an archive (a tar; its memory and disk sparse) for another node's
    /// `snapshot-import`. The file appears only once the archive is whole.
    SnapshotExport {
        id: String,
        /// The archive's file.
        #[arg(short, long, value_name = "FILE")]
        output: std::path::PathBuf,
    },
    /// Import a snapshot archive another node exported and print the snapshot's id (the same
    /// as there). This node needs the CPU fingerprint, template and volumes it was taken
    /// with; importing a snapshot that is here already answers it again.
    SnapshotImport {
        file: std::path::PathBuf,
    },
    /// Fork into N new sandboxes (a fresh snapshot, restored N times); prints each new id
    /// or why it failed, and fails if any did.
    Fork(ForkArgs),
    /// Reset in place (same id, fresh state) to a snapshot [default: the one it came from;
    /// a sandbox that came from none boots afresh].
    Reset(ResetArgs),
    /// Serve a sandbox's TCP port on a host address: each connection accepted there is
    /// piped to the guest's 127.0.0.1:PORT through the agent. Prints the address, then runs
    /// until interrupted.
    PortForward(guest::PortForwardArgs),
}

/// `create`'s arguments.
#[derive(Args)]
pub struct CreateArgs {
    #[arg(required_unless_present = "snapshot", conflicts_with = "snapshot")]
    pub template: Option<String>,
    /// Restore this snapshot instead of booting a template.
    #[arg(long, value_name = "SNAPSHOT_ID")]
    pub snapshot: Option<String>,
    /// Hard TTL in seconds (required unless the daemon has --default-ttl).
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<i64>,
    /// End it after this many seconds without an API call on it.
    #[arg(long, value_name = "SECS")]
    pub idle_ttl: Option<i64>,
    #[arg(long)]
    pub vcpus: Option<i64>,
    #[arg(long, value_name = "MIB")]
    pub memory_mib: Option<i64>,
    /// KEY=VALUE (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// KEY=VALUE (repeatable).
    #[arg(long = "metadata", value_name = "KEY=VALUE")]
    pub metadata: Vec<String>,
    /// A retried create with the same key returns the first sandbox.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
    /// KEY=VALUE (repeatable): environment of every exec in the sandbox.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Limit the sandbox to this many cores of CPU time (e.g. 0.5), by a cgroup.
    #[arg(long, value_name = "CORES")]
    pub cpu_limit: Option<f64>,
    /// A deterministic machine: no RDRAND/RDSEED, and every restore (this create, each
    /// reset) puts back the snapshot's guest time and generation exactly.
    #[arg(long)]
    pub deterministic: bool,
    /// Create this many of the spec in one batch (each succeeds or fails on its own).
    #[arg(long, value_name = "N")]
    pub count: Option<i64>,
    /// Mount a volume (`rollbox volume create`) at an absolute path, read-only with `:ro`
    /// (repeatable). A restore gets its snapshot's volumes.
    #[arg(
        long = "volume",
        value_name = "NAME:/PATH[:ro]",
        value_parser = super::volume::parse_mount,
        conflicts_with = "snapshot"
    )]
    pub volumes: Vec<super::volume::VolumeMount>,
    /// Pass GPUs through (`rollbox gpu ls`): a name such as H100 (matched in the device's
    /// name), `any`, or a PCI address. A sandbox with a GPU boots, and cannot be paused,
    /// snapshotted, forked or reset.
    #[arg(long, value_name = "NAME", conflicts_with = "snapshot")]
    pub gpu: Option<String>,
    /// How many GPUs [default: 1].
    #[arg(long, value_name = "N", conflicts_with = "snapshot")]
    pub gpu_count: Option<u32>,
    /// Wait up to SECS for busy GPUs to come free [default: 0: refused at once].
    #[arg(long, value_name = "SECS", conflicts_with = "snapshot")]
    pub gpu_wait: Option<u32>,
    /// Give the sandbox a network (a tap with NAT, `eth0` in the guest) with the server's
    /// `--default-egress` (a restore of a snapshot with a network gets one anyway, with the
    /// snapshot's egress).
    #[arg(long)]
    pub network: bool,
    /// A network with this egress: none, all, or an allow-list CIDR|HOST[:PORT[-PORT]],...
    #[arg(long, value_name = "POLICY")]
    pub egress: Option<String>,
    /// Expose this guest TCP port on a host port (repeatable; implies a network): `sandbox
    /// get` shows the host address and port.
    #[arg(long = "expose", value_name = "PORT")]
    pub expose: Vec<u16>,
}

/// `network` of a create or template: `--egress POLICY` and `--expose PORT` (which imply a
/// network), or `--network` (the server's default egress).
pub fn network_body(
    network: bool,
    egress: Option<String>,
    expose: Vec<u16>,
) -> Option<serde_json::Value> {
    if !network && egress.is_none() && expose.is_empty() {
        return None;
    }
    let mut body = json!({});
    if let Some(policy) = egress {
        body["egress"] = json!(policy);
    }
    if !expose.is_empty() {
        body["expose"] = json!(expose);
    }
    Some(body)
}

/// `ls`'s arguments.
#[derive(Args)]
pub struct LsArgs {
    /// KEY=VALUE (repeatable; all must match).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    #[arg(long)]
    pub state: Option<String>,
    /// At most this many (one page).
    #[arg(long)]
    pub limit: Option<u32>,
    #[arg(long, value_name = "TOKEN")]
    pub page_token: Option<String>,
}

/// `rm`'s arguments.
#[derive(Args)]
pub struct RmArgs {
    #[arg(required_unless_present = "labels", conflicts_with = "labels")]
    pub ids: Vec<String>,
    /// KEY=VALUE (repeatable; all must match): end every live sandbox with these labels.
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
}

/// `keepalive`'s arguments.
#[derive(Args)]
pub struct KeepaliveArgs {
    pub id: String,
    #[arg(long, value_name = "SECS")]
    pub ttl: i64,
}

/// `snapshot`'s arguments.
#[derive(Args)]
pub struct SnapshotArgs {
    pub id: String,
    /// End the sandbox once the snapshot is taken.
    #[arg(long)]
    pub stop: bool,
    /// Remove the snapshot after this many seconds (unless a live sandbox came from it).
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<i64>,
}

/// `fork`'s arguments.
#[derive(Args)]
pub struct ForkArgs {
    pub id: String,
    #[arg(long, default_value_t = 1)]
    pub count: i64,
    /// TTL of the new sandboxes [default: what the parent has left].
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<i64>,
    /// KEY=VALUE (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
}

/// `reset`'s arguments.
#[derive(Args)]
pub struct ResetArgs {
    pub id: String,
    #[arg(long, value_name = "SNAPSHOT_ID")]
    pub snapshot: Option<String>,
}

/// Runs one subcommand; the process's exit status (a command's own for `exec`).
pub fn run(conn: &Conn, command: SandboxCommand) -> Result<u8, CliError> {
    match command {
        SandboxCommand::Create(args) => create(conn, *args),
        SandboxCommand::Ls(args) => ls(conn, args),
        SandboxCommand::Get { id } => get(conn, &id),
        SandboxCommand::Rm(args) => rm(conn, args),
        SandboxCommand::Usage { id } => usage(conn, &id),
        SandboxCommand::Pause { id } => pause_resume(conn, &id, "pause"),
        SandboxCommand::Resume { id } => pause_resume(conn, &id, "resume"),
        SandboxCommand::Keepalive(args) => keepalive(conn, args),
        SandboxCommand::Network { id, egress } => set_network(conn, &id, egress),
        SandboxCommand::Exec(args) => guest::exec(conn, args),
        SandboxCommand::Cp(args) => guest::copy(conn, &args).map(|()| 0),
        SandboxCommand::Snapshot(args) => snapshot(conn, args),
        SandboxCommand::Snapshots { sandbox } => snapshots(conn, sandbox),
        SandboxCommand::SnapshotRm { ids } => snapshot_rm(conn, ids),
        SandboxCommand::SnapshotExport { id, output } => snapshot_export(conn, &id, &output),
        SandboxCommand::SnapshotImport { file } => snapshot_import(conn, &file),
        SandboxCommand::Fork(args) => fork(conn, args),
        SandboxCommand::Reset(args) => reset(conn, args),
        SandboxCommand::PortForward(args) => {
            guest::port_forward(conn, &args.id, args.port, args.listen).map(|()| 0)
        }
    }
}

/// `rollbox sandbox create` (`--count`: a batch).
fn create(conn: &Conn, args: CreateArgs) -> Result<u8, CliError> {
    let CreateArgs {
        template,
        snapshot,
        ttl,
        idle_ttl,
        vcpus,
        memory_mib,
        labels,
        metadata,
        idempotency_key,
        env,
        cpu_limit,
        deterministic,
        count,
        volumes,
        gpu,
        gpu_count,
        gpu_wait,
        network,
        egress,
        expose,
    } = args;
    let mut body = json!({
        "labels": key_values(&labels, "label")?,
        "metadata": key_values(&metadata, "metadata")?,
        "env": key_values(&env, "env")?,
    });
    match (template, snapshot) {
        (_, Some(snapshot)) => body["snapshot"] = json!(snapshot),
        (Some(template), None) => body["template"] = json!(template),
        (None, None) => {}
    }
    for (field, value) in [
        ("ttl_s", ttl),
        ("idle_ttl_s", idle_ttl),
        ("vcpus", vcpus),
        ("memory_mib", memory_mib),
    ] {
        if let Some(v) = value {
            body[field] = json!(v);
        }
    }
    if let Some(key) = idempotency_key {
        body["idempotency_key"] = json!(key);
    }
    if let Some(cores) = cpu_limit {
        body["cpu_limit"] = json!(cores);
    }
    if deterministic {
        body["deterministic"] = json!(true);
    }
    if !volumes.is_empty() {
        body["volumes"] = json!(volumes);
    }
    if let Some(gpu) = gpu {
        body["gpu"] = json!(gpu);
    }
    if let Some(n) = gpu_count {
        body["gpu_count"] = json!(n);
    }
    if let Some(s) = gpu_wait {
        body["gpu_wait_s"] = json!(s);
    }
    if let Some(network) = network_body(network, egress, expose) {
        body["network"] = network;
    }
    if let Some(count) = count {
        body["count"] = json!(count);
        let response = conn.call("POST", "/sandboxes/batch", Some(body))?;
        if conn.json {
            print_json(&response);
            return Ok(0);
        }
        #[derive(serde::Deserialize)]
        struct Batch {
            results: Vec<rollbox::daemon::api::ForkResult>,
        }
        let batch: Batch = parse(&response)?;
        let mut failed = 0u8;
        for result in batch.results {
            match (result.sandbox, result.error) {
                (Some(s), _) => println!("{}\t{}", s.id, s.state.as_str()),
                (None, error) => {
                    failed = 1;
                    println!("-\tfailed: {}", error.unwrap_or_default());
                }
            }
        }
        return Ok(failed);
    }
    let response = conn.call("POST", "/sandboxes", Some(body))?;
    if conn.json {
        print_json(&response);
    } else {
        let sandbox: Sandbox = parse(&response)?;
        if response.status == 200 {
            eprintln!("(an earlier create with this idempotency key made it)");
        }
        print_sandbox(&sandbox);
    }
    Ok(0)
}

/// `rollbox sandbox ls`.
fn ls(conn: &Conn, args: LsArgs) -> Result<u8, CliError> {
    let LsArgs {
        labels,
        state,
        limit,
        page_token,
    } = args;
    let mut query: Vec<String> = labels
        .iter()
        .map(|l| format!("label={}", encode(l)))
        .collect();
    if let Some(state) = state {
        query.push(format!("state={}", encode(&state)));
    }
    if let Some(limit) = limit {
        query.push(format!("limit={limit}"));
    }
    if let Some(token) = page_token {
        query.push(format!("page_token={}", encode(&token)));
    }
    let path = if query.is_empty() {
        "/sandboxes".to_string()
    } else {
        format!("/sandboxes?{}", query.join("&"))
    };
    let response = conn.call("GET", &path, None)?;
    if conn.json {
        print_json(&response);
    } else {
        let list: SandboxList = parse(&response)?;
        print_sandboxes(&list.sandboxes);
        if let Some(token) = list.next_page_token {
            eprintln!("more: --page-token {token}");
        }
    }
    Ok(0)
}

/// `rollbox sandbox get`.
fn get(conn: &Conn, id: &str) -> Result<u8, CliError> {
    let response = conn.call("GET", &format!("/sandboxes/{id}"), None)?;
    if conn.json {
        print_json(&response);
    } else {
        print_sandbox(&parse(&response)?);
    }
    Ok(0)
}

/// `rollbox sandbox rm`: by ids, or every live sandbox with `--label`s.
fn rm(conn: &Conn, args: RmArgs) -> Result<u8, CliError> {
    let RmArgs { ids, labels } = args;
    if !labels.is_empty() {
        key_values(&labels, "label")?;
        let query: Vec<String> = labels
            .iter()
            .map(|l| format!("label={}", encode(l)))
            .collect();
        let response = conn.call("DELETE", &format!("/sandboxes?{}", query.join("&")), None)?;
        if conn.json {
            print_json(&response);
        } else {
            #[derive(serde::Deserialize)]
            struct Deleted {
                deleted: Vec<String>,
            }
            let deleted: Deleted = parse(&response)?;
            for id in &deleted.deleted {
                println!("{id}: removed");
            }
            if deleted.deleted.is_empty() {
                println!("no live sandbox has these labels");
            }
        }
        return Ok(0);
    }
    for id in ids {
        conn.call("DELETE", &format!("/sandboxes/{id}"), None)?;
        if !conn.json {
            println!("{id}: removed");
        }
    }
    Ok(0)
}

/// `rollbox sandbox usage`.
fn usage(conn: &Conn, id: &str) -> Result<u8, CliError> {
    let response = conn.call("GET", &format!("/sandboxes/{id}/usage"), None)?;
    if conn.json {
        print_json(&response);
    } else {
        let u: rollbox::daemon::api::Usage = parse(&response)?;
        println!("sandbox:            {} ({})", u.sandbox, u.state.as_str());
        println!("running_s:          {}", u.running_s);
        println!("vcpu_seconds:       {} ({} vCPUs)", u.vcpu_seconds, u.vcpus);
        println!(
            "memory_mib_seconds: {} ({} MiB)",
            u.memory_mib_seconds, u.memory_mib
        );
        println!("cpu_seconds:        {:.3} (measured)", u.cpu_seconds);
    }
    Ok(0)
}

/// `rollbox sandbox pause` and `resume`.
fn pause_resume(conn: &Conn, id: &str, verb: &str) -> Result<u8, CliError> {
    let response = conn.call("POST", &format!("/sandboxes/{id}/{verb}"), None)?;
    if conn.json {
        print_json(&response);
    } else {
        let sandbox: Sandbox = parse(&response)?;
        println!("{}: {}", sandbox.id, sandbox.state.as_str());
    }
    Ok(0)
}

/// `rollbox sandbox network`.
fn set_network(conn: &Conn, id: &str, egress: String) -> Result<u8, CliError> {
    let body = network_body(true, Some(egress), Vec::new());
    let response = conn.call("PATCH", &format!("/sandboxes/{id}/network"), body)?;
    if conn.json {
        print_json(&response);
    } else {
        print_sandbox(&parse(&response)?);
    }
    Ok(0)
}

/// `rollbox sandbox keepalive`.
fn keepalive(conn: &Conn, args: KeepaliveArgs) -> Result<u8, CliError> {
    let KeepaliveArgs { id, ttl } = args;
    let response = conn.call(
        "POST",
        &format!("/sandboxes/{id}/keepalive"),
        Some(json!({ "ttl_s": ttl })),
    )?;
    if conn.json {
        print_json(&response);
    } else {
        let sandbox: Sandbox = parse(&response)?;
        println!(
            "{}: expires in {}",
            sandbox.id,
            seconds_left(sandbox.expires_at_ms)
        );
    }
    Ok(0)
}

/// `rollbox sandbox snapshot`.
fn snapshot(conn: &Conn, args: SnapshotArgs) -> Result<u8, CliError> {
    let SnapshotArgs { id, stop, ttl } = args;
    let mut body = json!({ "stop": stop });
    if let Some(ttl) = ttl {
        body["ttl_s"] = json!(ttl);
    }
    let response = conn.call("POST", &format!("/sandboxes/{id}/snapshots"), Some(body))?;
    print_snapshot(conn, &response)
}

/// A snapshot's id, or its JSON with `--json`.
fn print_snapshot(conn: &Conn, response: &Response) -> Result<u8, CliError> {
    if conn.json {
        print_json(response);
    } else {
        let snapshot: Snapshot = parse(response)?;
        println!("{}", snapshot.id);
    }
    Ok(0)
}

/// `rollbox sandbox snapshots`.
fn snapshots(conn: &Conn, sandbox: Option<String>) -> Result<u8, CliError> {
    let path = match sandbox {
        Some(id) => format!("/snapshots?sandbox={}", encode(&id)),
        None => "/snapshots".to_string(),
    };
    let response = conn.call("GET", &path, None)?;
    if conn.json {
        print_json(&response);
    } else {
        let list: Value = parse(&response)?;
        let snapshots: Vec<Snapshot> =
            serde_json::from_value(list["snapshots"].clone()).map_err(CliError::Answer)?;
        println!("{:<22} {:<20} {:<22} TEMPLATE", "ID", "SANDBOX", "PARENT");
        for s in snapshots {
            println!(
                "{:<22} {:<20} {:<22} {}",
                s.id,
                s.sandbox,
                s.parent.as_deref().unwrap_or("-"),
                s.template
            );
        }
    }
    Ok(0)
}

/// `rollbox sandbox snapshot-rm`.
fn snapshot_rm(conn: &Conn, ids: Vec<String>) -> Result<u8, CliError> {
    for id in ids {
        conn.call("DELETE", &format!("/snapshots/{id}"), None)?;
        if !conn.json {
            println!("{id} deleted");
        }
    }
    Ok(0)
}

/// `rollbox sandbox snapshot-export`: into a hidden file beside `output`, renamed to it once
/// the archive ended whole (a cut download leaves no file).
fn snapshot_export(conn: &Conn, id: &str, output: &std::path::Path) -> Result<u8, CliError> {
    let local = local_error;
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = output.with_file_name(format!(".{name}.partial"));
    let mut response = conn.open(
        "GET",
        &format!("/snapshots/{}/export", encode(id)),
        None,
        "application/json",
    )?;
    let mut file = std::fs::File::create(&partial).map_err(local(&partial))?;
    let copied = std::io::copy(&mut response, &mut file)
        .map_err(|e| CliError::Stream(format!("export of {id} cut: {e}")))
        .and_then(|n| file.sync_all().map(|()| n).map_err(local(&partial)));
    let bytes = match copied {
        Ok(bytes) => bytes,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    std::fs::rename(&partial, output).map_err(local(output))?;
    if conn.json {
        println!(
            "{}",
            json!({ "snapshot": id, "file": output, "bytes": bytes })
        );
    } else {
        println!("{}: {bytes} bytes", output.display());
    }
    Ok(0)
}

/// `rollbox sandbox snapshot-import`.
fn snapshot_import(conn: &Conn, path: &std::path::Path) -> Result<u8, CliError> {
    let local = local_error(path);
    let mut file = std::fs::File::open(path).map_err(&local)?;
    let len = file.metadata().map_err(&local)?.len();
    let response = conn
        .open(
            "POST",
            "/snapshots/import",
            Some((&mut file, len)),
            "application/x-tar",
        )?
        .into_response()
        .map_err(CliError::Request)?;
    print_snapshot(conn, &response)
}

/// `rollbox sandbox fork`: fails when any fork did.
fn fork(conn: &Conn, args: ForkArgs) -> Result<u8, CliError> {
    let ForkArgs {
        id,
        count,
        ttl,
        labels,
    } = args;
    let mut body = json!({ "count": count, "labels": key_values(&labels, "label")? });
    if let Some(ttl) = ttl {
        body["ttl_s"] = json!(ttl);
    }
    let response = conn.call("POST", &format!("/sandboxes/{id}/fork"), Some(body))?;
    if conn.json {
        print_json(&response);
    }
    let answer: Value = parse(&response)?;
    let results: Vec<rollbox::daemon::api::ForkResult> =
        serde_json::from_value(answer["results"].clone()).map_err(CliError::Answer)?;
    let mut failed = 0usize;
    for result in &results {
        match (&result.sandbox, &result.error) {
            (Some(sandbox), _) if !conn.json => println!("{}", sandbox.id),
            (None, Some(error)) => {
                failed += 1;
                eprintln!("error: one fork failed: {error}");
            }
            _ => {}
        }
    }
    if failed > 0 {
        return Err(CliError::Usage(format!(
            "{failed} of {} forks failed (the others run)",
            results.len()
        )));
    }
    Ok(0)
}

/// `rollbox sandbox reset`.
fn reset(conn: &Conn, args: ResetArgs) -> Result<u8, CliError> {
    let ResetArgs { id, snapshot } = args;
    let body = match snapshot {
        Some(s) => json!({ "snapshot": s }),
        None => json!({}),
    };
    let response = conn.call("POST", &format!("/sandboxes/{id}/reset"), Some(body))?;
    if conn.json {
        print_json(&response);
    } else {
        let sandbox: Sandbox = parse(&response)?;
        println!("{}: reset ({})", sandbox.id, sandbox.state.as_str());
    }
    Ok(0)
}

fn print_sandboxes(sandboxes: &[Sandbox]) {
    println!(
        "{:<20} {:<9} {:<16} {:>5} {:>7} {:>9}  LABELS",
        "ID", "STATE", "TEMPLATE", "VCPUS", "MEM_MIB", "EXPIRES"
    );
    for s in sandboxes {
        let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let expires = if s.state.is_live() {
            seconds_left(s.expires_at_ms)
        } else {
            "-".to_string()
        };
        println!(
            "{:<20} {:<9} {:<16} {:>5} {:>7} {:>9}  {}",
            s.id,
            s.state.as_str(),
            s.template,
            s.vcpus,
            s.memory_mib,
            expires,
            labels.join(",")
        );
    }
}

fn print_sandbox(s: &Sandbox) {
    println!("id:       {}", s.id);
    println!("state:    {}", s.state.as_str());
    println!("template: {}", s.template);
    println!("vcpus:    {}   memory: {} MiB", s.vcpus, s.memory_mib);
    if s.state.is_live() {
        println!("expires:  in {}", seconds_left(s.expires_at_ms));
    }
    if let Some(pid) = s.pid {
        println!("pid:      {pid}");
    }
    println!("dir:      {}", s.dir.display());
    for gpu in &s.gpus {
        println!("gpu:      {gpu}");
    }
    if let Some(n) = &s.network {
        println!(
            "network:  {}/{} via {} (tap {}), egress {}",
            n.address, n.prefix_len, n.gateway, n.tap, n.egress
        );
        for p in &n.ports {
            println!("port:     {} at {}:{}", p.port, p.host_address, p.host_port);
        }
    }
    for v in &s.volumes {
        let ro = if v.readonly { " (read-only)" } else { "" };
        println!("volume:   {} at {}{ro}", v.name, v.mount_path);
    }
    for (k, v) in &s.labels {
        println!("label:    {k}={v}");
    }
    if let Some(reason) = &s.end_reason {
        println!("ended:    {reason}");
    }
}
