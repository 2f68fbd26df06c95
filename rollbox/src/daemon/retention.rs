//! Snapshot retention: with `--snapshot-retention N` each sandbox keeps its newest N
//! snapshots, and a snapshot taken with `ttl_s` goes when that runs out. Either way a
//! snapshot that a live sandbox was restored (or last reset) from is kept, since a reset of
//! that sandbox goes back to it; it goes on a later pass, once no live sandbox came from it.
//! A template's boot snapshot is kept while its template exists. A snapshot's `parent` is
//! history only (snapshots are Full, not deltas), so a parent is not kept for its children.
//!
//! A fork's snapshot (see `Snapshots::fork`) goes when the last live sandbox restored from it
//! ends, or at `--fork-snapshot-ttl` even while its clones run: a running clone needs none of
//! its files (its VMM keeps the memory file it maps open, and its rootfs is a copy); only a
//! reset back to it does, which then fails naming it. Nothing goes while a create, fork or
//! reset restores from it (a [`Pin`], or the source of a `creating` sandbox). The rules run
//! after each snapshot and on every reaper pass.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use super::api::Snapshot;
use super::store::{Db, StoreError};
use super::util::{now_ms, remove_dir};

/// What keeps the snapshots a rule would remove, and which are forks'.
#[derive(Debug, Default)]
pub struct Holds {
    /// Sources of live sandboxes and templates' boot snapshots: kept by every rule but a fork
    /// snapshot's TTL.
    pub protected: HashSet<String>,
    /// Snapshots being restored from now (by a create, fork or reset): kept by every rule.
    pub restoring: HashSet<String>,
    /// Fork snapshots: they go once `protected` does not name them, or at their TTL.
    pub forks: HashSet<String>,
}

/// The snapshots the rules remove, oldest first, and why; `kept` those a hold keeps.
pub fn doomed(
    snapshots: &[Snapshot],
    keep_newest: Option<u32>,
    holds: &Holds,
    now: u64,
) -> (Vec<(Snapshot, String)>, Vec<String>) {
    let mut per_sandbox: HashMap<&str, usize> = HashMap::new();
    let mut rank = vec![0usize; snapshots.len()];
    // `snapshots` is oldest first: rank 0 is each sandbox's newest.
    for (i, s) in snapshots.iter().enumerate().rev() {
        let seen = per_sandbox.entry(s.sandbox.as_str()).or_default();
        rank[i] = *seen;
        *seen += 1;
    }
    let (mut gone, mut kept) = (Vec::new(), Vec::new());
    for (s, rank) in snapshots.iter().zip(rank) {
        let fork = holds.forks.contains(&s.id);
        let expired = s.expires_at_ms.is_some_and(|at| now >= at);
        let protected = holds.protected.contains(&s.id);
        let why = if expired && fork {
            "--fork-snapshot-ttl ran out".to_string()
        } else if expired {
            "its ttl_s ran out".to_string()
        } else if keep_newest.is_some_and(|n| rank >= n as usize) {
            format!(
                "--snapshot-retention keeps the newest {} of sandbox {}",
                keep_newest.unwrap_or(0),
                s.sandbox
            )
        } else if fork && !protected {
            "no live sandbox restores from this fork snapshot any more".to_string()
        } else {
            continue;
        };
        if holds.restoring.contains(&s.id) || (protected && !(fork && expired)) {
            kept.push(s.id.clone());
        } else {
            gone.push((s.clone(), why));
        }
    }
    (gone, kept)
}

/// The retention rules, applied to the store's snapshots.
pub struct Retention {
    db: Arc<Db>,
    /// `--snapshot-retention N`: keep each sandbox's newest N; None: keep all.
    keep_newest: Option<u32>,
    /// `--fork-snapshot-ttl SECS`: a fork snapshot goes this long after it was taken; None:
    /// when its last clone ends.
    fork_ttl_s: Option<u64>,
    /// Snapshots restored from now, and by how many; removals check it under its lock.
    pins: Mutex<HashMap<String, usize>>,
}

/// Keeps a snapshot from every rule while it lives (a fork or reset restoring from it).
pub struct Pin<'a> {
    retention: &'a Retention,
    id: String,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut pins = self.retention.pins();
        if let Some(count) = pins.get_mut(&self.id) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                pins.remove(&self.id);
            }
        }
    }
}

impl Retention {
    pub fn new(db: Arc<Db>, keep_newest: Option<u32>, fork_ttl_s: Option<u64>) -> Retention {
        Retention {
            db,
            keep_newest,
            fork_ttl_s,
            pins: Mutex::new(HashMap::new()),
        }
    }

    /// `--fork-snapshot-ttl`, for the `expires_at_ms` of a new fork snapshot.
    pub fn fork_ttl_s(&self) -> Option<u64> {
        self.fork_ttl_s
    }

    fn pins(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.pins.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps snapshot `id` until the pin is dropped. Pin before reading the snapshot's row:
    /// a row read after the pin stays with its files until then.
    pub fn pin(&self, id: &str) -> Pin<'_> {
        *self.pins().entry(id.to_string()).or_default() += 1;
        Pin {
            retention: self,
            id: id.to_string(),
        }
    }

