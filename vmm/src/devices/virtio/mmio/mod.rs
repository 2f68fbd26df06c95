//! The virtio-mmio transport (virtio 1.x register layout, version 2); its snapshot state is in
//! `persist.rs`.

pub mod persist;

use std::sync::atomic::{fence, Ordering};

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};

use super::{Interrupt, QueueContext, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::vstate::bus::BusDevice;

const MAGIC_VALUE: u32 = 0x7472_6976; // "virt"
const MMIO_VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x524f_4c4c; // "ROLL"

const REG_MAGIC: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_VENDOR_ID: u64 = 0x00c;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
/// Offset of the QueueNotify register, which the VMM turns into ioeventfds.
pub const REG_QUEUE_NOTIFY: u64 = 0x050;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_CONFIG_GENERATION: u64 = 0x0fc;
const CONFIG_SPACE: u64 = 0x100;

/// Device status bits (virtio 1.2, 2.1).
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u32 = 1;
    /// The guest has a driver for it.
    pub const DRIVER: u32 = 2;
    /// The driver is ready.
    pub const DRIVER_OK: u32 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u32 = 8;
    /// The device hit an error the driver must recover from by resetting it.
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u32 = 0x80;
}

/// The transport around one device: registers, queues, feature negotiation.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    interrupt: Interrupt,
    queues: Vec<Queue>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    acked_features: u64,
    status: u32,
    config_generation: u32,
}

