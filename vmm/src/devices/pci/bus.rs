//! The PCI root bus: a host bridge at 00:00.0, up to 31 more single-function devices on bus 0,
//! configuration access through ports CF8/CFC and through ECAM, BAR placement in the PCI
//! windows, and dispatch of MMIO in the windows to the BAR that decodes it.

use std::sync::{Arc, Mutex};

use super::config::{BarKind, BarRegion, ConfigSpace, DeviceIdentity};
use crate::arch::layout::{
    PCI_ECAM_SIZE, PCI_IO_SIZE, PCI_IO_START, PCI_MMIO32_SIZE, PCI_MMIO32_START,
};
use crate::vstate::bus::{lock, BusDevice};

/// Device slots on bus 0.
pub const SLOTS: usize = 32;
/// CF8: configuration enable bit.
const CONFIG_ENABLE: u32 = 1 << 31;
/// CF8 bits that hold state: enable, bus, device, function, dword register.
const CONFIG_ADDRESS_MASK: u32 = 0x80ff_fffc;
/// The host bridge's identity: Red Hat's "QEMU PCIe host bridge" ID, which Linux binds no
/// driver to, and class 06/00 (host bridge).
pub const HOST_BRIDGE: DeviceIdentity = DeviceIdentity {
    vendor: 0x1b36,
    device: 0x0008,
    revision: 0,
    class: [0x06, 0x00, 0x00],
    subsystem_vendor: 0x1b36,
    subsystem: 0x0008,
};

/// Errors from building the bus or placing BARs; each names the slot, BAR or window.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciBusError {
    /// Every slot on bus 0 is taken.
    #[error("PCI bus 0 is full ({SLOTS} slots)")]
    Full,
    /// The slot is taken or does not exist.
    #[error("PCI slot {0} is taken or out of range")]
    SlotTaken(usize),
    /// A BAR does not fit in its window.
    #[error(
        "BAR {bar} of device 00:{slot:02x}.0 ({size:#x} bytes) does not fit in the {window} window"
    )]
    NoRoom {
        /// The device's slot.
        slot: usize,
        /// The BAR index.
        bar: usize,
        /// The BAR's size.
        size: u64,
        /// Which window.
        window: &'static str,
    },
    /// The device refused an address the allocator chose (a bug).
    #[error("device 00:{slot:02x}.0 refused BAR {bar} at {addr:#x}")]
    Refused {
        /// The slot.
        slot: usize,
        /// The BAR.
        bar: usize,
        /// The address.
        addr: u64,
    },
}

/// A PCI function on the root bus.
pub trait PciDevice: Send {
    /// Its configuration space.
    fn config(&self) -> &ConfigSpace;
    /// Its configuration space, for firmware-style set-up (BAR placement).
    fn config_mut(&mut self) -> &mut ConfigSpace;
    /// Guest configuration read (already checked to be a 1, 2 or 4-byte aligned access).
    fn read_config(&mut self, offset: usize, data: &mut [u8]) {
        self.config().read(offset, data);
    }
    /// Guest configuration write; a device with capabilities that act (MSI-X message
    /// control) overrides this and looks at what changed.
    fn write_config(&mut self, offset: usize, data: &[u8]) {
        self.config_mut().write(offset, data);
    }
    /// Its MSI-X vectors, if it has MSI-X the VMM emulates (saved in a snapshot).
    fn msix(&self) -> Option<&super::msix::Msix> {
        None
    }
    /// Its MSI-X vectors, to restore them.
    fn msix_mut(&mut self) -> Option<&mut super::msix::Msix> {
        None
    }
    /// Guest read at `offset` in BAR `bar`.
    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        let _ = (bar, offset);
        data.fill(0xff);
    }
    /// Guest write at `offset` in BAR `bar`.
    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        let _ = (bar, offset, data);
    }
}

/// The host bridge at 00:00.0: a header and nothing else.
pub struct HostBridge {
    config: ConfigSpace,
}

impl Default for HostBridge {
    fn default() -> Self {
        Self {
            config: ConfigSpace::new(HOST_BRIDGE),
        }
    }
}

