//! The kinds of virtio device rollbox has, in one place: how each is created from the VM's
//! configuration ([`create_devices`], [`CreateError`]), what a snapshot records of it
//! ([`DevicePersistKind`], [`DevicePersistKind::save`]) and how a restore rebuilds it with the
//! overrides it takes ([`DevicePersistKind::restore`]). A new device adds a line or an arm to
//! each of those; its model, state and restore live in its own folder (`persist.rs`).

use std::any::Any;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use snapshot::Persist;

use super::DeviceManagerError;
use crate::arch::layout::{IRQ_BASE, IRQ_MAX};
use crate::devices::virtio::block::persist::{BlockPersistState, BlockRestoreArgs};
use crate::devices::virtio::block::{Block, BlockConfig, BlockError};
use crate::devices::virtio::fs::persist::{FsPersistState, FsRestoreArgs, FsRestoreError};
use crate::devices::virtio::fs::{Fs, FsError};
use crate::devices::virtio::net::persist::{NetPersistState, NetRestoreArgs};
use crate::devices::virtio::net::tap::AttachedTaps;
use crate::devices::virtio::net::{Net, NetConfig, NetError, NetOverride};
use crate::devices::virtio::vsock::persist::{VsockPersistState, VsockRestoreArgs};
use crate::devices::virtio::vsock::{Vsock, VsockError};
use crate::devices::virtio::VirtioDevice;
use crate::vmm_config::{ConfigError, Validate, VmResources};

/// Why a device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// Invalid device configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A drive.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The vsock device.
    #[error(transparent)]
    Vsock(#[from] VsockError),
    /// A network interface.
    #[error(transparent)]
    Net(#[from] NetError),
    /// A shared volume (virtio-fs).
    #[error(transparent)]
    Fs(#[from] FsError),
    /// More virtio devices than interrupt lines.
    #[error("too many virtio devices ({0}); at most {max} fit", max = IRQ_MAX - IRQ_BASE + 1)]
    TooManyDevices(usize),
}

/// Creates the devices of `resources` (opening drives and binding the vsock socket).
pub fn create_devices(resources: &VmResources) -> Result<Vec<Box<dyn VirtioDevice>>, CreateError> {
    let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
    for drive in &resources.drives {
        devices.push(Box::new(Block::new(BlockConfig {
            id: drive.drive_id.clone(),
            path: drive.path_on_host.clone(),
            read_only: drive.is_read_only,
        })?));
    }
    if let Some(vsock) = &resources.vsock {
        devices.push(Box::new(Vsock::new(vsock.guest_cid, &vsock.uds_path)?));
    }
    for iface in &resources.net {
        devices.push(Box::new(Net::new(
            NetConfig {
                iface_id: iface.iface_id.clone(),
                host_dev_name: iface.host_dev_name.clone(),
                guest_mac: iface.validate()?,
            },
            &resources.taps,
        )?));
    }
    for (index, fs) in resources.fs.iter().enumerate() {
        devices.push(Box::new(Fs::start_volume(
            resources.virtiofsd.as_deref(),
            index,
            fs,
        )?));
    }
    if devices.len() > (IRQ_MAX - IRQ_BASE + 1) as usize {
        return Err(CreateError::TooManyDevices(devices.len()));
    }
    Ok(devices)
}

/// Which device a slot holds, with its own saved state. The variant names are the state
/// file's tags.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DevicePersistKind {
    /// virtio-blk.
    Block(BlockPersistState),
    /// virtio-vsock.
    Vsock(VsockPersistState),
    /// virtio-net.
    Net(NetPersistState),
    /// virtio-fs: the volume and virtiofsd's saved state.
    Fs(Box<FsPersistState>),
}

/// What a restore gives devices instead of what their snapshot recorded.
#[derive(Debug, Clone, Copy)]
pub struct DeviceOverrides<'a> {
    /// New images, by drive ID.
    pub drives: &'a HashMap<String, PathBuf>,
    /// New taps (and MACs), by interface ID.
    pub nets: &'a HashMap<String, NetOverride>,
    /// A new host-side vsock socket.
    pub vsock_uds: Option<&'a Path>,
    /// New shared directories, by volume tag.
    pub fs_dirs: &'a HashMap<String, PathBuf>,
    /// Sockets of virtiofsd the caller started, by volume tag: those volumes start none.
    pub fs_sockets: &'a HashMap<String, PathBuf>,
    /// The virtiofsd binary for volumes.
    pub virtiofsd: Option<&'a Path>,
    /// Taps the caller attached already.
    pub taps: &'a AttachedTaps,
}

