//! Init duties when the agent is PID 1: mount the API file systems and set
//! a hostname. (Reaping is done by the reaper for every child.)

use std::ffi::CString;

use crate::errors::SysError;

/// An API file system and where it goes.
pub(crate) struct Mount {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: libc::c_ulong,
    data: &'static str,
}

const NOSUID_NODEV_NOEXEC: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

/// proc at /proc.
pub(crate) const PROC: Mount = Mount {
    source: "proc",
    target: "/proc",
    fstype: "proc",
    flags: NOSUID_NODEV_NOEXEC,
    data: "",
};

/// devtmpfs at /dev.
pub(crate) const DEV: Mount = Mount {
    source: "devtmpfs",
    target: "/dev",
    fstype: "devtmpfs",
    flags: libc::MS_NOSUID,
    data: "mode=0755",
};

const MOUNTS: &[Mount] = &[
    PROC,
    Mount {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
    DEV,
    Mount {
        source: "devpts",
        target: "/dev/pts",
        fstype: "devpts",
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        data: "mode=0620,ptmxmode=0666",
    },
    Mount {
        source: "shm",
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
    },
    Mount {
        source: "tmpfs",
        target: "/run",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=0755",
    },
    Mount {
        source: "tmpfs",
        target: "/tmp",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
    },
    Mount {
        source: "cgroup2",
        target: "/sys/fs/cgroup",
        fstype: "cgroup2",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
];

/// True when `target` is already a mount point (per /proc/self/mountinfo).
fn mounted(target: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|info| {
            info.lines()
                .any(|line| line.split(' ').nth(4) == Some(target))
        })
        .unwrap_or(false)
}

/// mount(2): `fstype` from `source` on `target`, with `data` as its options ("" for none).
pub(crate) fn mount_fs(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> std::io::Result<()> {
    let c = |s: &str| CString::new(s).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL));
    let (source, target, fstype, data) = (c(source)?, c(target)?, c(fstype)?, c(data)?);
    // SAFETY: all pointers are NUL-terminated strings that live across the call.
    let ret = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if ret != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Mounts `m` unless its target already is a mount point.
pub(crate) fn mount(m: &Mount) -> Result<(), SysError> {
    if mounted(m.target) {
        return Ok(());
    }
    let fail = |e| SysError::new("mount", m.target, e);
    std::fs::create_dir_all(m.target).map_err(fail)?;
    match mount_fs(m.source, m.target, m.fstype, m.flags, m.data) {
        Ok(()) => Ok(()),
        // Already mounted (e.g. by the kernel's devtmpfs automount): fine.
        Err(err) if err.raw_os_error() == Some(libc::EBUSY) => Ok(()),
        Err(err) => Err(fail(err)),
    }
}

/// Mount what a Linux userland expects, and name the host. Failures are
/// logged, not fatal: a partly set-up guest still serves requests.
pub fn init_system(hostname: &str) {
    for m in MOUNTS {
        if let Err(err) = mount(m) {
            log::warn!("{err}");
        }
    }
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(target, link);
    }
    let current = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let current = current.trim();
    if current.is_empty() || current == "(none)" || current == "localhost" {
        // SAFETY: pointer and length describe `hostname`'s bytes.
        if unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) } != 0 {
            log::warn!(
                "{}",
                SysError::new("sethostname", hostname, std::io::Error::last_os_error())
            );
        }
    }
}
