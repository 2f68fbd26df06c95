//! The reaper (VMMs that ended on their own, sandboxes whose Kubernetes pod is gone, TTLs and
//! idle TTLs) and the recovery after a
//! restart (re-attach live VMMs, fail unfinished creates, and bring each VMM's paused or
//! running state back to the store's: a daemon killed mid-snapshot leaves a paused VM).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::super::api::{OnTimeout, Sandbox, State, POD_UID_LABEL};
use super::super::store::StoreError;
use super::super::supervisor::{self, vm};
use super::super::util::{now_ms, remove_dir};
use super::{RecoverError, Sandboxes};

impl Sandboxes {
    /// One reaper pass: VMMs that ended on their own, pods gone, then TTLs.
    pub async fn reap(&self) -> Result<(), StoreError> {
        let live = self.db.lock().live()?;
        let now = now_ms();
        for sandbox in live {
            if sandbox.state == State::Creating || self.supervisor.is_busy(&sandbox.id) {
                continue;
            }
            if let Some(reason) = self.supervisor.exited(&sandbox) {
                // Its directory goes: keep why in the record and the daemon's log.
                log::info!("sandbox {}: {reason}", sandbox.id);
                if self
                    .db
                    .lock()
                    .end(&sandbox.id, State::Exited, &reason, now)?
                {
                    let _ = remove_dir(&sandbox.dir);
                    self.supervisor.release(&sandbox);
                }
                continue;
            }
            if let Some(pods) = &self.options.kubelet_pods_dir {
                if let Some(reason) = pod_gone(pods, &sandbox.labels) {
                    log::info!("sandbox {}: {reason}", sandbox.id);
                    if let Err(e) = self.end(&sandbox.id, State::Deleted, &reason).await {
                        log::warn!("reaper: cannot end {}: {e}", sandbox.id);
                    }
                    continue;
                }
            }
            let idle = sandbox.idle_ttl_s.is_some_and(|idle| {
                now.saturating_sub(sandbox.last_active_at_ms) >= idle.saturating_mul(1000)
            });
            let expired = now >= sandbox.expires_at_ms;
            let mut reason = if expired {
                "ttl: its TTL ran out".to_string()
            } else if idle {
                "idle_ttl: no API call within its idle TTL".to_string()
            } else {
                continue;
            };
            if expired && sandbox.on_timeout == OnTimeout::Pause && sandbox.state == State::Running
            {
                // Its TTL pauses it (and keeps it PAUSED_RETENTION_S); a paused one ends. One
                // that cannot be paused ends now rather than being tried again for ever.
                match self.pause_resume(&sandbox.id, true).await {
                    Ok(_) => {
                        log::info!("sandbox {}: paused by its TTL", sandbox.id);
                        continue;
                    }
                    Err(e) => {
                        log::warn!("reaper: cannot pause {}: {e}; ending it", sandbox.id);
                        reason = format!("ttl: its TTL ran out and it could not be paused: {e}");
                    }
                }
            }
            if let Err(e) = self.end(&sandbox.id, State::Expired, &reason).await {
                log::warn!("reaper: cannot end {}: {e}", sandbox.id);
            }
        }
        Ok(())
    }

    /// After a (re)start: re-attach live VMMs, fail unfinished creates, and have the
    /// supervisor kill VMMs and remove directories and cgroups that belong to no live sandbox.
    /// Then each re-attached VMM loses what an unfinished snapshot left in its directory and
    /// is paused or resumed to match the store. Returns the re-attached sandboxes (with their
    /// VMM's pid and start time).
    pub async fn recover(&self) -> Result<HashMap<String, (u32, u64)>, RecoverError> {
        let live = self.db.lock().live()?;
        let now = now_ms();
        let mut keep = HashMap::new();
        let mut kept = Vec::new();
        for sandbox in live {
            match (sandbox.state, sandbox.pid, sandbox.pid_start_time) {
                (State::Creating, _, _) => {
                    self.db.lock().end(
                        &sandbox.id,
                        State::Failed,
                        "the daemon stopped during the create",
                        now,
                    )?;
                }
                (_, Some(pid), Some(start)) if vm::is_ours(pid, start) => {
                    keep.insert(sandbox.id.clone(), (pid, start));
                    kept.push(sandbox);
                }
                _ => {
                    self.db.lock().end(
                        &sandbox.id,
                        State::Exited,
                        "the VMM ended while the daemon was down",
                        now,
                    )?;
                }
            }
        }
        self.supervisor.sweep(&keep)?;
        let reconciled = kept.iter().map(|sandbox| async move {
            let dir = sandbox.dir.clone();
            let staged = tokio::task::spawn_blocking(move || {
                supervisor::snapshot::remove_snapshot_staging(&dir)
            })
            .await;
            if let Ok(Err(e)) = staged {
                log::warn!("sandbox {}: unfinished snapshot files: {e}", sandbox.id);
            }
            self.reconcile_vmm(sandbox).await;
        });
        futures_util::future::join_all(reconciled).await;
        Ok(keep)
    }