    /// Applies the retention rules once.
    pub async fn enforce(&self) -> Result<(), StoreError> {
        let (snapshots, mut holds) = {
            let store = self.db.lock();
            let mut protected = store.sources_of_live()?;
            // A template's boot snapshot goes with its template only.
            protected.extend(
                store
                    .templates()?
                    .into_iter()
                    .filter_map(|t| t.boot_snapshot),
            );
            let holds = Holds {
                protected,
                restoring: store.sources_of_creating()?,
                forks: store.fork_snapshots()?,
            };
            (store.snapshots(None)?, holds)
        };
        holds.restoring.extend(self.pins().keys().cloned());
        let any_rule = self.keep_newest.is_some()
            || !holds.forks.is_empty()
            || snapshots.iter().any(|s| s.expires_at_ms.is_some());
        if !any_rule {
            return Ok(());
        }
        let (gone, _kept) = doomed(&snapshots, self.keep_newest, &holds, now_ms());
        for (snapshot, why) in gone {
            let removed = {
                // Under the pins' lock: a restore pins first, then reads the row.
                let pins = self.pins();
                !pins.contains_key(&snapshot.id) && self.db.lock().remove_snapshot(&snapshot.id)?
            };
            if removed {
                log::info!("removed snapshot {}: {why}", snapshot.id);
                let dir = snapshot.dir.clone();
                let _ = tokio::task::spawn_blocking(move || remove_dir(&dir)).await;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(id: &str, sandbox: &str, expires_at_ms: Option<u64>) -> Snapshot {
        Snapshot {
            id: id.into(),
            name: None,
            sandbox: sandbox.into(),
            parent: None,
            template: "t".into(),
            vcpus: 1,
            memory_mib: 32,
            dir: format!("/s/{id}").into(),
            created_at_ms: 0,
            expires_at_ms,
            deterministic: false,
            tenant: None,
            volumes: Vec::new(),
            network: None,
            expose: Vec::new(),
        }
    }

    fn set(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn ids(gone: &[(Snapshot, String)]) -> Vec<&str> {
        gone.iter().map(|(s, _)| s.id.as_str()).collect()
    }

    #[test]
    fn newest_n_per_sandbox_and_ttls_except_sources_of_live_sandboxes() {
        let all = [
            snap("a1", "a", None),
            snap("b1", "b", Some(10)),
            snap("a2", "a", None),
            snap("a3", "a", None),
            snap("b2", "b", Some(1000)),
            snap("a4", "a", None),
        ];
        let holds = Holds {
            protected: set(&["a2"]),
            ..Holds::default()
        };
        let (gone, kept) = doomed(&all, Some(2), &holds, 100);
        assert_eq!(ids(&gone), ["a1", "b1"]);
        assert_eq!(kept, ["a2"]);
        let (gone, _) = doomed(&all, None, &Holds::default(), 100);
        assert_eq!(gone.len(), 1);
        assert!(gone[0].1.contains("ttl_s"));
    }

    #[test]
    fn fork_snapshots_go_with_their_last_clone_or_at_their_ttl_unless_restored_from() {
        let all = [
            // Clones of it live, no TTL: kept.
            snap("f-live", "p", None),
            // No clone lives: gone.
            snap("f-unused", "p", None),
            // Its TTL ran out: gone although clones live.
            snap("f-expired", "p", Some(50)),
            // Its TTL ran out, but a create or reset restores from it now: kept.
            snap("f-restoring", "p", Some(50)),
            // Not expired yet, and no clone (its fork is still creating them): kept.
            snap("f-pinned", "p", Some(500)),
            // A user's snapshot that nothing restores from: kept (no rule applies).
            snap("user", "p", None),
        ];
        let holds = Holds {
            protected: set(&["f-live", "f-expired", "f-restoring"]),
            restoring: set(&["f-restoring", "f-pinned"]),
            forks: set(&["f-live", "f-unused", "f-expired", "f-restoring", "f-pinned"]),
        };
        let (gone, kept) = doomed(&all, None, &holds, 100);
        assert_eq!(ids(&gone), ["f-unused", "f-expired"]);
        assert!(gone[0].1.contains("no live sandbox"), "{}", gone[0].1);
        assert!(gone[1].1.contains("--fork-snapshot-ttl"), "{}", gone[1].1);
        assert_eq!(kept, ["f-restoring", "f-pinned"]);
    }

    #[test]
    fn a_pin_keeps_a_snapshot_until_its_last_holder_lets_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = super::super::store::Store::open(&dir.path().join("state.db")).expect("db");
        let retention = Retention::new(Arc::new(Db::new(store)), None, Some(1));
        assert_eq!(retention.fork_ttl_s(), Some(1));
        let first = retention.pin("snap-a");
        let second = retention.pin("snap-a");
        drop(first);
        assert!(retention.pins().contains_key("snap-a"));
        drop(second);
        assert!(retention.pins().is_empty());
    }
}
