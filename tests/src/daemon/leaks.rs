//! What a daemon holds, read from /proc and /sys for the leak checks of
//! rollbox/tests/daemon_load.rs: its fds and children, the files under its state directory,
//! the host's network interfaces (taps), and the ids of a list of sandboxes.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

/// The ids of `sandboxes` (sandbox objects).
pub fn ids(sandboxes: &[Value]) -> BTreeSet<String> {
    sandboxes
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

/// What `readlink /proc/PID/fd/*` shows: `socket:[…]`, `pipe:[…]`, paths, `anon_inode:…`.
pub fn fds(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|target| target.to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Processes whose parent is `pid` (zombies included): "PID STATE COMM" each.
pub fn children_of(pid: u32) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Field 3 is the state, field 4 the parent's pid.
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(pid) {
            found.push(format!(
                "{} {} {}",
                entry.file_name().to_string_lossy(),
                fields.first().unwrap_or(&"?"),
                stat.get(..close + 1).unwrap_or_default()
            ));
        }
    }
    found
}

/// Every file and directory under `root`, relative, except SQLite's own side files.
pub fn tree(root: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .to_string();
            if rel.starts_with("state.db") {
                continue;
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
            out.insert(rel);
        }
    }
    out
}

/// Network interfaces of the host (tap devices show up here).
pub fn interfaces() -> BTreeSet<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_lists_files_and_directories_but_not_sqlites_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("sandboxes/sb-1")).expect("mkdir");
        for file in ["state.db", "state.db-wal", "sandboxes/sb-1/console.log"] {
            std::fs::write(dir.path().join(file), b"").expect("write");
        }
        let want: BTreeSet<String> = ["sandboxes", "sandboxes/sb-1", "sandboxes/sb-1/console.log"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(tree(dir.path()), want);
    }

    #[test]
    fn this_process_has_fds_and_a_parent_that_lists_it() {
        assert!(!fds(std::process::id()).is_empty());
        let parent = std::os::unix::process::parent_id();
        let me = std::process::id().to_string();
        assert!(
            children_of(parent)
                .iter()
                .any(|c| c.starts_with(&format!("{me} "))),
            "{:?}",
            children_of(parent)
        );
    }
}
