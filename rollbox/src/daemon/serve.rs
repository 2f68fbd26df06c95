//! `rollbox serve`'s composition root: opens the state, builds the services (the supervisor,
//! then sandboxes, snapshots and templates over it and the store) and the [`Core`] they sit
//! behind, recovers what a previous daemon left, starts the reaper and the frontends (the
//! native API, and the E2B one when asked), and serves until shutdown. The core knows neither
//! frontend; this is where they meet it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::core::{Core, Services};
use super::frontend::conn::{self, ConnLimits};
use super::frontend::transport::{tls_acceptor, Listen, Listener, TlsFiles, TransportError};
use super::frontend::{e2b, rest};
use super::gpus::inventory::{self, GpuSpec, InventoryError, PCI_IDS};
use super::gpus::Gpus;
use super::guest::Guest;
use super::keys::Keys;
use super::networks::{NetworkOptions, Networks};
use super::node::{Node, NodeError, NodeOptions};
use super::retention::Retention;
use super::sandboxes::{Attachable, RecoverError, SandboxOptions, Sandboxes};
use super::snapshots::Snapshots;
use super::store::{Db, Store, StoreError};
use super::supervisor::{JailerOptions, Supervisor, SupervisorError, SupervisorOptions};
use super::templates::{TemplateOptions, TemplatePolicy, Templates};
use super::usage::Counters;
use super::volumes::Volumes;

pub use super::sandboxes::PoolSpec as WarmPoolSpec;