impl PciDevice for HostBridge {
    fn config(&self) -> &ConfigSpace {
        &self.config
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }
}

/// A shared PCI device.
pub type SharedPciDevice = Arc<Mutex<dyn PciDevice>>;

/// A bus, device, function and register, as CF8 and ECAM encode them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigAddress {
    /// Bus number.
    pub bus: u8,
    /// Device (slot) number, 0-31.
    pub device: u8,
    /// Function number, 0-7.
    pub function: u8,
    /// Byte offset in configuration space.
    pub register: usize,
}

impl ConfigAddress {
    /// Decodes an ECAM offset (from the ECAM base).
    pub fn from_ecam(offset: u64) -> Self {
        Self {
            bus: (offset >> 20) as u8,
            device: ((offset >> 15) & 0x1f) as u8,
            function: ((offset >> 12) & 0x7) as u8,
            register: (offset & 0xfff) as usize,
        }
    }

    /// Decodes a CF8 value plus the byte offset into CFC..CFF.
    pub fn from_cf8(address: u32, byte: u8) -> Self {
        Self {
            bus: (address >> 16) as u8,
            device: ((address >> 11) & 0x1f) as u8,
            function: ((address >> 8) & 0x7) as u8,
            register: (address & 0xfc) as usize + usize::from(byte),
        }
    }
}

/// A window BARs are placed in: a bump allocator that aligns each BAR to its size.
#[derive(Debug, Clone)]
pub struct Window {
    name: &'static str,
    next: u64,
    end: u64,
}

impl Window {
    /// The window `[start, start + size)`.
    pub fn new(name: &'static str, start: u64, size: u64) -> Self {
        Self {
            name,
            next: start,
            end: start.saturating_add(size),
        }
    }

    /// The next `size`-aligned range of `size` bytes.
    pub fn allocate(&mut self, size: u64) -> Option<u64> {
        let addr = self.next.checked_next_multiple_of(size)?;
        let end = addr.checked_add(size)?;
        (end <= self.end).then(|| {
            self.next = end;
            addr
        })
    }
}

/// The windows BARs are placed in.
#[derive(Debug, Clone)]
pub struct BarWindows {
    /// I/O BARs.
    pub io: Window,
    /// 32-bit memory BARs.
    pub mmio32: Window,
    /// 64-bit memory BARs, prefetchable or not.
    pub mmio64: Window,
}

impl BarWindows {
    /// The layout's windows, with the 64-bit one at `(start, size)` (see
    /// [`crate::arch::layout::pci_mmio64_window`]).
    pub fn new(mmio64: (u64, u64)) -> Self {
        Self {
            io: Window::new("I/O", PCI_IO_START, PCI_IO_SIZE),
            mmio32: Window::new("32-bit MMIO", PCI_MMIO32_START, PCI_MMIO32_SIZE),
            mmio64: Window::new("64-bit MMIO", mmio64.0, mmio64.1),
        }
    }
}

/// A BAR the allocator placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The device's slot.
    pub slot: usize,
    /// The BAR index.
    pub bar: usize,
    /// Its address.
    pub addr: u64,
    /// Its size.
    pub size: u64,
}

/// The root bus, bus 0.
pub struct PciRoot {
    slots: Vec<Option<SharedPciDevice>>,
}

impl Default for PciRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl PciRoot {
    /// A bus with the host bridge at 00:00.0.
    pub fn new() -> Self {
        let mut slots: Vec<Option<SharedPciDevice>> = vec![None; SLOTS];
        slots[0] = Some(Arc::new(Mutex::new(HostBridge::default())));
        Self { slots }
    }

    /// Puts `device` in the lowest free slot; returns the slot.
    pub fn add(&mut self, device: SharedPciDevice) -> Result<usize, PciBusError> {
        let slot = self
            .slots
            .iter()
            .position(Option::is_none)
            .ok_or(PciBusError::Full)?;
        self.slots[slot] = Some(device);
        Ok(slot)
    }

