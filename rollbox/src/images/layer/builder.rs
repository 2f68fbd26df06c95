//! The apply loop: a root directory that layers are applied to in order, entry by entry, and
//! the final pass that sets directory mtimes.

use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::context::LayerCtx;
use super::entry::apply_entry;
use super::error::LayerError;
use super::meta::read_meta;
use super::path::normalize_entry_path;
use super::whiteout::apply_whiteout;
use crate::images::sys::set_times_nofollow;

/// What one layer did, for progress and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayerStats {
    pub entries: u64,
    pub whiteouts: u64,
    pub file_bytes: u64,
}

/// A root directory that layers are applied to, in order.
pub struct RootfsBuilder {
    root: PathBuf,
    /// Directory mtimes are set last: adding children changes them.
    dir_times: HashMap<PathBuf, (i64, u32)>,
    /// The most entries the next layer may hold.
    entry_cap: u64,
}

impl RootfsBuilder {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            dir_times: HashMap::new(),
            entry_cap: u64::MAX,
        }
    }

    /// Caps the entries of each layer applied from now on: one more is
    /// [`LayerError::TooManyEntries`].
    pub fn set_entry_cap(&mut self, cap: u64) {
        self.entry_cap = cap;
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Applies one uncompressed layer tar stream. `layer` names the layer in errors.
    pub fn apply_layer<R: Read>(
        &mut self,
        layer: &str,
        tar_stream: R,
    ) -> Result<LayerStats, LayerError> {
        let mut ctx = LayerCtx {
            layer,
            entry: String::new(),
            created: HashSet::new(),
        };
        let mut stats = LayerStats::default();
        let mut archive = tar::Archive::new(tar_stream);
        let entries = archive.entries().map_err(|e| ctx.read(e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| ctx.read(e))?;
            let raw_path = entry.path().map_err(|e| ctx.read(e))?.into_owned();
            ctx.entry = raw_path.display().to_string();
            let rel = normalize_entry_path(&raw_path)
                .map_err(|problem| problem.into_error(layer, &ctx.entry))?;
            stats.entries += 1;
            if stats.entries > self.entry_cap {
                return Err(LayerError::TooManyEntries {
                    layer: layer.to_string(),
                    limit: self.entry_cap,
                });
            }

            if apply_whiteout(&self.root, &mut ctx, &rel)? {
                stats.whiteouts += 1;
                continue;
            }
            let meta = read_meta(&mut entry).map_err(|e| ctx.read(e))?;
            stats.file_bytes += apply_entry(
                &self.root,
                &mut self.dir_times,
                &mut ctx,
                &rel,
                &mut entry,
                meta,
            )?;
        }
        Ok(stats)
    }

    /// Sets directory mtimes recorded from the layers. Call once, after the last change.
    pub fn finish(&mut self) -> Result<(), LayerError> {
        self.set_dir_times()?;
        self.dir_times.clear();
        Ok(())
    }

    /// Sets the directory mtimes recorded so far and keeps them, so that [`Self::finish`]
    /// sets them again after later layers: for a snapshot of the tree between layers.
    pub fn set_dir_times(&self) -> Result<(), LayerError> {
        for (rel, mtime) in &self.dir_times {
            let mtime = *mtime;
            let full = self.root.join(rel);
            match set_times_nofollow(&full, mtime) {
                Ok(()) => {}
                // Removed by a later layer.
                Err(e)
                    if e.kind() == io::ErrorKind::NotFound
                        || e.raw_os_error() == Some(libc::ENOTDIR) => {}
                Err(source) => {
                    return Err(LayerError::Io {
                        layer: "(final pass)".to_string(),
                        entry: rel.display().to_string(),
                        action: "set mtime of",
                        path: full.display().to_string(),
                        source,
                    })
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_tar::LayerTar;
    use super::*;

    #[test]
    fn truncated_layer_is_a_read_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        let bytes = LayerTar::new()
            .file("big", &[7u8; 10_000], 0o644, 0, 0)
            .bytes();
        let err = rootfs.apply_layer("cut", &bytes[..3000]).unwrap_err();
        assert!(matches!(err, LayerError::Read { .. }), "{err}");
    }

    #[test]
    fn entries_past_the_cap_stop_the_layer() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        rootfs.set_entry_cap(2);
        let bytes = LayerTar::new()
            .file("a", b"a", 0o644, 0, 0)
            .file("b", b"b", 0o644, 0, 0)
            .file("c", b"c", 0o644, 0, 0)
            .bytes();
        let err = rootfs.apply_layer("many", &bytes[..]).unwrap_err();
        assert!(
            matches!(err, LayerError::TooManyEntries { limit: 2, .. }),
            "{err}"
        );
        assert!(!dir.path().join("c").exists());
    }
}
