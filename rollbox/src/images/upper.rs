//! The overlayfs upper directory of a split build: what the layers above the shared base, E2B's
//! account and the agent install changed in the staging tree.
//!
//! [`Snapshot::record`] notes every path of the tree once the base's layers are applied: a
//! directory's inode and metadata (mode, owner, mtime, xattrs), any other entry's inode and
//! ctime. The build goes on in the same tree; [`write_upper`] then walks the finished tree and
//! puts into the upper directory:
//! - every new entry, and every non-directory whose inode or ctime changed, as a hard link to
//!   the tree's inode (nothing is copied; two upper names of one inode stay one inode);
//! - a directory kept (same inode) whose metadata changed, as a plain directory;
//! - a directory replaced (new inode) as an opaque one (`trusted.overlay.opaque=y`), with all
//!   its current children;
//! - a recorded entry gone from a kept directory as a whiteout (character device 0/0);
//! - the parents of all of these, with the tree's metadata.
//!
//! A directory removed and made again may get its old inode number back; it then counts as
//! kept, and whiteouts for its removed children give the same merged view as an opaque mark.
//! Directories are compared by metadata, not ctime: the layer applier sets directory mtimes
//! again at the end of the build, which changes ctime without changing anything a guest sees.

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsString};
use std::fs::{self, Metadata};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::sys;

/// The xattr that makes an overlayfs upper directory hide the lower one.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

#[derive(Debug, thiserror::Error)]
pub enum UpperError {
    #[error("overlay upper: cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: String,
        source: io::Error,
    },
}

fn io_error<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> UpperError + 'a {
    move |source| UpperError::Io {
        action,
        path: path.display().to_string(),
        source,
    }
}

type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Recorded {
    Dir {
        ino: u64,
        mode: u32,
        uid: u32,
        gid: u32,
        mtime: (i64, i64),
        xattrs: Xattrs,
    },
    Other {
        ino: u64,
        ctime: (i64, i64),
    },
}

/// The tree as it was when the base's layers were applied.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// By path relative to the tree's root ("" is the root).
    entries: HashMap<PathBuf, Recorded>,
    /// Each recorded directory's children.
    children: HashMap<PathBuf, Vec<OsString>>,
}

/// What [`write_upper`] put into the upper directory.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UpperStats {
    pub linked: u64,
    pub dirs: u64,
    pub opaque_dirs: u64,
    pub whiteouts: u64,
}

fn record_dir(path: &Path, meta: &Metadata) -> Result<Recorded, UpperError> {
    Ok(Recorded::Dir {
        ino: meta.ino(),
        mode: meta.mode(),
        uid: meta.uid(),
        gid: meta.gid(),
        mtime: (meta.mtime(), meta.mtime_nsec()),
        xattrs: list_xattrs(path).map_err(io_error("read the xattrs of", path))?,
    })
}

impl Snapshot {
    /// Records every path under `root` (lstat, no symlink followed). Returns after the
    /// clock has moved past every recorded ctime, so a change made afterwards is seen even
    /// where ctime is coarse.
    pub fn record(root: &Path) -> Result<Snapshot, UpperError> {
        let mut snapshot = Snapshot::default();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let full = root.join(&rel);
            let meta = fs::symlink_metadata(&full).map_err(io_error("inspect", &full))?;
            if meta.is_dir() {
                snapshot
                    .entries
                    .insert(rel.clone(), record_dir(&full, &meta)?);
                let names = list_dir(&full)?;
                stack.extend(names.iter().map(|n| rel.join(n)));
                snapshot.children.insert(rel, names);
            } else {
                let recorded = Recorded::Other {
                    ino: meta.ino(),
                    ctime: (meta.ctime(), meta.ctime_nsec()),
                };
                snapshot.entries.insert(rel, recorded);
            }
        }
        // Kernel timestamps come from a clock that ticks every few milliseconds.
        std::thread::sleep(Duration::from_millis(20));
        Ok(snapshot)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn list_dir(dir: &Path) -> Result<Vec<OsString>, UpperError> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_error("list", dir))? {
        names.push(entry.map_err(io_error("list", dir))?.file_name());
    }
    names.sort();
    Ok(names)
}

