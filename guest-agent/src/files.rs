//! File operations. They block, so the server runs them on blocking threads.
//! Errors read "<op> <path>: <errno meaning>".

use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rollbox_agent_protocol::{
    ErrorInfo, FileInfo, FileKind, ServerFrame, ServerMessage, WriteFileRequest, CHUNK_BYTES,
};
use tokio::sync::mpsc;

use crate::errors::SysError;

/// Paths must be absolute: the agent has no meaningful cwd for a client.
pub fn check_path(path: &str) -> Result<PathBuf, ErrorInfo> {
    if path.is_empty() {
        return Err(ErrorInfo::bad_request("path is empty"));
    }
    if path.contains('\0') {
        return Err(ErrorInfo::bad_request(format!(
            "path {path:?} contains a NUL byte"
        )));
    }
    if !path.starts_with('/') {
        return Err(ErrorInfo::bad_request(format!(
            "path {path:?} is not absolute"
        )));
    }
    Ok(PathBuf::from(path))
}

fn info(err: SysError) -> ErrorInfo {
    err.to_info()
}

fn file_info(path: &Path, meta: &fs::Metadata) -> FileInfo {
    let file_type = meta.file_type();
    let kind = if file_type.is_symlink() {
        FileKind::Symlink
    } else if file_type.is_dir() {
        FileKind::Dir
    } else if file_type.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    FileInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        path: path.display().to_string(),
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_ns: meta
            .mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(meta.mtime_nsec()),
        link_target: if kind == FileKind::Symlink {
            fs::read_link(path).ok().map(|t| t.display().to_string())
        } else {
            None
        },
        // Only files and directories carry user attributes.
        metadata: if kind == FileKind::File || kind == FileKind::Dir {
            crate::xattrs::read(path)
        } else {
            Default::default()
        },
    }
}

pub fn stat(path: &str, follow_symlinks: bool) -> Result<FileInfo, ErrorInfo> {
    let p = check_path(path)?;
    let meta = if follow_symlinks {
        fs::metadata(&p)
    } else {
        fs::symlink_metadata(&p)
    };
    let meta = meta.map_err(|e| {
        info(SysError::new(
            if follow_symlinks { "stat" } else { "lstat" },
            path,
            e,
        ))
    })?;
    Ok(file_info(&p, &meta))
}

pub fn list(path: &str) -> Result<Vec<FileInfo>, ErrorInfo> {
    let p = check_path(path)?;
    let mut entries = Vec::new();
    for entry in fs::read_dir(&p).map_err(|e| info(SysError::new("opendir", path, e)))? {
        let entry = entry.map_err(|e| info(SysError::new("readdir", path, e)))?;
        let entry_path = entry.path();
        match fs::symlink_metadata(&entry_path) {
            Ok(meta) => entries.push(file_info(&entry_path, &meta)),
            // Removed between readdir and lstat: it is simply gone.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => {
                return Err(info(SysError::new(
                    "lstat",
                    entry_path.display().to_string(),
                    err,
                )))
            }
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

/// Creates `path` (and with `parents` its missing parents); what it creates goes to `owner`.
pub fn mkdir(
    path: &str,
    parents: bool,
    mode: Option<u32>,
    owner: Option<Owner>,
) -> Result<(), ErrorInfo> {
    let p = check_path(path)?;
    let missing: Vec<&Path> = p
        .ancestors()
        .take_while(|d| fs::symlink_metadata(d).is_err())
        .collect();
    let mut builder = fs::DirBuilder::new();
    builder.recursive(parents).mode(mode.unwrap_or(0o755));
    builder
        .create(&p)
        .map_err(|e| info(SysError::new("mkdir", path, e)))?;
    give_created(&missing, owner)
}

pub fn remove(path: &str, recursive: bool) -> Result<(), ErrorInfo> {
    let p = check_path(path)?;
    if p.parent().is_none() {
        return Err(ErrorInfo::bad_request("remove: refusing to remove /"));
    }
    let meta = fs::symlink_metadata(&p).map_err(|e| info(SysError::new("remove", path, e)))?;
    let result = if meta.is_dir() {
        if recursive {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_dir(&p)
        }
    } else {
        fs::remove_file(&p)
    };
    result.map_err(|e| info(SysError::new("remove", path, e)))
}

pub fn rename(from: &str, to: &str) -> Result<(), ErrorInfo> {
    let src = check_path(from)?;
    let dst = check_path(to)?;
    fs::rename(&src, &dst).map_err(|e| info(SysError::new("rename", format!("{from} -> {to}"), e)))
}

/// Sends download chunks from a blocking thread.
pub struct ChunkSender {
    pub id: u64,
    pub out: mpsc::Sender<ServerFrame>,
    pub cancel: Arc<AtomicBool>,
    seq: u64,
    pub bytes: u64,
}

impl ChunkSender {
    pub fn new(id: u64, out: mpsc::Sender<ServerFrame>, cancel: Arc<AtomicBool>) -> Self {
        Self {
            id,
            out,
            cancel,
            seq: 0,
            bytes: 0,
        }
    }

    fn send(&mut self, data: &[u8]) -> io::Result<()> {
        if self.cancel.load(Ordering::Relaxed) {
            return Err(io::Error::other("download cancelled by the client"));
        }
        let body = ServerMessage::Data {
            seq: self.seq,
            data: data.to_vec(),
        };
        self.out
            .blocking_send(ServerFrame { id: self.id, body })
            .map_err(|_| io::Error::other("connection closed"))?;
        self.seq += 1;
        self.bytes += data.len() as u64;
        Ok(())
    }
}

/// A buffering writer that turns a byte stream into Data chunks.
struct ChunkWriter<'a> {
    sender: &'a mut ChunkSender,
    buf: Vec<u8>,
}

impl Write for ChunkWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let room = CHUNK_BYTES - self.buf.len();
        let take = data.len().min(room);
        self.buf.extend_from_slice(&data[..take]);
        if self.buf.len() == CHUNK_BYTES {
            self.flush()?;
        }
        Ok(take)
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.sender.send(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }
}

