//! Machine resources: what a microVM is built from, set by flags, a JSON file or the API.
//! The JSON shapes are Firecracker's (`boot-source`, `machine-config`, `drives`, `vsock`),
//! so Firecracker config files and API bodies work unchanged; they are defined in
//! [`vmm_api::machine`] and re-exported here. This module owns what rollbox-vmm makes of
//! them: their checks ([`Validate`], [`ValidateMachine`]), the command-line flags, and
//! [`VmResources`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
pub use vmm_api::machine::{
    BootSourceConfig, ConfigFile, DriveConfig, FsCache, FsConfig, MachineConfig, MachineExtension,
    NetworkInterfaceConfig, VsockConfig,
};

/// Errors in a configuration value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Memory size out of range.
    #[error("mem_size_mib {0} is invalid: it must be at least 1")]
    MemoryZero(u64),
    /// More memory than the host has.
    #[error("mem_size_mib {requested} exceeds the host's memory ({host_mib} MiB)")]
    MemoryTooLarge {
        /// Requested MiB.
        requested: u64,
        /// Host MiB.
        host_mib: u64,
    },
    /// vCPU count out of range.
    #[error("vcpu_count {0} is invalid: it must be between 1 and {MAX_VCPUS}")]
    VcpuCount(u64),
    /// SMT is not offered.
    #[error("smt=true is not supported: rollbox-vmm exposes one thread per core")]
    Smt,
    /// A Firecracker option rollbox-vmm does not implement.
    #[error("{0} is not supported by rollbox-vmm")]
    Unsupported(&'static str),
    /// One host device passed through twice.
    #[error("VFIO device {0} is given twice")]
    VfioTwice(PathBuf),
    /// A VFIO path that names no PCI device in sysfs.
    #[error("VFIO device {0} is not a PCI device (expected /sys/bus/pci/devices/DDDD:BB:DD.F)")]
    VfioNotPci(PathBuf),
    /// A guest CID that is reserved.
    #[error("guest_cid {0} is invalid: CIDs 0-2 are reserved, use 3 or more")]
    GuestCid(u64),
    /// Two drives with one ID where that is not allowed, or a second root device.
    #[error("drive {0}: a root device is already configured")]
    SecondRoot(String),
    /// An empty or oversized drive ID.
    #[error("drive_id {0:?} is invalid: use 1-64 characters of [A-Za-z0-9_-]")]
    DriveId(String),
    /// A drive ID in the path does not match the body.
    #[error("drive_id {body:?} in the body does not match {path:?} in the path")]
    DriveIdMismatch {
        /// ID in the URL.
        path: String,
        /// ID in the body.
        body: String,
    },
    /// The configuration file could not be read.
    #[error("config file {path}: {detail}")]
    File {
        /// File path.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// A drive flag could not be parsed.
    #[error("--drive {0:?}: expected PATH[,readonly][,id=NAME]")]
    DriveFlag(String),
    /// An empty or oversized interface ID.
    #[error("iface_id {0:?} is invalid: use 1-64 characters of [A-Za-z0-9_-]")]
    IfaceId(String),
    /// A tap name Linux refuses.
    #[error("host_dev_name {0:?} is invalid: use 1-15 bytes without '/', ':' or whitespace")]
    HostDevName(String),
    /// A MAC that does not parse or is not a unicast address.
    #[error("guest_mac {0:?} is invalid: expected a unicast MAC like 06:00:ac:10:00:02")]
    GuestMac(String),
    /// Two interfaces share a tap or a MAC.
    #[error("network interface {iface_id}: {what} {value} is already used by interface {other}")]
    NetClash {
        /// The interface being added.
        iface_id: String,
        /// "host_dev_name" or "guest_mac".
        what: &'static str,
        /// The clashing value.
        value: String,
        /// The interface that has it.
        other: String,
    },
    /// A `--net` flag could not be parsed.
    #[error("--net {0:?}: expected TAP[,mac=MAC][,id=NAME]")]
    NetFlag(String),
    /// An empty or oversized volume tag.
    #[error("fs tag {0:?} is invalid: use 1-36 bytes, without ',', ':', '=' or whitespace")]
    FsTag(String),
    /// Two volumes with one tag.
    #[error("fs tag {0:?} is already configured")]
    FsTagClash(String),
    /// A volume's host directory is missing or not a directory.
    #[error("fs {tag}: shared directory {path}: {detail}")]
    FsDir {
        /// The tag.
        tag: String,
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// A volume's vhost-user socket (started by the caller) does not exist.
    #[error("fs {tag}: socket {path} does not exist; start virtiofsd on it first")]
    FsSocket {
        /// The tag.
        tag: String,
        /// The socket path.
        path: PathBuf,
    },
    /// Options that only apply to a virtiofsd rollbox-vmm starts, given with `socket`.
    #[error("fs {0}: readonly and cache are options of virtiofsd; with socket=PATH give them to the virtiofsd you started")]
    FsSocketOptions(String),
    /// An `--fs` flag could not be parsed.
    #[error(
        "--fs {0:?}: expected TAG=HOST_DIR[,readonly][,cache=auto|always|never][,socket=PATH]"
    )]
    FsFlag(String),
    /// virtiofsd is needed and was not found.
    #[error("fs {tag}: {detail}")]
    NoVirtiofsd {
        /// The tag of the volume that needs it.
        tag: String,
        /// Where it was looked for, and how to install it.
        detail: String,
    },
    /// No kernel was given.
    #[error("no kernel configured: give --kernel, a boot-source in --config, or PUT /boot-source")]
    NoKernel,
}

