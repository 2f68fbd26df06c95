//! Device models: legacy port-I/O devices, the PCI bus and virtio devices. The buses they sit
//! on are the VM's ([`crate::vstate::bus`]).

pub mod legacy;
pub mod pci;
pub mod virtio;

/// The VM's buses, at their old path for the fuzz targets (`fuzz/`); use [`crate::vstate::bus`].
pub use crate::vstate::bus;