pub fn read_file(
    path: &str,
    offset: u64,
    length: Option<u64>,
    sender: &mut ChunkSender,
) -> Result<u64, ErrorInfo> {
    let p = check_path(path)?;
    let mut file = fs::File::open(&p).map_err(|e| info(SysError::new("open", path, e)))?;
    let meta = file
        .metadata()
        .map_err(|e| info(SysError::new("fstat", path, e)))?;
    if meta.is_dir() {
        return Err(info(SysError::new(
            "read",
            path,
            io::Error::from_raw_os_error(libc::EISDIR),
        )));
    }
    if offset > 0 {
        file.seek(SeekFrom::Start(offset))
            .map_err(|e| info(SysError::new("seek", path, e)))?;
    }
    let mut remaining = length.unwrap_or(u64::MAX);
    let mut buf = vec![0u8; CHUNK_BYTES];
    while remaining > 0 {
        let want = usize::try_from(remaining.min(CHUNK_BYTES as u64)).unwrap_or(CHUNK_BYTES);
        let n = match file.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(info(SysError::new("read", path, err))),
        };
        sender
            .send(&buf[..n])
            .map_err(|e| info(SysError::new("send", path, e)))?;
        remaining -= n as u64;
    }
    Ok(sender.bytes)
}

/// A tar archive of `path`: a directory's tree as `./...`, or one file by its name. Only
/// directories, regular files and symlinks (as links, never followed) go in; FIFOs, sockets
/// and device nodes are left out, as opening a FIFO blocks and a device can be read without
/// end (the protocol's `End` has no room to name them).
pub fn tar_download(path: &str, sender: &mut ChunkSender) -> Result<u64, ErrorInfo> {
    let p = check_path(path)?;
    let meta = fs::metadata(&p).map_err(|e| info(SysError::new("stat", path, e)))?;
    let mut writer = ChunkWriter {
        sender,
        buf: Vec::with_capacity(CHUNK_BYTES),
    };
    {
        let mut builder = tar::Builder::new(&mut writer);
        builder.follow_symlinks(false);
        let result = if meta.is_dir() {
            append_tree(&mut builder, &p)
        } else {
            let name = p
                .file_name()
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("file"));
            fs::symlink_metadata(&p)
                .and_then(|m| append_entry(&mut builder, &p, &name, m.file_type()))
        };
        result
            .and_then(|()| builder.finish())
            .map_err(|e| ErrorInfo {
                code: "io_error".into(),
                errno: e.raw_os_error(),
                message: format!("tar {path}: {e}"),
            })?;
    }
    writer
        .flush()
        .map_err(|e| info(SysError::new("send tar of", path, e)))?;
    Ok(writer.sender.bytes)
}

