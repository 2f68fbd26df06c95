//! The on-disk cache:
//! ```text
//! <cache>/blobs/sha256/<hex>          layer blobs pulled from registries, verified
//! <cache>/rootfs/<key>/rootfs.ext4    built root filesystems, keyed by image digest,
//! <cache>/rootfs/<key>/image.json     agent hash, builder version and size
//! <cache>/bases/<key>/base.ext4      shared lower layers of split builds (images.md)
//! <cache>/chains/<hex>                empty markers: layer prefixes seen by split builds
//! <cache>/tmp/<kind>-<pid>-<n>        work in progress; renamed into place when complete
//! ```
//! Nothing outside `tmp/` is ever partly written: every entry appears by rename.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::digest::Digest;

pub const ROOTFS_FILE: &str = "rootfs.ext4";
pub const METADATA_FILE: &str = "image.json";
pub const BASE_FILE: &str = "base.ext4";

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache directory {path}: cannot {action}: {source}")]
    Io {
        path: String,
        action: &'static str,
        source: io::Error,
    },
}

fn io_error<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> CacheError + 'a {
    move |source| CacheError::Io {
        path: path.display().to_string(),
        action,
        source,
    }
}

#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
}

/// A built rootfs in the cache.
#[derive(Debug, Clone)]
pub struct CachedRootfs {
    pub rootfs: PathBuf,
    pub metadata: PathBuf,
}

impl Cache {
    /// Creates the layout if needed and removes work left behind by dead processes.
    pub fn open(root: &Path) -> Result<Self, CacheError> {
        for sub in ["blobs/sha256", "rootfs", "bases", "chains", "tmp"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).map_err(io_error(&dir, "create"))?;
        }
        let cache = Self {
            root: root.to_path_buf(),
        };
        cache.sweep_stale()?;
        Ok(cache)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    fn sweep_stale(&self) -> Result<(), CacheError> {
        let tmp = self.tmp_dir();
        for entry in fs::read_dir(&tmp).map_err(io_error(&tmp, "list"))? {
            let entry = entry.map_err(io_error(&tmp, "list"))?;
            let name = entry.file_name();
            let pid = name
                .to_str()
                .and_then(|n| n.split('-').nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            let alive = pid.is_some_and(|pid| Path::new("/proc").join(pid.to_string()).exists());
            if !alive {
                let path = entry.path();
                let removed = if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    fs::remove_dir_all(&path)
                } else {
                    fs::remove_file(&path)
                };
                removed.map_err(io_error(&path, "remove stale work"))?;
            }
        }
        Ok(())
    }

    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(digest.hex())
    }

    pub fn rootfs_dir(&self, key: &str) -> PathBuf {
        self.root.join("rootfs").join(key)
    }

    pub fn lookup_rootfs(&self, key: &str) -> Option<CachedRootfs> {
        let dir = self.rootfs_dir(key);
        let entry = CachedRootfs {
            rootfs: dir.join(ROOTFS_FILE),
            metadata: dir.join(METADATA_FILE),
        };
        (entry.rootfs.is_file() && entry.metadata.is_file()).then_some(entry)
    }

    /// A fresh path under tmp/ that is removed when dropped, unless committed.
    pub fn staging(&self, kind: &str) -> Staging {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Staging {
            path: self
                .tmp_dir()
                .join(format!("{kind}-{}-{nanos}{n}", std::process::id())),
            armed: true,
        }
    }

    /// Moves a finished staging directory to rootfs/<key>. If another build got there
    /// first, its entry wins and ours is dropped.
    pub fn commit_rootfs(&self, staging: Staging, key: &str) -> Result<CachedRootfs, CacheError> {
        let dir = self.rootfs_dir(key);
        match fs::rename(&staging.path, &dir) {
            Ok(()) => staging.disarm(),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
                drop(staging)
            }
            Err(e) => return Err(io_error(&dir, "move the built rootfs into place")(e)),
        }
        self.lookup_rootfs(key).ok_or_else(|| CacheError::Io {
            path: dir.display().to_string(),
            action: "find the rootfs just committed",
            source: io::Error::from(io::ErrorKind::NotFound),
        })
    }

    pub fn base_dir(&self, key: &str) -> PathBuf {
        self.root.join("bases").join(key)
    }

    /// The base.ext4 of bases/<key>, when complete.
    pub fn lookup_base(&self, key: &str) -> Option<PathBuf> {
        let file = self.base_dir(key).join(BASE_FILE);
        file.is_file().then_some(file)
    }

    /// Moves a finished staging directory (holding base.ext4) to bases/<key>; an entry already
    /// there wins.
    pub fn commit_base(&self, staging: Staging, key: &str) -> Result<PathBuf, CacheError> {
        let dir = self.base_dir(key);
        match fs::rename(&staging.path, &dir) {
            Ok(()) => staging.disarm(),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
                drop(staging)
            }
            Err(e) => return Err(io_error(&dir, "move the built base into place")(e)),
        }
        self.lookup_base(key).ok_or_else(|| CacheError::Io {
            path: dir.display().to_string(),
            action: "find the base just committed",
            source: io::Error::from(io::ErrorKind::NotFound),
        })
    }

    pub fn has_chain(&self, chain: &Digest) -> bool {
        self.root.join("chains").join(chain.hex()).exists()
    }

    /// Records that a build has seen the layer prefix `chain` (an empty file, by rename).
    pub fn mark_chain(&self, chain: &Digest) -> Result<(), CacheError> {
        let dest = self.root.join("chains").join(chain.hex());
        if dest.exists() {
            return Ok(());
        }
        let staging = self.staging("chain");
        fs::write(&staging.path, b"").map_err(io_error(&staging.path, "write a chain marker"))?;
        fs::rename(&staging.path, &dest).map_err(io_error(&dest, "store a chain marker"))?;
        staging.disarm();
        Ok(())
    }

    /// Moves a verified blob file into blobs/sha256/<hex>.
    pub fn commit_blob(&self, staging: Staging, digest: &Digest) -> Result<PathBuf, CacheError> {
        let dest = self.blob_path(digest);
        fs::rename(&staging.path, &dest).map_err(io_error(&dest, "store blob"))?;
        staging.disarm();
        Ok(dest)
    }
}

