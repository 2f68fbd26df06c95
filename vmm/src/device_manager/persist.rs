//! Saving and restoring every device: COM1, the i8042 and each virtio slot (the device's own
//! state next to its transport's registers and queues), in the state file's shapes.

use serde::{Deserialize, Serialize};
use snapshot::Persist;

use super::kinds::{DeviceOverrides, DevicePersistKind};
use super::{DeviceManager, DeviceManagerError};
use crate::devices::legacy::i8042::I8042PersistState;
use crate::devices::legacy::serial::SerialPersistState;
use crate::devices::virtio::fs::persist::fs_socket_and_override;
use crate::devices::virtio::mmio::persist::{
    QueuePersistState, TransportRegisters, TransportState,
};
use crate::devices::virtio::VirtioDevice;
use crate::vstate::bus::lock;

/// One virtio-mmio slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioPersistState {
    /// The device.
    pub kind: DevicePersistKind,
    /// Transport registers.
    pub transport: TransportRegisters,
    /// Queues.
    pub queues: Vec<QueuePersistState>,
}

impl VirtioPersistState {
    /// The transport's part.
    pub fn transport_state(&self) -> TransportState {
        TransportState {
            registers: self.transport.clone(),
            queues: self.queues.clone(),
        }
    }
}

/// Every device's saved state.
#[derive(Debug)]
pub struct DeviceStates {
    /// COM1.
    pub serial: SerialPersistState,
    /// i8042.
    pub i8042: I8042PersistState,
    /// Virtio devices in MMIO order.
    pub virtio: Vec<VirtioPersistState>,
}

/// Device states from a snapshot, for a restore.
pub struct SavedDevices<'a> {
    /// COM1.
    pub serial: &'a SerialPersistState,
    /// i8042.
    pub i8042: &'a I8042PersistState,
    /// Virtio transports, in MMIO order.
    pub virtio: &'a [VirtioPersistState],
}

impl DeviceManager {
    /// Saves every device (the VM paused, backends saved).
    pub fn save(&self) -> Result<DeviceStates, DeviceManagerError> {
        let serial = lock(&self.serial)
            .save()
            .map_err(|detail| DeviceManagerError::Device {
                device: "serial".into(),
                detail,
            })?;
        let i8042 = match lock(&self.i8042).save() {
            Ok(state) => state,
            Err(never) => match never {},
        };
        let virtio = self
            .virtio
            .iter()
            .map(|slot| {
                let transport = lock(&slot.transport);
                let saved = transport
                    .save()
                    .map_err(|detail| DeviceManagerError::Device {
                        device: transport.device().name(),
                        detail,
                    })?;
                Ok(VirtioPersistState {
                    kind: DevicePersistKind::save(transport.device())?,
                    transport: saved.registers,
                    queues: saved.queues,
                })
            })
            .collect::<Result<Vec<_>, DeviceManagerError>>()?;
        Ok(DeviceStates {
            serial,
            i8042,
            virtio,
        })
    }
}

/// Refuses overrides that name no device of the snapshot, and a volume given both a new
/// directory and a caller's virtiofsd socket.
pub fn check_overrides(
    slots: &[VirtioPersistState],
    overrides: &DeviceOverrides<'_>,
) -> Result<(), DeviceManagerError> {
    let kinds = || slots.iter().map(|slot| &slot.kind);
    for tag in overrides.fs_dirs.keys() {
        if !kinds().any(|k| k.as_volume().is_some_and(|fs| &fs.config.tag == tag)) {
            return Err(DeviceManagerError::Mismatch(format!(
                "fs_overrides: the snapshot has no volume with tag {tag:?}"
            )));
        }
    }
    for tag in overrides.fs_sockets.keys() {
        if !kinds().any(|k| k.as_volume().is_some_and(|fs| &fs.config.tag == tag)) {
            return Err(DeviceManagerError::Mismatch(format!(
                "fs_sockets: the snapshot has no volume with tag {tag:?}"
            )));
        }
        if overrides.fs_dirs.contains_key(tag) {
            return Err(DeviceManagerError::Mismatch(fs_socket_and_override(tag)));
        }
    }
    for id in overrides.drives.keys() {
        if !kinds().any(|k| k.as_drive().is_some_and(|drive| &drive.id == id)) {
            return Err(DeviceManagerError::Mismatch(format!(
                "drive_overrides: the snapshot has no drive with ID {id:?}"
            )));
        }
    }
    for id in overrides.nets.keys() {
        if !kinds().any(|k| k.as_net().is_some_and(|net| &net.iface_id == id)) {
            return Err(DeviceManagerError::Mismatch(format!(
                "network_overrides: the snapshot has no network interface with iface_id {id:?}"
            )));
        }
    }
    Ok(())
}

