//! Shared volumes (`fs`, a rollbox extension): virtio-fs tags over host directories. The fs
//! device checks a volume ([`check_volume`]); here its errors get the API's names, and a
//! volume needs a virtiofsd to serve it.

use vmm_api::FsConfig;

use super::resources::VmResources;
use super::validate::{ConfigError, Validate};
use crate::devices::virtio::fs::{check_volume, locate_virtiofsd, VolumeError};

/// The tag, the directory and the socket.
impl Validate for FsConfig {
    type Valid = ();

    fn validate(&self) -> Result<(), ConfigError> {
        check_volume(self).map_err(|e| match e {
            VolumeError::Tag(tag) => ConfigError::FsTag(tag),
            VolumeError::SharedDir { tag, path, detail } => {
                ConfigError::FsDir { tag, path, detail }
            }
            VolumeError::Socket { tag, path } => ConfigError::FsSocket { tag, path },
            VolumeError::SocketOptions(tag) => ConfigError::FsSocketOptions(tag),
        })
    }
}

impl VmResources {
    /// Adds a shared volume after checking it: its tag is new, and its directory and the
    /// virtiofsd that will serve it exist, or the caller's socket does (the directory is then
    /// that virtiofsd's, not checked here).
    pub fn add_fs(&mut self, fs: FsConfig) -> Result<(), ConfigError> {
        fs.validate()?;
        if self.fs.iter().any(|f| f.tag == fs.tag) {
            return Err(ConfigError::FsTagClash(fs.tag));
        }
        if fs.socket.is_none() {
            locate_virtiofsd(self.virtiofsd.as_deref()).map_err(|e| ConfigError::NoVirtiofsd {
                tag: fs.tag.clone(),
                detail: e.to_string(),
            })?;
        }
        self.fs.push(fs);
        Ok(())
    }
}
