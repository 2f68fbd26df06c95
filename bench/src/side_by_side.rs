//! `rollbox-bench side-by-side`: rollbox-vmm beside any other VMM that speaks Firecracker's
//! API, measured by `../shared/bench/fcbench.py` in one run, alternating VMM by VMM round by
//! round. Every figure comes from this run; without `--other` only rollbox-vmm's are printed.
//! With `--warm-shell`, a second rollbox-vmm column restores into a warm shell, the way the
//! daemon's warm pool does: fcbench's restore VMM is started with `--shell-memory-mib`, so its
//! empty VM is built before its API answers, and the load only restores state.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use crate::stats::{summarize, Summary};

/// The figures compared: fcbench.py's JSON key, the row's name and its unit.
pub const FIGURES: [(&str, &str); 6] = [
    ("spawn_to_api_ms", "process spawn -> GET / answered (ms)"),
    (
        "start_to_serial_ms",
        "InstanceStart sent -> first serial byte (ms)",
    ),
    ("snapshot_create_ms", "snapshot create, Full (ms)"),
    ("load_call_ms", "snapshot load call, File backend (ms)"),
    (
        "load_to_serial_ms",
        "load sent -> first new serial byte (ms)",
    ),
    ("overhead_kb", "VmRSS beyond touched guest memory (KiB)"),
];

#[derive(Debug, thiserror::Error)]
pub enum SideBySideError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program} failed ({status}): {stderr}")]
    Failed {
        program: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fcbench.py printed no result line for {vmm} (its output: {output:?})")]
    NoResult { vmm: String, output: String },
    #[error("fcbench.py's result line for {vmm} is not JSON: {line:?}: {source}")]
    BadLine {
        vmm: String,
        line: String,
        source: serde_json::Error,
    },
}

/// Settings.
#[derive(Debug, Clone)]
pub struct SideBySideConfig {
    pub fcbench: PathBuf,
    /// fcbench.py's directory (its guest sources and tsreader.c).
    pub fcbench_dir: PathBuf,
    /// Where the guest ELF and tsreader are built, and fcbench's scratch files go.
    pub work: PathBuf,
    pub snapdir: PathBuf,
    pub rollbox: PathBuf,
    /// The other VMM and its name in the table.
    pub other: Option<(PathBuf, String)>,
    pub mem_mib: u64,
    pub rounds: usize,
    /// Add the warm-shell column.
    pub warm_shell: bool,
}

/// The warm-shell column's name.
pub const WARM_SHELL: &str = "rollbox-vmm, warm shell";

/// One VMM's samples per figure (in [`FIGURES`] order).
#[derive(Debug, Clone, Serialize)]
pub struct VmmFigures {
    pub name: String,
    pub path: PathBuf,
    pub samples: Vec<Vec<f64>>,
}

/// The figures of one fcbench.py repetition, from its stdout: the last line that is a JSON
/// object. A figure fcbench could not measure (`null`, missing) is `None`.
pub fn parse_result(stdout: &str, vmm: &str) -> Result<Vec<Option<f64>>, SideBySideError> {
    let line = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|line| line.starts_with('{'))
        .ok_or_else(|| SideBySideError::NoResult {
            vmm: vmm.to_string(),
            output: stdout.chars().take(400).collect(),
        })?;
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|source| SideBySideError::BadLine {
            vmm: vmm.to_string(),
            line: line.chars().take(400).collect(),
            source,
        })?;
    Ok(FIGURES
        .iter()
        .map(|(key, _)| value.get(*key).and_then(serde_json::Value::as_f64))
        .collect())
}

