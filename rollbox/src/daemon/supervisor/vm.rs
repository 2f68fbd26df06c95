//! `rollbox-vmm` processes: spawn one per sandbox (a boot from a `vmm_api::ConfigFile` in
//! the sandbox's directory, a restore from `--restore` flags), speak to its API through
//! `vmm_api::Client`, recognise it again by (pid, start time), end its process group, and find
//! VMMs that belong to no sandbox.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox_jailer::cgroup;
use vmm_api::{
    BootSourceConfig, Client, ClientError, ConfigFile, DriveConfig, FsCache, FsConfig,
    MachineConfig, NetworkInterfaceConfig, VmState, VsockConfig,
};

use super::disk::{copy_disk, copy_file};
use super::jaildir::{JailDir, JailDirError, SocketPath};
pub use super::process::{find_vmms, is_ours, kill, start_time, Found};
use super::virtiofsd::{self, Virtiofsd, VolumeSource};
use crate::daemon::api::Template;

/// A failed VMM operation.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot create sandbox directory {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot copy rootfs {from} to {to}: {source}")]
    Rootfs {
        from: PathBuf,
        to: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot link snapshot file {from} into the warm shell as {to}: {source}")]
    ShellLink {
        from: PathBuf,
        to: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot give {path} to the warm shell's jail: {source}")]
    ShellOwner {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A name in the sandbox's directory refused or failed ([`super::jaildir`]).
    #[error(transparent)]
    Jail(#[from] JailDirError),
    #[error("cannot write the VMM's configuration {path}: {source}")]
    Config {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}: the VMM's configuration file takes only UTF-8 paths")]
    NotUtf8(PathBuf),
    #[error("cannot start {vmm}: {source}")]
    Spawn {
        vmm: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "rollbox-vmm (pid {pid}) ended before its API socket {sock} listened: {status}; its output: {output}"
    )]
    EarlyExit {
        pid: u32,
        sock: PathBuf,
        status: std::process::ExitStatus,
        /// The end of vmm.log (the directory goes with the failed sandbox).
        output: String,
    },
    #[error("rollbox-vmm (pid {pid}): its API socket {sock} did not listen within {secs} s")]
    NotReady { pid: u32, sock: PathBuf, secs: u64 },
    #[error("rollbox-vmm (pid {0}) vanished before its start time could be read")]
    Vanished(u32),
    /// A call on the VMM's API socket (reached through its descriptor, hence the name).
    #[error("{sock}: {source}")]
    Api { sock: PathBuf, source: ClientError },
    /// A volume's virtiofsd could not be found or started.
    #[error("{0}")]
    Volume(String),
}

/// The shared volumes of a launch, and the virtiofsd that serves them.
pub struct Volumes<'a> {
    pub list: &'a [VolumeSource],
    /// None when the daemon found no virtiofsd (why, then).
    pub virtiofsd: Result<&'a Path, &'a str>,
}

impl Volumes<'_> {
    /// Starts their virtiofsd processes in the sandbox's (just made) directory.
    fn start(&self, paths: &Paths, jail: Option<&JailSpec>) -> Result<Vec<Virtiofsd>, VmError> {
        if self.list.is_empty() {
            return Ok(Vec::new());
        }
        let binary = self
            .virtiofsd
            .map_err(|why| VmError::Volume(format!("volumes need virtiofsd: {why}")))?;
        let owner = jail.map(|spec| (spec.jail.uid, spec.jail.gid));
        virtiofsd::start_all(binary, &paths.dir, self.list, owner).map_err(VmError::Volume)
    }
}

/// The files in a sandbox's directory.
pub struct Paths {
    pub dir: PathBuf,
    pub api_sock: PathBuf,
    pub vsock: PathBuf,
    pub console: PathBuf,
    pub log: PathBuf,
    pub rootfs: PathBuf,
    /// A boot's `--config` file.
    pub config: PathBuf,
}

impl Paths {
    pub fn new(dir: &Path) -> Paths {
        Paths {
            dir: dir.to_path_buf(),
            api_sock: dir.join("api.sock"),
            vsock: dir.join("vsock.sock"),
            console: dir.join("console.log"),
            log: dir.join("vmm.log"),
            rootfs: dir.join("rootfs.img"),
            config: dir.join("vmm-config.json"),
        }
    }
}

/// What one VMM runs.
pub struct Shape<'a> {
    pub template: &'a Template,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// A deterministic machine (`--deterministic`: no RDRAND/RDSEED in CPUID).
    pub deterministic: bool,
    /// The console file's cap (`rollbox serve --console-max-bytes`).
    pub console_max_bytes: u64,
    /// PCI devices passed through (sysfs paths; the jail sees them at the same paths).
    pub vfio: &'a [PathBuf],
    /// A network interface on a host tap the daemon attached.
    pub nic: Option<&'a Nic>,
}

/// A sandbox's network interface: `eth0` on a host tap, whose attached descriptor the VMM
/// inherits (`--tap-fd`; it cannot open the tap from its empty network namespace).
pub struct Nic {
    pub tap: String,
    pub mac: String,
    /// /dev/net/tun attached to `tap`.
    pub file: File,
    /// The kernel's `ip=` argument (the guest agent reads it too).
    pub kernel_ip_arg: String,
}

