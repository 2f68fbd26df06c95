//! Checks of the host and the inputs before a Linux guest runs: a /dev/kvm that can run Linux,
//! the guest kernel and rollbox-vmm, and what the initramfs packs.

use std::path::{Path, PathBuf};

use super::config::LinuxBenchConfig;
use super::error::LinuxBenchError;
use super::initramfs::{fixture, must_exist};

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
