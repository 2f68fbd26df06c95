//! Applies image layers (tar streams) onto a root directory, the way a container runtime
//! stacks them: later layers overwrite, `.wh.<name>` deletes `<name>` from lower layers and
//! `.wh..wh..opq` hides everything lower layers put in its directory.
//!
//! Safety rules, checked for every entry: no absolute paths, no `..` components, never
//! write or delete through a symlink that leaves the root (an absolute symlink or one that
//! climbs above the root in a parent component is an error; relative ones that stay inside
//! are followed; an existing symlink at the target path itself is replaced, not followed),
//! and hardlinks only to entries inside the root. Modes, ownership, times, xattrs, symlinks, hardlinks and
//! device nodes are reproduced (the caller must be root).

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use tar::EntryType;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
/// Other `.wh..wh.` names are aufs bookkeeping (e.g. `.wh..wh.plnk`) and carry no files.
const AUFS_META_PREFIX: &[u8] = b".wh..wh.";
/// Symlinks followed while resolving one path, as Linux's MAXSYMLINKS.
const MAX_SYMLINK_HOPS: u32 = 40;

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("layer {layer}: corrupt or unreadable layer data: {source}")]
    Read { layer: String, source: io::Error },
    #[error("layer {layer}: entry {entry:?} has an absolute path; layer entries must be relative to the root")]
    AbsolutePath { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?} contains a `..` component (path traversal)")]
    Traversal { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?} would be written through the symlink /{link} (path escapes via symlink)")]
    ThroughSymlink {
        layer: String,
        entry: String,
        link: String,
    },
    #[error("layer {layer}: entry {entry:?} needs /{parent} to be a directory, but it is not")]
    ParentNotDirectory {
        layer: String,
        entry: String,
        parent: String,
    },
    #[error("layer {layer}: hardlink {entry:?} points outside the root: {target:?}")]
    HardlinkOutside {
        layer: String,
        entry: String,
        target: String,
    },
    #[error("layer {layer}: hardlink {entry:?} points to {target:?}, which does not exist (or is a directory)")]
    HardlinkTarget {
        layer: String,
        entry: String,
        target: String,
    },
    #[error("layer {layer}: whiteout {entry:?} names no file")]
    BadWhiteout { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?} has unsupported tar entry type {kind}")]
    Unsupported {
        layer: String,
        entry: String,
        kind: String,
    },
    #[error("layer {layer}: entry {entry:?}: cannot {action} {path}: {source}")]
    Io {
        layer: String,
        entry: String,
        action: &'static str,
        path: String,
        source: io::Error,
    },
}