/// How `rollbox serve` jails its VMMs with `rollbox-jailer` (the default; `--no-jailer`
/// turns it off): the sandbox's directory is the jail's root, so its sockets, console and
/// rootfs copy are where the daemon expects them, and the VMM sees them as `/api.sock` etc.
#[derive(Debug, Clone)]
pub struct Jail {
    pub jailer: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub cgroup_fs: PathBuf,
    /// Parent of each jail's cgroups: the daemon's own root name (see `cgroup::root_name`).
    pub cgroup_parent: String,
    /// Whether the host has memory and pids controllers for each jail's limits.
    pub memory_limits: bool,
    pub pids_limits: bool,
}

/// Memory a jail may use beyond its guest's (the VMM, its page cache, /dev/shm of a fork).
const JAIL_MEMORY_OVERHEAD_MIB: u64 = 512;
/// Processes and threads a jail may hold (vCPUs, I/O workers, clones and their threads).
const JAIL_PIDS_MAX: u32 = 512;
/// Descriptors a jailed VMM may hold.
const JAIL_NOFILE: u32 = 4096;
/// The largest file a jailed VMM may write beyond its disk or memory, whichever is larger
/// (a snapshot's memory file, its state, the console and logs).
const JAIL_FSIZE_SLACK: u64 = 512 << 20;
/// How long a Full snapshot may take to write.
pub(super) const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a pause or resume may take.
const STATE_TIMEOUT: Duration = Duration::from_secs(10);
/// A template's shared base: the VMM's second drive (after `rootfs`), so the guest's
/// `/dev/vdb`, bind-mounted read-only at `/base.ext4` in a jail.
const BASE_DRIVE: &str = "base";
const BASE_DEVICE: &str = "/dev/vdb";
const BASE_FILE: &str = "base.ext4";

/// One sandbox's jail: the jail settings plus its own cgroup limits.
pub struct JailSpec<'a> {
    pub jail: &'a Jail,
    /// `--cgroup` values beyond memory and pids (the cpu quota of a `cpu_limit`).
    pub cgroups: Vec<String>,
    pub memory_mib: u32,
    /// PCI devices the VMM passes through (`--vfio` of the jailer: their sysfs directories,
    /// IOMMU groups and /dev/vfio nodes).
    pub vfio: Vec<PathBuf>,
}

/// A VMM command line being built: paths are the host's, or the jail's when jailed.
struct Launch<'a> {
    args: Vec<std::ffi::OsString>,
    binds: Vec<std::ffi::OsString>,
    jail: Option<&'a JailSpec<'a>>,
    /// The size of the sandbox's disk copy (0 without one), for the jail's fsize limit.
    disk_bytes: u64,
    /// Descriptors the VMM inherits (a tap's).
    keep_fds: Vec<std::os::fd::RawFd>,
}

/// RLIMIT_FSIZE of a jailed VMM: its largest file is its disk or its memory snapshot. (A
/// guest that fills its console past this ends its VMM with SIGXFSZ, not the host's disk.)
fn fsize_limit(disk_bytes: u64, memory_mib: u32) -> u64 {
    disk_bytes.max(u64::from(memory_mib) << 20) + JAIL_FSIZE_SLACK
}

