//! `rollbox serve`, `rollbox sandbox ...` and `rollbox template ...`: the daemon and the CLI
//! that talks to it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use rollbox::daemon::api::{Sandbox, SandboxList, Snapshot, Template};
use rollbox::daemon::client::{ClientError, Endpoint, Response, Streaming};
use rollbox::daemon::{Listen, ServeOptions};

/// A CLI command that failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("cannot read the API key from {path}: {source}")]
    KeyFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no API key: pass --api-key-file FILE or set ROLLBOX_API_KEY")]
    NoKey,
    #[error("{flag}: {source}")]
    Url {
        flag: &'static str,
        source: ClientError,
    },
    #[error("{0}\nhint: is `rollbox serve` running? start it with `rollbox serve --socket PATH --api-key-file FILE`, and point --socket or --url at it")]
    NotRunning(ClientError),
    #[error(transparent)]
    Request(ClientError),
    #[error("{message} ({status}){hint}")]
    Refused {
        status: u16,
        message: String,
        hint: &'static str,
    },
    #[error("the daemon's answer is not what this CLI expects: {0}")]
    Answer(serde_json::Error),
    #[error("--{flag} {pair:?}: expected KEY=VALUE")]
    KeyValue { flag: &'static str, pair: String },
    #[error("{path}: {source}")]
    Local {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the daemon's stream broke off: {0}")]
    Stream(String),
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Usage(String),
}

/// Where `rollbox serve` listens, and the CLI connects, without --socket or --url.
pub const DEFAULT_SOCKET: &str = "/run/rollbox/rollbox.sock";

#[derive(Args)]
pub struct ServeArgs {
    /// Serve on this Unix socket [default: $ROLLBOX_SOCKET, else /run/rollbox/rollbox.sock,
    /// unless --listen].
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    socket: Option<PathBuf>,
    /// Serve on this loopback TCP address instead, e.g. 127.0.0.1:7070.
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// A file holding the API key [default: $ROLLBOX_API_KEY].
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// State: the SQLite database and one directory per sandbox.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/rollbox")]
    state_dir: PathBuf,
    /// The rollbox-vmm binary [default: rollbox-vmm beside this executable].
    #[arg(long, value_name = "PATH")]
    vmm: Option<PathBuf>,
    /// TTL in seconds for creates that give no ttl_s (without it, ttl_s is required).
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=rollbox::daemon::api::MAX_TTL_S))]
    default_ttl: Option<u64>,
    /// Creates in flight at once; more get 429 with Retry-After.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    max_pending_creates: u64,
    /// Seconds a started rollbox-vmm may take to answer its API before the create, fork or
    /// reset fails (raise it where VMs start slowly, such as under nested emulation).
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    vmm_start_timeout: u64,
    /// Test only: send every sandbox's agent traffic (exec, files) to this hybrid-vsock Unix
    /// socket, e.g. a host `rollbox-agent --listen-unix PATH`, instead of the sandbox's own.
    #[arg(long, value_name = "PATH", hide = true)]
    test_agent_socket: Option<PathBuf>,
    /// The static guest agent installed into images built for templates [default:
    /// $ROLLBOX_AGENT, else the build output under target/agent-static].
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
    /// The image builder's cache [default: $XDG_CACHE_HOME/rollbox, else
    /// /var/cache/rollbox/images].
    #[arg(long, value_name = "DIR")]
    image_cache: Option<PathBuf>,
    /// Keep each sandbox's newest N snapshots; older ones are removed unless a live sandbox
    /// was restored or reset from them.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    snapshot_retention: Option<u32>,
    /// Where the cgroup hierarchies are mounted (for sandboxes' cpu_limit).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/sys/fs/cgroup",
        hide = true
    )]
    cgroup_fs: PathBuf,
    /// Run each VMM directly instead of inside `rollbox-jailer` (namespaces, chroot into the
    /// sandbox directory, an unprivileged uid, cgroups): only where the daemon is not root or
    /// for debugging.
    #[arg(long)]
    no_jailer: bool,
    /// The rollbox-jailer binary [default: rollbox-jailer beside this executable].
    #[arg(long, value_name = "PATH", conflicts_with = "no_jailer")]
    jailer: Option<PathBuf>,
    /// The unprivileged uid every jailed VMM runs as.
    #[arg(
        long,
        value_name = "UID",
        default_value_t = 64000,
        conflicts_with = "no_jailer"
    )]
    jail_uid: u32,
    /// The unprivileged gid every jailed VMM runs as.
    #[arg(
        long,
        value_name = "GID",
        default_value_t = 64000,
        conflicts_with = "no_jailer"
    )]
    jail_gid: u32,
    /// Also serve the E2B-compatible API (control plane and envd data plane) on this loopback
    /// address, e.g. 127.0.0.1:3000 (E2B_API_URL=http://127.0.0.1:3000).
    #[arg(long, value_name = "ADDR")]
    e2b_listen: Option<std::net::SocketAddr>,
    /// The `domain` E2B sandboxes report: data-plane traffic goes to {port}-{id}.DOMAIN unless
    /// the client sets E2B_SANDBOX_URL.
    #[arg(
        long,
        value_name = "DOMAIN",
        default_value = "e2b.localhost",
        requires = "e2b_listen"
    )]
    e2b_domain: String,
    /// Serve the E2B API over TLS with this PEM certificate chain (with --e2b-tls-key).
    #[arg(long, value_name = "FILE", requires_all = ["e2b_listen", "e2b_tls_key"])]
    e2b_tls_cert: Option<PathBuf>,
    /// The PEM private key of --e2b-tls-cert.
    #[arg(long, value_name = "FILE", requires = "e2b_tls_cert")]
    e2b_tls_key: Option<PathBuf>,
}

