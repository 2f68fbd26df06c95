//! The sandboxes service: create (a boot of a template or a restore of a snapshot, at most
//! `--max-pending-creates` at once), look up, keep alive, pause and resume, and end sandboxes;
//! batches are in `batch.rs`, the reaper and the recovery after a restart in `reaper.rs`. The
//! VMMs themselves are the [`Supervisor`]'s.

mod batch;
mod pool;
mod reaper;

use std::sync::Arc;
use std::time::Duration;

use super::api::{
    ApiError, CreateSandbox, NetworkRequest, OnTimeout, Reply, Sandbox, SandboxList, Snapshot,
    State, Template, PAUSED_RETENTION_S,
};
use super::gpus::inventory::sysfs_path;
use super::gpus::Gpus;
use super::guest::Guest;
use super::networks::Networks;
use super::node::Node;
use super::store::StoreError;
use super::store::{Db, Inserted};
use super::supervisor::virtiofsd::VolumeSource;
use super::supervisor::{self, Shell, ShellShape, Supervisor, SupervisorError};
use super::usage::Counters;
use super::util::{internal, ms_since, now_ms, random_hex, remove_dir, sandbox_reply, touch};
use super::volumes::Volumes;

use pool::WarmPool;
pub use pool::{parse_shape, with_default as warm_pool_with_default, PoolSpec};

/// The TTL a resumed `on_timeout: pause` sandbox gets when its row has no create TTL (rows
/// of daemons before the column) and the daemon no `--default-ttl`.
const DEFAULT_RESUME_TTL_S: u64 = 300;

/// Why the sandboxes could not be recovered after a restart.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
}

/// What the sandboxes service is given.
pub struct SandboxOptions {
    /// TTL for creates that give none; without it `ttl_s` is required.
    pub default_ttl_s: Option<u64>,
    pub max_pending_creates: usize,
    /// How long a new VMM may take to open its API socket (a repeated create waits twice that
    /// for the first).
    pub ready_timeout: Duration,
    /// `--kubelet-pods-dir`: sandboxes labelled with a pod's UID end once the kubelet has
    /// removed that pod's directory here.
    pub kubelet_pods_dir: Option<std::path::PathBuf>,
    /// `--warm-pool`: the VMM shells kept ready.
    pub warm_pool: Vec<PoolSpec>,
}

/// What a sandbox may have attached: volumes, GPUs and a network.
pub struct Attachable {
    pub volumes: Arc<Volumes>,
    pub gpus: Arc<Gpus>,
    pub networks: Arc<Networks>,
}

/// The sandboxes.
pub struct Sandboxes {
    db: Arc<Db>,
    supervisor: Arc<Supervisor>,
    /// Runs templates' start and ready commands after a boot.
    guest: Arc<Guest>,
    counters: Arc<Counters>,
    /// Admission against the node's limits, and drain.
    node: Arc<Node>,
    /// Where the volumes a sandbox mounts are.
    volumes: Arc<Volumes>,
    /// The node's GPUs and their holders.
    gpus: Arc<Gpus>,
    /// Taps, addresses and egress rules.
    networks: Arc<Networks>,
    options: SandboxOptions,
    pending: Arc<tokio::sync::Semaphore>,
    /// `--warm-pool`'s shells; None without the flag.
    pool: Option<Arc<WarmPool>>,
}

/// What [`Sandboxes::prepare`] found for a create.
struct Prepared {
    snapshot: Option<Snapshot>,
    template: Template,
    ttl_s: u64,
    /// The mounts (the snapshot's, for a restore) and their directories.
    volumes: Vec<VolumeSource>,
    /// Its network, if it gets one.
    network: Option<NetworkRequest>,
}

/// A deterministic sandbox restores only snapshots of deterministic sandboxes: another's CPUID
/// offers RDRAND, whose values no restore can repeat.
pub fn check_deterministic(deterministic: bool, snapshot: &Snapshot) -> Result<(), ApiError> {
    if deterministic && !snapshot.deterministic {
        return Err(ApiError::BadRequest(format!(
            "deterministic: snapshot {} was taken of a sandbox that is not deterministic (its CPUID offers RDRAND); create a deterministic sandbox, snapshot it, and restore that",
            snapshot.id
        )));
    }
    Ok(())
}

