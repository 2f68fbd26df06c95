//! `rollbox serve`: the daemon. HTTP/JSON (bearer key) → [`api::Action`] → [`Daemon::handle`]
//! → [`Reply`]. One `rollbox-vmm` process per sandbox, state in SQLite, a reaper for TTLs and
//! VMMs that ended, and re-attachment to live VMMs after a restart.
//!
//! Exec and files go through the sandbox's guest agent ([`guest`]); snapshots, restores, fork
//! and reset are in [`snapshots`].
//!
//! Templates (from files or built from an image, with an optional boot snapshot) are in
//! [`templates`].
//! Batches are in [`batch`], CPU limits in [`cgroup`], usage and metrics in [`usage`],
//! snapshot retention in [`retention`].

pub mod api;
mod batch;
pub mod client;
pub mod e2b;
mod guest;
mod http;
mod retention;
mod snapshots;
pub mod store;
mod templates;
pub mod usage;
pub mod vm;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use api::{
    Action, ApiError, CreateSandbox, Reply, Sandbox, SandboxList, Snapshot, State, Template,
};
use store::{Db, Inserted, Store, StoreError};

/// The host's cgroups (`rollbox_jailer::cgroup`), where the daemon's tools and tests find them.
pub use rollbox_jailer::cgroup;

/// A daemon that cannot start or stopped on an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("jailer {path}: {why} (or run `rollbox serve --no-jailer`)")]
    Jailer { path: PathBuf, why: String },
    #[error("state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {what}: {source}")]
    Listen {
        what: String,
        source: std::io::Error,
    },
    #[error("{0} is not a loopback address: the API is for this host only (use --socket for a Unix socket)")]
    NotLoopback(SocketAddr),
    #[error("{0} is in use by a running daemon; stop it or pick another --socket")]
    SocketInUse(PathBuf),
    #[error("the API key is empty: put a key in --api-key-file or ROLLBOX_API_KEY")]
    EmptyKey,
    #[error("sandbox directory paths under {0} are too long for Unix sockets (108 bytes); use a shorter --state-dir")]
    PathTooLong(PathBuf),
}

/// Where the API listens.
#[derive(Debug, Clone)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
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
    /// Keep each sandbox's newest N snapshots (see [`retention`]); None: keep all.
    pub snapshot_retention: Option<u32>,
    /// The E2B-compatible API on its own listener (`--e2b-listen`).
    pub e2b: Option<e2b::E2bOptions>,
    /// `rollbox-jailer` around every VMM (the default); None with `--no-jailer`.
    pub jailer: Option<JailerOptions>,
}

/// `rollbox serve`'s jailer settings.
#[derive(Debug, Clone)]
pub struct JailerOptions {
    /// The `rollbox-jailer` binary.
    pub binary: PathBuf,
    /// The unprivileged uid and gid every VMM runs as.
    pub uid: u32,
    pub gid: u32,
}