/// The rebuilt device, or why `device` could not be rebuilt.
fn rebuilt<D: VirtioDevice>(
    device: String,
    result: Result<D, impl std::fmt::Display>,
) -> Result<Box<dyn VirtioDevice>, DeviceManagerError> {
    match result {
        Ok(rebuilt) => Ok(Box::new(rebuilt)),
        Err(e) => Err(DeviceManagerError::Device {
            device,
            detail: e.to_string(),
        }),
    }
}

/// `device`'s saved state, if it is a `D`.
fn save_as<D>(
    device: &dyn Any,
    kind: fn(D::State) -> DevicePersistKind,
) -> Option<Result<DevicePersistKind, String>>
where
    D: Persist + 'static,
    D::Error: std::fmt::Display,
{
    let device = device.downcast_ref::<D>()?;
    Some(device.save().map(kind).map_err(|e| e.to_string()))
}

impl DevicePersistKind {
    /// What a snapshot records of `device`.
    pub fn save(device: &dyn VirtioDevice) -> Result<Self, DeviceManagerError> {
        let any: &dyn Any = device;
        save_as::<Block>(any, Self::Block)
            .or_else(|| save_as::<Vsock>(any, Self::Vsock))
            .or_else(|| save_as::<Net>(any, Self::Net))
            .or_else(|| save_as::<Fs>(any, |fs| Self::Fs(Box::new(fs))))
            .unwrap_or_else(|| Err("snapshots do not know this kind of device".into()))
            .map_err(|detail| DeviceManagerError::Device {
                device: device.name(),
                detail,
            })
    }

    /// Rebuilds the device, the `index`th of its VM, with what `overrides` gives it.
    pub fn restore(
        &self,
        index: usize,
        overrides: &DeviceOverrides<'_>,
    ) -> Result<Box<dyn VirtioDevice>, DeviceManagerError> {
        match self {
            Self::Block(state) => {
                let args = BlockRestoreArgs {
                    path: overrides.drives.get(&state.id).cloned(),
                };
                rebuilt(format!("drive {}", state.id), Block::restore(args, state))
            }
            Self::Vsock(state) => {
                let args = VsockRestoreArgs {
                    uds_path: overrides.vsock_uds.map(Path::to_path_buf),
                };
                rebuilt("vsock".into(), Vsock::restore(args, state))
            }
            Self::Net(state) => {
                let args = NetRestoreArgs {
                    host: overrides.nets.get(&state.iface_id).cloned(),
                    taps: overrides.taps.clone(),
                };
                let name = format!("network interface {}", state.iface_id);
                rebuilt(name, Net::restore(args, state))
            }
            Self::Fs(state) => {
                let tag = &state.config.tag;
                let args = FsRestoreArgs {
                    index,
                    shared_dir: overrides.fs_dirs.get(tag).cloned(),
                    socket: overrides.fs_sockets.get(tag).cloned(),
                    virtiofsd: overrides.virtiofsd.map(Path::to_path_buf),
                };
                match Fs::restore(args, state) {
                    // As when the VM was built: virtiofsd's own error.
                    Err(FsRestoreError::Start(e)) => Err(CreateError::Fs(e).into()),
                    result => rebuilt(format!("fs {tag}"), result),
                }
            }
        }
    }

