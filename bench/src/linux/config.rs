//! The settings of `rollbox-bench linux` (also the guest, VMM and rounds of `linux-net` and
//! `linux-fs`), and its parts.

use std::path::PathBuf;
use std::time::Duration;

/// The two parts of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// Linux boot under rollbox-vmm and QEMU microvm.
    Boot,
    /// Restore until the agent answers, beside a cold boot.
    Restore,
}

/// Settings; paths are checked by [`super::run`].
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
