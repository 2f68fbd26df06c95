//! The snapshots service: snapshots of running sandboxes (the VMM's Full snapshot into a
//! daemon-owned directory), fork (a fresh snapshot, then one restore per new sandbox) and reset
//! (same id, a new VMM restored from a snapshot, or booted afresh); export and import
//! ([`transfer`]) move snapshots between nodes.

pub mod archive;
mod transfer;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use super::api::{ApiError, CreateSandbox, ForkResult, Reply, Snapshot, State};
use super::node::Node;
use super::retention::{Pin, Retention};
use super::sandboxes::{check_deterministic, Sandboxes};
use super::store::{Db, StoreError};
use super::supervisor::snapshot::Resume;
use super::supervisor::{self, Busy, Release, Supervisor};
use super::util::{internal, ms_since, now_ms, random_hex, remove_dir, sandbox_reply, touch};

/// The snapshots.
pub struct Snapshots {
    db: Arc<Db>,
    supervisor: Arc<Supervisor>,
    sandboxes: Arc<Sandboxes>,
    retention: Arc<Retention>,
    /// The node: its id and CPU go with exports, and imports are checked against them.
    node: Arc<Node>,
    /// `STATE/snapshots`: one directory per snapshot.
    dir: PathBuf,
    /// Test only (`--test-hold-snapshot FILE`): once a snapshot's files are written, with the
    /// VM still paused and nothing recorded, write FILE and wait until it is removed (so a test
    /// can kill the daemon there).
    hold: Option<PathBuf>,
}

/// A snapshot just taken, pinned against retention while the caller uses it.
struct Taken<'a> {
    snapshot: Snapshot,
    pin: Pin<'a>,
    /// How long the sandbox's VM was paused for it (None: it was paused already).
    paused_ms: Option<f64>,
}

/// Who a snapshot is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// A user's (POST /sandboxes/{id}/snapshots) or a template's boot snapshot.
    Kept,
    /// A fork's: it goes with its last clone, or at `--fork-snapshot-ttl`.
    Fork,
}

impl Snapshots {
    pub fn new(
        db: Arc<Db>,
        supervisor: Arc<Supervisor>,
        sandboxes: Arc<Sandboxes>,
        retention: Arc<Retention>,
        node: Arc<Node>,
        dir: PathBuf,
        hold: Option<PathBuf>,
    ) -> Snapshots {
        Snapshots {
            db,
            supervisor,
            sandboxes,
            retention,
            node,
            dir,
            hold,
        }
    }