#[derive(Args)]
pub struct ConnArgs {
    /// The daemon's Unix socket [default: $ROLLBOX_URL or $ROLLBOX_SOCKET, else
    /// /run/rollbox/rollbox.sock].
    #[arg(long, value_name = "PATH", global = true, conflicts_with = "url")]
    socket: Option<PathBuf>,
    /// The daemon's loopback URL, e.g. http://127.0.0.1:7070.
    #[arg(long, value_name = "URL", global = true)]
    url: Option<String>,
    /// A file holding the API key [default: $ROLLBOX_API_KEY].
    #[arg(long, value_name = "FILE", global = true)]
    api_key_file: Option<PathBuf>,
    /// Print the daemon's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox from a template (a boot) or from a snapshot (a restore) and print it.
    Create {
        #[arg(required_unless_present = "snapshot", conflicts_with = "snapshot")]
        template: Option<String>,
        /// Restore this snapshot instead of booting a template.
        #[arg(long, value_name = "SNAPSHOT_ID")]
        snapshot: Option<String>,
        /// Hard TTL in seconds (required unless the daemon has --default-ttl).
        #[arg(long, value_name = "SECS")]
        ttl: Option<i64>,
        /// End it after this many seconds without an API call on it.
        #[arg(long, value_name = "SECS")]
        idle_ttl: Option<i64>,
        #[arg(long)]
        vcpus: Option<i64>,
        #[arg(long, value_name = "MIB")]
        memory_mib: Option<i64>,
        /// KEY=VALUE (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
        /// KEY=VALUE (repeatable).
        #[arg(long = "metadata", value_name = "KEY=VALUE")]
        metadata: Vec<String>,
        /// A retried create with the same key returns the first sandbox.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
        /// KEY=VALUE (repeatable): environment of every exec in the sandbox.
        #[arg(long = "env", value_name = "KEY=VALUE")]
        env: Vec<String>,
        /// Limit the sandbox to this many cores of CPU time (e.g. 0.5), by a cgroup.
        #[arg(long, value_name = "CORES")]
        cpu_limit: Option<f64>,
        /// A deterministic machine: no RDRAND/RDSEED, and every restore (this create, each
        /// reset) puts back the snapshot's guest time and generation exactly.
        #[arg(long)]
        deterministic: bool,
        /// Create this many of the spec in one batch (each succeeds or fails on its own).
        #[arg(long, value_name = "N")]
        count: Option<i64>,
    },
    /// List live sandboxes (or those in --state).
    Ls {
        /// KEY=VALUE (repeatable; all must match).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
        #[arg(long)]
        state: Option<String>,
        /// At most this many (one page).
        #[arg(long)]
        limit: Option<u32>,
        #[arg(long, value_name = "TOKEN")]
        page_token: Option<String>,
    },
    /// Show one sandbox.
    Get {
        id: String,
    },
    /// End sandboxes by id, or every live one with --label (ending one that is gone already
    /// succeeds).
    Rm {
        #[arg(required_unless_present = "labels", conflicts_with = "labels")]
        ids: Vec<String>,
        /// KEY=VALUE (repeatable; all must match): end every live sandbox with these labels.
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
    },
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
    Keepalive {
        id: String,
        #[arg(long, value_name = "SECS")]
        ttl: i64,
    },
    /// Run a command in the sandbox, streaming its output; exits with its status (128 +
    /// signal when a signal ended it, 124 on timeout).
    Exec {
        id: String,
        /// NAME=VALUE (repeatable).
        #[arg(long = "env", short = 'e', value_name = "NAME=VALUE")]
        env: Vec<String>,
        /// Working directory in the sandbox (absolute).
        #[arg(long, value_name = "DIR")]
        cwd: Option<String>,
        /// User name or uid in the sandbox.
        #[arg(long)]
        user: Option<String>,
        /// Kill the command's process group after this many seconds.
        #[arg(long, value_name = "SECS")]
        timeout: Option<f64>,
        /// The command and its arguments (after `--`).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        cmd: Vec<String>,
    },
    /// Copy a file or directory between the host and a sandbox, like `docker cp`: one side is
    /// ID:/absolute/path. A directory's contents land in DEST (created if missing); a file
    /// lands at DEST, or in it when DEST is a directory (host) or ends with / (sandbox).
    Cp {
        src: String,
        dest: String,
    },
    /// Take a memory snapshot (the sandbox keeps running unless --stop) and print its id.
    Snapshot {
        id: String,
        /// End the sandbox once the snapshot is taken.
        #[arg(long)]
        stop: bool,
        /// Remove the snapshot after this many seconds (unless a live sandbox came from it).
        #[arg(long, value_name = "SECS")]
        ttl: Option<i64>,
    },
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
    /// Fork into N new sandboxes (a fresh snapshot, restored N times); prints each new id
    /// or why it failed, and fails if any did.
    Fork {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: i64,
        /// TTL of the new sandboxes [default: what the parent has left].
        #[arg(long, value_name = "SECS")]
        ttl: Option<i64>,
        /// KEY=VALUE (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
    },
    /// Reset in place (same id, fresh state) to a snapshot [default: the one it came from;
    /// a sandbox that came from none boots afresh].
    Reset {
        id: String,
        #[arg(long, value_name = "SNAPSHOT_ID")]
        snapshot: Option<String>,
    },
    /// Serve a sandbox's TCP port on a host address: each connection accepted there is
    /// piped to the guest's 127.0.0.1:PORT through the agent. Prints the address, then runs
    /// until interrupted.
    PortForward {
        id: String,
        /// The guest port (1-65535).
        #[arg(value_parser = clap::value_parser!(u16).range(1..))]
        port: u16,
        /// Where to listen on the host (port 0: any free port).
        #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
    },
}

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Register a template from a kernel (and optional rootfs image and initrd).
    Add {
        name: String,
        #[arg(long, value_name = "PATH")]
        kernel: PathBuf,
        /// A raw/ext4 root disk image (each sandbox gets its own copy), e.g. from `rollbox
        /// image build`.
        #[arg(long, value_name = "PATH")]
        rootfs: Option<PathBuf>,
        #[arg(long, value_name = "PATH")]
        initrd: Option<PathBuf>,
        #[arg(long, default_value = "")]
        cmdline: String,
        #[arg(long)]
        vcpus: Option<i64>,
        #[arg(long, value_name = "MIB")]
        memory_mib: Option<i64>,
        /// Boot it once and keep a snapshot; creates then restore it (needs the agent).
        #[arg(long)]
        boot_snapshot: bool,
        #[command(flatten)]
        commands: StartCommands,
    },
    /// Build a template from an OCI/Docker image: the daemon builds the rootfs (with the guest
    /// agent as init) and, with --boot-snapshot, boots it once and snapshots it.
    Build {
        /// Image reference, e.g. 127.0.0.1:5000/busybox:latest (with an archive or layout,
        /// it picks one of several images).
        image: Option<String>,
        /// The template's name [default: the image's repository name].
        #[arg(long)]
        name: Option<String>,
        #[arg(long, value_name = "PATH")]
        kernel: PathBuf,
        /// Read the image from a `docker save` tarball.
        #[arg(long, value_name = "FILE", conflicts_with = "from_oci_layout")]
        from_docker_archive: Option<PathBuf>,
        /// Read the image from an OCI image layout directory.
        #[arg(long, value_name = "DIR")]
        from_oci_layout: Option<PathBuf>,
        /// Plain HTTP to the registry.
        #[arg(long)]
        insecure: bool,
        /// Root disk size in MiB [default: the content plus room to write].
        #[arg(long, value_name = "MIB")]
        size: Option<u64>,
        /// Kernel command line [default: serial console, the agent as init].
        #[arg(long)]
        cmdline: Option<String>,
        #[arg(long)]
        vcpus: Option<i64>,
        #[arg(long, value_name = "MIB")]
        memory_mib: Option<i64>,
        /// Boot it once and keep a snapshot; creates then restore it.
        #[arg(long)]
        boot_snapshot: bool,
        #[command(flatten)]
        commands: StartCommands,
    },
    Ls,
    Rm {
        name: String,
    },
}

