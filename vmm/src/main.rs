//! `rollbox-vmm`: one process per microVM, configured by flags, a JSON file or its API socket.

use std::collections::HashMap;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, OnceLock};

use clap::Parser;
use vmm::config::{
    host_memory_mib, load_config_file, parse_drive_flag, parse_fs_flag, parse_net_flag,
    BootSourceConfig, ConsoleConfig, Validate, ValidateMachine, VmResources, VsockConfig,
};
use vmm::controller::{Controller, StopSignal};
use vmm::fork::{CloneGuard, ShellControl};
use vmm::persist::{RestoreBackend, RestoreOptions};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// A KVM microVM manager. Give a kernel to boot at once, or an API socket to configure the
/// microVM over Firecracker's REST API.
#[derive(Parser, Debug)]
#[command(name = "rollbox-vmm", version)]
struct Args {
    /// Kernel: ELF vmlinux or bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initial ramdisk.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (rollbox-vmm appends its device arguments).
    #[arg(long)]
    cmdline: Option<String>,
    /// Guest memory in MiB [default: 128].
    #[arg(long)]
    memory_mib: Option<u64>,
    /// Number of vCPUs [default: 1].
    #[arg(long)]
    vcpus: Option<u64>,
    /// A raw disk image: PATH[,readonly][,root][,id=NAME]; repeat for more drives.
    #[arg(long = "drive")]
    drives: Vec<String>,
    /// A network interface on a host tap: TAP[,mac=MAC][,id=NAME]; repeat for more.
    #[arg(long = "net", conflicts_with = "restore")]
    nets: Vec<String>,
    /// With --restore: put an interface on another tap (and give it a new MAC), as
    /// ID=TAP[,mac=MAC].
    #[arg(long = "net-override", requires = "restore")]
    net_overrides: Vec<String>,
    /// Host side of virtio-vsock: a Unix socket path (with --restore: the clone's new socket).
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    /// The guest's vsock CID (3 or more).
    #[arg(long, requires = "vsock_uds")]
    vsock_cid: Option<u64>,
    /// A shared host directory over virtio-fs (rollbox extension):
    /// TAG=HOST_DIR[,readonly][,cache=auto|always|never][,socket=PATH]; repeat for more. The
    /// guest mounts it with `mount -t virtiofs TAG DIR`.
    #[arg(long = "fs")]
    fs: Vec<String>,
    /// The virtiofsd binary for --fs volumes [default: $ROLLBOX_VIRTIOFSD, else virtiofsd on
    /// PATH, /usr/libexec/virtiofsd, or the cache of scripts/virtiofsd.sh].
    #[arg(long)]
    virtiofsd: Option<PathBuf>,
    /// Track dirty pages, so that Diff snapshots can be taken.
    #[arg(long)]
    track_dirty_pages: bool,
    /// A deterministic machine (CPUID without RDRAND/RDSEED); with --restore: a deterministic
    /// reset (guest time and generation exactly as in the snapshot, no wall-clock update).
    #[arg(long, conflicts_with = "new_generation")]
    deterministic: bool,
    /// A PCI root bus (rollbox extension): CF8/CFC and ECAM, with ACPI's MCFG and PCI0.
    #[arg(long, conflicts_with = "restore")]
    pci: bool,
    /// Pass a host PCI device bound to vfio-pci through to the guest (rollbox extension):
    /// /sys/bus/pci/devices/DDDD:BB:DD.F; repeat for more. Implies --pci.
    #[arg(long = "vfio", conflicts_with = "restore")]
    vfio: Vec<PathBuf>,
    /// Restore a snapshot instead of booting: a directory with `vmstate` and `memory`, or a
    /// state file.
    #[arg(long, conflicts_with_all = ["kernel", "config", "vcpus", "cmdline", "initrd", "fs"])]
    restore: Option<PathBuf>,
    /// With --restore: cow (map the memory file copy-on-write), uffd (lazy, in-VMM page
    /// server) or copy (eager).
    #[arg(long, default_value = "cow", requires = "restore")]
    restore_backend: String,
    /// With --restore and uffd: prefetch the working set recorded by an earlier restore.
    #[arg(long, requires = "restore")]
    prefetch: bool,
    /// With --restore and uffd: record the pages the guest touches (`<memory>.ws`).
    #[arg(long, requires = "restore")]
    record_working_set: bool,
    /// With --restore: tell the guest it is a clone (new generation counter value).
    #[arg(long, requires = "restore")]
    new_generation: bool,
    /// With --restore: serve a volume from another host directory, as TAG=DIR.
    #[arg(long = "fs-override", requires = "restore")]
    fs_overrides: Vec<String>,
    /// With --restore: use another image for a drive, as ID=PATH.
    #[arg(long = "drive-override", requires = "restore")]
    drive_overrides: Vec<String>,
    /// With --restore: read a memory layer from another file, as INDEX=PATH (0 is the full
    /// base, then the diffs in order).
    #[arg(long = "layer-override", requires = "restore")]
    layer_overrides: Vec<String>,
    /// With --restore: start paused.
    #[arg(long, requires = "restore")]
    paused: bool,
    /// With --api-sock and no kernel: pre-build an empty VM with this much memory, so that a
    /// `PUT /snapshot/load` of that shape skips KVM set-up (rollbox extension).
    #[arg(long, requires = "api_sock", conflicts_with_all = ["kernel", "restore"])]
    shell_memory_mib: Option<u64>,
    /// vCPUs of the pre-built VM.
    #[arg(long, default_value_t = 1, requires = "shell_memory_mib")]
    shell_vcpus: u64,
    /// Keep this many clone processes with empty VMs ready (at most 64), so `POST /fork` only
    /// snapshots and loads (rollbox extension; the pool refills to this size after each fork).
    /// Without it, each fork starts exactly the clones it asks for.
    #[arg(long, default_value_t = 0)]
    fork_pool: usize,
    /// Internal: run as a fork's clone shell, driven over this inherited control socket.
    #[arg(long, hide = true, requires_all = ["shell_memory_mib", "fork_shell_dir"])]
    fork_shell_fd: Option<RawFd>,
    /// Internal: the clone shell's own directory, removed if it ends before its load.
    #[arg(long, hide = true, requires = "fork_shell_fd")]
    fork_shell_dir: Option<PathBuf>,
    /// Guest console: `stdout` or a file path [default: stdout].
    #[arg(long)]
    console: Option<String>,
    /// Serve the control API on this Unix socket.
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// A Firecracker-style JSON configuration file.
    #[arg(long = "config", alias = "config-file")]
    config: Option<PathBuf>,
    /// Write log lines to this file instead of stderr.
    #[arg(long)]
    log_path: Option<PathBuf>,
    /// Log level: Error, Warning, Info, Debug, Trace or Off.
    #[arg(long, default_value = "Warning")]
    level: String,
    /// Run without seccomp filters (by default each thread kind has its own allow-list).
    #[arg(long)]
    no_seccomp: bool,
    /// Use these seccomp filters instead of the built-in ones: Firecracker's JSON format, one
    /// filter per thread kind (vmm, api, vcpu, block, page_server).
    #[arg(long, value_name = "FILE", conflicts_with = "no_seccomp")]
    seccomp_filter: Option<PathBuf>,
    /// Print how many syscalls the built-in filters allow per thread kind, and which; then exit.
    #[arg(long)]
    print_seccomp_summary: bool,
}

