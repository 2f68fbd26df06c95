//! `rollbox-vmm`: one process per microVM, configured by flags, a JSON file or its API socket.
//! Here: the process (signals, logging, seccomp) and which mode it runs in (boot or
//! restore); the command line is `cli/`.

mod cli;

use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, OnceLock};

use clap::Parser;
use vmm::controller::{Controller, StopSignal};
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
/// clean up; then unblocks them, should the process have been started with them blocked.
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

/// Reads the process-wide block I/O setting into `controller`.
fn set_block_io_threads(controller: &mut Controller) -> Result<(), String> {
    // ROLLBOX_BLOCK_IO_THREADS=0 serves block queues on the event loop: the nested lab sets
    // it, as QEMU 7.2's TCG crashes L1 with the worker threads.
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
    Ok(())
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
    set_block_io_threads(&mut controller)?;
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

fn run(args: Args) -> Result<i32, String> {
    install_signal_handlers();
    let level = vmm::logger::parse_level(&args.level).map_err(|e| e.to_string())?;
    vmm::logger::init(args.log_path.as_deref(), level).map_err(|e| e.to_string())?;
    // Before any thread starts: the spawner must be created unfiltered.
    vmm::seccomp::configure(&seccomp_mode(&args), vmm::logger::file_fd())
        .map_err(|e| e.to_string())?;
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
    set_block_io_threads(&mut controller)?;
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