impl Sandboxes {
    pub fn new(
        db: Arc<Db>,
        supervisor: Arc<Supervisor>,
        guest: Arc<Guest>,
        counters: Arc<Counters>,
        node: Arc<Node>,
        attachable: Attachable,
        options: SandboxOptions,
    ) -> Sandboxes {
        let Attachable {
            volumes,
            gpus,
            networks,
        } = attachable;
        let pool = WarmPool::new(&options.warm_pool).map(Arc::new);
        Sandboxes {
            volumes,
            gpus,
            networks,
            pool,
            pending: Arc::new(tokio::sync::Semaphore::new(options.max_pending_creates)),
            db,
            supervisor,
            guest,
            counters,
            node,
            options,
        }
    }

    /// The warm pool's refill, to run until the daemon stops (None without `--warm-pool`).
    pub fn warm_pool_refill(
        &self,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let pool = Arc::clone(self.pool.as_ref()?);
        let (supervisor, node) = (Arc::clone(&self.supervisor), Arc::clone(&self.node));
        let room = Arc::clone(&node);
        let db = Arc::clone(&self.db);
        Some(pool.refill(
            supervisor,
            move || node.sandbox_id(&random_hex()),
            move || template_shapes(&db),
            move |count, memory_mib| room.has_room_for(count, memory_mib),
        ))
    }

    /// Tells the warm pool's refill to end (the daemon stops); it ends after the shell it may
    /// be starting.
    pub fn stop_warm_pool_refill(&self) {
        if let Some(pool) = &self.pool {
            pool.stop_refill();
        }
    }

    /// Ends the warm pool's ready shells (the daemon stops, the refill ended).
    pub async fn close_warm_pool(&self) {
        if let Some(pool) = &self.pool {
            pool.close(&self.supervisor).await;
        }
    }

    /// GET /node's `warm_pool`.
    pub fn warm_pool_status(&self) -> Vec<super::api::WarmPoolShape> {
        self.pool.as_ref().map(|p| p.status()).unwrap_or_default()
    }

    /// A warm shell for this create, when it is a restore that one can run: no network,
    /// volumes, GPUs or CPU limit (each is given to a VMM as it starts), and a shell of its
    /// template or its size that was made for its disk and shared base.
    fn shell_for(&self, request: &CreateSandbox, prepared: &Prepared) -> Option<Shell> {
        let pool = self.pool.as_ref()?;
        let snapshot = prepared.snapshot.as_ref()?;
        let plain = prepared.network.is_none()
            && prepared.volumes.is_empty()
            && request.gpu.is_none()
            && request.cpu_limit.is_none();
        if !plain {
            return None;
        }
        let template = &prepared.template;
        let (memory_mib, disk_bytes) = Supervisor::restore_needs(template, snapshot)?;
        pool.take(
            &template.name,
            memory_mib,
            disk_bytes,
            template.base_rootfs.as_deref(),
        )
    }

    /// A shell whose sandbox was never made: back to the pool.
    fn return_shell(&self, shell: Option<Shell>) {
        if let (Some(pool), Some(shell)) = (&self.pool, shell) {
            pool.put_back(shell);
        }
    }

    /// Refuses `count` new sandboxes of `memory_mib` each that the node has no room for, or
    /// any while it drains (a fork's check before its snapshot).
    pub fn check_room(&self, count: u32, memory_mib: u32) -> Result<(), ApiError> {
        let checked = self
            .node
            .check_room(u64::from(count), u64::from(memory_mib));
        if checked.is_err() {
            self.counters.refused();
        }
        checked
    }

    /// GET /sandboxes.
    pub fn list(&self, query: &super::api::ListQuery) -> Result<Reply, ApiError> {
        let (sandboxes, next_page_token) = self.db.lock().list(query).map_err(internal)?;
        Ok(Reply::Sandboxes(SandboxList {
            sandboxes,
            next_page_token,
        }))
    }

