//! The bodies that describe a microVM's resources (`PUT /boot-source`, `/machine-config`,
//! `/drives/{id}`, `/network-interfaces/{id}`, `/vsock`, `/fs/{tag}`, `/vfio`) and the
//! `rollbox-vmm --config FILE.json` file made of them. The JSON shapes are Firecracker's, plus
//! rollbox's extensions; rollbox-vmm's checks of them live in `vmm::vmm_config`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `PUT /boot-source`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootSourceConfig {
    /// ELF vmlinux or bzImage.
    pub kernel_image_path: PathBuf,
    /// Kernel command line; rollbox-vmm appends its device arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_args: Option<String>,
    /// Initial ramdisk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<PathBuf>,
}

/// `PUT /machine-config`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineConfig {
    /// Number of vCPUs.
    pub vcpu_count: u64,
    /// Guest memory in MiB.
    pub mem_size_mib: u64,
    /// Simultaneous multithreading (only `false`).
    #[serde(default)]
    pub smt: bool,
    /// Track dirty pages for diff snapshots.
    #[serde(default)]
    pub track_dirty_pages: bool,
    /// Firecracker CPU templates are not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
    /// Huge pages ("None" only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub huge_pages: Option<String>,
    /// rollbox extension: a deterministic machine. CPUID hides RDRAND and RDSEED, so the guest
    /// kernel draws no host entropy, and its snapshots can be restored with `deterministic`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deterministic: bool,
    /// rollbox extension (`"rollbox"` in the machine configuration): PCI and VFIO.
    #[serde(default, skip_serializing_if = "MachineExtension::is_default")]
    pub rollbox: MachineExtension,
}

/// rollbox's machine options that Firecracker does not have, under `"rollbox"` in
/// `machine-config`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineExtension {
    /// A PCI root bus (CF8/CFC and ECAM, announced by ACPI's MCFG and `PCI0`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pci: bool,
    /// Host PCI devices bound to `vfio-pci` to pass through, as sysfs paths
    /// (`/sys/bus/pci/devices/DDDD:BB:DD.F`); implies `pci`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vfio: Vec<PathBuf>,
}

impl MachineExtension {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Whether the machine has a PCI bus (asked for, or implied by a VFIO device).
    pub fn has_pci(&self) -> bool {
        self.pci || !self.vfio.is_empty()
    }
}

impl Default for MachineConfig {
    fn default() -> Self {
        Self {
            vcpu_count: 1,
            mem_size_mib: 128,
            smt: false,
            track_dirty_pages: false,
            cpu_template: None,
            huge_pages: None,
            deterministic: false,
            rollbox: MachineExtension::default(),
        }
    }
}

/// `PUT /drives/{drive_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriveConfig {
    /// Drive ID; also the virtio-blk device ID the guest reads.
    pub drive_id: String,
    /// Raw image on the host.
    pub path_on_host: PathBuf,
    /// Whether this drive is the guest's root file system (`root=/dev/vda`).
    #[serde(default)]
    pub is_root_device: bool,
    /// Read-only for the guest.
    #[serde(default)]
    pub is_read_only: bool,
    /// Partition UUID of the root partition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partuuid: Option<String>,
    /// "Unsafe" or "Writeback" (flushes always reach the host file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_type: Option<String>,
    /// "Sync" only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_engine: Option<String>,
    /// Rate limiters are not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<serde_json::Value>,
    /// vhost-user block sockets are not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
}

impl DriveConfig {
    /// A writable, non-root drive `drive_id` backed by `path_on_host`, without options.
    pub fn new(drive_id: impl Into<String>, path_on_host: impl Into<PathBuf>) -> Self {
        Self {
            drive_id: drive_id.into(),
            path_on_host: path_on_host.into(),
            is_root_device: false,
            is_read_only: false,
            partuuid: None,
            cache_type: None,
            io_engine: None,
            rate_limiter: None,
            socket: None,
        }
    }
}