/// Most vCPUs per microVM (the MP table lives in the 1 KiB EBDA).
pub const MAX_VCPUS: u64 = 32;

/// rollbox-vmm's checks of a resource body before it takes it (the machine's are
/// [`ValidateMachine`]); the error names the failing field and value.
pub trait Validate {
    /// What a valid body yields: a network interface's parsed MAC, else nothing.
    type Valid;

    /// Checks the body.
    fn validate(&self) -> Result<Self::Valid, ConfigError>;
}

/// The checks of a machine configuration, which need the host's memory size.
pub trait ValidateMachine {
    /// Checks ranges and unsupported options against `host_mib` of host memory.
    fn validate(&self, host_mib: u64) -> Result<(), ConfigError>;
}

/// The command line used when none is given.
pub const DEFAULT_BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off";
/// The command line used when none is given and the machine has a PCI bus.
pub const DEFAULT_BOOT_ARGS_PCI: &str = "console=ttyS0 reboot=k panic=1";

impl ValidateMachine for MachineConfig {
    fn validate(&self, host_mib: u64) -> Result<(), ConfigError> {
        if self.vcpu_count == 0 || self.vcpu_count > MAX_VCPUS {
            return Err(ConfigError::VcpuCount(self.vcpu_count));
        }
        if self.mem_size_mib == 0 {
            return Err(ConfigError::MemoryZero(self.mem_size_mib));
        }
        if self.mem_size_mib > host_mib {
            return Err(ConfigError::MemoryTooLarge {
                requested: self.mem_size_mib,
                host_mib,
            });
        }
        if self.smt {
            return Err(ConfigError::Smt);
        }
        if self.cpu_template.as_deref().is_some_and(|t| t != "None") {
            return Err(ConfigError::Unsupported("cpu_template"));
        }
        if self.huge_pages.as_deref().is_some_and(|t| t != "None") {
            return Err(ConfigError::Unsupported("huge_pages"));
        }
        let vfio = &self.rollbox.vfio;
        if let Some(twice) = vfio
            .iter()
            .enumerate()
            .find_map(|(i, path)| vfio[..i].contains(path).then_some(path))
        {
            return Err(ConfigError::VfioTwice(twice.clone()));
        }
        Ok(())
    }
}

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

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Parses `aa:bb:cc:dd:ee:ff` into a unicast MAC.
pub fn parse_mac(text: &str) -> Result<[u8; 6], ConfigError> {
    let err = || ConfigError::GuestMac(text.into());
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().ok_or_else(err)?;
        if part.len() != 2 {
            return Err(err());
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| err())?;
    }
    if parts.next().is_some() || mac[0] & 1 != 0 || mac == [0; 6] {
        return Err(err());
    }
    Ok(mac)
}

/// The ID, tap name, MAC and unsupported options; a valid interface yields its parsed MAC.
impl Validate for NetworkInterfaceConfig {
    type Valid = Option<[u8; 6]>;