    /// Puts `device` in `slot`.
    pub fn add_at(&mut self, slot: usize, device: SharedPciDevice) -> Result<(), PciBusError> {
        match self.slots.get_mut(slot) {
            Some(entry @ None) => {
                *entry = Some(device);
                Ok(())
            }
            _ => Err(PciBusError::SlotTaken(slot)),
        }
    }

    /// The functions present, with their slots.
    pub fn functions(&self) -> impl Iterator<Item = (usize, &SharedPciDevice)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, device)| device.as_ref().map(|d| (slot, d)))
    }

    /// The function in `slot`, if any.
    pub fn function(&self, slot: usize) -> Option<&SharedPciDevice> {
        self.slots.get(slot)?.as_ref()
    }

    fn device(&self, address: ConfigAddress) -> Option<&SharedPciDevice> {
        if address.bus != 0 || address.function != 0 {
            return None;
        }
        self.slots.get(usize::from(address.device))?.as_ref()
    }

    /// Configuration read. An absent device, or a malformed access, reads all ones.
    pub fn config_read(&self, address: ConfigAddress, data: &mut [u8]) {
        match self.device(address) {
            Some(device) if ConfigSpace::access_ok(address.register, data.len()) => {
                lock(device).read_config(address.register, data)
            }
            _ => data.fill(0xff),
        }
    }

    /// Configuration write. Dropped for an absent device or a malformed access.
    pub fn config_write(&self, address: ConfigAddress, data: &[u8]) {
        if let Some(device) = self.device(address) {
            if ConfigSpace::access_ok(address.register, data.len()) {
                lock(device).write_config(address.register, data);
            }
        }
    }

    /// Places every BAR of every device, largest first so that natural alignment wastes no
    /// space, as firmware does before the guest boots.
    pub fn place_bars(&self, windows: &mut BarWindows) -> Result<Vec<Placement>, PciBusError> {
        let mut wanted = Vec::new();
        for (slot, device) in self.slots.iter().enumerate() {
            if let Some(device) = device {
                for (bar, declared) in lock(device).config().bars() {
                    wanted.push((slot, bar, declared));
                }
            }
        }
        wanted.sort_by_key(|&(slot, bar, declared)| (std::cmp::Reverse(declared.size), slot, bar));
        let mut placed = Vec::with_capacity(wanted.len());
        for (slot, bar, declared) in wanted {
            let window = match declared.kind {
                BarKind::Io => &mut windows.io,
                BarKind::Memory32 { .. } => &mut windows.mmio32,
                BarKind::Memory64 { .. } => &mut windows.mmio64,
            };
            let size = declared.size;
            let addr = window.allocate(size).ok_or(PciBusError::NoRoom {
                slot,
                bar,
                size,
                window: window.name,
            })?;
            if let Some(device) = &self.slots[slot] {
                lock(device)
                    .config_mut()
                    .set_bar_address(bar, addr)
                    .map_err(|_| PciBusError::Refused { slot, bar, addr })?;
            }
            placed.push(Placement {
                slot,
                bar,
                addr,
                size,
            });
        }
        Ok(placed)
    }

    /// The device and BAR that decode `[addr, addr + len)` now, with the offset in the BAR.
    fn decoder(&self, addr: u64, len: usize, io: bool) -> Option<(&SharedPciDevice, BarRegion)> {
        let end = addr.checked_add(len as u64)?;
        self.slots.iter().flatten().find_map(|device| {
            let region = lock(device).config().decoded_bars().find(|region| {
                (region.bar.kind == BarKind::Io) == io
                    && region.addr <= addr
                    && end <= region.addr + region.bar.size
            })?;
            Some((device, region))
        })
    }

    /// An MMIO read in a PCI window; false when no BAR decodes it.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) -> bool {
        self.bar_access(addr, data.len(), false, |device, region| {
            device.read_bar(region.index, addr - region.addr, data)
        })
    }

    /// An MMIO write in a PCI window; false when no BAR decodes it.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) -> bool {
        self.bar_access(addr, data.len(), false, |device, region| {
            device.write_bar(region.index, addr - region.addr, data)
        })
    }

    /// A port read in the PCI I/O window; false when no I/O BAR decodes it.
    pub fn io_read(&self, port: u64, data: &mut [u8]) -> bool {
        self.bar_access(port, data.len(), true, |device, region| {
            device.read_bar(region.index, port - region.addr, data)
        })
    }

    /// A port write in the PCI I/O window; false when no I/O BAR decodes it.
    pub fn io_write(&self, port: u64, data: &[u8]) -> bool {
        self.bar_access(port, data.len(), true, |device, region| {
            device.write_bar(region.index, port - region.addr, data)
        })
    }

    fn bar_access(
        &self,
        addr: u64,
        len: usize,
        io: bool,
        access: impl FnOnce(&mut dyn PciDevice, BarRegion),
    ) -> bool {
        match self.decoder(addr, len, io) {
            Some((device, region)) => {
                access(&mut *lock(device), region);
                true
            }
            None => false,
        }
    }
}

