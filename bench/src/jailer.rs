//! `rollbox-bench jailer`: what rollbox-jailer adds to a start, step by step. Each round runs
//! `rollbox-vmm --version` once bare and once jailed (alternating, the jail as `rollbox serve`
//! makes it: a new network namespace, pids and memory cgroups), with
//! `ROLLBOX_JAILER_TIMINGS=1`, and reads the jailer's step lines (milliseconds since its
//! `main`). The difference of the two wall times is what jailing adds to a cold start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::Serialize;

use crate::stats::{summarize, Summary};

/// Where and how often to measure.
pub struct JailerBenchConfig {
    pub jailer: PathBuf,
    pub vmm: PathBuf,
    pub rounds: usize,
    /// The jails' base directory (made and removed here).
    pub dir: PathBuf,
}

#[derive(Debug, Serialize)]
pub struct JailerReport {
    pub rounds: usize,
    pub bare_ms: Summary,
    pub jailed_ms: Summary,
    /// (step, milliseconds since the jailer's main), in the order the jailer reached them.
    pub steps: Vec<(String, Summary)>,
    pub libraries: usize,
}

/// A jail-uid-readable copy of the VMM, so the jail may execute it wherever it was built.
fn stage_vmm(vmm: &Path, dir: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt as _;
    let staged = dir.join("rollbox-vmm");
    std::fs::copy(vmm, &staged).map_err(|e| format!("copy {}: {e}", vmm.display()))?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {}: {e}", staged.display()))?;
    Ok(staged)
}

fn wall_ms(command: &mut Command) -> Result<(f64, String), String> {
    let started = Instant::now();
    let output = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("run {command:?}: {e}"))?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        return Err(format!("{command:?} failed ({}): {stderr}", output.status));
    }
    Ok((ms, stderr))
}

pub fn run(config: &JailerBenchConfig) -> Result<JailerReport, String> {
    let base = config
        .dir
        .join(format!("rollbox-bench-jailer-{}", std::process::id()));
    std::fs::create_dir_all(&base).map_err(|e| format!("mkdir {}: {e}", base.display()))?;
    let result = measure(config, &base);
    let _ = std::fs::remove_dir_all(&base);
    result
}

fn measure(config: &JailerBenchConfig, base: &Path) -> Result<JailerReport, String> {
    let vmm = stage_vmm(&config.vmm, base)?;
    let libraries = rollbox_jailer::elf::shared_libraries(&vmm)
        .map_err(|e| e.to_string())?
        .len();
    let cgroup_memory = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        "memory.max=1073741824"
    } else {
        "memory.limit_in_bytes=1073741824"
    };
    let (mut bare, mut jailed) = (Vec::new(), Vec::new());
    let mut order: Vec<String> = Vec::new();
    let mut steps: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for round in 0..config.rounds {
        bare.push(wall_ms(Command::new(&vmm).arg("--version"))?.0);
        let id = format!("bench-{round}");
        let (ms, stderr) = wall_ms(
            Command::new(&config.jailer)
                .env("ROLLBOX_JAILER_TIMINGS", "1")
                .args([
                    "--id",
                    &id,
                    "--uid",
                    "64000",
                    "--gid",
                    "64000",
                    "--new-netns",
                ])
                .arg("--exec")
                .arg(&vmm)
                .arg("--chroot-base")
                .arg(base.join("jails"))
                .args(["--cgroup-parent", "rollbox-bench-jailer"])
                .args(["--cgroup", "pids.max=512", "--cgroup", cgroup_memory])
                .args(["--", "--version"]),
        )?;
        jailed.push(ms);
        let _ = std::fs::remove_dir_all(base.join("jails").join(&id));
        for line in stderr.lines() {
            let Some(rest) = line.strip_prefix("rollbox-jailer timing: ") else {
                continue;
            };
            let Some((step, ms)) = rest.rsplit_once(' ') else {
                continue;
            };
            let Ok(ms) = ms.parse::<f64>() else { continue };
            if !order.iter().any(|s| s == step) {
                order.push(step.to_string());
            }
            steps.entry(step.to_string()).or_default().push(ms);
        }
    }
    remove_parent_groups(Path::new("/sys/fs/cgroup"), "rollbox-bench-jailer");
    let summary = |samples: &[f64], what: &str| {
        summarize(samples).ok_or_else(|| format!("no {what} samples"))
    };
    let steps = order
        .into_iter()
        .map(|step| {
            let samples = steps.remove(&step).unwrap_or_default();
            summary(&samples, &step).map(|s| (step, s))
        })
        .collect::<Result<Vec<_>, String>>()?;
    if steps.is_empty() {
        return Err("the jailer printed no timing lines (is it this workspace's?)".into());
    }
    Ok(JailerReport {
        rounds: config.rounds,
        bare_ms: summary(&bare, "bare")?,
        jailed_ms: summary(&jailed, "jailed")?,
        steps,
        libraries,
    })
}

/// The (by now empty) parent group of the jails in every hierarchy.
fn remove_parent_groups(fs: &Path, parent: &str) {
    for dir in rollbox_jailer::existing_groups(fs, "", parent) {
        let _ = rollbox_jailer::remove_group(&dir);
    }
}

pub fn markdown(report: &JailerReport) -> String {
    let mut out = format!(
        "## rollbox-bench jailer ({} rounds; `rollbox-vmm --version` bare and jailed, alternating; the VMM needs {} loader and library files)\n\n",
        report.rounds, report.libraries
    );
    out.push_str("| figure | p50 | p90 | min |\n| --- | --- | --- | --- |\n");
    let row = |name: &str, s: &Summary| {
        format!(
            "| {name} | {:.2} ms | {:.2} ms | {:.2} ms |\n",
            s.p50, s.p90, s.min
        )
    };
    out.push_str(&row("bare: spawn to exit", &report.bare_ms));
    out.push_str(&row(
        "jailed: spawn to exit (jail made and removed)",
        &report.jailed_ms,
    ));
    out.push_str(&format!(
        "| jailing adds (p50 difference) | {:.2} ms | | |\n",
        report.jailed_ms.p50 - report.bare_ms.p50
    ));
    out.push_str(
        "\nEach step of the jailer, as ms from its `main` (p50 of when the step ended):\n\n",
    );
    out.push_str("| step | p50 | p90 |\n| --- | --- | --- |\n");
    for (step, s) in &report.steps {
        out.push_str(&format!("| {step} | {:.3} | {:.3} |\n", s.p50, s.p90));
    }
    out
}
