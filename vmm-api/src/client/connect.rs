//! Connecting to a VMM's API socket within a deadline. A Unix socket's `connect` blocks while
//! the listener's backlog is full (a VMM that stopped accepting), so `UnixStream::connect`
//! could wait forever; here the socket's send timeout (which Linux applies to that wait)
//! bounds it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// How a connect within a deadline failed.
#[derive(Debug)]
pub(super) enum ConnectError {
    /// The listener's backlog stayed full until the deadline.
    Deadline,
    /// Connecting failed (nothing listens, no such socket, a path too long, ...).
    Failed(io::Error),
}

/// Connects to the Unix socket `sock`, waiting for room in a full backlog until `deadline`
/// (None: no limit).
pub(super) fn connect_within(
    sock: &Path,
    deadline: Option<Instant>,
) -> Result<UnixStream, ConnectError> {
    let addr = socket_address(sock).map_err(ConnectError::Failed)?;
    // SAFETY: socket takes plain arguments; its result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(ConnectError::Failed(io::Error::last_os_error()));
    }
    // SAFETY: fd is a socket just created and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    loop {
        // What is left of the deadline, asked again after a signal interrupted the wait.
        let limit = match deadline {
            None => None,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ConnectError::Deadline);
                }
                Some(left)
            }
        };
        set_send_timeout(&fd, limit).map_err(ConnectError::Failed)?;
        // SAFETY: addr is a valid sockaddr_un and its size is passed with it; fd is open.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            set_send_timeout(&fd, None).map_err(ConnectError::Failed)?;
            return Ok(UnixStream::from(fd));
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            // The backlog stayed full for the whole send timeout.
            Some(libc::EAGAIN) => {
                if limit.is_none() {
                    continue;
                }
                return Err(ConnectError::Deadline);
            }
            _ => return Err(ConnectError::Failed(err)),
        }
    }
}

/// `sock` as a `sockaddr_un`, or why it cannot be one.
fn socket_address(sock: &Path) -> io::Result<libc::sockaddr_un> {
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid (empty) value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = sock.as_os_str().as_bytes();
    // One byte stays zero: the path's terminator.
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a Unix socket path must be 1 to {} bytes without NUL ({} bytes here)",
                addr.sun_path.len() - 1,
                bytes.len()
            ),
        ));
    }
    for (slot, byte) in addr.sun_path.iter_mut().zip(bytes) {
        *slot = *byte as libc::c_char;
    }
    Ok(addr)
}

/// Sets SO_SNDTIMEO (None: no timeout). A timeout that rounds to zero would mean none, so it
/// is at least a microsecond.
fn set_send_timeout(fd: &OwnedFd, limit: Option<Duration>) -> io::Result<()> {
    let tv = match limit {
        None => libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        Some(limit) => {
            let limit = limit.max(Duration::from_micros(1));
            libc::timeval {
                tv_sec: libc::time_t::try_from(limit.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_usec: libc::suseconds_t::from(limit.subsec_micros()),
            }
        }
    };
    // SAFETY: tv is a valid timeval and its size is passed with it; fd is open.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&raw const tv).cast::<libc::c_void>(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener with a backlog of 0 that never accepts: one connection fits, the next waits.
    fn full_listener(path: &Path) -> (OwnedFd, UnixStream) {
        let addr = socket_address(path).expect("address");
        // SAFETY: plain socket calls on a fresh fd, each result checked.
        let fd = unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let fd = OwnedFd::from_raw_fd(fd);
            let rc = libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            );
            assert_eq!(rc, 0, "bind: {}", io::Error::last_os_error());
            assert_eq!(libc::listen(fd.as_raw_fd(), 0), 0);
            fd
        };
        let first = UnixStream::connect(path).expect("the first connection fits the backlog");
        (fd, first)
    }

    #[test]
    fn a_full_backlog_ends_at_the_deadline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("api.sock");
        let (_listener, _first) = full_listener(&path);
        let started = Instant::now();
        let deadline = Some(started + Duration::from_millis(200));
        // Fill whatever room the kernel gives beyond the first, until one waits.
        let mut held = Vec::new();
        let outcome = loop {
            match connect_within(&path, deadline) {
                Ok(stream) => held.push(stream),
                Err(e) => break e,
            }
            assert!(held.len() < 64, "the backlog never filled");
        };
        assert!(matches!(outcome, ConnectError::Deadline), "{outcome:?}");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(150),
            "gave up early: {waited:?}"
        );
        assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    }

    #[test]
    fn a_client_call_to_a_full_backlog_names_the_wait() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("api.sock");
        let (_listener, _first) = full_listener(&path);
        let client = super::super::Client::new(&path).with_timeout(Duration::from_millis(200));
        // The first calls may still fit; they then wait for an answer that never comes.
        let err = (0..64)
            .map(|_| client.vm_info().expect_err("nothing answers"))
            .find(|e| e.to_string().contains("while connecting"))
            .expect("a connect that waited for the backlog");
        assert!(err.to_string().contains("api.sock"), "{err}");
    }

    #[test]
    fn nothing_listening_fails_at_once_and_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outcome = connect_within(&dir.path().join("none.sock"), None);
        match outcome {
            Err(ConnectError::Failed(e)) => assert_eq!(e.kind(), io::ErrorKind::NotFound),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_path_too_long_for_a_socket_is_named() {
        let long = Path::new("/tmp").join("x".repeat(200));
        match connect_within(&long, None) {
            Err(ConnectError::Failed(e)) => {
                assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
                assert!(e.to_string().contains("205 bytes here"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}