fn run_checked(mut command: Command, program: &str) -> Result<String, SideBySideError> {
    let output = command.output().map_err(|source| SideBySideError::Spawn {
        program: program.to_string(),
        source,
    })?;
    if !output.status.success() {
        return Err(SideBySideError::Failed {
            program: program.to_string(),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr)
                .chars()
                .rev()
                .take(2000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Builds fcbench's guest and tsreader into `config.work` (never into fcbench's directory).
fn build_tools(config: &SideBySideConfig) -> Result<(PathBuf, PathBuf), SideBySideError> {
    let guest_dir = config.work.join("guest");
    std::fs::create_dir_all(&guest_dir).map_err(|source| SideBySideError::Io {
        path: guest_dir.clone(),
        source,
    })?;
    for name in ["fc-guest.c", "fc-guest.ld", "build-guest.sh"] {
        let from = config.fcbench_dir.join("guest").join(name);
        std::fs::copy(&from, guest_dir.join(name))
            .map_err(|source| SideBySideError::Io { path: from, source })?;
    }
    let mut build = Command::new("sh");
    build.arg(guest_dir.join("build-guest.sh"));
    run_checked(build, "sh guest/build-guest.sh")?;
    let tsreader = config.work.join("tsreader");
    let mut cc = Command::new("gcc");
    cc.args(["-O2", "-o"])
        .arg(&tsreader)
        .arg(config.fcbench_dir.join("tsreader.c"));
    run_checked(cc, "gcc tsreader.c")?;
    Ok((guest_dir.join("fc-guest.elf"), tsreader))
}

/// One fcbench.py repetition of `vmm`.
fn one_rep(
    config: &SideBySideConfig,
    guest: &Path,
    tsreader: &Path,
    vmm: &Path,
    name: &str,
) -> Result<Vec<Option<f64>>, SideBySideError> {
    let mut command = Command::new("python3");
    command
        .arg(&config.fcbench)
        .arg("--vmm")
        .arg(vmm)
        .arg("--guest")
        .arg(guest)
        .arg("--tsreader")
        .arg(tsreader)
        .args(["--mem", &config.mem_mib.to_string(), "--reps", "1"])
        .arg("--snapdir")
        .arg(&config.snapdir)
        .arg("--workdir")
        .arg(config.work.join("run"))
        .arg("--out")
        .arg(config.work.join(format!("results-{name}")));
    let stdout = run_checked(command, &format!("fcbench.py --vmm {}", vmm.display()))?;
    parse_result(&stdout, name)
}

/// A script that runs `vmm`, with a warm shell of `mem_mib` for fcbench's restore VMM (the
/// one whose API socket fcbench names `m<MEM>r<REP>b.sock`; its boot VMM is `...a.sock`).
fn warm_shell_script(vmm: &Path, mem_mib: u64) -> String {
    let vmm = vmm.display().to_string().replace('\'', "'\\''");
    format!(
        "#!/bin/sh\n# fcbench's restore VMM gets a warm shell; its boot VMM runs as it is.\ncase \"$*\" in\n  *b.sock*) exec '{vmm}' \"$@\" --shell-memory-mib {mem_mib} --shell-vcpus 1 ;;\nesac\nexec '{vmm}' \"$@\"\n"
    )
}

fn write_warm_shell_script(config: &SideBySideConfig) -> Result<PathBuf, SideBySideError> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = config.work.join("rollbox-vmm-warm-shell");
    let io = |source| SideBySideError::Io {
        path: path.clone(),
        source,
    };
    std::fs::write(&path, warm_shell_script(&config.rollbox, config.mem_mib)).map_err(io)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).map_err(io)?;
    Ok(path)
}

/// Runs every round: rollbox-vmm (and its warm-shell column) and the other VMM alternate, and
/// their order reverses every other round. A figure a repetition could not measure is left
/// out of that VMM's samples.
pub fn run(config: &SideBySideConfig) -> Result<Vec<VmmFigures>, SideBySideError> {
    let (guest, tsreader) = build_tools(config)?;
    let mut vmms = vec![VmmFigures {
        name: "rollbox-vmm".into(),
        path: config.rollbox.clone(),
        samples: vec![Vec::new(); FIGURES.len()],
    }];
    if config.warm_shell {
        vmms.push(VmmFigures {
            name: WARM_SHELL.into(),
            path: write_warm_shell_script(config)?,
            samples: vec![Vec::new(); FIGURES.len()],
        });
    }
    if let Some((path, name)) = &config.other {
        vmms.push(VmmFigures {
            name: name.clone(),
            path: path.clone(),
            samples: vec![Vec::new(); FIGURES.len()],
        });
    }
    for round in 0..config.rounds {
        let mut order: Vec<usize> = (0..vmms.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for index in order {
            let Some(vmm) = vmms.get_mut(index) else {
                continue;
            };
            eprintln!("round {}/{}: {}", round + 1, config.rounds, vmm.name);
            let figures = one_rep(config, &guest, &tsreader, &vmm.path, &vmm.name)?;
            for (samples, figure) in vmm.samples.iter_mut().zip(figures) {
                samples.extend(figure);
            }
        }
    }
    Ok(vmms)
}

fn cell(summary: Option<&Summary>) -> String {
    summary.map_or("n/a".into(), |s| {
        format!("{:.2} / {:.2} / {:.2}", s.p50, s.p90, s.min)
    })
}

/// The table: one column per VMM (p50 / p90 / min) and, with another VMM (the last column),
/// the ratio of its p50 to each rollbox-vmm column's (above 1: rollbox-vmm is faster or
/// smaller).
pub fn markdown(vmms: &[VmmFigures], config: &SideBySideConfig) -> String {
    let mut out = format!(
        "fcbench.py side by side (this run only): {} MiB guest, {} rounds, {}\n\n",
        config.mem_mib,
        config.rounds,
        if vmms.len() > 1 {
            "VMMs alternating"
        } else {
            "rollbox-vmm only (no --other)"
        }
    );
    let names: Vec<&str> = vmms.iter().map(|v| v.name.as_str()).collect();
    out.push_str(&format!(
        "| figure (p50 / p90 / min) | {} |",
        names.join(" | ")
    ));
    // The other VMM is the last column; each rollbox column before it gets a ratio.
    let ours = if config.other.is_some() {
        vmms.len().saturating_sub(1)
    } else {
        0
    };
    let other = vmms.get(ours).filter(|_| ours > 0);
    if let Some(other) = other {
        for name in &names[..ours] {
            out.push_str(&format!(" {} / {name} (p50) |", other.name));
        }
    }
    out.push('\n');
    out.push_str(&"| --- ".repeat(names.len() + 1 + ours));
    out.push_str("|\n");
    for (index, (_, label)) in FIGURES.iter().enumerate() {
        let summaries: Vec<Option<Summary>> = vmms
            .iter()
            .map(|v| v.samples.get(index).and_then(|s| summarize(s)))
            .collect();
        let cells: Vec<String> = summaries.iter().map(|s| cell(s.as_ref())).collect();
        out.push_str(&format!("| {label} | {} |", cells.join(" | ")));
        if other.is_some() {
            for mine in &summaries[..ours] {
                let ratio = match (mine, summaries.get(ours)) {
                    (Some(mine), Some(Some(theirs))) if mine.p50 > 0.0 => {
                        format!("{:.2}", theirs.p50 / mine.p50)
                    }
                    _ => "n/a".into(),
                };
                out.push_str(&format!(" {ratio} |"));
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = r#"{"mem_mib": 64, "rep": 0, "spawn_to_api_ms": 2.5, "start_to_serial_ms": 3.0, "snapshot_create_ms": 6.0, "load_call_ms": 1.5, "load_to_serial_ms": null, "overhead_kb": 4096}"#;

    fn config(other: bool) -> SideBySideConfig {
        SideBySideConfig {
            fcbench: PathBuf::new(),
            fcbench_dir: PathBuf::new(),
            work: PathBuf::new(),
            snapdir: PathBuf::new(),
            rollbox: PathBuf::from("rollbox-vmm"),
            other: other.then(|| (PathBuf::from("fc"), "firecracker".to_string())),
            mem_mib: 64,
            rounds: 2,
            warm_shell: false,
        }
    }

    #[test]
    fn parses_the_last_json_line_and_leaves_nulls_out() {
        let stdout = format!("round 1\n{{\"spawn_to_api_ms\": 9}}\n{LINE}\n| table |\n");
        let figures = parse_result(&stdout, "x").expect("parsed");
        assert_eq!(
            figures,
            vec![
                Some(2.5),
                Some(3.0),
                Some(6.0),
                Some(1.5),
                None,
                Some(4096.0)
            ]
        );
    }

    #[test]
    fn no_result_line_and_bad_json_name_the_vmm() {
        let err = parse_result("only a table\n", "fc").expect_err("no line");
        assert!(err.to_string().contains("for fc"), "{err}");
        let err = parse_result("{not json\n", "fc").expect_err("bad line");
        assert!(err.to_string().contains("{not json"), "{err}");
    }

    fn figures(name: &str, value: f64) -> VmmFigures {
        VmmFigures {
            name: name.into(),
            path: PathBuf::new(),
            samples: vec![vec![value, value]; FIGURES.len()],
        }
    }

    #[test]
    fn without_another_vmm_only_rollbox_figures_and_no_ratio() {
        let table = markdown(&[figures("rollbox-vmm", 2.0)], &config(false));
        assert!(
            !table.contains("ratio") && !table.contains("/ rollbox-vmm"),
            "{table}"
        );
        assert!(!table.to_lowercase().contains("firecracker"), "{table}");
        assert_eq!(table.lines().filter(|l| l.starts_with("| ")).count(), 8);
    }

    #[test]
    fn ratio_is_the_other_p50_over_rollbox_p50() {
        let table = markdown(
            &[figures("rollbox-vmm", 2.0), figures("firecracker", 5.0)],
            &config(true),
        );
        let row = table
            .lines()
            .find(|l| l.starts_with("| snapshot create"))
            .expect("row");
        assert!(row.ends_with("| 2.50 |"), "{row}");
        assert!(table.contains("firecracker / rollbox-vmm (p50)"), "{table}");
    }

    #[test]
    fn the_warm_shell_column_gets_its_own_ratio() {
        let mut with_shell = config(true);
        with_shell.warm_shell = true;
        let table = markdown(
            &[
                figures("rollbox-vmm", 2.0),
                figures(WARM_SHELL, 1.0),
                figures("firecracker", 5.0),
            ],
            &with_shell,
        );
        let row = table
            .lines()
            .find(|l| l.starts_with("| snapshot create"))
            .expect("row");
        assert!(row.ends_with("| 2.50 | 5.00 |"), "{row}");
        assert!(
            table.contains(&format!("firecracker / {WARM_SHELL} (p50)")),
            "{table}"
        );
        // Without another VMM the shell column is a column, with no ratio.
        let mut alone = config(false);
        alone.warm_shell = true;
        let table = markdown(
            &[figures("rollbox-vmm", 2.0), figures(WARM_SHELL, 1.0)],
            &alone,
        );
        assert!(!table.contains("(p50) |"), "{table}");
    }

    #[test]
    fn the_warm_shell_script_shells_only_the_restore_vmm() {
        let script = warm_shell_script(Path::new("/opt/it's/rollbox-vmm"), 256);
        assert!(script.starts_with("#!/bin/sh\n"), "{script}");
        assert!(
            script.contains("*b.sock*) exec '/opt/it'\\''s/rollbox-vmm' \"$@\" --shell-memory-mib 256 --shell-vcpus 1 ;;"),
            "{script}"
        );
        assert!(
            script.ends_with("exec '/opt/it'\\''s/rollbox-vmm' \"$@\"\n"),
            "{script}"
        );
    }
}
