//! Where a build unpacks an image, kept away from the host: the staging directory is 0700, so
//! no other uid reaches the tree inside it, and the build runs on a thread of its own that
//! has a private mount namespace, in which the tree is bind-mounted onto itself `nosuid`,
//! `nodev` and `noexec` (the stage directory that holds it, and a split build's top disk
//! tree beside it). A set-id binary or a device node from the image is stored (the ext4
//! image keeps it) but cannot be used on the host, even by root, while the build runs. The
//! mount is seen only by the build thread (and `mkfs.ext4`, which it starts) and goes with
//! the thread, however the build ends.
//!
//! A thread, not a helper process: `unshare(CLONE_NEWNS)` is per thread (it also unshares the
//! thread's filesystem context), and the build's errors and progress stay in-process.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Runs `build` on a new thread that first leaves the host's mount namespace (its mounts are
/// made private, so nothing it mounts propagates back); `failed` turns the error into the
/// result when that cannot be done.
pub fn isolated<T: Send>(
    build: impl FnOnce() -> T + Send,
    failed: impl FnOnce(io::Error) -> T + Send,
) -> T {
    std::thread::scope(|scope| {
        let thread = scope.spawn(move || {
            // SAFETY: unshare has no memory arguments; CLONE_NEWNS affects only this thread
            // (the kernel unshares its filesystem context with it).
            let unshared = check(unsafe { libc::unshare(libc::CLONE_NEWNS) }).and_then(|()| {
                let root = c_path(Path::new("/"))?;
                // SAFETY: `root` is a valid NUL-terminated path; the null source, type and
                // data are allowed for a propagation change.
                check(unsafe {
                    libc::mount(
                        std::ptr::null(),
                        root.as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null(),
                    )
                })
            });
            match unshared {
                Ok(()) => build(),
                Err(e) => failed(e),
            }
        });
        match thread.join() {
            Ok(value) => value,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// The tree bind-mounted onto itself `nosuid,nodev,noexec` (in the calling thread's mount
/// namespace); unmounted when dropped.
pub struct LockedTree {
    path: PathBuf,
}

impl LockedTree {
    /// Mounts `tree`. Call from inside [`isolated`].
    pub fn mount(tree: &Path) -> io::Result<LockedTree> {
        let c = c_path(tree)?;
        // SAFETY: source and target are the same valid NUL-terminated path; type and data
        // may be null for a bind mount.
        check(unsafe {
            libc::mount(
                c.as_ptr(),
                c.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        })?;
        let locked = LockedTree {
            path: tree.to_path_buf(),
        };
        // SAFETY: as above; a remount of the bind mount changes only its flags.
        check(unsafe {
            libc::mount(
                std::ptr::null(),
                c.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT
                    | libc::MS_BIND
                    | libc::MS_NOSUID
                    | libc::MS_NODEV
                    | libc::MS_NOEXEC,
                std::ptr::null(),
            )
        })?;
        Ok(locked)
    }

    /// Unmounts now, reporting a failure (drop ignores it).
    pub fn unmount(mut self) -> io::Result<()> {
        let path = std::mem::take(&mut self.path);
        umount(&path)
    }
}

fn umount(path: &Path) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: `c` is a valid NUL-terminated path.
    check(unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) })
}

impl Drop for LockedTree {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = umount(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options of the mount at `path` in this thread's view, from mountinfo.
    fn mount_options(path: &Path) -> Option<String> {
        let info = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap();
        let target = path.to_str().unwrap();
        info.lines()
            .rfind(|line| line.split(' ').nth(4) == Some(target))
            .and_then(|line| line.split(' ').nth(5).map(str::to_string))
    }

    #[test]
    fn the_tree_is_nosuid_nodev_noexec_on_the_build_thread_only() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            let reason = "needs root (it mounts)";
            assert!(
                std::env::var_os("ROLLBOX_REQUIRE_ALL").is_none_or(|v| v != "1"),
                "the_tree_is_nosuid_nodev_noexec_on_the_build_thread_only could not run: {reason}"
            );
            eprintln!("SKIP the_tree_is_nosuid_nodev_noexec_on_the_build_thread_only: {reason}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir(&tree).unwrap();
        let seen = isolated(
            || {
                let locked = LockedTree::mount(&tree).unwrap();
                let inside = mount_options(&tree);
                // A device node (1:3, /dev/null) made in the tree cannot be opened.
                let node = tree.join("null");
                let c = c_path(&node).unwrap();
                // SAFETY: valid path; mknod keeps no pointer.
                let rc =
                    unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
                assert_eq!(rc, 0);
                let opened = std::fs::File::open(&node).map(|_| ());
                locked.unmount().unwrap();
                (inside, opened, mount_options(&tree))
            },
            |e| panic!("unshare: {e}"),
        );
        let options = seen.0.expect("the tree is a mount on the build thread");
        for flag in ["nosuid", "nodev", "noexec"] {
            assert!(options.split(',').any(|o| o == flag), "{options}");
        }
        assert_eq!(
            seen.1.unwrap_err().raw_os_error(),
            Some(libc::EACCES),
            "a device node in the tree opens"
        );
        assert_eq!(seen.2, None, "unmounted");
        assert_eq!(
            mount_options(&tree),
            None,
            "never seen by the host's namespace"
        );
    }
}
