//! Files inside a volume, reached as root from the host: a volume's directory holds what its
//! guests wrote, so every path is resolved below a descriptor of the volume's root with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: a symlink that stays inside is
//! followed, one that leads out (or `..` above the root) is refused, and nothing outside the
//! volume is ever opened.

use std::ffi::CString;
use std::fs::File;
use std::io::Write as _;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use crate::daemon::api::{FileInfo, FileKind};

/// A refused or failed file operation in a volume; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum VolumeFileError {
    #[error("path {path:?}: it leads outside the volume (a symlink pointing out?)")]
    Escapes { path: String },
    #[error("path {path:?}: no such file or directory in the volume")]
    NotFound { path: String },
    #[error("path {path:?}: {what}")]
    Kind { path: String, what: String },
    #[error("path {path:?}: {op}: {source}")]
    Io {
        path: String,
        op: &'static str,
        source: std::io::Error,
    },
}

/// openat2's `struct open_how`.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// A volume's root directory, held open.
pub struct VolumeRoot {
    fd: OwnedFd,
}

/// What a path names.
pub enum Found {
    File(File),
    Dir(VolumeDir),
}

/// A directory in a volume, held open.
pub struct VolumeDir {
    fd: OwnedFd,
    /// Its path in the volume ("" for the root).
    path: String,
}

fn io(path: &str, op: &'static str) -> impl FnOnce(std::io::Error) -> VolumeFileError {
    let path = path.to_string();
    move |source| match source.raw_os_error() {
        Some(libc::EXDEV) | Some(libc::ELOOP) => VolumeFileError::Escapes { path },
        Some(libc::ENOENT) => VolumeFileError::NotFound { path },
        Some(libc::EISDIR) => VolumeFileError::Kind {
            path,
            what: "a directory (give a file's path)".into(),
        },
        Some(libc::ENOTDIR) => VolumeFileError::Kind {
            path,
            what: "a part of it is not a directory".into(),
        },
        _ => VolumeFileError::Io { path, op, source },
    }
}