/// Ports CF8-CFF: the address register and the data window (configuration mechanism #1).
pub struct PciConfigIo {
    root: Arc<PciRoot>,
    address: u32,
}

impl PciConfigIo {
    /// Serves `root`; place it on the I/O bus at [`crate::arch::layout::PCI_CONFIG_IO_PORT`],
    /// 8 ports long.
    pub fn new(root: Arc<PciRoot>) -> Self {
        Self { root, address: 0 }
    }

    /// The CF8 address register.
    pub fn address(&self) -> u32 {
        self.address
    }

    /// Sets the CF8 address register (a restore); undefined bits are dropped.
    pub fn set_address(&mut self, address: u32) {
        self.address = address & CONFIG_ADDRESS_MASK;
    }

    fn data_address(&self, offset: u64, len: usize) -> Option<ConfigAddress> {
        let byte = offset.checked_sub(4)?;
        let in_dword = byte as usize + len <= 4;
        (self.address & CONFIG_ENABLE != 0 && in_dword)
            .then(|| ConfigAddress::from_cf8(self.address, byte as u8))
    }
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset == 0 && data.len() == 4 {
            data.copy_from_slice(&self.address.to_le_bytes());
            return;
        }
        match self.data_address(offset, data.len()) {
            Some(address) => self.root.config_read(address, data),
            None => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == 0 && data.len() == 4 {
            let mut value = [0u8; 4];
            value.copy_from_slice(data);
            self.address = u32::from_le_bytes(value) & CONFIG_ADDRESS_MASK;
            return;
        }
        if let Some(address) = self.data_address(offset, data.len()) {
            self.root.config_write(address, data);
        }
    }
}

/// The ECAM window: 4 KiB of configuration space per function, 1 MiB per bus.
pub struct PciEcam {
    root: Arc<PciRoot>,
}

impl PciEcam {
    /// Serves `root`; place it on the MMIO bus at [`crate::arch::layout::PCI_ECAM_START`],
    /// [`PCI_ECAM_SIZE`] long.
    pub fn new(root: Arc<PciRoot>) -> Self {
        Self { root }
    }
}

impl BusDevice for PciEcam {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= PCI_ECAM_SIZE {
            data.fill(0xff);
            return;
        }
        self.root
            .config_read(ConfigAddress::from_ecam(offset), data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset < PCI_ECAM_SIZE {
            self.root
                .config_write(ConfigAddress::from_ecam(offset), data);
        }
    }
}

/// A PCI memory window on the MMIO bus: accesses go to the BAR that decodes them.
pub struct PciMmioWindow {
    root: Arc<PciRoot>,
    base: u64,
}

impl PciMmioWindow {
    /// The window that starts at guest address `base`.
    pub fn new(root: Arc<PciRoot>, base: u64) -> Self {
        Self { root, base }
    }
}