/// The jail every VMM gets: the jailer must exist and the daemon must be root.
fn jail_of(
    jailer: &JailerOptions,
    cgroup_fs: &Path,
    state_dir: &Path,
) -> Result<vm::Jail, DaemonError> {
    let refuse = |why: String| DaemonError::Jailer {
        path: jailer.binary.clone(),
        why,
    };
    if !jailer.binary.is_file() {
        return Err(refuse("no such file".into()));
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(refuse("it needs root (namespaces, mounts, cgroups)".into()));
    }
    if jailer.uid == 0 || jailer.gid == 0 {
        return Err(refuse("--jail-uid and --jail-gid must not be 0".into()));
    }
    let has = |controller| rollbox_jailer::hierarchy(cgroup_fs, controller).is_ok();
    let (memory_limits, pids_limits) = (has("memory"), has("pids"));
    if !memory_limits || !pids_limits {
        log::warn!(
            "jailer: no {} cgroup controller under {}: jails get no such limit",
            if memory_limits { "pids" } else { "memory" },
            cgroup_fs.display()
        );
    }
    Ok(vm::Jail {
        jailer: jailer.binary.clone(),
        uid: jailer.uid,
        gid: jailer.gid,
        cgroup_fs: cgroup_fs.to_path_buf(),
        cgroup_parent: cgroup::root_name(state_dir),
        memory_limits,
        pids_limits,
    })
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// 16 random hex digits from the kernel.
fn random_hex() -> String {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if usize::try_from(n).ok() != Some(bytes.len()) {
        // Not reached on Linux >= 3.17; the time and pid still make a unique-enough id.
        bytes = (now_ms() ^ (u64::from(std::process::id()) << 40)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What [`Daemon::prepare_create`] found for a create.
struct Prepared {
    snapshot: Option<Snapshot>,
    template: Template,
    ttl_s: u64,
}

/// Processes of running streaming execs: (sandbox id, pid) → the agent connection, the
/// exec's request id (where the agent takes signals and stdin for it), and whether its stdin
/// is open for writes.
type Processes = HashMap<(String, u32), (rollbox_agent_protocol::client::AgentClient, u64, bool)>;

/// The daemon's shared state.
pub struct Daemon {
    options: ServeOptions,
    sandboxes_dir: PathBuf,
    store: Db,
    /// VMMs this daemon started (so it reaps them); re-attached ones are only watched.
    children: Mutex<HashMap<String, Child>>,
    pending: Arc<tokio::sync::Semaphore>,
    processes: Mutex<Processes>,
    /// Sandboxes whose VMM is being swapped (reset) or snapshotted: the reaper leaves them be.
    busy: Mutex<std::collections::HashSet<String>>,
    snapshots_dir: PathBuf,
    templates_dir: PathBuf,
    counters: usage::Counters,
    /// The cpu controller for `cpu_limit`, or why there is none.
    cgroups: Result<cgroup::Cgroups, String>,
    /// How VMMs are jailed; None with `--no-jailer`.
    jail: Option<vm::Jail>,
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal(e.to_string())
}

impl Daemon {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock()
    }

    fn children(&self) -> MutexGuard<'_, HashMap<String, Child>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn processes(&self) -> MutexGuard<'_, Processes> {
        self.processes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one action.
    pub async fn handle(self: &Arc<Self>, action: Action) -> Result<Reply, ApiError> {
        match action {
            Action::Health => Ok(Reply::Health),
            Action::ListTemplates => Ok(Reply::Templates(
                self.store().templates().map_err(internal)?,
            )),
            Action::AddTemplate(request) => self.add_template(request).await,
            Action::GetTemplate(name) => match self.store().template(&name).map_err(internal)? {
                Some(template) => Ok(Reply::Template {
                    created: false,
                    template,
                }),
                None => Err(ApiError::NotFound(format!("no template {name:?}"))),
            },
            Action::RemoveTemplate(name) => self.remove_template(&name).await,
            Action::ListSandboxes(query) => {
                let (sandboxes, next_page_token) = self.store().list(&query).map_err(internal)?;
                Ok(Reply::Sandboxes(SandboxList {
                    sandboxes,
                    next_page_token,
                }))
            }
            Action::CreateSandbox(request) => self.create(request).await,
            Action::CreateBatch { count, create } => self.create_batch(count, create).await,
            Action::DeleteSandboxes(query) => self.delete_matching(query).await,
            Action::Usage(id) => self.usage(&id),
            Action::Metrics => self.metrics(),
            Action::GetSandbox(id) => {
                let sandbox = self.touch(&id)?;
                Ok(Reply::Sandbox {
                    created: false,
                    sandbox,
                })
            }
            Action::DeleteSandbox(id) => {
                self.end(&id, State::Deleted, "deleted by the API").await?;
                Ok(Reply::NoContent)
            }
            Action::Keepalive { id, ttl_s } => {
                self.touch(&id)?;
                let expires = now_ms().saturating_add(ttl_s.saturating_mul(1000));
                if !self.store().set_expiry(&id, expires).map_err(internal)? {
                    return Err(ApiError::Conflict(format!("sandbox {id} has ended")));
                }
                self.sandbox_reply(&id)
            }
            Action::Pause(id) => self.pause_resume(&id, true).await,
            Action::Resume(id) => self.pause_resume(&id, false).await,
            Action::Exec { id, exec, stream } => self.exec(&id, exec, stream).await,
            Action::Signal {
                id,
                pid,
                signal,
                group,
            } => self.signal(&id, pid, signal, group).await,
            Action::Stdin {
                id,
                pid,
                data,
                close,
            } => self.write_stdin(&id, pid, data, close).await,
            Action::File { id, op } => self.file(&id, op).await,
            Action::Snapshot { id, stop, ttl_s } => self.snapshot(&id, stop, ttl_s).await,
            Action::ListSnapshots { sandbox } => Ok(Reply::Snapshots(
                self.store()
                    .snapshots(sandbox.as_deref())
                    .map_err(internal)?,
            )),
            Action::GetSnapshot(id) => match self.store().snapshot(&id).map_err(internal)? {
                Some(snapshot) => Ok(Reply::Snapshot {
                    created: false,
                    snapshot,
                }),
                None => Err(ApiError::NotFound(format!("no snapshot {id}"))),
            },
            Action::DeleteSnapshot(id) => self.delete_snapshot(&id).await,
            Action::Fork {
                id,
                count,
                ttl_s,
                labels,
            } => self.fork(&id, count, ttl_s, labels).await,
            Action::Reset { id, snapshot } => self.reset(&id, snapshot).await,
            Action::PortConnect { id, port } => Err(ApiError::BadRequest(format!(
                "GET /sandboxes/{id}/ports/{port} is an HTTP upgrade: send `Connection: Upgrade` and `Upgrade: tcp`"
            ))),
        }
    }

    fn sandbox_reply(&self, id: &str) -> Result<Reply, ApiError> {
        match self.store().sandbox(id).map_err(internal)? {
            Some(sandbox) => Ok(Reply::Sandbox {
                created: false,
                sandbox,
            }),
            None => Err(ApiError::NotFound(format!("no sandbox {id}"))),
        }
    }

    /// Records an API call on the sandbox and returns it.
    fn touch(&self, id: &str) -> Result<Sandbox, ApiError> {
        let store = self.store();
        store.touch(id, now_ms()).map_err(internal)?;
        store
            .sandbox(id)
            .map_err(internal)?
            .ok_or_else(|| ApiError::NotFound(format!("no sandbox {id}")))
    }

    async fn create(self: &Arc<Self>, request: CreateSandbox) -> Result<Reply, ApiError> {
        let prepared = self.prepare_create(&request)?;
        let Ok(_permit) = Arc::clone(&self.pending).try_acquire_owned() else {
            self.counters.refused();
            return Err(ApiError::Overloaded(self.options.max_pending_creates));
        };
        self.create_admitted(request, &prepared).await
    }

    /// Looks up what a create names (snapshot, template) and its TTL.
    fn prepare_create(&self, request: &CreateSandbox) -> Result<Prepared, ApiError> {
        let snapshot =
            match &request.snapshot {
                Some(id) => Some(self.store().snapshot(id).map_err(internal)?.ok_or_else(
                    || {
                        ApiError::BadRequest(format!(
                            "snapshot: no snapshot {id:?} (list them with GET /snapshots)"
                        ))
                    },
                )?),
                None => None,
            };
        let template_name = snapshot
            .as_ref()
            .map_or(request.template.as_str(), |s| s.template.as_str());
        let template = self
            .store()
            .template(template_name)
            .map_err(internal)?
            .ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "template: no template {template_name:?} (list them with GET /templates)"
                ))
            })?;
        if let Some(snapshot) = &snapshot {
            check_deterministic(request.deterministic, snapshot)?;
        }
        // A template's boot snapshot serves creates of its shape (a deterministic create only
        // a deterministic one); another shape boots.
        let snapshot = match (snapshot, &template.boot_snapshot) {
            (None, Some(boot))
                if request.vcpus.unwrap_or(template.vcpus) == template.vcpus
                    && request.memory_mib.unwrap_or(template.memory_mib) == template.memory_mib =>
            {
                self.store()
                    .snapshot(boot)
                    .map_err(internal)?
                    .filter(|s| s.deterministic || !request.deterministic)
            }
            (snapshot, _) => snapshot,
        };
        let ttl_s = request
            .ttl_s
            .or(self.options.default_ttl_s)
            .ok_or_else(|| {
                ApiError::BadRequest("ttl_s: required (this server has no --default-ttl)".into())
            })?;
        self.cgroups_for(request.cpu_limit)?;
        Ok(Prepared {
            snapshot,
            template,
            ttl_s,
        })
    }

    /// A create that holds its place among the pending creates.
    async fn create_admitted(
        &self,
        request: CreateSandbox,
        prepared: &Prepared,
    ) -> Result<Reply, ApiError> {
        let Prepared {
            snapshot,
            template,
            ttl_s,
        } = prepared;
        let (snapshot, ttl_s) = (snapshot.as_ref(), *ttl_s);
        let started = std::time::Instant::now();
        let now = now_ms();
        let id = format!("sb-{}", random_hex());
        let sandbox = Sandbox {
            id: id.clone(),
            template: template.name.clone(),
            state: State::Creating,
            vcpus: snapshot.map_or(request.vcpus.unwrap_or(template.vcpus), |s| s.vcpus),
            memory_mib: snapshot.map_or(request.memory_mib.unwrap_or(template.memory_mib), |s| {
                s.memory_mib
            }),
            labels: request.labels,
            metadata: request.metadata,
            idempotency_key: request.idempotency_key,
            created_at_ms: now,
            expires_at_ms: now.saturating_add(ttl_s.saturating_mul(1000)),
            idle_ttl_s: request.idle_ttl_s,
            last_active_at_ms: now,
            pid: None,
            pid_start_time: None,
            dir: self.sandboxes_dir.join(&id),
            ended_at_ms: None,
            end_reason: None,
            env: request.env,
            cpu_limit: request.cpu_limit,
            deterministic: request.deterministic,
        };
        let inserted = self.store().insert_sandbox(&sandbox).map_err(internal)?;
        if let Inserted::Existing(first) = inserted {
            return self.existing(*first).await;
        }
        let inserted_ms = ms_since(started);
        self.counters.created();
        match self.start_vmm(&sandbox, template, snapshot).await {
            Ok(()) => {
                if snapshot.is_none() {
                    if let Err(e) = self
                        .start_template_command(&id, template, &sandbox.env)
                        .await
                    {
                        self.counters.failed();
                        let _ = self.end(&id, State::Failed, &e.to_string()).await;
                        return Err(e);
                    }
                }
                if let Some(snapshot) = snapshot {
                    self.store()
                        .set_source(&id, &snapshot.id)
                        .map_err(internal)?;
                }
                if log::log_enabled!(log::Level::Debug) {
                    log::debug!(
                        "create {id}: inserted {inserted_ms:.2} ms, total {:.2} ms",
                        ms_since(started)
                    );
                }
                self.sandbox_reply(&id).map(|reply| match reply {
                    Reply::Sandbox { sandbox, .. } => Reply::Sandbox {
                        created: true,
                        sandbox,
                    },
                    other => other,
                })
            }
            Err(message) => {
                self.counters.failed();
                let _ = remove_dir(&sandbox.dir);
                self.store()
                    .end(&id, State::Failed, &message, now_ms())
                    .map_err(internal)?;
                Err(ApiError::Internal(format!("sandbox {id}: {message}")))
            }
        }
    }

    /// A create that repeats an idempotency key: the first sandbox, once it left `creating`.
    async fn existing(&self, mut first: Sandbox) -> Result<Reply, ApiError> {
        let deadline = std::time::Instant::now() + self.options.ready_timeout * 2;
        while first.state == State::Creating && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
            first = match self.store().sandbox(&first.id).map_err(internal)? {
                Some(s) => s,
                None => break,
            };
        }
        Ok(Reply::Sandbox {
            created: false,
            sandbox: first,
        })
    }

    /// Starts a VMM in the sandbox's directory (a boot of `template`, or a restore of
    /// `snapshot`) and waits until its VM runs; on error the VMM is gone. A restore into a new
    /// sandbox (`new_sandbox`) is a clone of the snapshot's VM: it gets a new VM generation,
    /// unless the sandbox is deterministic.
    async fn launch(
        &self,
        sandbox: &Sandbox,
        template: &Template,
        snapshot: Option<&Snapshot>,
        new_sandbox: bool,
    ) -> Result<(Child, u32, u64), String> {
        let paths = vm::Paths::new(&sandbox.dir);
        let groups = self
            .cgroups_for(sandbox.cpu_limit)
            .map_err(|e| e.to_string())?;
        // A jailed VMM's cpu group is made by its jailer (same path, with its memory and pids
        // groups); an unjailed one's by the daemon.
        let mut cpu_settings = Vec::new();
        if let (Some(groups), Some(cores)) = (groups, sandbox.cpu_limit) {
            if self.jail.is_some() {
                cpu_settings = cgroup::quota_settings(groups.version, cores);
            } else {
                groups
                    .create(&sandbox.id, cores)
                    .map_err(|e| e.to_string())?;
            }
        }
        let groups = groups.filter(|_| self.jail.is_none());
        let vmm = self.options.vmm.clone();
        let template = template.clone();
        let (vcpus, memory_mib) = (sandbox.vcpus, sandbox.memory_mib);
        let deterministic = sandbox.deterministic;
        let identity = match (deterministic, new_sandbox) {
            (true, _) => vm::Identity::Exact,
            (false, true) => vm::Identity::Clone,
            (false, false) => vm::Identity::Same,
        };
        let spawn_paths = vm::Paths::new(&sandbox.dir);
        let restore = snapshot.map(|s| s.dir.clone());
        let started = std::time::Instant::now();
        let jail = self.jail.clone();
        // Copying a rootfs may take a while: off the async threads.
        let spawned = tokio::task::spawn_blocking(move || {
            let spec = jail.as_ref().map(|jail| vm::JailSpec {
                jail,
                cgroups: cpu_settings,
                memory_mib,
            });
            match restore {
                Some(dir) => vm::spawn_restore(
                    &vmm,
                    &spawn_paths,
                    &dir,
                    template.rootfs.is_some(),
                    identity,
                    spec.as_ref(),
                ),
                None => {
                    let shape = vm::Shape {
                        template: &template,
                        vcpus,
                        memory_mib,
                        deterministic,
                    };
                    vm::spawn(&vmm, &spawn_paths, &shape, spec.as_ref())
                }
            }
        })
        .await
        .map_err(|e| e.to_string())?;
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                self.release_cgroup(sandbox);
                return Err(e.to_string());
            }
        };
        let spawn_ms = ms_since(started);
        let pid = child.id();
        if let Some(groups) = groups {
            // At once: the VMM has not created its vCPU threads yet, and those it has move too.
            if let Err(e) = groups.enter(&sandbox.id, pid) {
                reap_child(child).await;
                self.release_cgroup(sandbox);
                return Err(e.to_string());
            }
        }
        let ready = vm::wait_ready(&mut child, &paths, self.options.ready_timeout).await;
        if log::log_enabled!(log::Level::Debug) {
            log::debug!(
                "launch {}: spawn {spawn_ms:.2} ms, ready {:.2} ms",
                sandbox.id,
                ms_since(started) - spawn_ms
            );
        }
        let error = match (ready, vm::start_time(pid)) {
            (Ok(()), Some(start)) => return Ok((child, pid, start)),
            (Err(e), _) => e.to_string(),
            (Ok(()), None) => vm::VmError::Vanished(pid).to_string(),
        };
        reap_child(child).await;
        self.release_cgroup(sandbox);
        Err(error)
    }

    /// Spawns the VMM and moves the sandbox to running; on error, nothing of it is left.
    async fn start_vmm(
        &self,
        sandbox: &Sandbox,
        template: &Template,
        snapshot: Option<&Snapshot>,
    ) -> Result<(), String> {
        let (child, pid, start) = self.launch(sandbox, template, snapshot, true).await?;
        let result = {
            let store = self.store();
            match store.set_running(&sandbox.id, pid, start) {
                Ok(true) => {
                    self.children().insert(sandbox.id.clone(), child);
                    return Ok(());
                }
                Ok(false) => Err("deleted while it was being created".to_string()),
                Err(e) => Err(e.to_string()),
            }
        };
        reap_child(child).await;
        self.release_cgroup(sandbox);
        result
    }

    /// Ends a sandbox (DELETE, TTL): kills its VMM's process group, removes its directory and
    /// records `state`. Ending one that has ended already succeeds.
    async fn end(&self, id: &str, state: State, reason: &str) -> Result<(), ApiError> {
        let Some(sandbox) = self.store().sandbox(id).map_err(internal)? else {
            // Never existed, or long gone: deleting it is still success.
            return Ok(());
        };
        if !sandbox.state.is_live() {
            return Ok(());
        }
        // Record the end first: a create still in progress sees it and cleans up itself.
        self.store()
            .end(id, state, reason, now_ms())
            .map_err(internal)?;
        self.stop_vmm(id, &sandbox).await
    }

    /// Ends sandbox `id`'s VMM (by pid and start time, and the child handle if this daemon
    /// started it) and removes its directory.
    async fn stop_vmm(&self, id: &str, sandbox: &Sandbox) -> Result<(), ApiError> {
        self.record_cpu(sandbox);
        let child = self.children().remove(id);
        let dir = sandbox.dir.clone();
        let (pid, start) = (sandbox.pid, sandbox.pid_start_time);
        let id = id.to_string();
        let removed = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            if let (Some(pid), Some(start)) = (pid, start) {
                vm::kill(pid, start, Duration::from_secs(5));
            }
            if let Some(mut child) = child {
                let _ = child.kill();
                let _ = child.wait();
            }
            let killed_ms = ms_since(started);
            let removed = remove_dir(&dir);
            if log::log_enabled!(log::Level::Debug) {
                log::debug!(
                    "stop {id}: kill {killed_ms:.2} ms, remove {:.2} ms",
                    ms_since(started) - killed_ms
                );
            }
            removed
        })
        .await
        .map_err(internal)?
        .map_err(internal);
        self.release_cgroup(sandbox);
        removed
    }

    async fn pause_resume(&self, id: &str, pause: bool) -> Result<Reply, ApiError> {
        let sandbox = self.touch(id)?;
        let (from, to, word) = if pause {
            (State::Running, State::Paused, "Paused")
        } else {
            (State::Paused, State::Running, "Resumed")
        };
        if sandbox.state == to {
            return Ok(Reply::Sandbox {
                created: false,
                sandbox,
            });
        }
        if sandbox.state != from {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is {}, not {}",
                sandbox.state.as_str(),
                from.as_str()
            )));
        }
        let sock = vm::Paths::new(&sandbox.dir).api_sock;
        tokio::task::spawn_blocking(move || vm::set_vm_state(&sock, word))
            .await
            .map_err(internal)?
            .map_err(internal)?;
        if !self.store().transition(id, from, to).map_err(internal)? {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} changed state during the request"
            )));
        }
        self.sandbox_reply(id)
    }

    /// One reaper pass: VMMs that ended on their own, then TTLs.
    async fn reap(&self) -> Result<(), StoreError> {
        let live = self.store().live()?;
        let now = now_ms();
        for sandbox in live {
            if sandbox.state == State::Creating || self.is_busy(&sandbox.id) {
                continue;
            }
            let exited = {
                let mut children = self.children();
                match children.get_mut(&sandbox.id) {
                    Some(child) => match child.try_wait() {
                        Ok(Some(status)) => {
                            children.remove(&sandbox.id);
                            Some(format!("the VMM ended: {status}"))
                        }
                        _ => None,
                    },
                    None => match (sandbox.pid, sandbox.pid_start_time) {
                        (Some(pid), Some(start)) if vm::is_ours(pid, start) => None,
                        _ => Some("the VMM ended".to_string()),
                    },
                }
            };
            if let Some(mut reason) = exited {
                // Its directory goes: keep why in the record and the daemon's log.
                let tail = vm::log_tail(&vm::Paths::new(&sandbox.dir).log);
                if !tail.is_empty() {
                    reason = format!("{reason}; the end of its log: {tail}");
                }
                log::info!("sandbox {}: {reason}", sandbox.id);
                if self.store().end(&sandbox.id, State::Exited, &reason, now)? {
                    let _ = remove_dir(&sandbox.dir);
                    self.release_cgroup(&sandbox);
                }
                continue;
            }
            let idle = sandbox.idle_ttl_s.is_some_and(|idle| {
                now.saturating_sub(sandbox.last_active_at_ms) >= idle.saturating_mul(1000)
            });
            let reason = if now >= sandbox.expires_at_ms {
                "ttl: its TTL ran out"
            } else if idle {
                "idle_ttl: no API call within its idle TTL"
            } else {
                continue;
            };
            if let Err(e) = self.end(&sandbox.id, State::Expired, reason).await {
                log::warn!("reaper: cannot end {}: {e}", sandbox.id);
            }
        }
        self.enforce_retention().await
    }

    /// After a (re)start: re-attach live VMMs, fail unfinished creates, kill VMMs and remove
    /// directories that belong to no live sandbox.
    fn recover(&self) -> Result<(), DaemonError> {
        let live = self.store().live()?;
        let now = now_ms();
        let mut keep = HashMap::new();
        for sandbox in live {
            match (sandbox.state, sandbox.pid, sandbox.pid_start_time) {
                (State::Creating, _, _) => {
                    self.store().end(
                        &sandbox.id,
                        State::Failed,
                        "the daemon stopped during the create",
                        now,
                    )?;
                }
                (_, Some(pid), Some(start)) if vm::is_ours(pid, start) => {
                    keep.insert(sandbox.id.clone(), (pid, start));
                }
                _ => {
                    self.store().end(
                        &sandbox.id,
                        State::Exited,
                        "the VMM ended while the daemon was down",
                        now,
                    )?;
                }
            }
        }
        for found in vm::find_vmms(&self.sandboxes_dir) {
            if keep.get(&found.id) != Some(&(found.pid, found.start_time)) {
                log::info!(
                    "killing rollbox-vmm pid {} of no live sandbox ({})",
                    found.pid,
                    found.id
                );
                vm::kill(found.pid, found.start_time, Duration::from_secs(5));
            }
        }
        let entries =
            std::fs::read_dir(&self.sandboxes_dir).map_err(|source| DaemonError::StateDir {
                path: self.sandboxes_dir.clone(),
                source,
            })?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if !keep.contains_key(&name) {
                let _ = remove_dir(&entry.path());
            }
        }
        if let Ok(groups) = &self.cgroups {
            for name in groups.reap(|name| keep.contains_key(name)) {
                log::info!("removed cgroup {name} of no live sandbox");
            }
        }
        if let Some(jail) = &self.jail {
            for (id, dir) in rollbox_jailer::all_jail_groups(&jail.cgroup_fs, &jail.cgroup_parent) {
                if !keep.contains_key(&id) && rollbox_jailer::remove_group(&dir).is_ok() {
                    log::info!("removed jail cgroup {} of no live sandbox", dir.display());
                }
            }
        }
        // Snapshot directories of no recorded snapshot (a daemon killed mid-snapshot).
        let recorded: std::collections::HashSet<PathBuf> = self
            .store()
            .snapshots(None)?
            .into_iter()
            .map(|s| s.dir)
            .collect();
        if let Ok(entries) = std::fs::read_dir(&self.snapshots_dir) {
            for entry in entries.flatten() {
                if !recorded.contains(&entry.path()) {
                    let _ = remove_dir(&entry.path());
                }
            }
        }
        if !keep.is_empty() {
            log::info!("re-attached {} running sandboxes", keep.len());
        }
        Ok(())
    }
}

