//! pvpanic (QEMU's ISA device, ACPI `QEMU0001`): the guest kernel writes 1 to its port when it
//! panics, which ends the VMM with a crash status instead of the clean exit of the reboot
//! that `panic=N` does next.

use super::EventTrigger;
use crate::vstate::bus::BusDevice;
use vm_superio::Trigger;

/// The guest panicked.
const PVPANIC_PANICKED: u8 = 1 << 0;
/// A crash kernel is loaded and will run.
const PVPANIC_CRASH_LOADED: u8 = 1 << 1;

/// Signals `panic` when the guest reports a panic.
pub struct PvPanic {
    panic: EventTrigger,
}

impl PvPanic {
    /// A device that writes `panic` when the guest panics.
    pub fn new(panic: EventTrigger) -> Self {
        Self { panic }
    }
}

impl BusDevice for PvPanic {
    /// Reads offer the events the device understands; Linux reports only those.
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = PVPANIC_PANICKED | PVPANIC_CRASH_LOADED;
        }
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        if value & PVPANIC_PANICKED != 0 {
            if let Err(e) = self.panic.trigger() {
                log::error!("guest panic report lost: {e}");
            }
        } else if value & PVPANIC_CRASH_LOADED != 0 {
            log::warn!("guest kernel crashed; its crash kernel takes over");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    #[test]
    fn offers_its_events_and_signals_a_panic() {
        let evt = Arc::new(EventFd::new(EFD_NONBLOCK).expect("eventfd"));
        let mut dev = PvPanic::new(EventTrigger(Arc::clone(&evt)));
        let mut caps = [0u8; 1];
        dev.read(0, &mut caps);
        assert_eq!(caps[0], 3);
        assert!(evt.read().is_err(), "no event before a write");
        dev.write(0, &[PVPANIC_CRASH_LOADED]);
        assert!(evt.read().is_err(), "crash-loaded alone is no panic");
        dev.write(0, &[PVPANIC_PANICKED]);
        assert_eq!(evt.read().expect("panic event"), 1);
    }
}
