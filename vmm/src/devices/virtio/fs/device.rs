//! The virtio-fs device as a vhost-user frontend: the VMM owns the transport registers and
//! config space; virtiofsd serves the queues straight from (shared) guest memory.
//!
//! Notifications: the guest's QueueNotify writes land on the per-queue ioeventfds that the
//! builder registers; this device hands those to the backend as kick fds, and the VMM does not
//! poll them. Interrupts: the backend writes the device's irqfd itself (no VMM hop per
//! completion). Linux's virtio-mmio driver reads InterruptStatus and scans the used rings only
//! when the USED_RING bit is set, and the VMM never sees the backend's writes to set it, so the
//! builder makes this device's bit sticky ([`super::super::Interrupt::with_sticky_used_ring`]):
//! a config-change interrupt then also scans the rings, which is harmless.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

use super::daemon::Daemon;
use super::FsError;
use crate::config::FsConfig;
use crate::devices::virtio::persist::DevicePersistKind;
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

/// One shared volume.
pub struct Fs {
    tag: String,
    config_space: [u8; TAG_LEN + 4],
    frontend: Frontend,
    /// A second handle on the vhost-user socket, for the event loop to watch for hang-ups.
    watch: UnixStream,
    backend_features: u64,
    kicks: Vec<EventFd>,
    started: Vec<usize>,
    failure: Option<String>,
    /// Declared last: dropped (killed) after the socket closed.
    daemon: Option<Daemon>,
}

impl Fs {
    /// Connects to `socket` (served by `daemon` when rollbox-vmm started it) and negotiates
    /// the vhost-user session up to the guest-independent part: owner and protocol features.
    pub fn new(
        config: &FsConfig,
        socket: PathBuf,
        daemon: Option<Daemon>,
    ) -> Result<Self, FsError> {
        let tag = config.tag.clone();
        let stream = UnixStream::connect(&socket).map_err(|source| FsError::Connect {
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
        let wanted = VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK;
        frontend
            .set_protocol_features(offered & wanted)
            .map_err(vhost_err("SET_PROTOCOL_FEATURES"))?;
        let mut config_space = [0u8; TAG_LEN + 4];
        config_space[..tag.len().min(TAG_LEN)]
            .copy_from_slice(&tag.as_bytes()[..tag.len().min(TAG_LEN)]);
        config_space[TAG_LEN..].copy_from_slice(&REQUEST_QUEUES.to_le_bytes());
        Ok(Self {
            tag,
            config_space,
            frontend,
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
        let host = |addr: u64| {
            ctx.mem
                .get_host_address(GuestAddress(addr))
                .map(|p| p as u64)
                .map_err(|_| vhost::Error::InvalidGuestMemory)
        };
        for (index, queue) in ctx.queues.iter().enumerate() {
            if !queue.ready() {
                continue;
            }
            let Some(kick) = self.kicks.get(index) else {
                return Err(FsError::Daemon {
                    tag: self.tag.clone(),
                    detail: format!("queue {index} has no notify eventfd"),
                });
            };
            // vhost-user ring addresses are the frontend's virtual addresses.
            let rings = VringConfigData {
                queue_max_size: queue.max_size(),
                queue_size: queue.size(),
                flags: 0,
                desc_table_addr: host(queue.desc_table())
                    .map_err(self.vhost_err("SET_VRING_ADDR"))?,
                used_ring_addr: host(queue.used_ring())
                    .map_err(self.vhost_err("SET_VRING_ADDR"))?,
                avail_ring_addr: host(queue.avail_ring())
                    .map_err(self.vhost_err("SET_VRING_ADDR"))?,
                log_addr: None,
            };
            self.frontend
                .set_vring_num(index, queue.size())
                .map_err(self.vhost_err("SET_VRING_NUM"))?;
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
            self.started.push(index);
        }
        Ok(())
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

    fn persist_kind(&self) -> DevicePersistKind {
        DevicePersistKind::Fs {
            tag: self.tag.clone(),
        }
    }
}
