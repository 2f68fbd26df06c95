//! `rollbox-jailer`: starts one `rollbox-vmm` in new mount, PID, IPC and UTS namespaces (and a
//! network namespace when asked), pivot_root'ed into `<chroot-base>/<id>` with read-only bind
//! mounts of what the VM needs and a private /dev holding only kvm, net/tun, urandom and null
//! (and userfaultfd with `--userfaultfd`, for a uffd restore), its root bind-mounted on itself
//! nosuid, nodev and noexec, as an unprivileged uid with no capabilities and no-new-privs,
//! umask 077, in its own cgroups, with rlimits and no inherited descriptor but stdin, stdout
//! and stderr.
//!
//! Processes: the jailer stays outside as the jail's parent; its child is PID 1 of the new
//! PID namespace (it reaps, and when it ends the kernel kills everything else in the jail);
//! PID 1 starts the VMM. When the VMM ends (or the jailer is told to stop with SIGTERM, SIGINT
//! or SIGHUP) the jail ends, and the jailer removes its cgroups and the mount points it made,
//! then exits with the VMM's status (128 + signal when a signal ended it). Mounts live only in
//! the jail's mount namespace, so none outlives it. If the jailer itself is SIGKILLed, PID 1
//! gets SIGKILL too (parent-death signal), and only the empty cgroups stay: `rollbox serve`
//! removes them (`rollbox_jailer::remove_jail_groups`).

use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use clap::Parser;
use rollbox_jailer::{JailError, JailGroups, Setting};

mod timing;

/// The device nodes a jail gets (when the host has them), with their mode.
/// (/dev/null too: the VMM's own children get their stdio from it.)
const DEVICES: [(&str, u32); 4] = [
    ("kvm", 0o600),
    ("net/tun", 0o600),
    ("urandom", 0o666),
    ("null", 0o666),
];

/// The device node of `--userfaultfd` (a uffd restore's page server); no other jail has it.
const USERFAULTFD: (&str, u32) = ("userfaultfd", 0o600);

/// What the jail needs of one `--vfio` device.
struct VfioDevice {
    /// The device's sysfs directory (canonical) and where the jail sees it.
    sysfs: PathBuf,
    jail_sysfs: PathBuf,
    /// `/sys/kernel/iommu_groups/N` and where the jail sees it.
    group_dir: PathBuf,
    jail_group_dir: PathBuf,
    group: u32,
}

/// Checks each `--vfio` path: a PCI device in sysfs bound to vfio-pci, with an IOMMU group.
fn vfio_devices(paths: &[PathBuf]) -> Result<Vec<VfioDevice>, JailError> {
    paths
        .iter()
        .map(|path| {
            let bad = |why: &str| usage(format!("--vfio {}: {why}", path.display()));
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .filter(|n| {
                    n.len() == 12
                        && n.bytes()
                            .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
                })
                .ok_or_else(|| bad("not /sys/bus/pci/devices/DDDD:BB:DD.F"))?;
            if *path != Path::new("/sys/bus/pci/devices").join(name) {
                return Err(bad("not /sys/bus/pci/devices/DDDD:BB:DD.F"));
            }
            let sysfs = path
                .canonicalize()
                .map_err(JailError::step("--vfio", path))?;
            let driver = std::fs::read_link(path.join("driver")).ok();
            if driver.as_deref().and_then(Path::file_name) != Some(OsStr::new("vfio-pci")) {
                return Err(bad("not bound to vfio-pci"));
            }
            let group = std::fs::read_link(path.join("iommu_group"))
                .ok()
                .and_then(|link| link.file_name()?.to_str()?.parse::<u32>().ok())
                .ok_or_else(|| bad("no IOMMU group"))?;
            let group_dir = PathBuf::from(format!("/sys/kernel/iommu_groups/{group}"));
            Ok(VfioDevice {
                jail_sysfs: PathBuf::from("sys/bus/pci/devices").join(name),
                sysfs,
                jail_group_dir: PathBuf::from(format!("sys/kernel/iommu_groups/{group}")),
                group_dir,
                group,
            })
        })
        .collect()
}

