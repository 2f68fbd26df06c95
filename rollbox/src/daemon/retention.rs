//! Snapshot retention: with `--snapshot-retention N` each sandbox keeps its newest N
//! snapshots, and a snapshot taken with `ttl_s` goes when that runs out. Either way a
//! snapshot that a live sandbox was restored (or last reset) from is kept, since a reset of
//! that sandbox goes back to it; it goes on a later pass, once no live sandbox came from it.
//! A template's boot snapshot is kept while its template exists. A snapshot's `parent` is
//! history only (snapshots are Full, not deltas), so a parent is not kept for its children. The rules run after each snapshot and on every reaper pass.

use std::collections::{HashMap, HashSet};

use std::sync::Arc;

use super::api::Snapshot;
use super::store::{Db, StoreError};
use super::util::{now_ms, remove_dir};

/// The snapshots the rules remove, oldest first, and why; `kept` those a live sandbox keeps.
pub fn doomed(
    snapshots: &[Snapshot],
    keep_newest: Option<u32>,
    protected: &HashSet<String>,
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
        let why = if s.expires_at_ms.is_some_and(|at| now >= at) {
            "its ttl_s ran out".to_string()
        } else if keep_newest.is_some_and(|n| rank >= n as usize) {
            format!(
                "--snapshot-retention keeps the newest {} of sandbox {}",
                keep_newest.unwrap_or(0),
                s.sandbox
            )
        } else {
            continue;
        };
        if protected.contains(&s.id) {
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
}

impl Retention {
    pub fn new(db: Arc<Db>, keep_newest: Option<u32>) -> Retention {
        Retention { db, keep_newest }
    }

    /// Applies the retention rules once.
    pub async fn enforce(&self) -> Result<(), StoreError> {
        let (snapshots, protected) = {
            let store = self.db.lock();
            let mut protected = store.sources_of_live()?;
            // A template's boot snapshot goes with its template only.
            protected.extend(
                store
                    .templates()?
                    .into_iter()
                    .filter_map(|t| t.boot_snapshot),
            );
            (store.snapshots(None)?, protected)
        };
        let any_rule =
            self.keep_newest.is_some() || snapshots.iter().any(|s| s.expires_at_ms.is_some());
        if !any_rule {
            return Ok(());
        }
        let (gone, _kept) = doomed(&snapshots, self.keep_newest, &protected, now_ms());
        for (snapshot, why) in gone {
            if self.db.lock().remove_snapshot(&snapshot.id)? {
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
        }
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
        let protected = HashSet::from(["a2".to_string()]);
        let (gone, kept) = doomed(&all, Some(2), &protected, 100);
        let gone: Vec<&str> = gone.iter().map(|(s, _)| s.id.as_str()).collect();
        assert_eq!(gone, ["a1", "b1"]);
        assert_eq!(kept, ["a2"]);
        let (gone, _) = doomed(&all, None, &HashSet::new(), 100);
        assert_eq!(gone.len(), 1);
        assert!(gone[0].1.contains("ttl_s"));
    }
}
