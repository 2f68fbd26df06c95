//! The ioctl requests the filters allow, by full number (direction, size, type and number):
//! exactly those rollbox-vmm (and the kvm-ioctls, vfio-ioctls and userfaultfd crates it calls)
//! issues, per kind of thread. A request with a known type byte but another number or size is
//! refused.

use std::mem::size_of;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_create_device, kvm_debugregs, kvm_device_attr, kvm_dirty_log,
    kvm_fpu, kvm_ioeventfd, kvm_irq_routing, kvm_irqchip, kvm_irqfd, kvm_lapic_state, kvm_mp_state,
    kvm_msi, kvm_msr_list, kvm_msrs, kvm_pit_config, kvm_pit_state2, kvm_regs, kvm_sregs,
    kvm_userspace_memory_region, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};

const NONE: u64 = 0;
const WRITE: u64 = 1;
const READ: u64 = 2;

/// `_IOC(dir, ty, nr, size)`.
const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
const fn io(ty: u64, nr: u64) -> u64 {
    ioc(NONE, ty, nr, 0)
}
const fn ior<T>(ty: u64, nr: u64) -> u64 {
    ioc(READ, ty, nr, size_of::<T>())
}
const fn iow<T>(ty: u64, nr: u64) -> u64 {
    ioc(WRITE, ty, nr, size_of::<T>())
}
const fn iowr<T>(ty: u64, nr: u64) -> u64 {
    ioc(READ | WRITE, ty, nr, size_of::<T>())
}

const KVMIO: u64 = 0xAE;
const VFIO: u64 = b';' as u64;
const VFIO_BASE: u64 = 100;
const TUN: u64 = b'T' as u64;
const UFFDIO: u64 = 0xAA;