/// `openat2` of `name` (a relative path) below `dir`.
fn open_beneath(
    dir: &OwnedFd,
    name: &str,
    flags: libc::c_int,
    mode: u32,
) -> std::io::Result<OwnedFd> {
    let c =
        CString::new(name).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let how = OpenHow {
        flags: u64::try_from(flags | libc::O_CLOEXEC).unwrap_or(0),
        mode: u64::from(mode),
        resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2 reads `how` (of the size given) and the NUL-terminated name; both
    // outlive the call; the directory descriptor is ours.
    let raw = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let raw = libc::c_int::try_from(raw).map_err(|_| std::io::ErrorKind::InvalidData)?;
    // SAFETY: `raw` is a descriptor openat2 just returned, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Where a descriptor can be reached by path (for std's directory reading).
fn proc_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

impl VolumeRoot {
    /// Opens the volume's directory (itself not a symlink).
    pub fn open(dir: &Path) -> Result<VolumeRoot, VolumeFileError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags_dir()
            .open(dir)
            .map_err(io("", "open the volume's directory"))?;
        Ok(VolumeRoot { fd: file.into() })
    }

    /// The file or directory at `path` ("" is the root).
    pub fn find(&self, path: &str) -> Result<Found, VolumeFileError> {
        let name = if path.is_empty() { "." } else { path };
        let fd = open_beneath(&self.fd, name, libc::O_RDONLY, 0).map_err(io(path, "open"))?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(io(path, "stat"))?;
        if meta.is_dir() {
            return Ok(Found::Dir(VolumeDir {
                fd: file.into(),
                path: path.to_string(),
            }));
        }
        if !meta.is_file() {
            return Err(VolumeFileError::Kind {
                path: path.to_string(),
                what: "neither a regular file nor a directory".into(),
            });
        }
        Ok(Found::File(file))
    }

    /// The directory at `path`, made (with its parents) if missing.
    fn make_dirs(&self, path: &str) -> Result<OwnedFd, VolumeFileError> {
        let mut dir = open_beneath(&self.fd, ".", libc::O_DIRECTORY, 0).map_err(io("", "open"))?;
        let mut walked = String::new();
        for component in path.split('/').filter(|c| !c.is_empty()) {
            if !walked.is_empty() {
                walked.push('/');
            }
            walked.push_str(component);
            let c = CString::new(component).map_err(|_| VolumeFileError::Kind {
                path: walked.clone(),
                what: "holds a NUL".into(),
            })?;
            // SAFETY: mkdirat reads the NUL-terminated name; the descriptor is ours.
            if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) } < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EEXIST) {
                    return Err(io(&walked, "mkdir")(e));
                }
            }
            dir = open_beneath(&dir, component, libc::O_DIRECTORY, 0).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOTDIR) {
                    VolumeFileError::Kind {
                        path: walked.clone(),
                        what: "not a directory".into(),
                    }
                } else {
                    io(&walked, "open")(e)
                }
            })?;
        }
        Ok(dir)
    }

    /// Writes `data` to `path` (parents made): into a new file beside it, renamed over it
    /// once written, so a failed write leaves the old file whole.
    pub fn write(&self, path: &str, data: &[u8]) -> Result<u64, VolumeFileError> {
        let (parent, name) = match path.rsplit_once('/') {
            Some((parent, name)) => (parent, name),
            None => ("", path),
        };
        let dir = self.make_dirs(parent)?;
        let temp = format!(
            ".{name}.rollbox-upload-{}",
            crate::daemon::util::random_hex()
        );
        let fd = open_beneath(
            &dir,
            &temp,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o644,
        )
        .map_err(io(path, "create"))?;
        let mut file = File::from(fd);
        let written = file
            .write_all(data)
            .and_then(|()| file.sync_data())
            .map_err(io(path, "write"));
        let renamed = written.and_then(|()| {
            let (from, to) = (
                CString::new(temp.as_str()).map_err(|_| VolumeFileError::Kind {
                    path: path.to_string(),
                    what: "holds a NUL".into(),
                })?,
                CString::new(name).map_err(|_| VolumeFileError::Kind {
                    path: path.to_string(),
                    what: "holds a NUL".into(),
                })?,
            );
            // SAFETY: renameat reads two NUL-terminated names below a descriptor we own; a
            // plain name cannot leave the directory.
            let rc = unsafe {
                libc::renameat(dir.as_raw_fd(), from.as_ptr(), dir.as_raw_fd(), to.as_ptr())
            };
            if rc < 0 {
                return Err(io(path, "rename")(std::io::Error::last_os_error()));
            }
            Ok(())
        });
        if renamed.is_err() {
            if let Ok(c) = CString::new(temp) {
                // SAFETY: unlinkat of a plain name below a descriptor we own.
                unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) };
            }
        }
        renamed.map(|()| data.len() as u64)
    }
}