/// The device nodes `--vfio` devices need: the container and each group's node, once.
fn vfio_nodes(devices: &[VfioDevice]) -> Vec<(PathBuf, PathBuf, u32)> {
    let mut nodes: Vec<(PathBuf, PathBuf, u32)> = Vec::new();
    if devices.is_empty() {
        return nodes;
    }
    let mut names = vec!["vfio".to_string()];
    for device in devices {
        let group = device.group.to_string();
        if !names.contains(&group) {
            names.push(group);
        }
    }
    for name in names {
        nodes.push((
            Path::new("/dev/vfio").join(&name),
            Path::new("dev/vfio").join(&name),
            0o600,
        ));
    }
    nodes
}

/// Mode of the directories the jailer makes for mount points: the jail's uid passes through
/// them to what is mounted below, and no one lists them.
const MOUNT_POINT_DIR_MODE: u32 = 0o711;

#[derive(Parser, Debug)]
#[command(
    name = "rollbox-jailer",
    about = "Start rollbox-vmm in namespaces, a chroot, cgroups and an unprivileged uid"
)]
struct Args {
    /// The jail's name: its directory is <chroot-base>/<id>, its cgroups <parent>/<id>.
    #[arg(long)]
    id: String,
    /// The rollbox-vmm binary (bind-mounted read-only into the jail as /<its file name>).
    #[arg(long)]
    exec: PathBuf,
    #[arg(long)]
    uid: u32,
    #[arg(long)]
    gid: u32,
    /// The jail's root is <chroot-base>/<id> (made when missing, owned by uid:gid).
    #[arg(long)]
    chroot_base: PathBuf,
    /// HOST[:JAIL]: bind-mount HOST read-only at JAIL (default /<file name>) in the jail.
    #[arg(long = "bind-ro", value_name = "HOST[:JAIL]")]
    bind_ro: Vec<String>,
    /// CONTROLLER.FILE=VALUE, e.g. pids.max=64, memory.limit_in_bytes=1073741824,
    /// cpu.cfs_quota_us=50000 (v1) or cpu.max=50000 100000 (v2); repeatable.
    #[arg(long, value_name = "CONTROLLER.FILE=VALUE")]
    cgroup: Vec<Setting>,
    /// The parent group of the jail's cgroups, in each hierarchy.
    #[arg(long, default_value = "rollbox-jailer")]
    cgroup_parent: String,
    /// Where the cgroup hierarchies are mounted.
    #[arg(long, default_value = "/sys/fs/cgroup")]
    cgroup_fs: PathBuf,
    /// Join this network namespace (e.g. /var/run/netns/NAME) instead of the host's.
    #[arg(long)]
    netns: Option<PathBuf>,
    /// Make a new, empty network namespace (no interfaces but lo).
    #[arg(long, conflicts_with = "netns")]
    new_netns: bool,
    /// Give the jail /dev/userfaultfd (only a restore with `--restore-backend uffd` needs it).
    #[arg(long)]
    userfaultfd: bool,
    /// nofile=N, fsize=BYTES or memlock=BYTES (soft and hard limit); repeatable.
    #[arg(long, value_name = "RESOURCE=N")]
    rlimit: Vec<String>,
    /// A PCI device bound to vfio-pci that the VMM passes through
    /// (/sys/bus/pci/devices/DDDD:BB:DD.F): the jail gets its sysfs directory at that path
    /// and its IOMMU group's (read-only), and /dev/vfio/vfio and /dev/vfio/GROUP; repeatable.
    #[arg(long, value_name = "SYSFS_PATH")]
    vfio: Vec<PathBuf>,
    /// An inherited descriptor the VMM keeps, at the same number (e.g. a tap the caller
    /// attached in the host's network namespace, for `rollbox-vmm --tap-fd NAME=FD`); every
    /// other one above 2 is closed; repeatable.
    #[arg(long = "keep-fd", value_name = "FD", value_parser = clap::value_parser!(i32).range(3..))]
    keep_fd: Vec<i32>,
    /// The VMM's arguments (paths as the jail sees them).
    #[arg(last = true)]
    vmm_args: Vec<String>,
}

