//! A scratch directory for targets that write files: the target writes below `root`, and
//! anything that appears beside it was written outside, which is a finding.

use std::path::PathBuf;

pub struct Scratch {
    dir: tempfile::TempDir,
    pub root: PathBuf,
}

impl Scratch {
    pub fn new() -> Scratch {
        let dir =
            tempfile::tempdir().unwrap_or_else(|e| panic!("fuzz rig: temporary directory: {e}"));
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap_or_else(|e| panic!("fuzz rig: {}: {e}", root.display()));
        Scratch { dir, root }
    }

    /// Panics when anything but `root` is in the scratch directory; `what` wrote it.
    pub fn assert_nothing_outside(&self, what: &str) {
        let names: Vec<_> = std::fs::read_dir(self.dir.path())
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok().map(|e| e.file_name()))
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            names.len() == 1 && names[0] == "root",
            "{what} wrote outside its root: {names:?}"
        );
    }
}
