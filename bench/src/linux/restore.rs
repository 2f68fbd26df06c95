//! Part 2, restore: a booted Linux guest (busybox rootfs, the agent as init) snapshotted, then
//! restored with cow and with uffd + prefetch until the agent answers, beside rollbox-vmm's
//! own cold boot of the same VM.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::agent::{AgentAddr, AGENT_LISTENING, ROLLBOX_CID};
use super::config::LinuxBenchConfig;
use super::error::{io_err, LinuxBenchError};
use super::figures::{ms, summary};
use super::vm::VmProcess;
use crate::stats::Summary;

/// ms from process start until the agent answers, with the steps on the way.
#[derive(Debug, Clone, Serialize)]
pub struct ReadyFigures {
    /// The vsock Unix socket accepted a connection (for a cold boot: the first attempt,
    /// made once the agent's listening line is on the console).
    pub socket_ms: Summary,
    /// The guest answered the vsock connection request (`OK` of `CONNECT 1024`).
    pub vsock_connected_ms: Summary,
    /// The agent answered `hello`.
    pub agent_ready_ms: Summary,
}

/// Part 2.
#[derive(Debug, Clone, Serialize)]
pub struct RestoreReport {
    /// rollbox-vmm boot of the same VM.
    pub cold_boot: ReadyFigures,
    /// `--restore --restore-backend cow`.
    pub restore_cow: ReadyFigures,
    /// `--restore-backend uffd --prefetch` (working set recorded once before).
    pub restore_uffd_prefetch: ReadyFigures,
    /// The `PUT /snapshot/create` call.
    pub snapshot_create_ms: f64,
    /// Blocks allocated by the memory file.
    pub memory_file_allocated_mib: f64,
    pub working_set_file_bytes: u64,
    /// rollbox-vmm's own restore phases (`--level Debug`) from one extra cow restore.
    pub cow_restore_phases: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RestoreKind {
    Cold,
    Cow,
    UffdPrefetch,
}

impl RestoreKind {
    fn label(self) -> &'static str {
        match self {
            RestoreKind::Cold => "cold boot",
            RestoreKind::Cow => "restore cow",
            RestoreKind::UffdPrefetch => "restore uffd + prefetch",
        }
    }
}