impl Daemon {
    /// The cgroups a create with `cpu_limit` needs; a clear 503 where the host has none.
    fn cgroups_for(&self, cpu_limit: Option<f64>) -> Result<Option<&cgroup::Cgroups>, ApiError> {
        match (cpu_limit, &self.cgroups) {
            (None, _) => Ok(None),
            (Some(_), Ok(groups)) => Ok(Some(groups)),
            (Some(_), Err(why)) => Err(ApiError::Unavailable(why.clone())),
        }
    }

    /// Removes a sandbox's cgroup after its VMM ended (logged on failure).
    fn release_cgroup(&self, sandbox: &Sandbox) {
        // A jailer that was killed left its groups (cpu, memory, pids): they go here.
        if let Some(jail) = &self.jail {
            for e in rollbox_jailer::remove_jail_groups(
                &jail.cgroup_fs,
                &jail.cgroup_parent,
                &sandbox.id,
            ) {
                log::warn!("sandbox {}: {e}", sandbox.id);
            }
        }
        if sandbox.cpu_limit.is_none() {
            return;
        }
        if let Ok(groups) = &self.cgroups {
            if let Err(e) = groups.remove(&sandbox.id) {
                log::warn!("sandbox {}: {e}", sandbox.id);
            }
        }
    }
}

