//! The `rollbox-vmm` command line: its flags ([`Args`]), the resources they describe and the
//! options of a restore. The values of the resource flags are parsed in `flags.rs`.

mod flags;

use std::collections::HashMap;
use std::os::fd::{FromRawFd, RawFd};
use std::path::PathBuf;

use clap::Parser;
use vmm::devices::virtio::net::tap::AttachedTaps;
use vmm::persist::{RestoreBackend, RestoreOptions};
use vmm::vmm_config::{
    host_memory_mib, load_config_file, BootSourceConfig, ConsoleConfig, Validate, ValidateMachine,
    VmResources, VsockConfig, MIN_CONSOLE_MAX_BYTES,
};

use flags::{parse_drive_flag, parse_fs_flag, parse_net_flag};

/// A KVM microVM manager. Give a kernel to boot at once, or an API socket to configure the
/// microVM over Firecracker's REST API.
#[derive(Parser, Debug)]
#[command(name = "rollbox-vmm", version)]
pub struct Args {
    /// Kernel: ELF vmlinux or bzImage.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line (rollbox-vmm appends its device arguments).
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Guest memory in MiB [default: 128].
    #[arg(long)]
    pub memory_mib: Option<u64>,
    /// Back guest memory with huge pages: 2M (2 MiB hugetlb pages the host reserved in
    /// /proc/sys/vm/nr_hugepages; an even --memory-mib) or None [default: None].
    #[arg(long, value_name = "2M|None", conflicts_with = "restore")]
    pub huge_pages: Option<String>,
    /// Number of vCPUs [default: 1].
    #[arg(long)]
    pub vcpus: Option<u64>,
    /// A raw disk image: PATH[,readonly][,root][,id=NAME]; repeat for more drives.
    #[arg(long = "drive")]
    pub drives: Vec<String>,
    /// A network interface on a host tap: TAP[,mac=MAC][,id=NAME]; repeat for more.
    #[arg(long = "net", conflicts_with = "restore")]
    pub nets: Vec<String>,
    /// A tap this process inherited attached already, as NAME=FD (the descriptor of
    /// /dev/net/tun after TUNSETIFF NAME with IFF_TAP|IFF_NO_PI|IFF_VNET_HDR, done by the caller
    /// in its own network namespace): the interface on tap NAME, from --net, --config or a
    /// restore, takes it instead of opening the tap; repeat for more (rollbox extension: a VMM
    /// in an empty network namespace reaches the host's tap this way).
    #[arg(long = "tap-fd", value_name = "NAME=FD")]
    pub tap_fds: Vec<String>,
    /// With --restore: put an interface on another tap (and give it a new MAC), as
    /// ID=TAP[,mac=MAC].
    #[arg(long = "net-override", requires = "restore")]
    pub net_overrides: Vec<String>,
    /// Host side of virtio-vsock: a Unix socket path (with --restore: the clone's new socket).
    #[arg(long)]
    pub vsock_uds: Option<PathBuf>,
    /// The guest's vsock CID (3 or more).
    #[arg(long, requires = "vsock_uds")]
    pub vsock_cid: Option<u64>,
    /// A shared host directory over virtio-fs (rollbox extension):
    /// TAG=HOST_DIR[,readonly][,cache=auto|always|never][,socket=PATH]; repeat for more. The
    /// guest mounts it with `mount -t virtiofs TAG DIR`.
    #[arg(long = "fs")]
    pub fs: Vec<String>,
    /// The virtiofsd binary for --fs volumes [default: $ROLLBOX_VIRTIOFSD, else virtiofsd on
    /// PATH, /usr/libexec/virtiofsd, or the cache of scripts/virtiofsd.sh].
    #[arg(long)]
    pub virtiofsd: Option<PathBuf>,
    /// Track dirty pages, so that Diff snapshots can be taken.
    #[arg(long)]
    pub track_dirty_pages: bool,
    /// A deterministic machine (CPUID without RDRAND/RDSEED); with --restore: a deterministic
    /// reset (guest time and generation exactly as in the snapshot, no wall-clock update).
    #[arg(long, conflicts_with = "new_generation")]
    pub deterministic: bool,
    /// A PCI root bus (rollbox extension): CF8/CFC and ECAM, with ACPI's MCFG and PCI0.
    #[arg(long, conflicts_with = "restore")]
    pub pci: bool,
    /// Pass a host PCI device bound to vfio-pci through to the guest (rollbox extension):
    /// /sys/bus/pci/devices/DDDD:BB:DD.F; repeat for more. Implies --pci.
    #[arg(long = "vfio", conflicts_with = "restore")]
    pub vfio: Vec<PathBuf>,
    /// Restore a snapshot instead of booting: a directory with `vmstate` and `memory`, or a
    /// state file.
    #[arg(long, conflicts_with_all = ["kernel", "config", "vcpus", "cmdline", "initrd", "fs"])]
    pub restore: Option<PathBuf>,
    /// With --restore: cow (map the memory file copy-on-write), uffd (lazy, in-VMM page
    /// server) or copy (eager).
    #[arg(long, default_value = "cow", requires = "restore")]
    pub restore_backend: String,
    /// With --restore and uffd: prefetch the working set recorded by an earlier restore.
    #[arg(long, requires = "restore")]
    pub prefetch: bool,
    /// With --restore and uffd: record the pages the guest touches (`<memory>.ws`).
    #[arg(long, requires = "restore")]
    pub record_working_set: bool,
    /// With --restore: tell the guest it is a clone (new generation counter value).
    #[arg(long, requires = "restore")]
    pub new_generation: bool,
    /// With --restore: serve a volume from another host directory, as TAG=DIR.
    #[arg(long = "fs-override", requires = "restore")]
    pub fs_overrides: Vec<String>,
    /// With --restore: connect a volume to a virtiofsd already serving it, as TAG=SOCKET (its
    /// vhost-user socket): none is started, the shared directory is that virtiofsd's, and the
    /// snapshot's virtiofsd state is loaded into it. Not with --fs-override for the same TAG.
    #[arg(long = "fs-socket", requires = "restore")]
    pub fs_sockets: Vec<String>,
    /// With --restore: use another image for a drive, as ID=PATH.
    #[arg(long = "drive-override", requires = "restore")]
    pub drive_overrides: Vec<String>,
    /// With --restore: read a memory layer from another file, as INDEX=PATH (0 is the full
    /// base, then the diffs in order).
    #[arg(long = "layer-override", requires = "restore")]
    pub layer_overrides: Vec<String>,
    /// With --restore: start paused.
    #[arg(long, requires = "restore")]
    pub paused: bool,
    /// With --api-sock and no kernel: pre-build an empty VM with this much memory, so that a
    /// `PUT /snapshot/load` of that shape skips KVM set-up (rollbox extension).
    #[arg(long, requires = "api_sock", conflicts_with_all = ["kernel", "restore"])]
    pub shell_memory_mib: Option<u64>,
    /// vCPUs of the pre-built VM.
    #[arg(long, default_value_t = 1, requires = "shell_memory_mib")]
    pub shell_vcpus: u64,
    /// Guest console: `stdout` or a file path [default: stdout].
    #[arg(long)]
    pub console: Option<String>,
    /// Largest size of a `--console` file in bytes: past it, output is dropped and counted
    /// [default: 8 MiB, at least 1024].
    #[arg(long, value_parser = clap::value_parser!(u64).range(MIN_CONSOLE_MAX_BYTES..))]
    pub console_max_bytes: Option<u64>,
    /// Serve the control API on this Unix socket.
    #[arg(long)]
    pub api_sock: Option<PathBuf>,
    /// A Firecracker-style JSON configuration file.
    #[arg(long = "config", alias = "config-file")]
    pub config: Option<PathBuf>,
    /// Write log lines to this file instead of stderr.
    #[arg(long)]
    pub log_path: Option<PathBuf>,
    /// Log level: Error, Warning, Info, Debug, Trace or Off.
    #[arg(long, default_value = "Warning")]
    pub level: String,
    /// Run without seccomp filters (by default each thread kind has its own allow-list).
    #[arg(long)]
    pub no_seccomp: bool,
    /// Use these seccomp filters instead of the built-in ones: Firecracker's JSON format, one
    /// filter per thread kind (vmm, api, vcpu, block, page_server).
    #[arg(long, value_name = "FILE", conflicts_with = "no_seccomp")]
    pub seccomp_filter: Option<PathBuf>,
    /// Print how many syscalls the built-in filters allow per thread kind, and which; then exit.
    #[arg(long)]
    pub print_seccomp_summary: bool,
}