    /// The drive, if the slot holds one.
    pub fn as_drive(&self) -> Option<&BlockPersistState> {
        match self {
            Self::Block(state) => Some(state),
            _ => None,
        }
    }

    /// The network interface, if the slot holds one.
    pub fn as_net(&self) -> Option<&NetPersistState> {
        match self {
            Self::Net(state) => Some(state),
            _ => None,
        }
    }

    /// The volume, if the slot holds one.
    pub fn as_volume(&self) -> Option<&FsPersistState> {
        match self {
            Self::Fs(state) => Some(state),
            _ => None,
        }
    }

    /// Whether the slot holds the vsock device.
    pub fn is_vsock(&self) -> bool {
        matches!(self, Self::Vsock(_))
    }

    /// The device's name, if something outside the VMM maps guest memory for it (a volume's
    /// virtiofsd): its guest memory must be shared, and cannot be served lazily.
    pub fn memory_mapper(&self) -> Option<String> {
        self.as_volume().map(|fs| format!("fs {}", fs.config.tag))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::QueueContext;

    /// A device of a kind snapshots do not know.
    struct Unknown;

    impl VirtioDevice for Unknown {
        fn device_type(&self) -> u32 {
            42
        }
        fn avail_features(&self) -> u64 {
            0
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[]
        }
        fn read_config(&self, _offset: u64, data: &mut [u8]) {
            data.fill(0);
        }
        fn process_queue(&mut self, _queue: usize, _ctx: &mut QueueContext<'_>) {}
        fn name(&self) -> String {
            "unknown".into()
        }
    }

    #[test]
    fn each_device_saves_as_its_kind_and_restores_with_its_override() {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("disk.img");
        let copy = dir.path().join("copy.img");
        std::fs::write(&image, vec![0u8; 4096]).expect("image");
        std::fs::write(&copy, vec![0u8; 4096]).expect("copy");
        let block: Box<dyn VirtioDevice> = Box::new(
            Block::new(BlockConfig {
                id: "rootfs".into(),
                path: image.clone(),
                read_only: false,
            })
            .expect("drive"),
        );
        let vsock: Box<dyn VirtioDevice> =
            Box::new(Vsock::new(3, &dir.path().join("v.sock")).expect("vsock"));
        let drive = DevicePersistKind::save(block.as_ref()).expect("save the drive");
        assert_eq!(
            drive.as_drive().map(|d| (d.id.as_str(), d.path.clone())),
            Some(("rootfs", image))
        );
        let socket = DevicePersistKind::save(vsock.as_ref()).expect("save vsock");
        assert!(socket.is_vsock() && socket.as_drive().is_none());
        drop(vsock);

        let drives = HashMap::from([("rootfs".to_string(), copy.clone())]);
        let (nets, fs_dirs) = (HashMap::new(), HashMap::new());
        let clone_socket = dir.path().join("clone.sock");
        let overrides = DeviceOverrides {
            drives: &drives,
            nets: &nets,
            vsock_uds: Some(&clone_socket),
            fs_dirs: &fs_dirs,
            fs_sockets: &fs_dirs,
            virtiofsd: None,
            taps: &AttachedTaps::default(),
        };
        let restored = drive.restore(0, &overrides).expect("restore the drive");
        let again = DevicePersistKind::save(restored.as_ref()).expect("save again");
        assert_eq!(again.as_drive().map(|d| d.path.clone()), Some(copy));
        let restored = socket.restore(1, &overrides).expect("restore vsock");
        let again = DevicePersistKind::save(restored.as_ref()).expect("save vsock again");
        assert_eq!(
            again,
            DevicePersistKind::Vsock(VsockPersistState {
                guest_cid: 3,
                uds_path: clone_socket,
            })
        );

        let err = DevicePersistKind::save(&Unknown).expect_err("an unknown kind");
        assert_eq!(
            err.to_string(),
            "device unknown: snapshots do not know this kind of device"
        );
    }
}