/// A daemon that cannot start or stopped on an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    #[error("state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Recover(#[from] RecoverError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("the API key is empty: put a key in --api-key-file or ROLLBOX_API_KEY")]
    EmptyKey,
    #[error("--template-dir {path}: {source}")]
    TemplateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "state directory {path}: mode {mode:04o} lets {who} in; it holds every sandbox's disk, memory and env: `chmod 700 {path}`"
    )]
    StateDirOpen {
        path: PathBuf,
        mode: u32,
        who: &'static str,
    },
    #[error(
        "state directory {path}: owned by uid {uid}, not this daemon's ({me}): `chown {me} {path}`"
    )]
    StateDirOwner { path: PathBuf, uid: u32, me: u32 },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error(transparent)]
    Gpu(#[from] InventoryError),
    #[error("--kubelet-pods-dir {0}: not a directory (the kubelet's pods directory is /var/lib/kubelet/pods)")]
    KubeletPodsDir(PathBuf),
    #[error("--volume-dir {path}: {source}")]
    VolumeDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The volumes' owner is the jails' uid: a jailed VMM would own their virtiofsd.
    #[error("--volume-uid {0} is the jails' uid (--jail-uid): give volumes a uid of their own")]
    VolumeUid(u32),
    #[error("sandbox directory paths under {0} are too long for Unix sockets (108 bytes); use a shorter --state-dir")]
    PathTooLong(PathBuf),
    #[error("--registry-auth: {0}")]
    RegistryAuth(#[from] crate::images::auth::AuthError),
}

/// `rollbox serve` options.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: Listen,
    pub api_key: String,
    pub state_dir: PathBuf,
    /// The `rollbox-vmm` binary.
    pub vmm: PathBuf,
    /// TTL for creates that give none; without it `ttl_s` is required.
    pub default_ttl_s: Option<u64>,
    pub max_pending_creates: usize,
    /// How often the reaper looks at TTLs and processes.
    pub reap_interval: Duration,
    /// How long a new VMM may take to open its API socket.
    pub ready_timeout: Duration,
    /// Test-only (`--test-agent-socket`): every sandbox's agent traffic goes to this hybrid
    /// vsock socket (a host `rollbox-agent --listen-unix`) instead of the sandbox's own.
    pub test_agent_socket: Option<PathBuf>,
    /// The static guest agent installed into rootfs images built for templates.
    pub agent: Option<PathBuf>,
    /// The image builder's cache (layers and built rootfs images).
    pub image_cache: PathBuf,
    /// Where the cgroup hierarchies are mounted (for `cpu_limit`): /sys/fs/cgroup.
    pub cgroup_fs: PathBuf,
    /// Keep each sandbox's newest N snapshots (see [`super::retention`]); None: keep all.
    pub snapshot_retention: Option<u32>,
    /// `--fork-snapshot-ttl`: a fork's snapshot goes this many seconds after it was taken,
    /// even while its clones run; None: when its last clone ends.
    pub fork_snapshot_ttl_s: Option<u64>,
    /// Test-only (`--test-hold-snapshot`): every snapshot waits, its VM paused and nothing
    /// recorded, while this file exists (see `Snapshots::hold`).
    pub test_hold_snapshot: Option<PathBuf>,
    /// The E2B-compatible API on its own listener (`--e2b-listen`).
    pub e2b: Option<e2b::E2bOptions>,
    /// `rollbox-jailer` around every VMM (the default); None with `--no-jailer`.
    pub jailer: Option<JailerOptions>,
    /// `--template-dir`: where a template's rootfs, initrd and image files may lie (besides
    /// the state's own templates directory and the image cache).
    pub template_dirs: Vec<PathBuf>,
    /// `--registry-allow`: the registries templates may pull from; empty: any.
    pub registry_allow: Vec<String>,
    /// `--registry-auth`: a Docker config.json-format file of registry credentials for
    /// template builds (checked at start, read again for each build).
    pub registry_auth: Option<PathBuf>,
    /// Templates from images that share their first layers share a base file.
    pub share_layers: bool,
    /// Each VMM's console file stops growing at this many bytes (`--console-max-bytes`).
    pub console_max_bytes: u64,
    /// `--kubelet-pods-dir`: end sandboxes whose pod (label [`POD_UID_LABEL`]) is gone.
    pub kubelet_pods_dir: Option<PathBuf>,
    /// `--warm-pool`: VMM shells kept ready, per guest memory size or per template.
    pub warm_pool: Vec<WarmPoolSpec>,
    /// What every API connection is held to, on each listener.
    pub http: ConnLimits,
    /// `--agent-timeout`: guest agent connects, handshakes and calls without a timeout of
    /// their own end after this.
    pub agent_timeout: Duration,
    /// `--node-id`, `--max-sandboxes`, `--memory-budget-mib`.
    pub node: NodeOptions,
    /// `--tls-cert` and `--tls-key`: the TCP listener serves TLS (and may then be a
    /// non-loopback address).
    pub tls: Option<TlsFiles>,
    /// `--drain-on-sigterm`: a stop drains for this long, ends what is left and only then
    /// returns; None: a stop leaves the VMMs running for the next start to re-attach.
    pub drain_on_stop_s: Option<u64>,
    /// `--virtiofsd`: the virtiofsd binary that serves volumes; None: it is looked for.
    pub virtiofsd: Option<PathBuf>,
    /// `--volume-dir`: where a volume's `host_path` may be (none: only the state dir's).
    pub volume_dirs: Vec<PathBuf>,
    /// `--volume-uid` and `--volume-gid`: who owns the volumes the daemon makes (their
    /// virtiofsd runs as them); (0, 0): root, as before.
    pub volume_owner: (u32, u32),
    /// `--gpu BDF[=NAME]`: the node's GPUs; none: every device bound to vfio-pci.
    pub gpus: Vec<String>,
    /// `--default-egress`, `--net-pool`, `--net-state-dir`, `--sandbox-dns`.
    pub networks: NetworkOptions,
}

/// The template policy: the `--template-dir`s (which must exist) and the state's own
/// directories, all canonical, and the registries.
fn template_policy(options: &ServeOptions, dirs: &Dirs) -> Result<TemplatePolicy, DaemonError> {
    let mut allowed = vec![dirs.templates.clone()];
    if let Ok(cache) = std::fs::canonicalize(&options.image_cache) {
        allowed.push(cache);
    }
    for dir in &options.template_dirs {
        let canonical = std::fs::canonicalize(dir).map_err(|source| DaemonError::TemplateDir {
            path: dir.clone(),
            source,
        })?;
        allowed.push(canonical);
    }
    Ok(TemplatePolicy {
        dirs: allowed,
        registries: options.registry_allow.clone(),
    })
}

/// The state directory's parts, made if missing.
struct Dirs {
    state: PathBuf,
    sandboxes: PathBuf,
    snapshots: PathBuf,
    templates: PathBuf,
    volumes: PathBuf,
}

