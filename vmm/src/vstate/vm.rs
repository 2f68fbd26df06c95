//! The KVM VM: memory slots, in-kernel irqchip and PIT.

use crate::vstate::memory::GuestMemoryMmap;
use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

/// Errors from creating and configuring the KVM VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// /dev/kvm could not be opened.
    #[error("cannot open /dev/kvm: {0}")]
    OpenKvm(kvm_ioctls::Error),
    /// KVM_CREATE_VM failed.
    #[error("KVM_CREATE_VM failed: {0}")]
    CreateVm(kvm_ioctls::Error),
    /// KVM_SET_TSS_ADDR failed.
    #[error("KVM_SET_TSS_ADDR failed: {0}")]
    SetTss(kvm_ioctls::Error),
    /// KVM_SET_USER_MEMORY_REGION failed.
    #[error("KVM_SET_USER_MEMORY_REGION for slot {slot} at {guest_addr:#x} failed: {source}")]
    SetMemory {
        /// Memory slot.
        slot: u32,
        /// Guest address of the slot.
        guest_addr: u64,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// KVM_CREATE_IRQCHIP failed.
    #[error("KVM_CREATE_IRQCHIP failed: {0}")]
    CreateIrqchip(kvm_ioctls::Error),
    /// KVM_CREATE_PIT2 failed.
    #[error("KVM_CREATE_PIT2 failed: {0}")]
    CreatePit(kvm_ioctls::Error),
}

const TSS_ADDRESS: usize = 0xfffb_d000;

/// A KVM VM with its memory registered.
pub struct Vm {
    fd: std::sync::Arc<VmFd>,
}

impl Vm {
    /// Creates the VM. Memory must be registered before [`Vm::setup_irqchip`]: on PVM hosts a
    /// slot registered after the irqchip costs 5-10 ms, before it about 0.1 ms.
    pub fn new(kvm: &Kvm) -> Result<Self, VmError> {
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        fd.set_tss_address(TSS_ADDRESS).map_err(VmError::SetTss)?;
        Ok(Self {
            fd: std::sync::Arc::new(fd),
        })
    }

    /// Registers every region of `mem` as a KVM memory slot.
    pub fn register_memory(&self, mem: &GuestMemoryMmap, dirty_log: bool) -> Result<(), VmError> {
        for (slot, region) in mem.iter().enumerate() {
            let slot = slot as u32;
            let guest_addr = region.start_addr().0;
            let mapping = kvm_userspace_memory_region {
                slot,
                flags: if dirty_log {
                    KVM_MEM_LOG_DIRTY_PAGES
                } else {
                    0
                },
                guest_phys_addr: guest_addr,
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
            };
            // SAFETY: the region's host mapping stays alive as long as the VM: both are owned
            // by the microVM and dropped together, the VM first.
            unsafe { self.fd.set_user_memory_region(mapping) }.map_err(|source| {
                VmError::SetMemory {
                    slot,
                    guest_addr,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// Creates the in-kernel irqchip (PIC, IOAPIC, LAPICs) and the PIT.
    pub fn setup_irqchip(&self) -> Result<(), VmError> {
        self.fd.create_irq_chip().map_err(VmError::CreateIrqchip)?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.fd.create_pit2(pit).map_err(VmError::CreatePit)?;
        Ok(())
    }

    /// The KVM VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// The VM file descriptor, shared with devices that change memory slots or irqfds while
    /// the VM runs (VFIO BARs, MSI routes).
    pub fn shared_fd(&self) -> std::sync::Arc<VmFd> {
        std::sync::Arc::clone(&self.fd)
    }
}

/// Opens /dev/kvm.
pub fn open_kvm() -> Result<Kvm, VmError> {
    Kvm::new().map_err(VmError::OpenKvm)
}

/// The VM-wide KVM state: interrupt controllers, PIT and kvmclock.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct VmState {
    /// PIC master, PIC slave and IOAPIC, in KVM chip-id order.
    pub irqchips: Vec<kvm_bindings::kvm_irqchip>,
    /// The PIT.
    pub pit: kvm_bindings::kvm_pit_state2,
    /// kvmclock, so guest time continues rather than jumping.
    pub clock: kvm_bindings::kvm_clock_data,
}

const KVM_IRQCHIP_PIC_MASTER: u32 = 0;
const KVM_IRQCHIP_PIC_SLAVE: u32 = 1;
const KVM_IRQCHIP_IOAPIC: u32 = 2;

/// Errors from saving or restoring VM state.
#[derive(Debug, thiserror::Error)]
#[error("{what} failed: {source}")]
pub struct VmStateError {
    /// The ioctl.
    pub what: &'static str,
    /// The KVM error.
    pub source: kvm_ioctls::Error,
}

fn vm_state_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmStateError {
    move |source| VmStateError { what, source }
}

impl Vm {
    /// Saves irqchips, PIT and clock (vCPUs paused).
    pub fn save_state(&self) -> Result<VmState, VmStateError> {
        let mut irqchips = Vec::new();
        for chip_id in [
            KVM_IRQCHIP_PIC_MASTER,
            KVM_IRQCHIP_PIC_SLAVE,
            KVM_IRQCHIP_IOAPIC,
        ] {
            let mut chip = kvm_bindings::kvm_irqchip {
                chip_id,
                ..Default::default()
            };
            self.fd
                .get_irqchip(&mut chip)
                .map_err(vm_state_err("KVM_GET_IRQCHIP"))?;
            irqchips.push(chip);
        }
        Ok(VmState {
            irqchips,
            pit: self.fd.get_pit2().map_err(vm_state_err("KVM_GET_PIT2"))?,
            clock: self.fd.get_clock().map_err(vm_state_err("KVM_GET_CLOCK"))?,
        })
    }

    /// Restores irqchips, PIT and clock into a VM whose irqchip and PIT exist.
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmStateError> {
        self.fd
            .set_pit2(&state.pit)
            .map_err(vm_state_err("KVM_SET_PIT2"))?;
        // Guest time continues from the snapshot's instant. With the KVM_CLOCK_REALTIME flag
        // that KVM_GET_CLOCK reports, KVM would advance kvmclock by the wall time since the
        // snapshot: a jump that differs between two restores of one snapshot, and that the
        // guest's timekeeping mishandles after a long pause. The agent steps the wall clock.
        let mut clock = state.clock;
        clock.flags &= !(kvm_bindings::KVM_CLOCK_TSC_STABLE
            | kvm_bindings::KVM_CLOCK_REALTIME
            | kvm_bindings::KVM_CLOCK_HOST_TSC);
        self.fd
            .set_clock(&clock)
            .map_err(vm_state_err("KVM_SET_CLOCK"))?;
        for chip in &state.irqchips {
            self.fd
                .set_irqchip(chip)
                .map_err(vm_state_err("KVM_SET_IRQCHIP"))?;
        }
        Ok(())
    }

    /// Returns and clears KVM's dirty-page bitmap of memory slot `slot`.
    pub fn take_dirty_log(&self, slot: u32, len: usize) -> Result<Vec<u64>, VmStateError> {
        self.fd
            .get_dirty_log(slot, len)
            .map_err(vm_state_err("KVM_GET_DIRTY_LOG"))
    }
}

impl snapshot::Persist for Vm {
    type State = VmState;
    /// A VM with its memory registered and its irqchip and PIT created.
    type ConstructorArgs = Vm;
    type Error = VmStateError;

    fn save(&self) -> Result<VmState, VmStateError> {
        self.save_state()
    }

    fn restore(vm: Vm, state: &VmState) -> Result<Vm, VmStateError> {
        vm.restore_state(state)?;
        Ok(vm)
    }
}
