//! Host PCI devices passed through (`vfio`, a rollbox extension of the machine).

use std::path::PathBuf;

use super::resources::VmResources;
use super::validate::ConfigError;

impl VmResources {
    /// rollbox extension (`PUT /vfio`): a host PCI device to pass through. Whether it is bound
    /// to vfio-pci and usable is checked when the VM starts; here only that it is a PCI device
    /// and not given twice. (`PUT /machine-config` replaces the list, as it replaces the rest.)
    pub fn add_vfio(&mut self, path: PathBuf) -> Result<(), ConfigError> {
        if !path.join("config").is_file() {
            return Err(ConfigError::VfioNotPci(path));
        }
        if self.machine.rollbox.vfio.contains(&path) {
            return Err(ConfigError::VfioTwice(path));
        }
        self.machine.rollbox.vfio.push(path);
        Ok(())
    }
}