impl<'a> Launch<'a> {
    fn new(jail: Option<&'a JailSpec<'a>>) -> Launch<'a> {
        Launch {
            args: Vec::new(),
            binds: Vec::new(),
            jail,
            disk_bytes: 0,
            keep_fds: Vec::new(),
        }
    }

    /// `--tap-fd` for a tap the VMM inherits attached.
    fn tap(&mut self, nic: &Nic) -> &mut Self {
        use std::os::fd::AsRawFd;
        let fd = nic.file.as_raw_fd();
        self.keep_fds.push(fd);
        self.arg("--tap-fd").arg(format!("{}={fd}", nic.tap))
    }

    fn arg(&mut self, arg: impl AsRef<std::ffi::OsStr>) -> &mut Self {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    /// A file in the sandbox's directory as the VMM sees it: `/NAME` in the jail.
    fn own_path(&self, path: &Path) -> PathBuf {
        match (self.jail, path.file_name()) {
            (Some(_), Some(name)) => Path::new("/").join(name),
            _ => path.to_path_buf(),
        }
    }

    /// `flag` and a file in the sandbox's directory ([`Launch::own_path`]).
    fn own(&mut self, flag: &str, path: &Path) -> &mut Self {
        let seen = self.own_path(path);
        self.arg(flag).arg(seen)
    }

    /// A host file the VMM reads, as it sees it: bind-mounted read-only at `/NAME` in the
    /// jail.
    fn host_path(&mut self, path: &Path, name: &str) -> PathBuf {
        if self.jail.is_none() {
            return path.to_path_buf();
        }
        let mut bind = path.as_os_str().to_os_string();
        bind.push(format!(":/{name}"));
        self.binds.push(bind);
        PathBuf::from(format!("/{name}"))
    }

    /// `flag` and a host file the VMM reads ([`Launch::host_path`]).
    fn host(&mut self, flag: &str, path: &Path, name: &str) -> &mut Self {
        let seen = self.host_path(path, name);
        self.arg(flag).arg(seen)
    }

    /// The command: the VMM itself, or `rollbox-jailer` around it.
    fn command(&self, vmm: &Path, paths: &Paths) -> Result<(Command, PathBuf), VmError> {
        let Some(spec) = self.jail else {
            let mut command = Command::new(vmm);
            command.args(&self.args);
            return Ok((command, vmm.to_path_buf()));
        };
        let jail = spec.jail;
        let (Some(base), Some(id)) = (paths.dir.parent(), paths.dir.file_name()) else {
            return Err(VmError::Dir {
                path: paths.dir.clone(),
                source: std::io::ErrorKind::InvalidInput.into(),
            });
        };
        let mut command = Command::new(&jail.jailer);
        command
            .arg("--id")
            .arg(id)
            .arg("--exec")
            .arg(vmm)
            .args([
                "--uid",
                &jail.uid.to_string(),
                "--gid",
                &jail.gid.to_string(),
            ])
            .arg("--chroot-base")
            .arg(base)
            .arg("--cgroup-fs")
            .arg(&jail.cgroup_fs)
            .args(["--cgroup-parent", &jail.cgroup_parent])
            .args(["--rlimit", &format!("nofile={JAIL_NOFILE}")])
            .args([
                "--rlimit",
                &format!("fsize={}", fsize_limit(self.disk_bytes, spec.memory_mib)),
            ])
            // An empty network namespace: a sandbox's tap, if it has one, is handed down.
            .arg("--new-netns");
        for fd in &self.keep_fds {
            command.arg("--keep-fd").arg(fd.to_string());
        }
        for setting in &spec.cgroups {
            command.arg("--cgroup").arg(setting);
        }
        if jail.memory_limits {
            let bytes = (u64::from(spec.memory_mib) + JAIL_MEMORY_OVERHEAD_MIB) << 20;
            command
                .arg("--cgroup")
                .arg(cgroup::memory_limit_setting(&jail.cgroup_fs, bytes));
        }
        if jail.pids_limits {
            command.args(["--cgroup", &format!("pids.max={JAIL_PIDS_MAX}")]);
        }
        if !spec.vfio.is_empty() {
            // VFIO pins all of guest memory for the device's DMA.
            let bytes = (u64::from(spec.memory_mib) + JAIL_MEMORY_OVERHEAD_MIB) << 20;
            command.args(["--rlimit", &format!("memlock={bytes}")]);
            for device in &spec.vfio {
                command.arg("--vfio").arg(device);
            }
        }
        for bind in &self.binds {
            command.arg("--bind-ro").arg(bind);
        }
        command.arg("--").args(&self.args);
        Ok((command, jail.jailer.clone()))
    }
}

/// Makes the sandbox directory (its rootfs copy and the VMM's `--config` file,
/// `vmm-config.json`) and starts `vmm` (jailed when `jail` says so) in its own process group,
/// stdin from /dev/null, stdout and stderr into `vmm.log`.
pub fn spawn(
    vmm: &Path,
    paths: &Paths,
    shape: &Shape,
    jail: Option<&JailSpec>,
    volumes: &Volumes,
) -> Result<(Child, Vec<Virtiofsd>), VmError> {
    let dir_error = |source| VmError::Dir {
        path: paths.dir.clone(),
        source,
    };
    std::fs::create_dir(&paths.dir).map_err(dir_error)?;
    let daemons = volumes.start(paths, jail)?;
    let spawned = spawn_boot(vmm, paths, shape, jail, volumes.list);
    with_daemons(spawned, daemons)
}

/// The VMM and the volumes' virtiofsd processes; those end when the VMM did not start.
fn with_daemons(
    spawned: Result<Child, VmError>,
    daemons: Vec<Virtiofsd>,
) -> Result<(Child, Vec<Virtiofsd>), VmError> {
    match spawned {
        Ok(child) => Ok((child, daemons)),
        Err(e) => {
            virtiofsd::end_children(daemons);
            Err(e)
        }
    }
}

/// [`spawn`] once the directory and the volumes' virtiofsd processes are there.
fn spawn_boot(
    vmm: &Path,
    paths: &Paths,
    shape: &Shape,
    jail: Option<&JailSpec>,
    volumes: &[VolumeSource],
) -> Result<Child, VmError> {
    let mut launch = Launch::new(jail);
    if let Some(nic) = shape.nic {
        launch.tap(nic);
    }
    let config = boot_config(&mut launch, paths, shape, volumes)?;
    if let Some(rootfs) = &shape.template.rootfs {
        // A private copy: the guest writes to it.
        let failed = |source| VmError::Rootfs {
            from: rootfs.clone(),
            to: paths.rootfs.clone(),
            source,
        };
        copy_disk(rootfs, &paths.rootfs).map_err(failed)?;
        launch.disk_bytes = disk_len(&paths.rootfs).map_err(failed)?;
    }
    write_config(&paths.config, &config)?;
    launch
        .own("--api-sock", &paths.api_sock)
        .own("--config", &paths.config);
    let (command, program) = launch.command(vmm, paths)?;
    start(command, &program, paths, &launch.keep_fds)
}

