//! The old path of [`crate::vmm_config`], kept only while tests/tier2_fork.rs names it; remove
//! it once that test uses `vmm::vmm_config` and builds its drive with [`DriveConfig::new`].

pub use crate::vmm_config::{BootSourceConfig, ConsoleConfig, VmResources};

use crate::vmm_config::{ConfigError, DriveConfig, Validate};

/// The drive `--drive PATH` makes (`drive{index}`, writable, not the root device). Only that
/// plain form: the flag's full parser is the `rollbox-vmm` binary's.
pub fn parse_drive_flag(path: &str, index: usize) -> Result<DriveConfig, ConfigError> {
    if path.is_empty() || path.contains(',') {
        return Err(ConfigError::DriveFlag(path.into()));
    }
    let drive = DriveConfig::new(format!("drive{index}"), path);
    drive.validate()?;
    Ok(drive)
}
