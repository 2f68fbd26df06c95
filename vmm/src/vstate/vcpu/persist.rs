//! A vCPU's snapshot state: CPUID, MSRs, registers, FPU, LAPIC, events and run state.

use std::sync::Arc;

use kvm_bindings::{kvm_msr_entry, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuFd};

use super::{Vcpu, VcpuError};
use crate::vstate::bus::lock;

/// The MSRs a snapshot saves: KVM's save list, less those that must not be restored.
pub fn saveable_msrs(kvm: &Kvm) -> Result<Arc<Vec<u32>>, VcpuError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(state_err(0, "KVM_GET_MSR_INDEX_LIST"))?;
    let mut saveable: Vec<u32> = list
        .as_slice()
        .iter()
        .copied()
        .filter(|i| msr_is_saveable(*i))
        .collect();
    // KVM_SET_MSRS applies entries in order: the TSC deadline counts in TSC ticks and is
    // ignored unless the LAPIC timer is in deadline mode, so it goes after the TSC (and the
    // LAPIC is restored before any MSR).
    saveable.sort_by_key(|&index| index == MSR_IA32_TSC_DEADLINE);
    Ok(Arc::new(saveable))
}

/// A vCPU's saved state: everything KVM needs to resume it exactly.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct VcpuState {
    /// CPUID as set at boot.
    pub cpuid: Vec<kvm_bindings::kvm_cpuid_entry2>,
    /// MSRs from KVM's save list.
    pub msrs: Vec<kvm_msr_entry>,
    /// General registers.
    pub regs: kvm_bindings::kvm_regs,
    /// Special registers.
    pub sregs: kvm_bindings::kvm_sregs,
    /// FPU/SSE/AVX state.
    pub xsave: kvm_bindings::kvm_xsave,
    /// Extended control registers.
    pub xcrs: kvm_bindings::kvm_xcrs,
    /// Debug registers.
    pub debug_regs: kvm_bindings::kvm_debugregs,
    /// Local APIC.
    pub lapic: kvm_bindings::kvm_lapic_state,
    /// Pending events.
    pub vcpu_events: kvm_bindings::kvm_vcpu_events,
    /// Run state (running, halted, waiting for SIPI).
    pub mp_state: kvm_bindings::kvm_mp_state,
    /// TSC frequency, when KVM reports it.
    #[serde(default)]
    pub tsc_khz: Option<u32>,
}

/// IA32_TSC_DEADLINE: the LAPIC timer's deadline in TSC-deadline mode.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// MSRs that KVM lists but that must not be saved or restored.
fn msr_is_saveable(index: u32) -> bool {
    // IA32_ARCH_CAPABILITIES is refused on PVM hosts; the MCE banks are left at their reset
    // values.
    !(index == 0x10a || (0x400..0x480).contains(&index))
}

fn state_err(index: u8, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
    move |source| VcpuError::Configure {
        index,
        what,
        source,
    }
}

/// Saves a paused vCPU's state.
fn save_vcpu_state(index: u8, fd: &VcpuFd, saveable: &[u32]) -> Result<VcpuState, VcpuError> {
    let fam = |what: &'static str| {
        move |e: vmm_sys_util::fam::Error| VcpuError::Fam {
            index,
            what,
            detail: format!("{e:?}"),
        }
    };
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(state_err(index, "KVM_GET_CPUID2"))?;
    let mut indices = saveable.to_vec();
    let msrs = loop {
        let entries: Vec<kvm_msr_entry> = indices
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(fam("MSR list"))?;
        let read = fd
            .get_msrs(&mut msrs)
            .map_err(state_err(index, "KVM_GET_MSRS"))?;
        if read == indices.len() {
            break msrs.as_slice().to_vec();
        }
        // KVM stops at the first MSR it cannot read: drop it and read again.
        let refused = indices.remove(read);
        log::debug!("vCPU {index}: MSR {refused:#x} cannot be read; not saved");
    };
    Ok(VcpuState {
        cpuid: cpuid.as_slice().to_vec(),
        msrs,
        regs: fd.get_regs().map_err(state_err(index, "KVM_GET_REGS"))?,
        sregs: fd.get_sregs().map_err(state_err(index, "KVM_GET_SREGS"))?,
        xsave: fd.get_xsave().map_err(state_err(index, "KVM_GET_XSAVE"))?,
        xcrs: fd.get_xcrs().map_err(state_err(index, "KVM_GET_XCRS"))?,
        debug_regs: fd
            .get_debug_regs()
            .map_err(state_err(index, "KVM_GET_DEBUGREGS"))?,
        lapic: fd.get_lapic().map_err(state_err(index, "KVM_GET_LAPIC"))?,
        vcpu_events: fd
            .get_vcpu_events()
            .map_err(state_err(index, "KVM_GET_VCPU_EVENTS"))?,
        mp_state: fd
            .get_mp_state()
            .map_err(state_err(index, "KVM_GET_MP_STATE"))?,
        tsc_khz: fd.get_tsc_khz().ok(),
    })
}

