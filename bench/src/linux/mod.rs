//! `rollbox-bench linux`: Linux guests on real KVM (the nested lab, `scripts/lab/bench-linux.sh`).
//!
//! 1. Boot of one vmlinux and one initramfs (busybox + the static agent) under rollbox-vmm and
//!    under QEMU's `-M microvm`, alternating round by round: from VMM process start to the first
//!    kernel console line, to `/init` running, and to the agent answering `hello`.
//! 2. Restore of a booted Linux guest (busybox rootfs, agent as init) until the agent answers,
//!    beside rollbox-vmm's own cold boot of the same VM.
//!
//! Console bytes are stamped as they arrive on the VMM's stdout pipe.

mod agent;
mod boot;
mod initramfs;
mod report;
mod restore;
mod vm;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Serialize;

use crate::stats::{summarize, Summary};

pub(crate) use agent::{
    connect_agent_port, read_frame, set_timeval, unix_connect, vsock_connect, AgentAddr,
};
pub(crate) use boot::{qemu_args, rollbox_boot_args};
pub(crate) use initramfs::{build_initramfs, must_exist, WorkDir};
pub use report::markdown;
pub(crate) use report::{cell, ratio};
pub(crate) use vm::VmProcess;

use boot::{run_boot, BootReport};
use initramfs::fixture;
use restore::{run_restore, RestoreReport};

/// What the initramfs's `/init` prints first.
pub const INIT_MARKER: &str = "rollbox-bench: /init running";
/// The agent's log line once its vsock listener is bound (on the console: its stderr).
pub(crate) const AGENT_LISTENING: &str = "listening on vsock port";
pub(crate) const AGENT_PORT: u32 = rollbox_agent_protocol::DEFAULT_PORT;
/// rollbox-vmm's guest CID (its host side is a Unix socket, so any CID >= 3 does).
pub(crate) const ROLLBOX_CID: u32 = 3;
/// One connection attempt (connect, handshake, hello) at most.
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// SIGTERM, then SIGKILL after this.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// A long wait says so this often (on stderr), so a stuck run shows where it stands.
const NOTE_EVERY: Duration = Duration::from_secs(30);

/// Errors that stop the benchmark (never a slow figure).
#[derive(Debug, thiserror::Error)]
pub enum LinuxBenchError {
    #[error("{what} not found at {path} ({hint})")]
    Missing {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("reading fixtures file {path}: {source}")]
    Fixtures {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fixtures file {path} has no {key}= line (scripts/lab/tier4-fixtures.sh writes it)")]
    FixtureKey { path: PathBuf, key: &'static str },
    #[error("no {what}: pass {flag} or --fixtures FILE")]
    NoPath {
        what: &'static str,
        flag: &'static str,
    },
    #[error("{0}")]
    Host(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    #[error("{vm}: {what} did not come within {timeout:?}; last console lines:\n{console}\nstderr: {stderr}")]
    Timeout {
        vm: String,
        what: String,
        timeout: Duration,
        console: String,
        stderr: String,
    },
    #[error("{vm} exited ({status}) while waiting for {what}; last console lines:\n{console}\nstderr: {stderr}")]
    Exited {
        vm: String,
        what: String,
        status: String,
        console: String,
        stderr: String,
    },
    #[error("{vm}: the console never showed {what} before the agent answered")]
    NoMilestone { vm: String, what: &'static str },
    /// An API call failed (the error names the socket and the call).
    #[error(transparent)]
    Api(#[from] vmm_api::ClientError),
    #[error("{what}: no samples")]
    NoSamples { what: &'static str },
    #[error("{vm}: guest command `{script}`: {detail}")]
    Guest {
        vm: String,
        script: String,
        detail: String,
    },
    #[error("host command `{command}`: {detail}")]
    HostCommand { command: String, detail: String },
    #[error("interrupted by a signal; every VMM stopped")]
    Interrupted,
}

/// Set by SIGINT, SIGTERM or SIGHUP; the waits then end through the error path.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// A signal ends the run through the normal error path, so the guards stop every VMM and
/// remove the work directory.
pub(crate) fn catch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, note_signal as *const () as libc::sighandler_t) };
    }
}

/// The two parts of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// Linux boot under rollbox-vmm and QEMU microvm.
    Boot,
    /// Restore until the agent answers, beside a cold boot.
    Restore,
}

/// Settings; paths are checked by [`run`].
#[derive(Debug, Clone)]
pub struct LinuxBenchConfig {
    pub vmm: PathBuf,
    pub qemu: PathBuf,
    /// The QEMU machine, with its options (`-M`).
    pub qemu_machine: String,
    pub fixtures: Option<PathBuf>,
    pub kernel: Option<PathBuf>,
    pub rootfs: Option<PathBuf>,
    pub agent: PathBuf,
    pub busybox: PathBuf,
    pub rounds: usize,
    pub warmup: usize,
    pub memory_mib: u64,
    pub vcpus: u32,
    /// The command line both VMMs get (each appends its own device arguments).
    pub cmdline: String,
    /// Appended to QEMU's command line only: what rollbox-vmm appends by itself.
    pub qemu_append: String,
    pub qemu_cid: u32,
    pub parts: Vec<Part>,
    /// Parent of the work directory (removed at the end).
    pub dir: PathBuf,
    pub boot_timeout: Duration,
    /// Write every console transcript (host ms, line) here.
    pub keep_consoles: Option<PathBuf>,
}

/// Everything, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct LinuxReport {
    pub kernel: String,
    pub rootfs: Option<String>,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub rounds: usize,
    pub warmup: usize,
    pub cmdline: String,
    pub boot: Option<BootReport>,
    pub restore: Option<RestoreReport>,
}