/// Everything the jail's processes need, prepared before the fork.
struct Plan {
    root: PathBuf,
    uid: u32,
    gid: u32,
    hostname: String,
    /// (host path, mount point under root, is a dir, read-only)
    binds: Vec<(PathBuf, PathBuf, bool)>,
    /// (host device, node under root/dev, mode)
    devices: Vec<(PathBuf, PathBuf, u32)>,
    rlimits: Vec<(libc::__rlimit_resource_t, u64, String)>,
    exec_in_jail: CString,
    argv: Vec<CString>,
    /// `--keep-fd`: only the VMM holds them; the jailer and PID 1 close their copies.
    keep_fds: Vec<i32>,
}

impl Plan {
    /// Closes this process's copies of the descriptors the VMM keeps (so that it alone holds
    /// them, and e.g. a tap detaches when it ends).
    fn close_kept(&self) {
        for &fd in &self.keep_fds {
            // SAFETY: closes a descriptor this process inherited for its child and never uses.
            unsafe { libc::close(fd) };
        }
    }
}

fn main() {
    timing::start();
    let args = Args::parse();
    match run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("rollbox-jailer: {e}");
            std::process::exit(1);
        }
    }
}

fn usage(message: String) -> JailError {
    JailError::Usage(message)
}

fn cstring(bytes: &[u8], what: &str) -> Result<CString, JailError> {
    CString::new(bytes).map_err(|_| usage(format!("{what} holds a NUL byte")))
}

fn cpath(path: &Path) -> Result<CString, JailError> {
    cstring(path.as_os_str().as_bytes(), &path.display().to_string())
}

/// The last OS error as a failed `step` on `input`.
fn os_error(step: &'static str, input: impl AsRef<Path>) -> JailError {
    JailError::step(step, input)(std::io::Error::last_os_error())
}

fn check(rc: libc::c_int, step: &'static str, input: impl AsRef<Path>) -> Result<(), JailError> {
    if rc < 0 {
        Err(os_error(step, input))
    } else {
        Ok(())
    }
}

/// A jail-relative path: only plain components (no `..`), made relative to the jail root.
fn jail_relative(path: &Path) -> Result<PathBuf, JailError> {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => out.push(name),
            _ => {
                return Err(usage(format!(
                    "jail path {}: only plain names, no ..",
                    path.display()
                )))
            }
        }
    }
    if out.as_os_str().is_empty() {
        return Err(usage(format!(
            "jail path {}: names nothing",
            path.display()
        )));
    }
    Ok(out)
}

/// Whether uid:gid may read (and, for a dir or `exec`, search/execute) `meta`'s file.
fn readable_by(meta: &std::fs::Metadata, uid: u32, gid: u32, exec: bool) -> bool {
    let mode = meta.mode();
    let need = 0o4 | if exec || meta.is_dir() { 0o1 } else { 0 };
    let bits = if meta.uid() == uid {
        mode >> 6
    } else if meta.gid() == gid {
        mode >> 3
    } else {
        mode
    };
    bits & need == need
}

/// Closes every inherited descriptor but stdin, stdout, stderr and `keep` (which must be open).
fn close_inherited(keep: &[i32]) -> Result<(), JailError> {
    let mut keep: Vec<libc::c_uint> = keep.iter().map(|&fd| fd as libc::c_uint).collect();
    keep.sort_unstable();
    keep.dedup();
    for &fd in &keep {
        // SAFETY: F_GETFD on a number; no memory is shared, and an unopened number answers
        // EBADF.
        if unsafe { libc::fcntl(fd as libc::c_int, libc::F_GETFD) } < 0 {
            return Err(usage(format!(
                "--keep-fd {fd}: not an open descriptor ({})",
                std::io::Error::last_os_error()
            )));
        }
    }
    let mut first: libc::c_uint = 3;
    for fd in keep.into_iter().chain([libc::c_uint::MAX]) {
        if fd > first {
            // SAFETY: closes descriptors only; nothing in this process uses one above 2 yet
            // but the kept ones, which the ranges skip.
            unsafe { libc::close_range(first, fd - 1, 0) };
        }
        first = fd.saturating_add(1);
    }
    Ok(())
}