/// What a boot runs, as the VMM sees its files (a jail's paths when jailed): the kernel and
/// its command line, vCPUs and memory, the rootfs copy, the vsock (CID 3) and the console.
fn boot_config(
    launch: &mut Launch,
    paths: &Paths,
    shape: &Shape,
    volumes: &[VolumeSource],
) -> Result<ConfigFile, VmError> {
    let template = shape.template;
    // The guest agent mounts each `rollbox.volume=TAG:PATH[:ro]` at boot.
    let mut cmdline = template.cmdline.clone();
    let mut network_interfaces = Vec::new();
    if let Some(nic) = shape.nic {
        // The kernel (with IP_PNP) or the agent reads `ip=`.
        cmdline.push(' ');
        cmdline.push_str(&nic.kernel_ip_arg);
        network_interfaces.push(NetworkInterfaceConfig {
            iface_id: "eth0".into(),
            host_dev_name: nic.tap.clone(),
            guest_mac: Some(nic.mac.clone()),
            rx_rate_limiter: None,
            tx_rate_limiter: None,
        });
    }
    if template.rootfs.is_some() && template.base_rootfs.is_some() {
        // The agent mounts the overlay of the top disk's upper layer over this base, and makes
        // it the root, before anything else runs.
        cmdline.push_str(&format!(" rollbox.lower={BASE_DEVICE}"));
    }
    for volume in volumes {
        let mount = &volume.mount;
        cmdline.push_str(&format!(
            " rollbox.volume={}:{}{}",
            mount.name,
            mount.mount_path,
            if mount.readonly { ":ro" } else { "" }
        ));
    }
    let fs = volumes
        .iter()
        .map(|volume| FsConfig {
            tag: volume.mount.name.clone(),
            // The virtiofsd's; the VMM only records it.
            shared_dir: volume.host_path.clone(),
            readonly: false,
            cache: FsCache::Auto,
            socket: Some(launch.own_path(&paths.dir.join(volume.socket_name()))),
        })
        .collect();
    let boot_source = BootSourceConfig {
        kernel_image_path: launch.host_path(&template.kernel, "kernel"),
        boot_args: Some(cmdline.trim_start().to_string()).filter(|c| !c.is_empty()),
        initrd_path: template
            .initrd
            .as_ref()
            .map(|initrd| launch.host_path(initrd, "initrd")),
    };
    let mut machine = MachineConfig {
        vcpu_count: shape.vcpus.into(),
        mem_size_mib: shape.memory_mib.into(),
        // No RDRAND/RDSEED in CPUID.
        deterministic: shape.deterministic,
        ..MachineConfig::default()
    };
    machine.rollbox.vfio = shape.vfio.to_vec();
    // A VM with a device passed through pins all its memory for DMA: in 2 MiB huge pages when
    // the host has that many free, so there are 512 times fewer pages to pin and map.
    if !shape.vfio.is_empty()
        && shape.memory_mib.is_multiple_of(2)
        && free_huge_pages_mib() >= u64::from(shape.memory_mib)
    {
        machine.huge_pages = Some("2M".into());
    }
    let mut drives = Vec::new();
    if template.rootfs.is_some() {
        drives.push(DriveConfig {
            is_root_device: true,
            ..DriveConfig::new("rootfs", launch.own_path(&paths.rootfs))
        });
        // Shared by every sandbox of every template on it: never copied, never written.
        if let Some(base) = &template.base_rootfs {
            drives.push(DriveConfig {
                is_read_only: true,
                ..DriveConfig::new(BASE_DRIVE, launch.host_path(base, BASE_FILE))
            });
        }
    }
    let console = launch.own_path(&paths.console);
    let console = console.to_str().ok_or(VmError::NotUtf8(console.clone()))?;
    Ok(ConfigFile {
        boot_source: Some(boot_source),
        machine_config: Some(machine),
        drives,
        vsock: Some(VsockConfig {
            guest_cid: 3,
            uds_path: launch.own_path(&paths.vsock),
            vsock_id: None,
        }),
        console: Some(console.to_string()),
        console_max_bytes: Some(shape.console_max_bytes),
        fs,
        network_interfaces,
    })
}

/// The host's free 2 MiB huge pages, in MiB (/proc/meminfo's HugePages_Free when its
/// Hugepagesize is 2048 kB).
fn free_huge_pages_mib() -> u64 {
    let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") else {
        return 0;
    };
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    };
    match (field("HugePages_Free:"), field("Hugepagesize:")) {
        (Some(free), Some(2048)) => free * 2,
        _ => 0,
    }
}

/// Writes `config` to `path` as JSON.
fn write_config(path: &Path, config: &ConfigFile) -> Result<(), VmError> {
    let failed = |source| VmError::Config {
        path: path.to_path_buf(),
        source,
    };
    let json = serde_json::to_vec_pretty(config).map_err(|e| failed(std::io::Error::other(e)))?;
    std::fs::write(path, json).map_err(failed)
}

/// Who a restored guest is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity {
    /// Guest time and generation exactly as in the snapshot (`--deterministic`).
    Exact,
    /// The snapshot's generation, the wall clock brought to now (a reset of the same sandbox).
    Same,
    /// A clone: a new VM generation (`--new-generation`), so the guest reseeds its CRNG and
    /// the agent takes a new machine-id and hostname.
    Clone,
}

/// Like [`spawn`], but restores the snapshot in `restore.snapshot_dir` (`vmstate`, `memory`, and
/// `rootfs.img` when `restore.rootfs`: copied into the sandbox, since the guest writes to it). A
/// restore keeps its flags (`--restore`, `--drive-override`, ...): rollbox-vmm's `--config`
/// file describes a boot only, and has no form for a restore.
pub fn spawn_restore(
    vmm: &Path,
    paths: &Paths,
    restore: &Restore,
    jail: Option<&JailSpec>,
    volumes: &Volumes,
) -> Result<(Child, Vec<Virtiofsd>), VmError> {
    let dir_error = |source| VmError::Dir {
        path: paths.dir.clone(),
        source,
    };
    std::fs::create_dir(&paths.dir).map_err(dir_error)?;
    let daemons = volumes.start(paths, jail)?;
    let spawned = spawn_restored(vmm, paths, restore, jail, volumes.list);
    with_daemons(spawned, daemons)
}