/// What a template runs once its agent answers after a boot (before a boot snapshot).
#[derive(clap::Args)]
pub struct StartCommands {
    /// A shell command started in the background after boot, e.g. a server (its output goes
    /// to the guest's /var/log/rollbox-start.log).
    #[arg(long, value_name = "COMMAND")]
    start_cmd: Option<String>,
    /// A shell command run until it exits 0; creates return once it has (needs --start-cmd).
    #[arg(long, value_name = "COMMAND", requires = "start_cmd")]
    ready_cmd: Option<String>,
    /// How long --ready-cmd may take to first exit 0 [default: 300].
    #[arg(long, value_name = "SECONDS", requires = "ready_cmd")]
    ready_timeout: Option<i64>,
}

impl StartCommands {
    fn add_to(self, body: &mut serde_json::Value) {
        if let Some(c) = self.start_cmd {
            body["start_cmd"] = json!(c);
        }
        if let Some(c) = self.ready_cmd {
            body["ready_cmd"] = json!(c);
        }
        if let Some(s) = self.ready_timeout {
            body["ready_timeout_s"] = json!(s);
        }
    }
}

/// A template name from an image reference: its last path component without tag or digest.
fn name_from_image(image: &str) -> String {
    let last = image.rsplit('/').next().unwrap_or(image);
    let bare = last.split(['@', ':']).next().unwrap_or(last);
    bare.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `$ROLLBOX_SOCKET`, else [`DEFAULT_SOCKET`].
fn default_socket() -> PathBuf {
    PathBuf::from(env("ROLLBOX_SOCKET").unwrap_or_else(|| DEFAULT_SOCKET.to_string()))
}

fn read_key(file: Option<&PathBuf>) -> Result<String, CliError> {
    match file {
        Some(path) => std::fs::read_to_string(path)
            .map(|k| k.trim().to_string())
            .map_err(|source| CliError::KeyFile {
                path: path.clone(),
                source,
            }),
        None => env("ROLLBOX_API_KEY")
            .map(|k| k.trim().to_string())
            .ok_or(CliError::NoKey),
    }
}

fn absolute(path: PathBuf) -> PathBuf {
    std::path::absolute(&path).unwrap_or(path)
}

/// `rollbox serve`.
pub fn serve(args: ServeArgs) -> ExitCode {
    let api_key = match read_key(args.api_key_file.as_ref()) {
        Ok(key) => key,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let vmm = args.vmm.unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join("rollbox-vmm")))
            .unwrap_or_else(|| PathBuf::from("rollbox-vmm"))
    });
    let jailer = (!args.no_jailer).then(|| rollbox::daemon::JailerOptions {
        binary: absolute(args.jailer.unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(|d| d.join("rollbox-jailer")))
                .unwrap_or_else(|| PathBuf::from("rollbox-jailer"))
        })),
        uid: args.jail_uid,
        gid: args.jail_gid,
    });
    let listen = match (args.listen, args.socket) {
        (Some(addr), _) => Listen::Tcp(addr),
        (None, Some(path)) => Listen::Unix(path),
        (None, None) => Listen::Unix(default_socket()),
    };
    if let Listen::Unix(path) = &listen {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(parent);
        }
    }
    let options = ServeOptions {
        listen,
        api_key,
        state_dir: args.state_dir,
        vmm: absolute(vmm),
        default_ttl_s: args.default_ttl,
        max_pending_creates: usize::try_from(args.max_pending_creates).unwrap_or(64),
        reap_interval: Duration::from_millis(250),
        ready_timeout: Duration::from_secs(args.vmm_start_timeout),
        test_agent_socket: args.test_agent_socket,
        agent: Some(absolute(crate::agent_path(args.agent))),
        image_cache: args
            .image_cache
            .unwrap_or_else(rollbox::images::default_cache_dir),
        cgroup_fs: args.cgroup_fs,
        jailer,
        snapshot_retention: args.snapshot_retention,
        e2b: args
            .e2b_listen
            .map(|listen| rollbox::daemon::e2b::E2bOptions {
                listen,
                domain: args.e2b_domain,
                tls: args
                    .e2b_tls_cert
                    .zip(args.e2b_tls_key)
                    .map(|(cert, key)| rollbox::daemon::e2b::TlsFiles { cert, key }),
            }),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let shutdown = async {
            let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
            match term {
                Ok(mut term) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            log::info!("stopping; sandboxes keep running and the next start re-attaches to them");
        };
        rollbox::daemon::serve(options, shutdown).await
    });
    // Blocking tasks (a VMM start in progress) do not hold the exit up.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

