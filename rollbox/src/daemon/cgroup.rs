//! Fractional CPU limits: a sandbox with a `cpu_limit` has its VMM in a cgroup of its own,
//! `<controller>/rollbox-<hash of the state dir>/<sandbox id>`, with a CPU quota: cgroup v2
//! `cpu.max` where a cgroup2 hierarchy has the cpu controller, else v1 `cpu.cfs_quota_us`.
//! The group is made before the VMM is started and the VMM's pid is moved in right after the
//! spawn (before it answers on its API socket); it is removed when the sandbox ends, and
//! groups of no live sandbox are removed when the daemon starts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::api::{ApiError, Sandbox};
use super::Daemon;

/// The CFS period every quota is a share of (100 ms, the kernel's default).
pub const PERIOD_US: u64 = 100_000;
/// The smallest quota the kernel takes (1 ms).
const MIN_QUOTA_US: u64 = 1_000;

/// A failed cgroup operation.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cpu_limit: no writable cgroup cpu controller on this host (looked for cgroup2 with cpu in {fs}/cgroup.controllers or {fs}/unified/cgroup.controllers, and v1 {fs}/cpu/cpu.cfs_quota_us): {why}")]
    NoController { fs: PathBuf, why: String },
    #[error("cgroup {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Which cgroup interface the controller has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// The daemon's cgroup root in the cpu hierarchy.
#[derive(Debug, Clone)]
pub struct Cgroups {
    pub root: PathBuf,
    pub version: Version,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, text: &str) -> Result<(), CgroupError> {
    std::fs::write(path, text).map_err(io(path))
}

/// A short stable name for the daemon's root: two daemons with other state dirs never share.
pub fn root_name(state_dir: &Path) -> String {
    // FNV-1a: stable across builds, unlike std's hasher.
    let hash = state_dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("rollbox-{hash:016x}")
}

/// The quota in microseconds per [`PERIOD_US`] for `cores` of CPU time.
pub fn quota_us(cores: f64) -> u64 {
    ((cores * PERIOD_US as f64).round() as u64).max(MIN_QUOTA_US)
}

