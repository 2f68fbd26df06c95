//! A sandbox's directory as hostile ground. A jailed VMM owns its directory (it is the jail's
//! root), so it may have planted a symlink, a FIFO or a hard link at any name the daemon uses.
//! The daemon, as root, reaches names in it only through here: below a descriptor of the
//! directory opened `O_DIRECTORY|O_NOFOLLOW`, each name resolved by `openat2` with
//! `RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS` (one plain name, no symlink at
//! any step), the descriptor `fstat`ed (the kind of file, one link, an owner that is root or
//! the directory's own), then used: read, copied, renamed with `renameat2` and checked again,
//! or, for a Unix socket, connected to through `/proc/self/fd/N` of an `O_PATH` descriptor.
//! A refusal names the file and the directory and touches nothing outside it.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

/// A refused or failed operation in a sandbox's directory.
#[derive(Debug, thiserror::Error)]
pub enum JailDirError {
    #[error("sandbox directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("sandbox directory {dir}: refused {name}: {why}")]
    Refused {
        dir: PathBuf,
        name: String,
        why: String,
    },
    #[error("sandbox directory {dir}: {op} {name}: {source}")]
    Io {
        dir: PathBuf,
        name: String,
        op: &'static str,
        source: std::io::Error,
    },
}

impl JailDirError {
    /// Whether the name is simply not there (yet).
    pub fn is_not_found(&self) -> bool {
        match self {
            JailDirError::Io { source, .. } | JailDirError::Dir { source, .. } => {
                source.kind() == std::io::ErrorKind::NotFound
            }
            JailDirError::Refused { .. } => false,
        }
    }
}

/// The kind of file a name must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Socket,
}

impl Kind {
    fn mode(self) -> libc::mode_t {
        match self {
            Kind::File => libc::S_IFREG,
            Kind::Dir => libc::S_IFDIR,
            Kind::Socket => libc::S_IFSOCK,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::File => "a regular file",
            Kind::Dir => "a directory",
            Kind::Socket => "a Unix socket",
        }
    }
}

/// `struct open_how` of openat2(2) (libc's is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// A directory whose names the daemon does not trust, held open.
#[derive(Debug)]
pub struct JailDir {
    fd: OwnedFd,
    path: PathBuf,
    /// The directory's owner (the jail's uid and gid when jailed, else root).
    uid: u32,
    gid: u32,
}

/// A Unix socket in a [`JailDir`], to connect to through [`SocketPath::connect_path`] (or
/// `as_ref()`) while this is alive.
#[derive(Debug)]
pub struct SocketPath {
    /// None for a socket of the host's own ([`SocketPath::host`]).
    _fd: Option<OwnedFd>,
    proc_path: PathBuf,
    path: PathBuf,
}

impl AsRef<Path> for SocketPath {
    fn as_ref(&self) -> &Path {
        &self.proc_path
    }
}

impl SocketPath {
    /// A socket the daemon was configured with (no sandbox's), reached by its name.
    pub fn host(path: PathBuf) -> SocketPath {
        SocketPath {
            _fd: None,
            proc_path: path.clone(),
            path,
        }
    }

    /// The socket's path as the user knows it, for messages.
    pub fn display(&self) -> std::path::Display<'_> {
        self.path.display()
    }

    /// `/proc/self/fd/N` of the socket's `O_PATH` descriptor: a connect there reaches the
    /// socket checked, never what a symlink planted since would name.
    pub fn connect_path(&self) -> &Path {
        &self.proc_path
    }

    /// The socket's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn fstat(fd: &OwnedFd) -> std::io::Result<libc::stat> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes one `struct stat` into `stat`, which is large enough, on a
    // descriptor we own.
    if unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded, so it filled `stat`.
    Ok(unsafe { stat.assume_init() })
}

/// One plain name: no `/`, not `.` or `..`, no NUL.
fn plain_name(name: &OsStr) -> Option<CString> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return None;
    }
    CString::new(bytes).ok()
}

