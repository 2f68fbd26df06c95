//! `rollbox-bench linux-fs`: a virtio-fs volume beside a virtio-blk ext4 data disk in one
//! rollbox-vmm Linux guest (the nested lab, `scripts/lab/bench-net-fs.sh`).
//!
//! The initramfs guest of `rollbox-bench linux` gets a sparse ext4 image as its only drive
//! (`/dev/vda`, mounted by the benchmark at /mnt/blk) and a host directory as a virtio-fs
//! volume (`--fs vol=DIR`, mounted by the agent from `rollbox.volume=vol:/mnt/fs`). Both host
//! backings sit in the same host directory (`--dir`). Per round, alternating which goes first:
//! sequential write (`dd conv=fsync`), sequential read after `drop_caches`, and small-file
//! creation (shell `echo` into N files, then `sync`). The guest times each step with
//! /proc/uptime (10 ms steps), so the agent's round trip is not in the figures.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::guest::{parse_elapsed, timed, GuestShell};
use crate::linux::{
    build_initramfs, check_kvm, host_cmd, io_err, must_exist, prepare, ratio, rollbox_boot_args,
    summary, AgentAddr, LinuxBenchConfig, LinuxBenchError, VmProcess, AGENT_LISTENING,
};
use crate::stats::Summary;

/// One guest command at most.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(900);
const VOLUME_TAG: &str = "benchvol";

/// Settings; `linux` holds the guest, the VMM and the rounds.
#[derive(Debug, Clone)]
pub struct FsBenchConfig {
    pub linux: LinuxBenchConfig,
    /// MiB written and read sequentially.
    pub mib: u64,
    /// Small files created per round.
    pub files: usize,
    /// Bytes per small file.
    pub file_bytes: usize,
    /// The data disk's size in MiB (sparse).
    pub disk_mib: u64,
    /// virtiofsd [default: rollbox-vmm's own: $ROLLBOX_VIRTIOFSD, else PATH].
    pub virtiofsd: Option<PathBuf>,
}

/// Figures of one of the two.
#[derive(Debug, Clone, Serialize)]
pub struct StoreFigures {
    pub store: String,
    pub write_mib_s: Summary,
    pub read_mib_s: Summary,
    pub files_per_s: Summary,
}

/// Everything, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct FsReport {
    pub mib: u64,
    pub files: usize,
    pub file_bytes: usize,
    pub rounds: usize,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub host_dir: String,
    pub blk: StoreFigures,
    pub fs: StoreFigures,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Store {
    Blk,
    Fs,
}

impl Store {
    fn label(self) -> &'static str {
        match self {
            Store::Blk => "virtio-blk ext4",
            Store::Fs => "virtio-fs",
        }
    }

    fn dir(self) -> &'static str {
        match self {
            Store::Blk => "/mnt/blk",
            Store::Fs => "/mnt/fs",
        }
    }
}

/// The drop_caches step before a timed part.
const DROP_CACHES: &str = "sync; echo 3 > /proc/sys/vm/drop_caches";

fn elapsed(shell: &GuestShell, script: &str) -> Result<f64, LinuxBenchError> {
    let out = shell.sh(script, COMMAND_TIMEOUT)?;
    parse_elapsed(&out).ok_or_else(|| LinuxBenchError::Guest {
        vm: shell.vm.clone(),
        script: script.to_string(),
        detail: format!("no elapsed line in {out:?}"),
    })
}

