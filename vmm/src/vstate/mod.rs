//! KVM state: the VM, its memory, its vCPUs and the buses their exits reach devices through.

pub mod bus;
pub mod memory;
pub mod vcpu;
pub mod vm;