impl MmioTransport {
    /// Wraps `device`, whose queues live in `mem`, raising `interrupt`.
    pub fn new(device: Box<dyn VirtioDevice>, mem: GuestMemoryMmap, interrupt: Interrupt) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .filter_map(|&max| match Queue::new(max) {
                Ok(q) => Some(q),
                Err(e) => {
                    log::error!("{}: invalid queue size {max}: {e}", device.name());
                    None
                }
            })
            .collect();
        Self {
            device,
            mem,
            interrupt,
            queues,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            acked_features: 0,
            status: 0,
            config_generation: 0,
        }
    }

    /// The device model.
    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    /// Number of queues.
    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// Whether the driver set DRIVER_OK and the device has not failed.
    pub fn is_activated(&self) -> bool {
        self.status & status::DRIVER_OK != 0 && self.status & status::DEVICE_NEEDS_RESET == 0
    }

    /// After a restore: lets the device react, then serves every queue once, since
    /// notifications pending at snapshot time were not saved.
    pub fn kick_after_restore(&mut self) {
        if !self.is_activated() {
            return;
        }
        let mut ctx = QueueContext {
            mem: &self.mem,
            queues: &mut self.queues,
            interrupt: &self.interrupt,
        };
        self.device.after_restore(&mut ctx);
        for index in 0..self.queues.len() {
            self.notify_queue(index);
        }
    }

    /// Before a snapshot: the device's backend stops the queues and saves its state.
    pub fn save_backend(&mut self) -> Result<(), String> {
        let mut ctx = QueueContext {
            mem: &self.mem,
            queues: &mut self.queues,
            interrupt: &self.interrupt,
        };
        self.device.save_backend(&mut ctx)
    }

    /// After a snapshot: the device's backend starts the queues again.
    pub fn resume_backend(&mut self) {
        let mut ctx = QueueContext {
            mem: &self.mem,
            queues: &mut self.queues,
            interrupt: &self.interrupt,
        };
        self.device.resume_backend(&mut ctx);
    }

    /// Serves a notification of queue `index`.
    pub fn notify_queue(&mut self, index: usize) {
        if !self.is_activated() || index >= self.queues.len() {
            return;
        }
        let mut ctx = QueueContext {
            mem: &self.mem,
            queues: &mut self.queues,
            interrupt: &self.interrupt,
        };
        self.device.process_queue(index, &mut ctx);
    }

    /// Serves the device's backend file descriptor.
    pub fn process_backend(&mut self) {
        if !self.is_activated() {
            self.device.drain_backend();
            return;
        }
        let mut ctx = QueueContext {
            mem: &self.mem,
            queues: &mut self.queues,
            interrupt: &self.interrupt,
        };
        self.device.process_backend(&mut ctx);
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    fn reset(&mut self) {
        self.device.reset();
        for queue in &mut self.queues {
            queue.reset();
        }
        self.queue_select = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.acked_features = 0;
        self.status = 0;
        self.interrupt.set_status(0);
        self.interrupt.clear_needs_reset();
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let newly = value & !self.status;
        if newly & status::FEATURES_OK != 0 && self.acked_features & VIRTIO_F_VERSION_1 == 0 {
            log::warn!(
                "{}: driver did not accept VIRTIO_F_VERSION_1; refusing FEATURES_OK",
                self.device.name()
            );
            self.status = value & !status::FEATURES_OK;
            return;
        }
        self.status = value;
        if newly & status::DRIVER_OK != 0 {
            self.activate();
        }
    }

    fn activate(&mut self) {
        let name = self.device.name();
        for (i, queue) in self.queues.iter().enumerate() {
            if queue.ready() && !queue.is_valid(&self.mem) {
                log::warn!(
                    "{name}: queue {i} is invalid (size {}, desc {:#x}, avail {:#x}, used {:#x}); device needs reset",
                    queue.size(),
                    queue.desc_table(),
                    queue.avail_ring(),
                    queue.used_ring()
                );
                self.status |= status::DEVICE_NEEDS_RESET;
                self.interrupt.signal_config_change();
                return;
            }
        }
        self.activate_device();
    }

    fn activate_device(&mut self) {
        let mut ctx = QueueContext {
            mem: &self.mem,
            queues: &mut self.queues,
            interrupt: &self.interrupt,
        };
        if let Err(e) = self.device.activate_with(self.acked_features, &mut ctx) {
            log::error!(
                "{}: activation failed: {e}; device needs reset",
                self.device.name()
            );
            self.status |= status::DEVICE_NEEDS_RESET;
            self.interrupt.signal_config_change();
        }
    }

    fn read_register(&mut self, offset: u64) -> u32 {
        match offset {
            REG_MAGIC => MAGIC_VALUE,
            REG_VERSION => MMIO_VERSION,
            REG_DEVICE_ID => self.device.device_type(),
            REG_VENDOR_ID => VENDOR_ID,
            REG_DEVICE_FEATURES => {
                let features = self.device.avail_features() | VIRTIO_F_VERSION_1;
                match self.device_features_select {
                    0 => features as u32,
                    1 => (features >> 32) as u32,
                    _ => 0,
                }
            }
            REG_QUEUE_NUM_MAX => self
                .selected_queue()
                .map(|q| u32::from(q.max_size()))
                .unwrap_or(0),
            REG_QUEUE_READY => self
                .selected_queue()
                .map(|q| u32::from(q.ready()))
                .unwrap_or(0),
            REG_INTERRUPT_STATUS => self.interrupt.status(),
            REG_STATUS if self.interrupt.needs_reset() => self.status | status::DEVICE_NEEDS_RESET,
            REG_STATUS => self.status,
            REG_CONFIG_GENERATION => self.config_generation,
            _ => {
                log::debug!(
                    "{}: read of unknown register {offset:#x}",
                    self.device.name()
                );
                0
            }
        }
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        let features_ok = self.status & status::FEATURES_OK != 0;
        let driver_ok = self.status & status::DRIVER_OK != 0;
        match offset {
            REG_DEVICE_FEATURES_SEL => self.device_features_select = value,
            REG_DRIVER_FEATURES if !features_ok => {
                let offered = self.device.avail_features() | VIRTIO_F_VERSION_1;
                let shift = match self.driver_features_select {
                    0 => 0,
                    1 => 32,
                    _ => return,
                };
                let mask = 0xffff_ffffu64 << shift;
                let wanted = (u64::from(value) << shift) & offered;
                self.acked_features = (self.acked_features & !mask) | wanted;
            }
            REG_DRIVER_FEATURES_SEL => self.driver_features_select = value,
            REG_QUEUE_SEL => self.queue_select = value,
            REG_QUEUE_NUM if !driver_ok => {
                if let Some(q) = self.selected_queue() {
                    q.set_size(value as u16);
                }
            }
            REG_QUEUE_READY if !driver_ok => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(value == 1);
                }
            }
            REG_INTERRUPT_ACK => self.interrupt.ack(value),
            REG_STATUS => self.set_status(value),
            REG_QUEUE_DESC_LOW if !driver_ok => {
                self.with_queue(|q| q.set_desc_table_address(Some(value), None))
            }
            REG_QUEUE_DESC_HIGH if !driver_ok => {
                self.with_queue(|q| q.set_desc_table_address(None, Some(value)))
            }
            REG_QUEUE_DRIVER_LOW if !driver_ok => {
                self.with_queue(|q| q.set_avail_ring_address(Some(value), None))
            }
            REG_QUEUE_DRIVER_HIGH if !driver_ok => {
                self.with_queue(|q| q.set_avail_ring_address(None, Some(value)))
            }
            REG_QUEUE_DEVICE_LOW if !driver_ok => {
                self.with_queue(|q| q.set_used_ring_address(Some(value), None))
            }
            REG_QUEUE_DEVICE_HIGH if !driver_ok => {
                self.with_queue(|q| q.set_used_ring_address(None, Some(value)))
            }
            REG_QUEUE_NOTIFY => {
                // Normally caught by an ioeventfd; served here when none is registered.
                fence(Ordering::SeqCst);
                self.notify_queue(value as usize);
            }
            _ => log::debug!(
                "{}: ignored write {value:#x} to register {offset:#x} (status {:#x})",
                self.device.name(),
                self.status
            ),
        }
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.selected_queue() {
            f(q);
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE {
            self.device.read_config(offset - CONFIG_SPACE, data);
            return;
        }
        data.fill(0);
        if data.len() != 4 || !offset.is_multiple_of(4) {
            log::warn!(
                "{}: {}-byte read of register {offset:#x} ignored",
                self.device.name(),
                data.len()
            );
            return;
        }
        data.copy_from_slice(&self.read_register(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE {
            self.device.write_config(offset - CONFIG_SPACE, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            log::warn!(
                "{}: {}-byte write to register {offset:#x} ignored",
                self.device.name(),
                data.len()
            );
            return;
        };
        if !offset.is_multiple_of(4) {
            return;
        }
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

/// Copies `src[offset..]` into `data`, zero-filling past the end: a config-space read helper.
pub fn read_config_bytes(src: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if start >= src.len() {
        return;
    }
    let n = data.len().min(src.len() - start);
    data[..n].copy_from_slice(&src[start..start + n]);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::devices::virtio::INTERRUPT_CONFIG;

    /// Counts activations, resets and notifications.
    #[derive(Default)]
    struct Counts {
        activated: AtomicUsize,
        reset: AtomicUsize,
        notified: AtomicUsize,
        stall_on_notify: std::sync::atomic::AtomicBool,
    }

    struct Dummy(Arc<Counts>);

    impl VirtioDevice for Dummy {
        fn device_type(&self) -> u32 {
            42
        }
        fn avail_features(&self) -> u64 {
            1 << 5
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 8]
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            read_config_bytes(b"config!", offset, data);
        }
        fn activate(&mut self, _acked_features: u64) {
            self.0.activated.fetch_add(1, Ordering::SeqCst);
        }
        fn reset(&mut self) {
            self.0.reset.fetch_add(1, Ordering::SeqCst);
        }
        fn process_queue(&mut self, _queue: usize, ctx: &mut QueueContext<'_>) {
            self.0.notified.fetch_add(1, Ordering::SeqCst);
            if self.0.stall_on_notify.load(Ordering::SeqCst) {
                ctx.interrupt.signal_needs_reset();
            }
        }
        fn name(&self) -> String {
            "dummy".into()
        }
    }

    fn transport() -> (MmioTransport, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("mem");
        let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        let t = MmioTransport::new(
            Box::new(Dummy(Arc::clone(&counts))),
            mem,
            Interrupt::new(Arc::new(irq)),
        );
        (t, counts)
    }

    fn read(t: &mut MmioTransport, offset: u64) -> u32 {
        let mut data = [0xffu8; 4];
        t.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn write(t: &mut MmioTransport, offset: u64, value: u32) {
        t.write(offset, &value.to_le_bytes());
    }

    /// Sets up queue `index` of `size` with its rings at `base`.
    fn setup_queue(t: &mut MmioTransport, index: u32, size: u32, base: u32) {
        write(t, REG_QUEUE_SEL, index);
        write(t, REG_QUEUE_NUM, size);
        write(t, REG_QUEUE_DESC_LOW, base);
        write(t, REG_QUEUE_DRIVER_LOW, base + 0x1000);
        write(t, REG_QUEUE_DEVICE_LOW, base + 0x2000);
        write(t, REG_QUEUE_READY, 1);
    }

    fn negotiate(t: &mut MmioTransport) {
        write(t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
        write(t, REG_DRIVER_FEATURES_SEL, 1);
        write(t, REG_DRIVER_FEATURES, 1);
        write(
            t,
            REG_STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
    }

    const RUNNING: u32 =
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;

    #[test]
    fn identity_registers_and_config_space() {
        let (mut t, _) = transport();
        assert_eq!(read(&mut t, REG_MAGIC), MAGIC_VALUE);
        assert_eq!(read(&mut t, REG_VERSION), 2);
        assert_eq!(read(&mut t, REG_DEVICE_ID), 42);
        assert_eq!(read(&mut t, REG_VENDOR_ID), VENDOR_ID);
        write(&mut t, REG_QUEUE_SEL, 1);
        assert_eq!(read(&mut t, REG_QUEUE_NUM_MAX), 8);
        write(&mut t, REG_QUEUE_SEL, 7);
        assert_eq!(read(&mut t, REG_QUEUE_NUM_MAX), 0, "no such queue");
        let mut config = [0u8; 8];
        t.read(CONFIG_SPACE + 2, &mut config);
        assert_eq!(&config, b"nfig!\0\0\0");
    }

    #[test]
    fn features_are_offered_by_page_and_acked_within_the_offer() {
        let (mut t, _) = transport();
        assert_eq!(read(&mut t, REG_DEVICE_FEATURES), 1 << 5);
        write(&mut t, REG_DEVICE_FEATURES_SEL, 1);
        assert_eq!(read(&mut t, REG_DEVICE_FEATURES), 1, "VIRTIO_F_VERSION_1");
        write(&mut t, REG_DEVICE_FEATURES_SEL, 2);
        assert_eq!(read(&mut t, REG_DEVICE_FEATURES), 0);
        write(&mut t, REG_DRIVER_FEATURES, 0xffff_ffff);
        assert_eq!(
            t.registers().acked_features,
            1 << 5,
            "only offered bits stick"
        );
    }

    #[test]
    fn features_ok_needs_version_1() {
        let (mut t, _) = transport();
        write(&mut t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
        write(
            &mut t,
            REG_STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(read(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
        negotiate(&mut t);
        assert_ne!(read(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
    }

    #[test]
    fn driver_ok_activates_and_freezes_queue_setup_until_reset() {
        let (mut t, counts) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 16, 0x1_0000);
        setup_queue(&mut t, 1, 8, 0x2_0000);
        write(&mut t, REG_STATUS, RUNNING);
        assert!(t.is_activated());
        assert_eq!(counts.activated.load(Ordering::SeqCst), 1);
        write(&mut t, REG_QUEUE_NOTIFY, 1);
        write(&mut t, REG_QUEUE_NOTIFY, 9);
        assert_eq!(
            counts.notified.load(Ordering::SeqCst),
            1,
            "queue 9 does not exist"
        );
        // Queue registers are read-only while the device runs.
        write(&mut t, REG_QUEUE_SEL, 0);
        write(&mut t, REG_QUEUE_NUM, 4);
        write(&mut t, REG_QUEUE_READY, 0);
        assert_eq!(read(&mut t, REG_QUEUE_READY), 1);
        assert_eq!(t.queues[0].size(), 16);
        // Writing 0 to status resets the device and its queues.
        write(&mut t, REG_STATUS, 0);
        assert_eq!(counts.reset.load(Ordering::SeqCst), 1);
        assert_eq!(read(&mut t, REG_STATUS), 0);
        assert_eq!(read(&mut t, REG_QUEUE_READY), 0);
        assert!(!t.is_activated());
    }

    #[test]
    fn a_queue_outside_guest_memory_makes_the_device_need_reset() {
        let (mut t, counts) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 16, 0x1_0000);
        write(&mut t, REG_QUEUE_SEL, 1);
        write(&mut t, REG_QUEUE_NUM, 8);
        write(&mut t, REG_QUEUE_DESC_HIGH, 0x100);
        write(&mut t, REG_QUEUE_READY, 1);
        write(&mut t, REG_STATUS, RUNNING);
        assert_ne!(read(&mut t, REG_STATUS) & status::DEVICE_NEEDS_RESET, 0);
        assert!(!t.is_activated());
        assert_eq!(counts.activated.load(Ordering::SeqCst), 0);
        assert_ne!(read(&mut t, REG_INTERRUPT_STATUS) & INTERRUPT_CONFIG, 0);
        write(&mut t, REG_INTERRUPT_ACK, INTERRUPT_CONFIG);
        assert_eq!(read(&mut t, REG_INTERRUPT_STATUS), 0);
    }

    #[test]
    fn a_device_that_stops_serving_a_queue_asks_for_a_reset_once_until_reset() {
        let (mut t, counts) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, 0, 16, 0x1_0000);
        write(&mut t, REG_STATUS, RUNNING);
        assert!(t.is_activated());
        counts.stall_on_notify.store(true, Ordering::SeqCst);
        write(&mut t, REG_QUEUE_NOTIFY, 0);
        assert_ne!(read(&mut t, REG_STATUS) & status::DEVICE_NEEDS_RESET, 0);
        assert_ne!(read(&mut t, REG_INTERRUPT_STATUS) & INTERRUPT_CONFIG, 0);
        write(&mut t, REG_INTERRUPT_ACK, INTERRUPT_CONFIG);
        write(&mut t, REG_QUEUE_NOTIFY, 0);
        assert_eq!(
            read(&mut t, REG_INTERRUPT_STATUS) & INTERRUPT_CONFIG,
            0,
            "one configuration interrupt per stall"
        );
        counts.stall_on_notify.store(false, Ordering::SeqCst);
        write(&mut t, REG_STATUS, 0);
        assert_eq!(read(&mut t, REG_STATUS), 0);
        negotiate(&mut t);
        setup_queue(&mut t, 0, 16, 0x1_0000);
        write(&mut t, REG_STATUS, RUNNING);
        assert_eq!(read(&mut t, REG_STATUS) & status::DEVICE_NEEDS_RESET, 0);
    }

    #[test]
    fn odd_sized_and_unaligned_register_accesses_are_ignored() {
        let (mut t, _) = transport();
        let mut two = [0xffu8; 2];
        t.read(REG_MAGIC, &mut two);
        assert_eq!(two, [0, 0]);
        let mut four = [0xffu8; 4];
        t.read(REG_MAGIC + 1, &mut four);
        assert_eq!(four, [0; 4]);
        t.write(REG_STATUS, &[status::ACKNOWLEDGE as u8]);
        t.write(REG_STATUS + 2, &status::ACKNOWLEDGE.to_le_bytes());
        assert_eq!(read(&mut t, REG_STATUS), 0);
    }
}