/// Appends the tree under `dir` (not `dir` itself) as `./...`, depth first.
fn append_tree<W: Write>(builder: &mut tar::Builder<W>, dir: &Path) -> io::Result<()> {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(parent) = stack.pop() {
        for entry in fs::read_dir(&parent)? {
            let entry = entry?;
            let path = entry.path();
            let name = Path::new(".").join(path.strip_prefix(dir).map_err(io::Error::other)?);
            let kind = entry.file_type()?;
            append_entry(builder, &path, &name, kind)?;
            if kind.is_dir() {
                stack.push(path);
            }
        }
    }
    Ok(())
}

/// Appends `path` as `name` if it is a directory (its entry alone), a regular file or a
/// symlink; anything else is skipped.
fn append_entry<W: Write>(
    builder: &mut tar::Builder<W>,
    path: &Path,
    name: &Path,
    kind: fs::FileType,
) -> io::Result<()> {
    if kind.is_dir() {
        builder.append_dir(name, path)
    } else if kind.is_symlink() {
        // Its target is read first: whatever stands there later goes in as this link.
        let target = fs::read_link(path)?;
        let mut header = tar::Header::new_gnu();
        header.set_metadata(&fs::symlink_metadata(path)?);
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        builder.append_link(&mut header, name, target)
    } else if kind.is_file() {
        // Non-blocking and not followed, then checked again: a file swapped for a FIFO since
        // it was listed is skipped, not waited on (for a symlink, the open fails).
        let mut file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)?;
        if file.metadata()?.is_file() {
            builder.append_file(name, &mut file)?;
        }
        Ok(())
    } else {
        Ok(())
    }
}

/// Client input to an upload.
#[derive(Debug)]
pub enum UploadInput {
    Data(Vec<u8>),
    End,
    Cancel,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A file being written; the temporary file is removed unless committed.
struct PendingWrite {
    path: PathBuf,
    temp: Option<PathBuf>,
    file: fs::File,
    bytes: u64,
    /// The user metadata that replaces the file's once written.
    metadata: Option<std::collections::BTreeMap<String, String>>,
}

/// Who a written file is given to: (uid, gid).
pub type Owner = (u32, u32);

/// Gives the open `file`, or else `path`, to `owner` (nothing without one).
fn give(owner: Option<Owner>, path: &str, file: Option<&fs::File>) -> Result<(), ErrorInfo> {
    let Some((uid, gid)) = owner else {
        return Ok(());
    };
    let done = match file {
        Some(file) => std::os::unix::fs::fchown(file, Some(uid), Some(gid)),
        None => std::os::unix::fs::chown(path, Some(uid), Some(gid)),
    };
    done.map_err(|e| info(SysError::new("chown", path, e)))
}

impl PendingWrite {
    fn begin(req: &WriteFileRequest, owner: Option<Owner>) -> Result<Self, ErrorInfo> {
        let path = check_path(&req.path)?;
        if let Some(metadata) = &req.metadata {
            crate::xattrs::check(metadata)?;
        }
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(ErrorInfo::bad_request(format!(
                "write: {} names no file",
                req.path
            )));
        };
        if req.make_parents {
            make_parents(parent, owner)?;
        }
        let existing = fs::metadata(&path).ok();
        if existing.as_ref().is_some_and(|m| m.is_dir()) {
            return Err(info(SysError::new(
                "write",
                &req.path,
                io::Error::from_raw_os_error(libc::EISDIR),
            )));
        }
        let mode = req
            .mode
            .or(existing.as_ref().map(|m| m.mode() & 0o7777))
            .unwrap_or(0o644);
        // envd's order for a file written in place: an existing file is given to the user
        // before it is opened, a new one once it is there.
        if !req.atomic && existing.is_some() {
            give(owner, &req.path, None)?;
        }
        let (file, temp) = if req.atomic {
            let temp = parent.join(format!(
                ".{}.rollbox-{}-{}.tmp",
                name.to_string_lossy(),
                std::process::id(),
                TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            let file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temp)
                // Named by the requested path: the temporary name means nothing to the client.
                .map_err(|e| info(SysError::new("open", &req.path, e)))?;
            (file, Some(temp))
        } else {
            let file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(mode)
                .open(&path)
                .map_err(|e| info(SysError::new("open", &req.path, e)))?;
            (file, None)
        };
        let pending = Self {
            path,
            temp,
            file,
            bytes: 0,
            metadata: req.metadata.clone(),
        };
        if pending.temp.is_some() {
            // Exact mode despite the umask; owner of the file being replaced.
            pending
                .file
                .set_permissions(fs::Permissions::from_mode(mode))
                .map_err(|e| info(SysError::new("chmod", &req.path, e)))?;
            if owner.is_some() {
                give(owner, &req.path, Some(&pending.file))?;
            } else if let Some(meta) = &existing {
                let _ =
                    std::os::unix::fs::fchown(&pending.file, Some(meta.uid()), Some(meta.gid()));
            }
        } else if existing.is_none() {
            give(owner, &req.path, Some(&pending.file))?;
        }
        Ok(pending)
    }