impl BusDevice for PciMmioWindow {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if !self.root.mmio_read(self.base + offset, data) {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        self.root.mmio_write(self.base + offset, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::layout::{pci_mmio64_window, PCI_CONFIG_IO_PORT};
    use crate::devices::pci::config::{command, reg, Bar};
    use crate::vstate::bus::Bus;

    /// A device with a register file in BAR 0 and a big 64-bit prefetchable BAR 2.
    struct Scratch {
        config: ConfigSpace,
        registers: [u8; 16],
        last_bar: Option<usize>,
    }

    impl Scratch {
        fn new(big: u64) -> Self {
            let mut config = ConfigSpace::new(DeviceIdentity {
                vendor: 0x10de,
                device: 0x2335,
                class: [0x03, 0x02, 0x00],
                ..Default::default()
            });
            config
                .add_bar(
                    0,
                    Bar {
                        kind: BarKind::Memory32 {
                            prefetchable: false,
                        },
                        size: 16 << 20,
                    },
                )
                .expect("bar 0");
            config
                .add_bar(
                    2,
                    Bar {
                        kind: BarKind::Memory64 { prefetchable: true },
                        size: big,
                    },
                )
                .expect("bar 2");
            config
                .add_bar(
                    4,
                    Bar {
                        kind: BarKind::Io,
                        size: 0x80,
                    },
                )
                .expect("bar 4");
            Self {
                config,
                registers: [0; 16],
                last_bar: None,
            }
        }
    }

    impl PciDevice for Scratch {
        fn config(&self) -> &ConfigSpace {
            &self.config
        }
        fn config_mut(&mut self) -> &mut ConfigSpace {
            &mut self.config
        }
        fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
            self.last_bar = Some(bar);
            let at = (offset % 16) as usize;
            data.copy_from_slice(&self.registers[at..at + data.len()]);
        }
        fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
            self.last_bar = Some(bar);
            let at = (offset % 16) as usize;
            self.registers[at..at + data.len()].copy_from_slice(data);
        }
    }

    fn io_bus(root: Arc<PciRoot>) -> Bus {
        let mut bus = Bus::default();
        bus.insert(
            Arc::new(Mutex::new(PciConfigIo::new(root))),
            u64::from(PCI_CONFIG_IO_PORT),
            8,
        )
        .expect("cf8");
        bus
    }

    fn out32(bus: &Bus, port: u16, value: u32) {
        assert!(bus.write(u64::from(port), &value.to_le_bytes()));
    }

    fn in32(bus: &Bus, port: u16) -> u32 {
        let mut data = [0u8; 4];
        assert!(bus.read(u64::from(port), &mut data));
        u32::from_le_bytes(data)
    }

    fn cf8(device: u32, register: u32) -> u32 {
        0x8000_0000 | (device << 11) | register
    }

    #[test]
    fn cf8_cfc_reads_the_host_bridge_and_all_ones_elsewhere() {
        let bus = io_bus(Arc::new(PciRoot::new()));
        // Linux's type-1 probe: the address register reads back what was written.
        out32(&bus, 0xcf8, 0x8000_0000);
        assert_eq!(in32(&bus, 0xcf8), 0x8000_0000);
        out32(&bus, 0xcf8, 0xffff_ffff);
        assert_eq!(in32(&bus, 0xcf8), CONFIG_ADDRESS_MASK);
        out32(&bus, 0xcf8, cf8(0, 0));
        assert_eq!(in32(&bus, 0xcfc), 0x0008_1b36);
        out32(&bus, 0xcf8, cf8(0, 0x08));
        assert_eq!(in32(&bus, 0xcfc) >> 8, 0x06_00_00, "host bridge class");
        // An empty slot, another function, another bus: all ones.
        out32(&bus, 0xcf8, cf8(1, 0));
        assert_eq!(in32(&bus, 0xcfc), 0xffff_ffff);
        out32(&bus, 0xcf8, 0x8000_0100);
        assert_eq!(in32(&bus, 0xcfc), 0xffff_ffff);
        out32(&bus, 0xcf8, 0x8001_0000);
        assert_eq!(in32(&bus, 0xcfc), 0xffff_ffff);
        // Without the enable bit, the data port reads all ones.
        out32(&bus, 0xcf8, 0);
        assert_eq!(in32(&bus, 0xcfc), 0xffff_ffff);
    }