// /dev/kvm
pub(super) const KVM_GET_API_VERSION: u64 = io(KVMIO, 0x00);
pub(super) const KVM_CREATE_VM: u64 = io(KVMIO, 0x01);
pub(super) const KVM_GET_MSR_INDEX_LIST: u64 = iowr::<kvm_msr_list>(KVMIO, 0x02);
pub(super) const KVM_CHECK_EXTENSION: u64 = io(KVMIO, 0x03);
pub(super) const KVM_GET_VCPU_MMAP_SIZE: u64 = io(KVMIO, 0x04);
pub(super) const KVM_GET_SUPPORTED_CPUID: u64 = iowr::<kvm_cpuid2>(KVMIO, 0x05);
// a VM
pub(super) const KVM_CREATE_VCPU: u64 = io(KVMIO, 0x41);
pub(super) const KVM_GET_DIRTY_LOG: u64 = iow::<kvm_dirty_log>(KVMIO, 0x42);
pub(super) const KVM_SET_USER_MEMORY_REGION: u64 = iow::<kvm_userspace_memory_region>(KVMIO, 0x46);
pub(super) const KVM_SET_TSS_ADDR: u64 = io(KVMIO, 0x47);
pub(super) const KVM_CREATE_IRQCHIP: u64 = io(KVMIO, 0x60);
pub(super) const KVM_GET_IRQCHIP: u64 = iowr::<kvm_irqchip>(KVMIO, 0x62);
pub(super) const KVM_SET_IRQCHIP: u64 = ior::<kvm_irqchip>(KVMIO, 0x63);
pub(super) const KVM_SET_GSI_ROUTING: u64 = iow::<kvm_irq_routing>(KVMIO, 0x6a);
pub(super) const KVM_IRQFD: u64 = iow::<kvm_irqfd>(KVMIO, 0x76);
pub(super) const KVM_CREATE_PIT2: u64 = iow::<kvm_pit_config>(KVMIO, 0x77);
pub(super) const KVM_IOEVENTFD: u64 = iow::<kvm_ioeventfd>(KVMIO, 0x79);
pub(super) const KVM_SET_CLOCK: u64 = iow::<kvm_clock_data>(KVMIO, 0x7b);
pub(super) const KVM_GET_CLOCK: u64 = ior::<kvm_clock_data>(KVMIO, 0x7c);
pub(super) const KVM_GET_PIT2: u64 = ior::<kvm_pit_state2>(KVMIO, 0x9f);
pub(super) const KVM_SET_PIT2: u64 = iow::<kvm_pit_state2>(KVMIO, 0xa0);
pub(super) const KVM_SIGNAL_MSI: u64 = iow::<kvm_msi>(KVMIO, 0xa5);
pub(super) const KVM_CREATE_DEVICE: u64 = iowr::<kvm_create_device>(KVMIO, 0xe0);
pub(super) const KVM_SET_DEVICE_ATTR: u64 = iow::<kvm_device_attr>(KVMIO, 0xe1);
// a vCPU
pub(super) const KVM_RUN: u64 = io(KVMIO, 0x80);
pub(super) const KVM_GET_REGS: u64 = ior::<kvm_regs>(KVMIO, 0x81);
pub(super) const KVM_SET_REGS: u64 = iow::<kvm_regs>(KVMIO, 0x82);
pub(super) const KVM_GET_SREGS: u64 = ior::<kvm_sregs>(KVMIO, 0x83);
pub(super) const KVM_SET_SREGS: u64 = iow::<kvm_sregs>(KVMIO, 0x84);
pub(super) const KVM_GET_MSRS: u64 = iowr::<kvm_msrs>(KVMIO, 0x88);
pub(super) const KVM_SET_MSRS: u64 = iow::<kvm_msrs>(KVMIO, 0x89);
pub(super) const KVM_SET_FPU: u64 = iow::<kvm_fpu>(KVMIO, 0x8d);
pub(super) const KVM_GET_LAPIC: u64 = ior::<kvm_lapic_state>(KVMIO, 0x8e);
pub(super) const KVM_SET_LAPIC: u64 = iow::<kvm_lapic_state>(KVMIO, 0x8f);
pub(super) const KVM_SET_CPUID2: u64 = iow::<kvm_cpuid2>(KVMIO, 0x90);
pub(super) const KVM_GET_CPUID2: u64 = iowr::<kvm_cpuid2>(KVMIO, 0x91);
pub(super) const KVM_GET_MP_STATE: u64 = ior::<kvm_mp_state>(KVMIO, 0x98);
pub(super) const KVM_SET_MP_STATE: u64 = iow::<kvm_mp_state>(KVMIO, 0x99);
pub(super) const KVM_GET_VCPU_EVENTS: u64 = ior::<kvm_vcpu_events>(KVMIO, 0x9f);
pub(super) const KVM_SET_VCPU_EVENTS: u64 = iow::<kvm_vcpu_events>(KVMIO, 0xa0);
pub(super) const KVM_GET_DEBUGREGS: u64 = ior::<kvm_debugregs>(KVMIO, 0xa1);
pub(super) const KVM_SET_DEBUGREGS: u64 = iow::<kvm_debugregs>(KVMIO, 0xa2);
pub(super) const KVM_SET_TSC_KHZ: u64 = io(KVMIO, 0xa2);
pub(super) const KVM_GET_TSC_KHZ: u64 = io(KVMIO, 0xa3);
pub(super) const KVM_GET_XSAVE: u64 = ior::<kvm_xsave>(KVMIO, 0xa4);
pub(super) const KVM_SET_XSAVE: u64 = iow::<kvm_xsave>(KVMIO, 0xa5);
pub(super) const KVM_GET_XCRS: u64 = ior::<kvm_xcrs>(KVMIO, 0xa6);
pub(super) const KVM_SET_XCRS: u64 = iow::<kvm_xcrs>(KVMIO, 0xa7);
// VFIO (vfio-ioctls: container, group, device, DMA maps)
pub(super) const VFIO_GET_API_VERSION: u64 = io(VFIO, VFIO_BASE);
pub(super) const VFIO_CHECK_EXTENSION: u64 = io(VFIO, VFIO_BASE + 1);
pub(super) const VFIO_SET_IOMMU: u64 = io(VFIO, VFIO_BASE + 2);
pub(super) const VFIO_GROUP_GET_STATUS: u64 = io(VFIO, VFIO_BASE + 3);
pub(super) const VFIO_GROUP_SET_CONTAINER: u64 = io(VFIO, VFIO_BASE + 4);
pub(super) const VFIO_GROUP_UNSET_CONTAINER: u64 = io(VFIO, VFIO_BASE + 5);
pub(super) const VFIO_GROUP_GET_DEVICE_FD: u64 = io(VFIO, VFIO_BASE + 6);
pub(super) const VFIO_DEVICE_GET_INFO: u64 = io(VFIO, VFIO_BASE + 7);
pub(super) const VFIO_DEVICE_GET_REGION_INFO: u64 = io(VFIO, VFIO_BASE + 8);
pub(super) const VFIO_DEVICE_GET_IRQ_INFO: u64 = io(VFIO, VFIO_BASE + 9);
pub(super) const VFIO_DEVICE_SET_IRQS: u64 = io(VFIO, VFIO_BASE + 10);
pub(super) const VFIO_DEVICE_RESET: u64 = io(VFIO, VFIO_BASE + 11);
pub(super) const VFIO_IOMMU_GET_INFO: u64 = io(VFIO, VFIO_BASE + 12);
pub(super) const VFIO_IOMMU_MAP_DMA: u64 = io(VFIO, VFIO_BASE + 13);
pub(super) const VFIO_IOMMU_UNMAP_DMA: u64 = io(VFIO, VFIO_BASE + 14);
// tap devices
pub(super) const TUNSETIFF: u64 = iow::<libc::c_int>(TUN, 202);
pub(super) const TUNSETOFFLOAD: u64 = iow::<libc::c_uint>(TUN, 208);
pub(super) const TUNSETVNETHDRSZ: u64 = iow::<libc::c_int>(TUN, 216);
// userfaultfd (struct sizes from linux/userfaultfd.h)
pub(super) const UFFDIO_API: u64 = ioc(READ | WRITE, UFFDIO, 0x3f, 24);
pub(super) const UFFDIO_REGISTER: u64 = ioc(READ | WRITE, UFFDIO, 0x00, 32);
pub(super) const UFFDIO_WAKE: u64 = ioc(READ, UFFDIO, 0x02, 16);
pub(super) const UFFDIO_COPY: u64 = ioc(READ | WRITE, UFFDIO, 0x03, 40);
pub(super) const UFFDIO_ZEROPAGE: u64 = ioc(READ | WRITE, UFFDIO, 0x04, 32);
// std: non-blocking sockets and close-on-exec descriptors
pub(super) const FIONBIO: u64 = 0x5421;
pub(super) const FIOCLEX: u64 = 0x5451;