pub(crate) fn io_err(
    what: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> LinuxBenchError {
    let path = path.to_path_buf();
    move |source| LinuxBenchError::Io { what, path, source }
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn summary(what: &'static str, values: &[f64]) -> Result<Summary, LinuxBenchError> {
    summarize(values).ok_or(LinuxBenchError::NoSamples { what })
}

/// Refuses hosts whose /dev/kvm cannot run Linux, with one line saying why.
pub(crate) fn check_kvm() -> Result<(), LinuxBenchError> {
    if !Path::new("/dev/kvm").exists() {
        return Err(LinuxBenchError::Host(
            "/dev/kvm is missing; run this inside the nested lab (scripts/lab/bench-linux.sh)"
                .into(),
        ));
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Err(LinuxBenchError::Host(
            "this /dev/kvm is PVM, which cannot run Linux guests (see ../shared/docs/kvm-here.md); \
             run this inside the nested lab (scripts/lab/bench-linux.sh)"
                .into(),
        ));
    }
    Ok(())
}

/// The guest kernel (from `--kernel` or the fixtures), checked like rollbox-vmm.
pub(crate) fn kernel_and_vmm(config: &LinuxBenchConfig) -> Result<PathBuf, LinuxBenchError> {
    let kernel = fixture(
        config,
        &config.kernel,
        "OUR_VMLINUX",
        "guest kernel",
        "--kernel",
    )?;
    must_exist(
        "guest kernel (vmlinux)",
        &kernel,
        "kernel-config/build.sh builds it; rebuild the fixtures with scripts/lab/tier4-fixtures.sh",
    )?;
    must_exist(
        "rollbox-vmm",
        &config.vmm,
        "cargo build --release -p vmm, or pass --vmm PATH",
    )?;
    Ok(kernel)
}

/// The static agent and busybox that [`build_initramfs`] packs.
pub(crate) fn initramfs_inputs_exist(config: &LinuxBenchConfig) -> Result<(), LinuxBenchError> {
    must_exist(
        "static rollbox-agent",
        &config.agent,
        "guest-agent/build-static.sh builds it, or pass --agent PATH",
    )?;
    must_exist(
        "static busybox",
        &config.busybox,
        "apt-get install busybox-static, or pass --busybox PATH",
    )
}

/// Runs the parts `config.parts` asks for.
pub fn run(config: &LinuxBenchConfig) -> Result<LinuxReport, LinuxBenchError> {
    let kernel = kernel_and_vmm(config)?;
    let boot = config.parts.contains(&Part::Boot);
    let restore = config.parts.contains(&Part::Restore);
    if boot {
        initramfs_inputs_exist(config)?;
    }
    let rootfs = if restore {
        let path = fixture(
            config,
            &config.rootfs,
            "BUSYBOX_ROOTFS",
            "busybox rootfs",
            "--rootfs",
        )?;
        must_exist(
            "busybox rootfs",
            &path,
            "scripts/lab/tier4-fixtures.sh builds it, or pass --rootfs PATH",
        )?;
        Some(path)
    } else {
        None
    };
    check_kvm()?;
    catch_signals();
    let work = WorkDir::create(&config.dir)?;
    let boot_report = if boot {
        Some(run_boot(config, &kernel, &work.0)?)
    } else {
        None
    };
    let restore_report = match &rootfs {
        Some(rootfs) => Some(run_restore(config, &kernel, rootfs, &work.0)?),
        None => None,
    };
    Ok(LinuxReport {
        kernel: kernel.display().to_string(),
        rootfs: rootfs.map(|p| p.display().to_string()),
        memory_mib: config.memory_mib,
        vcpus: config.vcpus,
        rounds: config.rounds,
        warmup: config.warmup,
        cmdline: config.cmdline.clone(),
        boot: boot_report,
        restore: restore_report,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings whose paths do not exist (boot.rs's tests use them too).
    pub(super) fn config() -> LinuxBenchConfig {
        LinuxBenchConfig {
            vmm: "/nonexistent/rollbox-vmm".into(),
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            qemu_machine: "microvm".into(),
            fixtures: None,
            kernel: None,
            rootfs: None,
            agent: "/a".into(),
            busybox: "/b".into(),
            rounds: 1,
            warmup: 0,
            memory_mib: 256,
            vcpus: 2,
            cmdline: "console=ttyS0".into(),
            qemu_append: "tsc=reliable".into(),
            qemu_cid: 42,
            parts: vec![Part::Boot, Part::Restore],
            dir: std::env::temp_dir(),
            boot_timeout: Duration::from_secs(1),
            keep_consoles: None,
        }
    }

    #[test]
    fn bad_input_names_the_file() {
        let mut c = config();
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("--kernel or --fixtures"), "{err}");
        c.fixtures = Some("/nonexistent/fixtures.env".into());
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("/nonexistent/fixtures.env"), "{err}");
        let dir = tempdir();
        let env = dir.join("fixtures.env");
        std::fs::write(&env, "OUR_VMLINUX=/nonexistent/vmlinux\n").expect("temp dir");
        c.fixtures = Some(env.clone());
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("/nonexistent/vmlinux"), "{err}");
        c.kernel = Some(env.clone());
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("/nonexistent/rollbox-vmm"), "{err}");
        c.vmm = env.clone();
        c.parts = vec![Part::Restore];
        let err = run(&c).expect_err("bad input").to_string();
        assert!(err.contains("BUSYBOX_ROOTFS"), "{err}");
        std::fs::remove_dir_all(&dir).expect("temp dir");
    }

    fn tempdir() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rollbox-bench-linux-test.{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }
}