struct Conn {
    endpoint: Endpoint,
    key: String,
    json: bool,
}

impl Conn {
    fn new(args: &ConnArgs) -> Result<Conn, CliError> {
        let endpoint = match (&args.url, &args.socket) {
            (Some(url), _) => Endpoint::from_url(url).map_err(|source| CliError::Url {
                flag: "--url",
                source,
            })?,
            (None, Some(path)) => Endpoint::Unix(path.clone()),
            (None, None) => match env("ROLLBOX_URL") {
                Some(url) => Endpoint::from_url(&url).map_err(|source| CliError::Url {
                    flag: "ROLLBOX_URL",
                    source,
                })?,
                None => Endpoint::Unix(default_socket()),
            },
        };
        Ok(Conn {
            endpoint,
            key: read_key(args.api_key_file.as_ref())?,
            json: args.json,
        })
    }

    /// One request; a non-2xx answer becomes an error with a hint.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Response, CliError> {
        self.call_within(method, path, body, Duration::from_secs(120))
    }

    /// [`Conn::call`] for long work (a template build), waiting up to `timeout`.
    fn call_within(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<Response, CliError> {
        let auth = format!("Bearer {}", self.key);
        let body = body.map(|b| b.to_string());
        let response = self
            .endpoint
            .request(
                method,
                path,
                &[("Authorization", &auth)],
                body.as_deref().map(str::as_bytes),
                timeout,
            )
            .map_err(transport_error)?;
        if (200..300).contains(&response.status) {
            return Ok(response);
        }
        Err(refused(response.status, response.error_message()))
    }
}

