//! Legacy port-I/O devices: 16550 serial, i8042, the ACPI sleep registers, pvpanic and the VM
//! generation counter.

pub mod generation;
pub mod i8042;
pub mod poweroff;
pub mod pvpanic;
pub mod serial;

use std::sync::Arc;

use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

/// An interrupt line (irqfd) or event, raised by writing an eventfd.
#[derive(Clone)]
pub struct EventTrigger(pub Arc<EventFd>);

impl Trigger for EventTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}