fn restore_args(snap: &Path, backend: &str, extra: &[&str], sock: &Path) -> Vec<String> {
    let mut args = vec![
        "--restore".to_string(),
        snap.display().to_string(),
        "--restore-backend".into(),
        backend.into(),
        "--vsock-uds".into(),
        sock.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

pub(super) fn run_restore(
    config: &LinuxBenchConfig,
    kernel: &Path,
    rootfs: &Path,
    work: &Path,
) -> Result<RestoreReport, LinuxBenchError> {
    // The root drive is read-only, so every VM (and every restore) sees the same disk.
    let cold_args = |sock: &Path| -> Vec<String> {
        vec![
            "--kernel".into(),
            kernel.display().to_string(),
            "--memory-mib".into(),
            config.memory_mib.to_string(),
            "--vcpus".into(),
            config.vcpus.to_string(),
            "--drive".into(),
            format!("{},root,readonly", rootfs.display()),
            "--cmdline".into(),
            format!("{} init=/.rollbox/rollbox-agent", config.cmdline),
            "--vsock-uds".into(),
            sock.display().to_string(),
            "--vsock-cid".into(),
            ROLLBOX_CID.to_string(),
        ]
    };

    // Boot the VM to snapshot, wait for its agent, pause, snapshot.
    let api_sock = work.join("api.sock");
    let source_sock = work.join("source.sock");
    let mut args = cold_args(&source_sock);
    args.extend(["--api-sock".into(), api_sock.display().to_string()]);
    let mut source = VmProcess::spawn("rollbox-vmm (snapshot source)", &config.vmm, &args)?;
    let deadline = source.started + config.boot_timeout;
    source.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
    let ready = source
        .wait_hello(&AgentAddr::Unix(source_sock), deadline)?
        .answered;
    eprintln!(
        "linux restore: snapshot source booted, agent answered after {:.0} ms",
        ms(ready.saturating_duration_since(source.started))
    );
    let snap = work.join("snapshot");
    std::fs::create_dir_all(&snap).map_err(io_err("creating", &snap))?;
    let api = vmm_api::Client::new(&api_sock).with_timeout(Duration::from_secs(600));
    api.pause()?;
    let params = vmm_api::CreateSnapshotParams {
        snapshot_type: "Full".into(),
        snapshot_path: snap.join("vmstate"),
        mem_file_path: snap.join("memory"),
        version: None,
        rollbox: None,
    };
    let started = Instant::now();
    api.create_snapshot(&params)?;
    let snapshot_create_ms = ms(started.elapsed());
    source.stop();
    drop(source);
    let memory = snap.join("memory");
    let memory_file_allocated_mib = {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&memory).map_err(io_err("reading", &memory))?;
        (meta.blocks() * 512) as f64 / f64::from(1 << 20)
    };
    eprintln!(
        "linux restore: snapshot created in {snapshot_create_ms:.0} ms, memory file {memory_file_allocated_mib:.1} MiB allocated"
    );

    // Record the working set once: a uffd restore until the agent answers, then a clean exit.
    let record_sock = work.join("record.sock");
    let mut record = VmProcess::spawn(
        "rollbox-vmm (record working set)",
        &config.vmm,
        &restore_args(&snap, "uffd", &["--record-working-set"], &record_sock),
    )?;
    let deadline = record.started + config.boot_timeout;
    record.wait_hello(&AgentAddr::Unix(record_sock), deadline)?;
    record.stop();
    drop(record);
    let ws = snap.join("memory.ws");
    let working_set_file_bytes = std::fs::metadata(&ws)
        .map_err(|_| LinuxBenchError::Missing {
            what: "recorded working set",
            path: ws.clone(),
            hint: "rollbox-vmm --record-working-set saves it when it exits on SIGTERM",
        })?
        .len();
    eprintln!("linux restore: working set recorded ({working_set_file_bytes} bytes)");

    let kinds = [
        RestoreKind::Cold,
        RestoreKind::Cow,
        RestoreKind::UffdPrefetch,
    ];
    // Per kind: (socket accepts, guest answers the vsock connection, agent answers), ms.
    let mut samples: [Vec<[f64; 3]>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..config.rounds {
        for i in 0..kinds.len() {
            // Rotate the order round by round.
            let k = (round + i) % kinds.len();
            let kind = kinds[k];
            let sock = work.join(format!("r{round}-{k}.sock"));
            let args = match kind {
                RestoreKind::Cold => cold_args(&sock),
                RestoreKind::Cow => restore_args(&snap, "cow", &[], &sock),
                RestoreKind::UffdPrefetch => restore_args(&snap, "uffd", &["--prefetch"], &sock),
            };
            let mut vm = VmProcess::spawn(
                &format!("rollbox-vmm ({})", kind.label()),
                &config.vmm,
                &args,
            )?;
            let deadline = vm.started + config.boot_timeout;
            if kind == RestoreKind::Cold {
                vm.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
            }
            let times = vm.wait_hello(&AgentAddr::Unix(sock.clone()), deadline)?;
            let since = |at: Instant| ms(at.saturating_duration_since(vm.started));
            let sample = [
                since(times.first_connect),
                since(times.guest_connected),
                since(times.answered),
            ];
            drop(vm);
            let _ = std::fs::remove_file(&sock);
            eprintln!(
                "linux restore {}/{}: {}: socket {:.0} ms, guest vsock {:.0} ms, agent answered {:.0} ms",
                round + 1,
                config.rounds,
                kind.label(),
                sample[0],
                sample[1],
                sample[2]
            );
            samples[k].push(sample);
        }
    }

    // One more cow restore, unmeasured, with rollbox-vmm's restore phases logged.
    let phase_sock = work.join("phases.sock");
    let mut args = restore_args(&snap, "cow", &[], &phase_sock);
    args.extend(["--level".into(), "Debug".into()]);
    let mut vm = VmProcess::spawn("rollbox-vmm (cow, --level Debug)", &config.vmm, &args)?;
    let deadline = vm.started + config.boot_timeout;
    vm.wait_hello(&AgentAddr::Unix(phase_sock), deadline)?;
    vm.stop();
    let stderr = vm.stderr_tail_all();
    drop(vm);
    let cow_restore_phases = stderr
        .lines()
        .filter_map(|l| l.find("restore: ").map(|i| l[i..].to_string()))
        .collect();

    let [cold, cow, uffd] = samples;
    let figures =
        |what: &'static str, samples: &[[f64; 3]]| -> Result<ReadyFigures, LinuxBenchError> {
            let column = |i: usize| samples.iter().map(|s| s[i]).collect::<Vec<_>>();
            Ok(ReadyFigures {
                socket_ms: summary(what, &column(0))?,
                vsock_connected_ms: summary(what, &column(1))?,
                agent_ready_ms: summary(what, &column(2))?,
            })
        };
    Ok(RestoreReport {
        cold_boot: figures("cold boot", &cold)?,
        restore_cow: figures("restore cow", &cow)?,
        restore_uffd_prefetch: figures("restore uffd + prefetch", &uffd)?,
        snapshot_create_ms,
        memory_file_allocated_mib,
        working_set_file_bytes,
        cow_restore_phases,
    })
}
