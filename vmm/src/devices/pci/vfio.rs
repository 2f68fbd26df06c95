//! VFIO passthrough of a host PCI function (`--vfio /sys/bus/pci/devices/DDDD:BB:DD.F`).
//!
//! The function must be bound to `vfio-pci` and its IOMMU group must hold no device bound to
//! another driver. All VFIO devices of a VM share one container (one IOMMU domain) into which
//! all guest memory is mapped for DMA, guest-physical address = IO virtual address.
//!
//! Configuration space goes to the device, except what is emulated here: the command
//! register is mirrored (and passed on), the BARs and the ROM BAR are virtual (the VMM places
//! them; there is no ROM), the interrupt pin reads 0 (no INTx), and the MSI and MSI-X
//! capabilities are kept here and turned into VFIO eventfds wired to KVM irqfds on MSI GSIs.
//! BARs that VFIO lets us mmap are mapped into the guest as KVM memory slots, except the pages
//! that hold the MSI-X table and PBA, which trap into the emulated table; other BARs trap and
//! go through VFIO's region reads and writes.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_create_device, kvm_device_type_KVM_DEV_TYPE_VFIO, kvm_userspace_memory_region,
};
use kvm_ioctls::VmFd;
use vfio_ioctls::{VfioContainer, VfioDevice, VfioDeviceFd, VfioOps};

use super::bus::PciDevice;
use super::config::{command, reg, Bar, BarKind, ConfigSpace, DeviceIdentity, BAR_COUNT};
use super::msix::{MsiMessage, Msix};
use super::router::{MsiRouter, RouterError, VectorIrq};
use crate::vstate::bus::lock;
use crate::vstate::memory::GuestMemoryMmap;

// VFIO's region and interrupt indexes for a PCI device (linux/vfio.h).
const CONFIG_REGION: u32 = 7;
const MSI_IRQ_INDEX: u32 = 1;
const MSIX_IRQ_INDEX: u32 = 2;
/// VFIO_REGION_INFO_FLAG_MMAP.
const REGION_MMAP: u32 = 1 << 2;
const PAGE: u64 = 4096;
const MSI_CAPABILITY_ID: u8 = 0x05;
const MSIX_CAPABILITY_ID: u8 = 0x11;
/// The ROM BAR register.
const ROM_BAR: usize = 0x30;
/// KVM memory slots for BAR mappings start here (guest RAM takes the first few).
pub const FIRST_BAR_SLOT: u32 = 32;
/// Slots each device may use: up to three pieces of each BAR around the MSI-X pages.
const SLOTS_PER_DEVICE: u32 = (BAR_COUNT as u32) * 3;

