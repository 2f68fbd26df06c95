//! Device models and the buses that connect them to vCPUs.

pub mod bus;
pub mod legacy;
pub mod pci;
pub mod virtio;