fn run(args: Args) -> Result<i32, JailError> {
    close_inherited(&args.keep_fd)?;
    let id_ok = !args.id.is_empty()
        && args.id.len() <= 64
        && args
            .id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !id_ok {
        return Err(usage(format!(
            "--id {:?}: want 1 to 64 of A-Z a-z 0-9 - _",
            args.id
        )));
    }
    if args.uid == 0 || args.gid == 0 {
        return Err(usage(format!(
            "--uid {} --gid {}: the jail must not run as root",
            args.uid, args.gid
        )));
    }
    let exec_meta = std::fs::metadata(&args.exec).map_err(JailError::step("--exec", &args.exec))?;
    if !exec_meta.is_file() || !readable_by(&exec_meta, args.uid, args.gid, true) {
        return Err(usage(format!(
            "--exec {}: not a file that uid {} can read and execute",
            args.exec.display(),
            args.uid
        )));
    }
    let rlimits = args
        .rlimit
        .iter()
        .map(|text| {
            let bad = || {
                usage(format!(
                    "--rlimit {text:?}: want nofile=N, fsize=BYTES or memlock=BYTES"
                ))
            };
            let (name, value) = text.split_once('=').ok_or_else(bad)?;
            let value: u64 = value.parse().map_err(|_| bad())?;
            let resource = match name {
                "nofile" => libc::RLIMIT_NOFILE,
                "fsize" => libc::RLIMIT_FSIZE,
                "memlock" => libc::RLIMIT_MEMLOCK,
                _ => return Err(bad()),
            };
            Ok((resource, value, text.clone()))
        })
        .collect::<Result<Vec<_>, JailError>>()?;

    let base = &args.chroot_base;
    std::fs::create_dir_all(base).map_err(JailError::step("--chroot-base", base))?;
    let base = base
        .canonicalize()
        .map_err(JailError::step("--chroot-base", base))?;
    let root = base.join(&args.id);
    match std::fs::create_dir(&root) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(JailError::step("make jail directory", &root)(e));
        }
        _ => {}
    }
    if std::fs::symlink_metadata(&root)
        .map_err(JailError::step("jail directory", &root))?
        .is_symlink()
    {
        return Err(usage(format!(
            "jail directory {} is a symlink",
            root.display()
        )));
    }

    // What gets bind-mounted: the VMM binary, then each --bind-ro.
    let exec_name = args
        .exec
        .file_name()
        .ok_or_else(|| usage(format!("--exec {}: no file name", args.exec.display())))?;
    timing::step("checks");
    let mut binds = vec![(args.exec.clone(), PathBuf::from(exec_name), false)];
    // A dynamically linked VMM needs its loader and libraries, at the same paths.
    for library in rollbox_jailer::elf::shared_libraries(&args.exec)? {
        let jail = jail_relative(&library)?;
        binds.push((library, jail, false));
    }
    timing::step("libraries");
    for spec in &args.bind_ro {
        let (host, jail) = match spec.rsplit_once(':') {
            Some((host, jail)) => (PathBuf::from(host), jail_relative(Path::new(jail))?),
            None => {
                let host = PathBuf::from(spec);
                let name = host
                    .file_name()
                    .ok_or_else(|| usage(format!("--bind-ro {spec}: no file name")))?;
                (host.clone(), PathBuf::from(name))
            }
        };
        let meta = std::fs::metadata(&host).map_err(JailError::step("--bind-ro", &host))?;
        if !readable_by(&meta, args.uid, args.gid, false) {
            return Err(usage(format!(
                "--bind-ro {}: uid {} gid {} may not read it (mode {:o}, owner {}:{})",
                host.display(),
                args.uid,
                args.gid,
                meta.mode() & 0o7777,
                meta.uid(),
                meta.gid()
            )));
        }
        binds.push((host, jail, meta.is_dir()));
    }
    let vfio = vfio_devices(&args.vfio)?;
    for device in &vfio {
        binds.push((device.sysfs.clone(), device.jail_sysfs.clone(), true));
        binds.push((
            device.group_dir.clone(),
            device.jail_group_dir.clone(),
            true,
        ));
    }

    // The jail's directory and its files (not hard links shared with others) become the VM's.
    let owned = |path: &Path| -> Result<(), JailError> {
        let c = cpath(path)?;
        // SAFETY: lchown on a NUL-terminated path; it touches no memory of ours.
        let rc = unsafe { libc::lchown(c.as_ptr(), args.uid, args.gid) };
        check(rc, "chown", path)
    };
    owned(&root)?;
    for entry in std::fs::read_dir(&root)
        .map_err(JailError::step("read jail directory", &root))?
        .flatten()
    {
        if let Ok(meta) = entry.metadata() {
            if meta.is_file() && meta.nlink() == 1 {
                owned(&entry.path())?;
            }
        }
    }

    timing::step("jail directory");
    // Mount points that do not exist yet are made here and removed again at the end.
    let mut made: Vec<PathBuf> = Vec::new();
    let result = (|| {
        for (_, jail, is_dir) in &binds {
            make_mount_point(&root, jail, *is_dir, &mut made)?;
        }
        for dir in ["dev", "proc"] {
            make_mount_point(&root, Path::new(dir), true, &mut made)?;
        }
        let devices = DEVICES
            .iter()
            .chain(args.userfaultfd.then_some(&USERFAULTFD))
            .map(|(name, mode)| {
                (
                    Path::new("/dev").join(name),
                    Path::new("dev").join(name),
                    *mode,
                )
            })
            .filter(|(host, _, _)| host.exists())
            .chain(vfio_nodes(&vfio))
            .collect();
        let mut argv = vec![cstring(
            format!("/{}", exec_name.to_string_lossy()).as_bytes(),
            "--exec",
        )?];
        for arg in &args.vmm_args {
            argv.push(cstring(arg.as_bytes(), "a VMM argument")?);
        }
        let plan = Plan {
            root: root.clone(),
            uid: args.uid,
            gid: args.gid,
            hostname: args.id.clone(),
            binds: binds.clone(),
            devices,
            rlimits,
            exec_in_jail: cstring(
                Path::new("/").join(exec_name).as_os_str().as_bytes(),
                "--exec",
            )?,
            argv,
            keep_fds: args.keep_fd.clone(),
        };
        timing::step("mount points");
        let groups =
            JailGroups::create(&args.cgroup_fs, &args.cgroup_parent, &args.id, &args.cgroup)?;
        timing::step("cgroups");
        let status = start(&plan, &args, &groups);
        timing::step("jail ended");
        // The jail has ended (or never started): its groups go.
        for error in groups.remove() {
            eprintln!("rollbox-jailer: {error}");
        }
        timing::step("cgroups removed");
        status
    })();
    for path in made.iter().rev() {
        let _ = std::fs::remove_dir(path).or_else(|_| std::fs::remove_file(path));
    }
    timing::step("mount points removed");
    result
}