/// A request that did not get an answer: the daemon not listening, or the transport failing.
fn transport_error(e: ClientError) -> CliError {
    if e.is_connect() {
        CliError::NotRunning(e)
    } else {
        CliError::Request(e)
    }
}

/// A non-2xx answer, with what to do next where the status says it.
fn refused(status: u16, message: String) -> CliError {
    let hint = match status {
        401 => "\nhint: the key must match the daemon's: check --api-key-file or ROLLBOX_API_KEY",
        429 => {
            "\nhint: the daemon has too many creates in flight; retry shortly (it said Retry-After)"
        }
        _ => "",
    };
    CliError::Refused {
        status,
        message,
        hint,
    }
}

impl Conn {
    /// One request whose answer is read as it comes; a non-2xx answer becomes an error.
    fn open(
        &self,
        method: &str,
        path: &str,
        body: Option<(&mut dyn std::io::Read, u64)>,
        content_type: &str,
    ) -> Result<Streaming, CliError> {
        let auth = format!("Bearer {}", self.key);
        let response = self
            .endpoint
            .open(
                method,
                path,
                &[("Authorization", &auth), ("Content-Type", content_type)],
                body,
                Duration::from_secs(3600),
            )
            .map_err(transport_error)?;
        if (200..300).contains(&response.status) {
            return Ok(response);
        }
        let response = response.into_response().map_err(CliError::Request)?;
        Err(refused(response.status, response.error_message()))
    }
}

/// `rollbox sandbox exec`: streams the command's output; returns its exit status.
fn exec(conn: &Conn, id: &str, body: Value) -> Result<u8, CliError> {
    use rollbox::daemon::api::{decode_bytes, ExecLine, ExecRecord};
    use std::io::{BufRead, Write};
    let text = body.to_string();
    let mut source = text.as_bytes();
    let len = source.len() as u64;
    let response = conn.open(
        "POST",
        &format!("/sandboxes/{id}/exec?stream=true"),
        Some((&mut source, len)),
        "application/json",
    )?;
    let mut lines = std::io::BufReader::new(response);
    let mut line = String::new();
    loop {
        line.clear();
        let n = lines
            .read_line(&mut line)
            .map_err(|e| CliError::Stream(e.to_string()))?;
        if n == 0 {
            return Err(CliError::Stream("it ended before the exit line".into()));
        }
        let parsed: ExecLine = serde_json::from_str(&line).map_err(CliError::Answer)?;
        match parsed.record {
            ExecRecord::Started { .. } => {}
            ExecRecord::Stdout { data, encoding } => {
                let mut out = std::io::stdout().lock();
                let bytes = decode_bytes(&data, encoding).unwrap_or_default();
                let _ = out.write_all(&bytes).and_then(|()| out.flush());
            }
            ExecRecord::Stderr { data, encoding } => {
                let mut err = std::io::stderr().lock();
                let bytes = decode_bytes(&data, encoding).unwrap_or_default();
                let _ = err.write_all(&bytes).and_then(|()| err.flush());
            }
            ExecRecord::Exit(exit) => {
                if exit.oom {
                    eprintln!("rollbox: the OOM killer killed the command");
                }
                if exit.truncated {
                    eprintln!("rollbox: output beyond the cap was dropped");
                }
                return Ok(if exit.timed_out {
                    eprintln!("rollbox: timed out; the process group was killed");
                    124
                } else if let Some(signal) = exit.signal {
                    128u8.saturating_add(u8::try_from(signal).unwrap_or(127))
                } else {
                    exit.exit_code
                        .and_then(|c| u8::try_from(c & 0xff).ok())
                        .unwrap_or(1)
                });
            }
            ExecRecord::Error { message } => return Err(CliError::Stream(message)),
        }
    }
}

/// `ID:/path` → (id, path); anything else is a host path.
fn remote(spec: &str) -> Option<(&str, &str)> {
    let (id, path) = spec.split_once(':')?;
    (id.starts_with("sb-") && path.starts_with('/')).then_some((id, path))
}

fn base_name(path: &str) -> Result<&str, CliError> {
    std::path::Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| CliError::Usage(format!("{path:?} names no file")))
}

