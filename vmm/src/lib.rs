//! rollbox-vmm: a KVM microVM manager built on the rust-vmm crates, one process per microVM.
//!
//! - [`vstate`]: the KVM VM, guest memory and vCPUs.
//! - [`arch`]: x86-64 layout and the Linux boot protocol.
//! - [`devices`]: serial, i8042, power-off, and virtio-mmio block and vsock.
//! - [`api`]: the control API (Firecracker's REST API where the two overlap).
//! - [`controller`]: the event loop that ties them together.
//! - [`seccomp`]: per-thread seccomp filters.

pub mod api;
pub mod arch;
pub mod background_snapshot;
pub mod builder;
pub mod config;
pub mod controller;
pub mod device_manager;
pub mod devices;
pub mod fork;
pub mod logger;
pub mod persist;
pub mod seccomp;
pub mod vstate;