    /// Holds the sandbox's VMM for a snapshot or a reset.
    fn claim(&self, id: &str) -> Result<Busy<'_>, ApiError> {
        self.supervisor.claim(id).ok_or_else(|| {
            ApiError::Conflict(format!(
                "sandbox {id} is being snapshotted or reset; retry when that is done"
            ))
        })
    }

    /// A snapshot's name (its request `field`) must be no template's: E2B creates from a
    /// snapshot by its name in `templateID`, one namespace.
    fn name_is_free(&self, name: &str, field: &str) -> Result<(), ApiError> {
        if self.db.lock().template(name).map_err(internal)?.is_some() {
            return Err(ApiError::Conflict(format!(
                "{field}: {name:?} is a template's name on this node; give the snapshot another"
            )));
        }
        Ok(())
    }

    /// GET /snapshots (of one sandbox when given).
    pub fn list(&self, sandbox: Option<&str>) -> Result<Reply, ApiError> {
        Ok(Reply::Snapshots(
            self.db.lock().snapshots(sandbox).map_err(internal)?,
        ))
    }

    /// A snapshot by id, else by name.
    pub fn get(&self, id: &str) -> Result<Reply, ApiError> {
        let found = {
            let store = self.db.lock();
            match store.snapshot(id).map_err(internal)? {
                Some(snapshot) => Some(snapshot),
                None => store.snapshot_named(id, None).map_err(internal)?,
            }
        };
        match found {
            Some(snapshot) => Ok(Reply::Snapshot {
                created: false,
                snapshot,
            }),
            None => Err(ApiError::NotFound(format!("no snapshot {id}"))),
        }
    }

    /// Pauses the VM (if it runs), takes a Full snapshot and a copy of its rootfs, and resumes
    /// it, or ends it when `stop`.
    pub async fn snapshot(
        &self,
        id: &str,
        stop: bool,
        ttl_s: Option<u64>,
        name: Option<String>,
    ) -> Result<Reply, ApiError> {
        if let Some(name) = &name {
            self.name_is_free(name, "name")?;
        }
        let mut snapshot = {
            let _busy = self.claim(id)?;
            self.take_snapshot(id, name, Purpose::Kept).await?.snapshot
        };
        if let Some(ttl_s) = ttl_s {
            let at = snapshot
                .created_at_ms
                .saturating_add(ttl_s.saturating_mul(1000));
            snapshot.expires_at_ms = Some(at);
            self.db.lock().set_snapshot(&snapshot).map_err(internal)?;
        }
        if stop {
            let reason = format!("stopped after snapshot {}", snapshot.id);
            self.sandboxes.end(id, State::Deleted, &reason).await?;
        }
        Ok(Reply::Snapshot {
            created: true,
            snapshot,
        })
    }

    /// Takes and records a snapshot of sandbox `id`, pinned until the caller drops the pin.
    async fn take_snapshot(
        &self,
        id: &str,
        name: Option<String>,
        purpose: Purpose,
    ) -> Result<Taken<'_>, ApiError> {
        let sandbox = touch(&self.db, id)?;
        refuse_gpus(&sandbox, "snapshotted or forked")?;
        if !matches!(sandbox.state, State::Running | State::Paused) {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is {}; only a running or paused sandbox can be snapshotted",
                sandbox.state.as_str()
            )));
        }
        let template = self
            .db
            .lock()
            .template(&sandbox.template)
            .map_err(internal)?
            .ok_or_else(|| {
                ApiError::Conflict(format!(
                    "sandbox {id}: its template {:?} was removed, so it cannot be snapshotted",
                    sandbox.template
                ))
            })?;
        let snapshot_id = format!("snap-{}", random_hex());
        let created_at_ms = now_ms();
        let expires_at_ms = match (purpose, self.retention.fork_ttl_s()) {
            (Purpose::Fork, Some(ttl_s)) => {
                Some(created_at_ms.saturating_add(ttl_s.saturating_mul(1000)))
            }
            _ => None,
        };
        let snapshot = Snapshot {
            dir: self.dir.join(&snapshot_id),
            id: snapshot_id,
            name,
            sandbox: id.to_string(),
            parent: self.db.lock().source(id).map_err(internal)?,
            template: sandbox.template.clone(),
            vcpus: sandbox.vcpus,
            memory_mib: sandbox.memory_mib,
            created_at_ms,
            expires_at_ms,
            deterministic: sandbox.deterministic,
            tenant: sandbox.tenant.clone(),
            volumes: sandbox.volumes.clone(),
            network: sandbox.network.as_ref().map(|n| n.egress.clone()),
            expose: sandbox
                .network
                .as_ref()
                .map(|n| n.ports.iter().map(|p| p.port).collect())
                .unwrap_or_default(),
        };
        let pin = self.retention.pin(&snapshot.id);
        let failed = |e: String| ApiError::Internal(format!("snapshot of sandbox {id}: {e}"));
        // The pause and resume are here, not in `snapshot_vm`, so that a daemon killed between
        // them can be tested (`hold`); a restart resumes the VM (see `Sandboxes::recover`).
        let running = sandbox.state == State::Running;
        let paused_at = std::time::Instant::now();
        if running {
            supervisor::set_paused(&sandbox.dir, true)
                .await
                .map_err(|e| failed(format!("pausing it: {e}")))?;
        }
        let sandbox_dir = sandbox.dir.clone();
        let dir = snapshot.dir.clone();
        let rootfs = template.rootfs.is_some();
        let jail_uid = self.supervisor.jail_uid();
        // A fork's parent runs again as soon as the VMM has imaged its memory.
        let resume = if running && purpose == Purpose::Fork {
            Resume::WhileWriting
        } else {
            Resume::Never
        };
        let taken = tokio::task::spawn_blocking(move || {
            supervisor::snapshot::snapshot_vm(
                &sandbox_dir,
                &dir,
                rootfs,
                jail_uid,
                resume,
                paused_at,
            )
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|taken| taken);
        if taken.is_ok() {
            self.hold(&snapshot.id).await;
        }
        // A failed snapshot may have left it paused either way.
        let resumed = if running && (resume == Resume::Never || taken.is_err()) {
            supervisor::set_paused(&sandbox.dir, false)
                .await
                .map_err(|e| format!("resuming it: {e}"))
        } else {
            Ok(())
        };
        // How long a running VM was paused: until the VMM resumed it, or until our resume.
        let paused_ms = match &taken {
            Ok(Some(resumed_after_ms)) => Some(*resumed_after_ms),
            _ => running.then(|| ms_since(paused_at)),
        };
        if let Err(e) = taken.and(resumed) {
            let _ = remove_dir(&snapshot.dir);
            return Err(failed(e));
        }
        self.db
            .lock()
            .add_snapshot(&snapshot, purpose == Purpose::Fork)
            .map_err(internal)?;
        if let Err(e) = self.retention.enforce().await {
            log::warn!("snapshot retention: {e}");
        }
        Ok(Taken {
            snapshot,
            pin,
            paused_ms,
        })
    }

    /// The test hook of `--test-hold-snapshot`: writes the file, then waits until it is gone.
    async fn hold(&self, snapshot: &str) {
        let Some(file) = &self.hold else {
            return;
        };
        if let Err(e) = std::fs::write(file, snapshot) {
            log::warn!("--test-hold-snapshot {}: {e}", file.display());
            return;
        }
        log::warn!(
            "--test-hold-snapshot: holding snapshot {snapshot} until {} is removed",
            file.display()
        );
        while file.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Removes a snapshot and its files; removing one that is gone is success. Sandboxes
    /// restored from it keep running (their memory mapping outlives the file). A template's
    /// boot snapshot goes with its template only.
    pub async fn delete(&self, id: &str) -> Result<Reply, ApiError> {
        if let Some(template) = self.db.lock().boot_snapshot_owner(id).map_err(internal)? {
            return Err(ApiError::Conflict(format!(
                "snapshot {id} is the boot snapshot of template {template:?}; it goes when the template is removed"
            )));
        }
        self.remove_files(id).await?;
        Ok(Reply::NoContent)
    }

    /// Forgets a snapshot and removes its directory.
    pub async fn remove_files(&self, id: &str) -> Result<(), ApiError> {
        let snapshot = self.db.lock().snapshot(id).map_err(internal)?;
        if let Some(snapshot) = snapshot {
            self.db.lock().remove_snapshot(id).map_err(internal)?;
            tokio::task::spawn_blocking(move || remove_dir(&snapshot.dir))
                .await
                .map_err(internal)?
                .map_err(internal)?;
        }
        Ok(())
    }

    /// A snapshot of a running sandbox for its template's boot snapshot.
    pub async fn for_template(&self, id: &str) -> Result<String, ApiError> {
        let _busy = self.claim(id)?;
        Ok(self
            .take_snapshot(id, None, Purpose::Kept)
            .await?
            .snapshot
            .id)
    }

    /// A fresh snapshot of the sandbox, then `count` restores of it, each on its own. The
    /// snapshot is a fork's: it goes when the last sandbox restored from it ends, or at
    /// `--fork-snapshot-ttl` (see [`super::retention`]); it is pinned while the restores run.
    pub async fn fork(
        &self,
        id: &str,
        count: u32,
        ttl_s: Option<u64>,
        labels: BTreeMap<String, String>,
    ) -> Result<Reply, ApiError> {
        let parent = touch(&self.db, id)?;
        refuse_gpus(&parent, "forked")?;
        self.sandboxes.check_room(count, parent.memory_mib)?;
        let started = std::time::Instant::now();
        let Taken {
            snapshot,
            pin: _pin,
            paused_ms,
        } = {
            let _busy = self.claim(id)?;
            self.take_snapshot(id, None, Purpose::Fork).await?
        };
        // The snapshot's part of the fork (the parent ran again within it: `paused_ms`).
        let snapshot_ms = ms_since(started);
        let parent = touch(&self.db, id)?;
        // Without a TTL the forks get what the parent has left.
        let ttl_s = ttl_s.unwrap_or_else(|| {
            parent
                .expires_at_ms
                .saturating_sub(now_ms())
                .div_ceil(1000)
                .max(1)
        });
        let creates = (0..count).map(|_| {
            let request = CreateSandbox {
                template: String::new(),
                snapshot: Some(snapshot.id.clone()),
                vcpus: None,
                memory_mib: None,
                ttl_s: Some(ttl_s),
                idle_ttl_s: parent.idle_ttl_s,
                labels: labels.clone(),
                metadata: fork_metadata(&parent.metadata, id),
                idempotency_key: None,
                env: parent.env.clone(),
                cpu_limit: parent.cpu_limit,
                deterministic: parent.deterministic,
                on_timeout: parent.on_timeout,
                auto_resume: parent.auto_resume,
                tenant: parent.tenant.clone(),
                // A restore mounts its snapshot's volumes.
                volumes: Vec::new(),
                gpu: None,
                network: None,
            };
            async move { self.sandboxes.create(request).await }
        });
        let results = futures_util::future::join_all(creates)
            .await
            .into_iter()
            .map(ForkResult::of)
            .collect();
        if log::log_enabled!(log::Level::Debug) {
            log::debug!(
                "fork {id}: paused {:.2} ms, snapshot {snapshot_ms:.2} ms, clones {:.2} ms",
                paused_ms.unwrap_or(0.0),
                ms_since(started) - snapshot_ms
            );
        }
        Ok(Reply::Forked(results))
    }

    /// Same id, fresh state: a new VMM restored from `snapshot` (default: the snapshot the
    /// sandbox came from), or booted from its template when it came from none.
    pub async fn reset(&self, id: &str, snapshot: Option<String>) -> Result<Reply, ApiError> {
        let _busy = self.claim(id)?;
        let sandbox = touch(&self.db, id)?;
        refuse_gpus(&sandbox, "reset")?;
        if !matches!(sandbox.state, State::Running | State::Paused) {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is {}, not running or paused",
                sandbox.state.as_str()
            )));
        }
        let source = match snapshot {
            Some(s) => Some(s),
            None => self.db.lock().source(id).map_err(internal)?,
        };
        // Pinned before its row is read: retention leaves it until the restore is done.
        let _pin = source.as_deref().map(|s| self.retention.pin(s));
        let snapshot =
            match source {
                Some(s) => Some(self.db.lock().snapshot(&s).map_err(internal)?.ok_or_else(
                    || {
                        ApiError::BadRequest(format!(
                            "snapshot: no snapshot {s:?} (it was deleted, or it was a fork's and went with its clones or at --fork-snapshot-ttl; give another)"
                        ))
                    },
                )?),
                None => None,
            };
        if let Some(s) = &snapshot {
            if (s.template.as_str(), s.vcpus, s.memory_mib)
                != (sandbox.template.as_str(), sandbox.vcpus, sandbox.memory_mib)
            {
                return Err(ApiError::BadRequest(format!(
                    "snapshot: {} is of template {:?} with {} vCPUs and {} MiB, the sandbox of {:?} with {} and {}",
                    s.id, s.template, s.vcpus, s.memory_mib, sandbox.template, sandbox.vcpus, sandbox.memory_mib
                )));
            }
            check_deterministic(sandbox.deterministic, s)?;
            if s.volumes != sandbox.volumes {
                return Err(ApiError::BadRequest(format!(
                    "snapshot: {} mounts other volumes than sandbox {id} does; reset it to a snapshot of its own volumes",
                    s.id
                )));
            }
        }
        let volumes = self
            .sandboxes
            .mounts(&sandbox.volumes, sandbox.tenant.as_deref())?;
        let template = self
            .db
            .lock()
            .template(&sandbox.template)
            .map_err(internal)?
            .ok_or_else(|| {
                ApiError::Conflict(format!(
                    "sandbox {id}: its template {:?} was removed",
                    sandbox.template
                ))
            })?;
        // The old VMM goes first: the new one takes its sockets, directory and tap.
        // Its groups go before the new VMM's jail makes them again under the same id.
        self.sandboxes.stop_vmm(id, &sandbox, Release::Now).await?;
        let nic = match self.sandboxes.reattach_network(&sandbox).await {
            Ok(nic) => nic,
            Err(e) => {
                let _ = self.sandboxes.end(id, State::Failed, &e.to_string()).await;
                return Err(e);
            }
        };
        let launched = self
            .supervisor
            .launch(
                &sandbox,
                &template,
                snapshot.as_ref(),
                false,
                volumes,
                Vec::new(),
                nic,
            )
            .await;
        let launched = match launched {
            Ok(launched) => launched,
            Err(message) => {
                let _ = remove_dir(&sandbox.dir);
                let reason = format!("reset failed: {message}");
                self.db
                    .lock()
                    .end(id, State::Failed, &reason, now_ms())
                    .map_err(internal)?;
                return Err(ApiError::Internal(format!("sandbox {id}: {reason}")));
            }
        };
        if !self
            .db
            .lock()
            .set_vmm(id, launched.pid, launched.start)
            .map_err(internal)?
        {
            // Deleted while the reset ran.
            launched.reap().await;
            let _ = remove_dir(&sandbox.dir);
            return Err(ApiError::Conflict(format!(
                "sandbox {id} ended during the reset"
            )));
        }
        self.supervisor.adopt(id, launched);
        if let Some(s) = &snapshot {
            self.db.lock().set_source(id, &s.id).map_err(internal)?;
        }
        // The restored guest has the snapshot's address; a boot took its own from `ip=`.
        if snapshot.is_some() {
            if let Err(e) = self.sandboxes.readdress(id).await {
                let _ = self.sandboxes.end(id, State::Failed, &e.to_string()).await;
                return Err(e);
            }
        }
        sandbox_reply(&self.db, id)
    }

    /// After a restart: removes snapshot directories of no recorded snapshot (a daemon killed
    /// mid-snapshot).
    pub fn sweep(&self) -> Result<(), StoreError> {
        let recorded: HashSet<PathBuf> = self
            .db
            .lock()
            .snapshots(None)?
            .into_iter()
            .map(|s| s.dir)
            .collect();
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                if !recorded.contains(&entry.path()) {
                    let _ = remove_dir(&entry.path());
                }
            }
        }
        Ok(())
    }
}

/// A sandbox that holds GPUs is not snapshotted, forked or reset: the device's state is not
/// in the VM's (no migration of GPU state is claimed).
fn refuse_gpus(sandbox: &super::api::Sandbox, what: &str) -> Result<(), ApiError> {
    if sandbox.gpus.is_empty() {
        return Ok(());
    }
    Err(ApiError::Conflict(format!(
        "sandbox {} holds GPU {}: a VM with a device passed through cannot be {what} (its state is in the device)",
        sandbox.id,
        sandbox.gpus.join(", ")
    )))
}

/// A fork's metadata: `forked_from`, and the parent's `e2b.*` keys (the E2B façade's own, such
/// as a sandbox's `allowPublicTraffic: false`, which its forks must keep).
fn fork_metadata(parent: &BTreeMap<String, String>, id: &str) -> BTreeMap<String, String> {
    let mut metadata: BTreeMap<String, String> = parent
        .iter()
        .filter(|(key, _)| key.starts_with("e2b."))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    metadata.insert("forked_from".to_string(), id.to_string());
    metadata
}
