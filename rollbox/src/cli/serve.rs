//! `rollbox serve`: its flags, turned into the daemon's options, and the runtime it runs on
//! until SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use rollbox::daemon::{Listen, NetworkOptions, NodeOptions, ServeOptions};

use super::conn::{absolute, default_socket, read_key};

#[derive(Args)]
#[command(group(clap::ArgGroup::new("e2b").args(["e2b_listen", "e2b_socket"]).multiple(true)))]
pub struct ServeArgs {
    /// Serve on this Unix socket [default: $ROLLBOX_SOCKET, else /run/rollbox/rollbox.sock,
    /// unless --listen].
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    socket: Option<PathBuf>,
    /// Serve on this TCP address instead, e.g. 127.0.0.1:7070: a loopback address, or any
    /// with --tls-cert and --tls-key (for trainers on other hosts).
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// The TLS certificate chain (PEM) --listen serves.
    #[arg(long, value_name = "FILE", requires_all = ["listen", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
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
    /// Build every template from an image as one whole disk, even when its first layers are
    /// those of an image built before (by default such templates share one read-only base
    /// file and each keeps only the rest; rollbox/README.md, "Shared layers").
    #[arg(long)]
    no_layer_sharing: bool,
    /// Largest size of each sandbox's console.log in bytes: past it the VMM drops the guest's
    /// console output, counted in the file's last line.
    #[arg(long, value_name = "BYTES", default_value_t = 8 << 20, value_parser = clap::value_parser!(u64).range(1024..))]
    console_max_bytes: u64,
    /// The virtiofsd that serves sandboxes' volumes [default: $ROLLBOX_VIRTIOFSD, then
    /// virtiofsd on PATH, /usr/libexec/virtiofsd, the cache of scripts/virtiofsd.sh].
    #[arg(long, value_name = "PATH")]
    virtiofsd: Option<PathBuf>,
    /// A directory under which volumes may keep their files at an admin's `host_path`
    /// (repeatable); without one, volumes live in the state directory only.
    #[arg(long = "volume-dir", value_name = "DIR")]
    volume_dirs: Vec<PathBuf>,
    /// The uid that owns the volumes this server makes: their virtiofsd processes run as it
    /// (in a user namespace), and files guests write are its on the host; pick one no host
    /// account uses, and not --jail-uid (refused). 0 (with
    /// --volume-gid 0): root's, like volumes made before this option (their virtiofsd runs as
    /// root).
    #[arg(long, value_name = "UID", default_value_t = 64001)]
    volume_uid: u32,
    /// The gid that owns the volumes this server makes (see --volume-uid).
    #[arg(long, value_name = "GID", default_value_t = 64001)]
    volume_gid: u32,
    /// A GPU of this node: a PCI device bound to vfio-pci, DDDD:BB:DD.F, optionally named
    /// (`0000:3b:00.0=H100`; else the PCI ID database's name); repeatable. Without one, every
    /// device bound to vfio-pci is a GPU.
    #[arg(long = "gpu", value_name = "BDF[=NAME]")]
    gpus: Vec<String>,
    /// The egress of a sandbox whose `network` names none: none (nothing leaves the
    /// sandbox; the host still reaches it), all (the internet, but not private, shared or
    /// link-local addresses), or an allow-list CIDR|HOST[:PORT[-PORT]],...
    #[arg(long, value_name = "POLICY", default_value = "none")]
    default_egress: String,
    /// The pool sandboxes' /30 networks come from; it must not overlap the host's routes.
    #[arg(long, value_name = "CIDR", default_value = rollbox::net::DEFAULT_POOL)]
    net_pool: String,
    /// Where network leases are recorded (shared with `rollbox net list` and `gc`) [default:
    /// $ROLLBOX_NET_STATE, else /run/rollbox/net].
    #[arg(long, value_name = "DIR")]
    net_state_dir: Option<PathBuf>,
    /// The DNS server sandboxes with a network are given and may reach (not under egress
    /// none) [default: the host's first non-loopback IPv4 nameserver in /etc/resolv.conf,
    /// else none].
    #[arg(long, value_name = "IP")]
    sandbox_dns: Option<std::net::Ipv4Addr>,
    /// Where the resolver of a policy with hostnames asks (tests: a DNS server on another
    /// port) [default: --sandbox-dns, else the host's first nameserver, loopback included].
    #[arg(long, value_name = "IP:PORT", hide = true)]
    resolver_upstream: Option<std::net::SocketAddr>,
    /// Exposed ports (a create's `network.expose`) are on 127.0.0.1 only, for this host;
    /// with this, on this address of the host too, reachable from other hosts.
    #[arg(long, value_name = "IP")]
    publish: Option<std::net::Ipv4Addr>,
    /// The host ports exposed guest ports get, LOW-HIGH (keep it clear of the kernel's
    /// ephemeral range, net.ipv4.ip_local_port_range).
    #[arg(long, value_name = "LOW-HIGH", default_value = "20000-29999")]
    expose_port_range: String,
    /// Keep each sandbox's newest N snapshots; older ones are removed unless a live sandbox
    /// was restored or reset from them.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    snapshot_retention: Option<u32>,
    /// Remove a fork's snapshot this many seconds after the fork, even while its clones run
    /// (they need none of its files; only a reset back to it does) [default: none: it goes
    /// when its last clone ends].
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=rollbox::daemon::api::MAX_TTL_S))]
    fork_snapshot_ttl: Option<u64>,
    /// Test only: every snapshot, once written and with its VM still paused, writes this file
    /// and waits until it is removed (to kill the daemon mid-snapshot).
    #[arg(long, value_name = "FILE", hide = true)]
    test_hold_snapshot: Option<PathBuf>,
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
    /// Also serve the E2B-compatible API (control plane and envd data plane) on this address,
    /// e.g. 127.0.0.1:3000 (E2B_API_URL=http://127.0.0.1:3000): loopback, or any with
    /// --e2b-tls-cert and --e2b-tls-key.
    #[arg(long, value_name = "ADDR")]
    e2b_listen: Option<std::net::SocketAddr>,
    /// Also serve the E2B-compatible API on this Unix socket (mode 0600), e.g. for
    /// `rollbox lease` in a pod that mounts it from the host.
    #[arg(long, value_name = "PATH")]
    e2b_socket: Option<PathBuf>,
    /// The `domain` E2B sandboxes report: data-plane traffic goes to {port}-{id}.DOMAIN unless
    /// the client sets E2B_SANDBOX_URL.
    #[arg(
        long,
        value_name = "DOMAIN",
        default_value = "e2b.localhost",
        requires = "e2b"
    )]
    e2b_domain: String,
    /// Serve the E2B API over TLS with this PEM certificate chain (with --e2b-tls-key).
    #[arg(long, value_name = "FILE", requires_all = ["e2b_listen", "e2b_tls_key"])]
    e2b_tls_cert: Option<PathBuf>,
    /// The PEM private key of --e2b-tls-cert.
    #[arg(long, value_name = "FILE", requires = "e2b_tls_cert")]
    e2b_tls_key: Option<PathBuf>,
    /// A directory whose files templates may use as rootfs, initrd or image archive/layout
    /// (after symlinks resolve); repeatable. Without one, only the state directory's own
    /// templates and the image cache.
    #[arg(long = "template-dir", value_name = "DIR")]
    template_dirs: Vec<PathBuf>,
    /// A registry (host or host:port, e.g. ghcr.io) templates may pull images from;
    /// repeatable. Without one, any.
    #[arg(long = "registry-allow", value_name = "HOST")]
    registry_allow: Vec<String>,
    /// Registry credentials for template builds whose request gives none: a Docker
    /// config.json-format file, read at start and again for each build.
    #[arg(long, value_name = "FILE")]
    registry_auth: Option<PathBuf>,
    /// Open connections per API listener; past it the oldest connection with no request in
    /// progress is closed to make room.
    #[arg(long, value_name = "N", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: u64,
    /// Seconds a client may take to send a request's headers; also closes keep-alive
    /// connections idle this long.
    #[arg(long, value_name = "SECS", default_value_t = 30.0, value_parser = positive_seconds)]
    http_header_timeout: f64,
    /// Seconds a TLS handshake on the E2B listener may take.
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = positive_seconds)]
    tls_handshake_timeout: f64,
    /// Seconds the guest agent may take to accept a connection and to answer a call that has
    /// no timeout of its own (an exec is bounded by its own timeout).
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = positive_seconds)]
    agent_timeout: f64,
    /// This node's id in GET /node and /metrics [default: made once and kept in the state
    /// directory's `node-id`].
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// Live sandboxes (creating, running, paused) at most; a create past it gets 429 with
    /// Retry-After, naming the limit.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_sandboxes: Option<u64>,
    /// Guest memory of the live sandboxes at most, in MiB; a create past it gets 429.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    memory_budget_mib: Option<u64>,
    /// On SIGTERM or Ctrl-C, drain first: no new sandboxes, and what is still live after SECS
    /// is ended before the daemon exits [default: stop at once; the VMMs keep running and the
    /// next start re-attaches them].
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(0..=604_800))]
    drain_on_sigterm: Option<u64>,
    /// On a Kubernetes node: the kubelet's pods directory (/var/lib/kubelet/pods). A sandbox
    /// labelled rollbox.dev/pod-uid=UID (as `rollbox-lease` makes them) ends once DIR/UID is
    /// gone, so a deleted pod leaves no sandbox behind
    #[arg(long, value_name = "DIR")]
    kubelet_pods_dir: Option<PathBuf>,
    /// Keep N jailed VMM shells ready for guests of MIB MiB, or with templates=N for each
    /// template with a boot snapshot (repeatable; templates=2 unless given, templates=0 for
    /// none): a create that restores a snapshot (no network, volume, GPU or CPU limit) loads
    /// it into one instead of starting a VMM, and the pool starts another in the background.
    /// Shells count against --max-sandboxes and --memory-budget-mib: the pool holds only the
    /// room the sandboxes leave.
    #[arg(long = "warm-pool", value_name = "MIB=N|templates=N",
          value_parser = rollbox::daemon::parse_warm_pool)]
    warm_pool: Vec<rollbox::daemon::WarmPoolSpec>,
    /// No warm pool at all: every create starts and jails its VMM while the caller waits
    #[arg(long, conflicts_with = "warm_pool")]
    no_warm_pool: bool,
}