/// Makes the state directory's parts (0700 under the daemon's umask); a state directory that
/// another uid may enter, or that is not the daemon's, is refused.
fn make_dirs(state_dir: &Path) -> Result<Dirs, DaemonError> {
    use std::os::unix::fs::MetadataExt as _;
    let state_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DaemonError::StateDir { path, source }
    };
    std::fs::create_dir_all(state_dir).map_err(state_error(state_dir))?;
    let state = std::fs::canonicalize(state_dir).map_err(state_error(state_dir))?;
    let meta = std::fs::metadata(&state).map_err(state_error(&state))?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        let who = match (mode & 0o070 != 0, mode & 0o007 != 0) {
            (true, true) => "its group and others",
            (true, false) => "its group",
            _ => "others",
        };
        return Err(DaemonError::StateDirOpen {
            path: state,
            mode,
            who,
        });
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(DaemonError::StateDirOwner {
            path: state,
            uid: meta.uid(),
            me,
        });
    }
    let sandboxes = state.join("sandboxes");
    std::fs::create_dir_all(&sandboxes).map_err(state_error(&sandboxes))?;
    let snapshots = state.join("snapshots");
    std::fs::create_dir_all(&snapshots).map_err(state_error(&snapshots))?;
    let templates = state.join("templates");
    std::fs::create_dir_all(&templates).map_err(state_error(&templates))?;
    let volumes = state.join("volumes");
    std::fs::create_dir_all(&volumes).map_err(state_error(&volumes))?;
    Ok(Dirs {
        state,
        sandboxes,
        snapshots,
        templates,
        volumes,
    })
}