    #[test]
    fn byte_and_word_accesses_at_cfc_plus_n() {
        let root = Arc::new({
            let mut root = PciRoot::new();
            root.add(Arc::new(Mutex::new(Scratch::new(1 << 30))))
                .expect("slot");
            root
        });
        let bus = io_bus(root);
        out32(&bus, 0xcf8, cf8(1, 0));
        let mut byte = [0u8; 1];
        assert!(bus.read(0xcfd, &mut byte));
        assert_eq!(byte[0], 0x10, "vendor 0x10de, high byte");
        let mut word = [0u8; 2];
        assert!(bus.read(0xcfe, &mut word));
        assert_eq!(u16::from_le_bytes(word), 0x2335, "device ID");
        // A word at CFD would cross the dword: all ones.
        assert!(bus.read(0xcfd, &mut word));
        assert_eq!(word, [0xff, 0xff]);
        // A byte write to the command register's low byte through CFC.
        out32(&bus, 0xcf8, cf8(1, reg::COMMAND as u32));
        assert!(bus.write(0xcfc, &[command::MEMORY_SPACE as u8]));
        // A byte write to the status half (CFE) changes nothing it may not.
        assert!(bus.write(0xcfe, &[0xff]));
        assert_eq!(in32(&bus, 0xcfc), u32::from(command::MEMORY_SPACE));
    }

    #[test]
    fn ecam_reaches_the_same_space_and_the_extended_range() {
        let mut root = PciRoot::new();
        let slot = root
            .add(Arc::new(Mutex::new(Scratch::new(1 << 30))))
            .expect("slot");
        assert_eq!(slot, 1);
        let root = Arc::new(root);
        let mut ecam = PciEcam::new(root.clone());
        let at = |device: u64, register: u64| (device << 15) | register;
        let mut data = [0u8; 4];
        ecam.read(at(1, 0), &mut data);
        assert_eq!(u32::from_le_bytes(data), 0x2335_10de);
        ecam.read(at(1, 0x100), &mut data);
        assert_eq!(u32::from_le_bytes(data), 0, "no extended capabilities");
        ecam.read(at(1, 0) | (1 << 12), &mut data);
        assert_eq!(data, [0xff; 4], "function 1 is absent");
        ecam.read(at(2, 0), &mut data);
        assert_eq!(data, [0xff; 4]);
        ecam.read(PCI_ECAM_SIZE, &mut data);
        assert_eq!(data, [0xff; 4], "bus 1 is absent");
        // Size BAR 0 through ECAM; the result shows through CF8/CFC too.
        ecam.write(at(1, 0x10), &[0xff; 4]);
        let bus = io_bus(root);
        out32(&bus, 0xcf8, cf8(1, 0x10));
        assert_eq!(in32(&bus, 0xcfc), 0xff00_0000, "16 MiB BAR");
    }

    #[test]
    fn slots_fill_in_order_and_refuse_when_taken() {
        let mut root = PciRoot::new();
        let bridge = || Arc::new(Mutex::new(HostBridge::default())) as SharedPciDevice;
        assert_eq!(root.add_at(0, bridge()), Err(PciBusError::SlotTaken(0)));
        assert_eq!(root.add_at(32, bridge()), Err(PciBusError::SlotTaken(32)));
        root.add_at(5, bridge()).expect("slot 5");
        for expected in (1..32).filter(|&s| s != 5) {
            assert_eq!(root.add(bridge()), Ok(expected));
        }
        assert_eq!(root.add(bridge()), Err(PciBusError::Full));
    }