/// A vCPU: KVM_RUN, its registers for a crash report, and what the device emulation it
/// exits to does (PCI config and MSI/MSI-X writes move BARs, route MSIs and switch a VFIO
/// device's interrupts; virtio-net's activation sets the tap's offloads).
pub(super) const VCPU: &[u64] = &[
    KVM_RUN,
    KVM_GET_REGS,
    KVM_GET_SREGS,
    KVM_SET_USER_MEMORY_REGION,
    KVM_SET_GSI_ROUTING,
    KVM_IRQFD,
    KVM_IOEVENTFD,
    KVM_SIGNAL_MSI,
    VFIO_DEVICE_SET_IRQS,
    TUNSETOFFLOAD,
];

/// The page server of a lazy restore: it fills and wakes faulting pages.
pub(super) const PAGE_SERVER: &[u64] = &[UFFDIO_COPY, UFFDIO_ZEROPAGE, UFFDIO_WAKE];

/// The main thread: the VM's and vCPUs' set-up, snapshots and restores, devices (VFIO,
/// taps, lazy restores' userfaultfd), and std's socket and descriptor flags. Threads it
/// starts once filtered (the vCPUs of a VM started over the API, a page server) keep its
/// filter under their own, so its list holds theirs too (KVM_RUN among them).
pub(super) const VMM: &[u64] = &[
    KVM_RUN,
    KVM_GET_API_VERSION,
    KVM_CREATE_VM,
    KVM_GET_MSR_INDEX_LIST,
    KVM_CHECK_EXTENSION,
    KVM_GET_VCPU_MMAP_SIZE,
    KVM_GET_SUPPORTED_CPUID,
    KVM_CREATE_VCPU,
    KVM_GET_DIRTY_LOG,
    KVM_SET_USER_MEMORY_REGION,
    KVM_SET_TSS_ADDR,
    KVM_CREATE_IRQCHIP,
    KVM_GET_IRQCHIP,
    KVM_SET_IRQCHIP,
    KVM_SET_GSI_ROUTING,
    KVM_IRQFD,
    KVM_CREATE_PIT2,
    KVM_IOEVENTFD,
    KVM_SET_CLOCK,
    KVM_GET_CLOCK,
    KVM_GET_PIT2,
    KVM_SET_PIT2,
    KVM_SIGNAL_MSI,
    KVM_CREATE_DEVICE,
    KVM_SET_DEVICE_ATTR,
    KVM_GET_REGS,
    KVM_SET_REGS,
    KVM_GET_SREGS,
    KVM_SET_SREGS,
    KVM_GET_MSRS,
    KVM_SET_MSRS,
    KVM_SET_FPU,
    KVM_GET_LAPIC,
    KVM_SET_LAPIC,
    KVM_SET_CPUID2,
    KVM_GET_CPUID2,
    KVM_GET_MP_STATE,
    KVM_SET_MP_STATE,
    KVM_GET_VCPU_EVENTS,
    KVM_SET_VCPU_EVENTS,
    KVM_GET_DEBUGREGS,
    KVM_SET_DEBUGREGS,
    KVM_SET_TSC_KHZ,
    KVM_GET_TSC_KHZ,
    KVM_GET_XSAVE,
    KVM_SET_XSAVE,
    KVM_GET_XCRS,
    KVM_SET_XCRS,
    VFIO_GET_API_VERSION,
    VFIO_CHECK_EXTENSION,
    VFIO_SET_IOMMU,
    VFIO_GROUP_GET_STATUS,
    VFIO_GROUP_SET_CONTAINER,
    VFIO_GROUP_UNSET_CONTAINER,
    VFIO_GROUP_GET_DEVICE_FD,
    VFIO_DEVICE_GET_INFO,
    VFIO_DEVICE_GET_REGION_INFO,
    VFIO_DEVICE_GET_IRQ_INFO,
    VFIO_DEVICE_SET_IRQS,
    VFIO_DEVICE_RESET,
    VFIO_IOMMU_GET_INFO,
    VFIO_IOMMU_MAP_DMA,
    VFIO_IOMMU_UNMAP_DMA,
    TUNSETIFF,
    TUNSETOFFLOAD,
    TUNSETVNETHDRSZ,
    UFFDIO_API,
    UFFDIO_REGISTER,
    UFFDIO_WAKE,
    UFFDIO_COPY,
    UFFDIO_ZEROPAGE,
    FIONBIO,
    FIOCLEX,
];

