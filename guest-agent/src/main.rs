//! rollbox-agent: the in-guest agent. Listens on vsock (guest) or on a Unix
//! socket with the hybrid vsock preamble (host mode, for tests), and serves
//! the rollbox agent protocol.

mod agent;
mod cgroup;
mod docker;
mod errors;
mod exec;
mod files;
mod fixups;
mod generation;
mod health;
mod init;
mod layers;
mod network;
mod pty;
mod reaper;
mod server;
mod tcp;
mod users;
mod volumes;
mod vsock;
mod watch;
mod xattrs;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::Parser;
use rollbox_agent_protocol::{hybrid, DEFAULT_PORT};

#[derive(Debug, Parser)]
#[command(name = "rollbox-agent", version, about = "rollbox in-guest agent")]
struct Args {
    /// Listen on this AF_VSOCK port (the default when no --listen-unix is given).
    #[arg(long, value_name = "PORT")]
    listen_vsock: Option<u32>,
    /// Listen on a Unix socket that speaks Firecracker's hybrid vsock preamble
    /// ("CONNECT <port>\n" / "OK <port>\n"), e.g. to run on the host for tests.
    #[arg(long, value_name = "PATH")]
    listen_unix: Option<PathBuf>,
    /// The port a Unix-socket client must name in its CONNECT line.
    #[arg(long, default_value_t = DEFAULT_PORT)]
    port: u32,
    /// Do init duties (mounts, hostname) even when not PID 1.
    #[arg(long, conflicts_with = "no_init")]
    init: bool,
    /// Skip init duties even as PID 1 (a minimal init already did them).
    #[arg(long)]
    no_init: bool,
    /// Hostname set at init when the kernel has none.
    #[arg(long, default_value = "rollbox")]
    hostname: String,
    /// Answer SetTime without touching the clock (for host-mode tests).
    #[arg(long)]
    no_set_clock: bool,
    /// Where accounts are read (`passwd`, `group`) and `resolv.conf` is written. On the host,
    /// a test maps E2B's `user` onto the agent's own uid with a scratch home this way.
    #[arg(long, value_name = "DIR", default_value = "/etc")]
    etc_dir: PathBuf,
    /// Where SetIdentity writes the machine id.
    #[arg(long, default_value = "/etc/machine-id")]
    machine_id_path: PathBuf,
    /// Move the agent into a private UTS namespace first, so SetIdentity's
    /// hostname change stays inside it (for host-mode tests).
    #[arg(long)]
    unshare_uts: bool,
    /// dockerd's API socket.
    #[arg(long, default_value = "/var/run/docker.sock")]
    docker_socket: PathBuf,
    /// Log file of a dockerd started by the agent.
    #[arg(long, default_value = "/var/log/rollbox-dockerd.log")]
    dockerd_log: PathBuf,
    /// Watch the VM generation counter (I/O ports 0x3c8-0x3cf) even when not
    /// PID 1, and re-identify the guest when it changes.
    #[arg(long, conflicts_with = "no_generation_watch")]
    generation_watch: bool,
    /// Do not watch the VM generation counter, even as PID 1.
    #[arg(long)]
    no_generation_watch: bool,
    /// Log debug messages too.
    #[arg(long)]
    verbose: bool,
}

struct StderrLogger {
    verbose: AtomicBool,
}

static LOGGER: StderrLogger = StderrLogger {
    verbose: AtomicBool::new(false),
};

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level()
            <= if self.verbose.load(Ordering::Relaxed) {
                log::Level::Debug
            } else {
                log::Level::Info
            }
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("rollbox-agent {}: {}", record.level(), record.args());
        }
    }

    fn flush(&self) {}
}

fn main() {
    let is_pid1 = std::process::id() == 1;
    let args = match Args::try_parse() {
        Ok(args) => args,
        // The kernel hands init the command-line words it does not know; as
        // PID 1, run with the defaults rather than exit (which would panic the kernel).
        Err(err) if is_pid1 => {
            eprintln!("rollbox-agent: ignoring arguments: {err}");
            Args::parse_from(["rollbox-agent"])
        }
        Err(err) => err.exit(),
    };
    let verbose = args.verbose;
    LOGGER.verbose.store(verbose, Ordering::Relaxed);
    // Fails only if a logger is already set, which cannot happen here.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(if verbose {
        log::LevelFilter::Debug
    } else {
        log::LevelFilter::Info
    });
    if let Err(err) = run(args, is_pid1) {
        log::error!("{err}");
        if is_pid1 {
            // PID 1 must not exit (the kernel would panic); stay for inspection.
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        std::process::exit(1);
    }
}