impl LayerError {
    /// The underlying OS error, where the failure was a filesystem operation.
    pub fn io_source(&self) -> Option<&io::Error> {
        match self {
            LayerError::Io { source, .. } | LayerError::Read { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// What one layer did, for progress and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayerStats {
    pub entries: u64,
    pub whiteouts: u64,
    pub file_bytes: u64,
}

/// A root directory that layers are applied to, in order.
pub struct RootfsBuilder {
    root: PathBuf,
    /// Directory mtimes are set last: adding children changes them.
    dir_times: HashMap<PathBuf, (i64, u32)>,
}

/// Per-layer context: names for errors, and what this layer created (whiteouts apply only to
/// lower layers).
struct LayerCtx<'a> {
    layer: &'a str,
    entry: String,
    created: HashSet<PathBuf>,
}

impl LayerCtx<'_> {
    fn io(&self, action: &'static str, path: &Path, source: io::Error) -> LayerError {
        LayerError::Io {
            layer: self.layer.to_string(),
            entry: self.entry.clone(),
            action,
            path: path.display().to_string(),
            source,
        }
    }

    fn read(&self, source: io::Error) -> LayerError {
        LayerError::Read {
            layer: self.layer.to_string(),
            source,
        }
    }
}

/// Entry metadata that is applied after the entry itself is created.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, u32),
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl RootfsBuilder {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            dir_times: HashMap::new(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Applies one uncompressed layer tar stream. `layer` names the layer in errors.
    pub fn apply_layer<R: Read>(
        &mut self,
        layer: &str,
        tar_stream: R,
    ) -> Result<LayerStats, LayerError> {
        let mut ctx = LayerCtx {
            layer,
            entry: String::new(),
            created: HashSet::new(),
        };
        let mut stats = LayerStats::default();
        let mut archive = tar::Archive::new(tar_stream);
        let entries = archive.entries().map_err(|e| ctx.read(e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| ctx.read(e))?;
            let raw_path = entry.path().map_err(|e| ctx.read(e))?.into_owned();
            ctx.entry = raw_path.display().to_string();
            let rel = normalize_entry_path(&raw_path)
                .map_err(|problem| problem.into_error(layer, &ctx.entry))?;
            stats.entries += 1;

            if let Some(name) = rel.file_name() {
                let name = name.as_bytes();
                if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
                    let dir = rel.parent().unwrap_or(Path::new(""));
                    if name == OPAQUE_MARKER {
                        self.make_opaque(&mut ctx, dir)?;
                    } else if !name.starts_with(AUFS_META_PREFIX) {
                        if matches!(hidden, b"" | b"." | b"..") {
                            return Err(LayerError::BadWhiteout {
                                layer: layer.to_string(),
                                entry: ctx.entry.clone(),
                            });
                        }
                        self.whiteout(&mut ctx, &dir.join(OsStr::from_bytes(hidden)))?;
                    }
                    stats.whiteouts += 1;
                    continue;
                }
            }
            let meta = read_meta(&mut entry).map_err(|e| ctx.read(e))?;
            stats.file_bytes += self.apply_entry(&mut ctx, &rel, &mut entry, meta)?;
        }
        Ok(stats)
    }

    fn apply_entry<R: Read>(
        &mut self,
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
            let root = self.root.clone();
            self.set_meta(ctx, &root, &meta, false)?;
            self.dir_times.insert(PathBuf::new(), meta.mtime);
            return Ok(0);
        }
        let rel = &self
            .resolve_in_root(ctx, rel, true)?
            .unwrap_or_else(|| rel.to_path_buf());
        let full = self.root.join(rel);
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
                self.set_meta(ctx, &full, &meta, false)?;
                self.dir_times.insert(rel.to_path_buf(), meta.mtime);
            }
            EntryType::Symlink => {
                let target = link_name(ctx, entry)?;
                remove_existing(ctx, &full, false)?;
                std::os::unix::fs::symlink(&target, &full)
                    .map_err(|e| ctx.io("create symlink", &full, e))?;
                self.set_meta(ctx, &full, &meta, true)?;
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
                let target_rel = match self.resolve_in_root(ctx, &target_rel, false)? {
                    Some(resolved) if !resolved.as_os_str().is_empty() => resolved,
                    _ => return Err(missing(ctx)),
                };
                let target_full = self.root.join(&target_rel);
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
                self.set_meta(ctx, &full, &meta, false)?;
            }
            EntryType::XGlobalHeader => return Ok(0),
            other => return Err(unsupported(ctx, &format!("{other:?}"))),
        }
        ctx.created.insert(rel.to_path_buf());
        Ok(written)
    }

    /// Resolves the parent directories of `rel` inside the root and returns the path that `rel`
    /// names there (relative to the root, its parents free of symlinks). Relative symlinks that
    /// stay inside the root are followed, as a container runtime would (`lib -> usr/lib`); an
    /// absolute symlink, one that climbs out of the root, or a loop is refused. With `create`,
    /// missing parents are made; without, None is returned when one is missing. The last
    /// component is never followed.
    fn resolve_in_root(
        &self,
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
            let full = self.root.join(&candidate);
            match fs::symlink_metadata(&full) {
                Ok(m) if m.file_type().is_symlink() => {
                    hops += 1;
                    let target =
                        fs::read_link(&full).map_err(|e| ctx.io("read symlink", &full, e))?;
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

    /// `.wh.<name>`: removes `<name>` unless this same layer created it.
    fn whiteout(&mut self, ctx: &mut LayerCtx<'_>, rel: &Path) -> Result<(), LayerError> {
        match self.resolve_in_root(ctx, rel, false)? {
            Some(resolved)
                if !ctx.created.contains(&resolved) && !resolved.as_os_str().is_empty() =>
            {
                remove_existing(ctx, &self.root.join(resolved), false)?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// `.wh..wh..opq`: removes everything under `dir` that this layer did not create.
    fn make_opaque(&mut self, ctx: &mut LayerCtx<'_>, dir: &Path) -> Result<(), LayerError> {
        let Some(dir) = self.resolve_in_root(ctx, dir, false)? else {
            return Ok(());
        };
        let full = self.root.join(&dir);
        match fs::symlink_metadata(&full) {
            Ok(m) if m.is_dir() => self.remove_lower_children(ctx, &dir),
            // Not a directory (or absent): nothing from lower layers to hide.
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ctx.io("inspect", &full, e)),
        }
    }

    fn remove_lower_children(&self, ctx: &mut LayerCtx<'_>, dir: &Path) -> Result<(), LayerError> {
        let full = self.root.join(dir);
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
                self.remove_lower_children(ctx, &rel)?;
            }
        }
        Ok(())
    }

    fn set_meta(
        &self,
        ctx: &LayerCtx<'_>,
        full: &Path,
        meta: &Meta,
        is_symlink: bool,
    ) -> Result<(), LayerError> {
        std::os::unix::fs::lchown(full, Some(meta.uid), Some(meta.gid))
            .map_err(|e| ctx.io("chown", full, e))?;
        if !is_symlink {
            // chown clears set-id bits, so the mode goes second.
            fs::set_permissions(full, Permissions::from_mode(meta.mode & 0o7777))
                .map_err(|e| ctx.io("chmod", full, e))?;
        }
        set_xattrs(ctx, full, meta)?;
        set_times_nofollow(full, meta.mtime).map_err(|e| ctx.io("set mtime of", full, e))
    }

    /// Sets directory mtimes recorded from the layers. Call once, after the last change.
    pub fn finish(&mut self) -> Result<(), LayerError> {
        for (rel, mtime) in self.dir_times.drain() {
            let full = self.root.join(&rel);
            match set_times_nofollow(&full, mtime) {
                Ok(()) => {}
                // Removed by a later layer.
                Err(e)
                    if e.kind() == io::ErrorKind::NotFound
                        || e.raw_os_error() == Some(libc::ENOTDIR) => {}
                Err(source) => {
                    return Err(LayerError::Io {
                        layer: "(final pass)".to_string(),
                        entry: rel.display().to_string(),
                        action: "set mtime of",
                        path: full.display().to_string(),
                        source,
                    })
                }
            }
        }
        Ok(())
    }
}

enum PathProblem {
    Absolute,
    Traversal,
}

impl PathProblem {
    fn into_error(self, layer: &str, entry: &str) -> LayerError {
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
fn normalize_entry_path(raw: &Path) -> Result<PathBuf, PathProblem> {
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

fn unsupported(ctx: &LayerCtx<'_>, kind: &str) -> LayerError {
    LayerError::Unsupported {
        layer: ctx.layer.to_string(),
        entry: ctx.entry.clone(),
        kind: kind.to_string(),
    }
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
fn remove_existing(ctx: &LayerCtx<'_>, full: &Path, keep_dir: bool) -> Result<bool, LayerError> {
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

fn read_meta<R: Read>(entry: &mut tar::Entry<'_, R>) -> io::Result<Meta> {
    let header = entry.header();
    let mut meta = Meta {
        mode: header.mode()?,
        uid: u32::try_from(header.uid()?).unwrap_or(u32::MAX),
        gid: u32::try_from(header.gid()?).unwrap_or(u32::MAX),
        mtime: (i64::try_from(header.mtime()?).unwrap_or(0), 0),
        xattrs: Vec::new(),
    };
    if let Some(extensions) = entry.pax_extensions()? {
        for extension in extensions {
            let extension = extension?;
            let key = extension.key_bytes();
            let value = extension.value_bytes();
            let number = || {
                std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u32>().ok())
            };
            if key == b"uid" {
                meta.uid = number().unwrap_or(meta.uid);
            } else if key == b"gid" {
                meta.gid = number().unwrap_or(meta.gid);
            } else if key == b"mtime" {
                meta.mtime = parse_pax_time(value).unwrap_or(meta.mtime);
            } else if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                meta.xattrs.push((name.to_vec(), value.to_vec()));
            }
        }
    }
    Ok(meta)
}

/// PAX times are decimal seconds with an optional fraction: `1700000000.123456789`.
fn parse_pax_time(value: &[u8]) -> Option<(i64, u32)> {
    let text = std::str::from_utf8(value).ok()?;
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    let secs = secs.parse::<i64>().ok()?;
    let digits: String = frac.chars().take(9).collect();
    let nanos = if digits.is_empty() {
        0
    } else {
        digits.parse::<u32>().ok()? * 10u32.pow(9 - digits.len() as u32)
    };
    Some((secs, nanos))
}

fn system_time((secs, nanos): (i64, u32)) -> SystemTime {
    let offset = Duration::new(secs.unsigned_abs(), nanos);
    if secs >= 0 {
        SystemTime::UNIX_EPOCH + offset
    } else {
        SystemTime::UNIX_EPOCH - offset
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn set_times_nofollow(path: &Path, (secs, nanos): (i64, u32)) -> io::Result<()> {
    let c = c_path(path)?;
    let time = libc::timespec {
        tv_sec: secs,
        tv_nsec: i64::from(nanos),
    };
    let times = [time, time];
    // SAFETY: `c` is a valid NUL-terminated path and `times` points to two timespecs that
    // live for the duration of the call.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn mknod(path: &Path, mode: u32, dev: libc::dev_t) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: `c` is a valid NUL-terminated path; mknod does not keep the pointer.
    let rc = unsafe { libc::mknod(c.as_ptr(), mode, dev) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn set_xattrs(ctx: &LayerCtx<'_>, full: &Path, meta: &Meta) -> Result<(), LayerError> {
    for (name, value) in &meta.xattrs {
        let attempt = || -> io::Result<()> {
            let c = c_path(full)?;
            let name = CString::new(name.clone()).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "xattr name contains a NUL byte",
                )
            })?;
            // SAFETY: path and name are valid NUL-terminated strings, and value/len describe a
            // live byte buffer; the kernel copies them and keeps no pointer.
            let rc = unsafe {
                libc::lsetxattr(
                    c.as_ptr(),
                    name.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    0,
                )
            };
            if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        };
        attempt().map_err(|e| ctx.io("set extended attribute on", full, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Builds an in-memory tar layer.
    struct LayerTar {
        builder: tar::Builder<Vec<u8>>,
    }

    impl LayerTar {
        fn new() -> Self {
            Self {
                builder: tar::Builder::new(Vec::new()),
            }
        }

        fn header(kind: EntryType, mode: u32, uid: u64, gid: u64) -> tar::Header {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(kind);
            header.set_mode(mode);
            header.set_uid(uid);
            header.set_gid(gid);
            header.set_mtime(1_600_000_000);
            header.set_size(0);
            header
        }

        fn file(mut self, path: &str, data: &[u8], mode: u32, uid: u64, gid: u64) -> Self {
            let mut header = Self::header(EntryType::Regular, mode, uid, gid);
            header.set_size(data.len() as u64);
            self.builder.append_data(&mut header, path, data).unwrap();
            self
        }

        fn dir(mut self, path: &str, mode: u32) -> Self {
            let mut header = Self::header(EntryType::Directory, mode, 0, 0);
            self.builder
                .append_data(&mut header, path, io::empty())
                .unwrap();
            self
        }

        fn link(mut self, kind: EntryType, path: &str, target: &str) -> Self {
            let mut header = Self::header(kind, 0o777, 0, 0);
            self.builder.append_link(&mut header, path, target).unwrap();
            self
        }

        fn device(mut self, kind: EntryType, path: &str, major: u32, minor: u32) -> Self {
            let mut header = Self::header(kind, 0o620, 0, 5);
            header.set_device_major(major).unwrap();
            header.set_device_minor(minor).unwrap();
            self.builder
                .append_data(&mut header, path, io::empty())
                .unwrap();
            self
        }

        /// Writes a raw name that `append_data` would refuse (absolute or `..`).
        fn raw_file(mut self, path: &str) -> Self {
            let mut header = Self::header(EntryType::Regular, 0o644, 0, 0);
            let name = path.as_bytes();
            header.as_old_mut().name[..name.len()].copy_from_slice(name);
            header.set_cksum();
            self.builder.append(&header, io::empty()).unwrap();
            self
        }

        /// Raw hardlink with an arbitrary target.
        fn raw_hardlink(mut self, path: &str, target: &str) -> Self {
            let mut header = Self::header(EntryType::Link, 0o644, 0, 0);
            header.set_path(path).unwrap();
            let target = target.as_bytes();
            header.as_old_mut().linkname[..target.len()].copy_from_slice(target);
            header.set_cksum();
            self.builder.append(&header, io::empty()).unwrap();
            self
        }

        fn bytes(self) -> Vec<u8> {
            self.builder.into_inner().unwrap()
        }
    }

    fn apply(
        builder: &mut RootfsBuilder,
        name: &str,
        layer: LayerTar,
    ) -> Result<LayerStats, LayerError> {
        builder.apply_layer(name, &layer.bytes()[..])
    }

    fn exists(root: &Path, rel: &str) -> bool {
        fs::symlink_metadata(root.join(rel)).is_ok()
    }

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

    #[test]
    fn truncated_layer_is_a_read_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut rootfs = RootfsBuilder::new(dir.path());
        let bytes = LayerTar::new()
            .file("big", &[7u8; 10_000], 0o644, 0, 0)
            .bytes();
        let err = rootfs.apply_layer("cut", &bytes[..3000]).unwrap_err();
        assert!(matches!(err, LayerError::Read { .. }), "{err}");
    }

    #[test]
    fn pax_time_parsing() {
        assert_eq!(
            parse_pax_time(b"1700000000.5"),
            Some((1_700_000_000, 500_000_000))
        );
        assert_eq!(parse_pax_time(b"12"), Some((12, 0)));
        assert_eq!(parse_pax_time(b"x"), None);
    }
}
