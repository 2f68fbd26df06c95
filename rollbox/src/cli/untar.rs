//! Unpacking a guest's tar on the host (`rollbox sandbox cp ID:/dir HOSTDIR`): the guest
//! wrote the archive, so it is hostile. Byte and entry caps, no path out of the destination
//! (no `..`, no absolute name, nothing through a symlink), no symlink or hard link that points
//! out, no device node or fifo, and no set-id or sticky bit.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use tar::EntryType;

/// What one unpack may write.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// File bytes, all entries together.
    pub bytes: u64,
    pub entries: u64,
}

/// Default caps of `rollbox sandbox cp` from a guest.
pub const DEFAULT_MAX_BYTES: u64 = 16 << 30;
pub const DEFAULT_MAX_ENTRIES: u64 = 2_000_000;

/// Why an archive from the guest was refused; each names the entry or the cap.
#[derive(Debug, thiserror::Error)]
pub enum UntarError {
    #[error("the guest's archive has more than {limit} entries; stopped at the cap (raise it with --max-entries)")]
    Entries { limit: u64 },
    #[error("the guest's archive holds more than {limit} bytes; stopped at entry {entry} (raise the cap with --max-bytes)")]
    Bytes { limit: u64, entry: String },
    #[error("entry {entry} of the guest's archive would land outside {dest}")]
    Escape { entry: String, dest: String },
    #[error("entry {entry} of the guest's archive goes through the symlink {link}")]
    ThroughSymlink { entry: String, link: String },
    #[error("{kind} {entry} -> {target} in the guest's archive points outside {dest}")]
    LinkOut {
        kind: &'static str,
        entry: String,
        target: String,
        dest: String,
    },
    #[error("entry {entry} of the guest's archive is a {kind}; only files, directories and links are copied")]
    Kind { entry: String, kind: String },
    #[error("{file} in the guest holds more than {limit} bytes; stopped at the cap and removed {removed} (raise it with --max-bytes)")]
    FileBytes {
        file: String,
        limit: u64,
        removed: PathBuf,
    },
    #[error("cannot read the guest's archive: {0}")]
    Read(io::Error),
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

fn io_error<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> UntarError + 'a {
    move |source| UntarError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// An entry's name as a path below the destination: `.` dropped, `..` and roots refused.
fn relative(name: &Path, entry: &str, dest: &Path) -> Result<PathBuf, UntarError> {
    let mut rel = PathBuf::new();
    for component in name.components() {
        match component {
            Component::Normal(part) => rel.push(part),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(UntarError::Escape {
                    entry: entry.to_string(),
                    dest: dest.display().to_string(),
                })
            }
        }
    }
    Ok(rel)
}

/// Refuses a path whose existing ancestors below `dest` include a symlink or a non-directory.
fn check_parents(dest: &Path, rel: &Path, entry: &str) -> Result<(), UntarError> {
    let mut at = dest.to_path_buf();
    let Some(parent) = rel.parent() else {
        return Ok(());
    };
    for part in parent.components() {
        at.push(part);
        match fs::symlink_metadata(&at) {
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(UntarError::ThroughSymlink {
                    entry: entry.to_string(),
                    link: at.display().to_string(),
                })
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&at).map_err(io_error("create", &at))?;
            }
            Err(e) => return Err(io_error("inspect", &at)(e)),
        }
    }
    Ok(())
}

/// Whether a symlink at `rel` with relative target `target` stays below the destination.
fn target_stays_inside(rel: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut depth = rel.components().count().saturating_sub(1);
    for component in target.components() {
        match component {
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::ParentDir => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return false,
            },
            Component::RootDir | Component::Prefix(_) => return false,
        }
    }
    true
}

/// Removes what is at `path` unless it is a directory (a file, a symlink), so that a new entry
/// never writes through an old symlink.
fn clear(path: &Path) -> Result<(), UntarError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Err(UntarError::Io {
            action: "replace the directory",
            path: path.to_path_buf(),
            source: io::Error::from(io::ErrorKind::AlreadyExists),
        }),
        Ok(_) => fs::remove_file(path).map_err(io_error("replace", path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error("inspect", path)(e)),
    }
}

