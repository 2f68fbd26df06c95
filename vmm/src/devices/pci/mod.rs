//! PCI: a root bus with configuration space over CF8/CFC and ECAM, BAR allocation in 32-bit
//! and 64-bit windows, MSI-X emulation and MSI routing through KVM GSI routes and irqfds.
//!
//! Nothing here is wired into the default VM: it is the foundation for PCI and VFIO
//! passthrough (issue 9).

pub mod bus;
pub mod config;
pub mod msix;
pub mod router;