/// Makes `root/jail` (a dir or an empty file) when missing, recording what it made.
fn make_mount_point(
    root: &Path,
    jail: &Path,
    dir: bool,
    made: &mut Vec<PathBuf>,
) -> Result<(), JailError> {
    let mut at = root.to_path_buf();
    let parts: Vec<&OsStr> = jail.iter().collect();
    for (i, part) in parts.iter().enumerate() {
        at.push(part);
        let last = i + 1 == parts.len();
        match std::fs::symlink_metadata(&at) {
            Ok(meta) if meta.is_symlink() => {
                return Err(usage(format!("mount point {} is a symlink", at.display())));
            }
            Ok(_) => {}
            Err(_) if last && !dir => {
                std::fs::File::create(&at).map_err(JailError::step("make mount point", &at))?;
                made.push(at.clone());
            }
            Err(_) => {
                std::fs::create_dir(&at).map_err(JailError::step("make mount point", &at))?;
                made.push(at.clone());
                std::fs::set_permissions(
                    &at,
                    std::fs::Permissions::from_mode(MOUNT_POINT_DIR_MODE),
                )
                .map_err(JailError::step("chmod mount point", &at))?;
            }
        }
    }
    Ok(())
}

/// Forks PID 1 of the new namespaces and waits for it; SIGTERM, SIGINT and SIGHUP end it.
fn start(plan: &Plan, args: &Args, groups: &JailGroups) -> Result<i32, JailError> {
    let netns = args
        .netns
        .as_ref()
        .map(|path| {
            std::fs::File::open(path)
                .map_err(JailError::step("--netns", path))
                .map(|f| (f, path.clone()))
        })
        .transpose()?;
    // SAFETY: sigset operations on local sets; sigprocmask changes only this thread's mask.
    let (waited, old_mask) = unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGCHLD, libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, signal);
        }
        let mut old = std::mem::zeroed::<libc::sigset_t>();
        libc::sigprocmask(libc::SIG_BLOCK, &set, &mut old);
        (set, old)
    };
    // Only the PID namespace here (the child is its PID 1); the others in the child, so that
    // this process keeps the host's mounts for the clean-up.
    // SAFETY: unshare takes flags only.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWPID) };
    check(rc, "unshare the PID namespace for", &plan.root)?;
    // SAFETY: this process has a single thread, so the child may run any code.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(os_error("fork jail for", &plan.root));
    }
    if child == 0 {
        // PID 1 joins the groups (the jailer stays out of them, so it can remove them), before
        // it starts anything.
        timing::step("pid 1 forked");
        let code = match groups
            .enter_self()
            .inspect(|()| timing::step("pid 1 in cgroups"))
            .and_then(|()| enter_namespaces(plan, args.new_netns, netns.as_ref()))
            .inspect(|()| timing::step("namespaces"))
            .and_then(|()| jail_init(plan, &old_mask))
        {
            Ok(code) => code,
            Err(e) => {
                eprintln!("rollbox-jailer: {e}");
                1
            }
        };
        // SAFETY: ends this process without running the parent's exit handlers twice.
        unsafe { libc::_exit(code) };
    }
    plan.close_kept();
    loop {
        let mut info = std::mem::MaybeUninit::<libc::siginfo_t>::uninit();
        // SAFETY: waits for one of the blocked signals; `info` is written by the kernel.
        let signal = unsafe { libc::sigwaitinfo(&waited, info.as_mut_ptr()) };
        if signal == libc::SIGCHLD {
            let mut status = 0;
            // SAFETY: reaps our own child; `status` is a local.
            if unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } == child {
                return Ok(exit_code(status));
            }
        } else if signal > 0 {
            // SAFETY: signals our own child (PID 1 of the jail; the whole jail ends with it).
            unsafe { libc::kill(child, libc::SIGKILL) };
        }
    }
}

