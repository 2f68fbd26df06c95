//! `watch`: inotify on a directory (and, recursively, on its subdirectories), reported as
//! `fs_events` frames until the client cancels or the directory is removed or moved away.
//!
//! The queue is the kernel's: events wait in the inotify descriptor until the agent sends
//! them, and the agent reads no more while the connection's reply queue is full. When the
//! kernel's queue (`fs.inotify.max_queued_events`) overflows it drops events and says so
//! (IN_Q_OVERFLOW), which the agent passes on as a `notice`.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;

use rollbox_agent_protocol::{
    ErrorInfo, FsEvent, FsEventKind, ServerFrame, ServerMessage, WatchRequest,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;

use crate::errors::SysError;

/// What the agent asks inotify for on every watched directory.
const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR
    | libc::IN_EXCL_UNLINK;
/// Size of `struct inotify_event` before its name.
const EVENT_HEADER: usize = 16;
/// One read takes at most this much (many events).
const READ_BYTES: usize = 64 << 10;

/// A watch that could not be set up or kept.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error("watch {0}: the inotify watch limit is reached (raise fs.inotify.max_user_watches)")]
    WatchLimit(String),
    #[error("watch {0}: the path has a NUL byte")]
    NulInPath(String),
    #[error("watch {path}: cannot watch a directory on a network file system ({kind}), where changes made elsewhere are not seen (allow network mounts to watch it anyway)")]
    NetworkMount { path: String, kind: &'static str },
}

impl WatchError {
    fn to_info(&self) -> ErrorInfo {
        match self {
            WatchError::Sys(err) => err.to_info(),
            WatchError::WatchLimit(_) => ErrorInfo {
                code: "ENOSPC".into(),
                errno: Some(libc::ENOSPC),
                message: self.to_string(),
            },
            WatchError::NulInPath(_) | WatchError::NetworkMount { .. } => {
                ErrorInfo::bad_request(self.to_string())
            }
        }
    }

    /// The directory was not there (any more) when its watch was added.
    fn is_vanished(&self) -> bool {
        matches!(self, WatchError::Sys(err) if matches!(err.source.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)))
    }
}

/// The watched directories: inotify's watch descriptor → the directory relative to the root
/// ("" for the root itself).
struct Watches {
    inotify: AsyncFd<OwnedFd>,
    root: String,
    recursive: bool,
    dirs: HashMap<i32, String>,
    root_wd: i32,
}