fn seccomp_mode(args: &Args) -> vmm::seccomp::Mode {
    match (&args.seccomp_filter, args.no_seccomp) {
        (Some(path), _) => vmm::seccomp::Mode::File(path.clone()),
        (None, true) => vmm::seccomp::Mode::Off,
        (None, false) => vmm::seccomp::Mode::BuiltIn,
    }
}

/// Installs the main thread's filter and runs the event loop.
fn run_filtered(controller: &mut Controller) -> Result<i32, String> {
    vmm::seccomp::apply(vmm::seccomp::ThreadKind::Vmm);
    controller.run().map_err(|e| e.to_string())
}

fn resources_from(args: &Args) -> Result<VmResources, String> {
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
    for flag in &args.fs {
        let fs = parse_fs_flag(flag).map_err(|e| e.to_string())?;
        resources.add_fs(fs).map_err(|e| e.to_string())?;
    }
    Ok(resources)
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

fn restore_options(args: &Args) -> Result<RestoreOptions, String> {
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
    let fs_overrides = overrides("--fs-override", "TAG=DIR", &args.fs_overrides)?
        .map(|(tag, dir)| (tag, PathBuf::from(dir)))
        .collect();
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
            .unwrap_or_default(),
        record_working_set: args.record_working_set,
        prefetch: args.prefetch,
        expect_mem_mib: args.memory_mib,
        track_dirty_pages: args.track_dirty_pages.then_some(true),
    })
}

