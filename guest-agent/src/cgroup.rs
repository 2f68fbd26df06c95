//! One cgroup per exec, when the memory controller is available: it gives
//! an exact OOM-kill count, a memory limit, and a way to kill every process
//! the exec left behind. cgroup v2 is used when the agent sits at the root
//! of a cgroup2 hierarchy (the guest); cgroup v1's memory controller when
//! that is what the system has (e.g. a hybrid host).

use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rollbox_agent_protocol::OomDetection;

use crate::errors::{sys, SysError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// The directory under which per-exec cgroups are created.
#[derive(Debug, Clone)]
pub struct CgroupBase {
    pub version: Version,
    pub dir: PathBuf,
}

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const BASE_NAME: &str = "rollbox-agent";

/// Find a usable memory cgroup hierarchy and create our base directory.
/// Returns None (with the reason) when there is none.
pub fn detect() -> Result<CgroupBase, String> {
    let own = fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("read /proc/self/cgroup: {e}"))?;
    // v1: a line "N:...memory...:/path".
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.split(',').any(|c| c == "memory") {
            let mount = Path::new(CGROUP_ROOT).join("memory");
            let dir = mount.join(path.trim_start_matches('/')).join(BASE_NAME);
            fs::create_dir_all(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
            return Ok(CgroupBase {
                version: Version::V1,
                dir,
            });
        }
    }
    // v2: only from the root cgroup (no-internal-process rule).
    let root = Path::new(CGROUP_ROOT);
    let controllers = fs::read_to_string(root.join("cgroup.controllers"))
        .map_err(|e| format!("no cgroup2 at {CGROUP_ROOT} ({e})"))?;
    if !controllers.split_whitespace().any(|c| c == "memory") {
        return Err("cgroup2 has no memory controller".into());
    }
    if !own.lines().any(|l| l == "0::/") {
        return Err(
            "the agent is not in the root cgroup2, so it cannot delegate the memory controller"
                .into(),
        );
    }
    write_file(&root.join("cgroup.subtree_control"), "+memory")?;
    let dir = root.join(BASE_NAME);
    fs::create_dir_all(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    write_file(&dir.join("cgroup.subtree_control"), "+memory")?;
    Ok(CgroupBase {
        version: Version::V2,
        dir,
    })
}

fn write_file(path: &Path, text: &str) -> Result<(), String> {
    fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("write {text:?} to {}: {e}", path.display()))
}

static NEXT: AtomicU64 = AtomicU64::new(1);
/// Names of this agent's cgroups still in use by an exec (never swept).
static LIVE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn live() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The cgroup of one exec.
#[derive(Debug)]
pub struct ExecCgroup {
    version: Version,
    name: String,
    dir: PathBuf,
    procs: fs::File,
}

impl ExecCgroup {
    pub fn create(base: &CgroupBase, memory_limit: Option<u64>) -> Result<Self, SysError> {
        sweep(base);
        let name = format!(
            "exec-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        live().insert(name.clone());
        let dir = base.dir.join(&name);
        let dir_text = dir.display().to_string();
        if let Err(err) = fs::create_dir(&dir) {
            live().remove(&name);
            return Err(SysError::new("mkdir", &dir_text, err));
        }
        let procs = match fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
        {
            Ok(procs) => procs,
            Err(err) => {
                live().remove(&name);
                let _ = fs::remove_dir(&dir);
                return Err(SysError::new(
                    "open",
                    format!("{dir_text}/cgroup.procs"),
                    err,
                ));
            }
        };
        let cgroup = Self {
            version: base.version,
            name,
            dir,
            procs,
        };
        if let Some(limit) = memory_limit {
            let (file, swap_file) = match cgroup.version {
                Version::V2 => ("memory.max", "memory.swap.max"),
                Version::V1 => ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
            };
            let path = cgroup.dir.join(file);
            fs::write(&path, limit.to_string())
                .map_err(sys("write", &path.display().to_string()))?;
            // Keep the limit from being dodged through swap; absent without swap accounting.
            let swap_value = if cgroup.version == Version::V2 {
                "0".to_owned()
            } else {
                limit.to_string()
            };
            let _ = fs::write(cgroup.dir.join(swap_file), swap_value);
        }
        Ok(cgroup)
    }

    /// An fd to which the child writes "0" to join (before exec).
    pub fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    pub fn detection(&self) -> OomDetection {
        match self.version {
            Version::V1 => OomDetection::CgroupV1,
            Version::V2 => OomDetection::CgroupV2,
        }
    }

    /// OOM kills inside this cgroup so far.
    pub fn oom_kills(&self) -> u64 {
        let file = match self.version {
            Version::V2 => "memory.events",
            Version::V1 => "memory.oom_control",
        };
        fs::read_to_string(self.dir.join(file))
            .map(|text| counter(&text, "oom_kill"))
            .unwrap_or(0)
    }

    fn pids(&self) -> Vec<i32> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// SIGKILL every process in the cgroup.
    pub fn kill_all(&self) {
        if self.version == Version::V2 && fs::write(self.dir.join("cgroup.kill"), "1").is_ok() {
            return;
        }
        for _ in 0..3 {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                // SAFETY: kill has no memory effects; a stale pid just gives ESRCH.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }

    /// Remove the cgroup once its processes are gone. A cgroup still in
    /// use (background processes left running) stays; a later sweep removes it.
    pub async fn remove(&self) {
        live().remove(&self.name);
        // Exited processes take a moment to leave; processes still running
        // in the background keep the cgroup, and a later sweep removes it.
        for _ in 0..5 {
            if fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
    }
}

impl Drop for ExecCgroup {
    fn drop(&mut self) {
        live().remove(&self.name);
        // Best effort; a cgroup still in use is swept later.
        let _ = fs::remove_dir(&self.dir);
    }
}

/// Remove empty cgroups left by this agent's finished execs, and by agents
/// that are gone (other live agents sharing the hierarchy keep theirs).
fn sweep(base: &CgroupBase) {
    let Ok(entries) = fs::read_dir(&base.dir) else {
        return;
    };
    let own = std::process::id();
    let live = live();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(owner) = name
            .strip_prefix("exec-")
            .and_then(|rest| rest.split('-').next()?.parse::<u32>().ok())
        else {
            continue;
        };
        let owner_gone = !Path::new(&format!("/proc/{owner}")).exists();
        if (owner == own && !live.contains(&name)) || owner_gone {
            let _ = fs::remove_dir(entry.path());
        }
    }
}

/// The value of `key` in a "key value" per line file.
pub fn counter(text: &str, key: &str) -> u64 {
    text.lines()
        .filter_map(|line| line.split_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The system-wide OOM kill count (/proc/vmstat), if the kernel reports it.
pub fn system_oom_kills() -> Option<u64> {
    let text = fs::read_to_string("/proc/vmstat").ok()?;
    text.lines()
        .any(|l| l.starts_with("oom_kill "))
        .then(|| counter(&text, "oom_kill"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_parse() {
        let events = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(counter(events, "oom_kill"), 1);
        assert_eq!(counter(events, "oom"), 2);
        assert_eq!(
            counter("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", "oom_kill"),
            3
        );
        assert_eq!(counter("", "oom_kill"), 0);
    }
}