    fn validate(&self) -> Result<Option<[u8; 6]>, ConfigError> {
        if !valid_id(&self.iface_id) {
            return Err(ConfigError::IfaceId(self.iface_id.clone()));
        }
        if crate::devices::virtio::net::tap::check_name(&self.host_dev_name).is_err() {
            return Err(ConfigError::HostDevName(self.host_dev_name.clone()));
        }
        if self.rx_rate_limiter.is_some() {
            return Err(ConfigError::Unsupported("rx_rate_limiter"));
        }
        if self.tx_rate_limiter.is_some() {
            return Err(ConfigError::Unsupported("tx_rate_limiter"));
        }
        self.guest_mac.as_deref().map(parse_mac).transpose()
    }
}

/// Parses `--net TAP[,mac=MAC][,id=NAME]`; `index` names interfaces without an ID.
pub fn parse_net_flag(value: &str, index: usize) -> Result<NetworkInterfaceConfig, ConfigError> {
    let mut parts = value.split(',');
    let tap = parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ConfigError::NetFlag(value.into()))?;
    let mut iface = NetworkInterfaceConfig {
        iface_id: format!("eth{index}"),
        host_dev_name: tap.into(),
        guest_mac: None,
        rx_rate_limiter: None,
        tx_rate_limiter: None,
    };
    for part in parts {
        match part.split_once('=') {
            Some(("mac", mac)) => iface.guest_mac = Some(mac.into()),
            Some(("id", id)) => iface.iface_id = id.into(),
            _ => return Err(ConfigError::NetFlag(value.into())),
        }
    }
    iface.validate()?;
    Ok(iface)
}

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

/// The tag, the directory and the socket.
impl Validate for FsConfig {
    type Valid = ();

