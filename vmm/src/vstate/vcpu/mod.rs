//! vCPUs: creation and boot set-up (MSRs, registers, LAPIC). Beside it: CPUID (`cpuid.rs`),
//! the run loop on the vCPU's own thread (`run.rs`) and state save/restore (`persist.rs`).

mod cpuid;
mod persist;
mod run;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use crate::arch::regs::{boot_fpu, boot_regs, boot_sregs};
use crate::vstate::bus::lock;

pub use persist::{restore_vcpu_state, saveable_msrs, VcpuRestoreArgs, VcpuState};
pub use run::{
    install_kick_handler, ExitHandlers, ExitReport, RunState, VcpuHandle, VmExit, PAUSE_TIMEOUT,
};

/// Errors from creating, configuring and running vCPUs.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// KVM_CREATE_VCPU failed.
    #[error("KVM_CREATE_VCPU {index} failed: {source}")]
    Create {
        /// vCPU index.
        index: u8,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// A KVM ioctl used to configure the vCPU failed.
    #[error("vCPU {index}: {what} failed: {source}")]
    Configure {
        /// vCPU index.
        index: u8,
        /// The ioctl.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// KVM refused some of the boot MSRs.
    #[error(
        "vCPU {index}: KVM accepted only {set} of {wanted} boot MSRs (first refused: {refused:#x})"
    )]
    Msrs {
        /// vCPU index.
        index: u8,
        /// MSRs KVM set.
        set: usize,
        /// MSRs we asked for.
        wanted: usize,
        /// The first refused MSR.
        refused: u32,
    },
    /// Building a KVM FAM structure failed.
    #[error("vCPU {index}: {what}: {detail}")]
    Fam {
        /// vCPU index.
        index: u8,
        /// The structure.
        what: &'static str,
        /// The error.
        detail: String,
    },
    /// The signal used to kick vCPUs out of KVM_RUN could not be installed.
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    /// The vCPU did not leave KVM_RUN within the pause timeout; it keeps running.
    #[error("vCPU {index} did not pause within {waited:?} (blocked in a device, or on guest memory that is not served); the VM keeps running")]
    PauseTimeout {
        /// vCPU index.
        index: u8,
        /// How long the pause waited.
        waited: Duration,
    },
    /// The vCPU thread could not be spawned.
    #[error("cannot spawn the thread of vCPU {index}: {source}")]
    Spawn {
        /// vCPU index.
        index: u8,
        /// The I/O error.
        source: std::io::Error,
    },
}

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_IA32_MISC_ENABLE_FAST_STRING: u64 = 1;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRs enabled, default type write-back.
const MTRR_DEF_TYPE_WB_ENABLED: u64 = (1 << 11) | 6;

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// A vCPU: its KVM file descriptor (shared with its thread once started) and what a
/// snapshot of it needs.
#[derive(Clone)]
pub struct Vcpu {
    index: u8,
    fd: Arc<Mutex<VcpuFd>>,
    saveable_msrs: Arc<Vec<u32>>,
}

impl Vcpu {
    /// Creates vCPU `index`.
    pub fn new(vm: &VmFd, index: u8, saveable_msrs: Arc<Vec<u32>>) -> Result<Self, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Create { index, source })?;
        Ok(Self {
            index,
            fd: Arc::new(Mutex::new(fd)),
            saveable_msrs,
        })
    }

    fn configure_err(&self, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
        let index = self.index;
        move |source| VcpuError::Configure {
            index,
            what,
            source,
        }
    }

    /// Sets CPUID from KVM's supported list, filtered for this vCPU's topology. A
    /// `deterministic` machine gets no RDRAND or RDSEED.
    /// Sets the MSRs Linux expects at boot, only those KVM lists as supported.
    pub fn configure_msrs(&self, kvm: &Kvm) -> Result<(), VcpuError> {
        let supported = kvm
            .get_msr_index_list()
            .map_err(self.configure_err("KVM_GET_MSR_INDEX_LIST"))?;
        let supported = supported.as_slice();
        let wanted: Vec<kvm_msr_entry> = [
            (MSR_IA32_SYSENTER_CS, 0),
            (MSR_IA32_SYSENTER_ESP, 0),
            (MSR_IA32_SYSENTER_EIP, 0),
            (MSR_STAR, 0),
            (MSR_CSTAR, 0),
            (MSR_KERNEL_GS_BASE, 0),
            (MSR_SYSCALL_MASK, 0),
            (MSR_LSTAR, 0),
            (MSR_IA32_TSC, 0),
            (MSR_IA32_MISC_ENABLE, MSR_IA32_MISC_ENABLE_FAST_STRING),
            (MSR_MTRR_DEF_TYPE, MTRR_DEF_TYPE_WB_ENABLED),
        ]
        .into_iter()
        .filter(|(index, _)| supported.contains(index))
        .map(|(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
        let msrs = Msrs::from_entries(&wanted).map_err(|e| VcpuError::Fam {
            index: self.index,
            what: "boot MSR list",
            detail: format!("{e:?}"),
        })?;
        let set = lock(&self.fd)
            .set_msrs(&msrs)
            .map_err(self.configure_err("KVM_SET_MSRS"))?;
        if set != wanted.len() {
            return Err(VcpuError::Msrs {
                index: self.index,
                set,
                wanted: wanted.len(),
                refused: wanted.get(set).map(|m| m.index).unwrap_or(0),
            });
        }
        Ok(())
    }

    /// Sets registers, segments, FPU and LAPIC for the 64-bit Linux entry point. Only the
    /// boot vCPU gets the entry registers; the others wait for INIT/SIPI.
    pub fn configure_boot_state(&self, entry: u64) -> Result<(), VcpuError> {
        let fd = lock(&self.fd);
        if self.index == 0 {
            let sregs = fd
                .get_sregs()
                .map_err(self.configure_err("KVM_GET_SREGS"))?;
            fd.set_sregs(&boot_sregs(sregs))
                .map_err(self.configure_err("KVM_SET_SREGS"))?;
            fd.set_regs(&boot_regs(entry))
                .map_err(self.configure_err("KVM_SET_REGS"))?;
        }
        fd.set_fpu(&boot_fpu())
            .map_err(self.configure_err("KVM_SET_FPU"))?;
        let mut lapic = fd
            .get_lapic()
            .map_err(self.configure_err("KVM_GET_LAPIC"))?;
        set_lvt_delivery_mode(&mut lapic.regs, APIC_LVT0, APIC_MODE_EXTINT);
        set_lvt_delivery_mode(&mut lapic.regs, APIC_LVT1, APIC_MODE_NMI);
        fd.set_lapic(&lapic)
            .map_err(self.configure_err("KVM_SET_LAPIC"))?;
        Ok(())
    }
}

fn set_lvt_delivery_mode(regs: &mut [std::os::raw::c_char; 1024], offset: usize, mode: u32) {
    let mut bytes = [0u8; 4];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = regs[offset + i] as u8;
    }
    let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
    for (i, b) in value.to_le_bytes().iter().enumerate() {
        regs[offset + i] = *b as std::os::raw::c_char;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lvt_mode_is_replaced() {
        let mut regs = [0 as std::os::raw::c_char; 1024];
        regs[APIC_LVT0 + 1] = 0x05;
        set_lvt_delivery_mode(&mut regs, APIC_LVT0, APIC_MODE_EXTINT);
        assert_eq!(regs[APIC_LVT0 + 1] as u8, 0x07);
    }
}
