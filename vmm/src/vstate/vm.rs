//! The KVM VM: memory slots, in-kernel irqchip and PIT.

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

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
    fd: VmFd,
}

impl Vm {
    /// Creates the VM. Memory must be registered before [`Vm::setup_irqchip`]: on PVM hosts a
    /// slot registered after the irqchip costs 5-10 ms, before it about 0.1 ms.
    pub fn new(kvm: &Kvm) -> Result<Self, VmError> {
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        fd.set_tss_address(TSS_ADDRESS).map_err(VmError::SetTss)?;
        Ok(Self { fd })
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
}

/// Opens /dev/kvm.
pub fn open_kvm() -> Result<Kvm, VmError> {
    Kvm::new().map_err(VmError::OpenKvm)
}