fn run(args: Args, is_pid1: bool) -> Result<(), String> {
    let is_init = (is_pid1 || args.init) && !args.no_init;
    if is_init {
        // A layered template's sandbox: the root becomes the overlay first.
        layers::enter_from_cmdline().map_err(|e| e.to_string())?;
        init::init_system(&args.hostname);
        network::setup_at_boot();
        volumes::mount_from_cmdline();
    }
    if args.unshare_uts {
        // SAFETY: unshare has no memory effects; the process is still single-threaded.
        if unsafe { libc::unshare(libc::CLONE_NEWUTS) } != 0 {
            return Err(format!(
                "unshare(CLONE_NEWUTS): {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    if !is_pid1 {
        // Orphans of our processes come back to us to be reaped.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    let generation = watch_generation(&args, is_pid1);
    let config = agent::Config {
        set_clock: !args.no_set_clock,
        machine_id_path: args.machine_id_path.clone(),
        etc_dir: args.etc_dir.clone(),
        docker_socket: args.docker_socket.clone(),
        dockerd_log: args.dockerd_log.clone(),
        is_init,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("start the async runtime: {e}"))?;
    runtime.block_on(serve(args, config, generation))
}

/// The generation watcher, as PID 1 or with --generation-watch; says once why not.
fn watch_generation(args: &Args, is_pid1: bool) -> Option<generation::Watcher> {
    if args.no_generation_watch || !(is_pid1 || args.generation_watch) {
        log::info!("VM generation watch off (on as PID 1 or with --generation-watch)");
        return None;
    }
    match generation::Watcher::for_guest(
        args.machine_id_path.clone(),
        args.hostname.clone(),
        !args.no_set_clock,
    ) {
        Ok(watcher) => {
            log::info!(
                "VM generation {:#018x}; re-identifying when it changes",
                watcher.status().generation
            );
            Some(watcher)
        }
        Err(err) => {
            log::info!("VM generation watch off: {err}");
            None
        }
    }
}

async fn serve(
    args: Args,
    config: agent::Config,
    generation: Option<generation::Watcher>,
) -> Result<(), String> {
    let reaper = tokio::spawn(reaper::run());
    let agent = Arc::new(agent::Agent::new(config, generation));
    let vsock_port = match (args.listen_vsock, &args.listen_unix) {
        (Some(port), _) => Some(port),
        (None, None) => Some(DEFAULT_PORT),
        (None, Some(_)) => None,
    };
    let mut listeners = Vec::new();
    if let Some(path) = args.listen_unix.clone() {
        let listener = bind_unix(&path)?;
        log::info!(
            "listening on unix socket {} (CONNECT {})",
            path.display(),
            args.port
        );
        listeners.push(tokio::spawn(accept_unix(
            listener,
            Arc::clone(&agent),
            args.port,
        )));
    }
    if let Some(port) = vsock_port {
        let listener = vsock::VsockListener::bind(port)
            .map_err(|e| format!("listen on vsock port {port}: {e}"))?;
        log::info!("listening on vsock port {port}");
        listeners.push(tokio::spawn(accept_vsock(listener, Arc::clone(&agent))));
    }
    for listener in listeners {
        match listener.await {
            Ok(Err(err)) => return Err(err),
            Ok(Ok(())) => {}
            Err(err) => return Err(format!("listener task failed: {err}")),
        }
    }
    reaper.abort();
    Ok(())
}

fn bind_unix(path: &std::path::Path) -> Result<tokio::net::UnixListener, String> {
    use std::os::unix::fs::FileTypeExt as _;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() {
            // A stale socket from an earlier run.
            std::fs::remove_file(path)
                .map_err(|e| format!("remove stale socket {}: {e}", path.display()))?;
        } else {
            return Err(format!(
                "listen on {}: a non-socket file is in the way",
                path.display()
            ));
        }
    }
    // Bind and listen under a temporary name, then rename: once the socket
    // file exists, connections succeed (no window between bind and listen).
    let mut temp = path.as_os_str().to_owned();
    temp.push(format!(".{}.tmp", std::process::id()));
    let temp = PathBuf::from(temp);
    let _ = std::fs::remove_file(&temp);
    let listener = tokio::net::UnixListener::bind(&temp)
        .map_err(|e| format!("listen on unix socket {}: {e}", temp.display()))?;
    std::fs::rename(&temp, path).map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        format!("rename {} -> {}: {e}", temp.display(), path.display())
    })?;
    Ok(listener)
}

async fn accept_unix(
    listener: tokio::net::UnixListener,
    agent: Arc<agent::Agent>,
    port: u32,
) -> Result<(), String> {
    loop {
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                // E.g. out of file descriptors: keep listening, connections will work again.
                log::warn!("accept on unix socket: {err}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let agent = Arc::clone(&agent);
        tokio::spawn(async move {
            match hybrid::read_connect(&mut stream).await {
                Ok(asked) if asked == port => {
                    if hybrid::write_ok(&mut stream, port).await.is_ok() {
                        server::serve(agent, stream).await;
                    }
                }
                // Like a vsock port with no listener: the connection is just closed.
                Ok(asked) => {
                    log::info!("refused CONNECT {asked}: this agent listens on port {port}")
                }
                Err(err) => log::info!("refused connection: {err}"),
            }
        });
    }
}

async fn accept_vsock(
    listener: vsock::VsockListener,
    agent: Arc<agent::Agent>,
) -> Result<(), String> {
    loop {
        let stream = match listener.accept().await {
            Ok(stream) => stream,
            Err(err) => {
                log::warn!("accept on vsock: {err}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        tokio::spawn(server::serve(Arc::clone(&agent), stream));
    }
}
