//! KVM state: the VM, its memory and its vCPUs.

pub mod memory;
pub mod vcpu;
pub mod vm;
