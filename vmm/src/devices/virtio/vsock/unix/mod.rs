//! The host side of vsock: a Unix listener for host-initiated connections, Unix streams to
//! `<uds_path>_<port>` for guest-initiated ones, and the packets between them and the guest.
//! A host connection that has not sent its `CONNECT <port>` line, or whose guest port has not
//! answered, is closed after [`PENDING_TIMEOUT`] (a timer in the muxer's epoll set). One
//! connection and its credit accounting are `conn.rs`.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::num::Wrapping;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::conn::{connect_nonblocking, Conn, ConnKey, ConnState};
use super::packet::{op, PacketHeader, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM};

/// The host's CID.
pub const HOST_CID: u64 = 2;
/// Receive buffer we advertise per connection.
pub const BUF_ALLOC: u32 = 256 * 1024;
/// Longest `CONNECT <port>\n` line we accept.
const MAX_PREAMBLE: usize = 32;
/// First host port handed to host-initiated connections.
const FIRST_LOCAL_PORT: u32 = 1 << 30;
/// Most connections (established, or waiting for CONNECT) at once: each holds a host fd.
/// Firecracker's limit.
pub const MAX_CONNECTIONS: usize = 1023;
/// Most control packets queued for the guest: they wait for RX buffers the guest may never
/// give. Firecracker's limit.
pub const MAX_CONTROL: usize = 256;
/// Most control packets one connection keeps while the queue is full (a request or response,
/// a credit update, a shutdown); a connection that needs more is reset.
const MAX_DEFERRED: usize = 4;

/// How long a host connection may take to send its `CONNECT <port>` line, and how long the
/// guest may take to answer it. Firecracker's limit.
pub const PENDING_TIMEOUT: Duration = Duration::from_secs(2);

const TOKEN_LISTENER: u64 = u64::MAX;
const TOKEN_TIMER: u64 = u64::MAX - 1;
const TOKEN_PENDING_BIT: u64 = 1 << 63;

struct PendingAccept {
    stream: UnixStream,
    line: Vec<u8>,
    since: Instant,
}

/// Errors from setting up the host side.
#[derive(Debug, thiserror::Error)]
pub enum UnixError {
    /// The socket path is taken.
    #[error("vsock uds_path {0} already exists (in use, or left over: remove it)")]
    PathInUse(PathBuf),
    /// The timer of pending connections could not be set up.
    #[error("vsock uds_path {path}: the timer of pending connections: {source}")]
    Timer {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Binding or configuring the listener failed.
    #[error("vsock uds_path {path}: {source}")]
    Listen {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The host side of the vsock device.
pub struct UnixMuxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    pending: HashMap<u64, PendingAccept>,
    next_pending: u64,
    conns: HashMap<ConnKey, Conn>,
    tokens: HashMap<u64, ConnKey>,
    next_token: u64,
    next_local_port: u32,
    control: VecDeque<PacketHeader>,
    max_conns: usize,
    /// Control packets dropped because the queue was full.
    dropped_control: u64,
    /// Connections refused because [`MAX_CONNECTIONS`] were open.
    refused_conns: u64,
    /// Fires when the oldest pending connection's time is up (non-blocking).
    timer: TimerFd,
    /// When `timer` fires, if armed.
    timer_at: Option<Instant>,
    /// [`PENDING_TIMEOUT`] (shorter in tests).
    pending_timeout: Duration,
    /// Host connections closed because the line or the guest's answer did not come in time.
    timed_out_conns: u64,
}

fn epoll_add(epoll: &Epoll, fd: RawFd, events: EventSet, token: u64) -> std::io::Result<()> {
    epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
}

fn epoll_del(epoll: &Epoll, fd: RawFd) {
    if let Err(e) = epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default()) {
        log::debug!("vsock: epoll delete of fd {fd}: {e}");
    }
}

impl UnixMuxer {
    /// Binds `uds_path`; fails if it exists.
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, UnixError> {
        if uds_path.symlink_metadata().is_ok() {
            return Err(UnixError::PathInUse(uds_path.to_path_buf()));
        }
        let listen_err = |source| UnixError::Listen {
            path: uds_path.to_path_buf(),
            source,
        };
        let listener = UnixListener::bind(uds_path).map_err(listen_err)?;
        let cleanup = |e| {
            let _ = std::fs::remove_file(uds_path);
            listen_err(e)
        };
        listener.set_nonblocking(true).map_err(cleanup)?;
        let epoll = Epoll::new().map_err(cleanup)?;
        epoll_add(&epoll, listener.as_raw_fd(), EventSet::IN, TOKEN_LISTENER).map_err(cleanup)?;
        let timer = TimerFd::new()
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
            .and_then(|timer| {
                set_nonblocking(timer.as_raw_fd())?;
                epoll_add(&epoll, timer.as_raw_fd(), EventSet::IN, TOKEN_TIMER)?;
                Ok(timer)
            })
            .map_err(|source| {
                let _ = std::fs::remove_file(uds_path);
                UnixError::Timer {
                    path: uds_path.to_path_buf(),
                    source,
                }
            })?;
        Ok(Self {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener,
            epoll,
            pending: HashMap::new(),
            next_pending: 0,
            conns: HashMap::new(),
            tokens: HashMap::new(),
            next_token: 1,
            next_local_port: FIRST_LOCAL_PORT,
            control: VecDeque::new(),
            max_conns: MAX_CONNECTIONS,
            dropped_control: 0,
            refused_conns: 0,
            timer,
            timer_at: None,
            pending_timeout: PENDING_TIMEOUT,
            timed_out_conns: 0,
        })
    }

