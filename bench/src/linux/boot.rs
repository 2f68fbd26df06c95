//! Part 1, boot: one vmlinux and initramfs under rollbox-vmm and QEMU microvm, alternating
//! round by round, to the first kernel console line, `/init` and the agent's answer, with the
//! largest console gaps and CPU by thread of the median round.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use super::agent::{AgentAddr, AGENT_LISTENING, ROLLBOX_CID};
use super::config::LinuxBenchConfig;
use super::error::{io_err, LinuxBenchError};
use super::figures::{ms, summary};
use super::initramfs::{build_initramfs, must_exist, INIT_MARKER};
use super::vm::VmProcess;
use crate::stats::{summarize, Summary};

/// Lines of the largest console gaps shown per VMM.
const GAPS_SHOWN: usize = 6;

/// Figures of one VMM booting the initramfs.
#[derive(Debug, Clone, Serialize)]
pub struct BootFigures {
    pub vmm: String,
    /// VMM process start to the first kernel console line (one with a printk timestamp).
    pub first_kernel_line_ms: Option<Summary>,
    /// To the initramfs's `/init` marker line.
    pub init_ms: Summary,
    /// To the agent's "listening on vsock port" line.
    pub agent_listening_ms: Summary,
    /// To the agent's answer to `hello` on a new vsock connection (first tried once the
    /// listening line is on the console).
    pub agent_ready_ms: Summary,
    /// The kernel's "Command line:" as the guest printed it.
    pub kernel_cmdline: Option<String>,
    /// The largest gaps between console lines in the median round.
    pub largest_gaps: Vec<Gap>,
    /// The VMM's CPU ms by thread name when the agent answered, in the median round.
    pub cpu_ms_by_thread: Vec<(String, f64)>,
}

/// Host time between one console line and the one before it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gap {
    pub ms: f64,
    /// ms from process start to the line.
    pub at_ms: f64,
    /// The line after the gap.
    pub line: String,
}

/// Part 1.
#[derive(Debug, Clone, Serialize)]
pub struct BootReport {
    pub rollbox: BootFigures,
    pub qemu: BootFigures,
    pub qemu_machine: String,
    pub initramfs_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Rollbox,
    Qemu,
}

impl Which {
    fn label(self) -> &'static str {
        match self {
            Which::Rollbox => "rollbox-vmm",
            Which::Qemu => "QEMU microvm",
        }
    }
}

/// One boot's milestones, ms from process start.
#[derive(Debug, Clone)]
struct BootSample {
    first_kernel_line: Option<f64>,
    init: f64,
    listening: f64,
    ready: f64,
    lines: Vec<(f64, String)>,
    /// CPU time by thread name when the agent answered.
    threads: Vec<(String, f64)>,
}

/// Thread name and user + system CPU ms from one `/proc/PID/task/TID/stat`.
pub fn parse_task_stat(text: &str, ticks_per_s: f64) -> Option<(String, f64)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let name = text.get(open + 1..close)?.to_string();
    // After "pid (comm) " come state (field 3), ..., utime (14), stime (15).
    let fields: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((name, (utime + stime) * 1e3 / ticks_per_s))
}

/// CPU ms per thread name of process `pid` (threads of one name added up), largest first.
fn thread_cpu_ms(pid: u32) -> Vec<(String, f64)> {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
    let mut by_name: Vec<(String, f64)> = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return by_name;
    };
    for task in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        if let Some((name, cpu)) = parse_task_stat(&text, ticks) {
            match by_name.iter_mut().find(|(n, _)| *n == name) {
                Some((_, total)) => *total += cpu,
                None => by_name.push((name, cpu)),
            }
        }
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    by_name
}

/// A kernel console line: starts with a printk timestamp such as `[    0.000000]`.
pub fn is_printk_line(line: &str) -> bool {
    let Some(rest) = line.trim_start().strip_prefix('[') else {
        return false;
    };
    let Some((stamp, _)) = rest.split_once(']') else {
        return false;
    };
    let stamp = stamp.trim();
    !stamp.is_empty()
        && stamp.contains('.')
        && stamp.chars().all(|c| c.is_ascii_digit() || c == '.')
}

/// The `largest` biggest gaps between consecutive lines, biggest first.
pub fn largest_gaps(lines: &[(f64, String)], start_ms: f64, largest: usize) -> Vec<Gap> {
    let mut gaps: Vec<Gap> = Vec::new();
    let mut before = start_ms;
    for (at, line) in lines {
        gaps.push(Gap {
            ms: at - before,
            at_ms: *at,
            line: line.chars().take(100).collect(),
        });
        before = *at;
    }
    gaps.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    gaps.truncate(largest);
    gaps
}