impl Watches {
    fn new(req: &WatchRequest) -> Result<Self, WatchError> {
        let root = req.path.trim_end_matches('/').to_string();
        let root = if root.is_empty() {
            "/".to_string()
        } else {
            root
        };
        if req.refuse_network_mounts {
            if let Some(kind) = network_fs(&root)? {
                return Err(WatchError::NetworkMount { path: root, kind });
            }
        }
        // SAFETY: inotify_init1 only makes a descriptor; the result is checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            let source = std::io::Error::last_os_error();
            return Err(SysError::new("inotify_init1 to watch", root, source).into());
        }
        // SAFETY: `fd` was just made and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the AsyncFd owns `fd`, which stays open, the same descriptor, until it drops.
        let inotify =
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(|err| {
                let source = std::io::Error::from(err);
                SysError::new("register the inotify descriptor of", &root, source)
            })?;
        let mut watches = Self {
            inotify,
            root: root.clone(),
            recursive: req.recursive,
            dirs: HashMap::new(),
            root_wd: -1,
        };
        watches.root_wd = watches.add(&root, String::new())?;
        if req.recursive {
            watches.add_subdirectories("")?;
        }
        Ok(watches)
    }

    fn full_path(&self, relative: &str) -> String {
        match (relative.is_empty(), self.root.as_str()) {
            (true, _) => self.root.clone(),
            (false, "/") => format!("/{relative}"),
            (false, root) => format!("{root}/{relative}"),
        }
    }

    fn add(&mut self, path: &str, relative: String) -> Result<i32, WatchError> {
        let c_path = CString::new(path).map_err(|_| WatchError::NulInPath(path.to_string()))?;
        // SAFETY: `c_path` is NUL-terminated and outlives the call.
        let wd = unsafe {
            libc::inotify_add_watch(self.inotify.get_ref().as_raw_fd(), c_path.as_ptr(), MASK)
        };
        if wd < 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::ENOSPC) {
                return Err(WatchError::WatchLimit(path.to_string()));
            }
            return Err(SysError::new("watch", path, source).into());
        }
        self.dirs.insert(wd, relative);
        Ok(wd)
    }

    /// Watches every directory under `relative` (not following symlinks). A directory that
    /// vanishes meanwhile is skipped.
    fn add_subdirectories(&mut self, relative: &str) -> Result<(), WatchError> {
        let mut pending = vec![relative.to_string()];
        while let Some(dir) = pending.pop() {
            let Ok(entries) = std::fs::read_dir(self.full_path(&dir)) else {
                continue;
            };
            for entry in entries.flatten() {
                if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let name = String::from_utf8_lossy(entry.file_name().as_bytes()).into_owned();
                let child = if dir.is_empty() {
                    name
                } else {
                    format!("{dir}/{name}")
                };
                match self.add(&self.full_path(&child), child.clone()) {
                    Ok(_) => pending.push(child),
                    Err(err) if err.is_vanished() => {}
                    Err(err) => return Err(err),
                }
            }
        }
        Ok(())
    }

    /// Stops watching `relative` and everything under it (it moved away).
    fn forget(&mut self, relative: &str) {
        let prefix = format!("{relative}/");
        let gone: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(_, dir)| *dir == relative || dir.starts_with(&prefix))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.dirs.remove(&wd);
            // SAFETY: removes a watch of a descriptor we own; no memory is touched.
            unsafe { libc::inotify_rm_watch(self.inotify.get_ref().as_raw_fd(), wd) };
        }
    }

    async fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let mut ready = self.inotify.readable().await?;
            let fd = self.inotify.get_ref().as_raw_fd();
            let result = ready.try_io(|_| {
                // SAFETY: reads at most `buf.len()` bytes into `buf` from a descriptor we own.
                let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
                usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
            });
            if let Ok(result) = result {
                return result;
            }
        }
    }
}

/// One raw inotify event.
#[derive(Debug, PartialEq, Eq)]
struct RawEvent {
    wd: i32,
    mask: u32,
    name: String,
}

/// The events in one read of an inotify descriptor.
fn parse(buf: &[u8]) -> Vec<RawEvent> {
    let mut events = Vec::new();
    let mut at = 0;
    while let Some(header) = buf.get(at..at + EVENT_HEADER) {
        let word = |i: usize| [header[i], header[i + 1], header[i + 2], header[i + 3]];
        let wd = i32::from_ne_bytes(word(0));
        let mask = u32::from_ne_bytes(word(4));
        let len = u32::from_ne_bytes(word(12)) as usize;
        let name_bytes = buf
            .get(at + EVENT_HEADER..at + EVENT_HEADER + len)
            .unwrap_or(&[]);
        let name_end = name_bytes
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(name_bytes.len());
        events.push(RawEvent {
            wd,
            mask,
            name: String::from_utf8_lossy(&name_bytes[..name_end]).into_owned(),
        });
        at += EVENT_HEADER + len;
    }
    events
}

/// The kind reported for an inotify mask, if any.
fn kind_of(mask: u32) -> Option<FsEventKind> {
    if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
        Some(FsEventKind::Create)
    } else if mask & libc::IN_MODIFY != 0 {
        Some(FsEventKind::Write)
    } else if mask & libc::IN_DELETE != 0 {
        Some(FsEventKind::Remove)
    } else if mask & libc::IN_MOVED_FROM != 0 {
        Some(FsEventKind::Rename)
    } else if mask & libc::IN_ATTRIB != 0 {
        Some(FsEventKind::Chmod)
    } else {
        None
    }
}

/// What one read amounted to.
struct Batch {
    events: Vec<FsEvent>,
    overflowed: bool,
    /// Why the watch is over, when the root went away.
    ended: Option<String>,
}