/// One round on one store: (write MiB/s, read MiB/s, files/s).
fn round(
    config: &FsBenchConfig,
    shell: &GuestShell,
    store: Store,
) -> Result<[f64; 3], LinuxBenchError> {
    let d = store.dir();
    let mib = config.mib;
    shell.sh(
        &format!("rm -rf {d}/big {d}/small; {DROP_CACHES}"),
        COMMAND_TIMEOUT,
    )?;
    let write = elapsed(
        shell,
        &timed(&format!(
            "busybox dd if=/dev/zero of={d}/big bs=1048576 count={mib} conv=fsync 2>/dev/null"
        )),
    )?;
    eprintln!(
        "linux-fs {}: wrote {mib} MiB in {write:.2} s",
        store.label()
    );
    let size = shell.sh(&format!("busybox stat -c %s {d}/big"), COMMAND_TIMEOUT)?;
    if size != (mib << 20).to_string() {
        return Err(LinuxBenchError::Guest {
            vm: shell.vm.clone(),
            script: format!("stat {d}/big"),
            detail: format!("{size} bytes written, not {}", mib << 20),
        });
    }
    shell.sh(DROP_CACHES, COMMAND_TIMEOUT)?;
    let read = elapsed(
        shell,
        &timed(&format!(
            "busybox dd if={d}/big of=/dev/null bs=1048576 2>/dev/null"
        )),
    )?;
    eprintln!("linux-fs {}: read {mib} MiB in {read:.2} s", store.label());
    shell.sh(
        &format!("rm -f {d}/big; mkdir {d}/small; {DROP_CACHES}"),
        COMMAND_TIMEOUT,
    )?;
    // `echo` is a shell builtin: no process per file.
    let files = config.files;
    let create = elapsed(
        shell,
        &format!(
            "s=$(busybox printf '%{}s' '')\n{}",
            config.file_bytes,
            timed(&format!(
                "i=0\nwhile [ $i -lt {files} ]; do echo -n \"$s\" > {d}/small/f$i; i=$((i+1)); done\nsync"
            ))
        ),
    )?;
    let check = shell.sh(
        &format!("busybox ls {d}/small | busybox wc -l; busybox stat -c %s {d}/small/f0"),
        COMMAND_TIMEOUT,
    )?;
    let want = format!("{files}\n{}", config.file_bytes);
    if check.split_whitespace().collect::<Vec<_>>() != want.split_whitespace().collect::<Vec<_>>() {
        return Err(LinuxBenchError::Guest {
            vm: shell.vm.clone(),
            script: format!("ls {d}/small"),
            detail: format!("files and size {check:?}, not {want:?}"),
        });
    }
    shell.sh(&format!("rm -rf {d}/small; sync"), COMMAND_TIMEOUT)?;
    let rate = |secs: f64, amount: f64| amount / secs.max(0.01);
    Ok([
        rate(write, mib as f64),
        rate(read, mib as f64),
        rate(create, files as f64),
    ])
}

fn figures(store: Store, samples: &[[f64; 3]]) -> Result<StoreFigures, LinuxBenchError> {
    let column = |i: usize| samples.iter().map(|s| s[i]).collect::<Vec<_>>();
    Ok(StoreFigures {
        store: store.label().into(),
        write_mib_s: summary("sequential write", &column(0))?,
        read_mib_s: summary("sequential read", &column(1))?,
        files_per_s: summary("small files", &column(2))?,
    })
}