/// Unpacks `reader` into `dest` (an existing directory) within `caps`.
pub fn unpack(reader: impl Read, dest: &Path, caps: Caps) -> Result<(), UntarError> {
    let mut archive = tar::Archive::new(reader);
    let (mut entries, mut bytes) = (0u64, 0u64);
    let dest_text = || dest.display().to_string();
    for entry in archive.entries().map_err(UntarError::Read)? {
        let mut entry = entry.map_err(UntarError::Read)?;
        let kind = entry.header().entry_type();
        if matches!(kind, EntryType::XGlobalHeader | EntryType::XHeader) {
            continue;
        }
        entries += 1;
        if entries > caps.entries {
            return Err(UntarError::Entries {
                limit: caps.entries,
            });
        }
        let name = entry.path().map_err(UntarError::Read)?.into_owned();
        let shown = name.display().to_string();
        bytes = bytes.saturating_add(entry.size());
        if bytes > caps.bytes {
            return Err(UntarError::Bytes {
                limit: caps.bytes,
                entry: shown,
            });
        }
        let rel = relative(&name, &shown, dest)?;
        if rel.as_os_str().is_empty() {
            continue;
        }
        check_parents(dest, &rel, &shown)?;
        let path = dest.join(&rel);
        let mode = entry.header().mode().map_err(UntarError::Read)? & 0o777;
        match kind {
            EntryType::Directory => {
                match fs::symlink_metadata(&path) {
                    Ok(meta) if meta.is_dir() => {}
                    _ => {
                        clear(&path)?;
                        fs::create_dir(&path).map_err(io_error("create", &path))?;
                    }
                }
                fs::set_permissions(&path, fs::Permissions::from_mode(mode | 0o700))
                    .map_err(io_error("chmod", &path))?;
            }
            EntryType::Regular | EntryType::Continuous => {
                clear(&path)?;
                let mut file = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(mode)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(io_error("create", &path))?;
                io::copy(&mut entry, &mut file).map_err(io_error("write", &path))?;
                // create_new's mode passed through the umask; set-id bits were never kept.
                fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                    .map_err(io_error("chmod", &path))?;
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(UntarError::Read)?
                    .unwrap_or_default()
                    .into_owned();
                if !target_stays_inside(&rel, &target) {
                    return Err(UntarError::LinkOut {
                        kind: "symlink",
                        entry: shown,
                        target: target.display().to_string(),
                        dest: dest_text(),
                    });
                }
                clear(&path)?;
                std::os::unix::fs::symlink(&target, &path)
                    .map_err(io_error("create the symlink", &path))?;
            }
            EntryType::Link => {
                let target = entry
                    .link_name()
                    .map_err(UntarError::Read)?
                    .unwrap_or_default()
                    .into_owned();
                let link_out = || UntarError::LinkOut {
                    kind: "hard link",
                    entry: shown.clone(),
                    target: target.display().to_string(),
                    dest: dest_text(),
                };
                let target_rel = relative(&target, &shown, dest).map_err(|_| link_out())?;
                check_parents(dest, &target_rel, &shown)?;
                let source = dest.join(&target_rel);
                // Only a regular file this archive could have written: never a symlink.
                match fs::symlink_metadata(&source) {
                    Ok(meta) if meta.is_file() => {}
                    _ => return Err(link_out()),
                }
                clear(&path)?;
                fs::hard_link(&source, &path).map_err(io_error("link", &path))?;
            }
            other => {
                return Err(UntarError::Kind {
                    entry: shown,
                    kind: format!("{other:?}").to_lowercase(),
                })
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: Caps = Caps {
        bytes: 1 << 20,
        entries: 100,
    };

    fn header(kind: EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header
    }

    /// An entry with a raw name (and link name), which `tar::Builder` would refuse.
    fn raw(
        archive: &mut tar::Builder<Vec<u8>>,
        kind: EntryType,
        name: &str,
        link: &str,
        data: &[u8],
    ) {
        let mut header = header(kind, 0o4755, data.len() as u64);
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        header.set_cksum();
        archive.append(&header, data).unwrap();
    }

    fn tar_of(entries: &[(EntryType, &str, &str, &[u8])]) -> Vec<u8> {
        let mut archive = tar::Builder::new(Vec::new());
        for (kind, name, link, data) in entries {
            raw(&mut archive, *kind, name, link, data);
        }
        archive.into_inner().unwrap()
    }

    fn unpack_into(tar: &[u8], caps: Caps) -> (tempfile::TempDir, Result<(), UntarError>) {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("dest")).unwrap();
        let result = unpack(tar, &dir.path().join("dest"), caps);
        (dir, result)
    }

    #[test]
    fn files_dirs_and_inner_links_unpack_without_set_id_bits() {
        let tar = tar_of(&[
            (EntryType::Directory, "./", "", b""),
            (EntryType::Directory, "./sub/", "", b""),
            (EntryType::Regular, "./sub/f", "", b"hello"),
            (EntryType::Symlink, "./sub/l", "f", b""),
            (EntryType::Symlink, "./up", "sub/f", b""),
            (EntryType::Link, "./hard", "sub/f", b""),
        ]);
        let (dir, result) = unpack_into(&tar, CAPS);
        result.unwrap();
        let dest = dir.path().join("dest");
        assert_eq!(fs::read(dest.join("sub/l")).unwrap(), b"hello");
        assert_eq!(fs::read(dest.join("up")).unwrap(), b"hello");
        assert_eq!(fs::read(dest.join("hard")).unwrap(), b"hello");
        let mode = fs::metadata(dest.join("sub/f"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755, "set-id bit dropped");
    }

    #[test]
    fn escapes_are_refused() {
        for (entries, want) in [
            (
                vec![(EntryType::Regular, "../evil", "", &b"x"[..])],
                "outside",
            ),
            (
                vec![(EntryType::Regular, "/tmp/evil", "", &b"x"[..])],
                "outside",
            ),
            (
                vec![(EntryType::Symlink, "l", "/etc", &b""[..])],
                "points outside",
            ),
            (
                vec![(EntryType::Symlink, "a/l", "../../x", &b""[..])],
                "points outside",
            ),
            (
                vec![(EntryType::Link, "h", "/etc/passwd", &b""[..])],
                "points outside",
            ),
            (
                vec![(EntryType::Link, "h", "../x", &b""[..])],
                "points outside",
            ),
            (
                vec![
                    (EntryType::Symlink, "l", "d", &b""[..]),
                    (EntryType::Directory, "d", "", &b""[..]),
                    (EntryType::Regular, "l/f", "", &b"x"[..]),
                ],
                "goes through the symlink",
            ),
            (vec![(EntryType::Char, "null", "", &b""[..])], "is a char"),
            (vec![(EntryType::Fifo, "fifo", "", &b""[..])], "is a fifo"),
        ] {
            let (dir, result) = unpack_into(&tar_of(&entries), CAPS);
            let err = result.expect_err(want).to_string();
            assert!(err.contains(want), "{entries:?}: {err}");
            assert!(!dir.path().join("evil").exists() && !dir.path().join("x").exists());
        }
    }

    #[test]
    fn a_file_never_writes_through_an_old_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("dest");
        fs::create_dir(&dest).unwrap();
        let outside = dir.path().join("outside");
        fs::write(&outside, b"keep").unwrap();
        std::os::unix::fs::symlink(&outside, dest.join("f")).unwrap();
        let tar = tar_of(&[(EntryType::Regular, "f", "", b"new")]);
        unpack(&tar[..], &dest, CAPS).unwrap();
        assert_eq!(fs::read(&outside).unwrap(), b"keep");
        assert_eq!(fs::read(dest.join("f")).unwrap(), b"new");
    }

    #[test]
    fn caps_stop_the_unpack() {
        let big = vec![0u8; 4096];
        let tar = tar_of(&[
            (EntryType::Regular, "a", "", &big),
            (EntryType::Regular, "b", "", &big),
        ]);
        let (dir, result) = unpack_into(
            &tar,
            Caps {
                bytes: 5000,
                entries: 10,
            },
        );
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains("more than 5000 bytes") && err.contains("entry b"),
            "{err}"
        );
        assert!(!dir.path().join("dest/b").exists());
        let (_dir, result) = unpack_into(
            &tar,
            Caps {
                bytes: 1 << 20,
                entries: 1,
            },
        );
        let err = result.unwrap_err().to_string();
        assert!(err.contains("more than 1 entries"), "{err}");
    }
}