pub(crate) fn rollbox_boot_args(
    config: &LinuxBenchConfig,
    kernel: &Path,
    initramfs: &Path,
    sock: &Path,
) -> Vec<String> {
    vec![
        "--kernel".into(),
        kernel.display().to_string(),
        "--initrd".into(),
        initramfs.display().to_string(),
        "--memory-mib".into(),
        config.memory_mib.to_string(),
        "--vcpus".into(),
        config.vcpus.to_string(),
        "--cmdline".into(),
        config.cmdline.clone(),
        "--vsock-uds".into(),
        sock.display().to_string(),
        "--vsock-cid".into(),
        ROLLBOX_CID.to_string(),
    ]
}

/// QEMU's microvm with the same kernel, initramfs, memory and vCPUs; its serial console on
/// stdout, vsock through vhost-vsock.
pub fn qemu_args(config: &LinuxBenchConfig, kernel: &Path, initramfs: &Path) -> Vec<String> {
    let append = if config.qemu_append.trim().is_empty() {
        config.cmdline.clone()
    } else {
        format!("{} {}", config.cmdline, config.qemu_append.trim())
    };
    [
        "-accel",
        "kvm",
        "-M",
        &config.qemu_machine,
        "-cpu",
        "host",
        "-m",
        &format!("{}M", config.memory_mib),
        "-smp",
        &config.vcpus.to_string(),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        // Thread names ("CPU 0/KVM") for the CPU-by-thread figures.
        "-name",
        "rollbox-bench,debug-threads=on",
        "-no-reboot",
        "-serial",
        "stdio",
        "-kernel",
        &kernel.display().to_string(),
        "-initrd",
        &initramfs.display().to_string(),
        "-append",
        &append,
        "-device",
        &format!("vhost-vsock-device,guest-cid={}", config.qemu_cid),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn boot_once(
    config: &LinuxBenchConfig,
    which: Which,
    kernel: &Path,
    initramfs: &Path,
    work: &Path,
    round: usize,
) -> Result<BootSample, LinuxBenchError> {
    let sock = work.join(format!("boot-{round}.sock"));
    let (program, args, addr) = match which {
        Which::Rollbox => (
            &config.vmm,
            rollbox_boot_args(config, kernel, initramfs, &sock),
            AgentAddr::Unix(sock.clone()),
        ),
        Which::Qemu => (
            &config.qemu,
            qemu_args(config, kernel, initramfs),
            AgentAddr::Vsock(config.qemu_cid),
        ),
    };
    let mut vm = VmProcess::spawn(which.label(), program, &args)?;
    let deadline = vm.started + config.boot_timeout;
    let listening = vm.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
    let ready = vm.wait_hello(&addr, deadline)?.answered;
    let threads = thread_cpu_ms(vm.child.id());
    vm.drain();
    vm.stop();
    let _ = std::fs::remove_file(&sock);
    let since = |at: Instant| ms(at.saturating_duration_since(vm.started));
    let find = |needle: &str| {
        vm.lines
            .iter()
            .find(|(_, l)| l.contains(needle))
            .map(|(at, _)| *at)
    };
    let init = find(INIT_MARKER).ok_or_else(|| LinuxBenchError::NoMilestone {
        vm: which.label().into(),
        what: "the /init marker line",
    })?;
    let first_kernel_line = vm
        .lines
        .iter()
        .find(|(_, l)| is_printk_line(l))
        .map(|(at, _)| since(*at));
    Ok(BootSample {
        first_kernel_line,
        init: since(init),
        listening: since(listening),
        ready: since(ready),
        lines: vm.transcript(),
        threads,
    })
}

fn keep_console(
    config: &LinuxBenchConfig,
    name: &str,
    lines: &[(f64, String)],
) -> Result<(), LinuxBenchError> {
    let Some(dir) = &config.keep_consoles else {
        return Ok(());
    };
    std::fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    let path = dir.join(name);
    let text: String = lines
        .iter()
        .map(|(at, l)| format!("{at:10.1} ms  {l}\n"))
        .collect();
    std::fs::write(&path, text).map_err(io_err("writing", &path))
}

fn boot_figures(which: Which, samples: &[BootSample]) -> Result<BootFigures, LinuxBenchError> {
    let get = |f: fn(&BootSample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
    let first: Vec<f64> = samples.iter().filter_map(|s| s.first_kernel_line).collect();
    let ready = summary("agent ready", &get(|s| s.ready))?;
    // The round whose agent-ready time is the median one.
    let median_round = samples
        .iter()
        .find(|s| s.ready == ready.p50)
        .or(samples.first());
    let kernel_cmdline = median_round.and_then(|s| {
        s.lines
            .iter()
            .find_map(|(_, l)| l.split_once("Command line: ").map(|(_, c)| c.to_string()))
    });
    Ok(BootFigures {
        vmm: which.label().into(),
        first_kernel_line_ms: (first.len() == samples.len())
            .then(|| summarize(&first))
            .flatten(),
        init_ms: summary("/init", &get(|s| s.init))?,
        agent_listening_ms: summary("agent listening", &get(|s| s.listening))?,
        agent_ready_ms: ready,
        kernel_cmdline,
        largest_gaps: median_round
            .map(|s| largest_gaps(&s.lines, 0.0, GAPS_SHOWN))
            .unwrap_or_default(),
        cpu_ms_by_thread: median_round.map(|s| s.threads.clone()).unwrap_or_default(),
    })
}

pub(super) fn run_boot(
    config: &LinuxBenchConfig,
    kernel: &Path,
    work: &Path,
) -> Result<BootReport, LinuxBenchError> {
    must_exist(
        "QEMU",
        &config.qemu,
        "apt-get install qemu-system-x86, or pass --qemu PATH",
    )?;
    if !Path::new("/dev/vhost-vsock").exists() {
        return Err(LinuxBenchError::Host(
            "/dev/vhost-vsock is missing: QEMU's vsock needs the vhost_vsock module \
             (modprobe vhost_vsock; in the lab: scripts/lab/run.sh --modprobe vhost_vsock)"
                .into(),
        ));
    }
    let initramfs = work.join("initramfs.cpio");
    let initramfs_bytes = build_initramfs(config, &initramfs)?;
    eprintln!(
        "linux boot: initramfs {} KiB (busybox {}, agent {})",
        initramfs_bytes >> 10,
        config.busybox.display(),
        config.agent.display()
    );
    let mut rollbox = Vec::new();
    let mut qemu = Vec::new();
    let total = config.warmup + config.rounds;
    for round in 0..total {
        let warm = round < config.warmup;
        // Alternate which VMM goes first, round by round.
        let order = if round % 2 == 0 {
            [Which::Rollbox, Which::Qemu]
        } else {
            [Which::Qemu, Which::Rollbox]
        };
        for which in order {
            let sample = boot_once(config, which, kernel, &initramfs, work, round)?;
            eprintln!(
                "linux boot {} {}/{}{}: first kernel line {}, /init {:.0} ms, agent listening {:.0} ms, agent ready {:.0} ms",
                which.label(),
                round + 1,
                total,
                if warm { " (warm-up)" } else { "" },
                sample
                    .first_kernel_line
                    .map_or("n/a".into(), |v| format!("{v:.0} ms")),
                sample.init,
                sample.listening,
                sample.ready
            );
            let name = match which {
                Which::Rollbox => format!("boot-rollbox-{round}.log"),
                Which::Qemu => format!("boot-qemu-{round}.log"),
            };
            keep_console(config, &name, &sample.lines)?;
            if !warm {
                match which {
                    Which::Rollbox => rollbox.push(sample),
                    Which::Qemu => qemu.push(sample),
                }
            }
        }
    }
    Ok(BootReport {
        rollbox: boot_figures(Which::Rollbox, &rollbox)?,
        qemu: boot_figures(Which::Qemu, &qemu)?,
        qemu_machine: config.qemu_machine.clone(),
        initramfs_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linux::tests::config;

    #[test]
    fn printk_lines() {
        assert!(is_printk_line("[    0.000000] Linux version 6.1"));
        assert!(is_printk_line("[   12.345678] Run /init as init process"));
        assert!(!is_printk_line(INIT_MARKER));
        assert!(!is_printk_line("[INFO] listening"));
        assert!(!is_printk_line("[] x"));
    }

    #[test]
    fn gaps_biggest_first() {
        let lines = vec![
            (10.0, "a".to_string()),
            (15.0, "b".to_string()),
            (115.0, "c".to_string()),
            (120.0, "d".to_string()),
        ];
        let gaps = largest_gaps(&lines, 0.0, 2);
        assert_eq!(gaps.len(), 2);
        assert_eq!((gaps[0].ms, gaps[0].line.as_str()), (100.0, "c"));
        assert_eq!((gaps[1].ms, gaps[1].line.as_str()), (10.0, "a"));
    }

    #[test]
    fn task_stat_fields() {
        let text = "4242 (CPU 0/KVM) S 1 2 3 4 5 6 7 8 9 10 150 25 0 0 20 0 1 0 99 0 0";
        assert_eq!(
            parse_task_stat(text, 100.0),
            Some(("CPU 0/KVM".to_string(), 1750.0))
        );
        assert_eq!(parse_task_stat("garbage", 100.0), None);
    }

    #[test]
    fn qemu_gets_the_same_machine() {
        let args = qemu_args(&config(), Path::new("/k"), Path::new("/i"));
        let joined = args.join(" ");
        assert!(joined.contains("-accel kvm -M microvm -cpu host -m 256M -smp 2"));
        assert!(joined.contains("-kernel /k -initrd /i"));
        assert!(joined.contains("-device vhost-vsock-device,guest-cid=42"));
        let append = args
            .iter()
            .position(|a| a == "-append")
            .map(|i| args[i + 1].clone());
        assert_eq!(append.as_deref(), Some("console=ttyS0 tsc=reliable"));
    }
}