/// Rebuilds the virtio devices of `slots`, in order, with what `overrides` gives them.
pub fn rebuild_devices(
    slots: &[VirtioPersistState],
    overrides: &DeviceOverrides<'_>,
) -> Result<Vec<Box<dyn VirtioDevice>>, DeviceManagerError> {
    slots
        .iter()
        .enumerate()
        .map(|(index, slot)| slot.kind.restore(index, overrides))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::devices::virtio::block::persist::BlockPersistState;
    use crate::devices::virtio::fs::persist::FsPersistState;
    use crate::devices::virtio::net::persist::NetPersistState;
    use crate::devices::virtio::vsock::persist::VsockPersistState;
    use crate::vmm_config::{FsCache, FsConfig};

    /// The device fields of a `MicroVmState`, in its order.
    #[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
    struct DeviceFields {
        serial: SerialPersistState,
        i8042: I8042PersistState,
        devices: Vec<VirtioPersistState>,
    }

    fn slot(n: u64, kind: DevicePersistKind) -> VirtioPersistState {
        VirtioPersistState {
            kind,
            transport: TransportRegisters {
                queue_select: n as u32,
                device_features_select: 1,
                driver_features_select: 1,
                acked_features: (1 << 32) | n,
                status: 0xf,
                config_generation: 2,
                interrupt_status: 1,
            },
            queues: vec![QueuePersistState {
                max_size: 256,
                size: 128,
                ready: true,
                desc_table: 0x1000 * n,
                avail_ring: 0x1000 * n + 0x800,
                used_ring: 0x1000 * n + 0xc00,
                next_avail: 7,
                next_used: 6,
                event_idx_enabled: n.is_multiple_of(2),
            }],
        }
    }

    fn every_device() -> DeviceFields {
        DeviceFields {
            serial: SerialPersistState {
                line_control: 3,
                line_status: 0x60,
                in_buffer: b"hi".to_vec(),
                empty_polls: 12,
                ..Default::default()
            },
            i8042: I8042PersistState {
                control: 0x45,
                status: 0x14,
                output: vec![0xfa],
                expecting: Some(0x60),
            },
            devices: vec![
                slot(
                    1,
                    DevicePersistKind::Block(BlockPersistState {
                        id: "rootfs".into(),
                        path: "/images/rootfs.ext4".into(),
                        read_only: true,
                    }),
                ),
                slot(
                    2,
                    DevicePersistKind::Vsock(VsockPersistState {
                        guest_cid: 3,
                        uds_path: "/run/v.sock".into(),
                    }),
                ),
                slot(
                    3,
                    DevicePersistKind::Net(NetPersistState {
                        iface_id: "eth0".into(),
                        host_dev_name: "tap0".into(),
                        guest_mac: Some([2, 0, 0, 0, 0, 1]),
                    }),
                ),
                slot(
                    4,
                    DevicePersistKind::Fs(Box::new(FsPersistState {
                        config: FsConfig {
                            tag: "data".into(),
                            shared_dir: "/srv/data".into(),
                            readonly: false,
                            cache: FsCache::Never,
                            socket: None,
                        },
                        virtiofsd: Some("/usr/libexec/virtiofsd".into()),
                        backend_state: vec![1, 2, 3],
                    })),
                ),
            ],
        }
    }

    /// A state file of [`DeviceFields`] written by the types before per-device persist (commit
    /// ea85953): one drive, vsock, network interface and volume.
    const SAVED_BY_OLD_TYPES: &str = concat!(
        "524258534e4150000100000023060000000000009dd16a6fa36673657269616cab70626175645f6469766973",
        "6f725f6c6f770071626175645f64697669736f725f686967680070696e746572727570745f656e61626c6500",
        "7818696e746572727570745f6964656e74696669636174696f6e006c6c696e655f636f6e74726f6c036b6c69",
        "6e655f73746174757318606d6d6f64656d5f636f6e74726f6c006c6d6f64656d5f7374617475730067736372",
        "617463680069696e5f62756666657282186818696b656d7074795f706f6c6c730c656938303432a467636f6e",
        "74726f6c18456673746174757314666f75747075748118fa69657870656374696e6718606764657669636573",
        "84a3646b696e64a165426c6f636ba362696466726f6f7466736470617468732f696d616765732f726f6f7466",
        "732e6578743469726561645f6f6e6c79f5697472616e73706f7274a76c71756575655f73656c656374017664",
        "65766963655f66656174757265735f73656c65637401766472697665725f66656174757265735f73656c6563",
        "74016e61636b65645f66656174757265731b0000000100000001667374617475730f71636f6e6669675f6765",
        "6e65726174696f6e0270696e746572727570745f737461747573016671756575657381a9686d61785f73697a",
        "651901006473697a651880657265616479f56a646573635f7461626c651910006a617661696c5f72696e6719",
        "180069757365645f72696e67191c006a6e6578745f617661696c07696e6578745f7573656406716576656e74",
        "5f6964785f656e61626c6564f4a3646b696e64a16556736f636ba26967756573745f63696403687564735f70",
        "6174686b2f72756e2f762e736f636b697472616e73706f7274a76c71756575655f73656c6563740276646576",
        "6963655f66656174757265735f73656c65637401766472697665725f66656174757265735f73656c65637401",
        "6e61636b65645f66656174757265731b0000000100000002667374617475730f71636f6e6669675f67656e65",
        "726174696f6e0270696e746572727570745f737461747573016671756575657381a9686d61785f73697a6519",
        "01006473697a651880657265616479f56a646573635f7461626c651920006a617661696c5f72696e67192800",
        "69757365645f72696e67192c006a6e6578745f617661696c07696e6578745f7573656406716576656e745f69",
        "64785f656e61626c6564f5a3646b696e64a1634e6574a36869666163655f696464657468306d686f73745f64",
        "65765f6e616d6564746170306967756573745f6d616386020000000001697472616e73706f7274a76c717565",
        "75655f73656c65637403766465766963655f66656174757265735f73656c65637401766472697665725f6665",
        "6174757265735f73656c656374016e61636b65645f66656174757265731b0000000100000003667374617475",
        "730f71636f6e6669675f67656e65726174696f6e0270696e746572727570745f737461747573016671756575",
        "657381a9686d61785f73697a651901006473697a651880657265616479f56a646573635f7461626c65193000",
        "6a617661696c5f72696e6719380069757365645f72696e67193c006a6e6578745f617661696c07696e657874",
        "5f7573656406716576656e745f6964785f656e61626c6564f4a3646b696e64a1624673a366636f6e666967a4",
        "6374616764646174616a7368617265645f646972692f7372762f6461746168726561646f6e6c79f465636163",
        "6865656e657665726976697274696f667364762f7573722f6c6962657865632f76697274696f6673646d6261",
        "636b656e645f737461746583010203697472616e73706f7274a76c71756575655f73656c6563740476646576",
        "6963655f66656174757265735f73656c65637401766472697665725f66656174757265735f73656c65637401",
        "6e61636b65645f66656174757265731b0000000100000004667374617475730f71636f6e6669675f67656e65",
        "726174696f6e0270696e746572727570745f737461747573016671756575657381a9686d61785f73697a6519",
        "01006473697a651880657265616479f56a646573635f7461626c651940006a617661696c5f72696e67194800",
        "69757365645f72696e67194c006a6e6578745f617661696c07696e6578745f7573656406716576656e745f69",
        "64785f656e61626c6564f5",
    );

    #[test]
    fn fs_sockets_must_name_a_volume_and_not_one_with_a_new_directory() {
        let slots = every_device().devices;
        let empty = HashMap::new();
        let unknown = HashMap::from([("other".to_string(), PathBuf::from("/run/fs.sock"))]);
        let known = HashMap::from([("data".to_string(), PathBuf::from("/run/fs.sock"))]);
        let dirs = HashMap::from([("data".to_string(), PathBuf::from("/srv/copy"))]);
        let with = |fs_dirs, fs_sockets| {
            check_overrides(
                &slots,
                &DeviceOverrides {
                    drives: &empty,
                    nets: &HashMap::new(),
                    vsock_uds: None,
                    fs_dirs,
                    fs_sockets,
                    virtiofsd: None,
                    taps: &Default::default(),
                },
            )
            .map_err(|e| e.to_string())
        };
        assert_eq!(with(&empty, &known), Ok(()));
        assert_eq!(with(&dirs, &empty), Ok(()));
        assert_eq!(
            with(&empty, &unknown),
            Err(r#"fs_sockets: the snapshot has no volume with tag "other""#.to_string())
        );
        let both = with(&dirs, &known).expect_err("a socket and a directory");
        assert!(both.contains("fs_sockets and fs_overrides"), "{both}");
    }

    fn from_hex(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect()
    }

    #[test]
    fn a_state_file_of_the_old_device_types_loads_and_encodes_to_the_same_bytes() {
        let old = from_hex(SAVED_BY_OLD_TYPES);
        let loaded: DeviceFields =
            snapshot::format::decode(Path::new("old-vmstate"), &old).expect("decode");
        assert_eq!(loaded, every_device());
        let again = snapshot::format::encode(&loaded).expect("encode");
        assert!(again == old, "the encoding of the device state changed");
    }
}