/// The child's own mount, IPC and UTS namespaces, and its network namespace.
fn enter_namespaces(
    plan: &Plan,
    new_netns: bool,
    netns: Option<&(std::fs::File, PathBuf)>,
) -> Result<(), JailError> {
    if let Some((file, path)) = netns {
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a descriptor we hold open; it touches no memory of ours.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        check(rc, "join network namespace", path)?;
    }
    let mut flags = libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
    if new_netns {
        flags |= libc::CLONE_NEWNET;
    }
    // SAFETY: unshare takes flags only.
    let rc = unsafe { libc::unshare(flags) };
    check(rc, "unshare namespaces for", &plan.root)
}

fn exit_code(status: libc::c_int) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

fn mount(
    source: &Path,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
    step: &'static str,
) -> Result<(), JailError> {
    let source_c = cpath(source)?;
    let target_c = cpath(target)?;
    let fstype_c = fstype
        .map(|f| cstring(f.as_bytes(), "fstype"))
        .transpose()?;
    let data_c = data
        .map(|d| cstring(d.as_bytes(), "mount data"))
        .transpose()?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call, or null.
    let rc = unsafe {
        libc::mount(
            source_c.as_ptr(),
            target_c.as_ptr(),
            fstype_c.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            data_c
                .as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    check(rc, step, target)
}

/// PID 1 of the jail: builds its mount tree, pivots into it, starts the VMM and reaps until the
/// VMM ends; returns the VMM's exit code.
fn jail_init(plan: &Plan, old_mask: &libc::sigset_t) -> Result<i32, JailError> {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let root = &plan.root;
    let none = Path::new("none");
    mount(
        none,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
        "make mounts private",
    )?;
    mount(root, root, None, libc::MS_BIND, None, "bind jail root")?;
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV;
    // Nothing the VMM writes into its root runs, is setuid or is a device; what is bound into
    // it (the VMM, its libraries) are mounts of their own.
    mount(
        none,
        root,
        None,
        libc::MS_REMOUNT | libc::MS_BIND | nosuid | libc::MS_NOEXEC,
        None,
        "make the jail root nosuid,nodev,noexec",
    )?;
    for (host, jail, is_dir) in &plan.binds {
        let target = root.join(jail);
        let recursive = if *is_dir { libc::MS_REC } else { 0 };
        mount(
            host,
            &target,
            None,
            libc::MS_BIND | recursive,
            None,
            "bind-mount into jail",
        )?;
        let flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | nosuid;
        mount(none, &target, None, flags, None, "make read-only")?;
    }
    let dev = root.join("dev");
    // Not nodev: its device nodes must work.
    let dev_flags = libc::MS_NOSUID | libc::MS_NOEXEC;
    mount(
        Path::new("tmpfs"),
        &dev,
        Some("tmpfs"),
        dev_flags,
        Some("mode=755"),
        "mount jail /dev",
    )?;
    for dir in ["net", "shm", "vfio"] {
        let path = dev.join(dir);
        std::fs::create_dir(&path).map_err(JailError::step("mkdir", &path))?;
        // The jail's uid passes through to the nodes (the jailer's umask would leave 0700).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(JailError::step("chmod", &path))?;
    }
    let shm = dev.join("shm");
    std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o1777))
        .map_err(JailError::step("chmod", &shm))?;
    for (host, node, mode) in &plan.devices {
        let rdev = std::fs::metadata(host)
            .map_err(JailError::step("stat device", host))?
            .rdev();
        let path = root.join(node);
        let c = cpath(&path)?;
        // SAFETY: mknod and chown on a NUL-terminated path; no memory of ours is touched.
        unsafe {
            check(
                libc::mknod(c.as_ptr(), libc::S_IFCHR | mode, rdev),
                "mknod",
                &path,
            )?;
            check(libc::chown(c.as_ptr(), plan.uid, plan.gid), "chown", &path)?;
            check(libc::chmod(c.as_ptr(), *mode), "chmod", &path)?;
        }
    }
    let proc_dir = root.join("proc");
    mount(
        Path::new("proc"),
        &proc_dir,
        Some("proc"),
        nosuid | libc::MS_NOEXEC,
        None,
        "mount jail /proc",
    )?;
    timing::step("mounts and devices");
    std::env::set_current_dir(root).map_err(JailError::step("chdir", root))?;
    let dot = cpath(Path::new("."))?;
    // SAFETY: pivot_root(".", ".") stacks the old root under the new one; both are paths.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    check(rc as libc::c_int, "pivot_root into", root)?;
    // SAFETY: detaches the old root (stacked on "."), leaving only the jail's tree.
    let rc = unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) };
    check(rc, "detach the host root from", root)?;
    std::env::set_current_dir("/").map_err(JailError::step("chdir", "/"))?;
    let name = plan.hostname.as_bytes();
    // SAFETY: the pointer and length describe `name`.
    let rc = unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
    check(rc, "sethostname", &plan.hostname)?;
    timing::step("pivot_root");

    // SAFETY: PID 1 is single-threaded, so the child may run any code.
    let vmm = unsafe { libc::fork() };
    if vmm < 0 {
        return Err(os_error("fork the VMM in", root));
    }
    if vmm == 0 {
        let error = exec_vmm(plan, old_mask);
        eprintln!("rollbox-jailer: {error}");
        // SAFETY: ends the failed child at once.
        unsafe { libc::_exit(127) };
    }
    plan.close_kept();
    drop_privileges(plan)?;
    // A change of credentials clears the parent-death signal: armed again.
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    loop {
        let mut status = 0;
        // SAFETY: reaps any child of PID 1 (the VMM, or an orphan of it); `status` is a local.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid == vmm {
            return Ok(exit_code(status));
        }
        if pid < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Err(os_error("wait for the VMM in", root));
        }
    }
}

