//! Entry kinds: regular files (data copied, telling a bad layer from a bad disk), directories,
//! symlinks, hardlinks to entries inside the root, and device nodes and FIFOs, each replacing
//! what lower layers put at its path.

use std::collections::HashMap;
use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tar::EntryType;

use super::context::{unsupported, LayerCtx};
use super::error::LayerError;
use super::meta::{set_meta, set_xattrs, system_time, Meta};
use super::path::{normalize_entry_path, resolve_in_root};
use crate::images::sys::mknod;

/// Creates one entry at `rel` (a file, directory, symlink, hardlink, device node or FIFO) with
/// its metadata, replacing what lower layers put there; the file bytes written.
pub(super) fn apply_entry<R: Read>(
    root: &Path,
    dir_times: &mut HashMap<PathBuf, (i64, u32)>,
    ctx: &mut LayerCtx<'_>,
    rel: &Path,
    entry: &mut tar::Entry<'_, R>,
    meta: Meta,
) -> Result<u64, LayerError> {
    let kind = entry.header().entry_type();
    if rel.as_os_str().is_empty() {
        // The root itself: only its metadata can change.
        if kind != EntryType::Directory {
            return Err(unsupported(ctx, "non-directory entry for the root"));
        }
        set_meta(ctx, root, &meta, false)?;
        dir_times.insert(PathBuf::new(), meta.mtime);
        return Ok(0);
    }
    let rel = &resolve_in_root(root, ctx, rel, true)?.unwrap_or_else(|| rel.to_path_buf());
    let full = root.join(rel);
    let mut written = 0;
    match kind {
        EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
            remove_existing(ctx, &full, false)?;
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&full)
                .map_err(|e| ctx.io("create", &full, e))?;
            written = copy_entry_data(ctx, entry, &mut file, &full)?;
            std::os::unix::fs::fchown(&file, Some(meta.uid), Some(meta.gid))
                .map_err(|e| ctx.io("chown", &full, e))?;
            file.set_permissions(Permissions::from_mode(meta.mode & 0o7777))
                .map_err(|e| ctx.io("chmod", &full, e))?;
            set_xattrs(ctx, &full, &meta)?;
            file.set_modified(system_time(meta.mtime))
                .map_err(|e| ctx.io("set mtime of", &full, e))?;
        }
        EntryType::Directory => {
            if remove_existing(ctx, &full, true)? {
                fs::create_dir(&full).map_err(|e| ctx.io("create directory", &full, e))?;
            }
            set_meta(ctx, &full, &meta, false)?;
            dir_times.insert(rel.to_path_buf(), meta.mtime);
        }
        EntryType::Symlink => {
            let target = link_name(ctx, entry)?;
            remove_existing(ctx, &full, false)?;
            std::os::unix::fs::symlink(&target, &full)
                .map_err(|e| ctx.io("create symlink", &full, e))?;
            set_meta(ctx, &full, &meta, true)?;
        }
        EntryType::Link => {
            let raw_target = link_name(ctx, entry)?;
            let target_rel =
                normalize_entry_path(&raw_target).map_err(|_| LayerError::HardlinkOutside {
                    layer: ctx.layer.to_string(),
                    entry: ctx.entry.clone(),
                    target: raw_target.display().to_string(),
                })?;
            let missing = |ctx: &LayerCtx<'_>| LayerError::HardlinkTarget {
                layer: ctx.layer.to_string(),
                entry: ctx.entry.clone(),
                target: raw_target.display().to_string(),
            };
            let target_rel = match resolve_in_root(root, ctx, &target_rel, false)? {
                Some(resolved) if !resolved.as_os_str().is_empty() => resolved,
                _ => return Err(missing(ctx)),
            };
            let target_full = root.join(&target_rel);
            match fs::symlink_metadata(&target_full) {
                Ok(m) if !m.is_dir() => {}
                _ => return Err(missing(ctx)),
            }
            if target_rel != *rel {
                remove_existing(ctx, &full, false)?;
                // linkat without AT_SYMLINK_FOLLOW: a symlink target is linked, not followed.
                fs::hard_link(&target_full, &full)
                    .map_err(|e| ctx.io("create hardlink", &full, e))?;
            }
        }
        EntryType::Char | EntryType::Block | EntryType::Fifo => {
            remove_existing(ctx, &full, false)?;
            let file_type = match kind {
                EntryType::Char => libc::S_IFCHR,
                EntryType::Block => libc::S_IFBLK,
                _ => libc::S_IFIFO,
            };
            let header = entry.header();
            let major = header.device_major().map_err(|e| ctx.read(e))?.unwrap_or(0);
            let minor = header.device_minor().map_err(|e| ctx.read(e))?.unwrap_or(0);
            mknod(
                &full,
                file_type | (meta.mode & 0o7777),
                libc::makedev(major, minor),
            )
            .map_err(|e| ctx.io("create device node", &full, e))?;
            set_meta(ctx, &full, &meta, false)?;
        }
        EntryType::XGlobalHeader => return Ok(0),
        other => return Err(unsupported(ctx, &format!("{other:?}"))),
    }
    ctx.created.insert(rel.to_path_buf());
    Ok(written)
}

fn link_name<R: Read>(
    ctx: &LayerCtx<'_>,
    entry: &tar::Entry<'_, R>,
) -> Result<PathBuf, LayerError> {
    match entry.link_name().map_err(|e| ctx.read(e))? {
        Some(name) => Ok(name.into_owned()),
        None => Err(unsupported(ctx, "link without a target")),
    }
}