/// Opens the state, recovers, and serves until `shutdown` completes. VMMs keep running after
/// the daemon stops; the next start re-attaches to them.
pub async fn serve(
    options: ServeOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    if options.api_key.trim().is_empty() {
        return Err(DaemonError::EmptyKey);
    }
    // Everything the daemon makes (state.db, disk copies, snapshots) is its own alone.
    // SAFETY: umask sets this process's file mode mask; it cannot fail.
    unsafe { libc::umask(0o077) };
    // Descriptors for the connection caps (each connection may hold an agent connection too).
    match conn::raise_nofile() {
        Ok(limit) => log::debug!("open files limit: {limit}"),
        Err(e) => log::warn!("cannot raise the open files limit: {e}"),
    }
    let dirs = make_dirs(&options.state_dir)?;
    let policy = template_policy(&options, &dirs)?;
    if let Some(file) = &options.registry_auth {
        crate::images::auth::AuthFile::load(file)?;
    }
    let db = Arc::new(Db::new(Store::open(&dirs.state.join("state.db"))?));
    let keys = Arc::new(Keys::new(Arc::clone(&db), &options.api_key)?);
    let supervisor = Arc::new(Supervisor::new(SupervisorOptions {
        vmm: options.vmm.clone(),
        ready_timeout: options.ready_timeout,
        state_dir: &dirs.state,
        sandboxes_dir: dirs.sandboxes.clone(),
        cgroup_fs: &options.cgroup_fs,
        jailer: options.jailer.as_ref(),
        console_max_bytes: options.console_max_bytes,
        virtiofsd: options.virtiofsd.clone(),
    })?);
    if let Some(jailer) = &options.jailer {
        let (uid, _) = options.volume_owner;
        if uid != 0 && uid == jailer.uid {
            return Err(DaemonError::VolumeUid(uid));
        }
    }
    // Checked once here: a pods directory that is not there would make every pod look gone.
    if let Some(pods) = &options.kubelet_pods_dir {
        if !pods.is_dir() {
            return Err(DaemonError::KubeletPodsDir(pods.clone()));
        }
    }
    let mut volume_dirs = Vec::new();
    for dir in &options.volume_dirs {
        volume_dirs.push(
            std::fs::canonicalize(dir).map_err(|source| DaemonError::VolumeDir {
                path: dir.clone(),
                source,
            })?,
        );
    }
    let gpu_specs = options
        .gpus
        .iter()
        .map(|text| GpuSpec::parse(text))
        .collect::<Result<Vec<_>, _>>()?;
    let pci_ids = std::fs::read_to_string(PCI_IDS).ok();
    let inventory = inventory::discover(Path::new("/sys"), &gpu_specs, pci_ids.as_deref())?;
    for gpu in &inventory {
        log::info!(
            "GPU {} ({}, IOMMU group {})",
            gpu.bdf,
            gpu.name,
            gpu.iommu_group
        );
    }
    let gpus = Arc::new(Gpus::new(inventory));
    let networks = Arc::new(Networks::new(options.networks.clone()));
    let volumes = Arc::new(Volumes::new(
        Arc::clone(&db),
        dirs.volumes.clone(),
        volume_dirs,
        options.volume_owner,
    ));
    volumes.remount();
    let counters = Arc::new(Counters::default());
    let node = Arc::new(Node::new(Arc::clone(&db), &options.node, &dirs.state)?);
    // The longest socket path: DIR/sb-XXXXXXXXXXXXXXXX-NODE/vsock.sock_PORT (5 digits).
    let longest = format!("/{}/vsock.sock_65535", node.sandbox_id("0123456789abcdef"));
    if dirs.sandboxes.as_os_str().len() + longest.len() >= 108 {
        return Err(DaemonError::PathTooLong(dirs.sandboxes.clone()));
    }
    let guest = Arc::new(Guest::new(
        Arc::clone(&db),
        options.test_agent_socket.clone(),
        options.agent_timeout,
    ));
    let sandboxes = Arc::new(Sandboxes::new(
        Arc::clone(&db),
        Arc::clone(&supervisor),
        Arc::clone(&guest),
        Arc::clone(&counters),
        Arc::clone(&node),
        Attachable {
            volumes: Arc::clone(&volumes),
            gpus: Arc::clone(&gpus),
            networks: Arc::clone(&networks),
        },
        SandboxOptions {
            default_ttl_s: options.default_ttl_s,
            max_pending_creates: options.max_pending_creates,
            ready_timeout: options.ready_timeout,
            kubelet_pods_dir: options.kubelet_pods_dir.clone(),
            warm_pool: options.warm_pool.clone(),
        },
    ));
    let retention = Arc::new(Retention::new(
        Arc::clone(&db),
        options.snapshot_retention,
        options.fork_snapshot_ttl_s,
    ));
    let snapshots = Arc::new(Snapshots::new(
        Arc::clone(&db),
        Arc::clone(&supervisor),
        Arc::clone(&sandboxes),
        Arc::clone(&retention),
        Arc::clone(&node),
        dirs.snapshots.clone(),
        options.test_hold_snapshot.clone(),
    ));
    let templates = Arc::new(Templates::new(
        Arc::clone(&db),
        Arc::clone(&sandboxes),
        Arc::clone(&snapshots),
        Arc::clone(&guest),
        TemplateOptions {
            dir: dirs.templates.clone(),
            agent: options.agent.clone(),
            image_cache: options.image_cache.clone(),
            policy,
            registry_auth: options.registry_auth.clone(),
            share_layers: options.share_layers,
        },
    ));
    let core = Arc::new(Core::new(Services {
        db: Arc::clone(&db),
        counters,
        sandboxes: Arc::clone(&sandboxes),
        snapshots: Arc::clone(&snapshots),
        templates,
        guest,
        keys,
        node,
        volumes,
        gpus: Arc::clone(&gpus),
    }));
    let kept = sandboxes.recover().await?;
    // The GPUs live sandboxes hold (a sandbox that did not come back released its own).
    let live = db.lock().live()?;
    for sandbox in &live {
        gpus.adopt(&sandbox.id, &sandbox.gpus);
    }
    // The networks of sandboxes that ended while the daemon was down, or of creates it was
    // killed in.
    let live: std::collections::HashSet<String> = live.into_iter().map(|s| s.id).collect();
    let reconciled = {
        let (networks, db) = (Arc::clone(&networks), Arc::clone(&db));
        tokio::task::spawn_blocking(move || {
            networks.reconcile(&live, |id| {
                db.lock().sandbox(id).is_ok_and(|found| found.is_some())
            })
        })
        .await
        .unwrap_or_default()
    };
    if !reconciled.is_empty() {
        log::info!(
            "released the networks of {} ended sandboxes: {}",
            reconciled.len(),
            reconciled.join(", ")
        );
    }
    snapshots.sweep()?;
    if !kept.is_empty() {
        log::info!("re-attached {} running sandboxes", kept.len());
    }
    // After the sweep, which ended the shells of a daemon before this one.
    let warm_pool = sandboxes.warm_pool_refill().map(tokio::spawn);
    let pool_owner = Arc::clone(&sandboxes);
    // The E2B listener first: its TLS files are the likelier to be wrong.
    let e2b_listener = options.e2b.as_ref().map(e2b::bind).transpose()?;
    let tls = options
        .tls
        .as_ref()
        .map(|files| tls_acceptor(files, ("--tls-cert", "--tls-key")))
        .transpose()?;
    let listener = Listener::bind(&options.listen, tls.is_some(), "--tls-cert and --tls-key")?;
    let e2b_server = e2b_listener
        .zip(options.e2b.clone())
        .map(|(bound, e2b_options)| {
            log::info!("E2B API on {}", bound.describe());
            tokio::spawn(e2b::run(
                bound,
                Arc::clone(&core),
                options.api_key.clone(),
                e2b_options,
                options.http,
            ))
        });
    let reaper = {
        let interval = options.reap_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let reaped = match sandboxes.reap().await {
                    Ok(()) => retention.enforce().await,
                    Err(e) => Err(e),
                };
                if let Err(e) = reaped {
                    log::error!("reaper: {e}");
                }
            }
        })
    };
    let url = listener.describe();
    let url = match tls {
        Some(_) => url.replacen("http://", "https://", 1),
        None => url,
    };
    log::info!("listening on {url}");
    describe_vmm(&options.vmm);
    let stopping = Arc::clone(&core);
    let drain_on_stop_s = options.drain_on_stop_s;
    let shutdown = async move {
        shutdown.await;
        if let Some(seconds) = drain_on_stop_s {
            log::info!("stopping: draining first (--drain-on-sigterm {seconds})");
            stopping.drain_then_stop(seconds).await;
        }
    };
    rest::run(listener, core, options.http, tls, shutdown).await;
    reaper.abort();
    if let Some(refill) = warm_pool {
        // Not aborted: a shell it is starting would be left running.
        pool_owner.stop_warm_pool_refill();
        let _ = refill.await;
        pool_owner.close_warm_pool().await;
    }
    if let Some(e2b_server) = e2b_server {
        e2b_server.abort();
    }
    if let Listen::Unix(path) = &options.listen {
        let _ = std::fs::remove_file(path);
    }
    if let Some(path) = options.e2b.as_ref().and_then(|e2b| e2b.socket.as_ref()) {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Logs which rollbox-vmm the daemon starts, and says so when it is not the lean static build
/// (each VMM then maps the loader and libc, about 1 MiB more resident per sandbox, and the
/// jailer binds them into every jail). After the listening line, which stays the first.
fn describe_vmm(vmm: &Path) {
    match rollbox_jailer::elf::shared_libraries(vmm) {
        Ok(libraries) if libraries.is_empty() => {
            log::info!("VMM: {} (static)", vmm.display());
        }
        Ok(libraries) => log::info!(
            "VMM: {} (dynamic, {} libraries; scripts/install.sh installs the lean static build)",
            vmm.display(),
            libraries.len().saturating_sub(1)
        ),
        // A wrapper script, say: started as it is.
        Err(e) => log::info!("VMM: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn a_state_dir_others_may_enter_is_refused_with_the_chmod_hint() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let state = tmp.path().join("state");
        std::fs::create_dir(&state).expect("mkdir");
        for (mode, who) in [
            (0o755, "its group and others"),
            (0o750, "its group"),
            (0o701, "others"),
        ] {
            std::fs::set_permissions(&state, std::fs::Permissions::from_mode(mode)).expect("chmod");
            let Err(error) = make_dirs(&state) else {
                panic!("mode {mode:o} accepted");
            };
            let text = error.to_string();
            let canonical = std::fs::canonicalize(&state).expect("canonical");
            assert!(
                text.contains(&format!("mode {mode:04o} lets {who} in"))
                    && text.contains(&format!("chmod 700 {}", canonical.display())),
                "{text}"
            );
            assert!(
                !state.join("sandboxes").exists(),
                "made parts of a refused state dir"
            );
        }
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        make_dirs(&state).expect("0700 is fine");
        // Another uid's: refused too.
        std::os::unix::fs::chown(&state, Some(12345), None).expect("chown");
        let Err(error) = make_dirs(&state) else {
            panic!("another uid's state dir accepted");
        };
        assert!(error.to_string().contains("owned by uid 12345"), "{error}");
    }
}