impl JailDir {
    /// Opens `path` (the directory itself must not be a symlink).
    pub fn open(path: &Path) -> Result<JailDir, JailDirError> {
        let failed = |source| JailDirError::Dir {
            dir: path.to_path_buf(),
            source,
        };
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| failed(std::io::ErrorKind::InvalidInput.into()))?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: open on a NUL-terminated path; it touches no memory of ours.
        let raw = unsafe { libc::open(c.as_ptr(), flags) };
        if raw < 0 {
            return Err(failed(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a descriptor open() just returned, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let stat = fstat(&fd).map_err(failed)?;
        Ok(JailDir {
            fd,
            path: path.to_path_buf(),
            uid: stat.st_uid,
            gid: stat.st_gid,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory's owner: (uid, gid).
    pub fn owner(&self) -> (u32, u32) {
        (self.uid, self.gid)
    }

    fn refused(&self, name: &OsStr, why: impl Into<String>) -> JailDirError {
        JailDirError::Refused {
            dir: self.path.clone(),
            name: name.to_string_lossy().into_owned(),
            why: why.into(),
        }
    }

    fn io(&self, op: &'static str, name: &OsStr) -> impl FnOnce(std::io::Error) -> JailDirError {
        let (dir, name) = (self.path.clone(), name.to_string_lossy().into_owned());
        move |source| JailDirError::Io {
            dir,
            name,
            op,
            source,
        }
    }

    /// openat2 of one plain `name` below the directory, no symlink followed, then the checks
    /// of `kind`: its file type, one link (a file), and its owner root or the directory's.
    fn resolve(
        &self,
        name: &OsStr,
        flags: libc::c_int,
        kind: Kind,
    ) -> Result<OwnedFd, JailDirError> {
        let c = plain_name(name).ok_or_else(|| self.refused(name, "not one plain name"))?;
        let how = OpenHow {
            flags: u64::try_from(flags | libc::O_CLOEXEC).unwrap_or(0),
            mode: 0,
            resolve: libc::RESOLVE_BENEATH
                | libc::RESOLVE_NO_SYMLINKS
                | libc::RESOLVE_NO_MAGICLINKS,
        };
        // SAFETY: openat2 reads `how` (of the size given) and the NUL-terminated name; both
        // outlive the call; the directory descriptor is ours.
        let raw = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                self.fd.as_raw_fd(),
                c.as_ptr(),
                &how as *const OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        if raw < 0 {
            let error = std::io::Error::last_os_error();
            return Err(match error.raw_os_error() {
                Some(libc::ELOOP) => self.refused(name, "a symlink (planted by its VMM?)"),
                Some(libc::EXDEV) => self.refused(name, "it leads outside the directory"),
                Some(libc::ENOTDIR) if kind == Kind::Dir => {
                    self.refused(name, format!("not {}", kind.name()))
                }
                _ => self.io("open", name)(error),
            });
        }
        let raw = libc::c_int::try_from(raw)
            .map_err(|_| self.io("open", name)(std::io::ErrorKind::InvalidData.into()))?;
        // SAFETY: `raw` is a descriptor openat2 just returned, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let stat = fstat(&fd).map_err(self.io("stat", name))?;
        if stat.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(self.refused(name, "a symlink (planted by its VMM?)"));
        }
        if stat.st_mode & libc::S_IFMT != kind.mode() {
            return Err(self.refused(name, format!("not {}", kind.name())));
        }
        if kind == Kind::File && stat.st_nlink != 1 {
            return Err(self.refused(name, format!("{} hard links", stat.st_nlink)));
        }
        if stat.st_uid != 0 && stat.st_uid != self.uid {
            return Err(self.refused(
                name,
                format!("owned by uid {}, not root or {}", stat.st_uid, self.uid),
            ));
        }
        Ok(fd)
    }

    /// A regular file in the directory, open for reading.
    pub fn open_file(&self, name: impl AsRef<OsStr>) -> Result<File, JailDirError> {
        // O_NONBLOCK: a FIFO does not block the open (it is refused as no regular file).
        let fd = self.resolve(name.as_ref(), libc::O_RDONLY | libc::O_NONBLOCK, Kind::File)?;
        Ok(File::from(fd))
    }

    /// A directory in the directory, open.
    pub fn subdir(&self, name: impl AsRef<OsStr>) -> Result<JailDir, JailDirError> {
        let name = name.as_ref();
        let fd = self.resolve(name, libc::O_RDONLY | libc::O_DIRECTORY, Kind::Dir)?;
        let stat = fstat(&fd).map_err(self.io("stat", name))?;
        Ok(JailDir {
            fd,
            path: self.path.join(name),
            uid: stat.st_uid,
            gid: stat.st_gid,
        })
    }

    /// A Unix socket in the directory, to connect to.
    pub fn socket(&self, name: impl AsRef<OsStr>) -> Result<SocketPath, JailDirError> {
        let name = name.as_ref();
        let fd = self.resolve(name, libc::O_PATH, Kind::Socket)?;
        let proc_path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        Ok(SocketPath {
            _fd: Some(fd),
            proc_path,
            path: self.path.join(name),
        })
    }

    /// The names in the directory (not `.` and `..`).
    pub fn names(&self) -> Result<Vec<OsString>, JailDirError> {
        // The magic link names this very directory, whatever was renamed since.
        let here = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        let failed = |source| JailDirError::Dir {
            dir: self.path.clone(),
            source,
        };
        let mut names = Vec::new();
        for entry in std::fs::read_dir(here).map_err(failed)? {
            names.push(entry.map_err(failed)?.file_name());
        }
        Ok(names)
    }

    /// A new directory `name` owned by `uid`:`gid`, mode 0700, after removing whatever was at
    /// `name` (a symlink is removed, never followed).
    pub fn fresh_subdir(&self, name: &str, uid: u32, gid: u32) -> Result<JailDir, JailDirError> {
        let os = OsStr::new(name);
        let c = plain_name(os).ok_or_else(|| self.refused(os, "not one plain name"))?;
        // remove_dir_all removes a symlink itself and never follows one below it.
        match std::fs::remove_dir_all(self.path.join(name)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                std::fs::remove_file(self.path.join(name)).map_err(self.io("remove", os))?
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(self.io("remove", os)(e))
            }
            _ => {}
        }
        // SAFETY: mkdirat below our directory descriptor, on a NUL-terminated name.
        if unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), 0o700) } < 0 {
            return Err(self.io("make", os)(std::io::Error::last_os_error()));
        }
        let dir = self.subdir(os)?;
        // SAFETY: fchown on a descriptor we own; it touches no memory of ours.
        if unsafe { libc::fchown(dir.fd.as_raw_fd(), uid, gid) } < 0 {
            return Err(self.io("chown", os)(std::io::Error::last_os_error()));
        }
        Ok(JailDir { uid, gid, ..dir })
    }

