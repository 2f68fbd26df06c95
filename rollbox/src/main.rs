//! `rollbox`: the user-facing command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use rollbox::images::{self, progress::Progress, BuildOptions, SourceSpec};

mod daemon_cli;
mod logger;

/// Where `cargo xtask` (or the agent's build script) leaves the static guest agent.
const DEFAULT_AGENT: &str = "target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent";

#[derive(Parser)]
#[command(name = "rollbox", version, about = "Sandboxes for RL rollouts")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Images: turn Docker/OCI images into sandbox root filesystems.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Run a command in a sandbox through its agent (over the sandbox's vsock Unix socket).
    Exec(ExecArgs),
    /// Per-sandbox host networking: tap, /30 lease, NAT and egress policy (needs root).
    #[command(subcommand)]
    Net(NetCommand),
    /// The daemon: an HTTP/JSON API (bearer key) for sandboxes and templates.
    Serve(daemon_cli::ServeArgs),
    /// Sandboxes, through the daemon.
    Sandbox {
        #[command(flatten)]
        conn: daemon_cli::ConnArgs,
        #[command(subcommand)]
        command: daemon_cli::SandboxCommand,
    },
    /// Templates (what sandboxes boot), through the daemon.
    Template {
        #[command(flatten)]
        conn: daemon_cli::ConnArgs,
        #[command(subcommand)]
        command: daemon_cli::TemplateCommand,
    },
}

#[derive(Subcommand)]
enum NetCommand {
    /// Create sandbox NAME's tap, lease, NAT and egress rules; print them as JSON.
    Up(NetUpArgs),
    /// Remove everything `up` made for sandbox NAME (nothing to remove is not an error).
    Down {
        name: String,
        #[command(flatten)]
        state: NetStateArg,
    },
    /// Print the leases as a JSON array.
    List {
        #[command(flatten)]
        state: NetStateArg,
    },
    /// Remove what sandboxes whose state is gone left behind (unfinished leases, and taps and
    /// rules in the pool that no lease accounts for).
    Gc {
        /// Only interfaces and rules of this pool are considered.
        #[arg(long, value_name = "CIDR", default_value = rollbox::net::DEFAULT_POOL)]
        pool: String,
        #[command(flatten)]
        state: NetStateArg,
    },
}

#[derive(Args)]
struct NetStateArg {
    /// Lease directory [default: $ROLLBOX_NET_STATE, else /run/rollbox/net].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
}

impl NetStateArg {
    fn dir(self) -> rollbox::net::StateDir {
        rollbox::net::StateDir::new(
            self.state_dir
                .unwrap_or_else(rollbox::net::default_state_dir),
        )
    }
}

#[derive(Args)]
struct NetUpArgs {
    /// The sandbox's name: 1-64 bytes of A-Z a-z 0-9 _ . - (starting with a letter or digit).
    name: String,
    /// The pool each sandbox's /30 comes from.
    #[arg(long, value_name = "CIDR", default_value = rollbox::net::DEFAULT_POOL)]
    pool: String,
    /// none, all, or an allow-list: CIDR[:PORT[-PORT]],... (TCP and UDP to those ports).
    #[arg(long, value_name = "POLICY", default_value = "none")]
    egress: String,
    /// A DNS server the guest may reach (port 53), also passed in the kernel's ip= argument.
    #[arg(long, value_name = "IP")]
    dns: Option<String>,
    /// Forward host TCP port HOSTPORT to the guest's GUESTPORT (repeatable).
    #[arg(long, value_name = "HOSTPORT:GUESTPORT", num_args = 1..)]
    expose: Vec<String>,
    /// Tests only: instead of a tap, a veth pair whose peer, configured as the guest, sits in
    /// this network namespace (the rules are the same).
    #[arg(long, value_name = "NETNS", hide = true)]
    veth_netns: Option<String>,
    #[command(flatten)]
    state: NetStateArg,
}

#[derive(Args)]
struct ExecArgs {
    /// The sandbox's vsock Unix socket (rollbox-vmm --vsock-uds, or the TCG harness's).
    #[arg(long, value_name = "PATH")]
    vsock_uds: PathBuf,
    /// The agent's vsock port.
    #[arg(long, default_value_t = 1024)]
    port: u32,
    /// Working directory in the guest.
    #[arg(long)]
    cwd: Option<String>,
    /// Environment variable, NAME=VALUE (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// User name or uid in the guest.
    #[arg(long)]
    user: Option<String>,
    /// Hard timeout in seconds (SIGTERM, then SIGKILL to the process group).
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Keep retrying the connection this long while the guest boots.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    wait: f64,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
    argv: Vec<String>,
}

#[derive(Subcommand)]
enum ImageCommand {
    /// Build an ext4 rootfs from an image and print its path and size.
    Build(BuildArgs),
}

