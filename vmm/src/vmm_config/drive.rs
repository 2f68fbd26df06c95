//! Drives (`drives`): raw disk images, the root device first.

use vmm_api::DriveConfig;

use super::resources::VmResources;
use super::validate::{valid_id, ConfigError, Validate};

/// The ID and unsupported options.
impl Validate for DriveConfig {
    type Valid = ();

    fn validate(&self) -> Result<(), ConfigError> {
        if !valid_id(&self.drive_id) {
            return Err(ConfigError::DriveId(self.drive_id.clone()));
        }
        if self.rate_limiter.is_some() {
            return Err(ConfigError::Unsupported("rate_limiter"));
        }
        if self.socket.is_some() {
            return Err(ConfigError::Unsupported("vhost-user block (socket)"));
        }
        if self.io_engine.as_deref().is_some_and(|e| e != "Sync") {
            return Err(ConfigError::Unsupported("io_engine other than Sync"));
        }
        if self
            .cache_type
            .as_deref()
            .is_some_and(|c| c != "Unsafe" && c != "Writeback")
        {
            return Err(ConfigError::Unsupported(
                "cache_type other than Unsafe or Writeback",
            ));
        }
        Ok(())
    }
}

impl VmResources {
    /// Adds or replaces a drive, keeping the root device first.
    pub fn upsert_drive(&mut self, drive: DriveConfig) -> Result<(), ConfigError> {
        drive.validate()?;
        if drive.is_root_device
            && self
                .drives
                .iter()
                .any(|d| d.is_root_device && d.drive_id != drive.drive_id)
        {
            return Err(ConfigError::SecondRoot(drive.drive_id));
        }
        if let Some(existing) = self
            .drives
            .iter_mut()
            .find(|d| d.drive_id == drive.drive_id)
        {
            *existing = drive;
        } else if drive.is_root_device {
            self.drives.insert(0, drive);
        } else {
            self.drives.push(drive);
        }
        Ok(())
    }

    /// The kernel arguments for the root device, Firecracker style.
    pub fn root_args(&self) -> Option<String> {
        let root = self.drives.first().filter(|d| d.is_root_device)?;
        let mode = if root.is_read_only { "ro" } else { "rw" };
        Some(match &root.partuuid {
            Some(uuid) => format!("root=PARTUUID={uuid} {mode}"),
            None => format!("root=/dev/vda {mode}"),
        })
    }
}