    fn write(&mut self, data: &[u8]) -> Result<(), ErrorInfo> {
        let target = self
            .temp
            .as_ref()
            .unwrap_or(&self.path)
            .display()
            .to_string();
        self.file
            .write_all(data)
            .map_err(|e| info(SysError::new("write", target, e)))?;
        self.bytes += data.len() as u64;
        Ok(())
    }

    fn commit(mut self) -> Result<u64, ErrorInfo> {
        let path_text = self.path.display().to_string();
        if let Some(metadata) = &self.metadata {
            crate::xattrs::replace(&self.file, &path_text, metadata)?;
        }
        self.file
            .sync_all()
            .map_err(|e| info(SysError::new("fsync", &path_text, e)))?;
        if let Some(temp) = self.temp.take() {
            if let Err(err) = fs::rename(&temp, &self.path) {
                let _ = fs::remove_file(&temp);
                return Err(info(SysError::new(
                    "rename",
                    format!("{} -> {path_text}", temp.display()),
                    err,
                )));
            }
            if let Some(parent) = self.path.parent() {
                // Make the rename durable; some file systems refuse fsync on a directory.
                if let Ok(dir) = fs::File::open(parent) {
                    let _ = dir.sync_all();
                }
            }
        }
        Ok(self.bytes)
    }
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        if let Some(temp) = &self.temp {
            let _ = fs::remove_file(temp);
        }
    }
}

/// Gives the directories a call just `created` to `owner`, when there is one.
fn give_created(created: &[&Path], owner: Option<Owner>) -> Result<(), ErrorInfo> {
    let Some((uid, gid)) = owner else {
        return Ok(());
    };
    for dir in created {
        std::os::unix::fs::lchown(dir, Some(uid), Some(gid))
            .map_err(|e| info(SysError::new("chown", dir.display().to_string(), e)))?;
    }
    Ok(())
}

/// Creates `dir` and its missing parents; those it creates go to `owner` when given.
fn make_parents(dir: &Path, owner: Option<Owner>) -> Result<(), ErrorInfo> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|d| fs::symlink_metadata(d).is_err())
        .collect();
    fs::create_dir_all(dir)
        .map_err(|e| info(SysError::new("mkdir", dir.display().to_string(), e)))?;
    give_created(&missing, owner)
}

/// `ready` sends the Ready reply; false means the client is gone.
/// `owner` is `req.owner` as looked up by the caller.
pub fn write_file(
    req: &WriteFileRequest,
    owner: Option<Owner>,
    rx: &mut mpsc::Receiver<UploadInput>,
    ready: impl FnOnce() -> bool,
) -> Result<u64, ErrorInfo> {
    let mut pending = PendingWrite::begin(req, owner)?;
    if !ready() {
        return Err(ErrorInfo::bad_request("connection closed"));
    }
    loop {
        match rx.blocking_recv() {
            Some(UploadInput::Data(data)) => pending.write(&data)?,
            Some(UploadInput::End) => return pending.commit(),
            Some(UploadInput::Cancel) => return Err(cancelled(&req.path)),
            None => {
                return Err(ErrorInfo::bad_request(
                    "connection closed during the upload",
                ))
            }
        }
    }
}