#[derive(Args)]
struct BuildArgs {
    /// Image reference, e.g. 127.0.0.1:5000/busybox:latest. With --from-docker-archive or
    /// --from-oci-layout it picks one image when the file holds several.
    reference: Option<String>,
    /// Read the image from a `docker save` tarball instead of a registry.
    #[arg(long, value_name = "FILE", conflicts_with = "from_oci_layout")]
    from_docker_archive: Option<PathBuf>,
    /// Read the image from an OCI image layout directory instead of a registry.
    #[arg(long, value_name = "DIR")]
    from_oci_layout: Option<PathBuf>,
    /// Also copy the image to FILE (its metadata goes to FILE with extension .image.json).
    #[arg(long, short, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Size of the ext4 image in MiB (default: the content plus 64 MiB free).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    size: Option<u64>,
    /// The static guest agent to install as init [default: $ROLLBOX_AGENT, else
    /// target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent].
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
    /// Cache directory [default: $XDG_CACHE_HOME/rollbox, else /var/cache/rollbox/images].
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Use plain HTTP for this registry (loopback registries always use it).
    #[arg(long)]
    insecure: bool,
}

/// `--agent`, else `$ROLLBOX_AGENT`, else the build output: relative to the current
/// directory, or to the workspace that holds this binary (target/<profile>/rollbox).
pub(crate) fn agent_path(flag: Option<PathBuf>) -> PathBuf {
    if let Some(path) = flag {
        return path;
    }
    if let Some(path) = std::env::var_os("ROLLBOX_AGENT").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let relative = Path::new(DEFAULT_AGENT);
    if relative.exists() {
        return relative.to_path_buf();
    }
    let from_workspace = std::env::current_exe().ok().and_then(|exe| {
        exe.parent()?
            .parent()?
            .parent()
            .map(|root| root.join(DEFAULT_AGENT))
    });
    match from_workspace {
        Some(path) if path.exists() => path,
        _ => relative.to_path_buf(),
    }
}

fn build(args: BuildArgs) -> Result<(), images::ImageError> {
    let source = match (args.from_docker_archive, args.from_oci_layout) {
        (Some(file), _) => SourceSpec::DockerArchive(file),
        (None, Some(dir)) => SourceSpec::OciLayout(dir),
        (None, None) => SourceSpec::Registry {
            insecure: args.insecure,
        },
    };
    let options = BuildOptions {
        reference: args.reference,
        source,
        agent: agent_path(args.agent),
        cache_dir: args.cache_dir.unwrap_or_else(images::default_cache_dir),
        output: args.output,
        size_mib: args.size,
        progress: Progress::for_stderr(),
    };
    let started = std::time::Instant::now();
    let built = images::build(&options)?;
    if let Some(interpreter) = &built.agent_interpreter {
        eprintln!(
            "warning: agent {} is dynamically linked ({interpreter}); as the guest's init it needs a static build",
            options.agent.display()
        );
    }
    eprintln!(
        "{} {} in {:.2}s",
        if built.cached { "cached" } else { "built" },
        built.image_digest,
        started.elapsed().as_secs_f64()
    );
    println!("rootfs: {}", built.rootfs.display());
    println!(
        "size: {} bytes ({} MiB)",
        built.size_bytes,
        built.size_bytes.div_ceil(1024 * 1024)
    );
    println!("metadata: {}", built.metadata.display());
    println!("digest: {}", built.image_digest);
    Ok(())
}

fn exec(args: ExecArgs) -> ExitCode {
    let options = rollbox::exec::ExecOptions {
        uds: args.vsock_uds,
        port: args.port,
        argv: args.argv,
        cwd: args.cwd,
        env: args.env,
        user: args.user,
        timeout: args.timeout.map(std::time::Duration::from_secs_f64),
        wait: std::time::Duration::from_secs_f64(args.wait.max(0.0)),
    };
    match rollbox::exec::run(&options) {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn net(command: NetCommand) -> Result<(), rollbox::net::NetError> {
    use rollbox::net;
    let json = |value: serde_json::Value| println!("{value}");
    match command {
        NetCommand::Up(args) => {
            let options = net::UpOptions {
                name: args.name,
                pool: args.pool,
                egress: args.egress,
                dns: args.dns,
                expose: args.expose,
                link: match args.veth_netns {
                    Some(netns) => net::LinkKind::Veth { netns },
                    None => net::LinkKind::Tap,
                },
            };
            let info = net::up(&args.state.dir(), &options)?;
            json(serde_json::json!(info));
        }
        NetCommand::Down { name, state } => {
            if !net::down(&state.dir(), &name)? {
                eprintln!("{name}: no network to remove");
            }
        }
        NetCommand::List { state } => json(serde_json::json!(net::list(&state.dir())?)),
        NetCommand::Gc { pool, state } => {
            json(serde_json::json!({ "removed": net::gc(&state.dir(), &pool)? }))
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Image(ImageCommand::Build(args)) => build(args),
        Command::Exec(args) => return exec(args),
        Command::Serve(args) => {
            logger::init("rollbox serve");
            return daemon_cli::serve(args);
        }
        Command::Sandbox { conn, command } => return daemon_cli::sandbox(conn, command),
        Command::Template { conn, command } => return daemon_cli::template(conn, command),
        Command::Net(command) => {
            return match net(command) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("error: {error}");
                    ExitCode::FAILURE
                }
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            if error.is_no_space() {
                eprintln!("hint: the disk holding the cache or output is full; free space or pass --cache-dir on a larger disk");
            }
            ExitCode::FAILURE
        }
    }
}