/// Removes whatever is at `full` (never following a symlink there). With `keep_dir`, an
/// existing real directory stays. Returns true when nothing is left at `full`.
pub(super) fn remove_existing(
    ctx: &LayerCtx<'_>,
    full: &Path,
    keep_dir: bool,
) -> Result<bool, LayerError> {
    match fs::symlink_metadata(full) {
        Ok(m) if m.is_dir() => {
            if keep_dir {
                return Ok(false);
            }
            fs::remove_dir_all(full).map_err(|e| ctx.io("remove directory", full, e))?;
        }
        Ok(_) => fs::remove_file(full).map_err(|e| ctx.io("remove", full, e))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(ctx.io("inspect", full, e)),
    }
    Ok(true)
}

/// Copies an entry's data, telling a bad layer (read error) from a bad disk (write error).
fn copy_entry_data(
    ctx: &LayerCtx<'_>,
    from: &mut impl Read,
    to: &mut fs::File,
    path: &Path,
) -> Result<u64, LayerError> {
    let mut buf = vec![0u8; 128 * 1024];
    let mut total = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ctx.read(e)),
        };
        let chunk = buf.get(..n).unwrap_or_default();
        to.write_all(chunk).map_err(|e| ctx.io("write", path, e))?;
        total += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::super::builder::RootfsBuilder;
    use super::super::test_tar::{apply, exists, LayerTar};
    use super::*;

    #[test]
    fn preserves_modes_owners_links_and_devices() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        let is_root = unsafe_free_is_root();
        apply(
            &mut rootfs,
            "base",
            LayerTar::new()
                .file("bin/su", b"suid", 0o4755, 0, 0)
                .file("home/user/file", b"data", 0o640, 1000, 1001)
                .link(EntryType::Symlink, "bin/sh", "busybox")
                .link(EntryType::Symlink, "etc/abs", "/etc/passwd")
                .link(EntryType::Link, "bin/su2", "bin/su")
                .device(EntryType::Char, "dev/tty0", 4, 0)
                .device(EntryType::Fifo, "run/fifo", 0, 0),
        )
        .unwrap();
        rootfs.finish().unwrap();
        let root = dir.path();
        let su = fs::metadata(root.join("bin/su")).unwrap();
        assert_eq!(su.mode() & 0o7777, 0o4755);
        assert_eq!(su.mtime(), 1_600_000_000);
        let su2 = fs::metadata(root.join("bin/su2")).unwrap();
        assert_eq!(su.ino(), su2.ino(), "hardlink shares the inode");
        assert_eq!(
            fs::read_link(root.join("bin/sh")).unwrap(),
            Path::new("busybox")
        );
        assert_eq!(
            fs::read_link(root.join("etc/abs")).unwrap(),
            Path::new("/etc/passwd")
        );
        let user_file = fs::metadata(root.join("home/user/file")).unwrap();
        assert_eq!(user_file.mode() & 0o7777, 0o640);
        if is_root {
            assert_eq!((user_file.uid(), user_file.gid()), (1000, 1001));
            let tty = fs::symlink_metadata(root.join("dev/tty0")).unwrap();
            assert_eq!(tty.mode() & libc::S_IFMT, libc::S_IFCHR);
            assert_eq!(tty.rdev(), libc::makedev(4, 0));
            assert_eq!(tty.gid(), 5);
        }
        let fifo = fs::symlink_metadata(root.join("run/fifo")).unwrap();
        assert_eq!(fifo.mode() & libc::S_IFMT, libc::S_IFIFO);
    }

    fn unsafe_free_is_root() -> bool {
        fs::read_to_string("/proc/self/status")
            .map(|s| {
                s.lines()
                    .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
            })
            .unwrap_or(false)
    }

    #[test]
    fn later_layers_replace_files_symlinks_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        apply(
            &mut rootfs,
            "base",
            LayerTar::new()
                .link(EntryType::Symlink, "etc/target", "/etc/shadow")
                .file("usr/was-dir/x", b"x", 0o644, 0, 0)
                .file("usr/was-file", b"x", 0o644, 0, 0),
        )
        .unwrap();
        apply(
            &mut rootfs,
            "upper",
            LayerTar::new()
                .file("etc/target", b"plain file now", 0o600, 0, 0)
                .file("usr/was-dir", b"file now", 0o644, 0, 0)
                .dir("usr/was-file", 0o755),
        )
        .unwrap();
        let root = dir.path();
        // The symlink was replaced, not written through.
        assert!(fs::symlink_metadata(root.join("etc/target"))
            .unwrap()
            .is_file());
        assert_eq!(
            fs::read(root.join("etc/target")).unwrap(),
            b"plain file now"
        );
        assert!(fs::symlink_metadata(root.join("usr/was-dir"))
            .unwrap()
            .is_file());
        assert!(fs::symlink_metadata(root.join("usr/was-file"))
            .unwrap()
            .is_dir());
    }

    #[test]
    fn rejects_hardlinks_outside_or_missing() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        for target in ["/etc/passwd", "../../etc/passwd"] {
            let err = apply(
                &mut rootfs,
                "evil",
                LayerTar::new().raw_hardlink("h", target),
            )
            .unwrap_err();
            assert!(
                matches!(err, LayerError::HardlinkOutside { .. }),
                "{target}: {err}"
            );
        }
        let err = apply(
            &mut rootfs,
            "evil",
            LayerTar::new().raw_hardlink("h", "nope"),
        )
        .unwrap_err();
        assert!(matches!(err, LayerError::HardlinkTarget { .. }), "{err}");
        assert!(!exists(dir.path(), "h"));
    }
}