/// The controller that SIGTERM, SIGINT and SIGHUP stop (process-wide, so set here only).
static STOP: OnceLock<Arc<StopSignal>> = OnceLock::new();
/// A termination signal that came before the controller existed.
static EARLY_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_terminate(num: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    match STOP.get() {
        Some(stop) => stop.raise(num),
        None => EARLY_SIGNAL.store(num, Ordering::SeqCst),
    }
}

/// Catches termination signals from the start, so that none ends the process before it can
/// clean up; then takes the ones a fork's shell is started with blocked (its parent-death
/// signal, held pending until now).
fn install_signal_handlers() {
    const SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];
    for signal in SIGNALS {
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(signal, on_terminate) {
            log::warn!("cannot handle signal {signal}: {e}");
        }
    }
    // SAFETY: builds a signal set on the stack and unblocks it for this (the only) thread.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for signal in SIGNALS {
            libc::sigaddset(&mut set, signal);
        }
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
}

/// Makes termination signals stop `controller`'s event loop (so the VMM cleans up).
fn handle_signals(controller: &Controller) {
    let stop = controller.stop_signal();
    if STOP.set(Arc::clone(&stop)).is_err() {
        log::warn!("signal handlers are already set for another controller");
        return;
    }
    let early = EARLY_SIGNAL.load(Ordering::SeqCst);
    if early != 0 {
        stop.raise(early);
    }
}

/// Lets `controller` fork (clones re-run this binary) and reads the process-wide block I/O
/// setting.
fn enable_fork(controller: &mut Controller, pool: usize) -> Result<(), String> {
    // ROLLBOX_BLOCK_IO_THREADS=0 serves block queues on the event loop (clones inherit it):
    // the nested lab sets it, as QEMU 7.2's TCG crashes L1 with the worker threads.
    let threads = match std::env::var_os("ROLLBOX_BLOCK_IO_THREADS") {
        None => true,
        Some(v) if v == "1" => true,
        Some(v) if v == "0" => false,
        Some(v) => {
            return Err(format!(
                "ROLLBOX_BLOCK_IO_THREADS must be 0 or 1, not {:?}",
                v.to_string_lossy()
            ))
        }
    };
    controller.set_block_io_threads(threads);
    let exe = std::env::current_exe().map_err(|e| format!("cannot find rollbox-vmm: {e}"))?;
    controller
        .enable_fork(exe, pool)
        .map_err(|e| format!("--fork-pool: {e}"))
}

/// A fork's clone: builds an empty VM, loads the snapshot its parent sends over `fd`, and
/// once the parent detaches it runs on its own (its parent-death signal cleared).
fn run_fork_shell(args: &Args, fd: RawFd) -> Result<i32, String> {
    // SAFETY: `--fork-shell-fd` names the control socket the parent left open for this
    // process alone; nothing else here owns or closes it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let own_dir = args.fork_shell_dir.clone().unwrap_or_default();
    let mut control = ShellControl::new(stream, &own_dir);
    let resources = resources_from(args).inspect_err(|_| control.abandon())?;
    let api_evt = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| format!("eventfd: {e}"))?);
    let (api_tx, api_rx) = channel();
    let machine = vmm::config::MachineConfig {
        vcpu_count: args.shell_vcpus,
        mem_size_mib: args.shell_memory_mib.unwrap_or_default(),
        track_dirty_pages: args.track_dirty_pages,
        ..Default::default()
    };
    let mut controller = Controller::new(resources, Some(api_rx), Arc::clone(&api_evt))
        .map_err(|e| e.to_string())?;
    handle_signals(&controller);
    if let Err(e) = controller.prebuild_shell(&machine) {
        // The parent reads the answer and removes this shell's files.
        let _ = control.answer(&Err(e.message.clone()));
        return Err(e.message);
    }
    let load = match control.ready().and_then(|()| control.receive_load()) {
        Ok(Some(load)) => load,
        // The pool shut down or the parent ended (the shell's files are gone already).
        Ok(None) => return Ok(0),
        Err(e) => {
            control.abandon();
            return Err(format!("control socket: {e}"));
        }
    };
    let _guard = CloneGuard::new(load.cleanup.clone());
    let loaded = controller
        .handle(vmm::api::VmmAction::LoadSnapshot(load.load))
        .map(|_| ())
        .map_err(|e| e.message);
    control
        .answer(&loaded)
        .map_err(|e| format!("control socket: {e}"))?;
    loaded?;
    enable_fork(&mut controller, 0)?;
    let _api_guard = match &args.api_sock {
        Some(sock) => {
            Some(vmm::api::server::start(sock, api_tx, api_evt).map_err(|e| e.to_string())?)
        }
        None => None,
    };
    controller
        .watch_fork_control(
            control,
            Box::new(|| {
                // SAFETY: prctl with plain integer arguments; clears this thread's
                // parent-death signal (the main thread's, which the launcher armed).
                if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0) } != 0 {
                    log::warn!(
                        "cannot clear the parent-death signal: {}",
                        std::io::Error::last_os_error()
                    );
                }
            }),
        )
        .map_err(|e| e.to_string())?;
    let code = run_filtered(&mut controller)?;
    drop(controller);
    Ok(code)
}