/// What a restore restores, and how.
pub struct Restore<'a> {
    /// The snapshot's directory: `vmstate`, `memory`, and `rootfs.img` when `rootfs`.
    pub snapshot_dir: &'a Path,
    pub rootfs: bool,
    /// The template's shared base ([`Template::base_rootfs`]): the snapshot's second drive.
    pub base: Option<&'a Path>,
    pub identity: Identity,
    pub console_max_bytes: u64,
    /// The sandbox's own tap for the snapshot's interface (`eth0`), with its MAC.
    pub nic: Option<&'a Nic>,
}

/// [`spawn_restore`] once the directory and the volumes' virtiofsd processes are there.
fn spawn_restored(
    vmm: &Path,
    paths: &Paths,
    restore: &Restore,
    jail: Option<&JailSpec>,
    volumes: &[VolumeSource],
) -> Result<Child, VmError> {
    let Restore {
        snapshot_dir,
        rootfs,
        base,
        identity,
        console_max_bytes,
        nic,
    } = *restore;
    let mut launch = Launch::new(jail);
    if let Some(nic) = nic {
        launch
            .tap(nic)
            .arg("--net-override")
            .arg(format!("eth0={},mac={}", nic.tap, nic.mac));
    }
    for volume in volumes {
        // The snapshot's volume, served by the virtiofsd just started for this sandbox.
        let socket = launch.own_path(&paths.dir.join(volume.socket_name()));
        let mut value = std::ffi::OsString::from(format!("{}=", volume.mount.name));
        value.push(socket);
        launch.arg("--fs-socket").arg(value);
    }
    launch
        .host("--restore", snapshot_dir, "snapshot")
        .own("--api-sock", &paths.api_sock)
        .own("--vsock-uds", &paths.vsock)
        .own("--console", &paths.console)
        .arg(format!("--console-max-bytes={console_max_bytes}"));
    match identity {
        Identity::Exact => {
            launch.arg("--deterministic");
        }
        Identity::Clone => {
            launch.arg("--new-generation");
        }
        Identity::Same => {}
    }
    if rootfs {
        launch.disk_bytes = copy_snapshot_disk(snapshot_dir, paths)?;
        let mut drive = std::ffi::OsString::from("rootfs=");
        if jail.is_some() {
            drive.push("/rootfs.img");
        } else {
            drive.push(&paths.rootfs);
        }
        launch.arg("--drive-override").arg(drive);
        if let Some(base) = base {
            let mut drive = std::ffi::OsString::from(format!("{BASE_DRIVE}="));
            drive.push(launch.host_path(base, BASE_FILE));
            launch.arg("--drive-override").arg(drive);
        }
    }
    let (command, program) = launch.command(vmm, paths)?;
    start(command, &program, paths, &launch.keep_fds)
}

/// What a warm shell is made for: its jail's limits and binds are set as it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellShape {
    pub memory_mib: u32,
    /// The vCPUs of the empty VM it builds as it starts (`--shell-memory-mib`): a snapshot
    /// of that shape only restores its state into it; one of another loads without it.
    pub vcpus: u32,
    /// The largest disk it may run (its jail's file size limit is set for it).
    pub disk_bytes: u64,
    /// A template's shared base, bound read-only into its jail.
    pub base: Option<PathBuf>,
    /// The template it is kept for (`--warm-pool templates=N`); None: any of its size.
    pub template: Option<String>,
}

impl ShellShape {
    /// Whether a restore of `memory_mib` with a disk of `disk_bytes` over `base` can run in a
    /// shell of this shape (a disk within its own is within its jail's file size limit,
    /// [`fsize_limit`], which has room beyond it).
    pub fn fits(&self, memory_mib: u32, disk_bytes: u64, base: Option<&Path>) -> bool {
        self.memory_mib == memory_mib
            && self.base.as_deref() == base
            && disk_bytes <= self.disk_bytes
    }
}

/// Makes the directory of a warm shell (`paths.dir`, named by the sandbox id it will serve)
/// and starts `vmm` there (jailed when `jail` says so) with its API socket and console only,
/// building an empty VM of `shape` (KVM's VM, memory slot, irqchip and vCPUs; guest memory
/// untouched) that a `PUT /snapshot/load` of that shape restores into ([`load_in_shell`]). Its jail's file size limit is set
/// for `shape`'s disk, and `shape`'s base is bound into it.
pub fn spawn_shell(
    vmm: &Path,
    paths: &Paths,
    shape: &ShellShape,
    jail: Option<&JailSpec>,
    console_max_bytes: u64,
) -> Result<Child, VmError> {
    std::fs::create_dir(&paths.dir).map_err(|source| VmError::Dir {
        path: paths.dir.clone(),
        source,
    })?;
    let mut launch = Launch::new(jail);
    launch.disk_bytes = shape.disk_bytes;
    if let Some(base) = &shape.base {
        launch.host_path(base, BASE_FILE);
    }
    launch
        .own("--api-sock", &paths.api_sock)
        .own("--console", &paths.console)
        .arg(format!("--console-max-bytes={console_max_bytes}"))
        .arg(format!("--shell-memory-mib={}", shape.memory_mib))
        .arg(format!("--shell-vcpus={}", shape.vcpus));
    let (command, program) = launch.command(vmm, paths)?;
    start(command, &program, paths, &launch.keep_fds)
}