/// The name of an allowed request (for the summary and the SIGSYS line).
pub fn name(request: u64) -> Option<&'static str> {
    NAMES
        .iter()
        .find(|(number, _)| *number == request)
        .map(|(_, name)| *name)
}

macro_rules! names {
    ($($name:ident),* $(,)?) => {
        &[$(($name, stringify!($name))),*]
    };
}

const NAMES: &[(u64, &str)] = names![
    KVM_GET_API_VERSION,
    KVM_CREATE_VM,
    KVM_GET_MSR_INDEX_LIST,
    KVM_CHECK_EXTENSION,
    KVM_GET_VCPU_MMAP_SIZE,
    KVM_GET_SUPPORTED_CPUID,
    KVM_CREATE_VCPU,
    KVM_GET_DIRTY_LOG,
    KVM_SET_USER_MEMORY_REGION,
    KVM_SET_TSS_ADDR,
    KVM_CREATE_IRQCHIP,
    KVM_GET_IRQCHIP,
    KVM_SET_IRQCHIP,
    KVM_SET_GSI_ROUTING,
    KVM_IRQFD,
    KVM_CREATE_PIT2,
    KVM_IOEVENTFD,
    KVM_SET_CLOCK,
    KVM_GET_CLOCK,
    KVM_GET_PIT2,
    KVM_SET_PIT2,
    KVM_SIGNAL_MSI,
    KVM_CREATE_DEVICE,
    KVM_SET_DEVICE_ATTR,
    KVM_RUN,
    KVM_GET_REGS,
    KVM_SET_REGS,
    KVM_GET_SREGS,
    KVM_SET_SREGS,
    KVM_GET_MSRS,
    KVM_SET_MSRS,
    KVM_SET_FPU,
    KVM_GET_LAPIC,
    KVM_SET_LAPIC,
    KVM_SET_CPUID2,
    KVM_GET_CPUID2,
    KVM_GET_MP_STATE,
    KVM_SET_MP_STATE,
    KVM_GET_VCPU_EVENTS,
    KVM_SET_VCPU_EVENTS,
    KVM_GET_DEBUGREGS,
    KVM_SET_DEBUGREGS,
    KVM_SET_TSC_KHZ,
    KVM_GET_TSC_KHZ,
    KVM_GET_XSAVE,
    KVM_SET_XSAVE,
    KVM_GET_XCRS,
    KVM_SET_XCRS,
    VFIO_GET_API_VERSION,
    VFIO_CHECK_EXTENSION,
    VFIO_SET_IOMMU,
    VFIO_GROUP_GET_STATUS,
    VFIO_GROUP_SET_CONTAINER,
    VFIO_GROUP_UNSET_CONTAINER,
    VFIO_GROUP_GET_DEVICE_FD,
    VFIO_DEVICE_GET_INFO,
    VFIO_DEVICE_GET_REGION_INFO,
    VFIO_DEVICE_GET_IRQ_INFO,
    VFIO_DEVICE_SET_IRQS,
    VFIO_DEVICE_RESET,
    VFIO_IOMMU_GET_INFO,
    VFIO_IOMMU_MAP_DMA,
    VFIO_IOMMU_UNMAP_DMA,
    TUNSETIFF,
    TUNSETOFFLOAD,
    TUNSETVNETHDRSZ,
    UFFDIO_API,
    UFFDIO_REGISTER,
    UFFDIO_WAKE,
    UFFDIO_COPY,
    UFFDIO_ZEROPAGE,
    FIONBIO,
    FIOCLEX,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        // From the kernel's headers (x86_64), not from our sizes.
        for (ours, kernel) in [
            (KVM_RUN, 0xae80),
            (KVM_CREATE_VM, 0xae01),
            (KVM_GET_SUPPORTED_CPUID, 0xc008_ae05),
            (KVM_GET_REGS, 0x8090_ae81),
            (KVM_SET_REGS, 0x4090_ae82),
            (KVM_GET_SREGS, 0x8138_ae83),
            (KVM_SET_SREGS, 0x4138_ae84),
            (KVM_GET_MSRS, 0xc008_ae88),
            (KVM_SET_MSRS, 0x4008_ae89),
            (KVM_SET_FPU, 0x41a0_ae8d),
            (KVM_GET_LAPIC, 0x8400_ae8e),
            (KVM_SET_CPUID2, 0x4008_ae90),
            (KVM_GET_VCPU_EVENTS, 0x8040_ae9f),
            (KVM_GET_PIT2, 0x8070_ae9f),
            (KVM_GET_XSAVE, 0x9000_aea4),
            (KVM_GET_XCRS, 0x8188_aea6),
            (KVM_GET_IRQCHIP, 0xc208_ae62),
            (KVM_SET_IRQCHIP, 0x8208_ae63),
            (KVM_GET_CLOCK, 0x8030_ae7c),
            (KVM_SET_USER_MEMORY_REGION, 0x4020_ae46),
            (KVM_SET_GSI_ROUTING, 0x4008_ae6a),
            (KVM_IRQFD, 0x4020_ae76),
            (KVM_CREATE_PIT2, 0x4040_ae77),
            (KVM_IOEVENTFD, 0x4040_ae79),
            (KVM_SIGNAL_MSI, 0x4020_aea5),
            (KVM_CREATE_DEVICE, 0xc00c_aee0),
            (KVM_SET_DEVICE_ATTR, 0x4018_aee1),
            (KVM_GET_DIRTY_LOG, 0x4010_ae42),
            (VFIO_DEVICE_SET_IRQS, 0x3b6e),
            (VFIO_IOMMU_MAP_DMA, 0x3b71),
            (TUNSETIFF, 0x4004_54ca),
            (TUNSETOFFLOAD, 0x4004_54d0),
            (TUNSETVNETHDRSZ, 0x4004_54d8),
            (UFFDIO_API, 0xc018_aa3f),
            (UFFDIO_REGISTER, 0xc020_aa00),
            (UFFDIO_WAKE, 0x8010_aa02),
            (UFFDIO_COPY, 0xc028_aa03),
            (UFFDIO_ZEROPAGE, 0xc020_aa04),
            (FIONBIO, libc::FIONBIO),
            (FIOCLEX, libc::FIOCLEX),
        ] {
            assert_eq!(
                ours,
                kernel,
                "{}: {ours:#x} is not the kernel's {kernel:#x}",
                name(ours).unwrap_or("?")
            );
        }
    }

    #[test]
    fn the_main_threads_list_holds_those_of_the_threads_it_starts() {
        for request in VCPU.iter().chain(PAGE_SERVER) {
            assert!(VMM.contains(request), "{}", name(*request).unwrap_or("?"));
        }
    }

    #[test]
    fn every_allowed_request_has_a_name_and_no_number_two() {
        for list in [VMM, VCPU, PAGE_SERVER] {
            for request in list {
                assert!(name(*request).is_some(), "{request:#x} has no name");
            }
        }
        let mut all: Vec<u64> = NAMES.iter().map(|(n, _)| *n).collect();
        let count = all.len();
        all.sort_unstable();
        all.dedup();
        // VFIO's _IO numbers carry no size; none collides with another name here.
        assert_eq!(all.len(), count, "two names share a number");
    }
}
