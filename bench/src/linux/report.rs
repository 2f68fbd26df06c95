//! What `rollbox-bench linux` reports (as `--json` writes it), and the Linux benches' figures
//! as markdown: cells, ratios and verdicts against the targets.

use serde::Serialize;

use super::boot::BootReport;
use super::restore::{ReadyFigures, RestoreReport};
use crate::stats::Summary;

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

pub(crate) fn cell(s: &Summary) -> String {
    format!("{:.0} ({:.0}–{:.0})", s.p50, s.min, s.max)
}

pub(crate) fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "n/a".into()
    }
}

/// "met" or "missed by N×" for `value / base` against `target`.
pub fn verdict(value: f64, base: f64, target: f64) -> String {
    if base <= 0.0 {
        return "n/a".into();
    }
    let r = value / base;
    if r <= target {
        format!("met ({r:.2}×)")
    } else {
        format!("missed: {r:.2}×, {:.1}× over the target", r / target)
    }
}

/// The report as markdown tables.
pub fn markdown(report: &LinuxReport) -> String {
    let mut out = String::new();
    if let Some(boot) = &report.boot {
        let (r, q) = (&boot.rollbox, &boot.qemu);
        out.push_str(&format!(
            "### Linux boot: rollbox-vmm beside QEMU -M {} (same vmlinux and initramfs, {} MiB, {} vCPUs; median (min–max) of {} rounds, alternating)\n\n",
            boot.qemu_machine, report.memory_mib, report.vcpus, report.rounds
        ));
        out.push_str(
            "| ms from VMM process start to | rollbox-vmm | QEMU microvm | rollbox/QEMU |\n\
             | --- | ---: | ---: | ---: |\n",
        );
        let first = match (&r.first_kernel_line_ms, &q.first_kernel_line_ms) {
            (Some(a), Some(b)) => (cell(a), cell(b), ratio(a.p50, b.p50)),
            (a, b) => (
                a.as_ref().map_or("n/a".into(), cell),
                b.as_ref().map_or("n/a".into(), cell),
                "n/a".into(),
            ),
        };
        out.push_str(&format!(
            "| first kernel console line | {} | {} | {} |\n",
            first.0, first.1, first.2
        ));
        for (name, a, b) in [
            ("`/init` running (marker line)", &r.init_ms, &q.init_ms),
            (
                "agent listening (its console line)",
                &r.agent_listening_ms,
                &q.agent_listening_ms,
            ),
            (
                "**agent ready** (hello answered on a new vsock connection)",
                &r.agent_ready_ms,
                &q.agent_ready_ms,
            ),
        ] {
            out.push_str(&format!(
                "| {name} | {} | {} | {} |\n",
                cell(a),
                cell(b),
                ratio(a.p50, b.p50)
            ));
        }
        out.push_str(&format!(
            "\nTarget agent ready ≤ 0.5× QEMU microvm: {}.\n",
            verdict(r.agent_ready_ms.p50, q.agent_ready_ms.p50, 0.5)
        ));
        out.push_str(&format!(
            "Initramfs: {} KiB, uncompressed cpio.\n",
            boot.initramfs_bytes >> 10
        ));
        for figures in [r, q] {
            if let Some(cmdline) = &figures.kernel_cmdline {
                out.push_str(&format!(
                    "Kernel command line under {}: `{cmdline}`\n",
                    figures.vmm
                ));
            }
        }
        for figures in [r, q] {
            out.push_str(&format!(
                "\nLargest gaps between console lines, {} (median round; ms before the line, at ms):\n",
                figures.vmm
            ));
            for gap in &figures.largest_gaps {
                out.push_str(&format!(
                    "- {:.0} ms, at {:.0}: `{}`\n",
                    gap.ms, gap.at_ms, gap.line
                ));
            }
            let threads: Vec<String> = figures
                .cpu_ms_by_thread
                .iter()
                .map(|(name, cpu)| format!("{name} {cpu:.0}"))
                .collect();
            out.push_str(&format!(
                "\nCPU ms by thread of {} until the agent answered (median round): {}\n",
                figures.vmm,
                threads.join(", ")
            ));
        }
        out.push('\n');
    }
    if let Some(restore) = &report.restore {
        out.push_str(&format!(
            "### Restore of a Linux guest until the agent answers (rollbox-vmm, busybox rootfs with the agent as init, {} MiB, {} vCPUs; median (min–max) of {} rounds, rotating)\n\n",
            report.memory_mib, report.vcpus, report.rounds
        ));
        out.push_str(
            "| ms from process start to | cold boot of the same VM | restore, cow | restore, uffd + prefetch |\n\
             | --- | ---: | ---: | ---: |\n",
        );
        let kinds = [
            &restore.cold_boot,
            &restore.restore_cow,
            &restore.restore_uffd_prefetch,
        ];
        type Pick = fn(&ReadyFigures) -> &Summary;
        let rows: [(&str, Pick); 3] = [
            ("vsock socket accepts a connection", |f| &f.socket_ms),
            ("guest answers the vsock connection", |f| {
                &f.vsock_connected_ms
            }),
            ("**agent answers hello**", |f| &f.agent_ready_ms),
        ];
        for (name, pick) in rows {
            let cells: Vec<String> = kinds.iter().map(|f| cell(pick(f))).collect();
            out.push_str(&format!("| {name} | {} |\n", cells.join(" | ")));
        }
        let cold = restore.cold_boot.agent_ready_ms.p50;
        let cells: Vec<String> = kinds
            .iter()
            .map(|f| ratio(f.agent_ready_ms.p50, cold))
            .collect();
        out.push_str(&format!(
            "| agent answers, ÷ cold boot | {} |\n",
            cells.join(" | ")
        ));
        out.push_str(&format!(
            "\nTarget restore ≤ 0.1× cold boot: cow {}; uffd + prefetch {}. \
             (A cold boot's first attempt waits for the agent's listening line; a restore's \
             attempts start at process start.)\n",
            verdict(restore.restore_cow.agent_ready_ms.p50, cold, 0.1),
            verdict(restore.restore_uffd_prefetch.agent_ready_ms.p50, cold, 0.1)
        ));
        out.push_str(&format!(
            "Snapshot: create call {:.0} ms, memory file {:.1} MiB allocated, working set file {} bytes.\n",
            restore.snapshot_create_ms,
            restore.memory_file_allocated_mib,
            restore.working_set_file_bytes
        ));
        if !restore.cow_restore_phases.is_empty() {
            out.push_str("rollbox-vmm's restore phases (one more cow restore, --level Debug):\n");
            for phase in &restore.cow_restore_phases {
                out.push_str(&format!("- {phase}\n"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        assert_eq!(verdict(40.0, 100.0, 0.5), "met (0.40×)");
        assert_eq!(
            verdict(80.0, 100.0, 0.5),
            "missed: 0.80×, 1.6× over the target"
        );
        assert_eq!(verdict(1.0, 0.0, 0.5), "n/a");
    }
}