/// `rollbox sandbox cp`.
fn copy(conn: &Conn, src: &str, dest: &str) -> Result<(), CliError> {
    let local = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| CliError::Local { path, source }
    };
    match (remote(src), remote(dest)) {
        (None, Some((id, to))) => {
            let from = std::path::Path::new(src);
            let meta = std::fs::metadata(from).map_err(local(from))?;
            if meta.is_dir() {
                let mut archive = tar::Builder::new(Vec::new());
                archive.follow_symlinks(false);
                archive.append_dir_all(".", from).map_err(local(from))?;
                let data = archive.into_inner().map_err(local(from))?;
                let len = data.len() as u64;
                conn.open(
                    "PUT",
                    &format!("/sandboxes/{id}/tar?path={}", encode(to)),
                    Some((&mut data.as_slice(), len)),
                    "application/x-tar",
                )?
                .into_response()
                .map_err(CliError::Request)?;
            } else {
                let to = if to.ends_with('/') {
                    format!("{to}{}", base_name(src)?)
                } else {
                    to.to_string()
                };
                let mut file = std::fs::File::open(from).map_err(local(from))?;
                conn.open(
                    "PUT",
                    &format!("/sandboxes/{id}/files?path={}&parents=true", encode(&to)),
                    Some((&mut file, meta.len())),
                    "application/octet-stream",
                )?
                .into_response()
                .map_err(CliError::Request)?;
            }
            Ok(())
        }
        (Some((id, from)), None) => {
            let info = conn.call(
                "GET",
                &format!("/sandboxes/{id}/files/stat?path={}", encode(from)),
                None,
            )?;
            let info: rollbox::daemon::api::FileInfo = parse(&info)?;
            let to = std::path::Path::new(dest);
            let broken = |e: std::io::Error| CliError::Stream(e.to_string());
            if info.kind == rollbox_agent_protocol::messages::FileKind::Dir {
                std::fs::create_dir_all(to).map_err(local(to))?;
                let response = conn.open(
                    "GET",
                    &format!("/sandboxes/{id}/tar?path={}", encode(from)),
                    None,
                    "application/json",
                )?;
                tar::Archive::new(response).unpack(to).map_err(local(to))?;
            } else {
                let target = if to.is_dir() {
                    to.join(base_name(from)?)
                } else {
                    to.to_path_buf()
                };
                let mut response = conn.open(
                    "GET",
                    &format!("/sandboxes/{id}/files?path={}", encode(from)),
                    None,
                    "application/json",
                )?;
                let mut file = std::fs::File::create(&target).map_err(local(&target))?;
                std::io::copy(&mut response, &mut file).map_err(broken)?;
            }
            Ok(())
        }
        _ => Err(CliError::Usage(format!(
            "cp {src} {dest}: exactly one side must be ID:/absolute/path in a sandbox"
        ))),
    }
}

fn key_values(
    pairs: &[String],
    flag: &'static str,
) -> Result<serde_json::Map<String, Value>, CliError> {
    pairs
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
                .ok_or_else(|| CliError::KeyValue {
                    flag,
                    pair: pair.clone(),
                })
        })
        .collect()
}

/// Percent-encodes a query value.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn parse<T: serde::de::DeserializeOwned>(response: &Response) -> Result<T, CliError> {
    serde_json::from_slice(&response.body).map_err(CliError::Answer)
}

fn print_json(response: &Response) {
    println!("{}", String::from_utf8_lossy(&response.body).trim());
}

fn seconds_left(at_ms: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let left = (u128::from(at_ms).saturating_sub(now)) / 1000;
    format!("{left}s")
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
    for (k, v) in &s.labels {
        println!("label:    {k}={v}");
    }
    if let Some(reason) = &s.end_reason {
        println!("ended:    {reason}");
    }
}

fn run_sandbox(conn: &Conn, command: SandboxCommand) -> Result<u8, CliError> {
    match command {
        SandboxCommand::Create {
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
        } => {
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
        }
        SandboxCommand::Ls {
            labels,
            state,
            limit,
            page_token,
        } => {
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
        }
        SandboxCommand::Get { id } => {
            let response = conn.call("GET", &format!("/sandboxes/{id}"), None)?;
            if conn.json {
                print_json(&response);
            } else {
                print_sandbox(&parse(&response)?);
            }
        }
        SandboxCommand::Rm { labels, .. } if !labels.is_empty() => {
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
        }
        SandboxCommand::Rm { ids, .. } => {
            for id in ids {
                conn.call("DELETE", &format!("/sandboxes/{id}"), None)?;
                if !conn.json {
                    println!("{id}: removed");
                }
            }
        }
        SandboxCommand::Usage { id } => {
            let response = conn.call("GET", &format!("/sandboxes/{id}/usage"), None)?;
            if conn.json {
                print_json(&response);
            } else {
                let u: rollbox::daemon::usage::Usage = parse(&response)?;
                println!("sandbox:            {} ({})", u.sandbox, u.state.as_str());
                println!("running_s:          {}", u.running_s);
                println!("vcpu_seconds:       {} ({} vCPUs)", u.vcpu_seconds, u.vcpus);
                println!(
                    "memory_mib_seconds: {} ({} MiB)",
                    u.memory_mib_seconds, u.memory_mib
                );
                println!("cpu_seconds:        {:.3} (measured)", u.cpu_seconds);
            }
        }
        SandboxCommand::Pause { id } => pause_resume(conn, &id, "pause")?,
        SandboxCommand::Resume { id } => pause_resume(conn, &id, "resume")?,
        SandboxCommand::Keepalive { id, ttl } => {
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
        }
        SandboxCommand::Exec {
            id,
            env,
            cwd,
            user,
            timeout,
            cmd,
        } => {
            let mut body = json!({ "cmd": cmd, "env": Value::Object(key_values(&env, "env")?) });
            if let Some(cwd) = cwd {
                body["cwd"] = json!(cwd);
            }
            if let Some(user) = user {
                body["user"] = json!(user);
            }
            if let Some(timeout) = timeout {
                body["timeout_s"] = json!(timeout);
            }
            return exec(conn, &id, body);
        }
        SandboxCommand::Cp { src, dest } => copy(conn, &src, &dest)?,
        SandboxCommand::Snapshot { id, stop, ttl } => {
            let mut body = json!({ "stop": stop });
            if let Some(ttl) = ttl {
                body["ttl_s"] = json!(ttl);
            }
            let response = conn.call("POST", &format!("/sandboxes/{id}/snapshots"), Some(body))?;
            if conn.json {
                print_json(&response);
            } else {
                let snapshot: Snapshot = parse(&response)?;
                println!("{}", snapshot.id);
            }
        }
        SandboxCommand::Snapshots { sandbox } => {
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
        }
        SandboxCommand::SnapshotRm { ids } => {
            for id in ids {
                conn.call("DELETE", &format!("/snapshots/{id}"), None)?;
                if !conn.json {
                    println!("{id} deleted");
                }
            }
        }
        SandboxCommand::Fork {
            id,
            count,
            ttl,
            labels,
        } => {
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
        }
        SandboxCommand::Reset { id, snapshot } => {
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
        }
        SandboxCommand::PortForward { id, port, listen } => port_forward(conn, &id, port, listen)?,
    }
    Ok(0)
}

