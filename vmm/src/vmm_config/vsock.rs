//! The vsock device (`vsock`): its guest CID and host socket.

use vmm_api::VsockConfig;

use super::validate::{ConfigError, Validate};

/// The CID.
impl Validate for VsockConfig {
    type Valid = ();

    fn validate(&self) -> Result<(), ConfigError> {
        if self.guest_cid < 3 || self.guest_cid > u64::from(u32::MAX) {
            return Err(ConfigError::GuestCid(self.guest_cid));
        }
        Ok(())
    }
}
