//! rollbox-jailer's cgroups, shared with `rollbox serve` (which removes a jail's groups when a
//! jailer was killed before it could). A jail's group is `<controller>/<parent>/<id>` in every
//! controller it has a setting for: cgroup v2 where the unified hierarchy has the controller,
//! else the v1 hierarchy `<fs>/<controller>`.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A failed jail step, naming the step and its input.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("{step} {input}: {source}")]
    Step {
        step: &'static str,
        input: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Usage(String),
}

impl JailError {
    /// A failed `step` on `input`.
    pub fn step(
        step: &'static str,
        input: impl AsRef<Path>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let input = input.as_ref().display().to_string();
        move |source| JailError::Step {
            step,
            input,
            source,
        }
    }
}

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
                std::fs::create_dir(&dir).map_err(JailError::step("mkdir cgroup", &dir))?;
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
}