/// Loads the snapshot in `restore.snapshot_dir` into the shell in `paths.dir` (started by
/// [`spawn_shell`]) and runs it: the snapshot's `vmstate` and `memory` hard-linked into the
/// shell's directory (the same filesystem: the state directory), its disk copied there, then
/// `PUT /snapshot/load` as the shell sees those files. Blocking.
pub fn load_in_shell(paths: &Paths, restore: &Restore, jailed: bool) -> Result<(), VmError> {
    let seen = |name: &str| {
        if jailed {
            Path::new("/").join(name)
        } else {
            paths.dir.join(name)
        }
    };
    let memory_id = format!("{SHELL_MEMORY}.id");
    for (from, to) in [
        ("vmstate", SHELL_VMSTATE),
        ("memory", SHELL_MEMORY),
        // The memory file's identity (the VMM checks the file is the one the state names).
        ("memory.id", memory_id.as_str()),
    ] {
        let source = restore.snapshot_dir.join(from);
        if from == "memory.id" && !source.exists() {
            continue;
        }
        std::fs::hard_link(&source, paths.dir.join(to)).map_err(|e| VmError::ShellLink {
            from: source.clone(),
            to: paths.dir.join(to),
            source: e,
        })?;
    }
    let mut drive_overrides = std::collections::HashMap::new();
    if restore.rootfs {
        copy_snapshot_disk(restore.snapshot_dir, paths)?;
        if jailed {
            // The jailer gave its jail's files to the jail's uid as it started; this copy
            // came after, so it is given here.
            let (uid, gid) = JailDir::open(&paths.dir)?.owner();
            std::os::unix::fs::chown(&paths.rootfs, Some(uid), Some(gid)).map_err(|source| {
                VmError::ShellOwner {
                    path: paths.rootfs.clone(),
                    source,
                }
            })?;
        }
        drive_overrides.insert("rootfs".to_string(), seen("rootfs.img"));
        if let Some(base) = restore.base {
            // Bound at /base.ext4 in the shell's jail as it started.
            let seen_base = if jailed {
                seen(BASE_FILE)
            } else {
                base.to_path_buf()
            };
            drive_overrides.insert(BASE_DRIVE.to_string(), seen_base);
        }
    }
    let params = vmm_api::LoadSnapshotParams {
        snapshot_path: seen(SHELL_VMSTATE),
        mem_backend: Some(vmm_api::MemBackend {
            backend_type: "File".into(),
            backend_path: seen(SHELL_MEMORY),
        }),
        mem_file_path: None,
        enable_diff_snapshots: false,
        track_dirty_pages: false,
        resume_vm: true,
        vsock_override: Some(vmm_api::VsockOverride {
            uds_path: seen("vsock.sock"),
        }),
        network_overrides: Vec::new(),
        rollbox: Some(vmm_api::RestoreExtension {
            new_generation: restore.identity == Identity::Clone,
            deterministic: restore.identity == Identity::Exact,
            drive_overrides,
            ..Default::default()
        }),
    };
    let (client, sock) = api_client(paths, SNAPSHOT_TIMEOUT)?;
    client.load_snapshot(&params).map_err(api_error(&sock))
}

/// The names a shell's snapshot files take in its directory.
const SHELL_VMSTATE: &str = "restore.vmstate";
const SHELL_MEMORY: &str = "restore.memory";

/// Copies a snapshot's disk (`rootfs.img` in `snapshot_dir`, the daemon's own copy, still
/// opened with no symlink followed) to the sandbox's new `rootfs.img`; its size.
fn copy_snapshot_disk(snapshot_dir: &Path, paths: &Paths) -> Result<u64, VmError> {
    let source = JailDir::open(snapshot_dir)?.open_file("rootfs.img")?;
    let failed = |source| VmError::Rootfs {
        from: snapshot_dir.join("rootfs.img"),
        to: paths.rootfs.clone(),
        source,
    };
    let dest = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&paths.rootfs)
        .map_err(failed)?;
    copy_file(&source, &dest).map_err(failed)?;
    disk_len(&paths.rootfs).map_err(failed)
}

/// The size of a disk copy the daemon just made.
fn disk_len(path: &Path) -> std::io::Result<u64> {
    std::fs::metadata(path).map(|m| m.len())
}