fn run_restore(args: &Args, path: &std::path::Path) -> Result<i32, String> {
    let options = restore_options(args)?;
    let state = vmm::persist::state_path_of(path).map_err(|e| e.to_string())?;
    let api_evt = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| format!("eventfd: {e}"))?);
    let (api_tx, api_rx) = channel();
    let mut controller =
        Controller::new(VmResources::default(), Some(api_rx), Arc::clone(&api_evt))
            .map_err(|e| e.to_string())?;
    handle_signals(&controller);
    enable_fork(&mut controller, args.fork_pool)?;
    controller
        .restore(&state, &options)
        .map_err(|e| e.message)?;
    // The API socket appears only once the restore is done, so its existence means "ready".
    let _api_guard = match &args.api_sock {
        Some(sock) => {
            Some(vmm::api::server::start(sock, api_tx, api_evt).map_err(|e| e.to_string())?)
        }
        None => None,
    };
    let code = run_filtered(&mut controller)?;
    drop(controller);
    Ok(code)
}

/// A fork shell's own directory: created here, with stderr redirected into its stderr.log.
fn take_shell_dir(dir: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let path = dir.join("stderr.log");
    let stderr = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: dup2 of a descriptor this function owns onto stderr; `stderr` stays valid for
    // the call and is closed after it, leaving fd 2 open.
    if unsafe {
        libc::dup2(
            std::os::fd::AsRawFd::as_raw_fd(&stderr),
            libc::STDERR_FILENO,
        )
    } < 0
    {
        return Err(format!(
            "{}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn run(args: Args) -> Result<i32, String> {
    install_signal_handlers();
    if let Some(dir) = &args.fork_shell_dir {
        take_shell_dir(dir)?;
    }
    let level = vmm::logger::parse_level(&args.level).map_err(|e| e.to_string())?;
    vmm::logger::init(args.log_path.as_deref(), level).map_err(|e| e.to_string())?;
    // Before any thread starts: the spawner must be created unfiltered.
    vmm::seccomp::configure(&seccomp_mode(&args), vmm::logger::file_fd())
        .map_err(|e| e.to_string())?;
    if let Some(fd) = args.fork_shell_fd {
        return run_fork_shell(&args, fd);
    }
    if let Some(path) = args.restore.clone() {
        return run_restore(&args, &path);
    }
    let resources = resources_from(&args)?;
    let boot_now = resources.boot_source.is_some();
    if !boot_now && args.api_sock.is_none() {
        return Err("nothing to do: give --kernel (or --config with a boot-source) to boot now, or --api-sock to configure over the API".into());
    }
    let api_evt = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| format!("eventfd: {e}"))?);
    let (api_tx, api_rx) = channel();
    let _api_guard = match &args.api_sock {
        Some(path) => Some(
            vmm::api::server::start(path, api_tx, Arc::clone(&api_evt))
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let track_dirty_pages = resources.machine.track_dirty_pages;
    let mut controller =
        Controller::new(resources, Some(api_rx), api_evt).map_err(|e| e.to_string())?;
    handle_signals(&controller);
    if let Some(mem_size_mib) = args.shell_memory_mib {
        let machine = vmm::config::MachineConfig {
            vcpu_count: args.shell_vcpus,
            mem_size_mib,
            track_dirty_pages,
            ..Default::default()
        };
        controller.prebuild_shell(&machine).map_err(|e| e.message)?;
    }
    enable_fork(&mut controller, args.fork_pool)?;
    if boot_now {
        controller.start().map_err(|e| e.message)?;
    }
    let code = run_filtered(&mut controller)?;
    drop(controller);
    Ok(code)
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.print_seccomp_summary {
        return match vmm::seccomp::print_summary(&mut std::io::stdout()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rollbox-vmm: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let result = run(args);
    let dropped = vmm::logger::dropped_lines();
    if dropped > 0 {
        eprintln!("rollbox-vmm: {dropped} log lines were dropped by the rate limit");
    }
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(message) => {
            eprintln!("rollbox-vmm: error: {message}");
            ExitCode::FAILURE
        }
    }
}
