//! Pseudo-terminals for `exec` with `pty`: open a master/slave pair of a given size, read and
//! write the master without blocking the runtime, and resize it.

use std::ffi::CStr;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};

use rollbox_agent_protocol::PtySize;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// A step of setting up or using a terminal that failed.
#[derive(Debug, thiserror::Error)]
pub enum PtyError {
    #[error("pty: {step}: {source}")]
    Sys {
        step: &'static str,
        source: std::io::Error,
    },
    #[error("pty: size {rows}x{cols}: rows and cols must both be at least 1")]
    EmptySize { rows: u16, cols: u16 },
}

fn sys(step: &'static str) -> PtyError {
    PtyError::Sys {
        step,
        source: std::io::Error::last_os_error(),
    }
}

/// A new terminal: the master (non-blocking, for the agent) and the slave (for the process).
pub fn open(size: PtySize) -> Result<(OwnedFd, OwnedFd), PtyError> {
    check_size(size)?;
    // SAFETY: posix_openpt only opens /dev/ptmx; the result is checked below.
    let master = unsafe {
        libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK)
    };
    if master < 0 {
        return Err(sys("open /dev/ptmx"));
    }
    // SAFETY: `master` is a descriptor we just opened and own alone.
    let master = unsafe { OwnedFd::from_raw_fd(master) };
    // SAFETY: unlockpt is an ioctl on a descriptor we own.
    if unsafe { libc::unlockpt(master.as_raw_fd()) } != 0 {
        return Err(sys("unlockpt"));
    }
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: ptsname_r writes at most `name.len()` bytes, NUL included, into `name`.
    if unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) } != 0 {
        return Err(sys("ptsname_r"));
    }
    // SAFETY: on success ptsname_r left a NUL-terminated string in `name`.
    let path = unsafe { CStr::from_ptr(name.as_ptr()) };
    // SAFETY: `path` is NUL-terminated; open has no other memory effects.
    let slave = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if slave < 0 {
        return Err(sys("open the terminal's slave"));
    }
    // SAFETY: `slave` is a descriptor we just opened and own alone.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    resize(master.as_raw_fd(), size)?;
    Ok((master, slave))
}

fn check_size(size: PtySize) -> Result<(), PtyError> {
    if size.rows == 0 || size.cols == 0 {
        return Err(PtyError::EmptySize {
            rows: size.rows,
            cols: size.cols,
        });
    }
    Ok(())
}

/// Set the terminal's size (the foreground process group gets SIGWINCH).
pub fn resize(fd: RawFd, size: PtySize) -> Result<(), PtyError> {
    check_size(size)?;
    let winsize = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the pointer, which is valid for the call.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &winsize) } != 0 {
        return Err(sys("TIOCSWINSZ"));
    }
    Ok(())
}

/// The terminal's current size.
#[cfg(test)]
fn size(fd: RawFd) -> Result<PtySize, PtyError> {
    let mut winsize = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` through the pointer, which is valid for the call.
    if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut winsize) } != 0 {
        return Err(sys("TIOCGWINSZ"));
    }
    Ok(PtySize {
        rows: winsize.ws_row,
        cols: winsize.ws_col,
    })
}

/// Makes the terminal on stdin the caller's controlling terminal. For the child between fork
/// and exec, after setsid: only an ioctl, async-signal-safe.
pub fn take_controlling_terminal() -> std::io::Result<()> {
    // SAFETY: TIOCSCTTY takes an integer argument and touches no memory of ours.
    if unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The agent's end of a terminal, shared by the output reader and the input writer.
pub struct Master(AsyncFd<OwnedFd>);

impl Master {
    pub fn new(fd: OwnedFd) -> std::io::Result<Self> {
        // SAFETY: the AsyncFd owns `fd`, which stays open, the same descriptor, until it drops.
        let fd = unsafe {
            AsyncFd::register_with_interest(fd, Interest::READABLE | Interest::WRITABLE)
        }?;
        Ok(Self(fd))
    }

    pub fn raw_fd(&self) -> RawFd {
        self.0.get_ref().as_raw_fd()
    }

    /// Output of the terminal; `Ok(0)` once no process holds the slave open any more (the
    /// kernel answers EIO then).
    pub async fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let mut ready = self.0.readable().await?;
            let fd = self.raw_fd();
            let result = ready.try_io(|_| {
                // SAFETY: reads at most `buf.len()` bytes into `buf` from a descriptor we own.
                let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
                usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
            });
            match result {
                Ok(Err(err)) if err.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(result) => return result,
                Err(_would_block) => continue,
            }
        }
    }

    /// Types all of `data` into the terminal.
    pub async fn write_all(&self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            let mut ready = self.0.writable().await?;
            let fd = self.raw_fd();
            let result = ready.try_io(|_| {
                // SAFETY: writes at most `data.len()` bytes from `data` to a descriptor we own.
                let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
                usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
            });
            match result {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(err)) => return Err(err),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_terminal_has_the_asked_size_and_resizes() {
        let (master, slave) = open(PtySize { rows: 24, cols: 80 }).expect("open a pty");
        assert_eq!(
            size(slave.as_raw_fd()).expect("size"),
            PtySize { rows: 24, cols: 80 }
        );
        resize(
            master.as_raw_fd(),
            PtySize {
                rows: 50,
                cols: 132,
            },
        )
        .expect("resize");
        assert_eq!(
            size(slave.as_raw_fd()).expect("size"),
            PtySize {
                rows: 50,
                cols: 132
            }
        );
    }

    #[test]
    fn an_empty_size_is_refused_by_name() {
        let err = open(PtySize { rows: 0, cols: 80 }).expect_err("0 rows");
        assert_eq!(
            err.to_string(),
            "pty: size 0x80: rows and cols must both be at least 1"
        );
    }

    #[tokio::test]
    async fn bytes_written_to_the_slave_come_out_of_the_master() {
        let (master, slave) = open(PtySize { rows: 24, cols: 80 }).expect("open a pty");
        let master = Master::new(master).expect("register the master");
        let mut file = std::fs::File::from(slave);
        std::io::Write::write_all(&mut file, b"hello\n").expect("write the slave");
        let mut buf = [0u8; 64];
        let n = master.read(&mut buf).await.expect("read");
        // The line discipline turns "\n" into "\r\n".
        assert_eq!(&buf[..n], b"hello\r\n");
        drop(file);
        assert_eq!(master.read(&mut buf).await.expect("read after close"), 0);
    }
}