    /// Host connections closed because they sent no `CONNECT` line, or the guest did not
    /// answer it, within [`PENDING_TIMEOUT`].
    pub fn timed_out_conns(&self) -> u64 {
        self.timed_out_conns
    }

    /// Control packets dropped because the guest gave no RX buffers for them.
    pub fn dropped_control(&self) -> u64 {
        self.dropped_control
    }

    /// Connections refused because too many were open.
    pub fn refused_conns(&self) -> u64 {
        self.refused_conns
    }

    fn at_connection_limit(&self) -> bool {
        self.conns.len() + self.pending.len() >= self.max_conns
    }

    /// The host-side socket path.
    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// The epoll fd the VMM watches.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Drops every connection (device reset, snapshot restore). Listening stays.
    pub fn reset(&mut self) {
        for (_, conn) in self.conns.drain() {
            epoll_del(&self.epoll, conn.stream.as_raw_fd());
        }
        for (_, p) in self.pending.drain() {
            epoll_del(&self.epoll, p.stream.as_raw_fd());
        }
        self.tokens.clear();
        self.control.clear();
    }

    fn header(&self, key: ConnKey, op: u16) -> PacketHeader {
        PacketHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.0,
            dst_port: key.1,
            type_: TYPE_STREAM,
            op,
            buf_alloc: BUF_ALLOC,
            ..Default::default()
        }
    }

    fn push_control(&mut self, key: ConnKey, op: u16, flags: u32) {
        let queued = |h: &PacketHeader| h.op == op && (h.src_port, h.dst_port) == key;
        if op == op::CREDIT_UPDATE && self.control.iter().any(queued) {
            return;
        }
        let mut h = self.header(key, op);
        h.flags = flags;
        self.enqueue(h);
    }

    /// Refuses a guest packet for a connection we don't know.
    fn push_rst_for(&mut self, guest: &PacketHeader) {
        let mut h = self.header((guest.dst_port, guest.src_port), op::RST);
        h.dst_cid = guest.src_cid;
        self.enqueue(h);
    }