fn cancelled(path: &str) -> ErrorInfo {
    ErrorInfo {
        code: "cancelled".into(),
        errno: None,
        message: format!("upload to {path} cancelled; nothing was stored"),
    }
}

/// Reads upload chunks as one byte stream (for the tar unpacker).
struct UploadReader<'a> {
    rx: &'a mut mpsc::Receiver<UploadInput>,
    chunk: Vec<u8>,
    pos: usize,
    ended: bool,
    cancelled: bool,
    bytes: u64,
}

impl Read for UploadReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.chunk.len() {
            if self.ended {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(UploadInput::Data(data)) => {
                    self.bytes += data.len() as u64;
                    self.chunk = data;
                    self.pos = 0;
                }
                Some(UploadInput::End) => self.ended = true,
                Some(UploadInput::Cancel) => {
                    self.cancelled = true;
                    return Err(io::Error::other("upload cancelled by the client"));
                }
                None => return Err(io::Error::other("connection closed during the upload")),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.pos);
        buf[..n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

pub fn tar_upload(
    path: &str,
    rx: &mut mpsc::Receiver<UploadInput>,
    ready: impl FnOnce() -> bool,
) -> Result<u64, ErrorInfo> {
    let dest = check_path(path)?;
    fs::create_dir_all(&dest).map_err(|e| info(SysError::new("mkdir", path, e)))?;
    if !ready() {
        return Err(ErrorInfo::bad_request("connection closed"));
    }
    let mut reader = UploadReader {
        rx,
        chunk: Vec::new(),
        pos: 0,
        ended: false,
        cancelled: false,
        bytes: 0,
    };
    let result = {
        let mut archive = tar::Archive::new(&mut reader);
        archive.set_preserve_permissions(true);
        archive.set_overwrite(true);
        archive.set_unpack_xattrs(false);
        archive.unpack(&dest)
    };
    if reader.cancelled {
        return Err(cancelled(path));
    }
    if let Err(err) = result {
        return Err(ErrorInfo {
            code: "bad_archive".into(),
            errno: err.raw_os_error(),
            message: format!("unpack tar into {path}: {err}"),
        });
    }
    // The archive may end before the stream does (padding): read to End.
    io::copy(&mut reader, &mut io::sink())
        .map_err(|e| info(SysError::new("receive tar for", path, e)))?;
    Ok(reader.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_and_empty_paths_are_refused() {
        assert!(check_path("etc/passwd")
            .expect_err("relative")
            .message
            .contains("not absolute"));
        assert!(check_path("").is_err());
        assert!(check_path("/a\0b").is_err());
        assert!(check_path("/etc").is_ok());
    }

    #[test]
    fn missing_file_error_names_path_and_errno() {
        let err = stat("/nonexistent-rollbox/x", true).expect_err("missing");
        assert_eq!(
            err.message,
            "stat /nonexistent-rollbox/x: No such file or directory"
        );
        assert_eq!(err.code, "ENOENT");
    }

    #[test]
    fn atomic_write_leaves_no_temp_on_abort() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.txt");
        let req = WriteFileRequest::new(path.display().to_string());
        let mut pending = PendingWrite::begin(&req, None).expect("begin");
        pending.write(b"half").expect("write");
        drop(pending);
        assert_eq!(fs::read_dir(dir.path()).expect("readdir").count(), 0);

        let mut pending = PendingWrite::begin(&req, None).expect("begin");
        pending.write(b"whole").expect("write");
        assert_eq!(pending.commit().expect("commit"), 5);
        assert_eq!(fs::read(&path).expect("read"), b"whole");
        assert_eq!(fs::read_dir(dir.path()).expect("readdir").count(), 1);
    }

    #[test]
    fn mkdir_gives_what_it_creates_to_the_owner() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Our own ids, which any user may give.
        // SAFETY: getuid and getgid cannot fail.
        let me = unsafe { (libc::getuid(), libc::getgid()) };
        let deep = dir.path().join("x/y/z");
        mkdir(&deep.display().to_string(), true, None, Some(me)).expect("mkdir -p");
        for made in [dir.path().join("x"), dir.path().join("x/y"), deep.clone()] {
            let meta = fs::symlink_metadata(&made).expect("stat");
            assert_eq!((meta.uid(), meta.gid()), me, "{}", made.display());
        }
        mkdir(&deep.display().to_string(), true, None, Some(me)).expect("an existing dir is fine");
        let error = mkdir(
            &dir.path().join("a/b").display().to_string(),
            false,
            None,
            Some(me),
        )
        .expect_err("no parents without `parents`");
        assert_eq!(error.code, "ENOENT");
    }

    #[test]
    fn an_owner_gets_the_file_and_the_parents_the_write_made() {
        // chown needs root; elsewhere there is nothing to check.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a/b/f.txt");
        let mut req = WriteFileRequest::new(path.display().to_string());
        req.make_parents = true;
        let mut pending = PendingWrite::begin(&req, Some((4321, 4322))).expect("begin");
        pending.write(b"x").expect("write");
        pending.commit().expect("commit");
        for made in [dir.path().join("a"), dir.path().join("a/b"), path] {
            let meta = fs::symlink_metadata(&made).expect("stat");
            assert_eq!((meta.uid(), meta.gid()), (4321, 4322), "{}", made.display());
        }
        let top = fs::symlink_metadata(dir.path()).expect("stat");
        assert_eq!(top.uid(), 0, "an existing parent keeps its owner");
    }

    #[test]
    fn in_place_write_keeps_the_inode_and_replaces_metadata() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("g.txt");
        let mut req = WriteFileRequest::new(path.display().to_string());
        req.atomic = false;
        let write = |req: &WriteFileRequest, data: &[u8]| {
            let mut pending = PendingWrite::begin(req, None).expect("begin");
            pending.write(data).expect("write");
            pending.commit().expect("commit")
        };
        write(&req, b"first, longer");
        let inode = fs::metadata(&path).expect("stat").ino();
        write(&req, b"second");
        assert_eq!(fs::read(&path).expect("read"), b"second");
        // Given to an owner (here our own ids, which any user may give): before the open for
        // an existing file, after it for a new one.
        // SAFETY: getuid and getgid cannot fail.
        let me = unsafe { (libc::getuid(), libc::getgid()) };
        for name in ["g.txt", "owned-new.txt"] {
            let mut owned = WriteFileRequest::new(dir.path().join(name).display().to_string());
            owned.atomic = false;
            let mut pending = PendingWrite::begin(&owned, Some(me)).expect("begin owned");
            pending.write(b"second").expect("write");
            pending.commit().expect("commit");
            let meta = fs::metadata(dir.path().join(name)).expect("stat");
            assert_eq!((meta.uid(), meta.gid()), me);
        }
        fs::remove_file(dir.path().join("owned-new.txt")).expect("rm");
        assert_eq!(fs::metadata(&path).expect("stat").ino(), inode);
        assert_eq!(fs::read_dir(dir.path()).expect("readdir").count(), 1);

        let probe = fs::File::open(&path).expect("open");
        let one = std::collections::BTreeMap::from([("k".to_string(), "v".to_string())]);
        if crate::xattrs::replace(&probe, "probe", &one).is_err() {
            eprintln!(
                "skip metadata: {} has no user extended attributes",
                dir.path().display()
            );
            return;
        }
        req.metadata = Some(one.clone());
        write(&req, b"third");
        let info = stat(&path.display().to_string(), false).expect("stat");
        assert_eq!(info.metadata, one);
        // A write that says nothing keeps it; one with an empty map clears it.
        req.metadata = None;
        write(&req, b"fourth");
        assert_eq!(
            stat(&path.display().to_string(), false)
                .expect("stat")
                .metadata,
            one
        );
        req.metadata = Some(Default::default());
        write(&req, b"fifth");
        assert!(list(&dir.path().display().to_string()).expect("list")[0]
            .metadata
            .is_empty());
        req.metadata = Some(std::collections::BTreeMap::from([(
            String::new(),
            "v".to_string(),
        )]));
        let error = PendingWrite::begin(&req, None)
            .err()
            .expect("an empty key is refused");
        assert_eq!(error.code, "bad_request");
    }
}