/// `PUT /network-interfaces/{iface_id}` (Firecracker's body).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkInterfaceConfig {
    /// Interface ID.
    pub iface_id: String,
    /// Host tap device; it is created if it does not exist (which needs CAP_NET_ADMIN).
    pub host_dev_name: String,
    /// The guest's MAC; without it the guest picks a random one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
    /// Rate limiters are not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_rate_limiter: Option<serde_json::Value>,
    /// Rate limiters are not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_rate_limiter: Option<serde_json::Value>,
}

/// `PUT /vsock`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's context ID (3 or more).
    pub guest_cid: u64,
    /// Host-side Unix socket: the host connects here and sends `CONNECT <port>\n`; guest
    /// connections to host port P arrive on `<uds_path>_P`.
    pub uds_path: PathBuf,
    /// Deprecated Firecracker field, accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_id: Option<String>,
}

/// virtiofsd's caching policy for a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FsCache {
    /// virtiofsd's default: metadata and data cached with close-to-open consistency.
    #[default]
    Auto,
    /// Cache as much as possible: only the guest changes the directory.
    Always,
    /// No caching: every access goes to the host (others change the directory too).
    Never,
}

/// rollbox extension: a shared host directory over virtio-fs (`--fs`, `"fs"` in the config
/// file, `PUT /fs/{tag}`). The guest mounts it with `mount -t virtiofs TAG DIR`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    /// The mount tag the guest sees (1-36 bytes).
    pub tag: String,
    /// The host directory.
    pub shared_dir: PathBuf,
    /// The guest may not change anything (virtiofsd `--readonly`).
    #[serde(default)]
    pub readonly: bool,
    /// virtiofsd's cache policy.
    #[serde(default)]
    pub cache: FsCache,
    /// The vhost-user socket of a virtiofsd the caller started; without it rollbox-vmm starts
    /// one for the volume and stops it with the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
}

/// `PUT /vfio` body (a rollbox extension).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VfioDevice {
    /// The device's sysfs path, `/sys/bus/pci/devices/DDDD:BB:DD.F`.
    pub path: std::path::PathBuf,
}