/// `rollbox sandbox port-forward`: one thread per accepted connection, each with its own
/// upgraded daemon connection (`GET /sandboxes/{id}/ports/{port}`).
fn port_forward(
    conn: &Conn,
    id: &str,
    port: u16,
    listen: std::net::SocketAddr,
) -> Result<(), CliError> {
    // A sandbox that is not there fails now, not at the first connection.
    conn.call("GET", &format!("/sandboxes/{id}"), None)?;
    let listener = std::net::TcpListener::bind(listen).map_err(|source| CliError::Listen {
        address: listen,
        source,
    })?;
    let local = listener.local_addr().map_err(|source| CliError::Listen {
        address: listen,
        source,
    })?;
    println!("forwarding {local} -> sandbox {id} port {port}");
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let path = format!("/sandboxes/{id}/ports/{port}");
    let auth = format!("Bearer {}", conn.key);
    loop {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("rollbox sandbox port-forward: accept on {local}: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let endpoint = conn.endpoint.clone();
        let (path, auth) = (path.clone(), auth.clone());
        std::thread::spawn(move || {
            let upgraded = endpoint.upgrade(
                &path,
                &[("Authorization", &auth)],
                "tcp",
                Duration::from_secs(30),
            );
            match upgraded {
                Ok(Ok(guest)) => splice(client, guest),
                Ok(Err(refusal)) => eprintln!(
                    "rollbox sandbox port-forward: {}: {} ({})",
                    path,
                    refusal.error_message(),
                    refusal.status
                ),
                Err(e) => eprintln!("rollbox sandbox port-forward: {path}: {e}"),
            }
        });
    }
}

/// Copies both ways until both directions ended, passing each end of input on.
fn splice(client: std::net::TcpStream, guest: rollbox::daemon::client::Upgraded) {
    let (Ok(mut client_out), Ok(mut guest_in)) = (client.try_clone(), guest.try_clone()) else {
        eprintln!("rollbox sandbox port-forward: cannot duplicate a connection's descriptor");
        return;
    };
    let upstream = std::thread::spawn(move || {
        let mut client = client;
        let _ = std::io::copy(&mut client, &mut guest_in);
        let _ = guest_in.shutdown_write();
    });
    let mut guest = guest;
    let _ = std::io::copy(&mut guest, &mut client_out);
    let _ = client_out.shutdown(std::net::Shutdown::Write);
    let _ = upstream.join();
}

fn pause_resume(conn: &Conn, id: &str, verb: &str) -> Result<(), CliError> {
    let response = conn.call("POST", &format!("/sandboxes/{id}/{verb}"), None)?;
    if conn.json {
        print_json(&response);
    } else {
        let sandbox: Sandbox = parse(&response)?;
        println!("{}: {}", sandbox.id, sandbox.state.as_str());
    }
    Ok(())
}

/// How long the CLI waits for a template build (an image pull, a rootfs, a boot).
const TEMPLATE_BUILD_TIMEOUT: Duration = Duration::from_secs(1800);

fn print_template(conn: &Conn, response: &Response, done: &str) -> Result<(), CliError> {
    if conn.json {
        print_json(response);
        return Ok(());
    }
    let template: Template = parse(response)?;
    println!("template {} {done}", template.name);
    if let Some(image) = &template.image {
        println!("image: {image}");
    }
    if let Some(snapshot) = &template.boot_snapshot {
        println!("boot snapshot: {snapshot}");
    }
    if let Some(command) = &template.start_cmd {
        println!("start command: {command}");
    }
    Ok(())
}

fn run_template(conn: &Conn, command: TemplateCommand) -> Result<(), CliError> {
    match command {
        TemplateCommand::Add {
            name,
            kernel,
            rootfs,
            initrd,
            cmdline,
            vcpus,
            memory_mib,
            boot_snapshot,
            commands,
        } => {
            let mut body = json!({
                "name": name,
                "kernel": absolute(kernel),
                "cmdline": cmdline,
                "boot_snapshot": boot_snapshot,
            });
            commands.add_to(&mut body);
            if let Some(p) = rootfs {
                body["rootfs"] = json!(absolute(p));
            }
            if let Some(p) = initrd {
                body["initrd"] = json!(absolute(p));
            }
            if let Some(v) = vcpus {
                body["vcpus"] = json!(v);
            }
            if let Some(v) = memory_mib {
                body["memory_mib"] = json!(v);
            }
            let response =
                conn.call_within("POST", "/templates", Some(body), TEMPLATE_BUILD_TIMEOUT)?;
            print_template(conn, &response, "added")?;
        }
        TemplateCommand::Build {
            image,
            name,
            kernel,
            from_docker_archive,
            from_oci_layout,
            insecure,
            size,
            cmdline,
            vcpus,
            memory_mib,
            boot_snapshot,
            commands,
        } => {
            let name = match (name, &image, &from_docker_archive) {
                (Some(name), _, _) => name,
                (None, Some(image), _) => name_from_image(image),
                (None, None, Some(archive)) => name_from_image(
                    &archive
                        .file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                ),
                (None, None, None) => {
                    return Err(CliError::Usage(
                        "give an image reference, --from-docker-archive or --name".into(),
                    ))
                }
            };
            let mut source = json!({ "insecure": insecure });
            if let Some(image) = image {
                source["reference"] = json!(image);
            }
            if let Some(p) = from_docker_archive {
                source["docker_archive"] = json!(absolute(p));
            }
            if let Some(p) = from_oci_layout {
                source["oci_layout"] = json!(absolute(p));
            }
            if let Some(mib) = size {
                source["size_mib"] = json!(mib);
            }
            let mut body = json!({
                "name": name,
                "kernel": absolute(kernel),
                "image": source,
                "boot_snapshot": boot_snapshot,
            });
            commands.add_to(&mut body);
            if let Some(c) = cmdline {
                body["cmdline"] = json!(c);
            }
            if let Some(v) = vcpus {
                body["vcpus"] = json!(v);
            }
            if let Some(v) = memory_mib {
                body["memory_mib"] = json!(v);
            }
            let what = if boot_snapshot {
                format!("building template {name} (image, then a boot and a snapshot)")
            } else {
                format!("building template {name}")
            };
            let spinner = rollbox::images::progress::Progress::for_stderr().spinner(what);
            let response =
                conn.call_within("POST", "/templates", Some(body), TEMPLATE_BUILD_TIMEOUT);
            spinner.finish_and_clear();
            print_template(conn, &response?, "built")?;
        }
        TemplateCommand::Ls => {
            let response = conn.call("GET", "/templates", None)?;
            if conn.json {
                print_json(&response);
            } else {
                #[derive(serde::Deserialize)]
                struct List {
                    templates: Vec<Template>,
                }
                let list: List = parse(&response)?;
                println!(
                    "{:<20} {:>5} {:>7}  {:<40}  ROOTFS",
                    "NAME", "VCPUS", "MEM_MIB", "KERNEL"
                );
                for t in list.templates {
                    println!(
                        "{:<20} {:>5} {:>7}  {:<40}  {}",
                        t.name,
                        t.vcpus,
                        t.memory_mib,
                        t.kernel.display(),
                        t.rootfs
                            .as_ref()
                            .map(|p| p.display().to_string())
                            .unwrap_or_else(|| "-".into())
                    );
                }
            }
        }
        TemplateCommand::Rm { name } => {
            conn.call("DELETE", &format!("/templates/{name}"), None)?;
            if !conn.json {
                println!("template {name} removed");
            }
        }
    }
    Ok(())
}

fn finish(result: Result<(), CliError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `rollbox sandbox ...`.
pub fn sandbox(conn: ConnArgs, command: SandboxCommand) -> ExitCode {
    match Conn::new(&conn).and_then(|conn| run_sandbox(&conn, command)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => finish(Err(e)),
    }
}

/// `rollbox template ...`.
pub fn template(conn: ConnArgs, command: TemplateCommand) -> ExitCode {
    finish(Conn::new(&conn).and_then(|conn| run_template(&conn, command)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_flags_and_query_encoding() {
        let map = key_values(&["a=1".into(), "b=x=y".into()], "label").expect("parse");
        assert_eq!(map["a"], "1");
        assert_eq!(map["b"], "x=y");
        let error = key_values(&["novalue".into()], "label")
            .expect_err("no =")
            .to_string();
        assert!(
            error.contains("--label") && error.contains("KEY=VALUE"),
            "{error}"
        );
        assert_eq!(encode("run=a b/c"), "run%3Da%20b%2Fc");
    }
}