    /// Queues a control packet. When [`MAX_CONTROL`] wait already, a live connection keeps
    /// its packet until there is room (as Firecracker rebuilds its queue from connection
    /// state); any other packet (a reset for an unknown connection) is dropped and counted.
    fn enqueue(&mut self, h: PacketHeader) {
        let full = self.control.len() >= MAX_CONTROL;
        let key = (h.src_port, h.dst_port);
        match self.conns.get_mut(&key) {
            Some(conn) if full || !conn.deferred.is_empty() => {
                let coalesced = h.op == op::CREDIT_UPDATE
                    && conn.deferred.iter().any(|d| d.op == op::CREDIT_UPDATE);
                if coalesced {
                    return;
                }
                if conn.deferred.len() < MAX_DEFERRED {
                    conn.deferred.push(h);
                    return;
                }
            }
            _ if !full => {
                self.control.push_back(h);
                return;
            }
            _ => {}
        }
        self.dropped_control += 1;
        log::warn!(
            "vsock: guest gives no RX buffers: {} control packets wait; dropped op {} for ports {}->{} ({} dropped so far)",
            self.control.len(),
            h.op,
            h.src_port,
            h.dst_port,
            self.dropped_control
        );
        self.remove_conn((h.src_port, h.dst_port));
    }

    fn remove_conn(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.remove(&key) {
            epoll_del(&self.epoll, conn.stream.as_raw_fd());
            self.tokens.remove(&conn.token);
        }
    }

    fn add_conn(
        &mut self,
        key: ConnKey,
        stream: UnixStream,
        state: ConnState,
    ) -> std::io::Result<()> {
        stream.set_nonblocking(true)?;
        let token = self.next_token;
        self.next_token += 1;
        epoll_add(
            &self.epoll,
            stream.as_raw_fd(),
            EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED,
            token,
        )?;
        let mut conn = Conn::new(stream, state, token);
        conn.readable = true;
        self.conns.insert(key, conn);
        self.tokens.insert(token, key);
        Ok(())
    }

    fn alloc_local_port(&mut self, guest_port: u32) -> u32 {
        loop {
            let port = self.next_local_port;
            self.next_local_port = self
                .next_local_port
                .checked_add(1)
                .unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.contains_key(&(port, guest_port)) {
                return port;
            }
        }
    }

