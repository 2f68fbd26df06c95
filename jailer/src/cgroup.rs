//! The host's cgroups, for the jailer and for `rollbox serve`: the one place that knows
//! where controllers are mounted and how their files are written.
//!
//! A jail's group is `<controller>/<parent>/<id>` in every controller it has a setting for:
//! cgroup v2 where the unified hierarchy has the controller, else the v1 hierarchy
//! `<fs>/<controller>` ([`JailGroups`]; `rollbox serve` removes a jail's groups when a jailer
//! was killed before it could). A sandbox with a `cpu_limit` and no jail has a group of its own
//! in the cpu controller, `<cpu>/rollbox-<hash of the state dir>/<sandbox id>`, with a CPU
//! quota: cgroup v2 `cpu.max` where a cgroup2 hierarchy has the cpu controller, else v1
//! `cpu.cfs_quota_us` ([`Cgroups`]; the same quota goes into a jail as [`quota_settings`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::JailError;

/// One `--cgroup FILE=VALUE`: `controller.name=value`, e.g. `memory.limit_in_bytes=1G`.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub controller: String,
    pub file: String,
    pub value: String,
}

impl std::str::FromStr for Setting {
    type Err = String;

    fn from_str(text: &str) -> Result<Setting, String> {
        let bad = || format!("--cgroup {text:?}: want CONTROLLER.FILE=VALUE, e.g. pids.max=64");
        let (file, value) = text.split_once('=').ok_or_else(bad)?;
        let (controller, rest) = file.split_once('.').ok_or_else(bad)?;
        let plain = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
        };
        if !plain(controller) || !plain(rest) || value.is_empty() || value.contains('\n') {
            return Err(bad());
        }
        Ok(Setting {
            controller: controller.to_string(),
            file: file.to_string(),
            value: value.to_string(),
        })
    }
}

fn controllers_of(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("cgroup.controllers"))
        .map(|c| c.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The hierarchy that has `controller` under `fs`: (its base, whether it is v2).
pub fn hierarchy(fs: &Path, controller: &str) -> Result<(PathBuf, bool), JailError> {
    for v2 in [fs.to_path_buf(), fs.join("unified")] {
        if controllers_of(&v2).iter().any(|c| c == controller) {
            return Ok((v2, true));
        }
    }
    let v1 = fs.join(controller);
    if v1.join("cgroup.procs").is_file() {
        return Ok((v1, false));
    }
    Err(JailError::Usage(format!(
        "cgroup controller {controller:?}: neither in a cgroup2 cgroup.controllers under {} nor mounted at {}",
        fs.display(),
        v1.display()
    )))
}

/// The groups of one jail.
#[derive(Debug, Default)]
pub struct JailGroups {
    /// Each group directory, once (a v2 group holds every controller).
    pub dirs: Vec<PathBuf>,
}

impl JailGroups {
    /// Makes `<hierarchy>/<parent>/<id>` for each controller in `settings` and writes them.
    pub fn create(
        fs: &Path,
        parent: &str,
        id: &str,
        settings: &[Setting],
    ) -> Result<JailGroups, JailError> {
        let mut groups = JailGroups::default();
        let result = groups.fill(fs, parent, id, settings);
        if result.is_err() {
            groups.remove();
        }
        result.map(|()| groups)
    }

    fn fill(
        &mut self,
        fs: &Path,
        parent: &str,
        id: &str,
        settings: &[Setting],
    ) -> Result<(), JailError> {
        for setting in settings {
            let (base, v2) = hierarchy(fs, &setting.controller)?;
            let dir = base.join(parent).join(id);
            if !self.dirs.contains(&dir) {
                let top = base.join(parent);
                std::fs::create_dir_all(&top).map_err(JailError::step("mkdir cgroup", &top))?;
                make_fresh_group(&dir)?;
                self.dirs.push(dir.clone());
            }
            if v2 {
                // The controller is delegated down to the jail's group.
                let enable = format!("+{}", setting.controller);
                for subtree in [base.clone(), base.join(parent)] {
                    let control = subtree.join("cgroup.subtree_control");
                    std::fs::write(&control, &enable)
                        .map_err(JailError::step("enable cgroup controller in", &control))?;
                }
            }
            let file = dir.join(&setting.file);
            std::fs::write(&file, &setting.value).map_err(JailError::step(
                "write cgroup limit",
                format!("{}={}", file.display(), setting.value),
            ))?;
        }
        Ok(())
    }

    /// Moves the calling process into every group ("0" names the writer, in any PID namespace).
    pub fn enter_self(&self) -> Result<(), JailError> {
        for dir in &self.dirs {
            let procs = dir.join("cgroup.procs");
            std::fs::write(&procs, "0").map_err(JailError::step("join cgroup", &procs))?;
        }
        Ok(())
    }

    /// Removes every group (their processes must have ended; an exiting one may linger a
    /// moment). Returns the groups it could not remove.
    pub fn remove(&self) -> Vec<JailError> {
        self.dirs
            .iter()
            .filter_map(|d| remove_group(d).err())
            .collect()
    }
}

/// Makes a jail's group. One that is already there was left by this sandbox's previous VMM (a
/// reset or restore starts the next VMM right after killing the last, and on a loaded host the
/// killed one can take longer to leave than its daemon waited): it is removed first, waiting
/// as [`remove_group`] does for its last task to leave, so every jail starts from a fresh group.
fn make_fresh_group(dir: &Path) -> Result<(), JailError> {
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            remove_group(dir)?;
            std::fs::create_dir(dir).map_err(JailError::step("mkdir cgroup", dir))
        }
        made => made.map_err(JailError::step("mkdir cgroup", dir)),
    }
}