/// Drops to uid:gid with no supplementary groups, no capabilities (bounding set included)
/// and no-new-privs.
fn drop_privileges(plan: &Plan) -> Result<(), JailError> {
    for cap in 0..64 {
        // SAFETY: prctl with integer arguments; EINVAL past the last capability ends the loop.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
                break;
            }
            return Err(os_error(
                "drop capability bounding set",
                format!("cap {cap}"),
            ));
        }
    }
    let who = format!("{}:{}", plan.uid, plan.gid);
    // SAFETY: plain system calls with integer arguments (setgroups with an empty list).
    unsafe {
        check(libc::setgroups(0, std::ptr::null()), "setgroups", &who)?;
        check(
            libc::setresgid(plan.gid, plan.gid, plan.gid),
            "setresgid",
            &who,
        )?;
        check(
            libc::setresuid(plan.uid, plan.uid, plan.uid),
            "setresuid",
            &who,
        )?;
        check(
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL,
                0,
                0,
                0,
            ),
            "clear ambient capabilities",
            &who,
        )?;
        check(
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
            "set no-new-privs",
            &who,
        )?;
    }
    Ok(())
}

/// The VMM's process: rlimits, privileges dropped, the original signal mask, then exec.
fn exec_vmm(plan: &Plan, old_mask: &libc::sigset_t) -> JailError {
    for (resource, value, text) in &plan.rlimits {
        let limit = libc::rlimit {
            rlim_cur: *value,
            rlim_max: *value,
        };
        // SAFETY: `limit` is a local that outlives the call.
        if unsafe { libc::setrlimit(*resource, &limit) } < 0 {
            return os_error("setrlimit", text);
        }
    }
    if let Err(e) = drop_privileges(plan) {
        return e;
    }
    // What the VMM creates (sockets, console, snapshots) is its uid's alone.
    // SAFETY: umask sets this process's file mode mask; it cannot fail.
    unsafe { libc::umask(0o077) };
    // SAFETY: restores the mask the jailer started with; `old_mask` is valid.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, old_mask, std::ptr::null_mut()) };
    timing::step("vmm process: rlimits and privileges");
    let mut argv: Vec<*const libc::c_char> = plan.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // SAFETY: a NUL-terminated path and a null-terminated array of NUL-terminated strings,
    // all alive until execv replaces the process (or fails).
    unsafe { libc::execv(plan.exec_in_jail.as_ptr(), argv.as_ptr()) };
    os_error(
        "exec",
        Path::new(OsStr::from_bytes(plan.exec_in_jail.as_bytes())),
    )
}