/// The resources the flags (and the `--config` file they name) describe.
pub fn resources_from(args: &Args) -> Result<VmResources, String> {
    let host_mib = host_memory_mib();
    let mut resources = VmResources {
        virtiofsd: args.virtiofsd.clone(),
        ..Default::default()
    };
    if let Some(path) = &args.config {
        let file = load_config_file(path).map_err(|e| e.to_string())?;
        resources
            .apply_file(file, host_mib)
            .map_err(|e| e.to_string())?;
    }
    if let Some(kernel) = &args.kernel {
        let previous = resources.boot_source.take();
        resources.boot_source = Some(BootSourceConfig {
            kernel_image_path: kernel.clone(),
            boot_args: args
                .cmdline
                .clone()
                .or(previous.as_ref().and_then(|b| b.boot_args.clone())),
            initrd_path: args.initrd.clone().or(previous.and_then(|b| b.initrd_path)),
        });
    } else if args.cmdline.is_some() || args.initrd.is_some() {
        match resources.boot_source.as_mut() {
            Some(boot) => {
                if args.cmdline.is_some() {
                    boot.boot_args = args.cmdline.clone();
                }
                if args.initrd.is_some() {
                    boot.initrd_path = args.initrd.clone();
                }
            }
            None => {
                return Err(
                    "--cmdline and --initrd need --kernel (or a boot-source in --config)".into(),
                )
            }
        }
    }
    if let Some(mib) = args.memory_mib {
        resources.machine.mem_size_mib = mib;
    }
    if let Some(size) = &args.huge_pages {
        resources.machine.huge_pages = Some(size.clone());
    }
    if args.deterministic {
        resources.machine.deterministic = true;
    }
    if args.track_dirty_pages {
        resources.machine.track_dirty_pages = true;
    }
    if args.pci {
        resources.machine.rollbox.pci = true;
    }
    resources
        .machine
        .rollbox
        .vfio
        .extend(args.vfio.iter().cloned());
    if args.vsock_uds.is_some() && args.vsock_cid.is_none() {
        return Err("--vsock-uds needs --vsock-cid (except with --restore)".into());
    }
    if let Some(vcpus) = args.vcpus {
        resources.machine.vcpu_count = vcpus;
    }
    resources
        .machine
        .validate(host_mib)
        .map_err(|e| e.to_string())?;
    let first_index = resources.drives.len();
    for (i, flag) in args.drives.iter().enumerate() {
        let drive = parse_drive_flag(flag, first_index + i).map_err(|e| e.to_string())?;
        std::fs::metadata(&drive.path_on_host)
            .map_err(|e| format!("drive {}: {e}", drive.path_on_host.display()))?;
        resources.upsert_drive(drive).map_err(|e| e.to_string())?;
    }
    let first_index = resources.net.len();
    for (i, flag) in args.nets.iter().enumerate() {
        let iface = parse_net_flag(flag, first_index + i).map_err(|e| e.to_string())?;
        resources.upsert_net(iface).map_err(|e| e.to_string())?;
    }
    if let (Some(uds_path), Some(guest_cid)) = (&args.vsock_uds, args.vsock_cid) {
        let vsock = VsockConfig {
            guest_cid,
            uds_path: uds_path.clone(),
            vsock_id: None,
        };
        vsock.validate().map_err(|e| e.to_string())?;
        resources.vsock = Some(vsock);
    }
    if let Some(console) = &args.console {
        resources.console = ConsoleConfig::parse(console);
    }
    if let Some(max) = args.console_max_bytes {
        resources.console = resources.console.clone().with_max_bytes(max);
    }
    for flag in &args.fs {
        let fs = parse_fs_flag(flag).map_err(|e| e.to_string())?;
        resources.add_fs(fs).map_err(|e| e.to_string())?;
    }
    resources.taps = attached_taps(args)?;
    Ok(resources)
}