    /// Pauses or resumes the sandbox's VMM to match the store's state (running or paused),
    /// where it differs; a VMM that does not answer is left as it is, with a warning.
    pub(super) async fn reconcile_vmm(&self, sandbox: &Sandbox) {
        let want_paused = match sandbox.state {
            State::Running => false,
            State::Paused => true,
            _ => return,
        };
        let id = &sandbox.id;
        match supervisor::vm_paused(&sandbox.dir).await {
            Ok(paused) if paused == want_paused => {}
            Ok(_) => {
                let (verb, why) = if want_paused {
                    ("paused", "it is paused in the store")
                } else {
                    (
                        "resumed",
                        "its VM was left paused (a snapshot not finished?)",
                    )
                };
                match supervisor::set_paused(&sandbox.dir, want_paused).await {
                    Ok(()) => log::warn!("sandbox {id}: {verb} its VMM: {why}"),
                    Err(e) => log::warn!("sandbox {id}: cannot make its VMM {verb}: {e}"),
                }
            }
            Err(e) => log::warn!("sandbox {id}: cannot ask its VMM whether it is paused: {e}"),
        }
    }
}

/// Why a sandbox labelled with a pod's UID ([`POD_UID_LABEL`]) should end: the kubelet removed
/// the pod's directory under `pods` (`/var/lib/kubelet/pods/UID`), so the pod is gone. None for
/// a sandbox of no pod, one whose pod is still there, or a label that is not a plain name
/// (never looked up outside `pods`).
pub fn pod_gone(pods: &Path, labels: &BTreeMap<String, String>) -> Option<String> {
    let uid = labels.get(POD_UID_LABEL)?;
    let plain = !uid.is_empty()
        && uid.len() <= 64
        && uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    // A pods directory that is itself missing (unmounted, say) proves nothing about any pod.
    if !plain || !pods.is_dir() {
        return None;
    }
    match std::fs::symlink_metadata(pods.join(uid)) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(format!(
            "pod: its pod {uid} is gone (no {})",
            pods.join(uid).display()
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labelled(uid: Option<&str>) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([("run".to_string(), "r1".to_string())]);
        if let Some(uid) = uid {
            labels.insert(POD_UID_LABEL.to_string(), uid.to_string());
        }
        labels
    }

    #[test]
    fn a_sandbox_ends_only_when_its_own_pod_directory_is_gone() {
        let pods = tempfile::tempdir().unwrap();
        std::fs::create_dir(pods.path().join("5c1d-aa")).unwrap();
        assert_eq!(pod_gone(pods.path(), &labelled(None)), None);
        assert_eq!(pod_gone(pods.path(), &labelled(Some("5c1d-aa"))), None);
        let reason = pod_gone(pods.path(), &labelled(Some("77ee-bb"))).unwrap();
        assert!(reason.contains("77ee-bb is gone"), "{reason}");
        // Never a path outside the pods directory, whatever the label says.
        assert_eq!(pod_gone(pods.path(), &labelled(Some("../5c1d-aa"))), None);
        assert_eq!(pod_gone(pods.path(), &labelled(Some(".."))), None);
        assert_eq!(pod_gone(pods.path(), &labelled(Some(""))), None);
        let missing = pods.path().join("not-mounted");
        assert_eq!(pod_gone(&missing, &labelled(Some("77ee-bb"))), None);
    }
}