fn translate(watches: &mut Watches, raw: Vec<RawEvent>) -> Batch {
    let mut batch = Batch {
        events: Vec::new(),
        overflowed: false,
        ended: None,
    };
    for event in raw {
        if event.mask & libc::IN_Q_OVERFLOW != 0 {
            batch.overflowed = true;
            continue;
        }
        if event.wd == watches.root_wd {
            let gone = if event.mask & libc::IN_DELETE_SELF != 0 {
                Some("was removed")
            } else if event.mask & libc::IN_MOVE_SELF != 0 {
                Some("was moved away")
            } else if event.mask & libc::IN_IGNORED != 0 {
                Some("is gone (its file system was unmounted)")
            } else {
                None
            };
            if let Some(how) = gone {
                batch
                    .ended
                    .get_or_insert_with(|| format!("the watched directory {} {how}", watches.root));
                continue;
            }
        }
        if event.mask & libc::IN_IGNORED != 0 {
            watches.dirs.remove(&event.wd);
            continue;
        }
        let Some(dir) = watches.dirs.get(&event.wd) else {
            continue;
        };
        if event.name.is_empty() {
            // Self events of a subdirectory: its parent reports them by name.
            continue;
        }
        let name = if dir.is_empty() {
            event.name.clone()
        } else {
            format!("{dir}/{}", event.name)
        };
        let is_dir = event.mask & libc::IN_ISDIR != 0;
        if watches.recursive && is_dir {
            if event.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                let full = watches.full_path(&name);
                // A directory that is gone again by now has nothing left to watch.
                if watches.add(&full, name.clone()).is_ok() {
                    let _ = watches.add_subdirectories(&name);
                }
            } else if event.mask & libc::IN_MOVED_FROM != 0 {
                watches.forget(&name);
            }
        }
        if let Some(kind) = kind_of(event.mask) {
            batch.events.push(FsEvent { name, kind });
        }
    }
    batch
}

/// The network file system `path` is on, by statfs(2)'s magic number; None for a local one.
fn network_fs(path: &str) -> Result<Option<&'static str>, WatchError> {
    let c_path =
        std::ffi::CString::new(path).map_err(|_| WatchError::NulInPath(path.to_string()))?;
    // SAFETY: an all-zero statfs is a valid value for the kernel to fill.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is NUL-terminated; stat is a valid statfs to write.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        let source = std::io::Error::last_os_error();
        return Err(SysError::new("statfs", path, source).into());
    }
    // f_type is a long in glibc and an unsigned long in musl: a cast serves both.
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
    let magic = stat.f_type as i64;
    Ok(network_fs_kind(magic))
}

/// The network file systems E2B's envd refuses to watch by default, by statfs magic.
fn network_fs_kind(magic: i64) -> Option<&'static str> {
    Some(match magic {
        0x6969 => "NFS",
        0xFF53_4D42 => "CIFS",
        0xFE53_4D42 => "SMB2",
        0x517B => "SMB",
        0x6573_5546 => "FUSE",
        _ => return None,
    })
}