/// Kills a VMM this daemon started and waits for it, off the async threads.
async fn reap_child(mut child: Child) {
    let _ = child.kill();
    let _ = tokio::task::spawn_blocking(move || child.wait()).await;
}

fn remove_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn ms_since(start: std::time::Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
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
    let state_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DaemonError::StateDir { path, source }
    };
    std::fs::create_dir_all(&options.state_dir).map_err(state_error(&options.state_dir))?;
    let state_dir =
        std::fs::canonicalize(&options.state_dir).map_err(state_error(&options.state_dir))?;
    let sandboxes_dir = state_dir.join("sandboxes");
    std::fs::create_dir_all(&sandboxes_dir).map_err(state_error(&sandboxes_dir))?;
    let snapshots_dir = state_dir.join("snapshots");
    std::fs::create_dir_all(&snapshots_dir).map_err(state_error(&snapshots_dir))?;
    let templates_dir = state_dir.join("templates");
    std::fs::create_dir_all(&templates_dir).map_err(state_error(&templates_dir))?;
    // The longest socket path: DIR/sb-XXXXXXXXXXXXXXXX/vsock.sock_PORT (up to 5 digits).
    if sandboxes_dir.as_os_str().len() + "/sb-0123456789abcdef/vsock.sock_65535".len() >= 108 {
        return Err(DaemonError::PathTooLong(sandboxes_dir));
    }
    let store = Store::open(&state_dir.join("state.db"))?;
    let cgroup_fs = options.cgroup_fs.clone();
    let jail = options
        .jailer
        .as_ref()
        .map(|jailer| jail_of(jailer, &cgroup_fs, &state_dir))
        .transpose()?;
    let daemon = Arc::new(Daemon {
        pending: Arc::new(tokio::sync::Semaphore::new(options.max_pending_creates)),
        options,
        sandboxes_dir,
        store: Db::new(store),
        children: Mutex::new(HashMap::new()),
        processes: Mutex::new(HashMap::new()),
        busy: Mutex::new(std::collections::HashSet::new()),
        snapshots_dir,
        templates_dir,
        counters: usage::Counters::default(),
        cgroups: cgroup::Cgroups::find(&cgroup_fs, &cgroup::root_name(&state_dir))
            .map_err(|e| e.to_string()),
        jail,
    });
    daemon.recover()?;
    // The E2B listener first: its TLS files are the likelier to be wrong.
    let e2b_listener = daemon.options.e2b.as_ref().map(e2b::bind).transpose()?;
    let listener = http::Listener::bind(&daemon.options.listen)?;
    let e2b_server = e2b_listener
        .zip(daemon.options.e2b.clone())
        .map(|(bound, options)| {
            log::info!("E2B API on {}", bound.describe());
            tokio::spawn(e2b::run(bound, Arc::clone(&daemon), options))
        });
    let reaper = {
        let daemon = Arc::clone(&daemon);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(daemon.options.reap_interval);
            loop {
                tick.tick().await;
                if let Err(e) = daemon.reap().await {
                    log::error!("reaper: {e}");
                }
            }
        })
    };
    log::info!("listening on {}", listener.describe());
    let result = http::run(listener, Arc::clone(&daemon), shutdown).await;
    reaper.abort();
    if let Some(e2b_server) = e2b_server {
        e2b_server.abort();
    }
    if let Listen::Unix(path) = &daemon.options.listen {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// A deterministic sandbox restores only snapshots of deterministic sandboxes: another's CPUID
/// offers RDRAND, whose values no restore can repeat.
fn check_deterministic(deterministic: bool, snapshot: &Snapshot) -> Result<(), ApiError> {
    if deterministic && !snapshot.deterministic {
        return Err(ApiError::BadRequest(format!(
            "deterministic: snapshot {} was taken of a sandbox that is not deterministic (its CPUID offers RDRAND); create a deterministic sandbox, snapshot it, and restore that",
            snapshot.id
        )));
    }
    Ok(())
}