/// Runs the benchmark.
pub fn run(config: &FsBenchConfig) -> Result<FsReport, LinuxBenchError> {
    let (kernel, work) = prepare(&config.linux)?;
    if let Some(v) = &config.virtiofsd {
        must_exist(
            "virtiofsd",
            v,
            "scripts/virtiofsd.sh builds it and prints its path",
        )?;
    }
    check_kvm()?;
    let initramfs = work.0.join("initramfs.cpio");
    build_initramfs(&config.linux, &initramfs)?;

    let disk = work.0.join("data.ext4");
    let file = std::fs::File::create(&disk).map_err(io_err("creating", &disk))?;
    file.set_len(config.disk_mib << 20)
        .map_err(io_err("sizing", &disk))?;
    drop(file);
    let disk_s = disk.display().to_string();
    // Initialized now, so the guest's ext4lazyinit does not write during the figures.
    host_cmd(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            &disk_s,
        ],
    )?;
    let share = work.0.join("share");
    std::fs::create_dir_all(&share).map_err(io_err("creating", &share))?;

    let mut linux = config.linux.clone();
    linux.cmdline = format!(
        "{} rollbox.volume={VOLUME_TAG}:{}",
        linux.cmdline,
        Store::Fs.dir()
    );
    let sock = work.0.join("fs.sock");
    let mut args = rollbox_boot_args(&linux, &kernel, &initramfs, &sock);
    args.extend([
        "--drive".into(),
        disk_s,
        "--fs".into(),
        format!("{VOLUME_TAG}={}", share.display()),
    ]);
    if let Some(v) = &config.virtiofsd {
        args.extend(["--virtiofsd".into(), v.display().to_string()]);
    }
    let mut vm = VmProcess::spawn("rollbox-vmm (volumes)", &linux.vmm, &args)?;
    let deadline = vm.started + linux.boot_timeout;
    vm.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
    let addr = AgentAddr::Unix(sock);
    vm.wait_hello(&addr, deadline)?;
    let shell = GuestShell::new("rollbox-vmm (volumes)", addr);
    shell.sh(
        &format!(
            "mkdir -p {blk} && busybox mount -t ext4 /dev/vda {blk} && busybox grep ' {fs} virtiofs ' /proc/mounts",
            blk = Store::Blk.dir(),
            fs = Store::Fs.dir()
        ),
        COMMAND_TIMEOUT,
    )?;
    let mut samples: [Vec<[f64; 3]>; 2] = Default::default();
    let total = linux.warmup + linux.rounds;
    for r in 0..total {
        let order = if r % 2 == 0 {
            [Store::Blk, Store::Fs]
        } else {
            [Store::Fs, Store::Blk]
        };
        for store in order {
            let s = round(config, &shell, store)?;
            let warm = r < linux.warmup;
            eprintln!(
                "linux-fs {} {}/{total}{}: write {:.1} MiB/s, read {:.1} MiB/s, {:.0} files/s",
                store.label(),
                r + 1,
                if warm { " (warm-up)" } else { "" },
                s[0],
                s[1],
                s[2]
            );
            if !warm {
                samples[usize::from(store == Store::Fs)].push(s);
            }
        }
    }
    vm.stop();
    drop(vm);
    let report = FsReport {
        mib: config.mib,
        files: config.files,
        file_bytes: config.file_bytes,
        rounds: linux.rounds,
        memory_mib: linux.memory_mib,
        vcpus: linux.vcpus,
        host_dir: linux.dir.display().to_string(),
        blk: figures(Store::Blk, &samples[0])?,
        fs: figures(Store::Fs, &samples[1])?,
    };
    drop(work);
    Ok(report)
}

/// The table.
pub fn markdown(report: &FsReport) -> String {
    let mut out = format!(
        "### Volumes: virtio-fs beside a virtio-blk ext4 disk in one rollbox-vmm guest ({} MiB sequential, {} files of {} bytes, {} MiB guest, {} vCPUs, host backing in {}; median (min–max) of {} rounds)\n\n",
        report.mib,
        report.files,
        report.file_bytes,
        report.memory_mib,
        report.vcpus,
        report.host_dir,
        report.rounds
    );
    out.push_str("| figure (higher is better) | virtio-blk ext4 | virtio-fs | fs/blk |\n");
    out.push_str("| --- | ---: | ---: | ---: |\n");
    type Pick = fn(&StoreFigures) -> &Summary;
    let rows: [(&str, Pick); 3] = [
        ("sequential write, `dd conv=fsync`, MiB/s", |f| {
            &f.write_mib_s
        }),
        ("sequential read after drop_caches, MiB/s", |f| {
            &f.read_mib_s
        }),
        ("small files created (+ sync), files/s", |f| &f.files_per_s),
    ];
    for (name, pick) in rows {
        let (b, f) = (pick(&report.blk), pick(&report.fs));
        out.push_str(&format!(
            "| {name} | {:.1} ({:.1}–{:.1}) | {:.1} ({:.1}–{:.1}) | {} |\n",
            b.p50,
            b.min,
            b.max,
            f.p50,
            f.min,
            f.max,
            ratio(f.p50, b.p50)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::summarize;

    #[test]
    fn table_has_the_ratio() {
        let s = |v: f64| summarize(&[v]).expect("one sample");
        let store = |name: &str, v: f64| StoreFigures {
            store: name.into(),
            write_mib_s: s(v),
            read_mib_s: s(v * 2.0),
            files_per_s: s(v * 10.0),
        };
        let report = FsReport {
            mib: 256,
            files: 2000,
            file_bytes: 4096,
            rounds: 1,
            memory_mib: 512,
            vcpus: 2,
            host_dir: "/tmp".into(),
            blk: store("virtio-blk ext4", 100.0),
            fs: store("virtio-fs", 50.0),
        };
        let text = markdown(&report);
        assert!(text.contains("| sequential write, `dd conv=fsync`, MiB/s | 100.0 (100.0–100.0) | 50.0 (50.0–50.0) | 0.50× |"), "{text}");
        assert!(text.contains("files/s | 1000.0"), "{text}");
    }
}
