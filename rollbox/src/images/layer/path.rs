//! Path checks: a tar entry name as a plain relative path (no absolute paths, no `..`), and
//! its resolution inside the root, following only relative symlinks that stay inside.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{self, Permissions};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use super::context::LayerCtx;
use super::error::LayerError;

/// Symlinks followed while resolving one path, as Linux's MAXSYMLINKS.
const MAX_SYMLINK_HOPS: u32 = 40;

pub(super) enum PathProblem {
    Absolute,
    Traversal,
}

impl PathProblem {
    pub(super) fn into_error(self, layer: &str, entry: &str) -> LayerError {
        match self {
            PathProblem::Absolute => LayerError::AbsolutePath {
                layer: layer.to_string(),
                entry: entry.to_string(),
            },
            PathProblem::Traversal => LayerError::Traversal {
                layer: layer.to_string(),
                entry: entry.to_string(),
            },
        }
    }
}

/// A tar entry name as a plain relative path: `./` dropped, `..` and absolute paths refused.
pub(super) fn normalize_entry_path(raw: &Path) -> Result<PathBuf, PathProblem> {
    let mut rel = PathBuf::new();
    for component in raw.components() {
        match component {
            Component::CurDir => {}
            Component::Normal(part) => rel.push(part),
            Component::ParentDir => return Err(PathProblem::Traversal),
            Component::RootDir | Component::Prefix(_) => return Err(PathProblem::Absolute),
        }
    }
    Ok(rel)
}