impl VolumeDir {
    /// Its entries, sorted by name; symlinks are listed, not followed.
    pub fn list(&self) -> Result<Vec<FileInfo>, VolumeFileError> {
        let path = &self.path;
        let mut entries = Vec::new();
        for entry in std::fs::read_dir(proc_path(&self.fd)).map_err(io(path, "list"))? {
            let entry = entry.map_err(io(path, "list"))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let meta = entry.metadata().map_err(io(path, "stat"))?;
            let kind = if meta.file_type().is_symlink() {
                FileKind::Symlink
            } else if meta.is_dir() {
                FileKind::Dir
            } else if meta.is_file() {
                FileKind::File
            } else {
                FileKind::Other
            };
            let link_target = (kind == FileKind::Symlink)
                .then(|| std::fs::read_link(entry.path()).ok())
                .flatten()
                .map(|t| t.to_string_lossy().into_owned());
            let full = if path.is_empty() {
                format!("/{name}")
            } else {
                format!("/{path}/{name}")
            };
            entries.push(FileInfo {
                name,
                path: full,
                kind,
                size: meta.len(),
                mode: meta.mode() & 0o7777,
                uid: meta.uid(),
                gid: meta.gid(),
                mtime_ns: meta.mtime().saturating_mul(1_000_000_000) + meta.mtime_nsec(),
                link_target,
            });
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    /// The directory as a tar archive into `out`; symlinks are archived as links, never
    /// followed.
    pub fn tar(&self, out: impl std::io::Write) -> Result<(), VolumeFileError> {
        let mut builder = tar::Builder::new(out);
        builder.follow_symlinks(false);
        builder
            .append_dir_all(".", proc_path(&self.fd))
            .and_then(|()| builder.finish())
            .map_err(io(&self.path, "tar"))
    }
}

/// `OpenOptions` for a directory that must not be a symlink.
trait DirFlags {
    fn custom_flags_dir(&mut self) -> &mut Self;
}

impl DirFlags for std::fs::OpenOptions {
    fn custom_flags_dir(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt as _;
        self.custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_reads_and_lists_inside_and_refuses_ways_out() {
        let outside = tempfile::tempdir().expect("outside");
        std::fs::write(outside.path().join("secret"), "s").expect("secret");
        let dir = tempfile::tempdir().expect("volume");
        let root = VolumeRoot::open(dir.path()).expect("open");
        assert_eq!(root.write("a/b/c.txt", b"hello").expect("write"), 5);
        assert_eq!(
            std::fs::read(dir.path().join("a/b/c.txt")).expect("on disk"),
            b"hello"
        );
        root.write("a/b/c.txt", b"again").expect("overwrite");
        for (path, what) in [("a/b", "a directory"), ("a/b/c.txt/d", "not a directory")] {
            let e = root.write(path, b"x").expect_err(path);
            assert!(
                matches!(&e, VolumeFileError::Kind { .. }) && e.to_string().contains(what),
                "{path}: {e}"
            );
        }
        std::os::unix::fs::symlink("b/c.txt", dir.path().join("a/inside")).expect("link");
        std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).expect("link");
        std::os::unix::fs::symlink("../../..", dir.path().join("a/up")).expect("link");
        match root.find("a/inside").expect("inside link") {
            Found::File(mut f) => {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut f, &mut text).expect("read");
                assert_eq!(text, "again");
            }
            Found::Dir(_) => panic!("a file"),
        }
        for escape in ["out/secret", "a/up/etc/passwd", "out"] {
            let e = root.find(escape).err().expect(escape);
            assert!(
                matches!(e, VolumeFileError::Escapes { .. }),
                "{escape}: {e}"
            );
        }
        let e = root
            .write("out/x", b"x")
            .expect_err("write through a link out");
        assert!(matches!(e, VolumeFileError::Escapes { .. }), "{e}");
        assert!(!outside.path().join("x").exists());
        assert!(matches!(
            root.find("nope"),
            Err(VolumeFileError::NotFound { .. })
        ));
        let Found::Dir(top) = root.find("").expect("root") else {
            panic!("the root is a directory")
        };
        let names: Vec<(String, FileKind)> = top
            .list()
            .expect("list")
            .into_iter()
            .map(|e| (e.name, e.kind))
            .collect();
        assert_eq!(
            names,
            [
                ("a".into(), FileKind::Dir),
                ("out".into(), FileKind::Symlink)
            ]
        );
        let mut archive = Vec::new();
        top.tar(&mut archive).expect("tar");
        let mut listed: Vec<String> = tar::Archive::new(archive.as_slice())
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        listed.sort();
        assert!(listed.contains(&"a/b/c.txt".to_string()), "{listed:?}");
        assert!(listed.contains(&"out".to_string()), "{listed:?}");
        assert!(!listed.iter().any(|p| p.contains("secret")), "{listed:?}");
    }
}