    /// Serves host-side socket events. Returns true if RX work may be pending.
    pub fn process_events(&mut self) -> bool {
        let mut events = [EpollEvent::default(); 32];
        let n = match self.epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) => {
                log::warn!("vsock: epoll_wait: {e}");
                return false;
            }
        };
        for event in &events[..n] {
            match event.data() {
                TOKEN_LISTENER => self.accept_all(),
                TOKEN_TIMER => {
                    // Non-blocking: a re-arm since the event may have cleared the count.
                    let _ = self.timer.wait();
                    self.timer_at = None;
                }
                token if token & TOKEN_PENDING_BIT != 0 => self.read_preamble(token),
                token => {
                    let Some(&key) = self.tokens.get(&token) else {
                        continue;
                    };
                    let set = event.event_set();
                    if set.contains(EventSet::OUT) {
                        self.flush_conn(key);
                    }
                    if let Some(conn) = self.conns.get_mut(&key) {
                        if set.intersects(EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP)
                        {
                            conn.readable = true;
                        }
                    }
                }
            }
        }
        self.expire_pending(Instant::now());
        self.arm_timer();
        true
    }

    /// Closes the host connections whose `CONNECT` line, or the guest's answer to it, has
    /// not come within the pending timeout; the guest gets a reset for the latter.
    fn expire_pending(&mut self, now: Instant) {
        let timeout = self.pending_timeout;
        let late = |since: Instant| now.saturating_duration_since(since) >= timeout;
        let silent: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| late(p.since))
            .map(|(token, _)| *token)
            .collect();
        for token in silent {
            self.timed_out_conns += 1;
            self.drop_pending(token, "no CONNECT line within the pending timeout");
        }
        let unanswered: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| c.state == ConnState::AwaitingGuest && late(c.since))
            .map(|(key, _)| *key)
            .collect();
        for key in unanswered {
            self.timed_out_conns += 1;
            log::debug!(
                "vsock: guest port {} did not answer a host CONNECT within {timeout:?}; closed",
                key.1
            );
            self.remove_conn(key);
            self.push_control(key, op::RST, 0);
        }
    }

    /// Arms the timer for the oldest pending connection (disarms it when there is none).
    fn arm_timer(&mut self) {
        let oldest = self
            .pending
            .values()
            .map(|p| p.since)
            .chain(
                self.conns
                    .values()
                    .filter(|c| c.state == ConnState::AwaitingGuest)
                    .map(|c| c.since),
            )
            .min();
        let due = oldest.map(|since| since + self.pending_timeout);
        if due == self.timer_at {
            return;
        }
        let armed = match due {
            Some(at) => {
                // A zero duration would disarm the timer: at least a millisecond.
                let left = at
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                self.timer.reset(left, None)
            }
            None => self.timer.clear(),
        };
        match armed {
            Ok(()) => self.timer_at = due,
            Err(e) => log::warn!("vsock: cannot arm the timer of pending connections: {e}"),
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) if self.at_connection_limit() => {
                    self.refused_conns += 1;
                    log::warn!(
                        "vsock: {} connections open; refused a host connection on {}",
                        self.max_conns,
                        self.uds_path.display()
                    );
                    let _ = stream.set_nonblocking(true);
                    let _ = stream.write_all(b"ERR too many connections\n");
                }
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        log::warn!("vsock: cannot set up a host connection: {e}");
                        continue;
                    }
                    let token = TOKEN_PENDING_BIT | self.next_pending;
                    self.next_pending += 1;
                    if let Err(e) = epoll_add(&self.epoll, stream.as_raw_fd(), EventSet::IN, token)
                    {
                        log::warn!("vsock: cannot watch a host connection: {e}");
                        continue;
                    }
                    self.pending.insert(
                        token,
                        PendingAccept {
                            stream,
                            line: Vec::new(),
                            since: Instant::now(),
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    log::warn!("vsock: accept on {}: {e}", self.uds_path.display());
                    return;
                }
            }
        }
    }

    fn read_preamble(&mut self, token: u64) {
        let Some(pending) = self.pending.get_mut(&token) else {
            return;
        };
        let mut byte = [0u8; 1];
        // Byte by byte, so that nothing after the newline is consumed.
        loop {
            match pending.stream.read(&mut byte) {
                Ok(0) => {
                    self.drop_pending(token, "closed before CONNECT");
                    return;
                }
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) => {
                    pending.line.push(byte[0]);
                    if pending.line.len() > MAX_PREAMBLE {
                        self.drop_pending(token, "CONNECT line too long");
                        return;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    self.drop_pending(token, &e.to_string());
                    return;
                }
            }
        }
        let Some(mut pending) = self.pending.remove(&token) else {
            return;
        };
        epoll_del(&self.epoll, pending.stream.as_raw_fd());
        let line = String::from_utf8_lossy(&pending.line)
            .trim_end_matches('\r')
            .to_string();
        let port = line
            .strip_prefix("CONNECT ")
            .and_then(|p| p.trim().parse::<u32>().ok());
        let Some(guest_port) = port else {
            log::warn!("vsock: host connection sent {line:?}, expected \"CONNECT <port>\"");
            let _ = pending.stream.write_all(b"ERR expected CONNECT <port>\n");
            return;
        };
        let local_port = self.alloc_local_port(guest_port);
        let key = (local_port, guest_port);
        if let Err(e) = self.add_conn(key, pending.stream, ConnState::AwaitingGuest) {
            log::warn!("vsock: cannot set up the connection to guest port {guest_port}: {e}");
            return;
        }
        if let Some(conn) = self.conns.get_mut(&key) {
            conn.readable = false;
        }
        self.push_control(key, op::REQUEST, 0);
    }

    fn drop_pending(&mut self, token: u64, why: &str) {
        if let Some(p) = self.pending.remove(&token) {
            epoll_del(&self.epoll, p.stream.as_raw_fd());
            log::debug!("vsock: dropped a host connection: {why}");
        }
    }

    fn flush_conn(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if let Err(e) = conn.flush_to_host() {
            log::debug!("vsock: host stream {key:?}: {e}");
            self.remove_conn(key);
            self.push_control(key, op::RST, 0);
            return;
        }
        self.maybe_credit_update(key);
    }

    fn maybe_credit_update(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if (conn.fwd_cnt - conn.last_fwd_cnt_sent).0 >= BUF_ALLOC / 4 {
            conn.last_fwd_cnt_sent = conn.fwd_cnt;
            self.push_control(key, op::CREDIT_UPDATE, 0);
        }
    }

    /// Handles one packet the guest sent.
    pub fn handle_guest_packet(&mut self, header: &PacketHeader, payload: &[u8]) {
        if header.src_cid != self.guest_cid || header.dst_cid != HOST_CID {
            log::warn!(
                "vsock: dropped a packet from CID {} to CID {} (guest is {}, host is {HOST_CID})",
                header.src_cid,
                header.dst_cid,
                self.guest_cid
            );
            return;
        }
        if header.type_ != TYPE_STREAM {
            self.push_rst_for(header);
            return;
        }
        let key: ConnKey = (header.dst_port, header.src_port);
        if let Some(conn) = self.conns.get_mut(&key) {
            conn.peer_buf_alloc = header.buf_alloc;
            conn.peer_fwd_cnt = Wrapping(header.fwd_cnt);
        }
        match header.op {
            op::REQUEST => self.guest_connect(key),
            op::RESPONSE => {
                let Some(conn) = self.conns.get_mut(&key) else {
                    self.push_rst_for(header);
                    return;
                };
                if conn.state != ConnState::AwaitingGuest {
                    self.remove_conn(key);
                    self.push_rst_for(header);
                    return;
                }
                conn.state = ConnState::Established;
                conn.readable = true;
                let reply = format!("OK {}\n", key.0);
                if let Err(e) = conn.stream.write_all(reply.as_bytes()) {
                    log::debug!("vsock: host went away before OK: {e}");
                    self.remove_conn(key);
                    self.push_rst_for(header);
                }
            }
            op::RW => {
                let Some(conn) = self.conns.get_mut(&key) else {
                    self.push_rst_for(header);
                    return;
                };
                if conn.to_host.len() + payload.len() > BUF_ALLOC as usize {
                    log::warn!(
                        "vsock: guest port {} overran its credit; resetting the connection",
                        key.1
                    );
                    self.remove_conn(key);
                    self.push_rst_for(header);
                    return;
                }
                conn.to_host.extend(payload);
                self.flush_conn(key);
            }
            op::CREDIT_UPDATE => {}
            op::CREDIT_REQUEST => {
                if self.conns.contains_key(&key) {
                    self.push_control(key, op::CREDIT_UPDATE, 0);
                } else {
                    self.push_rst_for(header);
                }
            }
            op::SHUTDOWN => {
                let Some(conn) = self.conns.get_mut(&key) else {
                    return;
                };
                let both = SHUTDOWN_RCV | SHUTDOWN_SEND;
                if header.flags & both == both || conn.state == ConnState::Closing {
                    let _ = conn.flush_to_host();
                    self.remove_conn(key);
                    self.push_control(key, op::RST, 0);
                } else if header.flags & SHUTDOWN_SEND != 0 {
                    let _ = conn.flush_to_host();
                    let _ = conn.stream.shutdown(std::net::Shutdown::Write);
                }
            }
            op::RST => self.remove_conn(key),
            other => {
                log::warn!("vsock: unknown operation {other} from guest port {}", key.1);
                self.remove_conn(key);
                self.push_rst_for(header);
            }
        }
    }

    fn guest_connect(&mut self, key: ConnKey) {
        if self.conns.contains_key(&key) {
            self.remove_conn(key);
            self.push_control(key, op::RST, 0);
            return;
        }
        if self.at_connection_limit() {
            self.refused_conns += 1;
            log::warn!(
                "vsock: {} connections open; refused guest port {} connecting to host port {}",
                self.max_conns,
                key.1,
                key.0
            );
            self.push_control(key, op::RST, 0);
            return;
        }
        let mut path = self.uds_path.clone().into_os_string();
        path.push(format!("_{}", key.0));
        match connect_nonblocking(Path::new(&path)) {
            Ok(stream) => match self.add_conn(key, stream, ConnState::Established) {
                Ok(()) => self.push_control(key, op::RESPONSE, 0),
                Err(e) => {
                    log::warn!(
                        "vsock: cannot set up the connection to {}: {e}",
                        Path::new(&path).display()
                    );
                    self.push_control(key, op::RST, 0);
                }
            },
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                log::warn!(
                    "vsock: guest connect to host port {}: {} has a full backlog (not accepting); refused",
                    key.0,
                    Path::new(&path).display()
                );
                self.push_control(key, op::RST, 0);
            }
            Err(e) => {
                log::info!(
                    "vsock: guest connect to host port {}: {}: {e}",
                    key.0,
                    Path::new(&path).display()
                );
                self.push_control(key, op::RST, 0);
            }
        }
    }

    /// The next packet for the guest, given an RX buffer with room for `max_payload` bytes.
    pub fn next_rx(&mut self, max_payload: usize) -> Option<(PacketHeader, Vec<u8>)> {
        if let Some(mut header) = self.control.pop_front() {
            if let Some(conn) = self.conns.get_mut(&(header.src_port, header.dst_port)) {
                header.fwd_cnt = conn.fwd_cnt.0;
                conn.last_fwd_cnt_sent = conn.fwd_cnt;
            }
            return Some((header, Vec::new()));
        }
        // Control packets that waited for room go before any data.
        if let Some(conn) = self.conns.values_mut().find(|c| !c.deferred.is_empty()) {
            let mut header = conn.deferred.remove(0);
            header.fwd_cnt = conn.fwd_cnt.0;
            conn.last_fwd_cnt_sent = conn.fwd_cnt;
            return Some((header, Vec::new()));
        }
        let keys: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| c.readable && c.state == ConnState::Established)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            let room = (conn.peer_credit() as usize).min(max_payload);
            if room == 0 {
                continue;
            }
            let mut buf = vec![0u8; room];
            match conn.stream.read(&mut buf) {
                Ok(0) => {
                    conn.readable = false;
                    conn.host_eof = true;
                    conn.state = ConnState::Closing;
                    self.push_control(key, op::SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND);
                    return self.next_rx(max_payload);
                }
                Ok(n) => {
                    buf.truncate(n);
                    conn.tx_cnt += Wrapping(n as u32);
                    let mut header = self.header(key, op::RW);
                    header.len = n as u32;
                    if let Some(conn) = self.conns.get_mut(&key) {
                        header.fwd_cnt = conn.fwd_cnt.0;
                        conn.last_fwd_cnt_sent = conn.fwd_cnt;
                    }
                    return Some((header, buf));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => conn.readable = false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    log::debug!("vsock: host stream {key:?}: {e}");
                    self.remove_conn(key);
                    self.push_control(key, op::RST, 0);
                    return self.next_rx(max_payload);
                }
            }
        }
        None
    }

    /// Whether a packet is ready for the guest (control, or data with credit).
    pub fn has_rx(&self) -> bool {
        !self.control.is_empty()
            || self.conns.values().any(|c| {
                !c.deferred.is_empty()
                    || (c.readable && c.state == ConnState::Established && c.peer_credit() > 0)
            })
    }
}

/// Sets O_NONBLOCK on `fd`.
fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; F_GETFL/F_SETFL only read and set its flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Drop for UnixMuxer {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.uds_path) {
            log::debug!("vsock: removing {}: {e}", self.uds_path.display());
        }
    }
}

#[cfg(test)]
mod tests;
