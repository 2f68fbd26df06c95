//! System errors as the protocol reports them: "<op> <path>: <strerror>",
//! with the errno name as the code.

use std::io;

use rollbox_agent_protocol::ErrorInfo;

/// A failed system call on a named input.
#[derive(Debug, thiserror::Error)]
#[error("{op} {target}: {}", describe(.source))]
pub struct SysError {
    pub op: &'static str,
    pub target: String,
    pub source: io::Error,
}

impl SysError {
    pub fn new(op: &'static str, target: impl Into<String>, source: io::Error) -> Self {
        Self {
            op,
            target: target.into(),
            source,
        }
    }

    pub fn to_info(&self) -> ErrorInfo {
        let errno = self.source.raw_os_error();
        ErrorInfo {
            code: errno.and_then(errno_name).unwrap_or("io_error").to_owned(),
            errno,
            message: self.to_string(),
        }
    }
}

/// strerror text without std's " (os error N)" suffix.
pub fn describe(err: &io::Error) -> String {
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_owned(),
        _ => text,
    }
}

/// Closure helper: `.map_err(sys("open", path))`.
pub fn sys<'a>(op: &'static str, target: &'a str) -> impl FnOnce(io::Error) -> SysError + 'a {
    move |source| SysError::new(op, target, source)
}

/// Symbolic names of the errno values a client may want to branch on.
pub fn errno_name(errno: i32) -> Option<&'static str> {
    Some(match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::ESRCH => "ESRCH",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::E2BIG => "E2BIG",
        libc::ENOEXEC => "ENOEXEC",
        libc::EBADF => "EBADF",
        libc::ECHILD => "ECHILD",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENFILE => "ENFILE",
        libc::EMFILE => "EMFILE",
        libc::ENOTTY => "ENOTTY",
        libc::ETXTBSY => "ETXTBSY",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::ESPIPE => "ESPIPE",
        libc::EROFS => "EROFS",
        libc::EMLINK => "EMLINK",
        libc::EPIPE => "EPIPE",
        libc::ERANGE => "ERANGE",
        libc::EOPNOTSUPP => "ENOTSUP",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::ENOSYS => "ENOSYS",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ELOOP => "ELOOP",
        libc::EDQUOT => "EDQUOT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        _ => return None,
    })
}

/// An error reply for anything that is not a system call failure.
pub fn internal(message: impl Into<String>) -> ErrorInfo {
    ErrorInfo {
        code: "internal".into(),
        errno: None,
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_op_path_and_errno_meaning() {
        let err = SysError::new("open", "/x/y", io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(err.to_string(), "open /x/y: No such file or directory");
        let info = err.to_info();
        assert_eq!(info.code, "ENOENT");
        assert_eq!(info.errno, Some(libc::ENOENT));
    }

    #[test]
    fn non_os_errors_keep_their_text() {
        let err = SysError::new("parse", "/etc/passwd", io::Error::other("bad line 3"));
        assert_eq!(err.to_string(), "parse /etc/passwd: bad line 3");
        assert_eq!(err.to_info().code, "io_error");
    }
}