/// A Firecracker-style configuration file, plus rollbox's `console`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Kernel, command line and initrd.
    #[serde(
        rename = "boot-source",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub boot_source: Option<BootSourceConfig>,
    /// vCPUs and memory.
    #[serde(
        rename = "machine-config",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub machine_config: Option<MachineConfig>,
    /// Block devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drives: Vec<DriveConfig>,
    /// The vsock device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<VsockConfig>,
    /// Network interfaces.
    #[serde(
        rename = "network-interfaces",
        default,
        skip_serializing_if = "Vec::is_empty"
    )]
    pub network_interfaces: Vec<NetworkInterfaceConfig>,
    /// rollbox extension: "stdout" or a file path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console: Option<String>,
    /// rollbox extension: the largest size of a console file in bytes (at least 1024; the
    /// VMM's default is 8 MiB); later output is dropped and counted.
    #[serde(
        rename = "console-max-bytes",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub console_max_bytes: Option<u64>,
    /// rollbox extension (not a Firecracker field): shared volumes over virtio-fs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fs: Vec<FsConfig>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::assert_wire;

    fn drive() -> DriveConfig {
        DriveConfig {
            is_root_device: true,
            ..DriveConfig::new("rootfs", "/r.img")
        }
    }

    #[test]
    fn boot_source() {
        let mut boot = BootSourceConfig {
            kernel_image_path: "/k".into(),
            boot_args: None,
            initrd_path: None,
        };
        assert_wire(&boot, r#"{"kernel_image_path":"/k"}"#);
        boot.boot_args = Some("console=ttyS0".into());
        boot.initrd_path = Some("/i".into());
        assert_wire(
            &boot,
            r#"{"kernel_image_path":"/k","boot_args":"console=ttyS0","initrd_path":"/i"}"#,
        );
    }

    #[test]
    fn machine_config_and_its_rollbox_extension() {
        assert_wire(
            &MachineConfig::default(),
            r#"{"vcpu_count":1,"mem_size_mib":128,"smt":false,"track_dirty_pages":false}"#,
        );
        let full = MachineConfig {
            vcpu_count: 2,
            mem_size_mib: 256,
            smt: false,
            track_dirty_pages: true,
            cpu_template: Some("None".into()),
            huge_pages: Some("None".into()),
            deterministic: true,
            rollbox: MachineExtension {
                pci: true,
                vfio: vec!["/sys/bus/pci/devices/0000:00:04.0".into()],
            },
        };
        assert_wire(
            &full,
            r#"{"vcpu_count":2,"mem_size_mib":256,"smt":false,"track_dirty_pages":true,"cpu_template":"None","huge_pages":"None","deterministic":true,"rollbox":{"pci":true,"vfio":["/sys/bus/pci/devices/0000:00:04.0"]}}"#,
        );
        // Firecracker's minimal body; smt and track_dirty_pages default to false.
        let minimal: MachineConfig =
            serde_json::from_str(r#"{"vcpu_count":1,"mem_size_mib":64}"#).expect("parse");
        assert_eq!(minimal.mem_size_mib, 64);
        assert!(!minimal.rollbox.has_pci());
        let vfio_only = MachineExtension {
            pci: false,
            vfio: vec!["/x".into()],
        };
        assert!(vfio_only.has_pci(), "a VFIO device implies a PCI bus");
        assert_wire(&vfio_only, r#"{"vfio":["/x"]}"#);
    }

    #[test]
    fn drives() {
        assert_wire(
            &drive(),
            r#"{"drive_id":"rootfs","path_on_host":"/r.img","is_root_device":true,"is_read_only":false}"#,
        );
        let every_field = DriveConfig {
            partuuid: Some("0eaa91a0-01".into()),
            cache_type: Some("Writeback".into()),
            io_engine: Some("Sync".into()),
            rate_limiter: Some(serde_json::json!({})),
            socket: Some("/vhost.sock".into()),
            ..drive()
        };
        assert_wire(
            &every_field,
            r#"{"drive_id":"rootfs","path_on_host":"/r.img","is_root_device":true,"is_read_only":false,"partuuid":"0eaa91a0-01","cache_type":"Writeback","io_engine":"Sync","rate_limiter":{},"socket":"/vhost.sock"}"#,
        );
        let defaults: DriveConfig =
            serde_json::from_str(r#"{"drive_id":"d","path_on_host":"/d"}"#).expect("parse");
        assert!(!defaults.is_root_device && !defaults.is_read_only);
    }

    #[test]
    fn network_interfaces() {
        let mut iface = NetworkInterfaceConfig {
            iface_id: "eth0".into(),
            host_dev_name: "tap0".into(),
            guest_mac: Some("06:00:ac:10:00:02".into()),
            rx_rate_limiter: None,
            tx_rate_limiter: None,
        };
        assert_wire(
            &iface,
            r#"{"iface_id":"eth0","host_dev_name":"tap0","guest_mac":"06:00:ac:10:00:02"}"#,
        );
        iface.guest_mac = None;
        iface.rx_rate_limiter = Some(serde_json::json!({"bandwidth": null}));
        iface.tx_rate_limiter = Some(serde_json::json!({}));
        assert_wire(
            &iface,
            r#"{"iface_id":"eth0","host_dev_name":"tap0","rx_rate_limiter":{"bandwidth":null},"tx_rate_limiter":{}}"#,
        );
    }

    #[test]
    fn vsock_fs_and_vfio() {
        let mut vsock = VsockConfig {
            guest_cid: 3,
            uds_path: "/v.sock".into(),
            vsock_id: None,
        };
        assert_wire(&vsock, r#"{"guest_cid":3,"uds_path":"/v.sock"}"#);
        vsock.vsock_id = Some("vsock0".into());
        assert_wire(
            &vsock,
            r#"{"guest_cid":3,"uds_path":"/v.sock","vsock_id":"vsock0"}"#,
        );
        let mut fs = FsConfig {
            tag: "data".into(),
            shared_dir: "/srv".into(),
            readonly: false,
            cache: FsCache::Auto,
            socket: None,
        };
        assert_wire(
            &fs,
            r#"{"tag":"data","shared_dir":"/srv","readonly":false,"cache":"auto"}"#,
        );
        fs.readonly = true;
        fs.cache = FsCache::Never;
        fs.socket = Some("/fs.sock".into());
        assert_wire(
            &fs,
            r#"{"tag":"data","shared_dir":"/srv","readonly":true,"cache":"never","socket":"/fs.sock"}"#,
        );
        assert_wire(&FsCache::Always, r#""always""#);
        let defaults: FsConfig =
            serde_json::from_str(r#"{"tag":"t","shared_dir":"/tmp"}"#).expect("parse");
        assert_eq!((defaults.readonly, defaults.cache), (false, FsCache::Auto));
        assert_wire(
            &VfioDevice {
                path: "/sys/bus/pci/devices/0000:00:04.0".into(),
            },
            r#"{"path":"/sys/bus/pci/devices/0000:00:04.0"}"#,
        );
    }

    #[test]
    fn the_config_file_has_firecrackers_names() {
        assert_wire(&ConfigFile::default(), "{}");
        let file = ConfigFile {
            boot_source: Some(BootSourceConfig {
                kernel_image_path: "/k".into(),
                boot_args: None,
                initrd_path: None,
            }),
            machine_config: Some(MachineConfig::default()),
            drives: vec![drive()],
            vsock: Some(VsockConfig {
                guest_cid: 3,
                uds_path: "/v.sock".into(),
                vsock_id: None,
            }),
            network_interfaces: vec![NetworkInterfaceConfig {
                iface_id: "eth0".into(),
                host_dev_name: "tap0".into(),
                guest_mac: None,
                rx_rate_limiter: None,
                tx_rate_limiter: None,
            }],
            console: Some("/c.log".into()),
            console_max_bytes: Some(4096),
            fs: vec![FsConfig {
                tag: "t".into(),
                shared_dir: "/tmp".into(),
                readonly: true,
                cache: FsCache::Always,
                socket: None,
            }],
        };
        assert_wire(
            &file,
            concat!(
                r#"{"boot-source":{"kernel_image_path":"/k"},"#,
                r#""machine-config":{"vcpu_count":1,"mem_size_mib":128,"smt":false,"track_dirty_pages":false},"#,
                r#""drives":[{"drive_id":"rootfs","path_on_host":"/r.img","is_root_device":true,"is_read_only":false}],"#,
                r#""vsock":{"guest_cid":3,"uds_path":"/v.sock"},"#,
                r#""network-interfaces":[{"iface_id":"eth0","host_dev_name":"tap0"}],"#,
                r#""console":"/c.log","console-max-bytes":4096,"#,
                r#""fs":[{"tag":"t","shared_dir":"/tmp","readonly":true,"cache":"always"}]}"#
            ),
        );
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        for (json, field) in [
            (r#"{"kernel":"x"}"#, "kernel"),
            (
                r#"{"machine-config":{"vcpu_count":1,"mem_size_mib":64,"bogus":1}}"#,
                "bogus",
            ),
            (
                r#"{"machine-config":{"vcpu_count":1,"mem_size_mib":64,"rollbox":{"usb":true}}}"#,
                "usb",
            ),
            (r#"{"fs":[{"tag":"t","shared_dir":"/tmp","bar":1}]}"#, "bar"),
            (
                r#"{"vsock":{"guest_cid":3,"uds_path":"/v","cid":4}}"#,
                "cid",
            ),
        ] {
            let err = serde_json::from_str::<ConfigFile>(json).expect_err(json);
            assert!(err.to_string().contains(field), "{json}: {err}");
        }
        let err = serde_json::from_str::<VfioDevice>(r#"{"path":"/x","bar":1}"#)
            .expect_err("unknown field");
        assert!(err.to_string().contains("bar"), "{err}");
    }
}
