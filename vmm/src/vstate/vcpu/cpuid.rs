//! CPUID: KVM's supported list, filtered for the VM's topology, no power management, no PMU
//! and no invariant TSC; a deterministic machine also loses RDRAND and RDSEED.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;

use super::{Vcpu, VcpuError};
use crate::vstate::bus::lock;

const CPUID_HYPERVISOR_BIT: u32 = 1 << 31;
const CPUID_HTT_BIT: u32 = 1 << 28;

impl Vcpu {
    pub fn configure_cpuid(
        &self,
        kvm: &Kvm,
        vcpu_count: u8,
        deterministic: bool,
    ) -> Result<(), VcpuError> {
        let mut cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(self.configure_err("KVM_GET_SUPPORTED_CPUID"))?;
        filter_cpuid(&mut cpuid, self.index, vcpu_count);
        // KVM emulates the TSC-deadline LAPIC timer but leaves its CPUID bit to userspace.
        // Without it Linux programs the LAPIC timer through trapped MMIO writes.
        if kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer) {
            offer_tsc_deadline_timer(&mut cpuid);
        }
        if deterministic {
            hide_hardware_rng(&mut cpuid);
        }
        lock(&self.fd)
            .set_cpuid2(&cpuid)
            .map_err(self.configure_err("KVM_SET_CPUID2"))
    }
}

/// CPUID.1:ECX.RDRAND[bit 30].
const CPUID_RDRAND_BIT: u32 = 1 << 30;
/// CPUID.(EAX=7,ECX=0):EBX.RDSEED[bit 18].
const CPUID_RDSEED_BIT: u32 = 1 << 18;

/// CPUID.1:ECX.TSC-Deadline[bit 24].
const CPUID_TSC_DEADLINE_BIT: u32 = 1 << 24;
/// CPUID.80000007H:EDX.InvariantTSC[bit 8].
const CPUID_INVARIANT_TSC_BIT: u32 = 1 << 8;

/// Offers the TSC-deadline mode of the LAPIC timer.
fn offer_tsc_deadline_timer(cpuid: &mut CpuId) {
    for entry in cpuid.as_mut_slice() {
        if entry.function == 0x1 {
            entry.ecx |= CPUID_TSC_DEADLINE_BIT;
        }
    }
}

/// Hides RDRAND and RDSEED, the guest's only entropy source that a snapshot can't pin.
fn hide_hardware_rng(cpuid: &mut CpuId) {
    for entry in cpuid.as_mut_slice() {
        match (entry.function, entry.index) {
            (0x1, _) => entry.ecx &= !CPUID_RDRAND_BIT,
            (0x7, 0) => entry.ebx &= !CPUID_RDSEED_BIT,
            _ => {}
        }
    }
}

/// Gives each vCPU its APIC ID and the VM's topology, and marks the hypervisor.
fn filter_cpuid(cpuid: &mut CpuId, index: u8, vcpu_count: u8) {
    let apic_id = u32::from(index);
    let count = u32::from(vcpu_count);
    // Bits needed to number `count` logical CPUs.
    let shift = 32 - (count.max(1) - 1).leading_zeros();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            0x1 => {
                entry.ebx = (entry.ebx & 0x0000_ffff) | (apic_id << 24) | (count << 16);
                entry.ecx |= CPUID_HYPERVISOR_BIT;
                if count > 1 {
                    entry.edx |= CPUID_HTT_BIT;
                } else {
                    entry.edx &= !CPUID_HTT_BIT;
                }
            }
            0x4 => {
                // One core per vCPU package topology: cores per package - 1 in EAX[31:26].
                entry.eax = (entry.eax & 0x03ff_ffff) | ((count.max(1) - 1) << 26);
                // Cache shared by all logical CPUs: EAX[25:14].
                entry.eax = (entry.eax & !(0xfff << 14)) | ((count.max(1) - 1) << 14);
            }
            0x6 => {
                // No power management features (no APERF/MPERF, no turbo).
                entry.eax = 0;
                entry.ecx = 0;
            }
            0xa => {
                // No architectural PMU.
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            0xb | 0x1f => {
                entry.edx = apic_id;
                match entry.index {
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = 1 << 8;
                    }
                    1 => {
                        entry.eax = shift;
                        entry.ebx = count;
                        entry.ecx = (2 << 8) | 1;
                    }
                    _ => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = entry.index;
                    }
                }
            }
            0x8000_0007 => {
                // No invariant TSC: with it Linux prefers the TSC over kvm-clock, and a snapshot
                // then carries a clock tied to one host's TSC frequency.
                entry.edx &= !CPUID_INVARIANT_TSC_BIT;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    #[test]
    fn deterministic_cpuid_hides_rdrand_and_rdseed() {
        let entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ecx: CPUID_RDRAND_BIT | 1,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 7,
                index: 0,
                ebx: CPUID_RDSEED_BIT | 1,
                ..Default::default()
            },
        ];
        let mut cpuid = CpuId::from_entries(&entries).expect("cpuid");
        hide_hardware_rng(&mut cpuid);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ecx, 1);
        assert_eq!(e[1].ebx, 1);
    }

    #[test]
    fn cpuid_gets_apic_id_and_topology() {
        let entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ebx: 0xffff_ffff,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                index: 1,
                ..Default::default()
            },
        ];
        let mut cpuid = CpuId::from_entries(&entries).expect("cpuid");
        filter_cpuid(&mut cpuid, 3, 4);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_eq!(e[0].ebx & 0xffff, 0xffff);
        assert_ne!(e[0].ecx & CPUID_HYPERVISOR_BIT, 0);
        assert_eq!(e[1].edx, 3);
        assert_eq!(e[1].eax, 2);
        assert_eq!(e[1].ebx, 4);
    }
}
