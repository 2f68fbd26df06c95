//! `rollbox-vmm`: one process per microVM, configured by flags, a JSON file or its API socket.
//! Here: the process (signals, logging, seccomp) and which mode it runs in (boot, restore,
//! fork shell); the command line is `cli/`.

mod cli;

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, OnceLock};

use clap::Parser;
use vmm::controller::{Controller, StopSignal};
use vmm::fork::{CloneGuard, ShellControl};
use vmm::vmm_config::{MachineConfig, VmResources};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use cli::{resources_from, restore_options, Args};

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
fn enable_fork(
    controller: &mut Controller,
    pool: usize,
    console_max_bytes: Option<u64>,
) -> Result<(), String> {
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
        .enable_fork(exe, pool, console_max_bytes)
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
    let machine = MachineConfig {
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
    enable_fork(&mut controller, 0, args.console_max_bytes)?;
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
    enable_fork(&mut controller, args.fork_pool, args.console_max_bytes)?;
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
        let machine = MachineConfig {
            vcpu_count: args.shell_vcpus,
            mem_size_mib,
            track_dirty_pages,
            ..Default::default()
        };
        controller.prebuild_shell(&machine).map_err(|e| e.message)?;
    }
    enable_fork(&mut controller, args.fork_pool, args.console_max_bytes)?;
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