/// Errors from passing a device through; each names the device.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    /// The path is not a PCI device in sysfs.
    #[error("VFIO device {path}: not a PCI device in sysfs (expected /sys/bus/pci/devices/DDDD:BB:DD.F): {source}")]
    NotADevice {
        /// The path given.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The device is not bound to vfio-pci.
    #[error("VFIO device {path}: bound to {driver}, not vfio-pci (echo vfio-pci > {path}/driver_override, unbind it, then echo {name} > /sys/bus/pci/drivers/vfio-pci/bind)", name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default())]
    NotVfioPci {
        /// The device.
        path: PathBuf,
        /// Its driver, or "no driver".
        driver: String,
    },
    /// The device has no IOMMU group: no IOMMU.
    #[error("VFIO device {path}: no IOMMU group, so the host has no IOMMU enabled (boot it with intel_iommu=on or amd_iommu=on)")]
    NoIommu {
        /// The device.
        path: PathBuf,
    },
    /// Another device in the group is bound to a host driver.
    #[error("VFIO device {path}: IOMMU group {group} is not viable: {other} in the same group is bound to {driver}; bind every device of the group to vfio-pci")]
    GroupNotViable {
        /// The device.
        path: PathBuf,
        /// The group.
        group: u32,
        /// The other device.
        other: String,
        /// Its driver.
        driver: String,
    },
    /// /dev/vfio is missing or unusable.
    #[error("VFIO device {path}: {what}: {source}")]
    Dev {
        /// The device.
        path: PathBuf,
        /// What could not be opened.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A VFIO ioctl failed.
    #[error("VFIO device {path}: {what}: {source}")]
    Vfio {
        /// The device.
        path: PathBuf,
        /// What failed.
        what: &'static str,
        /// The VFIO error.
        source: vfio_ioctls::VfioError,
    },
    /// The KVM VFIO pseudo-device could not be created.
    #[error("VFIO device {path}: KVM_CREATE_DEVICE(KVM_DEV_TYPE_VFIO) failed: {source}")]
    KvmDevice {
        /// The first device.
        path: PathBuf,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// A BAR the emulation cannot take.
    #[error("VFIO device {path}: BAR {bar}: {detail}")]
    Bar {
        /// The device.
        path: PathBuf,
        /// The BAR.
        bar: usize,
        /// What is wrong.
        detail: String,
    },
    /// MSI-X set-up.
    #[error("VFIO device {path}: MSI-X: {detail}")]
    Msix {
        /// The device.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
}

/// Checks a `--vfio` path before any KVM or VFIO work: a PCI device bound to vfio-pci, in an
/// IOMMU group whose other devices are free or bound to vfio-pci, with its /dev/vfio group.
/// Returns the IOMMU group.
pub fn check_device(path: &Path) -> Result<u32, VfioError> {
    let not_a_device = |source| VfioError::NotADevice {
        path: path.to_path_buf(),
        source,
    };
    std::fs::metadata(path.join("config")).map_err(not_a_device)?;
    let driver = driver_of(path);
    if driver.as_deref() != Some("vfio-pci") {
        return Err(VfioError::NotVfioPci {
            path: path.to_path_buf(),
            driver: driver.unwrap_or_else(|| "no driver".into()),
        });
    }
    let group = std::fs::read_link(path.join("iommu_group"))
        .ok()
        .and_then(|link| link.file_name()?.to_str()?.parse::<u32>().ok())
        .ok_or_else(|| VfioError::NoIommu {
            path: path.to_path_buf(),
        })?;
    let own = path.canonicalize().map_err(not_a_device)?;
    let members = std::fs::read_dir(format!("/sys/kernel/iommu_groups/{group}/devices"))
        .map_err(not_a_device)?;
    for member in members.flatten() {
        let other = member.path();
        if other.canonicalize().ok().as_deref() == Some(own.as_path()) {
            continue;
        }
        match driver_of(&other) {
            None => {}
            Some(d) if d == "vfio-pci" || d == "pcieport" => {}
            Some(driver) => {
                return Err(VfioError::GroupNotViable {
                    path: path.to_path_buf(),
                    group,
                    other: member.file_name().to_string_lossy().into_owned(),
                    driver,
                })
            }
        }
    }
    for dev in ["/dev/vfio/vfio".to_string(), format!("/dev/vfio/{group}")] {
        std::fs::metadata(&dev).map_err(|source| VfioError::Dev {
            path: path.to_path_buf(),
            what: dev.clone(),
            source,
        })?;
    }
    Ok(group)
}

fn driver_of(path: &Path) -> Option<String> {
    let link = std::fs::read_link(path.join("driver")).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

/// The VFIO devices of one VM and the container they share.
pub struct VfioSet {
    /// The devices, in `--vfio` order.
    pub devices: Vec<Arc<Mutex<VfioPci>>>,
    /// Their sysfs paths.
    pub paths: Vec<PathBuf>,
}

/// Opens every device of `paths` (checked with [`check_device`]) into one container, maps all
/// of `mem` for DMA and builds their PCI functions. On failure everything opened so far is
/// closed again.
pub fn open_devices(
    vm: &Arc<VmFd>,
    mem: &GuestMemoryMmap,
    paths: &[PathBuf],
    router: &Arc<Mutex<MsiRouter>>,
) -> Result<VfioSet, VfioError> {
    let Some(first) = paths.first() else {
        return Ok(VfioSet {
            devices: Vec::new(),
            paths: Vec::new(),
        });
    };
    let mut kvm_vfio = kvm_create_device {
        type_: kvm_device_type_KVM_DEV_TYPE_VFIO,
        fd: 0,
        flags: 0,
    };
    let kvm_device = vm
        .create_device(&mut kvm_vfio)
        .map_err(|source| VfioError::KvmDevice {
            path: first.clone(),
            source,
        })?;
    let container = VfioContainer::new(Some(Arc::new(VfioDeviceFd::new_from_kvm(kvm_device))))
        .map_err(|source| VfioError::Vfio {
            path: first.clone(),
            what: "cannot open the VFIO container /dev/vfio/vfio with a type-1 IOMMU",
            source,
        })?;
    let container = Arc::new(container);
    let mut opened = Vec::new();
    for path in paths {
        let device = VfioDevice::new(path, Arc::clone(&container) as Arc<dyn VfioOps>, false)
            .map_err(|source| VfioError::Vfio {
                path: path.clone(),
                what: "cannot open its VFIO group and device (is it in use by another VM?)",
                source,
            })?;
        opened.push((path.clone(), Arc::new(device)));
    }
    // SAFETY: guest memory stays mapped while any device of this container lives: every
    // VfioPci holds a clone of `mem` and drops it after its device and container. The VMM
    // reaches guest memory only through vm-memory's volatile accessors, never references.
    unsafe { container.vfio_map_guest_memory(mem) }.map_err(|source| VfioError::Vfio {
        path: first.clone(),
        what: "cannot map guest memory for DMA (VFIO_IOMMU_MAP_DMA)",
        source,
    })?;
    let mut devices = Vec::new();
    for (index, (path, device)) in opened.into_iter().enumerate() {
        let slot_base = FIRST_BAR_SLOT + index as u32 * SLOTS_PER_DEVICE;
        let pci = VfioPci::new(
            path,
            device,
            Arc::clone(&container),
            mem.clone(),
            Arc::clone(vm),
            Arc::clone(router),
            slot_base,
        )?;
        devices.push(Arc::new(Mutex::new(pci)));
    }
    Ok(VfioSet {
        devices,
        paths: paths.to_vec(),
    })
}

/// A BAR's host mapping (VFIO region mmap) and the KVM slots it is mapped through.
struct BarMapping {
    host: *mut u8,
    size: u64,
    /// Page ranges (offsets in the BAR) that trap: the MSI-X table and PBA.
    holes: Vec<(u64, u64)>,
    /// Slots in use: (slot, guest address, offset in the BAR, size).
    slots: Vec<(u32, u64, u64, u64)>,
    first_slot: u32,
}

/// The MSI-X capability of the device, emulated.
struct MsixState {
    cap: usize,
    control: u16,
    table_bar: usize,
    table_offset: u64,
    pba_bar: usize,
    pba_offset: u64,
    state: Msix,
}

/// The MSI capability, emulated: the registers live in `regs` (a copy of the capability).
struct MsiState {
    cap: usize,
    regs: Vec<u8>,
    writable: Vec<u8>,
    wide: bool,
    per_vector_mask: bool,
    capable: u32,
}

impl MsiState {
    /// Where the pending bits are in `regs` (with per-vector masking only; the mask bits are
    /// the dword before).
    fn pending_at(&self) -> Option<usize> {
        let data = if self.wide { 12 } else { 8 };
        let at = data + 8;
        (self.per_vector_mask && at + 4 <= self.regs.len()).then_some(at)
    }
}

/// Interrupts enabled on the device: one GSI and eventfd per vector; a masked vector's
/// eventfd is no irqfd, so its signals wait there as the pending bit.
struct Vectors {
    index: u32,
    irqs: Vec<VectorIrq>,
}

/// A host PCI function passed through with VFIO.
pub struct VfioPci {
    path: PathBuf,
    config: ConfigSpace,
    bars: [Option<BarMapping>; BAR_COUNT],
    msix: Option<MsixState>,
    msi: Option<MsiState>,
    vectors: Option<Vectors>,
    vm: Arc<VmFd>,
    router: Arc<Mutex<MsiRouter>>,
    // Dropped in this order: the device, then the container, then guest memory.
    device: Arc<VfioDevice>,
    _container: Arc<VfioContainer>,
    _mem: GuestMemoryMmap,
}

// SAFETY: the raw pointers are this device's own mmaps of VFIO regions, used only under the
// device's mutex (as KVM slot addresses and for unmapping); nothing else aliases them.
unsafe impl Send for VfioPci {}

fn bytes_u32(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn bytes_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// Whether configuration byte `at` is emulated rather than the device's: the command
/// register, the BARs, the ROM BAR, interrupt line and pin.
fn emulated_header_byte(at: usize) -> bool {
    (reg::COMMAND..reg::COMMAND + 2).contains(&at)
        || (reg::BAR0..reg::BAR0 + 4 * BAR_COUNT).contains(&at)
        || (ROM_BAR..ROM_BAR + 4).contains(&at)
        || (reg::INTERRUPT_LINE..reg::INTERRUPT_LINE + 4).contains(&at)
}

impl VfioPci {
    #[allow(clippy::too_many_arguments)]
    fn new(
        path: PathBuf,
        device: Arc<VfioDevice>,
        container: Arc<VfioContainer>,
        mem: GuestMemoryMmap,
        vm: Arc<VmFd>,
        router: Arc<Mutex<MsiRouter>>,
        slot_base: u32,
    ) -> Result<Self, VfioError> {
        let mut header = vec![0u8; 256];
        device.region_read(CONFIG_REGION, &mut header, 0);
        let identity = DeviceIdentity {
            vendor: bytes_u16(&header, reg::VENDOR_ID),
            device: bytes_u16(&header, reg::DEVICE_ID),
            revision: header[reg::REVISION_ID],
            class: [header[0x0b], header[0x0a], header[0x09]],
            subsystem_vendor: bytes_u16(&header, reg::SUBSYSTEM_VENDOR_ID),
            subsystem: bytes_u16(&header, reg::SUBSYSTEM_ID),
        };
        if identity.vendor == 0xffff {
            return Err(VfioError::Bar {
                path,
                bar: 0,
                detail: "configuration space reads all ones (device gone or in reset)".into(),
            });
        }
        let mut config = ConfigSpace::new(identity);
        let mut index = 0;
        while index < BAR_COUNT {
            let size = device.get_region_size(index as u32);
            let low = bytes_u32(&header, reg::BAR0 + 4 * index);
            let kind = if low & 1 == 1 {
                BarKind::Io
            } else if low & 0b110 == 0b100 {
                BarKind::Memory64 {
                    prefetchable: low & 0b1000 != 0,
                }
            } else {
                BarKind::Memory32 {
                    prefetchable: low & 0b1000 != 0,
                }
            };
            if size > 0 {
                config
                    .add_bar(index, Bar { kind, size })
                    .map_err(|e| VfioError::Bar {
                        path: path.clone(),
                        bar: index,
                        detail: e.to_string(),
                    })?;
            }
            index += if matches!(kind, BarKind::Memory64 { .. }) {
                2
            } else {
                1
            };
        }
        let (msi, msix) = Self::capabilities(&path, &header, &device)?;
        let mut pci = Self {
            path,
            config,
            bars: Default::default(),
            msix,
            msi,
            vectors: None,
            vm,
            router,
            device,
            _container: container,
            _mem: mem,
        };
        pci.map_bars(slot_base);
        Ok(pci)
    }

    fn capabilities(
        path: &Path,
        header: &[u8],
        device: &VfioDevice,
    ) -> Result<(Option<MsiState>, Option<MsixState>), VfioError> {
        let (mut msi, mut msix) = (None, None);
        if bytes_u16(header, reg::STATUS) & super::config::STATUS_CAPABILITIES == 0 {
            return Ok((msi, msix));
        }
        let mut at = usize::from(header[reg::CAPABILITIES] & !3);
        let mut seen = 0;
        while at >= reg::FIRST_CAPABILITY && at + 4 <= header.len() && seen < 48 {
            seen += 1;
            match header[at] {
                MSI_CAPABILITY_ID => {
                    let control = bytes_u16(header, at + 2);
                    let wide = control & (1 << 7) != 0;
                    let per_vector_mask = control & (1 << 8) != 0;
                    let len = 10 + if wide { 4 } else { 0 } + if per_vector_mask { 10 } else { 0 };
                    let len = len.min(header.len() - at);
                    let regs = header[at..at + len].to_vec();
                    let mut writable = vec![0u8; len];
                    // Enable and multiple message enable; address; data; mask bits.
                    writable[2] = 0x71;
                    writable[4..8].copy_from_slice(&(!3u32).to_le_bytes());
                    let data = if wide {
                        writable[8..12].fill(0xff);
                        12
                    } else {
                        8
                    };
                    writable[data..data + 2].fill(0xff);
                    if per_vector_mask && data + 8 <= len {
                        writable[data + 4..data + 8].fill(0xff);
                    }
                    msi = Some(MsiState {
                        cap: at,
                        regs,
                        writable,
                        wide,
                        per_vector_mask,
                        capable: 1 << ((control >> 1) & 0b111).min(5),
                    });
                }
                MSIX_CAPABILITY_ID => {
                    let control = bytes_u16(header, at + 2);
                    let table = bytes_u32(header, at + 4);
                    let pba = bytes_u32(header, at + 8);
                    let vectors = usize::from(control & 0x7ff) + 1;
                    let state = Msix::new(vectors).map_err(|e| VfioError::Msix {
                        path: path.to_path_buf(),
                        detail: e.to_string(),
                    })?;
                    let available = device
                        .get_irq_info(MSIX_IRQ_INDEX)
                        .map(|irq| irq.count)
                        .unwrap_or(0);
                    if (available as usize) < vectors {
                        return Err(VfioError::Msix {
                            path: path.to_path_buf(),
                            detail: format!(
                                "the table has {vectors} vectors but VFIO offers {available}"
                            ),
                        });
                    }
                    msix = Some(MsixState {
                        cap: at,
                        control: control & !(0xc000),
                        table_bar: (table & 7) as usize,
                        table_offset: u64::from(table & !7),
                        pba_bar: (pba & 7) as usize,
                        pba_offset: u64::from(pba & !7),
                        state,
                    });
                }
                _ => {}
            }
            at = usize::from(header[at + 1] & !3);
        }
        Ok((msi, msix))
    }

    /// The device's sysfs path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// mmaps every BAR VFIO allows (at least a page) so it can be a KVM slot; others trap.
    fn map_bars(&mut self, slot_base: u32) {
        let bars: Vec<(usize, Bar)> = self.config.bars().collect();
        for (index, bar) in bars {
            let flags = self.device.get_region_flags(index as u32);
            if bar.kind == BarKind::Io || flags & REGION_MMAP == 0 || bar.size < PAGE {
                continue;
            }
            let offset = self.device.get_region_offset(index as u32);
            // SAFETY: a fresh shared mapping of the device fd's region at its VFIO offset;
            // the kernel checks the range. It is unmapped in `Drop`, after its KVM slots go.
            let host = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bar.size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    self.device.as_raw_fd(),
                    offset as libc::off_t,
                )
            };
            if host == libc::MAP_FAILED {
                log::warn!(
                    "VFIO device {}: BAR {index} cannot be mmapped ({}); its accesses trap",
                    self.path.display(),
                    std::io::Error::last_os_error()
                );
                continue;
            }
            let mut holes = Vec::new();
            if let Some(msix) = &self.msix {
                let table_bytes = msix.state.table_bytes();
                let pba_bytes = msix.state.pba_bytes();
                for (b, start, len) in [
                    (msix.table_bar, msix.table_offset, table_bytes),
                    (msix.pba_bar, msix.pba_offset, pba_bytes),
                ] {
                    if b == index {
                        let start = start / PAGE * PAGE;
                        let end = (start + len).next_multiple_of(PAGE);
                        holes.push((start, end.min(bar.size)));
                    }
                }
            }
            holes.sort_unstable();
            self.bars[index] = Some(BarMapping {
                host: host.cast(),
                size: bar.size,
                holes,
                slots: Vec::new(),
                first_slot: slot_base + index as u32 * 3,
            });
        }
    }

    /// Maps the decoded mmapped BARs at their current guest addresses and unmaps the rest.
    fn sync_bars(&mut self) {
        let decoded: Vec<(usize, u64)> = self
            .config
            .decoded_bars()
            .map(|region| (region.index, region.addr))
            .collect();
        for index in 0..BAR_COUNT {
            let vm = Arc::clone(&self.vm);
            let path = self.path.clone();
            let Some(mapping) = self.bars[index].as_mut() else {
                continue;
            };
            let addr = decoded.iter().find(|(i, _)| *i == index).map(|(_, a)| *a);
            let mut wanted = Vec::new();
            if let Some(addr) = addr.filter(|a| a % PAGE == 0) {
                let mut start = 0;
                let mut pieces = Vec::new();
                for &(hole_start, hole_end) in &mapping.holes {
                    if hole_start > start {
                        pieces.push((start, hole_start - start));
                    }
                    start = start.max(hole_end);
                }
                if start < mapping.size {
                    pieces.push((start, mapping.size - start));
                }
                for (n, (offset, size)) in pieces.into_iter().enumerate().take(3) {
                    wanted.push((mapping.first_slot + n as u32, addr + offset, offset, size));
                }
            }
            if wanted == mapping.slots {
                continue;
            }
            for &(slot, gpa, _, _) in &mapping.slots {
                set_slot(&vm, slot, gpa, 0, 0, &path);
            }
            mapping.slots.clear();
            for &(slot, gpa, offset, size) in &wanted {
                let host = mapping.host as u64 + offset;
                if set_slot(&vm, slot, gpa, size, host, &path) {
                    log::info!(
                        "VFIO device {}: BAR {index} at {gpa:#x} mapped into the guest \
                         (offset {offset:#x}, {size:#x} bytes, KVM slot {slot})",
                        path.display()
                    );
                    mapping.slots.push((slot, gpa, offset, size));
                }
            }
        }
    }

    /// As firmware would: turns on memory and I/O decoding for the BARs placed before boot,
    /// so the guest finds the device working without a driver having enabled it.
    pub fn enable_decoding(&mut self) {
        let mut bits = 0;
        for (_, bar) in self.config.bars() {
            bits |= match bar.kind {
                BarKind::Io => command::IO_SPACE,
                _ => command::MEMORY_SPACE,
            };
        }
        let value = self.config.command() | bits;
        self.write_config(reg::COMMAND, &value.to_le_bytes());
    }

    fn msix_control_range(&self) -> Option<std::ops::Range<usize>> {
        self.msix.as_ref().map(|m| m.cap + 2..m.cap + 4)
    }

    fn msi_range(&self) -> Option<std::ops::Range<usize>> {
        self.msi.as_ref().map(|m| m.cap + 2..m.cap + m.regs.len())
    }

    /// Disables the device's interrupts and gives back their GSIs and irqfds.
    fn disable_vectors(&mut self) {
        let Some(vectors) = self.vectors.take() else {
            return;
        };
        if let Err(e) = self.device.disable_irq(vectors.index) {
            log::warn!(
                "VFIO device {}: disabling interrupts: {e}",
                self.path.display()
            );
        }
        let mut router = lock(&self.router);
        for mut irq in vectors.irqs {
            let _ = irq.mask(&self.vm);
            let _ = router.release(irq.gsi());
        }
        if let Err(e) = router.apply(&self.vm) {
            log::error!("VFIO device {}: {e}", self.path.display());
        }
    }

    /// Enables `count` vectors of VFIO interrupt `index`, each on a GSI with an irqfd.
    fn enable_vectors(&mut self, index: u32, count: usize) -> Result<(), String> {
        let mut irqs: Vec<VectorIrq> = Vec::new();
        let mut gsis = Vec::new();
        let result = (|| {
            let mut router = lock(&self.router);
            for _ in 0..count {
                let gsi = router.allocate().map_err(|e| e.to_string())?;
                gsis.push(gsi);
                irqs.push(
                    VectorIrq::new(&router, &self.vm, gsi)
                        .map_err(|e: RouterError| e.to_string())?,
                );
            }
            drop(router);
            self.device
                .enable_irq(index, irqs.iter().map(VectorIrq::fd).collect())
                .map_err(|e| format!("VFIO_DEVICE_SET_IRQS: {e}"))
        })();
        if let Err(e) = result {
            let mut router = lock(&self.router);
            for irq in &mut irqs {
                let _ = irq.mask(&self.vm);
            }
            for gsi in &gsis {
                let _ = router.release(*gsi);
            }
            return Err(e);
        }
        log::info!(
            "VFIO device {}: {count} {} vector(s) enabled on GSIs {gsis:?}",
            self.path.display(),
            if index == MSIX_IRQ_INDEX {
                "MSI-X"
            } else {
                "MSI"
            }
        );
        self.vectors = Some(Vectors { index, irqs });
        Ok(())
    }

    /// Points each enabled vector's GSI at its message, or masks it (no route, no irqfd: its
    /// signals stay pending in the eventfd). An unmasked vector's pending signals are
    /// delivered, and so is every vector in `pending` (bits the VMM had taken already).
    fn route_vectors(&mut self, messages: &[Option<MsiMessage>], pending: &[u16]) {
        let Some(vectors) = &mut self.vectors else {
            return;
        };
        let path = &self.path;
        for (irq, message) in vectors.irqs.iter_mut().zip(messages) {
            if message.is_none() {
                if let Err(e) = irq.mask(&self.vm) {
                    log::error!("VFIO device {}: masking: {e}", path.display());
                }
            }
        }
        let mut router = lock(&self.router);
        for (irq, message) in vectors.irqs.iter().zip(messages) {
            let _ = router.set_route(irq.gsi(), *message);
        }
        if let Err(e) = router.apply(&self.vm) {
            log::error!("VFIO device {}: {e}", path.display());
        }
        drop(router);
        for (vector, (irq, message)) in vectors.irqs.iter_mut().zip(messages).enumerate() {
            if message.is_some() {
                let taken = pending.contains(&(vector as u16));
                if let Err(e) = irq.unmask(&self.vm, taken) {
                    log::error!("VFIO device {}: unmasking: {e}", path.display());
                }
            }
        }
    }

    /// Moves signals that arrived on masked vectors into the emulated pending bits (the MSI-X
    /// PBA, the MSI pending register), before the guest reads them.
    fn collect_pending(&mut self) {
        let Some(vectors) = &mut self.vectors else {
            return;
        };
        for (vector, irq) in vectors.irqs.iter_mut().enumerate() {
            if !irq.take_pending() {
                continue;
            }
            if vectors.index == MSIX_IRQ_INDEX {
                if let Some(msix) = &mut self.msix {
                    let _ = msix.state.signal(vector as u16);
                }
            } else if let Some(msi) = &mut self.msi {
                if let Some(at) = msi.pending_at() {
                    let bits = bytes_u32(&msi.regs, at) | (1 << vector);
                    msi.regs[at..at + 4].copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
    }

    /// After a write to the MSI-X control or table: enables, disables or reroutes; `pending`
    /// are vectors the write unmasked with their pending bit set.
    fn update_msix(&mut self, pending: &[u16]) {
        let Some(msix) = &self.msix else { return };
        let enabled = msix.state.enabled();
        let count = usize::from(msix.state.vectors());
        let messages: Vec<Option<MsiMessage>> =
            (0..count as u16).map(|v| msix.state.message(v)).collect();
        let on = self.vectors.as_ref().map(|v| v.index);
        if !enabled {
            if on.is_some() {
                self.disable_vectors();
            }
            return;
        }
        if on != Some(MSIX_IRQ_INDEX) {
            self.disable_vectors();
            if let Err(e) = self.enable_vectors(MSIX_IRQ_INDEX, count) {
                log::error!("VFIO device {}: MSI-X: {e}", self.path.display());
                return;
            }
        }
        self.route_vectors(&messages, pending);
    }

    /// After a write to the MSI capability.
    fn update_msi(&mut self) {
        // Pending bits of vectors the guest unmasked are delivered and cleared.
        let mut pending = Vec::new();
        if let Some(msi) = &mut self.msi {
            if let Some(at) = msi.pending_at() {
                let mask = bytes_u32(&msi.regs, at - 4);
                let bits = bytes_u32(&msi.regs, at);
                let delivered = bits & !mask;
                pending = (0..32u16).filter(|v| delivered & (1 << v) != 0).collect();
                msi.regs[at..at + 4].copy_from_slice(&(bits & mask).to_le_bytes());
            }
        }
        let Some(msi) = &self.msi else { return };
        let control = bytes_u16(&msi.regs, 2);
        let enabled = control & 1 != 0;
        let count = (1u32 << ((control >> 4) & 0b111).min(5)).min(msi.capable) as usize;
        let address_low = u64::from(bytes_u32(&msi.regs, 4));
        let (address, data_at) = if msi.wide {
            (address_low | (u64::from(bytes_u32(&msi.regs, 8)) << 32), 12)
        } else {
            (address_low, 8)
        };
        let data = u32::from(bytes_u16(&msi.regs, data_at));
        let mask = if msi.per_vector_mask {
            bytes_u32(&msi.regs, data_at + 4)
        } else {
            0
        };
        let messages: Vec<Option<MsiMessage>> = (0..count as u32)
            .map(|v| {
                (mask & (1 << v) == 0).then_some(MsiMessage {
                    address,
                    data: (data & !(count as u32 - 1)) | v,
                })
            })
            .collect();
        let on = self.vectors.as_ref().map(|v| (v.index, v.irqs.len()));
        if !enabled {
            if on.is_some() {
                self.disable_vectors();
            }
            return;
        }
        if on != Some((MSI_IRQ_INDEX, count)) {
            self.disable_vectors();
            if let Err(e) = self.enable_vectors(MSI_IRQ_INDEX, count) {
                log::error!("VFIO device {}: MSI: {e}", self.path.display());
                return;
            }
        }
        self.route_vectors(&messages, &pending);
    }

    /// Resets the device (if it can be) so the next VM gets it clean.
    fn reset(&self) {
        self.device.reset();
    }

    fn msix_place(&self, bar: usize, offset: u64, len: usize) -> Option<(bool, u64)> {
        let msix = self.msix.as_ref()?;
        let inside = |b: usize, start: u64, size: u64| {
            (b == bar && offset >= start && offset + len as u64 <= start + size)
                .then(|| offset - start)
        };
        inside(msix.table_bar, msix.table_offset, msix.state.table_bytes())
            .map(|at| (true, at))
            .or_else(|| {
                inside(msix.pba_bar, msix.pba_offset, msix.state.pba_bytes()).map(|at| (false, at))
            })
    }
}

/// Sets KVM slot `slot` to `size` bytes at guest `gpa` backed by host address `host`
/// (size 0 deletes it). Logs and returns false on failure.
fn set_slot(vm: &VmFd, slot: u32, gpa: u64, size: u64, host: u64, path: &Path) -> bool {
    let region = kvm_userspace_memory_region {
        slot,
        flags: 0,
        guest_phys_addr: gpa,
        memory_size: size,
        userspace_addr: host,
    };
    // SAFETY: `host` is this device's own mmap of the BAR, which stays mapped until the slot
    // is deleted (Drop deletes every slot before it unmaps); a deletion passes no memory.
    match unsafe { vm.set_user_memory_region(region) } {
        Ok(()) => true,
        Err(e) => {
            log::error!(
                "VFIO device {}: KVM slot {slot} at {gpa:#x} ({size:#x} bytes): {e}",
                path.display()
            );
            false
        }
    }
}

impl PciDevice for VfioPci {
    fn config(&self) -> &ConfigSpace {
        &self.config
    }

    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }

    fn read_config(&mut self, offset: usize, data: &mut [u8]) {
        // Beyond the device's configuration region (conventional PCI above 256) reads zero.
        data.fill(0);
        self.device.region_read(CONFIG_REGION, data, offset as u64);
        let mut emulated = [0u8; 4];
        self.config.read(offset & !3, &mut emulated);
        let msix_control = self.msix_control_range();
        let msi = self.msi_range();
        if msi
            .as_ref()
            .is_some_and(|r| offset < r.end && r.start < offset + data.len())
        {
            self.collect_pending();
        }
        for (i, byte) in data.iter_mut().enumerate() {
            let at = offset + i;
            // No INTx pin and no ROM.
            if at == reg::INTERRUPT_PIN || (ROM_BAR..ROM_BAR + 4).contains(&at) {
                *byte = 0;
            } else if emulated_header_byte(at) {
                *byte = emulated[at & 3];
            } else if let (Some(range), Some(msix)) = (&msix_control, &self.msix) {
                if range.contains(&at) {
                    *byte = msix.control.to_le_bytes()[at - range.start];
                }
            }
            if let (Some(range), Some(m)) = (&msi, &self.msi) {
                if range.contains(&at) {
                    *byte = m.regs[at - m.cap];
                }
            }
        }
    }

    fn write_config(&mut self, offset: usize, data: &[u8]) {
        let end = offset + data.len();
        let touches = |range: std::ops::Range<usize>| offset < range.end && range.start < end;
        let bars_or_command = touches(reg::COMMAND..reg::COMMAND + 2)
            || touches(reg::BAR0..reg::BAR0 + 4 * BAR_COUNT);
        self.config.write(offset, data);
        if let Some(range) = self.msi_range() {
            if touches(range.clone()) {
                if let Some(msi) = self.msi.as_mut() {
                    for (i, &value) in data.iter().enumerate() {
                        let at = offset + i;
                        if range.contains(&at) {
                            let r = at - msi.cap;
                            let w = msi.writable[r];
                            msi.regs[r] = (msi.regs[r] & !w) | (value & w);
                        }
                    }
                }
                self.update_msi();
                return;
            }
        }
        if let Some(range) = self.msix_control_range() {
            if touches(range.clone()) {
                if let Some(msix) = self.msix.as_mut() {
                    let mut control = msix.control.to_le_bytes();
                    for (i, &value) in data.iter().enumerate() {
                        if range.contains(&(offset + i)) {
                            control[offset + i - range.start] = value;
                        }
                    }
                    let value = u16::from_le_bytes(control) & 0xc000;
                    msix.control = (msix.control & 0x3fff) | value;
                }
                self.collect_pending();
                let pending: Vec<u16> = match self.msix.as_mut() {
                    Some(msix) => msix
                        .state
                        .control_written(msix.control)
                        .into_iter()
                        .map(|(vector, _)| vector)
                        .collect(),
                    None => Vec::new(),
                };
                self.update_msix(&pending);
                return;
            }
        }
        let virtual_only =
            touches(reg::BAR0..reg::BAR0 + 4 * BAR_COUNT) || touches(ROM_BAR..ROM_BAR + 4);
        if !virtual_only {
            self.device.region_write(CONFIG_REGION, data, offset as u64);
        }
        if bars_or_command {
            self.sync_bars();
        }
    }

    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if let Some((table, at)) = self.msix_place(bar, offset, data.len()) {
            if !table {
                self.collect_pending();
            }
            if let Some(msix) = &self.msix {
                let result = if table {
                    msix.state.read_table(at, data)
                } else {
                    msix.state.read_pba(at, data)
                };
                if result.is_err() {
                    data.fill(0xff);
                }
            }
            return;
        }
        self.device.region_read(bar as u32, data, offset);
    }

    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if let Some((table, at)) = self.msix_place(bar, offset, data.len()) {
            if table {
                // Signals that came while masked are pending bits before an unmask delivers them.
                self.collect_pending();
                let written = self
                    .msix
                    .as_mut()
                    .map(|msix| msix.state.write_table(at, data));
                if let Some(Ok(delivered)) = written {
                    let pending: Vec<u16> = delivered.into_iter().map(|(v, _)| v).collect();
                    self.update_msix(&pending);
                }
            }
            return;
        }
        self.device.region_write(bar as u32, data, offset);
    }
}

impl Drop for VfioPci {
    fn drop(&mut self) {
        for mapping in self.bars.iter_mut().flatten() {
            for &(slot, gpa, _, _) in &mapping.slots {
                set_slot(&self.vm, slot, gpa, 0, 0, &self.path);
            }
            mapping.slots.clear();
            // SAFETY: our own mapping from `map_bars`, no longer in any KVM slot.
            unsafe { libc::munmap(mapping.host.cast(), mapping.size as usize) };
        }
        self.disable_vectors();
        self.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msi_pending_bits_follow_the_mask_bits_in_either_layout() {
        let state = |wide: bool, per_vector_mask: bool, len: usize| MsiState {
            cap: 0x50,
            regs: vec![0; len],
            writable: vec![0; len],
            wide,
            per_vector_mask,
            capable: 4,
        };
        // 64-bit: mask at 0x10, pending at 0x14; 32-bit: mask at 0x0c, pending at 0x10.
        assert_eq!(state(true, true, 24).pending_at(), Some(20));
        assert_eq!(state(false, true, 20).pending_at(), Some(16));
        assert_eq!(
            state(true, false, 14).pending_at(),
            None,
            "no masks, no pending bits"
        );
        assert_eq!(
            state(true, true, 20).pending_at(),
            None,
            "a cut-off capability"
        );
    }

    /// A fake sysfs device directory: `config`, and a `driver` link when given.
    fn fake_device(dir: &Path, driver: Option<&str>) -> PathBuf {
        let dev = dir.join("0000:00:04.0");
        std::fs::create_dir_all(&dev).expect("dir");
        std::fs::write(dev.join("config"), [0u8; 64]).expect("config");
        if let Some(driver) = driver {
            let target = dir.join("drivers").join(driver);
            std::fs::create_dir_all(&target).expect("driver dir");
            std::os::unix::fs::symlink(&target, dev.join("driver")).expect("link");
        }
        dev
    }

    #[test]
    fn checks_name_the_device_and_what_is_wrong() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("0000:ff:1f.7");
        let err = check_device(&missing).expect_err("missing");
        assert!(matches!(err, VfioError::NotADevice { .. }), "{err}");
        assert!(err.to_string().contains("0000:ff:1f.7"), "{err}");

        let dev = fake_device(dir.path(), Some("e1000"));
        let err = check_device(&dev).expect_err("other driver");
        let text = err.to_string();
        assert!(text.contains("bound to e1000, not vfio-pci"), "{text}");
        assert!(text.contains("drivers/vfio-pci/bind"), "{text}");

        let other = tempfile::tempdir().expect("tempdir");
        let dev = fake_device(other.path(), None);
        let err = check_device(&dev).expect_err("no driver");
        assert!(err.to_string().contains("bound to no driver"), "{err}");

        let third = tempfile::tempdir().expect("tempdir");
        let dev = fake_device(third.path(), Some("vfio-pci"));
        let err = check_device(&dev).expect_err("no group");
        assert!(matches!(err, VfioError::NoIommu { .. }), "{err}");
        assert!(err.to_string().contains("intel_iommu=on"), "{err}");
    }

    #[test]
    fn emulated_header_bytes_are_command_bars_rom_and_interrupt() {
        for at in [0x04, 0x05, 0x10, 0x27, 0x30, 0x33, 0x3c, 0x3d] {
            assert!(emulated_header_byte(at), "{at:#x}");
        }
        for at in [0x00, 0x02, 0x06, 0x08, 0x2c, 0x34, 0x40, 0x100] {
            assert!(!emulated_header_byte(at), "{at:#x}");
        }
    }
}
