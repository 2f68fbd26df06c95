//! The libc calls std has no wrapper for, none following a symlink at the path's end:
//! `utimensat`, `mknod` and `lsetxattr`.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub(super) fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

pub(super) fn set_times_nofollow(path: &Path, (secs, nanos): (i64, u32)) -> io::Result<()> {
    let time = (secs, i64::from(nanos));
    set_atime_mtime_nofollow(path, time, time)
}

/// Sets the access and modification times (seconds, nanoseconds) of `path` itself.
pub(super) fn set_atime_mtime_nofollow(
    path: &Path,
    atime: (i64, i64),
    mtime: (i64, i64),
) -> io::Result<()> {
    let c = c_path(path)?;
    let times = [atime, mtime].map(|(tv_sec, tv_nsec)| libc::timespec { tv_sec, tv_nsec });
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

pub(super) fn mknod(path: &Path, mode: u32, dev: libc::dev_t) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: `c` is a valid NUL-terminated path; mknod does not keep the pointer.
    let rc = unsafe { libc::mknod(c.as_ptr(), mode, dev) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets the extended attribute `name` of `path` (a symlink itself, not its target).
pub(super) fn lsetxattr(path: &Path, name: &[u8], value: &[u8]) -> io::Result<()> {
    let c = c_path(path)?;
    let name = CString::new(name).map_err(|_| {
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
}