/// A temporary file or directory that removes itself unless disarmed.
#[derive(Debug)]
pub struct Staging {
    path: PathBuf,
    armed: bool,
}

impl Staging {
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Best effort: a failure here leaves work in tmp/, which the next open() sweeps.
        match fs::symlink_metadata(&self.path) {
            Ok(m) if m.is_dir() => {
                let _ = fs::remove_dir_all(&self.path);
            }
            Ok(_) => {
                let _ = fs::remove_file(&self.path);
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_is_removed_unless_committed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path()).unwrap();
        let staging = cache.staging("build");
        fs::create_dir(staging.path()).unwrap();
        fs::write(staging.path().join("x"), b"x").unwrap();
        let path = staging.path().to_path_buf();
        drop(staging);
        assert!(!path.exists());

        let staging = cache.staging("build");
        fs::create_dir(staging.path()).unwrap();
        fs::write(staging.path().join(ROOTFS_FILE), b"fs").unwrap();
        fs::write(staging.path().join(METADATA_FILE), b"{}").unwrap();
        let entry = cache.commit_rootfs(staging, "key").unwrap();
        assert_eq!(fs::read(&entry.rootfs).unwrap(), b"fs");
        assert!(cache.lookup_rootfs("key").is_some());

        // A second commit of the same key keeps the first.
        let staging = cache.staging("build");
        fs::create_dir(staging.path()).unwrap();
        fs::write(staging.path().join(ROOTFS_FILE), b"other").unwrap();
        fs::write(staging.path().join(METADATA_FILE), b"{}").unwrap();
        let entry = cache.commit_rootfs(staging, "key").unwrap();
        assert_eq!(fs::read(&entry.rootfs).unwrap(), b"fs");
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn stale_work_of_dead_processes_is_swept() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(tmp.join("build-999999999-1")).unwrap();
        fs::create_dir_all(tmp.join(format!("build-{}-1", std::process::id()))).unwrap();
        Cache::open(dir.path()).unwrap();
        assert!(!tmp.join("build-999999999-1").exists());
        assert!(tmp.join(format!("build-{}-1", std::process::id())).exists());
    }
}
