//! `rollbox-bench`: benchmarks that print figures. They never fail on time; they fail
//! only when the thing measured cannot be run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod linux;
mod procfs;
mod snapshot;
mod stats;
mod vmm;

/// The test guest's command line: it finds its virtio devices on the command line, so ACPI is
/// off (with ACPI on, rollbox-vmm names them in the DSDT instead).
const TEST_GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off acpi=off";

#[derive(Parser, Debug)]
#[command(name = "rollbox-bench", version, about)]
struct Args {
    #[command(subcommand)]
    bench: Bench,
}

// Parsed once; the Linux variant's many flags make it the large one.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Bench {
    /// rollbox-vmm with the test guest: spawn to first serial byte, the VMM's own
    /// memory beyond guest memory, and port-I/O/MMIO exit round trips.
    Vmm {
        /// How many VMM processes to run.
        #[arg(long, default_value_t = 20)]
        reps: usize,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// The VMM binary [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// The test guest ELF [default: target/test-guest/test-guest, built when missing].
        #[arg(long)]
        guest: Option<PathBuf>,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 256)]
        memory_mib: u64,
        /// Iterations of each exit loop.
        #[arg(long, default_value_t = 20_000)]
        exits: u64,
        /// Runs of each exit loop per rep; the fastest counts (host load only adds time).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// First run `cargo build --release -p vmm` and `cargo xtask test-guest`.
        #[arg(long)]
        build: bool,
    },
    /// Snapshot and restore of rollbox-vmm: snapshot time (Full, Diff), restore latency per
    /// memory backend, uffd working-set prefetch, fork and fan-out with memory sharing.
    Snapshot {
        /// Guest sizes in MiB.
        #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
        sizes: Vec<u64>,
        /// Repetitions per figure.
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// Where snapshots go.
        #[arg(long, default_value = "/dev/shm/rollbox-bench")]
        dir: PathBuf,
        /// Clones in the fan-out figure.
        #[arg(long, default_value_t = 100)]
        fanout: usize,
        /// Working set the guest touches, MiB.
        #[arg(long, default_value_t = 32)]
        working_set_mib: u64,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Linux guests on real KVM (run it in the nested lab: scripts/lab/bench-linux.sh): boot
    /// of one vmlinux and initramfs under rollbox-vmm and QEMU microvm, and restore until the
    /// agent answers beside a cold boot.
    Linux {
        /// A fixtures.env of scripts/lab/tier4-fixtures.sh (OUR_VMLINUX, BUSYBOX_ROOTFS).
        #[arg(long)]
        fixtures: Option<PathBuf>,
        /// The guest kernel, an ELF vmlinux [default: OUR_VMLINUX of --fixtures].
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// The busybox rootfs with the agent as init [default: BUSYBOX_ROOTFS of --fixtures].
        #[arg(long)]
        rootfs: Option<PathBuf>,
        /// The static agent for the initramfs
        /// [default: target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent].
        #[arg(long)]
        agent: Option<PathBuf>,
        /// A static busybox for the initramfs.
        #[arg(long, default_value = "/bin/busybox")]
        busybox: PathBuf,
        /// The VMM binary [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// QEMU.
        #[arg(long, default_value = "/usr/bin/qemu-system-x86_64")]
        qemu: PathBuf,
        /// QEMU's machine and its options (-M).
        #[arg(long, default_value = "microvm")]
        qemu_machine: String,
        /// Appended to QEMU's kernel command line only: what rollbox-vmm appends by itself.
        #[arg(long, default_value = "tsc=reliable")]
        qemu_append: String,
        /// QEMU's guest vsock CID.
        #[arg(long, default_value_t = 42)]
        qemu_cid: u32,
        /// Measured rounds (medians are over these).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Boot rounds run first and not counted (they warm the page cache).
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 256)]
        memory_mib: u64,
        /// Guest vCPUs.
        #[arg(long, default_value_t = 2)]
        vcpus: u32,
        /// Kernel command line for both VMMs (each appends its own device arguments).
        #[arg(long, default_value = "console=ttyS0 reboot=k panic=1")]
        cmdline: String,
        /// Which parts to run.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "boot,restore"
        )]
        parts: Vec<linux::Part>,
        /// Where the work directory goes (removed at the end).
        #[arg(long, default_value = "/tmp")]
        dir: PathBuf,
        /// Seconds one boot or restore may take before the run fails.
        #[arg(long, default_value_t = 120)]
        boot_timeout: u64,
        /// Write every boot's console transcript (host ms, line) into this directory.
        #[arg(long)]
        keep_consoles: Option<PathBuf>,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.bench {
        Bench::Linux {
            fixtures,
            kernel,
            rootfs,
            agent,
            busybox,
            vmm,
            qemu,
            qemu_machine,
            qemu_append,
            qemu_cid,
            rounds,
            warmup,
            memory_mib,
            vcpus,
            cmdline,
            parts,
            dir,
            boot_timeout,
            keep_consoles,
            json,
        } => {
            let root = workspace_root();
            let config = linux::LinuxBenchConfig {
                vmm: vmm.unwrap_or_else(|| root.join("target/release/rollbox-vmm")),
                qemu,
                qemu_machine,
                fixtures,
                kernel,
                rootfs,
                agent: agent.unwrap_or_else(|| {
                    root.join("target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent")
                }),
                busybox,
                rounds: rounds.max(1),
                warmup,
                memory_mib,
                vcpus: vcpus.max(1),
                cmdline,
                qemu_append,
                qemu_cid,
                parts,
                dir,
                boot_timeout: std::time::Duration::from_secs(boot_timeout.max(1)),
                keep_consoles,
            };
            let result = linux::run(&config)
                .map_err(|e| e.to_string())
                .and_then(|report| {
                    println!("{}", linux::markdown(&report));
                    if let Some(path) = &json {
                        let text =
                            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
                        std::fs::write(path, text + "\n")
                            .map_err(|e| format!("writing {}: {e}", path.display()))?;
                        println!("JSON written to {}", path.display());
                    }
                    Ok(())
                });
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("rollbox-bench linux: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Bench::Snapshot {
            sizes,
            reps,
            dir,
            fanout,
            working_set_mib,
            json,
        } => {
            let root = workspace_root();
            let config = snapshot::SnapshotBenchConfig {
                vmm: root.join("target/release/rollbox-vmm"),
                guest: root.join("target/test-guest/test-guest"),
                sizes,
                reps: reps.max(1),
                dir,
                fanout,
                working_set_mib,
            };
            match snapshot::run(&config) {
                Ok(reports) => {
                    println!("{}", snapshot::markdown(&reports, &config));
                    if let Some(path) = json {
                        let text = serde_json::to_string_pretty(&reports).unwrap_or_default();
                        if let Err(e) = std::fs::write(&path, text) {
                            eprintln!("rollbox-bench snapshot: {}: {e}", path.display());
                            return ExitCode::FAILURE;
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("rollbox-bench snapshot: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Bench::Vmm {
            reps,
            json,
            vmm,
            guest,
            memory_mib,
            exits,
            rounds,
            build,
        } => {
            let root = workspace_root();
            let config = vmm::VmmBenchConfig {
                vmm: vmm.unwrap_or_else(|| root.join("target/release/rollbox-vmm")),
                guest: guest.unwrap_or_else(|| root.join("target/test-guest/test-guest")),
                workspace: root,
                reps: reps.max(1),
                memory_mib,
                exit_iterations: exits.max(1),
                rounds: rounds.max(1),
                build,
            };
            match vmm::run(&config).and_then(|report| {
                println!("{}", vmm::markdown(&report));
                if let Some(path) = &json {
                    let text = serde_json::to_string_pretty(&report)?;
                    std::fs::write(path, text + "\n").map_err(|source| {
                        vmm::VmmBenchError::WriteJson {
                            path: path.clone(),
                            source,
                        }
                    })?;
                    println!("JSON written to {}", path.display());
                }
                Ok(())
            }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("rollbox-bench vmm: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
