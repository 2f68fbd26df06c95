//! Taking a sandbox VMM's snapshot into a daemon directory: the VMM's Full snapshot (written
//! by a jailed VMM into its own directory and moved out through checked descriptors), the
//! copy of the sandbox's disk beside it, and what an unfinished one left behind.

use std::path::{Path, PathBuf};
use std::time::Instant;

use vmm_api::{CreateSnapshotParams, ResumedSnapshot};

use super::disk::copy_file;
use super::jaildir::{JailDir, JailDirError};
use super::vm::{api_client, api_error, Paths, VmError, SNAPSHOT_TIMEOUT};
use crate::daemon::util::{ms_since, remove_dir};

/// What the VMM may write beside a snapshot's `vmstate` and `memory` (`memory.id`, ...); never
/// a name the daemon writes itself.
const DAEMON_SNAPSHOT_FILES: [&str; 1] = ["rootfs.img"];

/// When a paused VM runs again after its snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Not at all: whoever paused it resumes it.
    Never,
    /// As soon as the VMM has imaged its memory (fork(2)), while a child process writes the
    /// memory file (`"rollbox": {"resume_vm": true}`); the call returns once it is written.
    WhileWriting,
}

/// `PUT /snapshot/create` (Full) into `dir`/vmstate and `dir`/memory; the VM must be paused.
/// A jailed VMM (its directory owned by `jail_uid`) writes them into its own directory
/// (`/snapshot-new/`), and they are moved to `dir` from there: regular files only, each
/// checked through its descriptor ([`JailDir::move_file_to`]).
/// With [`Resume::WhileWriting`], returns the VMM's figures: how long the VM stayed paused.
pub fn create_snapshot(
    paths: &Paths,
    dir: &Path,
    jail_uid: Option<u32>,
    resume: Resume,
) -> Result<Option<ResumedSnapshot>, VmError> {
    let sandbox = JailDir::open(&paths.dir)?;
    let (uid, gid) = sandbox.owner();
    let jailed = jail_uid == Some(uid);
    let seen_as = if jailed {
        // The jail's uid writes there: the owner of the sandbox directory.
        sandbox.fresh_subdir("snapshot-new", uid, gid)?;
        PathBuf::from("/snapshot-new")
    } else {
        dir.to_path_buf()
    };
    let params = CreateSnapshotParams {
        snapshot_type: "Full".into(),
        snapshot_path: seen_as.join("vmstate"),
        mem_file_path: seen_as.join("memory"),
        version: None,
        rollbox: None,
    };
    let (client, sock) = api_client(paths, SNAPSHOT_TIMEOUT)?;
    let made = match resume {
        Resume::Never => client.create_snapshot(&params).map(|()| None),
        Resume::WhileWriting => client.create_snapshot_resuming(&params).map(Some),
    }
    .map_err(api_error(&sock));
    if !jailed {
        return made;
    }
    let moved = made.and_then(|resumed| {
        let staging = sandbox.subdir("snapshot-new")?;
        let to = JailDir::open(dir)?;
        for name in staging.names()? {
            if DAEMON_SNAPSHOT_FILES.iter().any(|n| name == *n) {
                return Err(JailDirError::Refused {
                    dir: staging.path().to_path_buf(),
                    name: name.to_string_lossy().into_owned(),
                    why: "the daemon writes that name itself".into(),
                }
                .into());
            }
            staging.move_file_to(&name, &to)?;
        }
        Ok(resumed)
    });
    // remove_dir_all removes a symlink itself and follows none below it.
    let _ = std::fs::remove_dir_all(paths.dir.join("snapshot-new"));
    moved
}

/// Copies the sandbox's disk (`rootfs.img`, opened with no symlink followed and checked) to
/// `to`, a new file.
pub fn copy_rootfs(paths: &Paths, to: &Path) -> Result<(), VmError> {
    let source = JailDir::open(&paths.dir)?.open_file("rootfs.img")?;
    let failed = |source| VmError::Rootfs {
        from: paths.rootfs.clone(),
        to: to.to_path_buf(),
        source,
    };
    let dest = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(failed)?;
    copy_file(&source, &dest).map_err(failed)
}

/// Takes a copy of the paused VM's rootfs (when `rootfs`) and a Full snapshot into `dir` (made
/// here); on error `dir` is gone. With `resume`, the VMM resumes the VM as soon as its memory
/// is imaged and writes the memory file while it runs ([`Resume::WhileWriting`]; a
/// failed snapshot may leave it paused), and the answer says how long after `paused_at` it
/// ran again, in ms. Blocking. A jailed VMM's snapshot directory is its group's to read (mode
/// 0750): a restore binds it into a jail.
pub fn snapshot_vm(
    sandbox_dir: &Path,
    dir: &Path,
    rootfs: bool,
    jail_uid: Option<u32>,
    resume: Resume,
    paused_at: Instant,
) -> Result<Option<f64>, String> {
    let paths = Paths::new(sandbox_dir);
    std::fs::create_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = (|| {
        let sandbox = JailDir::open(&paths.dir).map_err(|e| e.to_string())?;
        let (uid, gid) = sandbox.owner();
        if jail_uid == Some(uid) {
            JailDir::open(dir)
                .and_then(|d| d.set_group_mode(gid, 0o750))
                .map_err(|e| e.to_string())?;
        }
        // The disk is copied first, while the vCPUs are paused, so it matches the memory.
        if rootfs {
            copy_rootfs(&paths, &dir.join("rootfs.img")).map_err(|e| e.to_string())?;
        }
        let calling = ms_since(paused_at);
        let resumed = create_snapshot(&paths, dir, jail_uid, resume).map_err(|e| e.to_string())?;
        Ok(resumed.map(|r| calling + r.paused_ms))
    })();
    if result.is_err() {
        let _ = remove_dir(dir);
    }
    result
}

/// Removes what a snapshot that was not finished left in the sandbox's directory (the jailed
/// VMM's `snapshot-new/`, see [`create_snapshot`]); a symlink there is removed, not
/// followed.
pub fn remove_snapshot_staging(sandbox_dir: &Path) -> std::io::Result<()> {
    remove_dir(&sandbox_dir.join("snapshot-new"))
}
