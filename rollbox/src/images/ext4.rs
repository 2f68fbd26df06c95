//! Sizing and making the ext4 image with `mkfs.ext4 -d DIR -b 4096 -m 0`, and copying
//! the (sparse) result.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::Command;

const BLOCK: u64 = 4096;
const MIB: u64 = 1024 * 1024;
/// Free space left in an auto-sized image, so a sandbox can write files.
pub const DEFAULT_FREE_MIB: u64 = 64;
const INODE_SIZE: u64 = 256;

#[derive(Debug, thiserror::Error)]
pub enum Ext4Error {
    #[error("cannot measure the staged rootfs at {path}: {source}")]
    Measure { path: String, source: io::Error },
    #[error("cannot run mkfs.ext4 (install e2fsprogs): {source}")]
    MkfsMissing { source: io::Error },
    #[error("cannot create image file {path}: {source}")]
    Create { path: String, source: io::Error },
    #[error("the image content needs about {needed_mib} MiB, more than the requested --size {size_mib} MiB")]
    TooSmall { needed_mib: u64, size_mib: u64 },
    #[error("no space left on the device holding {path} while writing the ext4 image (mkfs.ext4: {stderr})")]
    NoSpace { path: String, stderr: String },
    #[error("mkfs.ext4 failed on {path} ({status}): {stderr}")]
    Mkfs {
        path: String,
        status: String,
        stderr: String,
    },
    #[error("cannot copy {from} to {to}: {source}")]
    Copy {
        from: String,
        to: String,
        source: io::Error,
    },
}

/// Disk use of a directory tree, as ext4 with 4 KiB blocks will store it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeUsage {
    pub data_bytes: u64,
    pub inodes: u64,
}

pub fn measure(root: &Path) -> Result<TreeUsage, Ext4Error> {
    let mut usage = TreeUsage::default();
    let mut seen_inodes = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    let measure_error = |path: &Path, source| Ext4Error::Measure {
        path: path.display().to_string(),
        source,
    };
    while let Some(path) = stack.pop() {
        let meta = fs::symlink_metadata(&path).map_err(|e| measure_error(&path, e))?;
        if meta.nlink() > 1 && !meta.is_dir() && !seen_inodes.insert((meta.dev(), meta.ino())) {
            continue;
        }
        usage.inodes += 1;
        let file_type = meta.file_type();
        if file_type.is_dir() {
            usage.data_bytes += meta.len().div_ceil(BLOCK).max(1) * BLOCK;
            for child in fs::read_dir(&path).map_err(|e| measure_error(&path, e))? {
                stack.push(child.map_err(|e| measure_error(&path, e))?.path());
            }
        } else if file_type.is_file() {
            usage.data_bytes += meta.len().div_ceil(BLOCK) * BLOCK;
        } else if file_type.is_symlink() && meta.len() >= 60 {
            // Short symlink targets live in the inode itself.
            usage.data_bytes += BLOCK;
        }
    }
    Ok(usage)
}

/// mke2fs's default journal size for a filesystem of `blocks` 4 KiB blocks.
fn journal_bytes(blocks: u64) -> u64 {
    let journal_blocks = match blocks {
        0..2048 => 0,
        2048..32_768 => 1024,
        32_768..262_144 => 4096,
        262_144..524_288 => 8192,
        524_288..4_194_304 => 16_384,
        4_194_304..8_388_608 => 32_768,
        8_388_608..16_777_216 => 65_536,
        16_777_216..33_554_432 => 131_072,
        _ => 262_144,
    };
    journal_blocks * BLOCK
}

/// Image size and inode count for `usage`: the data, inode tables and metadata, the journal,
/// and `free_mib` of room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub size_bytes: u64,
    pub inodes: u64,
    pub needed_bytes: u64,
}