/// A duration flag: seconds, fractions allowed, more than 0 and at most a day.
fn positive_seconds(text: &str) -> Result<f64, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(secs > 0.0 && secs <= 86_400.0) {
        return Err(format!("{text} is not between 0 and 86400 seconds"));
    }
    Ok(secs)
}

/// The network flags, checked.
fn network_options(args: &ServeArgs) -> Result<NetworkOptions, String> {
    let ServeArgs {
        default_egress,
        net_pool: pool,
        net_state_dir: state_dir,
        sandbox_dns: dns,
        resolver_upstream,
        publish,
        expose_port_range,
        ..
    } = args;
    let port_range = expose_port_range
        .split_once('-')
        .and_then(|(low, high)| Some((low.parse::<u16>().ok()?, high.parse::<u16>().ok()?)))
        .filter(|(low, high)| *low > 0 && low <= high)
        .ok_or_else(|| {
            format!("--expose-port-range {expose_port_range:?}: want LOW-HIGH, 1 <= LOW <= HIGH <= 65535")
        })?;
    if let Some(addr) = publish {
        // It must be one of this host's addresses, and not one that says "every address".
        if addr.is_unspecified() || addr.is_loopback() {
            return Err(format!(
                "--publish {addr}: name one address of this host that other hosts reach (exposed ports are on 127.0.0.1 already)"
            ));
        }
        std::net::TcpListener::bind((*addr, 0))
            .map_err(|e| format!("--publish {addr}: not an address of this host ({e})"))?;
    }
    Ok(NetworkOptions {
        publish: *publish,
        port_range,
        default_egress: default_egress
            .parse()
            .map_err(|e| format!("--default-egress: {e}"))?,
        pool: rollbox::net::Pool::parse(pool).map_err(|e| format!("--net-pool: {e}"))?,
        state_dir: absolute(
            state_dir
                .clone()
                .unwrap_or_else(rollbox::net::default_state_dir),
        ),
        dns: dns.or_else(rollbox::daemon::host_dns),
        upstream: resolver_upstream.or_else(|| {
            dns.or_else(rollbox::daemon::host_resolver)
                .map(|ip| std::net::SocketAddr::from((ip, 53)))
        }),
    })
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
    let networks = match network_options(&args) {
        Ok(networks) => networks,
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
    let http = rollbox::daemon::ConnLimits {
        header_timeout: Duration::from_secs_f64(args.http_header_timeout),
        tls_handshake_timeout: Duration::from_secs_f64(args.tls_handshake_timeout),
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
    };
    let options = ServeOptions {
        networks,
        http,
        agent_timeout: Duration::from_secs_f64(args.agent_timeout),
        node: NodeOptions {
            node_id: args.node_id,
            max_sandboxes: args.max_sandboxes,
            memory_budget_mib: args.memory_budget_mib,
        },
        drain_on_stop_s: args.drain_on_sigterm,
        virtiofsd: args.virtiofsd.map(absolute),
        volume_dirs: args.volume_dirs,
        volume_owner: (args.volume_uid, args.volume_gid),
        gpus: args.gpus,
        tls: args
            .tls_cert
            .zip(args.tls_key)
            .map(|(cert, key)| rollbox::daemon::e2b::TlsFiles { cert, key }),
        listen,
        api_key,
        state_dir: args.state_dir,
        vmm: absolute(vmm),
        default_ttl_s: args.default_ttl,
        max_pending_creates: usize::try_from(args.max_pending_creates).unwrap_or(64),
        reap_interval: Duration::from_millis(250),
        ready_timeout: Duration::from_secs(args.vmm_start_timeout),
        test_agent_socket: args.test_agent_socket,
        agent: Some(absolute(super::image::agent_path(args.agent))),
        image_cache: args
            .image_cache
            .unwrap_or_else(rollbox::images::default_cache_dir),
        cgroup_fs: args.cgroup_fs,
        jailer,
        snapshot_retention: args.snapshot_retention,
        fork_snapshot_ttl_s: args.fork_snapshot_ttl,
        test_hold_snapshot: args.test_hold_snapshot,
        template_dirs: args.template_dirs.into_iter().map(absolute).collect(),
        registry_allow: args.registry_allow,
        registry_auth: args.registry_auth.map(absolute),
        share_layers: !args.no_layer_sharing,
        console_max_bytes: args.console_max_bytes,
        kubelet_pods_dir: args.kubelet_pods_dir,
        warm_pool: rollbox::daemon::warm_pool_with_default(args.warm_pool, args.no_warm_pool),
        e2b: (args.e2b_listen.is_some() || args.e2b_socket.is_some()).then(|| {
            rollbox::daemon::e2b::E2bOptions {
                listen: args.e2b_listen,
                socket: args.e2b_socket.map(absolute),
                domain: args.e2b_domain,
                tls: args
                    .e2b_tls_cert
                    .zip(args.e2b_tls_key)
                    .map(|(cert, key)| rollbox::daemon::e2b::TlsFiles { cert, key }),
            }
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
    let drains = options.drain_on_stop_s.is_some();
    let result = runtime.block_on(async {
        let shutdown = async move {
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
            if !drains {
                log::info!(
                    "stopping; sandboxes keep running and the next start re-attaches to them"
                );
            }
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
