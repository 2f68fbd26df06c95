//! One connection of vsock's host side: its Unix stream, its state and the credit accounting
//! (what the guest may still take from us, what we forwarded); and the non-blocking connect
//! to `<uds_path>_<port>` a guest-initiated connection starts with.

use std::collections::VecDeque;
use std::io::{ErrorKind, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use super::packet::PacketHeader;

/// A connection key: (host port, guest port).
pub type ConnKey = (u32, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ConnState {
    /// Host connected and sent CONNECT; waiting for the guest's RESPONSE.
    AwaitingGuest,
    /// Data flows.
    Established,
    /// We sent SHUTDOWN to the guest; waiting for its RST.
    Closing,
}

/// One connection: its host stream, its state and both directions' credit counters.
pub(super) struct Conn {
    pub(super) stream: UnixStream,
    pub(super) state: ConnState,
    pub(super) peer_buf_alloc: u32,
    pub(super) peer_fwd_cnt: Wrapping<u32>,
    pub(super) tx_cnt: Wrapping<u32>,
    pub(super) fwd_cnt: Wrapping<u32>,
    pub(super) last_fwd_cnt_sent: Wrapping<u32>,
    pub(super) to_host: VecDeque<u8>,
    pub(super) readable: bool,
    pub(super) host_eof: bool,
    pub(super) token: u64,
    /// Control packets that found the queue full, in order; sent before any more data.
    pub(super) deferred: Vec<PacketHeader>,
    /// When it was set up: an [`ConnState::AwaitingGuest`] one waits for the guest's
    /// RESPONSE from then on, for at most the muxer's pending timeout.
    pub(super) since: Instant,
}

impl Conn {
    pub(super) fn new(stream: UnixStream, state: ConnState, token: u64) -> Self {
        Self {
            stream,
            state,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            tx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            to_host: VecDeque::new(),
            readable: false,
            host_eof: false,
            token,
            deferred: Vec::new(),
            since: Instant::now(),
        }
    }

    /// Bytes the guest can still take from us.
    pub(super) fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Writes what the guest sent to the host stream, as far as it takes it, counting
    /// what is forwarded.
    pub(super) fn flush_to_host(&mut self) -> std::io::Result<()> {
        while !self.to_host.is_empty() {
            let (front, _) = self.to_host.as_slices();
            match self.stream.write(front) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.to_host.drain(..n);
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Connects to the Unix socket `path` without blocking: a listener whose backlog is full
/// answers `WouldBlock` at once instead of stalling the event loop.
pub(super) fn connect_nonblocking(path: &Path) -> std::io::Result<UnixStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: an all-zero sockaddr_un is a valid (empty) address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::new(
            ErrorKind::InvalidInput,
            format!(
                "socket path is longer than {} bytes",
                addr.sun_path.len() - 1
            ),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid sockaddr_un whose first `len` bytes hold the family and the
    // NUL-terminated path.
    let rc = unsafe {
        libc::connect(
            fd,
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(UnixStream::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(buf_alloc: u32) -> Conn {
        let (a, _b) = UnixStream::pair().expect("pair");
        let mut c = Conn::new(a, ConnState::Established, 1);
        c.peer_buf_alloc = buf_alloc;
        c
    }

    #[test]
    fn peer_credit_is_buffer_less_bytes_in_flight_across_wraparound() {
        let mut c = conn(1000);
        assert_eq!(c.peer_credit(), 1000);
        c.tx_cnt = Wrapping(u32::MAX - 99);
        c.peer_fwd_cnt = Wrapping(u32::MAX - 399);
        assert_eq!(c.peer_credit(), 700, "300 bytes in flight");
        c.tx_cnt += Wrapping(500);
        assert_eq!(c.peer_credit(), 200, "800 in flight, counters wrapped");
        c.peer_fwd_cnt = c.tx_cnt;
        assert_eq!(c.peer_credit(), 1000);
        // A guest that shrinks its buffer below what is in flight gets no credit, not a wrap.
        c.tx_cnt += Wrapping(900);
        c.peer_buf_alloc = 100;
        assert_eq!(c.peer_credit(), 0);
    }
}