/// Starts the VMM with its output in the sandbox's log, in its own process group: a signal to
/// the daemon's group does not reach it, and ending the sandbox ends the group (virtiofsd and
/// other helpers too). `keep_fds` (close-on-exec in the daemon, so no other child inherits
/// them) are left open across this child's exec.
fn start(
    mut command: Command,
    vmm: &Path,
    paths: &Paths,
    keep_fds: &[std::os::fd::RawFd],
) -> Result<Child, VmError> {
    let dir_error = |source| VmError::Dir {
        path: paths.dir.clone(),
        source,
    };
    let log = File::create(&paths.log).map_err(dir_error)?;
    let log2 = log.try_clone().map_err(dir_error)?;
    use std::os::unix::process::CommandExt;
    command
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0);
    if !keep_fds.is_empty() {
        let keep = keep_fds.to_vec();
        // SAFETY: runs in the forked child before exec, and calls only fcntl, which is
        // async-signal-safe; the descriptors stay open in the daemon until spawn returns.
        unsafe {
            command.pre_exec(move || {
                for &fd in &keep {
                    if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    command.spawn().map_err(|source| VmError::Spawn {
        vmm: vmm.to_path_buf(),
        source,
    })
}

/// A client of the VMM's API socket in `paths.dir`, reached through a descriptor of the
/// socket ([`SocketPath`], kept alive beside the client): a symlink planted there is refused.
pub fn api_client(paths: &Paths, timeout: Duration) -> Result<(Client, SocketPath), VmError> {
    let sock = JailDir::open(&paths.dir)?.socket("api.sock")?;
    let client = Client::new(sock.connect_path()).with_timeout(timeout);
    Ok((client, sock))
}

/// The sandbox's hybrid-vsock socket (`vsock.sock`, the guest agent's), checked like
/// [`api_client`]'s.
pub fn agent_socket(dir: &Path) -> Result<SocketPath, VmError> {
    Ok(JailDir::open(dir)?.socket("vsock.sock")?)
}

/// A failed call on the socket `sock`.
pub(super) fn api_error(sock: &SocketPath) -> impl FnOnce(ClientError) -> VmError {
    let sock = sock.path().to_path_buf();
    move |source| VmError::Api { sock, source }
}

/// Waits until the VMM's API answers (its VM started), or it ended.
pub async fn wait_ready(
    child: &mut Child,
    paths: &Paths,
    timeout: Duration,
) -> Result<(), VmError> {
    let deadline = Instant::now() + timeout;
    loop {
        // The socket listens before the VM is built; its event loop answers `GET /` only once
        // the VM started (a kernel that fails to load ends the VMM instead).
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        match api_client(paths, left) {
            Ok((client, sock)) => {
                let answer = tokio::task::spawn_blocking(move || {
                    let answer = client.vm_info();
                    drop(sock);
                    answer
                })
                .await;
                match answer {
                    Ok(Ok(_)) => return Ok(()),
                    // Not listening yet, or no VM yet: try again unless the VMM ended.
                    Ok(Err(e)) if !e.is_connect() => log::debug!("{e}"),
                    _ => {}
                }
            }
            // No socket yet.
            Err(VmError::Jail(e)) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(VmError::EarlyExit {
                pid: child.id(),
                sock: paths.api_sock.clone(),
                status,
                output: log_tail(&paths.dir),
            });
        }
        if Instant::now() >= deadline {
            return Err(VmError::NotReady {
                pid: child.id(),
                sock: paths.api_sock.clone(),
                secs: timeout.as_secs(),
            });
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The last 1000 bytes of the sandbox's `vmm.log`, on one line (nothing when there is none;
/// the refusal when it is no regular file of the sandbox's, such as a planted symlink).
pub(super) fn log_tail(dir: &Path) -> String {
    let tail = match JailDir::open(dir).and_then(|d| d.tail("vmm.log", 1000)) {
        Ok(tail) => tail,
        Err(e) if e.is_not_found() => Vec::new(),
        Err(e) => return format!("[{e}]"),
    };
    String::from_utf8_lossy(&tail).trim().replace('\n', " | ")
}

/// `PATCH /vm {"state": STATE}` on the VMM's API socket (blocking).
pub fn set_vm_state(paths: &Paths, state: VmState) -> Result<(), VmError> {
    let (client, sock) = api_client(paths, STATE_TIMEOUT)?;
    client.set_state(state).map_err(api_error(&sock))
}

/// `GET /` on the VMM's API socket: its VM's state, "Running" or "Paused" (blocking).
pub fn vm_state(paths: &Paths) -> Result<String, VmError> {
    let (client, sock) = api_client(paths, STATE_TIMEOUT)?;
    Ok(client.vm_info().map_err(api_error(&sock))?.state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A jail as `rollbox serve` makes one, with or without memory and pids limits.
    fn test_jail(limits: bool) -> Jail {
        Jail {
            jailer: PathBuf::from("/usr/bin/rollbox-jailer"),
            uid: 64000,
            gid: 64001,
            cgroup_fs: PathBuf::from("/sys/fs/cgroup"),
            cgroup_parent: "rollbox-0123".into(),
            memory_limits: limits,
            pids_limits: limits,
        }
    }

    #[test]
    fn a_jails_largest_file_is_its_disk_or_its_memory_plus_slack() {
        assert_eq!(fsize_limit(0, 256), (256 + 512) << 20);
        assert_eq!(fsize_limit(4 << 30, 256), (4 << 30) + (512 << 20));
    }

    #[test]
    fn a_jailed_launch_names_jail_paths_and_binds_host_files() {
        let jail = test_jail(true);
        let spec = JailSpec {
            jail: &jail,
            cgroups: vec!["cpu.cfs_quota_us=50000".into()],
            memory_mib: 256,
            vfio: Vec::new(),
        };
        let paths = Paths::new(Path::new("/state/sandboxes/sb-1"));
        let mut launch = Launch::new(Some(&spec));
        launch
            .host("--kernel", Path::new("/templates/vmlinux"), "kernel")
            .own("--api-sock", &paths.api_sock);
        let (command, program) = launch
            .command(Path::new("/usr/bin/rollbox-vmm"), &paths)
            .expect("command");
        assert_eq!(program, jail.jailer);
        let args: Vec<String> = command
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let line = args.join(" ");
        for want in [
            "--id sb-1 --exec /usr/bin/rollbox-vmm --uid 64000 --gid 64001",
            "--chroot-base /state/sandboxes",
            "--cgroup cpu.cfs_quota_us=50000",
            &format!("--cgroup memory.limit_in_bytes={}", (256u64 + 512) << 20),
            "--cgroup pids.max=512",
            // No disk: the memory snapshot is its largest file.
            &format!("--rlimit fsize={}", (256u64 + 512) << 20),
            "--bind-ro /templates/vmlinux:/kernel",
            "-- --kernel /kernel --api-sock /api.sock",
        ] {
            assert!(line.contains(want), "{want:?} not in {line}");
        }
        // Unjailed: the host paths, the VMM itself.
        let mut plain = Launch::new(None);
        plain.host("--kernel", Path::new("/templates/vmlinux"), "kernel");
        plain.own("--api-sock", &paths.api_sock);
        let (command, program) = plain
            .command(Path::new("/usr/bin/rollbox-vmm"), &paths)
            .expect("command");
        assert_eq!(program, PathBuf::from("/usr/bin/rollbox-vmm"));
        let args: Vec<_> = command.get_args().collect();
        assert_eq!(
            args,
            [
                "--kernel",
                "/templates/vmlinux",
                "--api-sock",
                "/state/sandboxes/sb-1/api.sock"
            ]
        );
    }

    #[test]
    fn a_boot_is_a_config_file_with_the_jails_paths() {
        let template = Template {
            name: "t".into(),
            kernel: PathBuf::from("/templates/vmlinux"),
            rootfs: Some(PathBuf::from("/templates/rootfs.ext4")),
            base_rootfs: None,
            initrd: None,
            cmdline: "console=ttyS0".into(),
            vcpus: 1,
            memory_mib: 128,
            created_at_ms: 0,
            image: None,
            boot_snapshot: None,
            start_cmd: None,
            ready_cmd: None,
            ready_timeout_s: None,
            volumes: Vec::new(),
            network: None,
            docker: false,
        };
        let shape = Shape {
            template: &template,
            vcpus: 2,
            memory_mib: 256,
            deterministic: true,
            console_max_bytes: 1 << 20,
            vfio: &[],
            nic: None,
        };
        let paths = Paths::new(Path::new("/state/sandboxes/sb-1"));
        let jail = test_jail(false);
        let spec = JailSpec {
            jail: &jail,
            cgroups: Vec::new(),
            memory_mib: 256,
            vfio: Vec::new(),
        };
        let mut jailed = Launch::new(Some(&spec));
        let volume = VolumeSource {
            mount: crate::daemon::api::VolumeMount {
                name: "data".into(),
                mount_path: "/mnt/data".into(),
                readonly: true,
            },
            host_path: PathBuf::from("/state/volumes/data"),
        };
        let config = boot_config(&mut jailed, &paths, &shape, &[volume]).expect("config");
        assert_eq!(
            serde_json::to_string(&config).expect("json"),
            concat!(
                r#"{"boot-source":{"kernel_image_path":"/kernel","#,
                r#""boot_args":"console=ttyS0 rollbox.volume=data:/mnt/data:ro"},"#,
                r#""machine-config":{"vcpu_count":2,"mem_size_mib":256,"smt":false,"#,
                r#""track_dirty_pages":false,"deterministic":true},"#,
                r#""drives":[{"drive_id":"rootfs","path_on_host":"/rootfs.img","#,
                r#""is_root_device":true,"is_read_only":false}],"#,
                r#""vsock":{"guest_cid":3,"uds_path":"/vsock.sock"},"console":"/console.log","#,
                r#""console-max-bytes":1048576,"#,
                r#""fs":[{"tag":"data","shared_dir":"/state/volumes/data","readonly":false,"#,
                r#""cache":"auto","socket":"/vfs-data.sock"}]}"#
            )
        );
        assert_eq!(jailed.binds, ["/templates/vmlinux:/kernel"]);
        // Unjailed: the host's paths, no binds, and no drive without a rootfs.
        let template = Template {
            rootfs: None,
            cmdline: String::new(),
            ..template
        };
        let shape = Shape {
            template: &template,
            vcpus: 1,
            memory_mib: 128,
            deterministic: false,
            console_max_bytes: 1 << 20,
            vfio: &[],
            nic: None,
        };
        let mut plain = Launch::new(None);
        let config = boot_config(&mut plain, &paths, &shape, &[]).expect("config");
        let boot = config.boot_source.as_ref().expect("boot-source");
        assert_eq!(boot.kernel_image_path, PathBuf::from("/templates/vmlinux"));
        assert_eq!(boot.boot_args, None);
        assert!(config.drives.is_empty());
        assert!(
            !config
                .machine_config
                .as_ref()
                .expect("machine")
                .deterministic
        );
        assert_eq!(
            config.console.as_deref(),
            Some("/state/sandboxes/sb-1/console.log")
        );
        assert!(plain.binds.is_empty());
    }
}