/// Removes one (empty) cgroup directory; gone already is fine.
pub fn remove_group(dir: &Path) -> Result<(), JailError> {
    let mut tries = 0;
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if tries >= 100 => return Err(JailError::step("remove cgroup", dir)(e)),
            Err(_) => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Every group directory a jail `<parent>/<id>` may have under `fs`, that exists.
pub fn existing_groups(fs: &Path, parent: &str, id: &str) -> Vec<PathBuf> {
    let mut bases = vec![fs.to_path_buf()];
    if let Ok(entries) = std::fs::read_dir(fs) {
        bases.extend(entries.flatten().map(|e| e.path()));
    }
    bases
        .into_iter()
        .map(|b| b.join(parent).join(id))
        .filter(|d| d.is_dir())
        .collect()
}

/// Every jail group under `<hierarchy>/<parent>/` in any hierarchy under `fs`: (id, dir).
pub fn all_jail_groups(fs: &Path, parent: &str) -> Vec<(String, PathBuf)> {
    let mut bases = vec![fs.to_path_buf()];
    if let Ok(entries) = std::fs::read_dir(fs) {
        bases.extend(entries.flatten().map(|e| e.path()));
    }
    bases
        .into_iter()
        .filter_map(|b| std::fs::read_dir(b.join(parent)).ok())
        .flat_map(|entries| entries.flatten())
        .filter(|e| e.path().is_dir())
        .map(|e| (e.file_name().to_string_lossy().to_string(), e.path()))
        .collect()
}

/// Removes every group of the jail `<parent>/<id>` under `fs` (after its jailer was killed).
pub fn remove_jail_groups(fs: &Path, parent: &str, id: &str) -> Vec<JailError> {
    existing_groups(fs, parent, id)
        .iter()
        .filter_map(|d| remove_group(d).err())
        .collect()
}

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

/// A quota of `cores` as the files that set it (`FILE=VALUE`, a jailer's `--cgroup`s).
pub fn quota_settings(version: Version, cores: f64) -> Vec<String> {
    let quota = quota_us(cores);
    match version {
        Version::V1 => vec![
            format!("cpu.cfs_period_us={PERIOD_US}"),
            format!("cpu.cfs_quota_us={quota}"),
        ],
        Version::V2 => vec![format!("cpu.max={quota} {PERIOD_US}")],
    }
}

/// A memory limit of `bytes` as the file that sets it (`FILE=VALUE`, a jailer's `--cgroup`):
/// cgroup v2 `memory.max` where a cgroup2 hierarchy under `fs` has the memory controller,
/// else v1 `memory.limit_in_bytes`.
pub fn memory_limit_setting(fs: &Path, bytes: u64) -> String {
    let file = match hierarchy(fs, "memory") {
        Ok((_, true)) => "memory.max",
        _ => "memory.limit_in_bytes",
    };
    format!("{file}={bytes}")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_bad_ones_are_named() {
        let s: Setting = "memory.limit_in_bytes=1048576".parse().expect("parse");
        assert_eq!(s.controller, "memory");
        assert_eq!(s.file, "memory.limit_in_bytes");
        assert_eq!(s.value, "1048576");
        for bad in ["pids", "pids.max", "=1", "../x.max=1", "pids.max="] {
            let error = bad.parse::<Setting>().expect_err(bad);
            assert!(error.contains(bad), "{error}");
        }
    }

    #[test]
    fn a_group_left_by_the_previous_vmm_is_replaced_and_a_busy_one_is_named() {
        let fs = tempfile::tempdir().expect("tempdir");
        let left = fs.path().join("sb-1");
        std::fs::create_dir(&left).expect("mkdir");
        make_fresh_group(&left).expect("an empty group left behind is replaced");
        assert!(left.is_dir());
        // A group that stays busy (here: a directory that cannot be removed) is an error.
        std::fs::write(left.join("task"), "").expect("write");
        let error = make_fresh_group(&left).expect_err("busy");
        assert!(error.to_string().contains("sb-1"), "{error}");
    }

    #[test]
    fn a_v1_layout_gets_a_group_per_controller_and_loses_them() {
        let fs = tempfile::tempdir().expect("tempdir");
        for c in ["pids", "memory"] {
            std::fs::create_dir(fs.path().join(c)).expect("mkdir");
            std::fs::write(fs.path().join(c).join("cgroup.procs"), "").expect("write");
        }
        let settings: Vec<Setting> = ["pids.max=9", "memory.limit_in_bytes=4096"]
            .iter()
            .map(|s| s.parse().expect("parse"))
            .collect();
        let groups = JailGroups::create(fs.path(), "rollbox-x", "vm1", &settings).expect("create");
        assert_eq!(groups.dirs.len(), 2);
        let pids = fs.path().join("pids/rollbox-x/vm1/pids.max");
        assert_eq!(std::fs::read_to_string(pids).expect("read"), "9");
        assert_eq!(existing_groups(fs.path(), "rollbox-x", "vm1").len(), 2);
        // Plain files stand in for the kernel's: remove them so rmdir works.
        for dir in &groups.dirs {
            for entry in std::fs::read_dir(dir).expect("readdir").flatten() {
                std::fs::remove_file(entry.path()).expect("rm");
            }
        }
        assert!(remove_jail_groups(fs.path(), "rollbox-x", "vm1").is_empty());
        assert!(existing_groups(fs.path(), "rollbox-x", "vm1").is_empty());
        let error = JailGroups::create(
            fs.path(),
            "rollbox-x",
            "vm2",
            &["cpu.shares=2".parse().expect("parse")],
        )
        .expect_err("no cpu controller");
        assert!(error.to_string().contains("\"cpu\""), "{error}");
    }

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
    fn a_memory_limit_is_memory_max_on_v2_and_limit_in_bytes_on_v1() {
        let v2 = tempfile::tempdir().expect("tempdir");
        std::fs::write(v2.path().join("cgroup.controllers"), "cpu memory pids\n").expect("write");
        assert_eq!(
            memory_limit_setting(v2.path(), 1 << 20),
            "memory.max=1048576"
        );
        let v1 = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            memory_limit_setting(v1.path(), 1 << 20),
            "memory.limit_in_bytes=1048576"
        );
    }

    #[test]
    fn a_jails_quota_is_the_files_a_group_of_its_own_gets() {
        assert_eq!(
            quota_settings(Version::V1, 0.5),
            ["cpu.cfs_period_us=100000", "cpu.cfs_quota_us=50000"]
        );
        assert_eq!(quota_settings(Version::V2, 2.0), ["cpu.max=200000 100000"]);
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