pub fn plan(usage: TreeUsage, requested_mib: Option<u64>, free_mib: u64) -> Plan {
    let inodes = (usage.inodes + usage.inodes / 4 + 256).max(1024);
    let base = usage.data_bytes + inodes * INODE_SIZE;
    // Bitmaps, group descriptors and extent blocks: a few percent, plus a fixed floor.
    let core = base + base / 32 + 2 * MIB;
    let size_bytes = match requested_mib {
        Some(mib) => mib * MIB,
        None => {
            // The journal grows with the filesystem, so settle the size in a few rounds.
            let mut size = core + free_mib * MIB;
            for _ in 0..3 {
                size = core + free_mib * MIB + journal_bytes(size / BLOCK);
            }
            size.div_ceil(MIB) * MIB
        }
    };
    let needed = core + journal_bytes(size_bytes / BLOCK);
    // A larger filesystem gets mkfs's usual inode density (one per 16 KiB), never fewer than needed.
    Plan {
        size_bytes,
        inodes: inodes.max(size_bytes / 16_384),
        needed_bytes: needed,
    }
}

/// Makes `image` from the tree at `root`. An auto-sized image that turns out too small is
/// grown and made again.
pub fn make(root: &Path, image: &Path, requested_mib: Option<u64>) -> Result<u64, Ext4Error> {
    make_with_room(root, image, requested_mib, DEFAULT_FREE_MIB, true)
}

/// An auto-sized image with only the room it needs and no journal: for a file system that is
/// only ever mounted read-only.
pub fn make_read_only(root: &Path, image: &Path) -> Result<u64, Ext4Error> {
    make_with_room(root, image, None, 0, false)
}

fn make_with_room(
    root: &Path,
    image: &Path,
    requested_mib: Option<u64>,
    free_mib: u64,
    journal: bool,
) -> Result<u64, Ext4Error> {
    let usage = measure(root)?;
    let mut plan = plan(usage, requested_mib, free_mib);
    if let Some(size_mib) = requested_mib {
        if plan.needed_bytes > plan.size_bytes {
            return Err(Ext4Error::TooSmall {
                needed_mib: plan.needed_bytes.div_ceil(MIB),
                size_mib,
            });
        }
    }
    let mut attempts = 0;
    loop {
        attempts += 1;
        match run_mkfs(root, image, &plan, journal) {
            Err(Ext4Error::Mkfs { stderr, .. })
                if requested_mib.is_none()
                    && attempts < 3
                    && stderr.contains("Could not allocate block") =>
            {
                plan.size_bytes = (plan.size_bytes + plan.size_bytes / 2).div_ceil(MIB) * MIB;
                plan.inodes += plan.inodes / 2;
            }
            Err(Ext4Error::Mkfs { stderr, .. })
                if requested_mib.is_some() && stderr.contains("Could not allocate block") =>
            {
                return Err(Ext4Error::TooSmall {
                    needed_mib: plan.needed_bytes.div_ceil(MIB),
                    size_mib: requested_mib.unwrap_or(0),
                })
            }
            other => return other.map(|()| plan.size_bytes),
        }
    }
}

fn run_mkfs(root: &Path, image: &Path, plan: &Plan, journal: bool) -> Result<(), Ext4Error> {
    let create_error = |source| Ext4Error::Create {
        path: image.display().to_string(),
        source,
    };
    // A fresh sparse file of the final size: mkfs writes only what it uses.
    let file = File::create(image).map_err(create_error)?;
    file.set_len(plan.size_bytes).map_err(create_error)?;
    drop(file);
    let mut mkfs = Command::new("mkfs.ext4");
    if !journal {
        mkfs.args(["-O", "^has_journal"]);
    }
    let output = mkfs
        .args([
            "-q",
            "-F",
            "-b",
            "4096",
            "-m",
            "0",
            "-L",
            "rollbox",
            "-E",
            "root_owner=0:0",
            "-N",
        ])
        .arg(plan.inodes.to_string())
        .arg("-d")
        .arg(root)
        .arg(image)
        .env("PATH", mkfs_path())
        .output()
        .map_err(|source| Ext4Error::MkfsMissing { source })?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_string();
    if stderr.contains("No space left on device") {
        return Err(Ext4Error::NoSpace {
            path: image.display().to_string(),
            stderr,
        });
    }
    Err(Ext4Error::Mkfs {
        path: image.display().to_string(),
        status: output.status.to_string(),
        stderr,
    })
}

