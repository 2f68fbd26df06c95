//! `rollbox-bench`: benchmarks that print figures. They never fail on time; they fail
//! only when the thing measured cannot be run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod daemon;
mod guest;
mod jailer;
mod layers;
mod linux;
mod linux_fs;
mod linux_net;
mod networks;
mod procfs;
mod side_by_side;
mod snapshot;
mod snapshot_move;
mod stats;
mod test_guest;
mod vmm;
mod volumes;

/// Flags of `linux-net` and `linux-fs`: the guest, rollbox-vmm and the rounds.
#[derive(clap::Args, Debug, Clone)]
struct GuestArgs {
    /// A fixtures.env of scripts/lab/tier4-fixtures.sh (OUR_VMLINUX).
    #[arg(long)]
    fixtures: Option<PathBuf>,
    /// The guest kernel, an ELF vmlinux [default: OUR_VMLINUX of --fixtures].
    #[arg(long)]
    kernel: Option<PathBuf>,
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
    /// Measured rounds (medians are over these).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Rounds run first and not counted.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512)]
    memory_mib: u64,
    /// Guest vCPUs.
    #[arg(long, default_value_t = 2)]
    vcpus: u32,
    /// Kernel command line (the benchmark appends ip= or rollbox.volume=).
    #[arg(long, default_value = "console=ttyS0 reboot=k panic=1 loglevel=4")]
    cmdline: String,
    /// Where the work directory goes (removed at the end); for linux-fs also the host side
    /// of the data disk and the volume.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
    /// Seconds one boot may take before the run fails.
    #[arg(long, default_value_t = 120)]
    boot_timeout: u64,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

impl GuestArgs {
    fn linux_config(&self, root: &std::path::Path) -> linux::LinuxBenchConfig {
        linux::LinuxBenchConfig {
            vmm: self
                .vmm
                .clone()
                .unwrap_or_else(|| root.join("target/release/rollbox-vmm")),
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            qemu_machine: "microvm".into(),
            fixtures: self.fixtures.clone(),
            kernel: self.kernel.clone(),
            rootfs: None,
            agent: self.agent.clone().unwrap_or_else(|| {
                root.join("target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent")
            }),
            busybox: self.busybox.clone(),
            rounds: self.rounds.max(1),
            warmup: self.warmup,
            memory_mib: self.memory_mib,
            vcpus: self.vcpus.max(1),
            cmdline: self.cmdline.clone(),
            qemu_append: "tsc=reliable".into(),
            qemu_cid: 42,
            parts: vec![],
            dir: self.dir.clone(),
            boot_timeout: std::time::Duration::from_secs(self.boot_timeout.max(1)),
            keep_consoles: None,
        }
    }
}

/// Prints `report`'s tables and writes its JSON; the exit status.
fn finish<R: serde::Serialize, E: std::fmt::Display>(
    name: &str,
    result: Result<R, E>,
    markdown: impl Fn(&R) -> String,
    json: Option<&std::path::Path>,
) -> ExitCode {
    let report = match result {
        Ok(report) => report,
        Err(e) => {
            eprintln!("rollbox-bench {name}: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", markdown(&report));
    if let Some(path) = json {
        let written = serde_json::to_string_pretty(&report)
            .map_err(|e| e.to_string())
            .and_then(|text| std::fs::write(path, text + "\n").map_err(|e| e.to_string()));
        if let Err(e) = written {
            eprintln!("rollbox-bench {name}: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("JSON written to {}", path.display());
    }
    ExitCode::SUCCESS
}

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
    /// What rollbox-jailer adds to a start: `rollbox-vmm --version` bare and jailed,
    /// alternating, with the jailer's own time per step.
    Jailer {
        /// The jailer [default: target/release/rollbox-jailer].
        #[arg(long)]
        jailer: Option<PathBuf>,
        /// The VMM binary [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        #[arg(long, default_value_t = 200)]
        rounds: usize,
        /// Where the jails go (removed at the end).
        #[arg(long, default_value = "/tmp")]
        dir: PathBuf,
        /// Also write the figures as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// `rollbox serve` with the test-guest template: create-from-snapshot latency at
    /// concurrency 1, 16 and 64, creates per second, fork(16), daemon memory per sandbox.
    Daemon {
        /// The rollbox CLI [default: target/release/rollbox].
        #[arg(long)]
        rollbox: Option<PathBuf>,
        /// The VMM binary [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// The test guest ELF [default: target/test-guest/test-guest].
        #[arg(long)]
        guest: Option<PathBuf>,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 32)]
        memory_mib: u64,
        /// Where the scratch state directory goes (removed at the end).
        #[arg(long, default_value = "/tmp")]
        dir: PathBuf,
        /// Creates at concurrency 1.
        #[arg(long, default_value_t = 100)]
        serial: usize,
        /// Concurrencies measured beside 1.
        #[arg(long, value_delimiter = ',', default_value = "16,64")]
        concurrency: Vec<usize>,
        /// Rounds at each concurrency.
        #[arg(long, default_value_t = 4)]
        rounds: usize,
        /// Create + delete cycles of the sustained figure.
        #[arg(long, default_value_t = 500)]
        sustained: usize,
        /// Workers of the sustained figure.
        #[arg(long, default_value_t = 16)]
        sustained_workers: usize,
        /// Run the sustained figure for this many seconds instead of --sustained cycles
        /// (the figure is over 60 s).
        #[arg(long, value_name = "SECONDS")]
        sustained_for: Option<u64>,
        /// Boot the test guest in its idle mode (rollbox.test.run=idle): between commands it
        /// halts until an interrupt, as Linux does, instead of polling the serial port (each
        /// poll an exit to the VMM)
        #[arg(long)]
        idle_guest: bool,
        /// Fork repetitions.
        #[arg(long, default_value_t = 3)]
        forks: usize,
        /// Sandboxes per fork.
        #[arg(long, default_value_t = 16)]
        fork_count: usize,
        /// Sandboxes alive at once for the memory figure (extrapolated per 1,000).
        #[arg(long, default_value_t = 200)]
        live: usize,
        /// Keep N VMM shells warm (`rollbox serve --warm-pool MEMORY=N`); 0: none.
        #[arg(long, default_value_t = 0)]
        warm_pool: usize,
        /// Run the VMMs without rollbox-jailer (`rollbox serve --no-jailer`).
        #[arg(long)]
        no_jailer: bool,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Shared volumes through `rollbox serve` with test-guest writers: create latency with one
    /// volume against none, and records per second of N writers on one volume (forks) against
    /// N writers each on its own volume. Needs virtiofsd (scripts/virtiofsd.sh; found as
    /// rollbox serve finds it).
    Volumes {
        /// The rollbox CLI [default: target/release/rollbox].
        #[arg(long)]
        rollbox: Option<PathBuf>,
        /// The VMM binary [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// The test guest ELF [default: target/test-guest/test-guest].
        #[arg(long)]
        guest: Option<PathBuf>,
        /// Where the scratch state directory goes (removed at the end).
        #[arg(long, default_value = "/tmp")]
        dir: PathBuf,
        /// Creates of the latency figure, each with and without a volume.
        #[arg(long, default_value_t = 50)]
        creates: usize,
        /// Writer counts.
        #[arg(long, value_delimiter = ',', default_value = "64,256")]
        writers: Vec<usize>,
        /// `rollbox serve --vmm-start-timeout`: with hundreds of writers on few cores a
        /// restored VMM takes longer than the daemon's default 10 s to answer.
        #[arg(long, default_value_t = 120)]
        vmm_start_timeout: u64,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Templates from images that share their base layers, through `rollbox serve` with layer
    /// sharing off (full: --no-layer-sharing) and on (shared): disk of the templates and of
    /// each sandbox, template build and create times. Needs root and /dev/kvm.
    Layers(layers::LayersArgs),
    /// Networks per sandbox through `rollbox serve` (root, /dev/net/tun, nft): booted create
    /// latency without a network and with egress none and all, delete latency, and a live
    /// policy change (PATCH /sandboxes/{id}/network).
    Networks {
        /// The rollbox CLI [default: target/release/rollbox].
        #[arg(long)]
        rollbox: Option<PathBuf>,
        /// The VMM binary [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// The test guest ELF [default: target/test-guest/test-guest].
        #[arg(long)]
        guest: Option<PathBuf>,
        /// Where the scratch state directory goes (removed at the end).
        #[arg(long, default_value = "/tmp")]
        dir: PathBuf,
        /// Creates per row (and policy changes).
        #[arg(long, default_value_t = 50)]
        creates: usize,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// A snapshot moved between two `rollbox serve`s (export to a file, import), against
    /// `cp --sparse=always` of its files; the restore on the second daemon checks the pages
    /// the guest wrote. Needs root and /dev/kvm.
    SnapshotMove {
        /// The rollbox CLI [default: target/release/rollbox].
        #[arg(long)]
        rollbox: Option<PathBuf>,
        /// The VMM binary [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// The test guest ELF [default: target/test-guest/test-guest].
        #[arg(long)]
        guest: Option<PathBuf>,
        /// Where the scratch state directories go (removed at the end).
        #[arg(long, default_value = "/tmp")]
        dir: PathBuf,
        /// Guest memory.
        #[arg(long, default_value_t = 256)]
        memory_mib: u64,
        /// MiB the guest writes before the snapshot (from 32 MiB up: at most memory - 32).
        #[arg(long, default_value_t = 200)]
        touch_mib: u64,
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Also write the figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// rollbox-vmm beside another VMM that speaks Firecracker's API (e.g. Firecracker), both
    /// measured by ../shared/bench/fcbench.py in one run, alternating round by round: spawn ->
    /// API, InstanceStart -> first serial byte, snapshot create, load call, load -> first
    /// serial byte, RSS beyond guest memory, and the ratios. Without --other: rollbox-vmm only.
    SideBySide {
        /// The other VMM's binary (run with --api-sock, --log-path, --level like rollbox-vmm).
        #[arg(long)]
        other: Option<PathBuf>,
        /// The other VMM's name in the table.
        #[arg(long, default_value = "other")]
        other_name: String,
        /// rollbox-vmm [default: target/release/rollbox-vmm].
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// fcbench.py [default: ../shared/bench/fcbench.py beside the workspace, or
        /// ../../shared/bench/fcbench.py from a git worktree].
        #[arg(long)]
        fcbench: Option<PathBuf>,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 64)]
        mem: u64,
        /// Rounds (each runs every VMM once).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Also run rollbox-vmm restoring into a warm shell (--shell-memory-mib), as the
        /// daemon's warm pool does, in a column of its own.
        #[arg(long)]
        warm_shell: bool,
        /// Where snapshots go.
        #[arg(long, default_value = "/dev/shm/rollbox-side-by-side")]
        snapdir: PathBuf,
        /// Also write every sample as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
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
    /// memory backend, uffd working-set prefetch, a fork's snapshot (the VM resumed while its
    /// memory is written) and fan-out with memory sharing.
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
        /// The test guest halts between commands (as Linux does) instead of busy-polling
        /// its serial port; the parent and every clone.
        #[arg(long)]
        idle_guest: bool,
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
    /// virtio-net with Linux guests on real KVM (run it in the nested lab:
    /// scripts/lab/bench-net-fs.sh): TCP each way and ping under rollbox-vmm and QEMU microvm
    /// on one host tap and on the daemon's network (`rollbox::net` lease), `rollbox net
    /// up`/`down` time, and boot with and without `--net`.
    LinuxNet {
        #[command(flatten)]
        guest: GuestArgs,
        /// QEMU.
        #[arg(long, default_value = "/usr/bin/qemu-system-x86_64")]
        qemu: PathBuf,
        /// QEMU's guest vsock CID.
        #[arg(long, default_value_t = 42)]
        qemu_cid: u32,
        /// Which parts to run.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "throughput,daemon-net,setup"
        )]
        parts: Vec<linux_net::NetPart>,
        /// MiB per TCP transfer (each direction).
        #[arg(long, default_value_t = 128)]
        mib: u64,
        /// Pings per round (0.2 s apart).
        #[arg(long, default_value_t = 50)]
        pings: u32,
        /// `rollbox net up`/`down` cycles.
        #[arg(long, default_value_t = 50)]
        net_cycles: usize,
        /// Boots with and without `--net`, each.
        #[arg(long, default_value_t = 3)]
        start_rounds: usize,
        /// The rollbox CLI [default: target/release/rollbox].
        #[arg(long)]
        rollbox: Option<PathBuf>,
        /// The benchmark's own tap (created and removed).
        #[arg(long, default_value = "rbxbench0")]
        tap: String,
        /// The tap's /30 is 10.199.SUBNET.0/30; part daemon-net leases that /30 from
        /// `rollbox::net` and puts its server in 10.199.SUBNET+1.0/30.
        #[arg(long, default_value_t = 250)]
        subnet: u8,
    },
    /// virtio-fs beside a virtio-blk ext4 disk in one rollbox-vmm Linux guest (run it in the
    /// nested lab: scripts/lab/bench-net-fs.sh): sequential write and read, small files.
    LinuxFs {
        #[command(flatten)]
        guest: GuestArgs,
        /// MiB written and read sequentially.
        #[arg(long, default_value_t = 256)]
        mib: u64,
        /// Small files created per round.
        #[arg(long, default_value_t = 2000)]
        files: usize,
        /// Bytes per small file.
        #[arg(long, default_value_t = 4096)]
        file_bytes: usize,
        /// The data disk's size in MiB (a sparse file in --dir).
        #[arg(long, default_value_t = 1024)]
        disk_mib: u64,
        /// virtiofsd [default: rollbox-vmm's: $ROLLBOX_VIRTIOFSD, else on PATH].
        #[arg(long)]
        virtiofsd: Option<PathBuf>,
    },
}

fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.bench {
        Bench::Jailer {
            jailer: jailer_bin,
            vmm,
            rounds,
            dir,
            json,
        } => {
            let release = workspace_root().join("target/release");
            let config = jailer::JailerBenchConfig {
                jailer: jailer_bin.unwrap_or_else(|| release.join("rollbox-jailer")),
                vmm: vmm.unwrap_or_else(|| release.join("rollbox-vmm")),
                rounds: rounds.max(1),
                dir,
            };
            finish(
                "jailer",
                jailer::run(&config),
                jailer::markdown,
                json.as_deref(),
            )
        }
        Bench::Daemon {
            rollbox,
            vmm,
            guest,
            memory_mib,
            dir,
            serial,
            concurrency,
            rounds,
            sustained,
            sustained_workers,
            sustained_for,
            idle_guest,
            forks,
            fork_count,
            live,
            no_jailer,
            warm_pool,
            json,
        } => {
            let (default_rollbox, default_vmm, default_guest) =
                daemon::default_paths(&workspace_root());
            let config = daemon::DaemonBenchConfig {
                rollbox: rollbox.unwrap_or(default_rollbox),
                vmm: vmm.unwrap_or(default_vmm),
                guest: guest.unwrap_or(default_guest),
                memory_mib,
                dir,
                serial: serial.max(1),
                concurrency: concurrency.into_iter().filter(|c| *c > 0).collect(),
                rounds: rounds.max(1),
                sustained: sustained.max(1),
                sustained_workers: sustained_workers.max(1),
                sustained_for: sustained_for.map(|s| std::time::Duration::from_secs(s.max(1))),
                idle_guest,
                forks,
                fork_count: fork_count.max(1),
                live: live.max(1),
                jailer: !no_jailer,
                vmm_start_timeout_s: None,
                warm_pool,
            };
            finish(
                "daemon",
                daemon::run(&config),
                daemon::markdown,
                json.as_deref(),
            )
        }
        Bench::Volumes {
            rollbox,
            vmm,
            guest,
            dir,
            creates,
            writers,
            vmm_start_timeout,
            json,
        } => {
            let (default_rollbox, default_vmm, default_guest) =
                daemon::default_paths(&workspace_root());
            let config = volumes::VolumesBenchConfig {
                rollbox: rollbox.unwrap_or(default_rollbox),
                vmm: vmm.unwrap_or(default_vmm),
                guest: guest.unwrap_or(default_guest),
                dir,
                creates: creates.max(1),
                writers: writers.into_iter().filter(|w| *w > 0).collect(),
                vmm_start_timeout_s: vmm_start_timeout,
            };
            finish(
                "volumes",
                volumes::run(&config),
                volumes::markdown,
                json.as_deref(),
            )
        }
        Bench::Layers(args) => {
            let json = args.json.clone();
            let report = layers::run(args, &workspace_root());
            finish("layers", report, layers::markdown, json.as_deref())
        }
        Bench::Networks {
            rollbox,
            vmm,
            guest,
            dir,
            creates,
            json,
        } => {
            let (default_rollbox, default_vmm, default_guest) =
                daemon::default_paths(&workspace_root());
            let config = networks::NetworksBenchConfig {
                rollbox: rollbox.unwrap_or(default_rollbox),
                vmm: vmm.unwrap_or(default_vmm),
                guest: guest.unwrap_or(default_guest),
                dir,
                creates: creates.max(1),
            };
            finish(
                "networks",
                networks::run(&config),
                networks::markdown,
                json.as_deref(),
            )
        }
        Bench::SnapshotMove {
            rollbox,
            vmm,
            guest,
            dir,
            memory_mib,
            touch_mib,
            rounds,
            json,
        } => {
            let (default_rollbox, default_vmm, default_guest) =
                daemon::default_paths(&workspace_root());
            let config = snapshot_move::MoveBenchConfig {
                rollbox: rollbox.unwrap_or(default_rollbox),
                vmm: vmm.unwrap_or(default_vmm),
                guest: guest.unwrap_or(default_guest),
                dir,
                memory_mib,
                touch_mib: touch_mib.clamp(1, memory_mib.saturating_sub(32).max(1)),
                rounds,
            };
            finish(
                "snapshot-move",
                snapshot_move::run(&config),
                snapshot_move::markdown,
                json.as_deref(),
            )
        }
        Bench::LinuxNet {
            guest,
            qemu,
            qemu_cid,
            parts,
            mib,
            pings,
            net_cycles,
            start_rounds,
            rollbox,
            tap,
            subnet,
        } => {
            let root = workspace_root();
            let mut linux = guest.linux_config(&root);
            linux.qemu = qemu;
            linux.qemu_cid = qemu_cid;
            let config = linux_net::NetBenchConfig {
                linux,
                parts,
                mib: mib.max(1),
                pings: pings.max(1),
                net_cycles: net_cycles.max(1),
                start_rounds: start_rounds.max(1),
                rollbox: rollbox.unwrap_or_else(|| root.join("target/release/rollbox")),
                tap,
                subnet,
            };
            finish(
                "linux-net",
                linux_net::run(&config),
                linux_net::markdown,
                guest.json.as_deref(),
            )
        }
        Bench::LinuxFs {
            guest,
            mib,
            files,
            file_bytes,
            disk_mib,
            virtiofsd,
        } => {
            let root = workspace_root();
            let config = linux_fs::FsBenchConfig {
                linux: guest.linux_config(&root),
                mib: mib.max(1),
                files: files.max(1),
                file_bytes: file_bytes.max(1),
                disk_mib: disk_mib.max(mib * 2),
                virtiofsd,
            };
            finish(
                "linux-fs",
                linux_fs::run(&config),
                linux_fs::markdown,
                guest.json.as_deref(),
            )
        }
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
            idle_guest,
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
                idle_guest,
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
        Bench::SideBySide {
            other,
            other_name,
            vmm,
            fcbench,
            mem,
            rounds,
            warm_shell,
            snapdir,
            json,
        } => {
            let root = workspace_root();
            // The checkout's sibling ../shared, or ../../shared from a worktree in work/wt/NAME.
            let fcbench = fcbench.unwrap_or_else(|| {
                [
                    "../shared/bench/fcbench.py",
                    "../../shared/bench/fcbench.py",
                ]
                .iter()
                .map(|p| root.join(p))
                .find(|p| p.is_file())
                .unwrap_or_else(|| root.join("../shared/bench/fcbench.py"))
            });
            if !fcbench.is_file() {
                eprintln!(
                    "rollbox-bench side-by-side: {} not found (give --fcbench PATH)",
                    fcbench.display()
                );
                return ExitCode::FAILURE;
            }
            let config = side_by_side::SideBySideConfig {
                fcbench_dir: fcbench
                    .parent()
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from(".")),
                fcbench,
                work: root.join("target/fcbench"),
                snapdir,
                rollbox: vmm.unwrap_or_else(|| root.join("target/release/rollbox-vmm")),
                other: other.map(|path| (path, other_name)),
                mem_mib: mem.max(1),
                rounds: rounds.max(1),
                warm_shell,
            };
            finish(
                "side-by-side",
                side_by_side::run(&config),
                |vmms| side_by_side::markdown(vmms, &config),
                json.as_deref(),
            )
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
