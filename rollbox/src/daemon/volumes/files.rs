//! Files inside a volume, reached as root from the host: a volume's directory holds what its
//! guests wrote, so every path is resolved below a descriptor of the volume's root with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: a symlink that stays inside is
//! followed, one that leads out (or `..` above the root) is refused, and nothing outside the
//! volume is ever opened.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::Write as _;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use crate::daemon::api::{FileInfo, FileKind};
use crate::daemon::supervisor::virtiofsd::run_as;

/// A refused or failed file operation in a volume; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum VolumeFileError {
    #[error("path {path:?}: it leads outside the volume (a symlink pointing out?)")]
    Escapes { path: String },
    #[error("path {path:?}: no such file or directory in the volume")]
    NotFound { path: String },
    #[error("path {path:?}: {what}")]
    Kind { path: String, what: String },
    #[error("path {path:?}: it exists")]
    Exists { path: String },
    #[error("path {path:?}: the volume is full (its size_limit_mib)")]
    Full { path: String },
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
    /// Who its virtiofsd runs as, when not root: what the daemon makes in it is theirs.
    owner: Option<(u32, u32)>,
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
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => VolumeFileError::Full { path },
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
        let meta = file
            .metadata()
            .map_err(io("", "stat the volume's directory"))?;
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        Ok(VolumeRoot {
            fd: file.into(),
            owner: run_as((meta.uid(), meta.gid()), root),
        })
    }

    /// Gives `name` below `dir`, just made by the daemon, to the volume's owner, so that its
    /// virtiofsd may change it as a guest's root could.
    fn give(&self, dir: &OwnedFd, name: &CStr, path: &str) -> Result<(), VolumeFileError> {
        let Some((uid, gid)) = self.owner else {
            return Ok(());
        };
        // SAFETY: fchownat reads the NUL-terminated name below a descriptor we own and does
        // not follow a symlink there.
        let rc = unsafe {
            libc::fchownat(
                dir.as_raw_fd(),
                name.as_ptr(),
                uid,
                gid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc < 0 {
            return Err(io(path, "chown")(std::io::Error::last_os_error()));
        }
        Ok(())
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
            } else {
                self.give(&dir, &c, &walked)?;
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
        let given = match self.owner {
            Some((uid, gid)) => std::os::unix::fs::fchown(&file, Some(uid), Some(gid)),
            None => Ok(()),
        };
        let written = given
            .and_then(|()| file.write_all(data))
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

    /// The parent directory of `path` (not the root), held open, and the last component.
    fn parent<'a>(&self, path: &'a str) -> Result<(OwnedFd, &'a str), VolumeFileError> {
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path));
        if name.is_empty() || name == "." || name == ".." {
            return Err(VolumeFileError::Escapes {
                path: path.to_string(),
            });
        }
        let at = if parent.is_empty() { "." } else { parent };
        let dir = open_beneath(&self.fd, at, libc::O_DIRECTORY, 0).map_err(io(parent, "open"))?;
        Ok((dir, name))
    }

    /// What `path` is ("" is the root); a symlink is described, not followed.
    pub fn stat(&self, path: &str) -> Result<FileInfo, VolumeFileError> {
        if path.is_empty() {
            let meta = File::from(self.fd.try_clone().map_err(io(path, "stat"))?)
                .metadata()
                .map_err(io(path, "stat"))?;
            return Ok(file_info(String::new(), "/".into(), &meta, None));
        }
        let (dir, name) = self.parent(path)?;
        let at = proc_path(&dir).join(name);
        let meta = std::fs::symlink_metadata(&at).map_err(io(path, "stat"))?;
        let target = meta
            .file_type()
            .is_symlink()
            .then(|| std::fs::read_link(&at).ok())
            .flatten();
        Ok(file_info(
            name.to_string(),
            format!("/{path}"),
            &meta,
            target,
        ))
    }

    /// Makes the directory `path`; with `parents`, its missing parents too and an existing
    /// directory is no error (`mkdir -p`).
    pub fn make_dir(&self, path: &str, parents: bool) -> Result<FileInfo, VolumeFileError> {
        if parents {
            self.make_dirs(path)?;
            return self.stat(path);
        }
        if path.is_empty() {
            return Err(VolumeFileError::Exists { path: "/".into() });
        }
        let (dir, name) = self.parent(path)?;
        let c = CString::new(name).map_err(|_| VolumeFileError::Kind {
            path: path.to_string(),
            what: "holds a NUL".into(),
        })?;
        // SAFETY: mkdirat reads the NUL-terminated name (one component) below a descriptor
        // we own.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) } < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Err(VolumeFileError::Exists {
                    path: path.to_string(),
                });
            }
            return Err(io(path, "mkdir")(e));
        }
        self.give(&dir, &c, path)?;
        self.stat(path)
    }

    /// Removes the file, symlink (not what it points to) or directory (with what it holds)
    /// at `path`; the root is refused.
    pub fn remove(&self, path: &str) -> Result<(), VolumeFileError> {
        if path.is_empty() {
            return Err(VolumeFileError::Kind {
                path: "/".into(),
                what: "the volume's root cannot be removed (delete the volume instead)".into(),
            });
        }
        let (dir, name) = self.parent(path)?;
        let c = CString::new(name).map_err(|_| VolumeFileError::Kind {
            path: path.to_string(),
            what: "holds a NUL".into(),
        })?;
        // SAFETY: unlinkat of one NUL-terminated component below a descriptor we own.
        if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EISDIR) {
            return Err(io(path, "remove")(e));
        }
        // A directory: std's remove_dir_all opens each level without following symlinks.
        std::fs::remove_dir_all(proc_path(&dir).join(name)).map_err(io(path, "remove"))
    }
}