impl Cgroups {
    /// Finds the cpu controller under `fs` (normally /sys/fs/cgroup); the daemon's root in it
    /// is `name` (made by the first [`Cgroups::create`]).
    pub fn find(fs: &Path, name: &str) -> Result<Cgroups, CgroupError> {
        let no = |why: String| CgroupError::NoController {
            fs: fs.to_path_buf(),
            why,
        };
        let has_cpu = |dir: &Path| {
            std::fs::read_to_string(dir.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"))
        };
        let (base, version) = if has_cpu(fs) {
            (fs.to_path_buf(), Version::V2)
        } else if has_cpu(&fs.join("unified")) {
            (fs.join("unified"), Version::V2)
        } else if fs.join("cpu/cpu.cfs_quota_us").is_file() {
            (fs.join("cpu"), Version::V1)
        } else {
            return Err(no("none found".into()));
        };
        Ok(Cgroups {
            root: base.join(name),
            version,
        })
    }

    pub fn path(&self, sandbox: &str) -> PathBuf {
        self.root.join(sandbox)
    }

    /// Makes the sandbox's group with a quota of `cores`.
    pub fn create(&self, sandbox: &str, cores: f64) -> Result<PathBuf, CgroupError> {
        std::fs::create_dir_all(&self.root).map_err(io(&self.root))?;
        if self.version == Version::V2 {
            // Children of the hierarchy's root and of the daemon's get the cpu controller.
            if let Some(base) = self.root.parent() {
                write(&base.join("cgroup.subtree_control"), "+cpu")?;
            }
            write(&self.root.join("cgroup.subtree_control"), "+cpu")?;
        }
        let dir = self.path(sandbox);
        match std::fs::create_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(io(&dir)(e));
            }
            _ => {}
        }
        let quota = quota_us(cores);
        match self.version {
            Version::V2 => write(&dir.join("cpu.max"), &format!("{quota} {PERIOD_US}"))?,
            Version::V1 => {
                write(&dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                write(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
        }
        Ok(dir)
    }

    /// Moves process `pid` (all its threads) into the sandbox's group.
    pub fn enter(&self, sandbox: &str, pid: u32) -> Result<(), CgroupError> {
        write(&self.path(sandbox).join("cgroup.procs"), &pid.to_string())
    }

    /// Removes the sandbox's group (its processes must have ended; a group that is gone is
    /// fine). An exiting process may linger in it a moment: a few tries.
    pub fn remove(&self, sandbox: &str) -> Result<(), CgroupError> {
        let dir = self.path(sandbox);
        let mut tries = 0;
        loop {
            match std::fs::remove_dir(&dir) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) if tries >= 50 => return Err(io(&dir)(e)),
                Err(_) => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    /// Groups under the root whose names `keep` rejects are removed (after a restart: those
    /// of no live sandbox). Their processes are killed first by the caller's VMM reaping.
    pub fn reap(&self, keep: impl Fn(&str) -> bool) -> Vec<String> {
        let mut removed = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return removed;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if entry.path().is_dir() && !keep(&name) && self.remove(&name).is_ok() {
                removed.push(name);
            }
        }
        removed
    }
}

impl Daemon {
    /// The cgroups a create with `cpu_limit` needs; a clear 503 where the host has none.
    pub(super) fn cgroups_for(&self, cpu_limit: Option<f64>) -> Result<Option<&Cgroups>, ApiError> {
        match (cpu_limit, &self.cgroups) {
            (None, _) => Ok(None),
            (Some(_), Ok(groups)) => Ok(Some(groups)),
            (Some(_), Err(why)) => Err(ApiError::Unavailable(why.clone())),
        }
    }

    /// Removes a sandbox's cgroup after its VMM ended (logged on failure).
    pub(super) fn release_cgroup(&self, sandbox: &Sandbox) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_and_names() {
        assert_eq!(quota_us(0.5), 50_000);
        assert_eq!(quota_us(2.0), 200_000);
        assert_eq!(quota_us(0.001), MIN_QUOTA_US);
        let a = root_name(Path::new("/var/lib/rollbox"));
        assert_eq!(a, root_name(Path::new("/var/lib/rollbox")));
        assert_ne!(a, root_name(Path::new("/var/lib/rollbox2")));
    }

    #[test]
    fn no_controller_is_an_error_naming_cpu_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let error = Cgroups::find(dir.path(), "rollbox-x")
            .expect_err("an empty dir has no cpu controller")
            .to_string();
        assert!(error.contains("cpu_limit"), "{error}");
    }

    #[test]
    fn a_v2_layout_gets_cpu_max_and_the_controller_delegated() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("cgroup.controllers"),
            "cpuset cpu io memory\n",
        )
        .expect("write");
        let groups = Cgroups::find(dir.path(), "rollbox-x").expect("find");
        assert_eq!(groups.version, Version::V2);
        let group = groups.create("sb-1", 1.5).expect("create");
        assert_eq!(
            std::fs::read_to_string(group.join("cpu.max")).expect("read"),
            "150000 100000"
        );
        for subtree in [dir.path().to_path_buf(), groups.root.clone()] {
            let control = subtree.join("cgroup.subtree_control");
            assert_eq!(std::fs::read_to_string(control).expect("read"), "+cpu");
        }
    }

    #[test]
    fn a_v1_layout_gets_a_cfs_quota() {
        // A fake v1 hierarchy: plain files stand in for the kernel's.
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("cpu")).expect("mkdir");
        std::fs::write(dir.path().join("cpu/cpu.cfs_quota_us"), "-1").expect("write");
        let groups = Cgroups::find(dir.path(), "rollbox-x").expect("find");
        assert_eq!(groups.version, Version::V1);
        let group = groups.create("sb-1", 0.25).expect("create");
        assert_eq!(
            std::fs::read_to_string(group.join("cpu.cfs_quota_us")).expect("read"),
            "25000"
        );
    }
}
