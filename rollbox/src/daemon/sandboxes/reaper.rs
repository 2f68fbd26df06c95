//! The reaper (VMMs that ended on their own, TTLs and idle TTLs) and the recovery after a
//! restart (re-attach live VMMs, fail unfinished creates).

use std::collections::HashMap;

use super::super::api::{OnTimeout, State};
use super::super::store::StoreError;
use super::super::supervisor::vm;
use super::super::util::{now_ms, remove_dir};
use super::{RecoverError, Sandboxes};

impl Sandboxes {
    /// One reaper pass: VMMs that ended on their own, then TTLs.
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
    /// Returns the re-attached sandboxes (with their VMM's pid and start time).
    pub fn recover(&self) -> Result<HashMap<String, (u32, u64)>, RecoverError> {
        let live = self.db.lock().live()?;
        let now = now_ms();
        let mut keep = HashMap::new();
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
        Ok(keep)
    }
}
