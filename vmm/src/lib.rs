//! rollbox-vmm: a KVM microVM manager built on the rust-vmm crates, one process per microVM.
//!
//! - [`vstate`]: the KVM VM, guest memory, vCPUs and the port-I/O and MMIO buses.
//! - [`arch`]: x86-64 layout, the Linux boot protocol, ACPI and MP tables.
//! - [`devices`]: the device models: legacy (serial, i8042, power-off, pvpanic, generation
//!   counter), the PCI root with MSI/MSI-X and VFIO, and virtio (the MMIO transport; block,
//!   vsock, net, fs), each with its snapshot state.
//! - [`device_manager`]: creates, attaches, saves and restores the devices; the one list of
//!   virtio device kinds.
//! - [`builder`]: builds a booting microVM; [`persist`]: snapshots and restores;
//!   [`background_snapshot`]: a snapshot's memory written by a child process while the VM
//!   runs on.
//! - [`api`]: the control API (Firecracker's REST API where the two overlap).
//! - [`controller`]: the event loop that ties them together.
//! - [`seccomp`]: per-thread seccomp filters; [`logger`]: the log.
//! - [`vmm_config`]: the VM's resources, one file per resource, and their checks.

pub mod api;
pub mod arch;
pub mod background_snapshot;
pub mod builder;
pub mod controller;
pub mod device_manager;
pub mod devices;
pub mod logger;
pub mod persist;
pub mod seccomp;
pub mod vmm_config;
pub mod vstate;