/// Resolves the parent directories of `rel` inside the root and returns the path that `rel`
/// names there (relative to the root, its parents free of symlinks). Relative symlinks that
/// stay inside the root are followed, as a container runtime would (`lib -> usr/lib`); an
/// absolute symlink, one that climbs out of the root, or a loop is refused. With `create`,
/// missing parents are made; without, None is returned when one is missing. The last
/// component is never followed.
pub(super) fn resolve_in_root(
    root: &Path,
    ctx: &mut LayerCtx<'_>,
    rel: &Path,
    create: bool,
) -> Result<Option<PathBuf>, LayerError> {
    enum Step {
        Up,
        Name(OsString),
    }
    let Some(name) = rel.file_name() else {
        return Ok(Some(PathBuf::new()));
    };
    let escape = |ctx: &LayerCtx<'_>, link: &Path| LayerError::ThroughSymlink {
        layer: ctx.layer.to_string(),
        entry: ctx.entry.clone(),
        link: link.display().to_string(),
    };
    let mut pending: VecDeque<Step> = rel
        .parent()
        .unwrap_or(Path::new(""))
        .components()
        .filter_map(|c| match c {
            Component::Normal(part) => Some(Step::Name(part.to_os_string())),
            _ => None,
        })
        .collect();
    let mut resolved = PathBuf::new();
    let mut last_link = PathBuf::new();
    let mut hops = 0;
    while let Some(step) = pending.pop_front() {
        let part = match step {
            Step::Up => {
                if !resolved.pop() {
                    return Err(escape(ctx, &last_link));
                }
                continue;
            }
            Step::Name(part) => part,
        };
        let candidate = resolved.join(&part);
        let full = root.join(&candidate);
        match fs::symlink_metadata(&full) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                let target = fs::read_link(&full).map_err(|e| ctx.io("read symlink", &full, e))?;
                if hops > MAX_SYMLINK_HOPS || target.has_root() {
                    return Err(escape(ctx, &candidate));
                }
                for component in target.components().rev() {
                    match component {
                        Component::Normal(next) => {
                            pending.push_front(Step::Name(next.to_os_string()))
                        }
                        Component::ParentDir => pending.push_front(Step::Up),
                        Component::CurDir => {}
                        Component::RootDir | Component::Prefix(_) => {
                            return Err(escape(ctx, &candidate))
                        }
                    }
                }
                last_link = candidate;
            }
            Ok(m) if m.is_dir() => {
                if create {
                    // This layer has entries below: an opaque marker must keep them.
                    ctx.created.insert(candidate.clone());
                }
                resolved = candidate;
            }
            Ok(_) => {
                return Err(LayerError::ParentNotDirectory {
                    layer: ctx.layer.to_string(),
                    entry: ctx.entry.clone(),
                    parent: candidate.display().to_string(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if !create {
                    return Ok(None);
                }
                fs::create_dir(&full).map_err(|e| ctx.io("create directory", &full, e))?;
                fs::set_permissions(&full, Permissions::from_mode(0o755))
                    .map_err(|e| ctx.io("chmod", &full, e))?;
                ctx.created.insert(candidate.clone());
                resolved = candidate;
            }
            Err(e) => return Err(ctx.io("inspect", &full, e)),
        }
    }
    Ok(Some(resolved.join(name)))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use tar::EntryType;

    use super::super::builder::RootfsBuilder;
    use super::super::test_tar::{apply, exists, LayerTar};
    use super::*;

    #[test]
    fn rejects_traversal_and_absolute_paths() {
        for (bad, want_absolute) in [
            ("../escape", false),
            ("a/../../escape", false),
            ("/etc/passwd", true),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("root");
            fs::create_dir(&root).unwrap();
            let mut rootfs = RootfsBuilder::new(&root);
            let err = apply(&mut rootfs, "evil", LayerTar::new().raw_file(bad)).unwrap_err();
            match err {
                LayerError::AbsolutePath { .. } => assert!(want_absolute, "{bad}: {err}"),
                LayerError::Traversal { .. } => assert!(!want_absolute, "{bad}: {err}"),
                other => panic!("{bad}: unexpected error {other}"),
            }
            assert!(!dir.path().join("escape").exists());
        }
    }

    #[test]
    fn rejects_writing_through_a_symlink() {
        let outside = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        let target = outside.path().to_str().unwrap();
        // Same layer and across layers.
        let err = apply(
            &mut rootfs,
            "evil",
            LayerTar::new()
                .link(EntryType::Symlink, "evil", target)
                .file("evil/passwd", b"owned", 0o644, 0, 0),
        )
        .unwrap_err();
        assert!(
            matches!(err, LayerError::ThroughSymlink { ref link, .. } if link == "evil"),
            "{err}"
        );
        assert!(err.to_string().contains("evil/passwd"), "{err}");
        let err = apply(
            &mut rootfs,
            "evil2",
            LayerTar::new().file("evil/.wh.x", b"", 0o644, 0, 0),
        )
        .unwrap_err();
        assert!(matches!(err, LayerError::ThroughSymlink { .. }), "{err}");
        let err = apply(
            &mut rootfs,
            "evil3",
            LayerTar::new().link(EntryType::Link, "h", "evil/x"),
        )
        .unwrap_err();
        assert!(matches!(err, LayerError::ThroughSymlink { .. }), "{err}");
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
    }

    #[test]
    fn follows_relative_symlinks_that_stay_inside() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        apply(
            &mut rootfs,
            "base",
            LayerTar::new()
                .dir("usr/lib", 0o755)
                .link(EntryType::Symlink, "lib", "usr/lib")
                .dir("var/cache", 0o755)
                .link(EntryType::Symlink, "var/tmp", "../usr/./lib")
                .file("usr/lib/old.so", b"old", 0o644, 0, 0),
        )
        .unwrap();
        apply(
            &mut rootfs,
            "upper",
            LayerTar::new()
                .file("lib/libx.so", b"x", 0o644, 0, 0)
                .file("var/tmp/liby.so", b"y", 0o644, 0, 0)
                .link(EntryType::Link, "usr/hard", "lib/libx.so")
                .file("lib/.wh.old.so", b"", 0o644, 0, 0),
        )
        .unwrap();
        let root = dir.path();
        assert_eq!(fs::read(root.join("usr/lib/libx.so")).unwrap(), b"x");
        assert_eq!(fs::read(root.join("usr/lib/liby.so")).unwrap(), b"y");
        assert!(fs::symlink_metadata(root.join("lib"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(!exists(root, "usr/lib/old.so"));
        assert_eq!(
            fs::metadata(root.join("usr/hard")).unwrap().ino(),
            fs::metadata(root.join("usr/lib/libx.so")).unwrap().ino()
        );
    }

    #[test]
    fn rejects_relative_symlinks_that_climb_out_and_loops() {
        let outside = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let mut rootfs = RootfsBuilder::new(&root);
        let err = apply(
            &mut rootfs,
            "climb",
            LayerTar::new()
                .dir("a", 0o755)
                .link(EntryType::Symlink, "a/up", "../../..")
                .file("a/up/escaped", b"x", 0o644, 0, 0),
        )
        .unwrap_err();
        assert!(
            matches!(err, LayerError::ThroughSymlink { ref link, .. } if link == "a/up"),
            "{err}"
        );
        let err = apply(
            &mut rootfs,
            "loop",
            LayerTar::new()
                .link(EntryType::Symlink, "loop1", "loop2")
                .link(EntryType::Symlink, "loop2", "loop1")
                .file("loop1/x", b"x", 0o644, 0, 0),
        )
        .unwrap_err();
        assert!(matches!(err, LayerError::ThroughSymlink { .. }), "{err}");
        assert!(!dir.path().join("escaped").exists());
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
    }
}