/// A [`FileInfo`] of `meta`; `path` is from the volume's root, with a leading "/".
fn file_info(
    name: String,
    path: String,
    meta: &std::fs::Metadata,
    link_target: Option<PathBuf>,
) -> FileInfo {
    let kind = if meta.file_type().is_symlink() {
        FileKind::Symlink
    } else if meta.is_dir() {
        FileKind::Dir
    } else if meta.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    FileInfo {
        name,
        path,
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_ns: meta.mtime().saturating_mul(1_000_000_000) + meta.mtime_nsec(),
        link_target: link_target.map(|t| t.to_string_lossy().into_owned()),
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
            let link_target = meta
                .file_type()
                .is_symlink()
                .then(|| std::fs::read_link(entry.path()).ok())
                .flatten();
            let full = if path.is_empty() {
                format!("/{name}")
            } else {
                format!("/{path}/{name}")
            };
            entries.push(file_info(name, full, &meta, link_target));
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

    /// What the daemon makes in a volume owned by a uid that is not root is that uid's (its
    /// virtiofsd runs as it); in a root-owned one, root's.
    #[test]
    fn what_the_host_makes_belongs_to_the_volume_owner() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            let reason = "needs root (chown)";
            assert!(
                std::env::var_os("ROLLBOX_REQUIRE_ALL").is_none_or(|v| v != "1"),
                "what_the_host_makes_belongs_to_the_volume_owner could not run: {reason}"
            );
            eprintln!("SKIP what_the_host_makes_belongs_to_the_volume_owner: {reason}");
            return;
        }
        let owned = |path: &Path| {
            let meta = std::fs::symlink_metadata(path).expect("stat");
            (meta.uid(), meta.gid())
        };
        for owner in [(64001, 64002), (0, 0)] {
            let dir = tempfile::tempdir().expect("tempdir");
            std::os::unix::fs::chown(dir.path(), Some(owner.0), Some(owner.1)).expect("chown");
            let root = VolumeRoot::open(dir.path()).expect("open");
            root.write("a/b/file", b"data").expect("write");
            root.make_dir("c", false).expect("mkdir");
            root.make_dir("d/e", true).expect("mkdir -p");
            for made in ["a", "a/b", "a/b/file", "c", "d", "d/e"] {
                assert_eq!(owned(&dir.path().join(made)), owner, "{made}");
            }
        }
    }

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

    #[test]
    fn stats_makes_and_removes_inside_and_refuses_ways_out() {
        let outside = tempfile::tempdir().expect("outside");
        std::fs::write(outside.path().join("keep"), "k").expect("keep");
        let dir = tempfile::tempdir().expect("volume");
        let root = VolumeRoot::open(dir.path()).expect("open");
        let top = root.stat("").expect("root");
        assert_eq!((top.path.as_str(), top.kind), ("/", FileKind::Dir));
        let made = root.make_dir("a", false).expect("mkdir");
        assert_eq!((made.name.as_str(), made.path.as_str()), ("a", "/a"));
        assert_eq!(made.kind, FileKind::Dir);
        assert!(matches!(
            root.make_dir("a", false),
            Err(VolumeFileError::Exists { .. })
        ));
        assert!(matches!(
            root.make_dir("x/y", false),
            Err(VolumeFileError::NotFound { .. })
        ));
        root.make_dir("x/y", true).expect("mkdir -p");
        root.make_dir("x/y", true).expect("mkdir -p again");
        root.write("x/y/f", b"abc").expect("write");
        let file = root.stat("x/y/f").expect("stat");
        assert_eq!(
            (file.kind, file.size, file.path.as_str()),
            (FileKind::File, 3, "/x/y/f")
        );
        std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).expect("link");
        let link = root.stat("out").expect("a link is described");
        assert_eq!(link.kind, FileKind::Symlink);
        for escape in ["out/keep", "out/new"] {
            assert!(
                matches!(root.stat(escape), Err(VolumeFileError::Escapes { .. })),
                "{escape}"
            );
            assert!(
                matches!(root.remove(escape), Err(VolumeFileError::Escapes { .. })),
                "{escape}"
            );
            assert!(
                matches!(
                    root.make_dir(escape, true),
                    Err(VolumeFileError::Escapes { .. })
                ),
                "{escape}"
            );
        }
        root.remove("out").expect("the link, not what it points to");
        assert!(outside.path().join("keep").exists());
        root.remove("x").expect("a directory with what it holds");
        assert!(!dir.path().join("x").exists());
        root.remove("a").expect("an empty directory");
        assert!(matches!(
            root.remove("a"),
            Err(VolumeFileError::NotFound { .. })
        ));
        assert!(matches!(root.remove(""), Err(VolumeFileError::Kind { .. })));
        assert!(dir.path().exists());
    }
}
