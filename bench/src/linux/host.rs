//! The host side before and around a Linux guest: a /dev/kvm that can run Linux, the guest
//! kernel, rollbox-vmm and what the initramfs packs, the set-up `linux-net` and `linux-fs`
//! share, and host commands that must succeed.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::config::LinuxBenchConfig;
use super::error::LinuxBenchError;
use super::initramfs::{fixture, must_exist, WorkDir};
use super::signals::catch_signals;

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

/// What `linux-net` and `linux-fs` both check first: the kernel, rollbox-vmm, the agent and
/// busybox exist; then the signal handlers and the work directory.
pub fn prepare(config: &LinuxBenchConfig) -> Result<(PathBuf, WorkDir), LinuxBenchError> {
    let kernel = kernel_and_vmm(config)?;
    initramfs_inputs_exist(config)?;
    catch_signals();
    let work = WorkDir::create(&config.dir)?;
    Ok((kernel, work))
}

/// Runs `program args`, which must succeed; returns its stdout.
pub(crate) fn host_cmd(program: &str, args: &[&str]) -> Result<String, LinuxBenchError> {
    let command = format!("{program} {}", args.join(" "));
    let out =
        Command::new(program)
            .args(args)
            .output()
            .map_err(|e| LinuxBenchError::HostCommand {
                command: command.clone(),
                detail: e.to_string(),
            })?;
    if !out.status.success() {
        return Err(LinuxBenchError::HostCommand {
            command,
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
