//! Whiteouts: `.wh.<name>` deletes `<name>` from lower layers, `.wh..wh..opq` hides everything
//! lower layers put in its directory, and other `.wh..wh.` names (aufs bookkeeping) carry no
//! files. Entries of the same layer are never hidden.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::context::LayerCtx;
use super::entry::remove_existing;
use super::error::LayerError;
use super::path::resolve_in_root;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
/// Other `.wh..wh.` names are aufs bookkeeping (e.g. `.wh..wh.plnk`) and carry no files.
const AUFS_META_PREFIX: &[u8] = b".wh..wh.";

/// Applies `rel` if it is a whiteout entry; false when it is an ordinary entry.
pub(super) fn apply_whiteout(
    root: &Path,
    ctx: &mut LayerCtx<'_>,
    rel: &Path,
) -> Result<bool, LayerError> {
    let Some(name) = rel.file_name() else {
        return Ok(false);
    };
    let name = name.as_bytes();
    let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) else {
        return Ok(false);
    };
    let dir = rel.parent().unwrap_or(Path::new(""));
    if name == OPAQUE_MARKER {
        make_opaque(root, ctx, dir)?;
    } else if !name.starts_with(AUFS_META_PREFIX) {
        if matches!(hidden, b"" | b"." | b"..") {
            return Err(LayerError::BadWhiteout {
                layer: ctx.layer.to_string(),
                entry: ctx.entry.clone(),
            });
        }
        whiteout(root, ctx, &dir.join(OsStr::from_bytes(hidden)))?;
    }
    Ok(true)
}

/// `.wh.<name>`: removes `<name>` unless this same layer created it.
fn whiteout(root: &Path, ctx: &mut LayerCtx<'_>, rel: &Path) -> Result<(), LayerError> {
    match resolve_in_root(root, ctx, rel, false)? {
        Some(resolved) if !ctx.created.contains(&resolved) && !resolved.as_os_str().is_empty() => {
            remove_existing(ctx, &root.join(resolved), false)?;
            Ok(())
        }
        _ => Ok(()),
    }
}

/// `.wh..wh..opq`: removes everything under `dir` that this layer did not create.
fn make_opaque(root: &Path, ctx: &mut LayerCtx<'_>, dir: &Path) -> Result<(), LayerError> {
    let Some(dir) = resolve_in_root(root, ctx, dir, false)? else {
        return Ok(());
    };
    let full = root.join(&dir);
    match fs::symlink_metadata(&full) {
        Ok(m) if m.is_dir() => remove_lower_children(root, ctx, &dir),
        // Not a directory (or absent): nothing from lower layers to hide.
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ctx.io("inspect", &full, e)),
    }
}

fn remove_lower_children(
    root: &Path,
    ctx: &mut LayerCtx<'_>,
    dir: &Path,
) -> Result<(), LayerError> {
    let full = root.join(dir);
    let children = fs::read_dir(&full).map_err(|e| ctx.io("list", &full, e))?;
    for child in children {
        let child = child.map_err(|e| ctx.io("list", &full, e))?;
        let rel = dir.join(child.file_name());
        if !ctx.created.contains(&rel) {
            remove_existing(ctx, &child.path(), false)?;
        } else if child
            .file_type()
            .map_err(|e| ctx.io("inspect", &child.path(), e))?
            .is_dir()
        {
            remove_lower_children(root, ctx, &rel)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::super::builder::RootfsBuilder;
    use super::super::test_tar::{apply, exists, LayerTar};
    use super::*;

    #[test]
    fn whiteouts_delete_lower_entries_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        apply(
            &mut rootfs,
            "base",
            LayerTar::new()
                .dir("etc", 0o755)
                .file("etc/keep", b"keep", 0o644, 0, 0)
                .file("etc/gone", b"gone", 0o644, 0, 0)
                .dir("var/cache", 0o755)
                .file("var/cache/a/b", b"deep", 0o644, 0, 0),
        )
        .unwrap();
        let stats = apply(
            &mut rootfs,
            "upper",
            LayerTar::new()
                .file("etc/.wh.gone", b"", 0o644, 0, 0)
                .file("etc/.wh.never-existed", b"", 0o644, 0, 0)
                .file("etc/new", b"new", 0o644, 0, 0)
                .file("etc/.wh.new", b"", 0o644, 0, 0)
                .dir("var/cache", 0o700),
        )
        .unwrap();
        assert_eq!(stats.whiteouts, 3);
        let root = dir.path();
        assert!(!exists(root, "etc/gone"));
        assert!(exists(root, "etc/keep"));
        // A whiteout never hides an entry of its own layer.
        assert!(exists(root, "etc/new"));
        assert!(exists(root, "var/cache/a/b"));
        assert_eq!(
            fs::metadata(root.join("var/cache")).unwrap().mode() & 0o7777,
            0o700
        );
    }

    #[test]
    fn whiteouts_naming_no_file_are_refused() {
        for bad in ["etc/.wh.", "etc/.wh..", "etc/.wh..."] {
            let dir = tempfile::tempdir().unwrap();
            let mut rootfs = RootfsBuilder::new(dir.path());
            apply(
                &mut rootfs,
                "base",
                LayerTar::new().file("etc/keep", b"x", 0o644, 0, 0),
            )
            .unwrap();
            // They would name "", "." and "..": the directory itself or its parent.
            let result = apply(&mut rootfs, "upper", LayerTar::new().raw_file(bad));
            assert!(
                matches!(result, Err(LayerError::BadWhiteout { .. })),
                "{bad}: {result:?}"
            );
            assert!(
                exists(dir.path(), "etc/keep"),
                "{bad} deleted its directory"
            );
        }
    }

    #[test]
    fn whiteout_of_a_directory_removes_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        apply(
            &mut rootfs,
            "base",
            LayerTar::new().file("opt/app/lib/x.so", b"x", 0o755, 0, 0),
        )
        .unwrap();
        apply(
            &mut rootfs,
            "upper",
            LayerTar::new().file("opt/.wh.app", b"", 0o644, 0, 0),
        )
        .unwrap();
        assert!(!exists(dir.path(), "opt/app"));
        assert!(exists(dir.path(), "opt"));
    }

    #[test]
    fn opaque_directory_hides_lower_contents_wherever_the_marker_sits() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        apply(
            &mut rootfs,
            "base",
            LayerTar::new()
                .file("data/old", b"old", 0o644, 0, 0)
                .file("data/sub/old", b"old", 0o644, 0, 0)
                .file("other/stays", b"x", 0o644, 0, 0),
        )
        .unwrap();
        // The marker comes after this layer's own entries, which must survive it.
        apply(
            &mut rootfs,
            "upper",
            LayerTar::new()
                .dir("data", 0o755)
                .file("data/sub/new", b"new", 0o644, 0, 0)
                .file("data/.wh..wh..opq", b"", 0o644, 0, 0)
                .file("data/after", b"after", 0o644, 0, 0),
        )
        .unwrap();
        let root = dir.path();
        assert!(!exists(root, "data/old"));
        assert!(!exists(root, "data/sub/old"));
        assert!(exists(root, "data/sub/new"));
        assert!(exists(root, "data/after"));
        assert!(exists(root, "other/stays"));
        assert!(!exists(root, "data/.wh..wh..opq"));
    }
}
