//! The ACPI sleep control and status registers (hardware-reduced FADT): writing SLP_TYP=5 (S5,
//! the `_S5_` value in the DSDT) with SLP_EN to the control register powers off. The status
//! register reads 0 and ignores writes.

use super::EventTrigger;
use crate::vstate::bus::BusDevice;
use vm_superio::Trigger;

const SLP_EN: u8 = 1 << 5;
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x7;
const S5_SOFT_OFF: u8 = crate::arch::acpi::S5_SLEEP_TYPE;

/// Signals `poweroff` when the guest requests S5.
pub struct PowerOff {
    poweroff: EventTrigger,
}

impl PowerOff {
    /// A device that writes `poweroff` when the guest powers off.
    pub fn new(poweroff: EventTrigger) -> Self {
        Self { poweroff }
    }
}

impl BusDevice for PowerOff {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 0 {
            return;
        }
        let Some(&value) = data.first() else { return };
        if value & SLP_EN != 0 && (value >> SLP_TYP_SHIFT) & SLP_TYP_MASK == S5_SOFT_OFF {
            if let Err(e) = self.poweroff.trigger() {
                log::error!("power-off request lost: {e}");
            }
        }
    }
}