    #[test]
    fn bars_of_256_gib_land_above_ram_naturally_aligned() {
        let mut root = PciRoot::new();
        for _ in 0..2 {
            root.add(Arc::new(Mutex::new(Scratch::new(256 << 30))))
                .expect("slot");
        }
        let root = Arc::new(root);
        // 16 GiB of guest RAM, a host with 46 physical address bits.
        let window = pci_mmio64_window(16 << 30, 46).expect("window");
        let mut windows = BarWindows::new(window);
        let placed = root.place_bars(&mut windows).expect("placed");
        assert_eq!(placed.len(), 6);
        let big: Vec<_> = placed.iter().filter(|p| p.bar == 2).collect();
        assert_eq!(big[0].addr, 256 << 30);
        assert_eq!(big[1].addr, 512 << 30);
        for p in &placed {
            assert_eq!(p.addr % p.size, 0, "{p:?} aligned");
        }
        let small: Vec<_> = placed.iter().filter(|p| p.bar == 0).collect();
        assert_eq!(small[0].addr, PCI_MMIO32_START);
        assert_eq!(small[1].addr, PCI_MMIO32_START + (16 << 20));
        let io: Vec<_> = placed.iter().filter(|p| p.bar == 4).collect();
        assert_eq!(
            (io[0].addr, io[1].addr),
            (PCI_IO_START, PCI_IO_START + 0x80)
        );
        // The addresses are in the devices' BAR registers, as the guest will read them.
        let mut ecam = PciEcam::new(root.clone());
        let mut data = [0u8; 4];
        ecam.read((2 << 15) | 0x18, &mut data);
        assert_eq!(
            u32::from_le_bytes(data),
            0xc,
            "low half: 64-bit prefetchable"
        );
        ecam.read((2 << 15) | 0x1c, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0x80, "512 GiB >> 32");
    }

    #[test]
    fn a_bar_that_does_not_fit_names_itself() {
        let mut root = PciRoot::new();
        root.add(Arc::new(Mutex::new(Scratch::new(256 << 30))))
            .expect("slot");
        // 40 address bits: the window is 4 GiB..1 TiB; 256 GiB fits at 256 GiB.
        let mut windows = BarWindows::new(pci_mmio64_window(1 << 30, 40).expect("window"));
        assert!(root.place_bars(&mut windows).is_ok());
        // 38 bits: 4 GiB..256 GiB cannot hold it.
        let mut windows = BarWindows::new(pci_mmio64_window(1 << 30, 38).expect("window"));
        assert_eq!(
            root.place_bars(&mut windows),
            Err(PciBusError::NoRoom {
                slot: 1,
                bar: 2,
                size: 256 << 30,
                window: "64-bit MMIO"
            })
        );
    }

    #[test]
    fn window_accesses_reach_the_bar_only_while_decoding() {
        let device = Arc::new(Mutex::new(Scratch::new(1 << 30)));
        let mut root = PciRoot::new();
        root.add(device.clone()).expect("slot");
        let root = Arc::new(root);
        let mut windows = BarWindows::new((1 << 32, 1 << 36));
        root.place_bars(&mut windows).expect("placed");
        let mut mmio32 = PciMmioWindow::new(root.clone(), PCI_MMIO32_START);
        let mut data = [0u8; 4];
        mmio32.write(8, &[1, 2, 3, 4]);
        mmio32.read(8, &mut data);
        assert_eq!(data, [0xff; 4], "memory space is off");
        assert!(!root.mmio_read(1 << 32, &mut data));
        let address = ConfigAddress {
            bus: 0,
            device: 1,
            function: 0,
            register: reg::COMMAND,
        };
        root.config_write(
            address,
            &(command::MEMORY_SPACE | command::IO_SPACE).to_le_bytes(),
        );
        mmio32.write(8, &[1, 2, 3, 4]);
        mmio32.read(8, &mut data);
        assert_eq!(data, [1, 2, 3, 4]);
        assert_eq!(lock(&device).last_bar, Some(0));
        // The 1 GiB 64-bit BAR sits at the window's start, 4 GiB.
        assert!(root.mmio_read((1 << 32) + 8, &mut data));
        assert_eq!(lock(&device).last_bar, Some(2));
        assert!(root.io_write(PCI_IO_START + 4, &[9]));
        assert_eq!(lock(&device).last_bar, Some(4));
        // An access straddling the BAR's end is not decoded.
        assert!(!root.mmio_read(PCI_MMIO32_START + (16 << 20) - 2, &mut data));
        // Moving the BAR moves the decode.
        root.config_write(
            ConfigAddress {
                register: 0x10,
                ..address
            },
            &0xc100_0000u32.to_le_bytes(),
        );
        assert!(!root.mmio_read(PCI_MMIO32_START + 8, &mut data));
        assert!(root.mmio_read(0xc100_0008, &mut data));
    }
}