/// Writes the upper directory `upper` (which must not exist; its parent must, on the tree's
/// file system) for `tree`, changed since `snapshot` was recorded.
pub fn write_upper(
    tree: &Path,
    snapshot: &Snapshot,
    upper: &Path,
) -> Result<UpperStats, UpperError> {
    let mut writer = Writer {
        tree,
        upper,
        snapshot,
        created: HashSet::new(),
        dir_times: Vec::new(),
        stats: UpperStats::default(),
    };
    fs::create_dir(upper).map_err(io_error("create", upper))?;
    let root_meta = fs::symlink_metadata(tree).map_err(io_error("inspect", tree))?;
    writer.copy_dir_meta(Path::new(""), &root_meta)?;
    writer.created.insert(PathBuf::new());
    writer.visit(Path::new(""), false)?;
    // Last: adding entries to a directory changes its mtime.
    for (rel, meta) in writer.dir_times.iter().rev() {
        let path = upper.join(rel);
        set_times(&path, meta).map_err(io_error("set the times of", &path))?;
    }
    Ok(writer.stats)
}

struct Writer<'a> {
    tree: &'a Path,
    upper: &'a Path,
    snapshot: &'a Snapshot,
    /// Directories made in the upper, by relative path.
    created: HashSet<PathBuf>,
    dir_times: Vec<(PathBuf, Metadata)>,
    stats: UpperStats,
}

impl Writer<'_> {
    /// Visits the children of the tree's directory `rel`; `all` when every one of them goes
    /// into the upper (the directory is new or replaced).
    fn visit(&mut self, rel: &Path, all: bool) -> Result<(), UpperError> {
        let names = list_dir(&self.tree.join(rel))?;
        if !all {
            if let Some(before) = self.snapshot.children.get(rel) {
                for gone in before.iter().filter(|n| names.binary_search(n).is_err()) {
                    self.whiteout(&rel.join(gone))?;
                }
            }
        }
        for name in names {
            let child = rel.join(&name);
            let full = self.tree.join(&child);
            let meta = fs::symlink_metadata(&full).map_err(io_error("inspect", &full))?;
            let recorded = if all {
                None
            } else {
                self.snapshot.entries.get(&child)
            };
            match (recorded, meta.is_dir()) {
                (None, true) => {
                    self.make_dir(&child, &meta, false)?;
                    self.visit(&child, true)?;
                }
                (None, false) => self.link(&child)?,
                (Some(Recorded::Dir { ino, .. }), true) if *ino == meta.ino() => {
                    if recorded != Some(&record_dir(&full, &meta)?) {
                        self.make_dir(&child, &meta, false)?;
                    }
                    self.visit(&child, false)?;
                }
                (Some(_), true) => {
                    self.make_dir(&child, &meta, true)?;
                    self.visit(&child, true)?;
                }
                (Some(Recorded::Other { ino, ctime }), false)
                    if *ino == meta.ino() && *ctime == (meta.ctime(), meta.ctime_nsec()) => {}
                (Some(_), false) => self.link(&child)?,
            }
        }
        Ok(())
    }

    fn ensure_parent(&mut self, rel: &Path) -> Result<(), UpperError> {
        let parent = rel.parent().unwrap_or(Path::new(""));
        if self.created.contains(parent) {
            return Ok(());
        }
        let full = self.tree.join(parent);
        let meta = fs::symlink_metadata(&full).map_err(io_error("inspect", &full))?;
        self.make_dir(parent, &meta, false)
    }

    fn make_dir(&mut self, rel: &Path, meta: &Metadata, opaque: bool) -> Result<(), UpperError> {
        if self.created.contains(rel) {
            return Ok(());
        }
        self.ensure_parent(rel)?;
        let path = self.upper.join(rel);
        fs::create_dir(&path).map_err(io_error("create", &path))?;
        self.copy_dir_meta(rel, meta)?;
        if opaque {
            sys::lsetxattr(&path, OPAQUE_XATTR.as_bytes(), b"y")
                .map_err(io_error("mark opaque (trusted.* xattrs needed)", &path))?;
            self.stats.opaque_dirs += 1;
        }
        self.created.insert(rel.to_path_buf());
        self.stats.dirs += 1;
        Ok(())
    }

    /// Owner, mode and xattrs now; times at the end.
    fn copy_dir_meta(&mut self, rel: &Path, meta: &Metadata) -> Result<(), UpperError> {
        let (from, to) = (self.tree.join(rel), self.upper.join(rel));
        std::os::unix::fs::lchown(&to, Some(meta.uid()), Some(meta.gid()))
            .map_err(io_error("chown", &to))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(io_error("chmod", &to))?;
        for (name, value) in list_xattrs(&from).map_err(io_error("read the xattrs of", &from))? {
            sys::lsetxattr(&to, &name, &value).map_err(io_error("set an xattr on", &to))?;
        }
        self.dir_times.push((rel.to_path_buf(), meta.clone()));
        Ok(())
    }

    fn link(&mut self, rel: &Path) -> Result<(), UpperError> {
        self.ensure_parent(rel)?;
        let (from, to) = (self.tree.join(rel), self.upper.join(rel));
        fs::hard_link(&from, &to).map_err(io_error("hard-link into the upper", &to))?;
        self.stats.linked += 1;
        Ok(())
    }

    fn whiteout(&mut self, rel: &Path) -> Result<(), UpperError> {
        self.ensure_parent(rel)?;
        let path = self.upper.join(rel);
        sys::mknod(&path, libc::S_IFCHR, libc::makedev(0, 0))
            .map_err(io_error("make a whiteout at", &path))?;
        self.stats.whiteouts += 1;
        Ok(())
    }
}

