//! The virtio-fs device as a vhost-user frontend: the VMM owns the transport registers and
//! config space; virtiofsd serves the queues straight from (shared) guest memory.
//!
//! Notifications: the guest's QueueNotify writes land on the per-queue ioeventfds that the
//! device manager registers; this device hands those to the backend as kick fds, and the VMM does not
//! poll them. Interrupts: the backend writes the device's irqfd itself (no VMM hop per
//! completion). Linux's virtio-mmio driver reads InterruptStatus and scans the used rings only
//! when the USED_RING bit is set, and the VMM never sees the backend's writes to set it, so the
//! device manager makes this device's bit sticky ([`super::super::Interrupt::with_sticky_used_ring`]):
//! a config-change interrupt then also scans the rings, which is harmless.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vmm_api::FsConfig;
use vmm_sys_util::eventfd::EventFd;

use super::daemon::{locate_virtiofsd, Daemon};
use super::FsError;
use crate::devices::virtio::{QueueContext, VirtioDevice, TYPE_FS, VIRTIO_F_VERSION_1};

/// Bytes of the tag in config space.
pub const TAG_LEN: usize = 36;
/// Request queues offered (plus the high-priority queue).
const REQUEST_QUEUES: u32 = 1;
/// Size of each queue.
const QUEUE_SIZE: u16 = 1024;
const QUEUE_SIZES: [u16; 1 + REQUEST_QUEUES as usize] = [QUEUE_SIZE; 1 + REQUEST_QUEUES as usize];
const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << 28;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
/// Ring features the guest may negotiate when the backend offers them.
const PASSED_FEATURES: u64 =
    VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC | VIRTIO_RING_F_EVENT_IDX;
/// How long a snapshot waits for virtiofsd to complete the requests the guest made before
/// it was paused.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a socket that exists may refuse connections (its server is starting).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to a vhost-user socket. virtiofsd creates its socket file before it listens on
/// it, so a refused connection is retried for a while (a probe connection cannot be used to
/// wait: virtiofsd serves the first connection it accepts and exits when it closes).
fn connect(socket: &std::path::Path) -> std::io::Result<UnixStream> {
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    loop {
        match UnixStream::connect(socket) {
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            other => return other,
        }
    }
}

/// One shared volume.
pub struct Fs {
    tag: String,
    pub(super) config: FsConfig,
    config_space: [u8; TAG_LEN + 4],
    frontend: Frontend,
    /// Whether the backend takes part in device-state transfer (snapshots).
    device_state: bool,
    /// virtiofsd's state, saved by the last snapshot.
    pub(super) backend_state: Vec<u8>,
    /// The queues a snapshot stopped (GET_VRING_BASE), restarted after it.
    stopped: Vec<usize>,
    /// A second handle on the vhost-user socket, for the event loop to watch for hang-ups.
    watch: UnixStream,
    backend_features: u64,
    kicks: Vec<EventFd>,
    started: Vec<usize>,
    failure: Option<String>,
    /// Declared last: dropped (killed) after the socket closed.
    pub(super) daemon: Option<Daemon>,
}

/// `parent/name`, else `name-1`, `name-2`, ...: the first that nothing has. A killed VMM leaves
/// its directory behind, and a later one may get its pid. ([`Daemon::start`] creates it with
/// `mkdir`, which fails on anything made there meanwhile, so nothing is taken over.)
fn unused_dir(parent: &Path, name: &str) -> PathBuf {
    let mut dir = parent.join(name);
    for n in 1..1000 {
        if dir.symlink_metadata().is_err() {
            break;
        }
        dir = parent.join(format!("{name}-{n}"));
    }
    dir
}

impl Fs {
    /// The `index`th volume: starts virtiofsd for it (unless the caller gave its socket) and
    /// connects; `virtiofsd` is the binary named by `--virtiofsd`, if any.
    pub fn start_volume(
        virtiofsd: Option<&Path>,
        index: usize,
        config: &FsConfig,
    ) -> Result<Self, FsError> {
        if let Some(socket) = &config.socket {
            return Fs::new(config, socket.clone(), None);
        }
        let binary = locate_virtiofsd(virtiofsd)?;
        let name = format!("rollbox-vmm-{}-fs{index}", std::process::id());
        let dir = unused_dir(&std::env::temp_dir(), &name);
        let daemon = Daemon::start(&binary, config, &dir)?;
        let socket = daemon.socket().to_path_buf();
        Fs::new(config, socket, Some(daemon))
    }