    /// The last `max` bytes of regular file `name`.
    pub fn tail(&self, name: &str, max: u64) -> Result<Vec<u8>, JailDirError> {
        let mut file = self.open_file(name)?;
        let failed = self.io("read", OsStr::new(name));
        let len = file
            .metadata()
            .map_err(|e| self.io("stat", OsStr::new(name))(e))?
            .len();
        let mut tail = Vec::new();
        file.seek(SeekFrom::Start(len.saturating_sub(max)))
            .and_then(|_| file.take(max).read_to_end(&mut tail))
            .map_err(failed)?;
        Ok(tail)
    }

    /// Moves regular file `name` into `to` (a directory the daemon owns) under the same name,
    /// never over a file there; a copy where they are on different file systems. What arrives
    /// is the file checked here, or nothing.
    pub fn move_file_to(&self, name: &OsStr, to: &JailDir) -> Result<(), JailDirError> {
        let source = self.open_file(name)?;
        let c = plain_name(name).ok_or_else(|| self.refused(name, "not one plain name"))?;
        // SAFETY: renameat2 between two directory descriptors we own, NUL-terminated names.
        let rc = unsafe {
            libc::renameat2(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                to.fd.as_raw_fd(),
                c.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if rc < 0 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() != Some(libc::EXDEV) {
                return Err(self.io("move", name)(error));
            }
            let dest = to.create_file(name)?;
            return super::disk::copy_file(&source, &dest).map_err(self.io("copy", name));
        }
        // The VMM may have swapped the name between the check and the rename: what arrived
        // must be the very file checked (no symlink is followed to see).
        let mut moved = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstatat writes one `struct stat` into `moved`; the name is NUL-terminated
        // and the directory descriptor ours.
        let rc = unsafe {
            libc::fstatat(
                to.fd.as_raw_fd(),
                c.as_ptr(),
                moved.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        let checked = source.metadata().ok();
        let same = rc == 0 && {
            // SAFETY: fstatat succeeded, so it filled `moved`.
            let moved = unsafe { moved.assume_init() };
            use std::os::unix::fs::MetadataExt as _;
            checked.is_some_and(|b| moved.st_dev == b.dev() && moved.st_ino == b.ino())
        };
        match same {
            true => Ok(()),
            false => {
                // SAFETY: unlinkat of a name below our own directory descriptor.
                unsafe { libc::unlinkat(to.fd.as_raw_fd(), c.as_ptr(), 0) };
                Err(self.refused(name, "it was replaced while being moved"))
            }
        }
    }

    /// A new regular file `name` (never over one), open for writing.
    pub fn create_file(&self, name: &OsStr) -> Result<File, JailDirError> {
        let c = plain_name(name).ok_or_else(|| self.refused(name, "not one plain name"))?;
        let flags =
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: openat below our directory descriptor on a NUL-terminated name.
        let raw = unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags, 0o600) };
        if raw < 0 {
            return Err(self.io("create", name)(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a descriptor openat just returned, owned by nothing else.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(raw) }))
    }

    /// Sets the directory's group and mode (a snapshot directory a jail reads).
    pub fn set_group_mode(&self, gid: u32, mode: libc::mode_t) -> Result<(), JailDirError> {
        let failed = |source| JailDirError::Dir {
            dir: self.path.clone(),
            source,
        };
        // SAFETY: fchown and fchmod on a descriptor we own; no memory of ours is touched.
        unsafe {
            if libc::fchown(self.fd.as_raw_fd(), u32::MAX, gid) < 0
                || libc::fchmod(self.fd.as_raw_fd(), mode) < 0
            {
                return Err(failed(std::io::Error::last_os_error()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    /// A sandbox directory and, beside it, a host file and directory a VMM would aim at.
    struct Scene {
        _tmp: tempfile::TempDir,
        dir: PathBuf,
        host_file: PathBuf,
        host_dir: PathBuf,
    }

    const SECRET: &[u8] = b"host secret\n";

    fn scene() -> Scene {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("sb-1");
        std::fs::create_dir(&dir).expect("sandbox dir");
        let host_file = tmp.path().join("shadow");
        std::fs::write(&host_file, SECRET).expect("host file");
        let host_dir = tmp.path().join("etc");
        std::fs::create_dir(&host_dir).expect("host dir");
        std::fs::write(host_dir.join("passwd"), SECRET).expect("host dir file");
        Scene {
            _tmp: tmp,
            dir,
            host_file,
            host_dir,
        }
    }

    impl Scene {
        /// What the host file and directory hold, mode and owner: unchanged by any refusal.
        fn host_state(&self) -> Vec<(Vec<u8>, u32, u32, u32)> {
            [self.host_file.clone(), self.host_dir.join("passwd")]
                .iter()
                .chain([&self.host_dir])
                .map(|p| {
                    let meta = std::fs::metadata(p).expect("host path");
                    let data = if meta.is_file() {
                        std::fs::read(p).expect("read")
                    } else {
                        Vec::new()
                    };
                    (data, meta.uid(), meta.gid(), meta.mode())
                })
                .collect()
        }

        fn plant(&self, name: &str, target: &Path) {
            std::os::unix::fs::symlink(target, self.dir.join(name)).expect("symlink");
        }
    }

    /// A refusal names the file, the directory and why.
    fn assert_refused(error: impl std::fmt::Display, name: &str, why: &str) {
        let text = error.to_string();
        assert!(
            text.contains(&format!("refused {name}: ")) && text.contains(why),
            "{text}"
        );
    }

    #[test]
    fn a_planted_rootfs_symlink_is_refused_and_copies_nothing() {
        let scene = scene();
        let before = scene.host_state();
        scene.plant("rootfs.img", &scene.host_file);
        let dir = JailDir::open(&scene.dir).expect("open");
        assert_refused(
            dir.open_file("rootfs.img").unwrap_err(),
            "rootfs.img",
            "symlink",
        );
        // The snapshot's disk copy.
        let paths = super::super::vm::Paths::new(&scene.dir);
        let to = scene.dir.parent().expect("parent").join("snap-rootfs.img");
        let error = super::super::snapshot::copy_rootfs(&paths, &to).unwrap_err();
        assert_refused(&error, "rootfs.img", "symlink");
        assert!(
            error.to_string().contains(&scene.dir.display().to_string()),
            "{error}"
        );
        assert!(!to.exists(), "a copy was made");
        assert_eq!(scene.host_state(), before);
    }

    #[test]
    fn fifos_hard_links_and_strangers_files_are_refused() {
        let scene = scene();
        let dir = JailDir::open(&scene.dir).expect("open");
        let fifo = CString::new(scene.dir.join("rootfs.img").as_os_str().as_bytes()).expect("c");
        // SAFETY: mkfifo on a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        // Refused at once: the open does not wait for a writer.
        assert_refused(
            dir.open_file("rootfs.img").unwrap_err(),
            "rootfs.img",
            "not a regular file",
        );
        std::fs::write(scene.dir.join("a"), b"x").expect("write");
        std::fs::hard_link(scene.dir.join("a"), scene.dir.join("vmm.log")).expect("link");
        assert_refused(
            dir.open_file("vmm.log").unwrap_err(),
            "vmm.log",
            "2 hard links",
        );
        std::fs::write(scene.dir.join("memory"), b"x").expect("write");
        std::os::unix::fs::chown(scene.dir.join("memory"), Some(12345), None).expect("chown");
        assert_refused(
            dir.open_file("memory").unwrap_err(),
            "memory",
            "owned by uid 12345",
        );
        assert_refused(dir.open_file("../x").unwrap_err(), "../x", "plain name");
        // A plain file of its own is fine.
        std::fs::write(scene.dir.join("b"), b"ok").expect("write");
        let mut text = String::new();
        dir.open_file("b")
            .expect("b")
            .read_to_string(&mut text)
            .expect("read");
        assert_eq!(text, "ok");
    }

    #[test]
    fn a_planted_vmm_log_symlink_never_reaches_the_end_reason() {
        let scene = scene();
        let before = scene.host_state();
        scene.plant("vmm.log", &scene.host_file);
        let tail = super::super::vm::log_tail(&scene.dir);
        assert_refused(&tail, "vmm.log", "symlink");
        assert!(!tail.contains("host secret"), "{tail}");
        assert_eq!(scene.host_state(), before);
        // A real log: its last bytes, on one line.
        std::fs::remove_file(scene.dir.join("vmm.log")).expect("rm");
        let long = format!("{}\nlast line\n", "x".repeat(5000));
        std::fs::write(scene.dir.join("vmm.log"), long).expect("write");
        let tail = super::super::vm::log_tail(&scene.dir);
        assert!(
            tail.ends_with("x | last line") && tail.len() == 1001,
            "{}",
            tail.len()
        );
        // None at all: nothing.
        std::fs::remove_file(scene.dir.join("vmm.log")).expect("rm");
        assert_eq!(super::super::vm::log_tail(&scene.dir), "");
    }

    #[test]
    fn a_planted_snapshot_new_symlink_is_replaced_and_the_host_dir_keeps_its_owner() {
        let scene = scene();
        let before = scene.host_state();
        scene.plant("snapshot-new", &scene.host_dir);
        let dir = JailDir::open(&scene.dir).expect("open");
        let staging = dir
            .fresh_subdir("snapshot-new", 64000, 64001)
            .expect("fresh");
        let meta = std::fs::symlink_metadata(scene.dir.join("snapshot-new")).expect("stat");
        assert!(meta.is_dir() && !meta.is_symlink());
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (64000, 64001, 0o700)
        );
        assert_eq!(staging.owner(), (64000, 64001));
        assert_eq!(scene.host_state(), before);
        // Made a symlink again after the VMM wrote there: the read refuses it.
        std::fs::remove_dir(scene.dir.join("snapshot-new")).expect("rmdir");
        scene.plant("snapshot-new", &scene.host_dir);
        assert_refused(
            dir.subdir("snapshot-new").unwrap_err(),
            "snapshot-new",
            "symlink",
        );
        assert_eq!(scene.host_state(), before);
    }

    #[test]
    fn a_planted_symlink_in_snapshot_new_is_not_moved_and_its_target_stays() {
        let scene = scene();
        let before = scene.host_state();
        let dir = JailDir::open(&scene.dir).expect("open");
        // The jail's directory, and a file its VMM wrote, moved into one of root's.
        let staging = dir
            .fresh_subdir("snapshot-new", 64000, 64001)
            .expect("fresh");
        let snap = scene.dir.parent().expect("parent").join("snap");
        std::fs::create_dir(&snap).expect("snap dir");
        let to = JailDir::open(&snap).expect("open snap");
        std::fs::write(scene.dir.join("snapshot-new/vmstate"), b"state").expect("write");
        std::os::unix::fs::chown(scene.dir.join("snapshot-new/vmstate"), Some(64000), None)
            .expect("chown");
        std::os::unix::fs::symlink(&scene.host_file, scene.dir.join("snapshot-new/memory"))
            .expect("symlink");
        std::os::unix::fs::symlink(&scene.host_dir, scene.dir.join("snapshot-new/memory.id"))
            .expect("symlink");
        staging
            .move_file_to(OsStr::new("vmstate"), &to)
            .expect("vmstate moves");
        assert_eq!(
            std::fs::read(snap.join("vmstate")).expect("moved"),
            b"state"
        );
        for name in ["memory", "memory.id"] {
            let error = staging.move_file_to(OsStr::new(name), &to).unwrap_err();
            assert_refused(&error, name, "symlink");
            assert!(error.to_string().contains("snapshot-new"), "{error}");
            assert!(
                std::fs::symlink_metadata(snap.join(name)).is_err(),
                "{name} moved"
            );
        }
        // Never over a file the daemon has there.
        std::fs::write(scene.dir.join("snapshot-new/vmstate"), b"again").expect("write");
        assert!(staging.move_file_to(OsStr::new("vmstate"), &to).is_err());
        assert_eq!(std::fs::read(snap.join("vmstate")).expect("kept"), b"state");
        assert_eq!(scene.host_state(), before);
    }

    #[test]
    fn a_planted_api_sock_symlink_is_refused_and_a_real_socket_connects() {
        let scene = scene();
        // A host service's socket the symlink aims at.
        let host_sock = scene.host_dir.join("service.sock");
        let host = std::os::unix::net::UnixListener::bind(&host_sock).expect("bind host");
        host.set_nonblocking(true).expect("nonblocking");
        scene.plant("api.sock", &host_sock);
        let dir = JailDir::open(&scene.dir).expect("open");
        assert_refused(dir.socket("api.sock").unwrap_err(), "api.sock", "symlink");
        let paths = super::super::vm::Paths::new(&scene.dir);
        let error = super::super::vm::set_vm_state(&paths, vmm_api::VmState::Paused).unwrap_err();
        assert_refused(&error, "api.sock", "symlink");
        assert!(host.accept().is_err(), "the host socket was connected to");
        // A regular file is no socket either.
        std::fs::write(scene.dir.join("vsock.sock"), b"").expect("write");
        assert_refused(
            dir.socket("vsock.sock").unwrap_err(),
            "vsock.sock",
            "not a Unix socket",
        );
        // The VMM's own socket: reached through the descriptor.
        std::fs::remove_file(scene.dir.join("api.sock")).expect("rm");
        let own = std::os::unix::net::UnixListener::bind(scene.dir.join("api.sock")).expect("bind");
        let sock = dir.socket("api.sock").expect("socket");
        assert_eq!(sock.path(), scene.dir.join("api.sock"));
        std::os::unix::net::UnixStream::connect(sock.connect_path()).expect("connect");
        own.accept().expect("accepted");
    }

    #[test]
    fn the_directory_itself_must_not_be_a_symlink() {
        let scene = scene();
        let link = scene.dir.parent().expect("parent").join("sb-2");
        std::os::unix::fs::symlink(&scene.host_dir, &link).expect("symlink");
        let error = JailDir::open(&link).unwrap_err();
        assert!(error.to_string().contains("sb-2"), "{error}");
        // And a group or mode change reaches only the directory opened.
        let dir = JailDir::open(&scene.dir).expect("open");
        dir.set_group_mode(64001, 0o750).expect("chgrp");
        let meta = std::fs::metadata(&scene.dir).expect("stat");
        assert_eq!(
            (meta.gid(), meta.permissions().mode() & 0o777),
            (64001, 0o750)
        );
    }
}
