//! What a clone leaves behind and who removes it: its own directories when it ends, the fork's
//! snapshot when the last clone that holds it ends, and what forks of processes that are gone
//! left in /dev/shm.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};

/// What a clone removes when it ends (and its parent, if alive, when it sees it end).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloneCleanup {
    /// Directories of this clone alone (sockets, logs, drive copies): removed.
    pub own_dirs: Vec<PathBuf>,
    /// Removed if empty once `own_dirs` are gone (a pool's directory).
    pub empty_dirs: Vec<PathBuf>,
    /// The fork's snapshot directory: removed by whichever of its clones ends last. Each
    /// clone holds a shared lock on its `vmstate` while it runs.
    pub snapshot_dir: Option<PathBuf>,
}

impl CloneCleanup {
    /// Removes what this clone leaves behind; the snapshot only if no other clone holds it.
    pub fn run(&self) {
        for dir in &self.own_dirs {
            remove_dir_all_quietly(dir);
        }
        for dir in &self.empty_dirs {
            let _ = std::fs::remove_dir(dir);
        }
        if let Some(dir) = &self.snapshot_dir {
            remove_unused_snapshot(dir);
        }
    }
}

pub(super) fn remove_dir_all_quietly(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            log::warn!("cannot remove {}: {e}", dir.display());
        }
    }
}

pub(super) fn flock(file: &File, operation: libc::c_int) -> bool {
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    unsafe { libc::flock(file.as_raw_fd(), operation) == 0 }
}

/// Removes a fork's snapshot directory if no clone holds a lock on its `vmstate`.
pub(super) fn remove_unused_snapshot(dir: &Path) {
    match File::open(dir.join("vmstate")) {
        Ok(state) => {
            if flock(&state, libc::LOCK_EX | libc::LOCK_NB) {
                remove_dir_all_quietly(dir);
            }
        }
        // Gone already, or the snapshot was never written: remove what is left.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => remove_dir_all_quietly(dir),
        Err(e) => log::warn!("cannot check {}: {e}", dir.display()),
    }
}

/// Where forks and pools keep their files unless told otherwise.
pub(super) const SHM: &str = "/dev/shm";

/// Numbers this process's fork and pool directories.
static FORKS: AtomicU32 = AtomicU32::new(0);

/// A new directory name `SHM/rollbox-KIND-PID-SEQ` for a fork (`kind` "fork") or a pool
/// ("pool"), as [`owner_of`] reads it back.
pub(super) fn shm_dir(kind: &str) -> PathBuf {
    let seq = FORKS.fetch_add(1, Ordering::SeqCst);
    PathBuf::from(format!("{SHM}/rollbox-{kind}-{}-{seq}", std::process::id()))
}

/// The pid in a `rollbox-fork-PID-SEQ` or `rollbox-pool-PID-SEQ` name.
fn owner_of(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("rollbox-fork-")
        .or_else(|| name.strip_prefix("rollbox-pool-"))?;
    let (pid, seq) = rest.split_once('-')?;
    seq.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Removes what forks of processes that are gone left in `base`. A parent killed while writing
/// a fork's snapshot leaves its directory: its shells never learned of it. A fork directory is
/// removed only when no running clone holds its snapshot; a pool directory only when empty.
pub(super) fn sweep_orphans(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(owner_of) else {
            continue;
        };
        if Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        let path = entry.path();
        if name.to_string_lossy().starts_with("rollbox-fork-") {
            remove_unused_snapshot(&path);
        } else {
            let _ = std::fs::remove_dir(&path);
        }
    }
}

/// Held by a running clone: its shared lock on the fork's snapshot; cleans up when dropped.
pub struct CloneGuard {
    cleanup: CloneCleanup,
    _snapshot_lock: Option<File>,
}

impl CloneGuard {
    /// Takes the shared lock on the snapshot named in `cleanup`.
    pub fn new(cleanup: CloneCleanup) -> Self {
        let lock = cleanup.snapshot_dir.as_ref().and_then(|dir| {
            let file = File::open(dir.join("vmstate")).ok()?;
            flock(&file, libc::LOCK_SH).then_some(file)
        });
        Self {
            cleanup,
            _snapshot_lock: lock,
        }
    }
}

impl Drop for CloneGuard {
    fn drop(&mut self) {
        self._snapshot_lock.take();
        self.cleanup.run();
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn the_snapshot_goes_with_the_last_clone_that_holds_it() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let fork_dir = scratch.path().join("fork");
        let own = |n: u32| fork_dir.join(format!("clone-{n}"));
        for n in 0..2 {
            std::fs::create_dir_all(own(n)).expect("clone dir");
        }
        std::fs::write(fork_dir.join("vmstate"), b"state").expect("vmstate");
        let guard = |n: u32| {
            CloneGuard::new(CloneCleanup {
                own_dirs: vec![own(n)],
                empty_dirs: Vec::new(),
                snapshot_dir: Some(fork_dir.clone()),
            })
        };
        let (first, second) = (guard(0), guard(1));
        drop(first);
        assert!(!own(0).exists(), "a clone's own directory goes with it");
        assert!(
            fork_dir.join("vmstate").exists(),
            "the snapshot went while a clone still held it"
        );
        drop(second);
        assert!(
            !fork_dir.exists(),
            "the last clone leaves the snapshot behind"
        );
    }

    #[test]
    fn orphaned_fork_directories_go_unless_a_clone_holds_them_or_their_owner_lives() {
        assert_eq!(owner_of("rollbox-fork-12-3"), Some(12));
        assert_eq!(owner_of("rollbox-pool-12-3"), Some(12));
        assert_eq!(owner_of("rollbox-fork-12"), None);
        assert_eq!(owner_of("rollbox-fork-x-3"), None);
        assert_eq!(owner_of("other-12-3"), None);

        let base = tempfile::tempdir().expect("tempdir");
        // A pid that is gone: a child that has been reaped.
        let mut child = Command::new("true").spawn().expect("spawn true");
        child.wait().expect("wait");
        let dead = child.id();
        let live = std::process::id();
        let dir = |owner: u32, seq: u32, kind: &str| {
            let dir = base.path().join(format!("rollbox-{kind}-{owner}-{seq}"));
            std::fs::create_dir_all(dir.join("clone-0")).expect("mkdir");
            dir
        };
        // A parent killed mid-snapshot: only its temporary memory file.
        let half_written = dir(dead, 1, "fork");
        std::fs::write(half_written.join(".memory.tmp-1"), b"x").expect("write");
        // A finished fork whose clone still runs (holds the shared lock).
        let held = dir(dead, 2, "fork");
        std::fs::write(held.join("vmstate"), b"x").expect("write");
        let lock = File::open(held.join("vmstate")).expect("open");
        assert!(flock(&lock, libc::LOCK_SH | libc::LOCK_NB));
        // A live parent's fork, and an empty pool directory of a dead one.
        let own = dir(live, 3, "fork");
        let pool = base.path().join(format!("rollbox-pool-{dead}-4"));
        std::fs::create_dir(&pool).expect("mkdir");

        sweep_orphans(base.path());
        assert!(
            !half_written.exists(),
            "a dead parent's half-written fork stayed"
        );
        assert!(held.exists(), "a fork a running clone holds was removed");
        assert!(own.exists(), "a live parent's fork was removed");
        assert!(
            !pool.exists(),
            "a dead parent's empty pool directory stayed"
        );
        drop(lock);
        sweep_orphans(base.path());
        assert!(!held.exists(), "the fork stayed after its last clone ended");
    }
}
