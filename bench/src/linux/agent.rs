//! Reaching the guest agent: over rollbox-vmm's vsock Unix socket (hybrid `CONNECT`
//! preamble) or AF_VSOCK (QEMU's vhost-vsock), with every step bounded, and one `hello`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::frame;
use rollbox_agent_protocol::{ClientFrame, ClientMessage, ServerFrame, ServerMessage};

/// The agent's log line once its vsock listener is bound (on the console: its stderr).
pub(crate) const AGENT_LISTENING: &str = "listening on vsock port";
pub(crate) const AGENT_PORT: u32 = rollbox_agent_protocol::DEFAULT_PORT;
/// rollbox-vmm's guest CID (its host side is a Unix socket, so any CID >= 3 does).
pub(crate) const ROLLBOX_CID: u32 = 3;
/// One connection attempt (connect, handshake, hello) at most.
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// `SO_VM_SOCKETS_CONNECT_TIMEOUT` (linux/vm_sockets.h; level AF_VSOCK, a `struct timeval`).
const SO_VM_SOCKETS_CONNECT_TIMEOUT: libc::c_int = 6;

/// Where the agent is reached.
#[derive(Debug, Clone)]
pub(crate) enum AgentAddr {
    /// rollbox-vmm's vsock Unix socket (hybrid `CONNECT <port>` preamble).
    Unix(PathBuf),
    /// AF_VSOCK to a guest CID (QEMU's vhost-vsock).
    Vsock(u32),
}

/// When the steps of one `hello` attempt succeeded.
#[derive(Debug, Default)]
pub(super) struct Attempt {
    /// The host side accepted the connection (rollbox-vmm's Unix socket, or AF_VSOCK connect).
    pub(super) connected: Option<Instant>,
    /// The guest's vsock answered the connection request.
    pub(super) guest_connected: Option<Instant>,
}

/// The successful `wait_hello`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HelloTimes {
    /// The first attempt whose host-side connect succeeded.
    pub(crate) first_connect: Instant,
    /// The guest answered the successful attempt's vsock connection request.
    pub(crate) guest_connected: Instant,
    /// The agent's hello answer arrived.
    pub(crate) answered: Instant,
}

/// One attempt: connect, send `hello`, read the agent's `hello`.
pub(super) fn hello_once(
    addr: &AgentAddr,
    timeout: Duration,
    attempt: &mut Attempt,
) -> Result<(), String> {
    let timeout = timeout.max(Duration::from_millis(10));
    match addr {
        AgentAddr::Unix(path) => {
            let mut stream = unix_connect(path, timeout)?;
            attempt.connected = Some(Instant::now());
            connect_agent_port(&mut stream)?;
            attempt.guest_connected = Some(Instant::now());
            hello_frames(&mut stream)
        }
        AgentAddr::Vsock(cid) => {
            let mut stream = vsock_connect(*cid, AGENT_PORT, timeout)?;
            attempt.connected = Some(Instant::now());
            attempt.guest_connected = attempt.connected;
            hello_frames(&mut stream)
        }
    }
}

/// rollbox-vmm's hybrid vsock preamble: `CONNECT <agent port>`, answered `OK <port>`.
pub(crate) fn connect_agent_port(stream: &mut UnixStream) -> Result<(), String> {
    stream
        .write_all(format!("CONNECT {AGENT_PORT}\n").as_bytes())
        .map_err(|e| format!("CONNECT: {e}"))?;
    let line = read_line(stream)?;
    if line.starts_with("OK ") {
        Ok(())
    } else {
        Err(format!("CONNECT {AGENT_PORT} answered {line:?}"))
    }
}

/// Bytes read up to a newline as text, without the line ending (the preamble's answer here,
/// console lines in vm.rs).
pub(super) fn clean_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .trim_end_matches(['\r', '\n'])
        .to_string()
}

/// The preamble's answer, byte by byte (nothing after the newline is consumed).
pub(crate) fn read_line<R: Read>(reader: &mut R) -> Result<String, String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 64 {
        match reader.read(&mut byte) {
            Ok(0) => return Err(format!("closed after {:?}", clean_line(&line))),
            Ok(_) if byte[0] == b'\n' => return Ok(clean_line(&line)),
            Ok(_) => line.push(byte[0]),
            Err(e) => return Err(format!("reading the CONNECT answer: {e}")),
        }
    }
    Err(format!("CONNECT answer too long: {:?}", clean_line(&line)))
}

fn hello_frames<S: Read + Write>(stream: &mut S) -> Result<(), String> {
    let request = ClientFrame {
        id: 1,
        body: ClientMessage::Hello,
    };
    let bytes = frame::encode(&request).map_err(|e| e.to_string())?;
    stream
        .write_all(&bytes)
        .map_err(|e| format!("sending hello: {e}"))?;
    let reply = read_frame(stream).map_err(|e| format!("the hello answer: {e}"))?;
    match reply.body {
        ServerMessage::Hello { .. } => Ok(()),
        other => Err(format!("the agent answered hello with {other:?}")),
    }
}

/// One length-prefixed frame from the agent.
pub(crate) fn read_frame<R: Read>(stream: &mut R) -> Result<ServerFrame, String> {
    let mut header = [0u8; 4];
    stream
        .read_exact(&mut header)
        .map_err(|e| format!("reading: {e}"))?;
    let len = u32::from_be_bytes(header) as usize;
    if len > rollbox_agent_protocol::MAX_FRAME_BYTES {
        return Err(format!("answer frame of {len} bytes"));
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| format!("reading: {e}"))?;
    frame::decode(&body).map_err(|e| e.to_string())
}

pub(crate) fn set_timeval(
    fd: &impl AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    t: Duration,
) -> Result<(), String> {
    let tv = libc::timeval {
        tv_sec: t.as_secs().try_into().unwrap_or(libc::time_t::MAX),
        tv_usec: t.subsec_micros().into(),
    };
    // SAFETY: `tv` lives across the call and the length given is its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "setsockopt({level}, {name}): {}",
            std::io::Error::last_os_error()
        ))
    }
}

/// A Unix stream socket connected to `path`, every step bounded by `timeout` (SO_SNDTIMEO also
/// bounds connect(2) on a listener whose backlog is full).
pub(crate) fn unix_connect(path: &Path, timeout: Duration) -> Result<UnixStream, String> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(format!("socket path {} is too long", path.display()));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    // SAFETY: socket(2) with constant arguments; the descriptor is owned just below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("unix socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, timeout)?;
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, timeout)?;
    // SAFETY: `addr` is a valid sockaddr_un and the length given is its size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(format!(
            "connect {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(UnixStream::from(fd))
}

/// A connected AF_VSOCK stream to `cid:port`.
pub(crate) fn vsock_connect(cid: u32, port: u32, timeout: Duration) -> Result<File, String> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned just below.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!(
            "AF_VSOCK socket: {} (is vhost_vsock loaded?)",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_timeval(&fd, libc::AF_VSOCK, SO_VM_SOCKETS_CONNECT_TIMEOUT, timeout)?;
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, timeout)?;
    set_timeval(&fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, timeout)?;
    // SAFETY: sockaddr_vm is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    // SAFETY: `addr` is a valid sockaddr_vm and the length given is its size.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(format!(
            "connect vsock {cid}:{port}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(File::from(fd))
}
