//! Snapshots of running sandboxes (the VMM's Full snapshot into a daemon-owned directory),
//! fork (a fresh snapshot, then one restore per new sandbox) and reset (same id, a new VMM
//! restored from a snapshot, or booted afresh).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::api::Reply;
use super::api::{ApiError, CreateSandbox, ForkResult, Snapshot, State};
use super::{internal, now_ms, random_hex, reap_child, remove_dir, vm, Daemon};

/// Marks a sandbox busy (the reaper skips it) until dropped.
struct Busy<'a> {
    daemon: &'a Daemon,
    id: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.daemon.busy_set().remove(&self.id);
    }
}

impl Daemon {
    fn busy_set(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.busy.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn is_busy(&self, id: &str) -> bool {
        self.busy_set().contains(id)
    }

    fn claim(&self, id: &str) -> Result<Busy<'_>, ApiError> {
        if !self.busy_set().insert(id.to_string()) {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is being snapshotted or reset; retry when that is done"
            )));
        }
        Ok(Busy {
            daemon: self,
            id: id.to_string(),
        })
    }

    /// Pauses the VM (if it runs), takes a Full snapshot and a copy of its rootfs, and resumes
    /// it, or ends it when `stop`.
    pub(super) async fn snapshot(
        &self,
        id: &str,
        stop: bool,
        ttl_s: Option<u64>,
    ) -> Result<Reply, ApiError> {
        let mut snapshot = {
            let _busy = self.claim(id)?;
            self.take_snapshot(id).await?
        };
        if let Some(ttl_s) = ttl_s {
            let at = snapshot
                .created_at_ms
                .saturating_add(ttl_s.saturating_mul(1000));
            snapshot.expires_at_ms = Some(at);
            self.store().set_snapshot(&snapshot).map_err(internal)?;
        }
        if stop {
            let reason = format!("stopped after snapshot {}", snapshot.id);
            self.end(id, State::Deleted, &reason).await?;
        }
        Ok(Reply::Snapshot {
            created: true,
            snapshot,
        })
    }

    async fn take_snapshot(&self, id: &str) -> Result<Snapshot, ApiError> {
        let sandbox = self.touch(id)?;
        if !matches!(sandbox.state, State::Running | State::Paused) {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is {}; only a running or paused sandbox can be snapshotted",
                sandbox.state.as_str()
            )));
        }
        let template = self
            .store()
            .template(&sandbox.template)
            .map_err(internal)?
            .ok_or_else(|| {
                ApiError::Conflict(format!(
                    "sandbox {id}: its template {:?} was removed, so it cannot be snapshotted",
                    sandbox.template
                ))
            })?;
        let snapshot_id = format!("snap-{}", random_hex());
        let snapshot = Snapshot {
            dir: self.snapshots_dir.join(&snapshot_id),
            id: snapshot_id,
            sandbox: id.to_string(),
            parent: self.store().source(id).map_err(internal)?,
            template: sandbox.template.clone(),
            vcpus: sandbox.vcpus,
            memory_mib: sandbox.memory_mib,
            created_at_ms: now_ms(),
            expires_at_ms: None,
            deterministic: sandbox.deterministic,
        };
        let paths = vm::Paths::new(&sandbox.dir);
        let dir = snapshot.dir.clone();
        let running = sandbox.state == State::Running;
        let rootfs = template.rootfs.is_some();
        let jail_uid = self.jail.as_ref().map(|j| j.uid);
        let taken = tokio::task::spawn_blocking(move || -> Result<(), String> {
            std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            if running {
                vm::set_vm_state(&paths.api_sock, "Paused").map_err(|e| e.to_string())?;
            }
            // The disk is copied while the vCPUs are paused, so it matches the memory.
            let result = vm::create_snapshot(&paths, &dir, jail_uid)
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    if rootfs {
                        vm::copy_disk(&paths.rootfs, &dir.join("rootfs.img"))
                            .map_err(|e| format!("copying {}: {e}", paths.rootfs.display()))
                    } else {
                        Ok(())
                    }
                });
            if running {
                let resumed = vm::set_vm_state(&paths.api_sock, "Resumed");
                if let (Ok(()), Err(e)) = (&result, resumed) {
                    return Err(e.to_string());
                }
            }
            if result.is_err() {
                let _ = remove_dir(&dir);
            }
            result
        })
        .await
        .map_err(internal)?;
        taken.map_err(|e| ApiError::Internal(format!("snapshot of sandbox {id}: {e}")))?;
        self.store().add_snapshot(&snapshot).map_err(internal)?;
        if let Err(e) = self.enforce_retention().await {
            log::warn!("snapshot retention: {e}");
        }
        Ok(snapshot)
    }

    /// Removes a snapshot and its files; removing one that is gone is success. Sandboxes
    /// restored from it keep running (their memory mapping outlives the file). A template's
    /// boot snapshot goes with its template only.
    pub(super) async fn delete_snapshot(&self, id: &str) -> Result<Reply, ApiError> {
        if let Some(template) = self.boot_snapshot_owner(id)? {
            return Err(ApiError::Conflict(format!(
                "snapshot {id} is the boot snapshot of template {template:?}; it goes when the template is removed"
            )));
        }
        self.remove_snapshot_files(id).await?;
        Ok(Reply::NoContent)
    }

    /// Forgets a snapshot and removes its directory.
    pub(super) async fn remove_snapshot_files(&self, id: &str) -> Result<(), ApiError> {
        let snapshot = self.store().snapshot(id).map_err(internal)?;
        if let Some(snapshot) = snapshot {
            self.store().remove_snapshot(id).map_err(internal)?;
            tokio::task::spawn_blocking(move || remove_dir(&snapshot.dir))
                .await
                .map_err(internal)?
                .map_err(internal)?;
        }
        Ok(())
    }

    /// A snapshot of a running sandbox for its template's boot snapshot.
    pub(super) async fn snapshot_for_template(&self, id: &str) -> Result<String, ApiError> {
        let _busy = self.claim(id)?;
        Ok(self.take_snapshot(id).await?.id)
    }

    /// A fresh snapshot of the sandbox, then `count` restores of it, each on its own.
    pub(super) async fn fork(
        self: &Arc<Self>,
        id: &str,
        count: u32,
        ttl_s: Option<u64>,
        labels: BTreeMap<String, String>,
    ) -> Result<Reply, ApiError> {
        let snapshot = {
            let _busy = self.claim(id)?;
            self.take_snapshot(id).await?
        };
        let parent = self.touch(id)?;
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
                metadata: BTreeMap::from([("forked_from".to_string(), id.to_string())]),
                idempotency_key: None,
                env: parent.env.clone(),
                cpu_limit: parent.cpu_limit,
                deterministic: parent.deterministic,
            };
            let daemon = Arc::clone(self);
            async move { daemon.create(request).await }
        });
        let results = futures_util::future::join_all(creates)
            .await
            .into_iter()
            .map(|result| match result {
                Ok(Reply::Sandbox { sandbox, .. }) => ForkResult {
                    sandbox: Some(sandbox),
                    error: None,
                },
                Ok(other) => ForkResult {
                    sandbox: None,
                    error: Some(format!("unexpected reply {other:?}")),
                },
                Err(e) => ForkResult {
                    sandbox: None,
                    error: Some(e.to_string()),
                },
            })
            .collect();
        Ok(Reply::Forked(results))
    }

    /// Same id, fresh state: a new VMM restored from `snapshot` (default: the snapshot the
    /// sandbox came from), or booted from its template when it came from none.
    pub(super) async fn reset(
        &self,
        id: &str,
        snapshot: Option<String>,
    ) -> Result<Reply, ApiError> {
        let _busy = self.claim(id)?;
        let sandbox = self.touch(id)?;
        if !matches!(sandbox.state, State::Running | State::Paused) {
            return Err(ApiError::Conflict(format!(
                "sandbox {id} is {}, not running or paused",
                sandbox.state.as_str()
            )));
        }
        let source = match snapshot {
            Some(s) => Some(s),
            None => self.store().source(id).map_err(internal)?,
        };
        let snapshot = match source {
            Some(s) => Some(
                self.store()
                    .snapshot(&s)
                    .map_err(internal)?
                    .ok_or_else(|| {
                        ApiError::BadRequest(format!(
                            "snapshot: no snapshot {s:?} (it was deleted?)"
                        ))
                    })?,
            ),
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
            super::check_deterministic(sandbox.deterministic, s)?;
        }
        let template = self
            .store()
            .template(&sandbox.template)
            .map_err(internal)?
            .ok_or_else(|| {
                ApiError::Conflict(format!(
                    "sandbox {id}: its template {:?} was removed",
                    sandbox.template
                ))
            })?;
        // The old VMM goes first: the new one takes its sockets and directory.
        self.stop_vmm(id, &sandbox).await?;
        let launched = self
            .launch(&sandbox, &template, snapshot.as_ref(), false)
            .await;
        let (child, pid, start) = match launched {
            Ok(launched) => launched,
            Err(message) => {
                let _ = remove_dir(&sandbox.dir);
                let reason = format!("reset failed: {message}");
                self.store()
                    .end(id, State::Failed, &reason, now_ms())
                    .map_err(internal)?;
                return Err(ApiError::Internal(format!("sandbox {id}: {reason}")));
            }
        };
        if !self.store().set_vmm(id, pid, start).map_err(internal)? {
            // Deleted while the reset ran.
            reap_child(child).await;
            let _ = remove_dir(&sandbox.dir);
            return Err(ApiError::Conflict(format!(
                "sandbox {id} ended during the reset"
            )));
        }
        self.children().insert(id.to_string(), child);
        if let Some(s) = &snapshot {
            self.store().set_source(id, &s.id).map_err(internal)?;
        }
        self.sandbox_reply(id)
    }
}