/// mkfs.ext4 lives in /sbin or /usr/sbin, which a non-login root shell may not have in PATH.
fn mkfs_path() -> String {
    let current = std::env::var("PATH").unwrap_or_default();
    format!("{current}:/usr/sbin:/sbin")
}

/// Copies a sparse file, keeping its holes.
pub fn sparse_copy(from: &Path, to: &Path) -> Result<u64, Ext4Error> {
    let copy_error = |source| Ext4Error::Copy {
        from: from.display().to_string(),
        to: to.display().to_string(),
        source,
    };
    let source = File::open(from).map_err(copy_error)?;
    let len = source.metadata().map_err(copy_error)?.len();
    let dest = File::create(to).map_err(copy_error)?;
    dest.set_len(len).map_err(copy_error)?;
    let mut buf = vec![0u8; 1024 * 1024];
    let mut pos = 0u64;
    while pos < len {
        let Some(data) = seek_data(&source, pos, libc::SEEK_DATA).map_err(copy_error)? else {
            break;
        };
        let hole = seek_data(&source, data, libc::SEEK_HOLE)
            .map_err(copy_error)?
            .unwrap_or(len);
        let mut at = data;
        while at < hole {
            let chunk = (hole - at).min(buf.len() as u64) as usize;
            let slice = buf.get_mut(..chunk).unwrap_or_default();
            source.read_exact_at(slice, at).map_err(copy_error)?;
            dest.write_all_at(slice, at).map_err(copy_error)?;
            at += chunk as u64;
        }
        pos = hole;
    }
    dest.sync_all().map_err(copy_error)?;
    Ok(len)
}

/// lseek with SEEK_DATA/SEEK_HOLE; None when there is no more data (ENXIO).
fn seek_data(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let offset = i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek on a descriptor owned by `file`, which outlives the call; it touches no memory.
    let rc = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if rc >= 0 {
        return Ok(Some(rc as u64));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(err)
    }
}

/// Bytes actually allocated on disk for a file.
pub fn allocated_bytes(path: &Path) -> io::Result<u64> {
    Ok(fs::metadata(path)?.blocks() * 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_covers_data_and_journal() {
        let usage = TreeUsage {
            data_bytes: 5 * MIB,
            inodes: 500,
        };
        let auto = plan(usage, None, DEFAULT_FREE_MIB);
        assert!(auto.needed_bytes > 5 * MIB + 4 * MIB, "{auto:?}");
        assert_eq!(auto.size_bytes % MIB, 0);
        assert!(auto.size_bytes >= auto.needed_bytes + DEFAULT_FREE_MIB * MIB);
        assert!(auto.inodes >= 1024);
        let fixed = plan(usage, Some(512), 0);
        assert_eq!(fixed.size_bytes, 512 * MIB);
        assert_eq!(fixed.inodes, 512 * MIB / 16_384);
    }

    #[test]
    fn journal_sizes_follow_mke2fs() {
        assert_eq!(journal_bytes(1000), 0);
        assert_eq!(journal_bytes(20_000), 4 * MIB);
        assert_eq!(journal_bytes(100_000), 16 * MIB);
    }

    #[test]
    fn sparse_copy_keeps_content_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("from");
        let to = dir.path().join("to");
        let file = File::create(&from).unwrap();
        file.set_len(64 * MIB).unwrap();
        file.write_all_at(b"start", 0).unwrap();
        file.write_all_at(b"middle", 32 * MIB).unwrap();
        drop(file);
        assert_eq!(sparse_copy(&from, &to).unwrap(), 64 * MIB);
        assert_eq!(fs::read(&from).unwrap(), fs::read(&to).unwrap());
        assert!(allocated_bytes(&to).unwrap() < MIB, "holes were filled");
    }
}