/// Restores a vCPU created for restore (before its thread starts).
pub fn restore_vcpu_state(index: u8, fd: &VcpuFd, state: &VcpuState) -> Result<(), VcpuError> {
    let fam = |what: &'static str| {
        move |e: vmm_sys_util::fam::Error| VcpuError::Fam {
            index,
            what,
            detail: format!("{e:?}"),
        }
    };
    let cpuid = CpuId::from_entries(&state.cpuid).map_err(fam("CPUID"))?;
    fd.set_cpuid2(&cpuid)
        .map_err(state_err(index, "KVM_SET_CPUID2"))?;
    if let Some(khz) = state.tsc_khz {
        if let Err(e) = fd.set_tsc_khz(khz) {
            log::debug!("vCPU {index}: KVM_SET_TSC_KHZ {khz}: {e}");
        }
    }
    fd.set_mp_state(state.mp_state)
        .map_err(state_err(index, "KVM_SET_MP_STATE"))?;
    fd.set_regs(&state.regs)
        .map_err(state_err(index, "KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs)
        .map_err(state_err(index, "KVM_SET_SREGS"))?;
    // SAFETY: the xsave area came from KVM_GET_XSAVE on the same kind of host, so it has the
    // layout and size this KVM expects.
    unsafe { fd.set_xsave(&state.xsave) }.map_err(state_err(index, "KVM_SET_XSAVE"))?;
    fd.set_xcrs(&state.xcrs)
        .map_err(state_err(index, "KVM_SET_XCRS"))?;
    fd.set_debug_regs(&state.debug_regs)
        .map_err(state_err(index, "KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&state.lapic)
        .map_err(state_err(index, "KVM_SET_LAPIC"))?;
    let msrs = Msrs::from_entries(&state.msrs).map_err(fam("MSR list"))?;
    let set = fd
        .set_msrs(&msrs)
        .map_err(state_err(index, "KVM_SET_MSRS"))?;
    if set != state.msrs.len() {
        return Err(VcpuError::Msrs {
            index,
            set,
            wanted: state.msrs.len(),
            refused: state.msrs.get(set).map(|m| m.index).unwrap_or(0),
        });
    }
    fd.set_vcpu_events(&state.vcpu_events)
        .map_err(state_err(index, "KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// What restoring a vCPU needs besides its state.
pub struct VcpuRestoreArgs {
    /// A freshly created vCPU.
    pub vcpu: Vcpu,
}

impl snapshot::Persist for Vcpu {
    type State = VcpuState;
    type ConstructorArgs = VcpuRestoreArgs;
    type Error = VcpuError;

    /// Saves the vCPU; it must be paused or not yet started.
    fn save(&self) -> Result<VcpuState, VcpuError> {
        save_vcpu_state(self.index, &lock(&self.fd), &self.saveable_msrs)
    }

    fn restore(args: VcpuRestoreArgs, state: &VcpuState) -> Result<Self, VcpuError> {
        restore_vcpu_state(args.vcpu.index, &lock(&args.vcpu.fd), state)?;
        Ok(args.vcpu)
    }
}
