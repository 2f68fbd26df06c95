//! The checks a resource body passes before rollbox-vmm takes it ([`Validate`],
//! [`ValidateMachine`]), and their one error, [`ConfigError`], which names the failing field
//! and value.

use std::path::PathBuf;

use crate::arch::mptable::MAX_VCPUS;

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
    /// A console cap too small to hold anything.
    #[error("console-max-bytes {0} is invalid: it must be at least {min}", min = super::console::MIN_CONSOLE_MAX_BYTES)]
    ConsoleMaxBytes(u64),
    /// vCPU count out of range.
    #[error("vcpu_count {0} is invalid: it must be between 1 and {MAX_VCPUS}")]
    VcpuCount(u64),
    /// SMT is not offered.
    #[error("smt=true is not supported: rollbox-vmm exposes one thread per core")]
    Smt,
    /// A Firecracker option rollbox-vmm does not implement (huge_pages: only "None" and "2M").
    #[error("{0} is not supported by rollbox-vmm")]
    Unsupported(&'static str),
    /// Huge pages for a guest that is not a whole number of them.
    #[error("huge_pages \"2M\" needs an even mem_size_mib (whole 2 MiB pages), not {0}")]
    HugePagesOdd(u64),
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

/// Whether `id` is a valid drive or interface ID: 1-64 characters of `[A-Za-z0-9_-]`.
pub(super) fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}