fn c_bytes(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains a NUL byte"))
}

/// The xattrs of `path` itself (not a symlink's target), sorted by name.
fn list_xattrs(path: &Path) -> io::Result<Xattrs> {
    let c = sys::c_path(path)?;
    let mut names = vec![0u8; 1024];
    let len = loop {
        // SAFETY: `c` is a valid path; the buffer is writable for its whole length.
        let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if n >= 0 {
            break n.unsigned_abs();
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) => names.resize(names.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(e),
        }
    };
    let mut out = Vec::new();
    for name in names[..len].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let c_name = c_bytes(name)?;
        let mut value = vec![0u8; 256];
        let n = loop {
            // SAFETY: valid path and name; the buffer is writable for its whole length.
            let n = unsafe {
                libc::lgetxattr(
                    c.as_ptr(),
                    c_name.as_ptr(),
                    value.as_mut_ptr().cast(),
                    value.len(),
                )
            };
            if n >= 0 {
                break n.unsigned_abs();
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ERANGE) || value.len() > 1 << 20 {
                return Err(e);
            }
            value.resize(value.len() * 4, 0);
        };
        value.truncate(n);
        out.push((name.to_vec(), value));
    }
    out.sort();
    Ok(out)
}

fn set_times(path: &Path, meta: &Metadata) -> io::Result<()> {
    sys::set_atime_mtime_nofollow(
        path,
        (meta.atime(), meta.atime_nsec()),
        (meta.mtime(), meta.mtime_nsec()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, FileTypeExt};

    fn root_or_skip(test: &str) -> bool {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            return true;
        }
        let reason = "needs root (whiteouts are device nodes, opaque marks trusted.* xattrs)";
        assert!(
            std::env::var_os("ROLLBOX_REQUIRE_ALL").is_none_or(|v| v != "1"),
            "{test} could not run: {reason}"
        );
        eprintln!("SKIP {test}: {reason}");
        false
    }

    fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
        list_xattrs(path)
            .unwrap()
            .into_iter()
            .find(|(n, _)| n == name.as_bytes())
            .map(|(_, v)| v)
    }

    fn is_whiteout(path: &Path) -> bool {
        let meta = fs::symlink_metadata(path).unwrap();
        meta.file_type().is_char_device() && meta.rdev() == 0
    }

    /// The upper's entries, relative, sorted.
    fn listing(upper: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![upper.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                out.push(path.strip_prefix(upper).unwrap().display().to_string());
                if fs::symlink_metadata(&path).unwrap().is_dir() {
                    stack.push(path);
                }
            }
        }
        out.sort();
        out
    }

    #[test]
    fn upper_holds_changes_whiteouts_opaque_dirs_and_links() {
        if !root_or_skip("upper_holds_changes_whiteouts_opaque_dirs_and_links") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        let t = |p: &str| tree.join(p);
        for d in ["a", "d", "m", "x", "same"] {
            fs::create_dir_all(t(d)).unwrap();
        }
        for f in [
            "a/keep", "a/edit", "a/gone", "d/old", "h1", "x/file", "same/f",
        ] {
            fs::write(t(f), f.as_bytes()).unwrap();
        }
        std::os::unix::fs::symlink("keep", t("a/link")).unwrap();
        fs::hard_link(t("a/keep"), t("a/keep2")).unwrap();
        let snapshot = Snapshot::record(&tree).unwrap();
        assert_eq!(snapshot.len(), 15);

        // Added, changed in place, deleted, replaced, linked, re-moded, xattrs.
        fs::create_dir(t("n")).unwrap();
        fs::write(t("n/new"), b"new").unwrap();
        fs::OpenOptions::new()
            .append(true)
            .open(t("a/edit"))
            .unwrap()
            .write_all_at(b"!", 6)
            .unwrap();
        fs::remove_file(t("a/gone")).unwrap();
        // Replaced while the old one still exists, so the new one gets another inode.
        fs::rename(t("d"), t("d.old")).unwrap();
        fs::create_dir(t("d")).unwrap();
        fs::remove_dir_all(t("d.old")).unwrap();
        fs::write(t("d/fresh"), b"fresh").unwrap();
        fs::hard_link(t("h1"), t("h2")).unwrap();
        fs::set_permissions(t("m"), fs::Permissions::from_mode(0o700)).unwrap();
        sys::lsetxattr(&t("x/file"), b"user.k", b"v").unwrap();
        sys::lsetxattr(&t("x"), b"user.d", b"w").unwrap();

        let upper = dir.path().join("upper");
        let stats = write_upper(&tree, &snapshot, &upper).unwrap();
        let u = |p: &str| upper.join(p);
        assert_eq!(
            listing(&upper),
            [
                "a", "a/edit", "a/gone", "d", "d/fresh", "h1", "h2", "m", "n", "n/new", "x",
                "x/file"
            ]
        );
        assert_eq!(
            stats,
            UpperStats {
                linked: 6,
                dirs: 5,
                opaque_dirs: 1,
                whiteouts: 1
            }
        );
        // Nothing copied: the tree's inodes, and a new link pair stays one inode.
        let ino = |p: &Path| fs::symlink_metadata(p).unwrap().ino();
        assert_eq!(ino(&u("a/edit")), ino(&t("a/edit")));
        assert_eq!(ino(&u("h1")), ino(&u("h2")));
        assert_eq!(fs::read(u("a/edit")).unwrap(), b"a/edit!");
        assert!(is_whiteout(&u("a/gone")));
        assert_eq!(xattr(&u("d"), OPAQUE_XATTR).as_deref(), Some(&b"y"[..]));
        assert_eq!(xattr(&u("a"), OPAQUE_XATTR), None);
        assert_eq!(xattr(&u("n"), OPAQUE_XATTR), None);
        assert_eq!(xattr(&u("x"), "user.d").as_deref(), Some(&b"w"[..]));
        assert_eq!(xattr(&u("x/file"), "user.k").as_deref(), Some(&b"v"[..]));
        let m = fs::symlink_metadata(u("m")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o700);
        // Parents and changed directories carry the tree's metadata, times included.
        let a = fs::symlink_metadata(t("a")).unwrap();
        let ua = fs::symlink_metadata(u("a")).unwrap();
        assert_eq!(
            (ua.mode(), ua.uid(), ua.mtime(), ua.mtime_nsec()),
            (a.mode(), a.uid(), a.mtime(), a.mtime_nsec())
        );
    }

    #[test]
    fn an_unchanged_tree_has_an_empty_upper_and_a_dir_turned_file_hides_the_dir() {
        if !root_or_skip("an_unchanged_tree_has_an_empty_upper_and_a_dir_turned_file_hides_the_dir")
        {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        fs::create_dir_all(tree.join("p/q")).unwrap();
        fs::write(tree.join("p/q/f"), b"f").unwrap();
        fs::write(tree.join("file"), b"f").unwrap();
        let snapshot = Snapshot::record(&tree).unwrap();
        let upper = dir.path().join("upper");
        write_upper(&tree, &snapshot, &upper).unwrap();
        assert!(listing(&upper).is_empty());

        fs::remove_dir_all(tree.join("p/q")).unwrap();
        fs::write(tree.join("p/q"), b"now a file").unwrap();
        fs::remove_file(tree.join("file")).unwrap();
        fs::create_dir(tree.join("file")).unwrap();
        let upper = dir.path().join("upper2");
        write_upper(&tree, &snapshot, &upper).unwrap();
        assert_eq!(listing(&upper), ["file", "p", "p/q"]);
        assert_eq!(fs::read(upper.join("p/q")).unwrap(), b"now a file");
        let opaque = xattr(&upper.join("file"), OPAQUE_XATTR);
        assert_eq!(opaque.as_deref(), Some(&b"y"[..]));
    }
}
