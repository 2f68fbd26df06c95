//! A file's user metadata as `user.e2b.<key>` extended attributes: read with stat and list,
//! replaced by a write that carries metadata (E2B's `files.write(..., metadata=...)`).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::io::AsRawFd as _;
use std::path::Path;

use rollbox_agent_protocol::{
    ErrorInfo, METADATA_MAX_KEY, METADATA_MAX_VALUE as MAX_VALUE, METADATA_XATTR_PREFIX,
};

use crate::errors::SysError;

/// The `user.e2b.*` attributes of `path` itself (a symlink is not followed), prefix stripped.
/// A file system without extended attributes, or a file that went, has none.
pub fn read(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(c_path) = CString::new(path.as_os_str().as_bytes()) else {
        return out;
    };
    let names = list_names(|buf, len| {
        // SAFETY: c_path is NUL-terminated; buf is valid for len bytes (or null with len 0).
        unsafe { libc::llistxattr(c_path.as_ptr(), buf, len) }
    });
    for name in names.unwrap_or_default() {
        let Some(key) = name.strip_prefix(METADATA_XATTR_PREFIX) else {
            continue;
        };
        let Ok(c_name) = CString::new(name.as_bytes()) else {
            continue;
        };
        let mut value = vec![0u8; MAX_VALUE];
        // SAFETY: both strings are NUL-terminated; value is valid for its length.
        let got = unsafe {
            libc::lgetxattr(
                c_path.as_ptr(),
                c_name.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if let Ok(len) = usize::try_from(got) {
            value.truncate(len);
            out.insert(
                key.to_string(),
                String::from_utf8_lossy(&value).into_owned(),
            );
        }
    }
    out
}

/// The attribute names `list(buf, len)` (a listxattr call) answers.
fn list_names(list: impl Fn(*mut libc::c_char, usize) -> isize) -> io::Result<Vec<String>> {
    let size = list(std::ptr::null_mut(), 0);
    let size = usize::try_from(size).map_err(|_| io::Error::last_os_error())?;
    if size == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; size];
    let got = list(buf.as_mut_ptr().cast(), buf.len());
    let got = usize::try_from(got).map_err(|_| io::Error::last_os_error())?;
    buf.truncate(got);
    Ok(buf
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect())
}

/// Checks metadata before anything is written: keys non-empty, without NUL or `/`, short
/// enough for an attribute name; values without NUL and at most [`MAX_VALUE`] bytes.
pub fn check(metadata: &BTreeMap<String, String>) -> Result<(), ErrorInfo> {
    for (key, value) in metadata {
        if key.is_empty() || key.contains('\0') || key.contains('/') {
            return Err(ErrorInfo::bad_request(format!(
                "metadata key {key:?}: must be non-empty, without NUL or '/'"
            )));
        }
        if key.len() > METADATA_MAX_KEY {
            return Err(ErrorInfo::bad_request(format!(
                "metadata key {key:?}: longer than {METADATA_MAX_KEY} bytes"
            )));
        }
        if value.contains('\0') || value.len() > MAX_VALUE {
            return Err(ErrorInfo::bad_request(format!(
                "metadata value of {key:?}: must be at most {MAX_VALUE} bytes, without NUL"
            )));
        }
    }
    Ok(())
}

/// Replaces the `user.e2b.*` attributes of the open `file` (named `path` in errors) with
/// `metadata`. A file system without user extended attributes refuses a non-empty map.
pub fn replace(
    file: &fs::File,
    path: &str,
    metadata: &BTreeMap<String, String>,
) -> Result<(), ErrorInfo> {
    let fd = file.as_raw_fd();
    let fail = |op: &'static str, e: io::Error| {
        let unsupported = matches!(e.raw_os_error(), Some(libc::ENOTSUP));
        let mut info = SysError::new(op, path, e).to_info();
        if unsupported {
            info.message = format!(
                "{}: this file system does not support user extended attributes, where file metadata is kept",
                info.message
            );
        }
        info
    };
    let names = list_names(|buf, len| {
        // SAFETY: fd is open for the call; buf is valid for len bytes (or null with len 0).
        unsafe { libc::flistxattr(fd, buf, len) }
    });
    let names = match names {
        Ok(names) => names,
        // Nothing to clear where there can be nothing.
        Err(e) if metadata.is_empty() && e.raw_os_error() == Some(libc::ENOTSUP) => Vec::new(),
        Err(e) => return Err(fail("listxattr", e)),
    };
    for name in names {
        let stale = name
            .strip_prefix(METADATA_XATTR_PREFIX)
            .is_some_and(|key| !metadata.contains_key(key));
        if !stale {
            continue;
        }
        let c_name = CString::new(name.as_bytes()).map_err(|e| fail("removexattr", e.into()))?;
        // SAFETY: fd is open; c_name is NUL-terminated.
        if unsafe { libc::fremovexattr(fd, c_name.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(fail("removexattr", e));
            }
        }
    }
    for (key, value) in metadata {
        let name = format!("{METADATA_XATTR_PREFIX}{key}");
        let c_name = CString::new(name).map_err(|e| fail("setxattr", e.into()))?;
        // SAFETY: fd is open; c_name is NUL-terminated; value is valid for its length.
        let rc =
            unsafe { libc::fsetxattr(fd, c_name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        if rc != 0 {
            return Err(fail("setxattr", io::Error::last_os_error()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the file system of `dir` keeps user extended attributes.
    fn supported(dir: &Path) -> bool {
        let probe = dir.join("probe");
        let file = fs::File::create(&probe).expect("probe");
        let map = BTreeMap::from([("p".to_string(), "1".to_string())]);
        replace(&file, "probe", &map).is_ok()
    }

    #[test]
    fn metadata_is_replaced_and_read_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        if !supported(dir.path()) {
            let file = fs::File::create(dir.path().join("a")).expect("a");
            let map = BTreeMap::from([("k".to_string(), "v".to_string())]);
            let error = replace(&file, "a", &map).expect_err("no xattrs here");
            assert!(error.message.contains("extended attributes"), "{error:?}");
            eprintln!(
                "skip: {} has no user extended attributes",
                dir.path().display()
            );
            return;
        }
        let path = dir.path().join("a");
        let file = fs::File::create(&path).expect("a");
        let first = BTreeMap::from([
            ("owner".to_string(), "alice".to_string()),
            ("tag".to_string(), "one two".to_string()),
        ]);
        replace(&file, "a", &first).expect("set");
        assert_eq!(read(&path), first);
        let second = BTreeMap::from([("tag".to_string(), "three".to_string())]);
        replace(&file, "a", &second).expect("replace");
        assert_eq!(read(&path), second);
        replace(&file, "a", &BTreeMap::new()).expect("clear");
        assert!(read(&path).is_empty());
        assert!(read(&dir.path().join("missing")).is_empty());
    }

    #[test]
    fn bad_keys_and_values_are_named() {
        let long = "k".repeat(300);
        for (key, value) in [("", "v"), ("a/b", "v"), (long.as_str(), "v"), ("k", "\0")] {
            let map = BTreeMap::from([(key.to_string(), value.to_string())]);
            let error = check(&map).expect_err("refused");
            assert_eq!(error.code, "bad_request");
            assert!(error.message.contains("metadata"), "{error:?}");
        }
        let fine = BTreeMap::from([("content-type".to_string(), "text/plain".to_string())]);
        assert!(check(&fine).is_ok());
    }
}