    fn validate(&self) -> Result<(), ConfigError> {
        let tag_ok = !self.tag.is_empty()
            && self.tag.len() <= 36
            && !self
                .tag
                .chars()
                .any(|c| c == ',' || c == ':' || c == '=' || c.is_whitespace() || c.is_control());
        if !tag_ok {
            return Err(ConfigError::FsTag(self.tag.clone()));
        }
        let dir_err = |detail: String| ConfigError::FsDir {
            tag: self.tag.clone(),
            path: self.shared_dir.clone(),
            detail,
        };
        let meta = std::fs::metadata(&self.shared_dir).map_err(|e| dir_err(e.to_string()))?;
        if !meta.is_dir() {
            return Err(dir_err("not a directory".into()));
        }
        if let Some(socket) = &self.socket {
            if self.readonly || self.cache != FsCache::Auto {
                return Err(ConfigError::FsSocketOptions(self.tag.clone()));
            }
            if !socket.exists() {
                return Err(ConfigError::FsSocket {
                    tag: self.tag.clone(),
                    path: socket.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Where the guest console goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ConsoleConfig {
    /// The VMM's stdout (input from its stdin).
    #[default]
    Stdout,
    /// Appended to a file.
    File(PathBuf),
}

impl ConsoleConfig {
    /// Parses the `--console` value.
    pub fn parse(value: &str) -> Self {
        if value == "stdout" {
            ConsoleConfig::Stdout
        } else {
            ConsoleConfig::File(PathBuf::from(value))
        }
    }
}

/// Reads and parses the `--config` file at `path`; unknown fields are errors.
pub fn load_config_file(path: &Path) -> Result<ConfigFile, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// Everything needed to build a microVM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmResources {
    /// Kernel and command line.
    pub boot_source: Option<BootSourceConfig>,
    /// vCPUs and memory.
    pub machine: MachineConfig,
    /// Drives, in insertion order (the root device first).
    pub drives: Vec<DriveConfig>,
    /// The vsock device.
    pub vsock: Option<VsockConfig>,
    /// Network interfaces, in insertion order.
    pub net: Vec<NetworkInterfaceConfig>,
    /// Console output.
    pub console: ConsoleConfig,
    /// rollbox extension: shared volumes, in insertion order.
    pub fs: Vec<FsConfig>,
    /// The virtiofsd binary (`--virtiofsd`); else it is looked up (see
    /// [`crate::devices::virtio::fs::locate_virtiofsd`]).
    pub virtiofsd: Option<PathBuf>,
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

    /// Adds or replaces a network interface; no two share a tap or a MAC.
    pub fn upsert_net(&mut self, iface: NetworkInterfaceConfig) -> Result<(), ConfigError> {
        let mac = iface.validate()?;
        for other in self.net.iter().filter(|o| o.iface_id != iface.iface_id) {
            let clash = |what, value: String| ConfigError::NetClash {
                iface_id: iface.iface_id.clone(),
                what,
                value,
                other: other.iface_id.clone(),
            };
            if other.host_dev_name == iface.host_dev_name {
                return Err(clash("host_dev_name", iface.host_dev_name.clone()));
            }
            let other_mac = other.guest_mac.as_deref().map(parse_mac).transpose()?;
            if let (Some(a), Some(b)) = (mac, other_mac) {
                if a == b {
                    return Err(clash(
                        "guest_mac",
                        iface.guest_mac.clone().unwrap_or_default(),
                    ));
                }
            }
        }
        match self.net.iter_mut().find(|o| o.iface_id == iface.iface_id) {
            Some(existing) => *existing = iface,
            None => self.net.push(iface),
        }
        Ok(())
    }

    /// Adds a shared volume after checking it: its tag is new, its directory exists, and the
    /// virtiofsd that will serve it exists (or the caller's socket does).
    pub fn add_fs(&mut self, fs: FsConfig) -> Result<(), ConfigError> {
        fs.validate()?;
        if self.fs.iter().any(|f| f.tag == fs.tag) {
            return Err(ConfigError::FsTagClash(fs.tag));
        }
        if fs.socket.is_none() {
            crate::devices::virtio::fs::locate_virtiofsd(self.virtiofsd.as_deref()).map_err(
                |e| ConfigError::NoVirtiofsd {
                    tag: fs.tag.clone(),
                    detail: e.to_string(),
                },
            )?;
        }
        self.fs.push(fs);
        Ok(())
    }

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

    /// Applies a configuration file.
    pub fn apply_file(&mut self, file: ConfigFile, host_mib: u64) -> Result<(), ConfigError> {
        if let Some(machine) = file.machine_config {
            machine.validate(host_mib)?;
            self.machine = machine;
        }
        self.boot_source = file.boot_source.or(self.boot_source.take());
        for drive in file.drives {
            self.upsert_drive(drive)?;
        }
        if let Some(vsock) = file.vsock {
            vsock.validate()?;
            self.vsock = Some(vsock);
        }
        for iface in file.network_interfaces {
            self.upsert_net(iface)?;
        }
        if let Some(console) = file.console {
            self.console = ConsoleConfig::parse(&console);
        }
        for fs in file.fs {
            self.add_fs(fs)?;
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

/// Parses `--drive PATH[,readonly][,id=NAME]`; `index` names drives without an ID.
pub fn parse_drive_flag(value: &str, index: usize) -> Result<DriveConfig, ConfigError> {
    let mut parts = value.split(',');
    let path = parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ConfigError::DriveFlag(value.into()))?;
    let mut drive = DriveConfig::new(format!("drive{index}"), path);
    for part in parts {
        match part.split_once('=') {
            None if part == "readonly" || part == "ro" => drive.is_read_only = true,
            None if part == "root" => drive.is_root_device = true,
            Some(("id", id)) => drive.drive_id = id.to_string(),
            _ => return Err(ConfigError::DriveFlag(value.into())),
        }
    }
    drive.validate()?;
    Ok(drive)
}

/// Parses `--fs TAG=HOST_DIR[,readonly][,cache=auto|always|never][,socket=PATH]`.
pub fn parse_fs_flag(value: &str) -> Result<FsConfig, ConfigError> {
    let bad = || ConfigError::FsFlag(value.into());
    let mut parts = value.split(',');
    let (tag, dir) = parts
        .next()
        .and_then(|first| first.split_once('='))
        .filter(|(_, dir)| !dir.is_empty())
        .ok_or_else(bad)?;
    let mut fs = FsConfig {
        tag: tag.to_string(),
        shared_dir: PathBuf::from(dir),
        readonly: false,
        cache: FsCache::Auto,
        socket: None,
    };
    for part in parts {
        match part.split_once('=') {
            None if part == "readonly" || part == "ro" => fs.readonly = true,
            Some(("cache", "auto")) => fs.cache = FsCache::Auto,
            Some(("cache", "always")) => fs.cache = FsCache::Always,
            Some(("cache", "never")) => fs.cache = FsCache::Never,
            Some(("socket", path)) if !path.is_empty() => fs.socket = Some(PathBuf::from(path)),
            _ => return Err(bad()),
        }
    }
    Ok(fs)
}

/// The host's memory in MiB, from /proc/meminfo.
pub fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map(|kib| kib / 1024)
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_and_vfio_are_a_rollbox_extension_of_the_machine_config() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"machine-config":{"vcpu_count":1,"mem_size_mib":64,
                "rollbox":{"pci":true,"vfio":["/sys/bus/pci/devices/0000:00:04.0"]}}}"#,
        )
        .expect("parse");
        let machine = file.machine_config.expect("machine");
        assert!(machine.rollbox.pci && machine.rollbox.has_pci());
        assert_eq!(machine.rollbox.vfio.len(), 1);
        // Without it, nothing of the extension is written back.
        let plain = serde_json::to_string(&MachineConfig::default()).expect("json");
        assert!(!plain.contains("rollbox"), "{plain}");
        // One device twice is refused, naming it.
        let mut twice = machine.clone();
        twice.rollbox.vfio.push(machine.rollbox.vfio[0].clone());
        let err = twice.validate(1 << 20).expect_err("twice");
        assert!(err.to_string().contains("0000:00:04.0"), "{err}");
        let vfio_only = MachineExtension {
            pci: false,
            vfio: vec!["/x".into()],
        };
        assert!(vfio_only.has_pci(), "--vfio implies --pci");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_str::<ConfigFile>(
            r#"{"machine-config":{"vcpu_count":1,"mem_size_mib":64,"bogus":1}}"#,
        )
        .expect_err("must fail");
        assert!(err.to_string().contains("bogus"), "{err}");
        let err = serde_json::from_str::<ConfigFile>(r#"{"kernel":"x"}"#).expect_err("must fail");
        assert!(err.to_string().contains("kernel"), "{err}");
    }

    #[test]
    fn firecracker_config_parses() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"boot-source":{"kernel_image_path":"/k","boot_args":"console=ttyS0"},
                "machine-config":{"vcpu_count":2,"mem_size_mib":256,"smt":false},
                "drives":[{"drive_id":"rootfs","path_on_host":"/r","is_root_device":true,"is_read_only":false}],
                "vsock":{"guest_cid":3,"uds_path":"/tmp/v.sock"}}"#,
        )
        .expect("parse");
        let mut res = VmResources::default();
        res.apply_file(file, 1024).expect("apply");
        assert_eq!(res.machine.vcpu_count, 2);
        assert_eq!(res.root_args().as_deref(), Some("root=/dev/vda rw"));
    }

    #[test]
    fn memory_limits() {
        let mut m = MachineConfig {
            mem_size_mib: 0,
            ..Default::default()
        };
        assert_eq!(m.validate(100), Err(ConfigError::MemoryZero(0)));
        m.mem_size_mib = 200;
        assert!(matches!(
            m.validate(100),
            Err(ConfigError::MemoryTooLarge { .. })
        ));
        m.mem_size_mib = 64;
        m.vcpu_count = 33;
        assert_eq!(m.validate(100), Err(ConfigError::VcpuCount(33)));
    }

    #[test]
    fn drive_flags() {
        let d = parse_drive_flag("/x.img,readonly,id=data", 0).expect("parse");
        assert!(d.is_read_only);
        assert_eq!(d.drive_id, "data");
        assert_eq!(
            parse_drive_flag("/y.img", 3).expect("parse").drive_id,
            "drive3"
        );
        assert!(parse_drive_flag("/y.img,bogus", 0).is_err());
        assert!(parse_drive_flag("", 0).is_err());
    }

    #[test]
    fn network_interfaces() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"network-interfaces":[{"iface_id":"eth0","host_dev_name":"tap0","guest_mac":"06:00:AC:10:00:02"}]}"#,
        )
        .expect("parse");
        let mut res = VmResources::default();
        res.apply_file(file, 1024).expect("apply");
        assert_eq!(res.net.len(), 1);
        assert_eq!(parse_mac("06:00:AC:10:00:02"), Ok([6, 0, 0xac, 0x10, 0, 2]));
        for bad in [
            "01:00:00:00:00:01",
            "06:00:ac:10:00",
            "06:00:ac:10:00:02:03",
            "zz:00:00:00:00:01",
            "00:00:00:00:00:00",
        ] {
            assert_eq!(parse_mac(bad), Err(ConfigError::GuestMac(bad.into())));
        }
        let clash = res.upsert_net(parse_net_flag("tap0,id=eth1", 1).expect("flag"));
        assert!(
            matches!(
                clash,
                Err(ConfigError::NetClash {
                    what: "host_dev_name",
                    ..
                })
            ),
            "{clash:?}"
        );
        let clash = res.upsert_net(parse_net_flag("tap1,mac=06:00:ac:10:00:02", 1).expect("flag"));
        assert!(
            matches!(
                clash,
                Err(ConfigError::NetClash {
                    what: "guest_mac",
                    ..
                })
            ),
            "{clash:?}"
        );
        res.upsert_net(parse_net_flag("tap1,mac=06:00:ac:10:00:03", 1).expect("flag"))
            .expect("second interface");
        // Replacing an interface by ID is not a clash with itself.
        res.upsert_net(parse_net_flag("tap0,id=eth0", 0).expect("flag"))
            .expect("replace");
        assert_eq!(res.net.len(), 2);
        assert!(matches!(
            parse_net_flag("tap-name-too-long-x", 0),
            Err(ConfigError::HostDevName(_))
        ));
        assert!(matches!(
            parse_net_flag("tap0,bogus", 0),
            Err(ConfigError::NetFlag(_))
        ));
        let limited: NetworkInterfaceConfig = serde_json::from_str(
            r#"{"iface_id":"eth0","host_dev_name":"tap0","rx_rate_limiter":{}}"#,
        )
        .expect("parse");
        assert_eq!(
            limited.validate(),
            Err(ConfigError::Unsupported("rx_rate_limiter"))
        );
    }

    #[test]
    fn fs_flags_and_checks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().display();
        let fs = parse_fs_flag(&format!("data={d},readonly,cache=never")).expect("parse");
        assert_eq!(fs.tag, "data");
        assert!(fs.readonly);
        assert_eq!(fs.cache, FsCache::Never);
        assert!(parse_fs_flag("data").is_err());
        assert!(parse_fs_flag("data=").is_err());
        assert!(parse_fs_flag(&format!("data={d},cache=sometimes")).is_err());

        let mut res = VmResources {
            virtiofsd: Some(PathBuf::from("/bin/true")),
            ..Default::default()
        };
        res.add_fs(fs.clone()).expect("add");
        assert_eq!(
            res.add_fs(fs.clone()),
            Err(ConfigError::FsTagClash("data".into()))
        );
        let long = FsConfig {
            tag: "x".repeat(37),
            ..fs.clone()
        };
        assert!(matches!(res.add_fs(long), Err(ConfigError::FsTag(_))));
        let empty = FsConfig {
            tag: String::new(),
            ..fs.clone()
        };
        assert!(matches!(res.add_fs(empty), Err(ConfigError::FsTag(_))));
        let missing = FsConfig {
            tag: "m".into(),
            shared_dir: dir.path().join("absent"),
            ..fs.clone()
        };
        let err = res.add_fs(missing).expect_err("missing dir");
        assert!(err.to_string().contains("absent"), "{err}");
        let no_daemon = FsConfig {
            tag: "n".into(),
            ..fs.clone()
        };
        res.virtiofsd = Some(dir.path().join("no-virtiofsd"));
        let err = res.add_fs(no_daemon).expect_err("no virtiofsd");
        assert!(err.to_string().contains("scripts/virtiofsd.sh"), "{err}");
        assert_eq!(res.fs.len(), 1);
    }

    #[test]
    fn fs_is_a_separate_config_file_field() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"fs":[{"tag":"t","shared_dir":"/tmp","readonly":true,"cache":"always"}]}"#,
        )
        .expect("parse");
        assert_eq!(file.fs[0].cache, FsCache::Always);
        assert!(serde_json::from_str::<ConfigFile>(
            r#"{"fs":[{"tag":"t","shared_dir":"/tmp","bogus":1}]}"#
        )
        .is_err());
    }

    #[test]
    fn root_device_goes_first() {
        let mut res = VmResources::default();
        res.upsert_drive(parse_drive_flag("/a", 0).expect("a"))
            .expect("a");
        res.upsert_drive(parse_drive_flag("/b,root", 1).expect("b"))
            .expect("b");
        assert_eq!(res.drives[0].drive_id, "drive1");
        assert!(res
            .upsert_drive(parse_drive_flag("/c,root", 2).expect("c"))
            .is_err());
    }
}