    /// Connects to `socket` (served by `daemon` when rollbox-vmm started it) and negotiates
    /// the vhost-user session up to the guest-independent part: owner and protocol features.
    pub fn new(
        config: &FsConfig,
        socket: PathBuf,
        daemon: Option<Daemon>,
    ) -> Result<Self, FsError> {
        let tag = config.tag.clone();
        let stream = connect(&socket).map_err(|source| FsError::Connect {
            tag: tag.clone(),
            socket: socket.clone(),
            source,
        })?;
        let watch = stream.try_clone().map_err(|source| FsError::Connect {
            tag: tag.clone(),
            socket: socket.clone(),
            source,
        })?;
        let mut frontend = Frontend::from_stream(stream, QUEUE_SIZES.len() as u64);
        let vhost_err = |request| {
            let tag = tag.clone();
            move |source| FsError::VhostUser {
                tag,
                request,
                source,
            }
        };
        frontend.set_owner().map_err(vhost_err("SET_OWNER"))?;
        let backend_features = frontend.get_features().map_err(vhost_err("GET_FEATURES"))?;
        if backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            return Err(FsError::MissingFeature {
                tag,
                feature: "VHOST_USER_F_PROTOCOL_FEATURES",
            });
        }
        let offered = frontend
            .get_protocol_features()
            .map_err(vhost_err("GET_PROTOCOL_FEATURES"))?;
        let wanted = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::DEVICE_STATE;
        frontend
            .set_protocol_features(offered & wanted)
            .map_err(vhost_err("SET_PROTOCOL_FEATURES"))?;
        let device_state = offered.contains(VhostUserProtocolFeatures::DEVICE_STATE);
        let mut config_space = [0u8; TAG_LEN + 4];
        config_space[..tag.len().min(TAG_LEN)]
            .copy_from_slice(&tag.as_bytes()[..tag.len().min(TAG_LEN)]);
        config_space[TAG_LEN..].copy_from_slice(&REQUEST_QUEUES.to_le_bytes());
        Ok(Self {
            tag,
            config: config.clone(),
            config_space,
            frontend,
            device_state,
            backend_state: Vec::new(),
            stopped: Vec::new(),
            watch,
            backend_features,
            kicks: Vec::new(),
            started: Vec::new(),
            failure: None,
            daemon,
        })
    }

    fn vhost_err(&self, request: &'static str) -> impl FnOnce(vhost::Error) -> FsError {
        let tag = self.tag.clone();
        move |source| FsError::VhostUser {
            tag,
            request,
            source,
        }
    }

    /// Hands guest memory and every ready queue to the backend.
    fn start(&mut self, acked_features: u64, ctx: &QueueContext<'_>) -> Result<(), FsError> {
        self.frontend
            .set_features(acked_features | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits())
            .map_err(self.vhost_err("SET_FEATURES"))?;
        let regions = ctx
            .mem
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<Result<Vec<_>, _>>()
            .map_err(self.vhost_err("SET_MEM_TABLE (guest memory is not memfd-backed)"))?;
        self.frontend
            .set_mem_table(&regions)
            .map_err(self.vhost_err("SET_MEM_TABLE"))?;
        for index in 0..ctx.queues.len() {
            if ctx.queues[index].ready() {
                self.start_queue(index, ctx)?;
                self.started.push(index);
            }
        }
        Ok(())
    }

    /// Hands one queue to the backend, starting at the queue's next available index.
    fn start_queue(&mut self, index: usize, ctx: &QueueContext<'_>) -> Result<(), FsError> {
        let queue = &ctx.queues[index];
        let Some(kick) = self.kicks.get(index) else {
            return Err(FsError::Daemon {
                tag: self.tag.clone(),
                detail: format!("queue {index} has no notify eventfd"),
            });
        };
        let host = |addr: u64| {
            ctx.mem
                .get_host_address(GuestAddress(addr))
                .map(|p| p as u64)
                .map_err(|_| vhost::Error::InvalidGuestMemory)
        };
        // vhost-user ring addresses are the frontend's virtual addresses.
        let rings = VringConfigData {
            queue_max_size: queue.max_size(),
            queue_size: queue.size(),
            flags: 0,
            desc_table_addr: host(queue.desc_table()).map_err(self.vhost_err("SET_VRING_ADDR"))?,
            used_ring_addr: host(queue.used_ring()).map_err(self.vhost_err("SET_VRING_ADDR"))?,
            avail_ring_addr: host(queue.avail_ring()).map_err(self.vhost_err("SET_VRING_ADDR"))?,
            log_addr: None,
        };
        self.frontend
            .set_vring_num(index, queue.size())
            .map_err(self.vhost_err("SET_VRING_NUM"))?;
        // The backend reads the used index from guest memory here.
        self.frontend
            .set_vring_addr(index, &rings)
            .map_err(self.vhost_err("SET_VRING_ADDR"))?;
        self.frontend
            .set_vring_base(index, queue.next_avail())
            .map_err(self.vhost_err("SET_VRING_BASE"))?;
        self.frontend
            .set_vring_call(index, ctx.interrupt.irqfd())
            .map_err(self.vhost_err("SET_VRING_CALL"))?;
        self.frontend
            .set_vring_kick(index, kick)
            .map_err(self.vhost_err("SET_VRING_KICK"))?;
        self.frontend
            .set_vring_enable(index, true)
            .map_err(self.vhost_err("SET_VRING_ENABLE"))?;
        Ok(())
    }

    fn state_err(&self, detail: String) -> FsError {
        FsError::DeviceState {
            tag: self.tag.clone(),
            detail,
        }
    }

    /// Snapshot, with the vCPUs paused: lets virtiofsd finish the guest's requests, stops every
    /// ring (GET_VRING_BASE; the queues then hold the backend's indices) and takes virtiofsd's
    /// state. [`Fs::restart`] starts the rings again.
    fn stop_and_save(&mut self, ctx: &mut QueueContext<'_>) -> Result<(), FsError> {
        if !self.device_state {
            return Err(FsError::MissingFeature {
                tag: self.tag.clone(),
                feature: "VHOST_USER_PROTOCOL_F_DEVICE_STATE (virtiofsd 1.10 or later), needed to snapshot a volume",
            });
        }
        // A request the guest queued without a notification still completes: kick every ring.
        for &index in &self.started {
            if let Some(kick) = self.kicks.get(index) {
                let _ = kick.write(1);
            }
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        for &index in &self.started {
            let queue = &ctx.queues[index];
            loop {
                let avail = queue.avail_idx(ctx.mem, Ordering::Acquire);
                let used = queue.used_idx(ctx.mem, Ordering::Acquire);
                match (avail, used) {
                    (Ok(a), Ok(u)) if a == u => break,
                    (Ok(a), Ok(u)) if Instant::now() > deadline => {
                        return Err(self.state_err(format!(
                            "queue {index}: {} request(s) still in flight after {} s (a guest blocked on a lock?); snapshot again later",
                            (a - u).0,
                            DRAIN_TIMEOUT.as_secs()
                        )))
                    }
                    (Ok(_), Ok(_)) => std::thread::sleep(Duration::from_millis(1)),
                    _ => {
                        return Err(
                            self.state_err(format!("queue {index}: its rings are not in guest memory"))
                        )
                    }
                }
            }
        }
        for index in std::mem::take(&mut self.started) {
            let base = self
                .frontend
                .get_vring_base(index)
                .map_err(self.vhost_err("GET_VRING_BASE"))?;
            self.stopped.push(index);
            // Every request is answered, so the next used index equals the next available one.
            let queue = &mut ctx.queues[index];
            queue.set_next_avail(base as u16);
            queue.set_next_used(base as u16);
        }
        self.backend_state = self.transfer(VhostTransferStateDirection::SAVE, &[])?;
        Ok(())
    }

    /// Starts the rings a snapshot stopped, where the backend left them.
    fn restart(&mut self, ctx: &QueueContext<'_>) -> Result<(), FsError> {
        for index in std::mem::take(&mut self.stopped) {
            self.start_queue(index, ctx)?;
            self.started.push(index);
        }
        Ok(())
    }

    /// Gives a fresh virtiofsd the state a snapshot saved, before any ring starts.
    pub fn load_state(&mut self, state: &[u8]) -> Result<(), FsError> {
        if !self.device_state {
            return Err(FsError::MissingFeature {
                tag: self.tag.clone(),
                feature: "VHOST_USER_PROTOCOL_F_DEVICE_STATE (virtiofsd 1.10 or later), needed to restore a volume",
            });
        }
        self.transfer(VhostTransferStateDirection::LOAD, state)?;
        self.backend_state = state.to_vec();
        Ok(())
    }

    /// One device-state transfer through a memfd: the backend reads `load` from it, or writes
    /// its state into it, which is returned. CHECK_DEVICE_STATE waits for the backend.
    fn transfer(
        &self,
        direction: VhostTransferStateDirection,
        load: &[u8],
    ) -> Result<Vec<u8>, FsError> {
        let io = |what: &str| {
            let tag = self.tag.clone();
            let what = what.to_string();
            move |e: std::io::Error| FsError::DeviceState {
                tag,
                detail: format!("{what}: {e}"),
            }
        };
        let file = crate::vstate::memory::memfd(c"rollbox-fs-state", 0)
            .map_err(io("creating the state memfd"))?;
        file.write_all_at(load, 0)
            .map_err(io("writing the saved state"))?;
        let fd: OwnedFd = file
            .try_clone()
            .map_err(io("duplicating the state memfd"))?
            .into();
        let request = if direction == VhostTransferStateDirection::SAVE {
            "SET_DEVICE_STATE_FD (save)"
        } else {
            "SET_DEVICE_STATE_FD (load)"
        };
        let reply = self
            .frontend
            .set_device_state_fd(direction, VhostTransferStatePhase::STOPPED, fd)
            .map_err(self.vhost_err(request))?;
        if reply.is_some() {
            return Err(self.state_err(
                "the backend asked to use a channel of its own, which rollbox-vmm does not read"
                    .into(),
            ));
        }
        self.frontend.check_device_state().map_err(|source| {
            let what = if direction == VhostTransferStateDirection::SAVE {
                "virtiofsd could not save its state (see its stderr)"
            } else {
                "virtiofsd refused the saved state (damaged, or the shared directory no longer has the files the guest held; see its stderr)"
            };
            FsError::DeviceState {
                tag: self.tag.clone(),
                detail: format!("CHECK_DEVICE_STATE: {what}: {source}"),
            }
        })?;
        if direction != VhostTransferStateDirection::SAVE {
            return Ok(Vec::new());
        }
        let len = file.metadata().map_err(io("reading the state"))?.len();
        let mut out = vec![0u8; len as usize];
        file.read_exact_at(&mut out, 0)
            .map_err(io("reading the state"))?;
        if out.is_empty() {
            return Err(self.state_err("virtiofsd saved an empty state".into()));
        }
        Ok(out)
    }

    /// Whether the backend hung up; records why.
    fn check_backend(&mut self) {
        if self.failure.is_some() {
            return;
        }
        let mut byte = 0u8;
        // SAFETY: peeks at most one byte into a live stack variable from a socket we own.
        let n = unsafe {
            libc::recv(
                self.watch.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        let why = match n {
            0 => "closed its vhost-user socket".to_string(),
            n if n > 0 => "sent a message nobody asked for".to_string(),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::Interrupted
                {
                    return;
                }
                format!("socket error: {e}")
            }
        };
        let status = self
            .daemon
            .as_mut()
            .and_then(|d| {
                // The process may still be on its way out.
                for _ in 0..100 {
                    if let Some(status) = d.exited() {
                        return Some(status);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                None
            })
            .map(|s| format!(" (virtiofsd {s})"))
            .unwrap_or_default();
        let message = format!(
            "volume {}: the virtio-fs backend {why}{status}; stopping the VM, since the guest's requests on this volume could never complete",
            self.tag
        );
        self.failure = Some(message);
    }
}

impl VirtioDevice for Fs {
    fn device_type(&self) -> u32 {
        TYPE_FS
    }

    fn avail_features(&self) -> u64 {
        self.backend_features & PASSED_FEATURES
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::devices::virtio::mmio::read_config_bytes(&self.config_space, offset, data);
    }

    fn activate_with(
        &mut self,
        acked_features: u64,
        ctx: &mut QueueContext<'_>,
    ) -> Result<(), String> {
        self.start(acked_features, ctx).map_err(|e| e.to_string())
    }

    fn reset(&mut self) {
        // GET_VRING_BASE stops a ring; the next DRIVER_OK starts them again.
        for index in std::mem::take(&mut self.started) {
            if let Err(e) = self.frontend.get_vring_base(index) {
                log::warn!("volume {}: stopping queue {index}: {e}", self.tag);
            }
        }
    }

    fn process_queue(&mut self, queue: usize, _ctx: &mut QueueContext<'_>) {
        // Only reached when a notification bypassed the ioeventfd: pass it on.
        if let Some(kick) = self.kicks.get(queue) {
            if let Err(e) = kick.write(1) {
                log::warn!("volume {}: kick of queue {queue}: {e}", self.tag);
            }
        }
    }

    fn backend_serves_queues(&self) -> bool {
        true
    }

    fn set_notify_fds(&mut self, fds: Vec<EventFd>) {
        self.kicks = fds;
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.watch.as_raw_fd())
    }

    fn process_backend(&mut self, _ctx: &mut QueueContext<'_>) {
        self.check_backend();
    }

    fn drain_backend(&mut self) {
        self.check_backend();
    }

    fn failure(&self) -> Option<String> {
        self.failure.clone()
    }

    fn name(&self) -> String {
        format!("fs {}", self.tag)
    }

    fn save_backend(&mut self, ctx: &mut QueueContext<'_>) -> Result<(), String> {
        self.stop_and_save(ctx).map_err(|e| e.to_string())
    }

    fn resume_backend(&mut self, ctx: &mut QueueContext<'_>) {
        if let Err(e) = self.restart(ctx) {
            self.failure = Some(format!(
                "{e}; stopping the VM, since the guest's requests on this volume could never complete"
            ));
        }
    }

    fn maps_guest_memory(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::fs::locate_virtiofsd;
    use vmm_api::FsCache;

    /// A volume served by a real virtiofsd, or None when none is installed here.
    fn volume(share: &std::path::Path, run: &std::path::Path) -> Option<Fs> {
        let Ok(binary) = locate_virtiofsd(None) else {
            eprintln!("no virtiofsd here (scripts/virtiofsd.sh): skipped");
            return None;
        };
        let config = FsConfig {
            tag: "t".into(),
            shared_dir: share.to_path_buf(),
            readonly: false,
            cache: FsCache::Auto,
            socket: None,
        };
        let daemon = Daemon::start(&binary, &config, run).expect("virtiofsd");
        let socket = daemon.socket().to_path_buf();
        Some(Fs::new(&config, socket, Some(daemon)).expect("connect"))
    }

    #[test]
    fn virtiofsd_state_goes_to_a_fresh_virtiofsd_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let share = dir.path().join("share");
        std::fs::create_dir(&share).expect("share");
        let Some(source) = volume(&share, &dir.path().join("run-source")) else {
            return;
        };
        assert!(
            source.device_state,
            "virtiofsd offers no device-state transfer"
        );
        let blob = source
            .transfer(VhostTransferStateDirection::SAVE, &[])
            .expect("save");
        assert!(!blob.is_empty());
        let Some(mut target) = volume(&share, &dir.path().join("run-target")) else {
            return;
        };
        target.load_state(&blob).expect("load");
        let Some(mut damaged) = volume(&share, &dir.path().join("run-damaged")) else {
            return;
        };
        let err = damaged
            .load_state(b"not a virtiofsd state")
            .expect_err("garbage accepted");
        let text = err.to_string();
        assert!(
            text.contains("volume t") && text.contains("refused the saved state"),
            "{text}"
        );
    }

    #[test]
    fn a_directory_left_by_a_killed_vmm_with_the_same_pid_is_passed_over() {
        let parent = tempfile::tempdir().expect("tempdir");
        let name = "rollbox-vmm-42-fs0";
        assert_eq!(unused_dir(parent.path(), name), parent.path().join(name));
        std::fs::create_dir(parent.path().join(name)).expect("stale dir");
        std::os::unix::fs::symlink("/nonexistent", parent.path().join(format!("{name}-1")))
            .expect("stale link");
        assert_eq!(
            unused_dir(parent.path(), name),
            parent.path().join(format!("{name}-2"))
        );
    }
}