/// The taps of `--tap-fd NAME=FD`: each descriptor is checked to be open, marked
/// close-on-exec (no clone or virtiofsd inherits it) and owned from here on. Called once per
/// process, by [`resources_from`] or [`restore_options`].
fn attached_taps(args: &Args) -> Result<AttachedTaps, String> {
    let taps = AttachedTaps::default();
    let mut seen = std::collections::HashSet::new();
    for (name, fd) in overrides("--tap-fd", "NAME=FD", &args.tap_fds)? {
        let bad = |why: &str| format!("--tap-fd {name}={fd}: {why}");
        vmm::devices::virtio::net::tap::check_name(&name).map_err(|e| bad(&e.to_string()))?;
        let fd: RawFd = fd
            .parse()
            .ok()
            .filter(|fd| *fd > 2)
            .ok_or_else(|| bad("FD must be a descriptor number above 2"))?;
        if !seen.insert(fd) || taps.names().contains(&name) {
            return Err(bad("each tap and each descriptor once"));
        }
        // SAFETY: F_GETFD/F_SETFD on a number; no memory is shared, and an unopened number
        // answers EBADF.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
            return Err(bad(&format!(
                "not an open descriptor ({})",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: the descriptor is open (checked above), was handed down to this process for
        // this tap alone, and each number is taken once, so nothing else owns or closes it.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        taps.insert(name, file);
    }
    Ok(taps)
}

/// Splits each `KEY=VALUE` of a repeated `flag` (`form` names the parts in errors).
fn overrides(
    flag: &str,
    form: &str,
    entries: &[String],
) -> Result<impl Iterator<Item = (String, String)>, String> {
    let pairs = entries
        .iter()
        .map(|entry| {
            entry
                .split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| format!("{flag} {entry:?}: expected {form}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(pairs.into_iter())
}

/// The restore options of `--restore` and the flags that go with it.
pub fn restore_options(args: &Args) -> Result<RestoreOptions, String> {
    let drive_overrides = overrides("--drive-override", "ID=PATH", &args.drive_overrides)?
        .map(|(id, path)| (id, PathBuf::from(path)))
        .collect();
    let mut net_overrides = HashMap::new();
    for entry in &args.net_overrides {
        let (id, value) = entry
            .split_once('=')
            .ok_or_else(|| format!("--net-override {entry:?}: expected ID=TAP[,mac=MAC]"))?;
        let parsed = vmm::devices::virtio::net::NetOverride::parse(value)
            .map_err(|e| format!("--net-override {entry:?}: {e}"))?;
        net_overrides.insert(id.to_string(), parsed);
    }
    let fs_overrides: HashMap<String, PathBuf> =
        overrides("--fs-override", "TAG=DIR", &args.fs_overrides)?
            .map(|(tag, dir)| (tag, PathBuf::from(dir)))
            .collect();
    let fs_sockets: HashMap<String, PathBuf> =
        overrides("--fs-socket", "TAG=SOCKET", &args.fs_sockets)?
            .map(|(tag, socket)| (tag, PathBuf::from(socket)))
            .collect();
    if let Some(tag) = fs_sockets
        .keys()
        .find(|tag| fs_overrides.contains_key(*tag))
    {
        return Err(format!(
            "--fs-socket {tag}=... and --fs-override {tag}=...: the shared directory is the one the virtiofsd on the socket serves, so give one"
        ));
    }
    let layer_overrides = overrides("--layer-override", "INDEX=PATH", &args.layer_overrides)?
        .map(|(index, path)| {
            index
                .parse::<usize>()
                .map(|index| (index, PathBuf::from(path)))
                .map_err(|e| format!("--layer-override {index:?}: the index: {e}"))
        })
        .collect::<Result<_, String>>()?;
    Ok(RestoreOptions {
        backend: args.restore_backend.parse::<RestoreBackend>()?,
        layer_overrides,
        fs_overrides,
        fs_sockets,
        taps: attached_taps(args)?,
        virtiofsd: args.virtiofsd.clone(),
        mem_file: None,
        vsock_uds: args.vsock_uds.clone(),
        drive_overrides,
        net_overrides,
        new_generation: args.new_generation,
        deterministic: args.deterministic,
        paused: args.paused,
        console: args
            .console
            .as_deref()
            .map(ConsoleConfig::parse)
            .unwrap_or_default()
            .with_max_bytes(
                args.console_max_bytes
                    .unwrap_or(vmm::vmm_config::DEFAULT_CONSOLE_MAX_BYTES),
            ),
        record_working_set: args.record_working_set,
        prefetch: args.prefetch,
        expect_mem_mib: args.memory_mib,
        track_dirty_pages: args.track_dirty_pages.then_some(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("rollbox-vmm").chain(flags.iter().copied()))
    }

    #[test]
    fn tap_fd_takes_an_open_descriptor_once_and_names_bad_ones() {
        use std::os::fd::IntoRawFd;
        let taps = |flags: &[&str]| attached_taps(&parse(flags).expect("parse"));
        let err = taps(&["--tap-fd", "rbx0=1"]).expect_err("stdout");
        assert_eq!(
            err,
            "--tap-fd rbx0=1: FD must be a descriptor number above 2"
        );
        let err = taps(&["--tap-fd", "rbx0"]).expect_err("no FD");
        assert!(err.contains("expected NAME=FD"), "{err}");
        let err = taps(&["--tap-fd", "a/b=7"]).expect_err("bad name");
        assert!(err.starts_with("--tap-fd a/b=7: tap name"), "{err}");
        let fd = std::fs::File::open("/dev/null")
            .expect("null")
            .into_raw_fd();
        let held = taps(&["--tap-fd", &format!("rbx0={fd}")]).expect("an open descriptor");
        assert_eq!(held.names(), vec!["rbx0".to_string()]);
        let fd = std::fs::File::open("/dev/null")
            .expect("null")
            .into_raw_fd();
        let (one, two) = (format!("rbx1={fd}"), format!("rbx2={fd}"));
        let err = taps(&["--tap-fd", &one, "--tap-fd", &two]).expect_err("twice");
        assert!(err.ends_with("each tap and each descriptor once"), "{err}");
    }

    #[test]
    fn fs_socket_names_a_callers_virtiofsd_per_tag_on_restore() {
        let args = parse(&[
            "--restore",
            "/snap",
            "--fs-socket",
            "data=/run/data.sock",
            "--fs-socket",
            "logs=/run/logs.sock",
            "--fs-override",
            "cache=/srv/cache",
        ])
        .expect("parse");
        let options = restore_options(&args).expect("options");
        assert_eq!(
            options.fs_sockets,
            HashMap::from([
                ("data".to_string(), PathBuf::from("/run/data.sock")),
                ("logs".to_string(), PathBuf::from("/run/logs.sock")),
            ])
        );
        assert_eq!(
            options.fs_overrides,
            HashMap::from([("cache".to_string(), PathBuf::from("/srv/cache"))])
        );

        let plain =
            restore_options(&parse(&["--restore", "/snap"]).expect("parse")).expect("options");
        assert!(plain.fs_sockets.is_empty());

        assert!(parse(&["--fs-socket", "data=/run/data.sock"]).is_err());
        let err =
            restore_options(&parse(&["--restore", "/snap", "--fs-socket", "data"]).expect("parse"))
                .expect_err("no socket");
        assert!(err.contains("expected TAG=SOCKET"), "{err}");
        let both = parse(&[
            "--restore",
            "/snap",
            "--fs-socket",
            "data=/run/data.sock",
            "--fs-override",
            "data=/srv/copy",
        ])
        .expect("parse");
        let err = restore_options(&both).expect_err("both for one tag");
        assert!(
            err.contains("--fs-socket data=") && err.contains("--fs-override data="),
            "{err}"
        );
    }
}