    /// GET /sandboxes/{id} (an API call on it, for its idle TTL).
    pub fn get(&self, id: &str) -> Result<Reply, ApiError> {
        let sandbox = touch(&self.db, id)?;
        Ok(Reply::Sandbox {
            created: false,
            sandbox,
        })
    }

    /// Sets the TTL to `ttl_s` from now.
    pub fn keepalive(&self, id: &str, ttl_s: u64) -> Result<Reply, ApiError> {
        touch(&self.db, id)?;
        let expires = now_ms().saturating_add(ttl_s.saturating_mul(1000));
        if !self.db.lock().set_expiry(id, expires).map_err(internal)? {
            return Err(ApiError::Conflict(format!("sandbox {id} has ended")));
        }
        sandbox_reply(&self.db, id)
    }

    pub async fn create(&self, request: CreateSandbox) -> Result<Reply, ApiError> {
        let prepared = self.prepare(&request)?;
        let Ok(_permit) = Arc::clone(&self.pending).try_acquire_owned() else {
            self.counters.refused();
            return Err(ApiError::Overloaded(self.options.max_pending_creates));
        };
        self.admitted(request, &prepared).await
    }

    /// Looks up what a create names (snapshot, template) and its TTL.
    fn prepare(&self, request: &CreateSandbox) -> Result<Prepared, ApiError> {
        let snapshot =
            match &request.snapshot {
                Some(id) => Some(self.db.lock().snapshot(id).map_err(internal)?.ok_or_else(
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
            .db
            .lock()
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
        // A template's boot snapshot serves creates of its shape and volumes (a deterministic
        // create only a deterministic one) without a GPU; another shape boots.
        // A create without volumes mounts its template's, and without a network gets its
        // template's.
        let wanted = if request.volumes.is_empty() {
            &template.volumes
        } else {
            &request.volumes
        };
        let wanted_network = match (&request.network, &template.network) {
            (Some(asked), Some(base)) => Some(asked.over(base)),
            (asked, base) => asked.clone().or_else(|| base.clone()),
        };
        let snapshot = match (snapshot, &template.boot_snapshot) {
            (None, Some(boot))
                if *wanted == template.volumes
                    && request.gpu.is_none()
                    && request.vcpus.unwrap_or(template.vcpus) == template.vcpus
                    && request.memory_mib.unwrap_or(template.memory_mib) == template.memory_mib =>
            {
                self.db
                    .lock()
                    .snapshot(boot)
                    .map_err(internal)?
                    .filter(|s| s.deterministic || !request.deterministic)
                    // A network interface is in the snapshot or not: one that differs boots.
                    .filter(|s| s.network.is_some() == wanted_network.is_some())
            }
            (snapshot, _) => snapshot,
        };
        let network = match (&request.snapshot, &snapshot) {
            (Some(_), Some(s)) => match (&s.network, &request.network) {
                (Some(egress), asked) => {
                    // The snapshot's egress and exposed ports, unless the create names others.
                    let recorded = NetworkRequest {
                        egress: Some(egress.clone()),
                        expose: s.expose.clone(),
                    };
                    Some(asked.as_ref().map_or(recorded.clone(), |a| a.over(&recorded)))
                }
                (None, Some(_)) => {
                    return Err(ApiError::BadRequest(format!(
                        "network: snapshot {} was taken of a sandbox without a network, and a restore cannot add a network interface; create from its template (a boot) instead",
                        s.id
                    )))
                }
                (None, None) => None,
            },
            _ => wanted_network,
        };
        let ttl_s = request
            .ttl_s
            .or(self.options.default_ttl_s)
            .ok_or_else(|| {
                ApiError::BadRequest("ttl_s: required (this server has no --default-ttl)".into())
            })?;
        self.supervisor
            .cgroups_for(request.cpu_limit)
            .map_err(ApiError::Unavailable)?;
        if let Some(gpu) = &request.gpu {
            self.gpus.check(gpu)?;
        }
        if let Some(network) = &network {
            self.networks.check(network)?;
        }
        let mounts = snapshot.as_ref().map_or(wanted, |s| &s.volumes);
        let volumes = self.mounts(mounts, request.tenant.as_deref())?;
        Ok(Prepared {
            snapshot,
            template,
            ttl_s,
            volumes,
            network,
        })
    }

    /// The directories of `mounts`, when this server can serve volumes.
    pub fn mounts(
        &self,
        mounts: &[super::api::VolumeMount],
        tenant: Option<&str>,
    ) -> Result<Vec<VolumeSource>, ApiError> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        self.supervisor
            .volumes_available()
            .map_err(ApiError::Unavailable)?;
        self.volumes.resolve(mounts, tenant)
    }

    /// A create that holds its place among the pending creates.
    async fn admitted(
        &self,
        request: CreateSandbox,
        prepared: &Prepared,
    ) -> Result<Reply, ApiError> {
        let started = std::time::Instant::now();
        // A warm shell was started under the id of the sandbox it becomes.
        let shell = self.shell_for(&request, prepared);
        let id = match &shell {
            Some(shell) => shell.id.clone(),
            None => self.node.sandbox_id(&random_hex()),
        };
        let gpus = match &request.gpu {
            Some(gpu) => self
                .gpus
                .claim_waiting(&id, gpu)
                .await
                .inspect_err(|_| self.counters.refused())?,
            None => Vec::new(),
        };
        let result = self
            .admitted_with(request, prepared, id.clone(), gpus, started, shell)
            .await;
        if result.is_err() {
            self.gpus.release(&id);
        }
        result
    }

    /// [`Sandboxes::admitted`] once the sandbox's id is chosen and its GPUs are held.
    async fn admitted_with(
        &self,
        request: CreateSandbox,
        prepared: &Prepared,
        id: String,
        gpus: Vec<String>,
        started: std::time::Instant,
        shell: Option<Shell>,
    ) -> Result<Reply, ApiError> {
        let Prepared {
            snapshot,
            template,
            ttl_s,
            volumes,
            network,
        } = prepared;
        let (snapshot, ttl_s) = (snapshot.as_ref(), *ttl_s);
        let now = now_ms();
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
            dir: self.supervisor.sandboxes_dir().join(&id),
            ended_at_ms: None,
            end_reason: None,
            env: request.env,
            cpu_limit: request.cpu_limit,
            deterministic: request.deterministic,
            on_timeout: request.on_timeout,
            auto_resume: request.auto_resume,
            ttl_s,
            tenant: request.tenant,
            volumes: volumes.iter().map(|v| v.mount.clone()).collect(),
            gpus,
            network: None,
        };
        let insert = || self.db.lock().insert_sandbox(&sandbox).map_err(internal);
        let admitted = self.node.admit(u64::from(sandbox.memory_mib), || {
            match (&self.pool, &shell) {
                // The shell counts as the pool's until the row does (its room, no more).
                (Some(pool), Some(shell)) => {
                    pool.insert_for(shell, insert, |i| matches!(i, Inserted::New))
                }
                _ => insert(),
            }
        });
        let inserted = match admitted {
            Ok(inserted) => inserted,
            Err(refused @ (ApiError::Full { .. } | ApiError::Unavailable(_))) => {
                // Its id was not used: a shell waits for the next create.
                self.return_shell(shell);
                // A repeat of a create that succeeded is answered even on a full node.
                let earlier = self
                    .db
                    .lock()
                    .created_with_key(&sandbox)
                    .map_err(internal)?;
                if let Some(first) = earlier {
                    return self.existing(first).await;
                }
                self.counters.refused();
                return Err(refused);
            }
            Err(other) => {
                self.return_shell(shell);
                return Err(other);
            }
        };
        if let Inserted::Existing(first) = inserted {
            self.return_shell(shell);
            // The first create holds its own GPUs, if any.
            self.gpus.release(&id);
            return self.existing(*first).await;
        }
        let inserted_ms = ms_since(started);
        self.counters.created();
        // From here the id is the sandbox's: a shell that is not used ends with it.
        let failed_early = |shell: Option<Shell>| async move {
            if let Some(shell) = shell {
                self.supervisor.discard_shell(shell).await;
            }
        };
        if let Some(snapshot) = snapshot {
            // Recorded before the restore: snapshot retention keeps the source of a sandbox
            // that is still `creating`.
            let recorded = self.db.lock().set_source(&id, &snapshot.id);
            if let Err(e) = recorded {
                failed_early(shell).await;
                let message = format!("recording its snapshot: {e}");
                self.counters.failed();
                self.db
                    .lock()
                    .end(&id, State::Failed, &message, now_ms())
                    .map_err(internal)?;
                return Err(ApiError::Internal(format!("sandbox {id}: {message}")));
            }
        }
        let nic = match network {
            Some(network) => match self.make_network(&id, network).await {
                Ok(nic) => Some(nic),
                Err(e) => {
                    failed_early(shell).await;
                    self.counters.failed();
                    let _ = self
                        .db
                        .lock()
                        .end(&id, State::Failed, &e.to_string(), now_ms());
                    return Err(e);
                }
            },
            None => None,
        };
        match self
            .start_vmm(&sandbox, template, snapshot, volumes.clone(), nic, shell)
            .await
        {
            Ok(()) => {
                let ready = if snapshot.is_none() {
                    self.guest
                        .start_template_command(&id, template, &sandbox.env)
                        .await
                } else {
                    // A restore's guest still has its snapshot's address.
                    self.readdress(&id).await
                };
                if let Err(e) = ready {
                    self.counters.failed();
                    let _ = self.end(&id, State::Failed, &e.to_string()).await;
                    return Err(e);
                }
                if log::log_enabled!(log::Level::Debug) {
                    log::debug!(
                        "create {id}: inserted {inserted_ms:.2} ms, total {:.2} ms",
                        ms_since(started)
                    );
                }
                sandbox_reply(&self.db, &id).map(|reply| match reply {
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
                self.release_network(&id).await;
                self.db
                    .lock()
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
            first = match self.db.lock().sandbox(&first.id).map_err(internal)? {
                Some(s) => s,
                None => break,
            };
        }
        Ok(Reply::Sandbox {
            created: false,
            sandbox: first,
        })
    }

    /// Makes sandbox `id`'s network and records it; on error none is left.
    async fn make_network(
        &self,
        id: &str,
        request: &NetworkRequest,
    ) -> Result<supervisor::vm::Nic, ApiError> {
        let networks = Arc::clone(&self.networks);
        let (owned_id, request) = (id.to_string(), request.clone());
        let made = tokio::task::spawn_blocking(move || networks.make(&owned_id, &request))
            .await
            .map_err(internal)??;
        let recorded = self.db.lock().set_network(id, &made.network, true);
        match recorded {
            Ok(true) => Ok(supervisor::vm::Nic {
                tap: made.network.tap,
                mac: made.network.mac,
                file: made.tap,
                kernel_ip_arg: made.kernel_ip_arg,
            }),
            Ok(false) => {
                self.release_network(id).await;
                Err(ApiError::Conflict(format!(
                    "sandbox {id} was deleted while it was being created"
                )))
            }
            Err(e) => {
                self.release_network(id).await;
                Err(internal(e))
            }
        }
    }

    /// PATCH /sandboxes/{id}/network: a live sandbox's new egress policy, in force at once
    /// for new connections.
    pub async fn set_network(&self, id: &str, request: &NetworkRequest) -> Result<Reply, ApiError> {
        let sandbox = touch(&self.db, id)?;
        if !sandbox.state.is_live() {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is {}",
                sandbox.state.as_str()
            )));
        }
        let Some(mut network) = sandbox.network else {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} has no network (a create with `network` gives it one); its egress cannot change"
            )));
        };
        let egress = self.networks.egress(request)?;
        let networks = Arc::clone(&self.networks);
        let (owned_id, new_egress) = (id.to_string(), egress.clone());
        tokio::task::spawn_blocking(move || networks.set_egress(&owned_id, &new_egress))
            .await
            .map_err(internal)??;
        network.egress = egress.to_string();
        self.db
            .lock()
            .set_network(id, &network, false)
            .map_err(internal)?;
        sandbox_reply(&self.db, id)
    }

    /// The sandbox's tap attached again, for a new VMM of the same sandbox (a reset).
    pub async fn reattach_network(
        &self,
        sandbox: &Sandbox,
    ) -> Result<Option<supervisor::vm::Nic>, ApiError> {
        let Some(network) = sandbox.network.clone() else {
            return Ok(None);
        };
        let networks = Arc::clone(&self.networks);
        let id = sandbox.id.clone();
        let file = tokio::task::spawn_blocking(move || networks.attach(&id, &network.tap))
            .await
            .map_err(internal)??;
        Ok(sandbox.network.as_ref().map(|network| supervisor::vm::Nic {
            tap: network.tap.clone(),
            mac: network.mac.clone(),
            file,
            // For a reset that boots: the same address.
            kernel_ip_arg: crate::net::kernel_ip_arg(
                network.address,
                network.gateway,
                network.prefix_len,
                network.dns,
            ),
        }))
    }

    /// After a restore: gives the guest its sandbox's own address, MAC, gateway and DNS
    /// (the agent's `configure_network`), if the sandbox has a network.
    pub async fn readdress(&self, id: &str) -> Result<(), ApiError> {
        let sandbox = touch(&self.db, id)?;
        match &sandbox.network {
            Some(network) => self.guest.configure_network(id, network).await,
            None => Ok(()),
        }
    }

    /// Removes sandbox `id`'s network, if it has one (off the async threads: nft and ioctls).
    async fn release_network(&self, id: &str) {
        let networks = Arc::clone(&self.networks);
        let id = id.to_string();
        let _ = tokio::task::spawn_blocking(move || networks.release(&id)).await;
    }

    /// Spawns the VMM and moves the sandbox to running; on error, nothing of it is left.
    async fn start_vmm(
        &self,
        sandbox: &Sandbox,
        template: &Template,
        snapshot: Option<&Snapshot>,
        volumes: Vec<VolumeSource>,
        nic: Option<supervisor::vm::Nic>,
        shell: Option<Shell>,
    ) -> Result<(), String> {
        let vfio = sandbox.gpus.iter().map(|bdf| sysfs_path(bdf)).collect();
        let launched = match (shell, snapshot) {
            (Some(shell), Some(snapshot)) => {
                self.supervisor
                    .launch_in_shell(shell, sandbox, template, snapshot)
                    .await?
            }
            (shell, _) => {
                if let Some(shell) = shell {
                    self.supervisor.discard_shell(shell).await;
                }
                self.supervisor
                    .launch(sandbox, template, snapshot, true, volumes, vfio, nic)
                    .await?
            }
        };
        let result = {
            let store = self.db.lock();
            match store.set_running(&sandbox.id, launched.pid, launched.start) {
                Ok(true) => {
                    self.supervisor.adopt(&sandbox.id, launched);
                    return Ok(());
                }
                Ok(false) => Err("deleted while it was being created".to_string()),
                Err(e) => Err(e.to_string()),
            }
        };
        launched.reap().await;
        self.supervisor.release(sandbox);
        result
    }

    /// Ends a sandbox (DELETE, TTL): kills its VMM's process group, removes its directory and
    /// records `state`. Ending one that has ended already succeeds.
    pub async fn end(&self, id: &str, state: State, reason: &str) -> Result<(), ApiError> {
        let Some(sandbox) = self.db.lock().sandbox(id).map_err(internal)? else {
            // Never existed, or long gone: deleting it is still success.
            return Ok(());
        };
        if !sandbox.state.is_live() {
            return Ok(());
        }
        // Record the end first: a create still in progress sees it and cleans up itself.
        self.db
            .lock()
            .end(id, state, reason, now_ms())
            .map_err(internal)?;
        // Its id is never used again: its cgroups may go after the answer.
        let stopped = self
            .stop_vmm(id, &sandbox, supervisor::Release::Later)
            .await;
        if sandbox.network.is_some() {
            self.release_network(id).await;
        }
        stopped
    }

    /// Records the CPU time of sandbox `id`'s VMM, then has the supervisor end it, remove its
    /// directory and release its cgroups (`release`).
    pub async fn stop_vmm(
        &self,
        id: &str,
        sandbox: &Sandbox,
        release: supervisor::Release,
    ) -> Result<(), ApiError> {
        if let (Some(pid), Some(start)) = (sandbox.pid, sandbox.pid_start_time) {
            if let Some(ms) = supervisor::cpu_ms(pid, start) {
                let _ = self.db.lock().add_cpu_ms(&sandbox.id, ms);
            }
        }
        let stopped = self
            .supervisor
            .stop(id, sandbox, release)
            .await
            .map_err(ApiError::Internal);
        self.gpus.release(id);
        stopped
    }

    pub async fn pause_resume(&self, id: &str, pause: bool) -> Result<Reply, ApiError> {
        let sandbox = touch(&self.db, id)?;
        let (from, to) = if pause {
            (State::Running, State::Paused)
        } else {
            (State::Paused, State::Running)
        };
        if sandbox.state == to {
            // The store has it there already; its VMM may not (a daemon killed mid-snapshot
            // leaves it paused): make the VMM agree, unless a snapshot or reset holds it now.
            if let Some(_busy) = self.supervisor.claim(id) {
                self.reconcile_vmm(&sandbox).await;
            }
            return Ok(Reply::Sandbox {
                created: false,
                sandbox,
            });
        }
        if pause && !sandbox.gpus.is_empty() {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} holds GPU {}: a VM with a device passed through cannot be paused or snapshotted (its state is in the device)",
                sandbox.gpus.join(", ")
            )));
        }
        if sandbox.state != from {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is {}, not {}",
                sandbox.state.as_str(),
                from.as_str()
            )));
        }
        supervisor::set_paused(&sandbox.dir, pause)
            .await
            .map_err(ApiError::Internal)?;
        if !self.db.lock().transition(id, from, to).map_err(internal)? {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} changed state during the request"
            )));
        }
        if sandbox.on_timeout == OnTimeout::Pause {
            // Paused, it is kept PAUSED_RETENTION_S; resumed, it has its create TTL again.
            let ttl_s = if pause {
                PAUSED_RETENTION_S
            } else if sandbox.ttl_s > 0 {
                sandbox.ttl_s
            } else {
                self.options.default_ttl_s.unwrap_or(DEFAULT_RESUME_TTL_S)
            };
            let expires = now_ms().saturating_add(ttl_s.saturating_mul(1000));
            self.db.lock().set_expiry(id, expires).map_err(internal)?;
        }
        sandbox_reply(&self.db, id)
    }
}

/// The shell shape of each template with a boot snapshot (`--warm-pool templates=N`): its
/// snapshot's memory and disk, and its shared base.
fn template_shapes(db: &Db) -> Vec<ShellShape> {
    // The rows under the store's lock; the disks' sizes (a stat each) after it.
    let with_snapshots: Vec<(Template, Snapshot)> = {
        let store = db.lock();
        let Ok(templates) = store.templates() else {
            return Vec::new();
        };
        templates
            .into_iter()
            .filter_map(|template| {
                let boot = template.boot_snapshot.as_deref()?;
                let snapshot = store.snapshot(boot).ok().flatten()?;
                Some((template, snapshot))
            })
            .collect()
    };
    with_snapshots
        .into_iter()
        .filter_map(|(template, snapshot)| {
            let (memory_mib, disk_bytes) = Supervisor::restore_needs(&template, &snapshot)?;
            Some(ShellShape {
                memory_mib,
                vcpus: snapshot.vcpus,
                disk_bytes,
                base: template.base_rootfs.clone(),
                template: Some(template.name),
            })
        })
        .collect()
}
