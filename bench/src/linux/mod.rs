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
mod config;
mod error;
mod figures;
mod host;
mod initramfs;
mod report;
mod restore;
mod signals;
mod vm;

pub use config::{LinuxBenchConfig, Part};
pub use error::LinuxBenchError;
pub use report::{markdown, LinuxReport};

pub(crate) use agent::{
    connect_agent_port, read_frame, set_timeval, unix_connect, vsock_connect, AgentAddr,
    AGENT_LISTENING, AGENT_PORT, ATTEMPT_TIMEOUT,
};
pub(crate) use boot::{qemu_args, rollbox_boot_args};
pub(crate) use error::io_err;
pub(crate) use figures::{ms, summary};
pub(crate) use host::{check_kvm, host_cmd, prepare};
pub(crate) use initramfs::{build_initramfs, must_exist, WorkDir};
pub(crate) use report::{cell, ratio};
pub(crate) use vm::VmProcess;

use boot::run_boot;
use host::{initramfs_inputs_exist, kernel_and_vmm};
use initramfs::fixture;
use restore::run_restore;
use signals::catch_signals;

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
    use std::path::PathBuf;
    use std::time::Duration;

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