/// Runs a watch until `stop` yields (the client's `cancel`) or closes (the connection is
/// gone), or the directory goes. Returns the terminal reply.
pub async fn run(
    req: WatchRequest,
    id: u64,
    out: &mpsc::Sender<ServerFrame>,
    mut stop: mpsc::UnboundedReceiver<()>,
) -> ServerMessage {
    let mut watches = match Watches::new(&req) {
        Ok(watches) => watches,
        Err(err) => return ServerMessage::Error(err.to_info()),
    };
    let send = |body| out.send(ServerFrame { id, body });
    if send(ServerMessage::Watching).await.is_err() {
        return ServerMessage::WatchEnded {
            reason: "the connection closed".into(),
        };
    }
    let mut buf = vec![0u8; READ_BYTES];
    loop {
        let n = tokio::select! {
            stopped = stop.recv() => {
                let reason = match stopped {
                    Some(()) => "cancelled",
                    None => "the connection closed",
                };
                return ServerMessage::WatchEnded { reason: reason.into() };
            }
            read = watches.read(&mut buf) => match read {
                Ok(n) => n,
                Err(source) => {
                    return ServerMessage::Error(SysError::new("read the inotify events of", &watches.root, source).to_info());
                }
            },
        };
        let batch = translate(&mut watches, parse(&buf[..n]));
        if batch.overflowed {
            let message = format!(
                "watch {}: the kernel's inotify queue overflowed and events were lost (raise fs.inotify.max_queued_events, or read events faster)",
                watches.root
            );
            if send(ServerMessage::Notice { message }).await.is_err() {
                break;
            }
        }
        if !batch.events.is_empty()
            && send(ServerMessage::FsEvents {
                events: batch.events,
            })
            .await
            .is_err()
        {
            break;
        }
        if let Some(reason) = batch.ended {
            return ServerMessage::WatchEnded { reason };
        }
    }
    ServerMessage::WatchEnded {
        reason: "the connection closed".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    #[tokio::test]
    async fn network_file_systems_are_named_and_local_ones_are_not() {
        assert_eq!(network_fs_kind(0x6969), Some("NFS"));
        assert_eq!(network_fs_kind(0x6573_5546), Some("FUSE"));
        assert_eq!(network_fs_kind(0xEF53), None); // ext4
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().display().to_string();
        // This host's temp dir is local (tmpfs or a disk), so a refusing watch is made.
        if network_fs(&path).expect("statfs").is_none() {
            let req = WatchRequest {
                path,
                recursive: false,
                refuse_network_mounts: true,
            };
            assert!(Watches::new(&req).is_ok());
        }
        assert!(network_fs("/nonexistent-rollbox").is_err());
    }

    struct Running {
        frames: mpsc::Receiver<ServerFrame>,
        stop: mpsc::UnboundedSender<()>,
        task: tokio::task::JoinHandle<ServerMessage>,
    }

    async fn start(path: &Path, recursive: bool) -> Running {
        let (out, mut frames) = mpsc::channel(64);
        let (stop, stop_rx) = mpsc::unbounded_channel();
        let req = WatchRequest {
            path: path.display().to_string(),
            recursive,
            refuse_network_mounts: false,
        };
        let task = tokio::spawn(async move { run(req, 9, &out, stop_rx).await });
        let first = frames.recv().await.expect("a first frame");
        assert_eq!(first.body, ServerMessage::Watching);
        Running { frames, stop, task }
    }

    /// Events until `want` has been seen (or 5 s pass).
    async fn events_until(running: &mut Running, want: &FsEvent) -> Vec<FsEvent> {
        let mut seen = Vec::new();
        while !seen.contains(want) {
            let frame = tokio::time::timeout(Duration::from_secs(5), running.frames.recv())
                .await
                .unwrap_or_else(|_| panic!("no {want:?} within 5 s; saw {seen:?}"))
                .expect("the watch is still running");
            match frame.body {
                ServerMessage::FsEvents { events } => seen.extend(events),
                other => panic!("unexpected frame {other:?}"),
            }
        }
        seen
    }

    fn event(name: &str, kind: FsEventKind) -> FsEvent {
        FsEvent {
            name: name.into(),
            kind,
        }
    }

    #[test]
    fn inotify_records_parse() {
        let mut buf = Vec::new();
        for (wd, mask, name) in [
            (1, libc::IN_CREATE, &b"a.txt\0\0\0"[..]),
            (2, libc::IN_DELETE_SELF, b""),
        ] {
            buf.extend_from_slice(&i32::to_ne_bytes(wd));
            buf.extend_from_slice(&u32::to_ne_bytes(mask));
            buf.extend_from_slice(&u32::to_ne_bytes(0));
            buf.extend_from_slice(&u32::to_ne_bytes(name.len() as u32));
            buf.extend_from_slice(name);
        }
        assert_eq!(
            parse(&buf),
            vec![
                RawEvent {
                    wd: 1,
                    mask: libc::IN_CREATE,
                    name: "a.txt".into()
                },
                RawEvent {
                    wd: 2,
                    mask: libc::IN_DELETE_SELF,
                    name: String::new()
                },
            ]
        );
        assert_eq!(
            kind_of(libc::IN_MOVED_TO | libc::IN_ISDIR),
            Some(FsEventKind::Create)
        );
        assert_eq!(kind_of(libc::IN_ATTRIB), Some(FsEventKind::Chmod));
        assert_eq!(kind_of(libc::IN_IGNORED), None);
    }

    #[tokio::test]
    async fn create_write_chmod_rename_remove_are_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut running = start(dir.path(), false).await;
        let file = dir.path().join("f.txt");
        std::fs::write(&file, b"one").expect("write");
        events_until(&mut running, &event("f.txt", FsEventKind::Write)).await;
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
        events_until(&mut running, &event("f.txt", FsEventKind::Chmod)).await;
        std::fs::rename(&file, dir.path().join("g.txt")).expect("rename");
        let seen = events_until(&mut running, &event("g.txt", FsEventKind::Create)).await;
        assert!(
            seen.contains(&event("f.txt", FsEventKind::Rename)),
            "{seen:?}"
        );
        std::fs::remove_file(dir.path().join("g.txt")).expect("remove");
        events_until(&mut running, &event("g.txt", FsEventKind::Remove)).await;
        running.stop.send(()).expect("stop");
        let end = running.task.await.expect("the watch task");
        assert_eq!(
            end,
            ServerMessage::WatchEnded {
                reason: "cancelled".into()
            }
        );
    }

    #[tokio::test]
    async fn a_recursive_watch_follows_new_subdirectories_and_ends_with_its_directory() {
        let parent = tempfile::tempdir().expect("tempdir");
        let root = parent.path().join("root");
        std::fs::create_dir_all(root.join("old")).expect("mkdir");
        let mut running = start(&root, true).await;
        std::fs::write(root.join("old/a"), b"x").expect("write in an existing subdirectory");
        events_until(&mut running, &event("old/a", FsEventKind::Create)).await;
        std::fs::create_dir(root.join("new")).expect("mkdir new");
        events_until(&mut running, &event("new", FsEventKind::Create)).await;
        std::fs::write(root.join("new/b"), b"y").expect("write in a new subdirectory");
        events_until(&mut running, &event("new/b", FsEventKind::Write)).await;
        std::fs::remove_dir_all(&root).expect("remove the root");
        let end = loop {
            match tokio::time::timeout(Duration::from_secs(5), running.frames.recv()).await {
                Ok(Some(_)) => continue,
                Ok(None) => break running.task.await.expect("the watch task"),
                Err(_) => panic!("the watch did not end when its directory went"),
            }
        };
        assert_eq!(
            end,
            ServerMessage::WatchEnded {
                reason: format!("the watched directory {} was removed", root.display())
            }
        );
    }

    #[tokio::test]
    async fn an_overflowing_kernel_queue_is_reported_and_the_watch_goes_on() {
        let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .expect("read max_queued_events")
            .trim()
            .parse()
            .expect("a number");
        let dir = tempfile::tempdir().expect("tempdir");
        // Room for one frame: the watch blocks on its second, and events pile up in the kernel.
        let (out, mut frames) = mpsc::channel(1);
        let (stop, stop_rx) = mpsc::unbounded_channel();
        let req = WatchRequest {
            path: dir.path().display().to_string(),
            recursive: false,
            refuse_network_mounts: false,
        };
        let task = tokio::spawn(async move { run(req, 9, &out, stop_rx).await });
        assert_eq!(
            frames.recv().await.expect("watching").body,
            ServerMessage::Watching
        );
        for i in 0..limit + 100 {
            std::fs::File::create(dir.path().join(format!("f{i}"))).expect("create");
        }
        let notice = loop {
            let frame = tokio::time::timeout(Duration::from_secs(10), frames.recv())
                .await
                .expect("a frame within 10 s")
                .expect("the watch runs");
            if let ServerMessage::Notice { message } = frame.body {
                break message;
            }
        };
        assert!(
            notice.contains("overflowed and events were lost"),
            "{notice}"
        );
        // Still watching after the overflow.
        std::fs::write(dir.path().join("after"), b"x").expect("write");
        let want = event("after", FsEventKind::Write);
        let mut running = Running { frames, stop, task };
        events_until(&mut running, &want).await;
        running.stop.send(()).expect("stop");
        assert!(matches!(
            running.task.await.expect("task"),
            ServerMessage::WatchEnded { .. }
        ));
    }

    #[tokio::test]
    async fn watching_a_missing_or_plain_file_fails_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("plain");
        std::fs::write(&file, b"").expect("write");
        for (path, code) in [(dir.path().join("missing"), "ENOENT"), (file, "ENOTDIR")] {
            let (out, _frames) = mpsc::channel(4);
            let (_stop, stop_rx) = mpsc::unbounded_channel();
            let req = WatchRequest {
                path: path.display().to_string(),
                recursive: false,
                refuse_network_mounts: false,
            };
            match run(req, 1, &out, stop_rx).await {
                ServerMessage::Error(info) => {
                    assert_eq!(info.code, code, "{info:?}");
                    assert!(
                        info.message.contains(&path.display().to_string()),
                        "{info:?}"
                    );
                }
                other => panic!("watching {} answered {other:?}", path.display()),
            }
        }
    }
}
