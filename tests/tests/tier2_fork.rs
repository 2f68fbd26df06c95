//! Tier 2: fork of the test guest on real KVM — clones with their own sockets and drives, no
//! processes, files or descriptors left behind (even when the parent is SIGKILLed mid-fork),
//! an opt-in and bounded pool, and a parent whose block I/O keeps going while clones load.

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rollbox_tests::{
    api_client, boot_with_api, fork_params, kvm_available, raw_image, wait_for_file_line, Vm,
};
use vmm_api::{CloneInfo, ForkParams};

/// `POST /fork` on `vm`; returns the clones of the answer (asserting it succeeded).
fn fork(vm: &Vm, params: &ForkParams) -> Vec<CloneInfo> {
    vm.api()
        .fork(params)
        .unwrap_or_else(|e| panic!("{e}"))
        .clones
}

fn pid_of(clone: &CloneInfo) -> i32 {
    clone.pid.expect("pid") as i32
}

/// Asserts that the clone whose API socket is `sock` runs its VM.
fn assert_running(sock: &Path) {
    let info = api_client(sock).vm_info().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(info.state, "Running", "{info:?}");
}

fn signal(pid: i32, signal: i32) {
    // SAFETY: signals a process this test started (a VMM or one of its clones).
    unsafe { libc::kill(pid, signal) };
}

fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Waits (up to `timeout`) until `done` holds; panics naming `what` otherwise.
fn wait_until(timeout: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(marker)
                })
                .unwrap_or(false)
        })
        .collect()
}

/// Entries of /dev/shm: all of them, and those whose name contains one of `markers`.
fn shm_entries(markers: &[String]) -> (usize, Vec<String>) {
    let names: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let ours = names
        .iter()
        .filter(|n| markers.iter().any(|m| n.contains(m.as_str())))
        .cloned()
        .collect();
    (names.len(), ours)
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The VMM's open fds once no API connection of ours is still being closed: the same count
/// twice, 100 ms apart.
fn settled_fd_count(pid: u32) -> usize {
    let mut last = fd_count(pid);
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let now = fd_count(pid);
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// The markers in the names of every file and process a fork of `parent` makes.
fn markers(parent: u32) -> Vec<String> {
    vec![
        format!("rollbox-fork-{parent}-"),
        format!("rollbox-pool-{parent}-"),
    ]
}

fn our_processes(markers: &[String]) -> Vec<i32> {
    markers.iter().flat_map(|m| processes_with(m)).collect()
}

fn sector_bytes(image: &Path, sector: u64, len: usize) -> Vec<u8> {
    let file = std::fs::File::open(image).unwrap_or_else(|e| panic!("{}: {e}", image.display()));
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, sector * 512)
        .unwrap_or_else(|e| panic!("{}: {e}", image.display()));
    buf
}

#[test]
fn fork_starts_clones_with_their_own_sockets_and_drives() {
    if !kvm_available() {
        return;
    }
    let mut vm = boot_with_api(&[]);
    assert_eq!(vm.ok("vsock-listen 1024"), "");
    assert_eq!(vm.ok("blk-write 0 3 666f726b"), "");
    // The guest computes while the fork snapshots it; the read of sector 3 waits in its serial
    // FIFO, so every clone runs it too, on its own drive, once the computation ends.
    vm.send("compute 60000\nblk-read 0 3 1\n");
    vm.expect_line("progress 1");
    let fork_dir = vm.path("fork");
    let clones = fork(
        &vm,
        &ForkParams {
            dir: Some(fork_dir),
            ..fork_params(4)
        },
    );
    assert_eq!(clones.len(), 4);
    // The parent keeps running: it ends the computation and reads its drive.
    let read = loop {
        let line = vm
            .next_line(Duration::from_secs(120))
            .unwrap_or_else(|| panic!("parent: no answer; {}", vm.stderr()));
        if line.starts_with("OK ") && !line.starts_with("OK 0x") {
            break line;
        }
    };
    assert!(read.starts_with("OK 666f726b00"), "parent read {read:?}");
    // Now the parent changes sector 3; no clone may see that.
    assert_eq!(vm.ok("blk-write 0 3 70617265"), "");
    assert_eq!(vm.ok("echo parent"), "parent");
    let mut uds = Vec::new();
    for clone in &clones {
        assert_eq!(clone.error, None, "{clone:?}");
        let sock = clone.vsock_uds.clone().expect("uds");
        assert!(!uds.contains(&sock), "clones must not share a vsock socket");
        uds.push(sock.clone());
        // Each clone's guest read sector 3 from its own drive as it was at the fork.
        let line = wait_for_file_line(&clone.console, Duration::from_secs(120), |l| {
            l.starts_with("OK ") && !l.starts_with("OK 0x") || l.starts_with("ERR")
        });
        assert!(
            line.starts_with("OK 666f726b00"),
            "clone {}: its guest read {line:?} from sector 3",
            clone.index
        );
        let mut s = UnixStream::connect(&sock).expect("clone vsock");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        s.write_all(b"CONNECT 1024\n").expect("connect");
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while b[0] != b'\n' {
            s.read_exact(&mut b).expect("OK line");
            line.push(b[0]);
        }
        s.write_all(b"ping\n").expect("send");
        let mut echo = [0u8; 5];
        s.read_exact(&mut echo).expect("echo");
        assert_eq!(&echo, b"ping\n");
        assert_running(&clone.api_sock);
        // On the host: the clone's drive is a copy of its own, untouched by the parent.
        let clone_dir = clone.api_sock.parent().expect("clone dir");
        let copy = clone_dir.join("drive0.img");
        assert_ne!(copy, vm.path("disk.img"));
        assert_eq!(
            sector_bytes(&copy, 3, 4),
            b"fork",
            "clone {}: {}",
            clone.index,
            copy.display()
        );
        signal(pid_of(clone), libc::SIGTERM);
    }
    assert_eq!(sector_bytes(&vm.path("disk.img"), 3, 4), b"pare");
    // Raw: a count out of range, and the status of its refusal.
    let answer = vm
        .api()
        .request("POST", "/fork", Some(br#"{"count":0}"#))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(answer.status, 400, "{}", answer.text());
}

/// Forks of 8 in this test: 50 by default (25 from a parent that is then SIGKILLed in the
/// middle of its 26th fork, 25 from a second parent); `ROLLBOX_FORK_ROUNDS=N` for N.
fn fork_rounds() -> usize {
    std::env::var("ROLLBOX_FORK_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
}

/// Forks `rounds` times 8 clones of `vm` into default directories, checks every clone runs,
/// and ends them; returns the clones of the last round still running when `keep_last`.
fn fork_rounds_of_eight(vm: &Vm, rounds: usize, keep_last: bool) -> Vec<CloneInfo> {
    let mut kept = Vec::new();
    for round in 0..rounds {
        let clones = fork(vm, &fork_params(8));
        assert_eq!(clones.len(), 8);
        for clone in &clones {
            assert_eq!(clone.error, None, "round {round}: {clone:?}");
            assert_running(&clone.api_sock);
        }
        if keep_last && round + 1 == rounds {
            kept = clones;
            break;
        }
        for clone in &clones {
            signal(pid_of(clone), libc::SIGTERM);
        }
        for clone in &clones {
            let pid = pid_of(clone);
            wait_until(
                Duration::from_secs(30),
                &format!("clone {pid} ends"),
                || !alive(pid),
            );
        }
    }
    kept
}

#[test]
fn fifty_forks_of_eight_with_the_parent_killed_halfway_leave_no_processes_files_or_fds() {
    if !kvm_available() {
        return;
    }
    let rounds = fork_rounds();
    let first_half = rounds / 2;
    let started = Instant::now();
    let (shm_total_before, _) = shm_entries(&[]);

    // The first parent: forks, then is SIGKILLed in the middle of a fork.
    let mut parent = boot_with_api(&[]);
    let pid_a = parent.child.id();
    let markers_a = markers(pid_a);
    let fds_a_before = settled_fd_count(pid_a);
    let survivors = fork_rounds_of_eight(&parent, first_half, true);
    // Wait for the reapers: every clone but the 8 kept ones has been cleaned up.
    wait_until(Duration::from_secs(30), "first parent's clones end", || {
        our_processes(&markers_a).len() == survivors.len()
    });
    let fds_a_after = settled_fd_count(pid_a);

    // Raw: the test checks that no 200 comes back.
    let api = parent.api().with_timeout(Duration::from_secs(120));
    let in_flight =
        std::thread::spawn(move || api.request("POST", "/fork", Some(br#"{"count":8}"#)));
    // Kill the parent once the clones of its next fork are starting.
    let fork_marker = format!("rollbox-fork-{pid_a}-");
    wait_until(
        Duration::from_secs(30),
        "the next fork starts clones",
        || {
            processes_with(&fork_marker)
                .iter()
                .any(|pid| !survivors.iter().any(|c| pid_of(c) == *pid))
        },
    );
    signal(pid_a as i32, libc::SIGKILL);
    let _ = parent.child.wait();
    let answer = in_flight.join().expect("fork thread");
    assert!(
        answer.as_ref().map_or(true, |answer| answer.status != 200),
        "the fork answered although its parent was killed: {answer:?}"
    );
    // The clones of earlier forks are VMs of their own and keep running.
    for clone in &survivors {
        assert_running(&clone.api_sock);
    }
    // The half-started clones of the interrupted fork die with their parent.
    wait_until(
        Duration::from_secs(30),
        "the interrupted fork's clones end",
        || our_processes(&markers_a).len() == survivors.len(),
    );
    for clone in &survivors {
        signal(pid_of(clone), libc::SIGTERM);
    }
    wait_until(
        Duration::from_secs(30),
        "the first parent's processes end",
        || our_processes(&markers_a).is_empty(),
    );
    drop(parent);

    // The second parent: the other half of the forks.
    let parent = boot_with_api(&[]);
    let pid_b = parent.child.id();
    let markers_b = markers(pid_b);
    let fds_b_before = settled_fd_count(pid_b);
    fork_rounds_of_eight(&parent, rounds - first_half, false);
    wait_until(
        Duration::from_secs(30),
        "second parent's clones end",
        || our_processes(&markers_b).is_empty(),
    );
    let fds_b_after = settled_fd_count(pid_b);
    drop(parent);

    let all_markers: Vec<String> = markers_a.iter().chain(&markers_b).cloned().collect();
    let shm_left = || shm_entries(&all_markers).1;
    wait_until(Duration::from_secs(30), "fork files leave /dev/shm", || {
        shm_left().is_empty()
    });
    let (shm_total_after, _) = shm_entries(&[]);
    let stray = our_processes(&all_markers);
    eprintln!(
        "fork hygiene: {} forks of 8 ({first_half} from a parent then SIGKILLed mid-fork, {} from a second) in {:.1} s",
        rounds,
        rounds - first_half,
        started.elapsed().as_secs_f64()
    );
    eprintln!(
        "fork hygiene: processes of the forks: {} left (8 clones outlived the killed parent until ended)",
        stray.len()
    );
    eprintln!(
        "fork hygiene: /dev/shm entries: {shm_total_before} before, {shm_total_after} after (all users of the machine); of these forks: {} left",
        shm_left().len()
    );
    eprintln!(
        "fork hygiene: parent fds: first {fds_a_before} before, {fds_a_after} after {first_half} forks; second {fds_b_before} before, {fds_b_after} after {} forks",
        rounds - first_half
    );
    assert!(stray.is_empty(), "stray processes: {stray:?}");
    assert_eq!(fds_a_after, fds_a_before, "the first parent leaked fds");
    assert_eq!(fds_b_after, fds_b_before, "the second parent leaked fds");
}

#[test]
fn the_fork_pool_is_opt_in_and_bounded() {
    if !kvm_available() {
        return;
    }
    // Without --fork-pool a fork starts exactly its clones and nothing stays behind.
    let vm = boot_with_api(&[]);
    let ours = markers(vm.child.id());
    let clones = fork(&vm, &fork_params(8));
    let mut pids: Vec<i32> = clones.iter().map(pid_of).collect();
    pids.sort_unstable();
    let mut running = our_processes(&ours);
    running.sort_unstable();
    assert_eq!(running, pids, "processes besides the clones");
    // Raw: the pool's status as it is on the wire.
    let pool = |vm: &Vm| {
        vm.api()
            .request("GET", "/fork-pool", None)
            .unwrap_or_else(|e| panic!("{e}"))
            .text()
    };
    let body = pool(&vm);
    assert_eq!(body.trim(), r#"{"target":0,"ready":0}"#);
    for pid in pids {
        signal(pid, libc::SIGTERM);
    }
    wait_until(Duration::from_secs(30), "clones end", || {
        our_processes(&ours).is_empty()
    });
    drop(vm);

    // A pool keeps its size, whatever the forks ask for.
    let vm = boot_with_api(&["--fork-pool", "2"]);
    let ours = markers(vm.child.id());
    let body = pool(&vm);
    assert_eq!(body.trim(), r#"{"target":2,"ready":2}"#);
    let clones = fork(&vm, &fork_params(8));
    assert!(clones.iter().all(|c| c.error.is_none()), "{clones:?}");
    let body = pool(&vm);
    assert_eq!(body.trim(), r#"{"target":2,"ready":2}"#);
    assert_eq!(
        our_processes(&ours).len(),
        8 + 2,
        "8 clones and 2 idle shells"
    );
    for clone in &clones {
        signal(pid_of(clone), libc::SIGTERM);
    }
    wait_until(Duration::from_secs(30), "clones end", || {
        our_processes(&ours).len() == 2
    });
    // The idle shells end with their parent, and take their files with them.
    drop(vm);
    wait_until(Duration::from_secs(30), "pool shells end", || {
        our_processes(&ours).is_empty()
    });
    wait_until(Duration::from_secs(30), "pool files leave /dev/shm", || {
        shm_entries(&ours).1.is_empty()
    });

    // Too large a pool is refused at start, naming the limit.
    let mut vm = Vm::spawn_raw(
        &[
            "--api-sock".into(),
            "{dir}/api.sock".into(),
            "--fork-pool".into(),
            "65".into(),
        ],
        tempfile::tempdir().expect("tempdir"),
    );
    let status = vm.wait(Duration::from_secs(30));
    assert!(!status.success());
    assert!(vm.stderr().contains("at most 64"), "{}", vm.stderr());
}

#[test]
fn a_running_parents_block_io_keeps_going_while_16_clones_load() {
    if !kvm_available() {
        return;
    }
    // One command: 4 KiB written to the parent's drive in one request.
    const COMMAND: &str = "blk-fill 0 0 8 7";
    const BYTES: f64 = 8.0 * 512.0;
    let mut vm = boot_with_api(&[]);
    // 32 MiB of guest memory that every clone copies while loading (restore_backend copy):
    // a load phase long enough to measure on a fast host.
    assert_eq!(vm.ok("touch 32 1"), "8192");
    let api = vm.api();
    let kib_s = |n: usize, secs: f64| n as f64 * BYTES / secs / 1024.0;

    let before_start = Instant::now();
    let mut before = 0;
    while before_start.elapsed() < Duration::from_secs(2) {
        assert_eq!(vm.ok(COMMAND), "");
        before += 1;
    }
    let before_secs = before_start.elapsed().as_secs_f64();

    let forked = std::thread::spawn(move || {
        let sent = Instant::now();
        let answer = api.fork(&ForkParams {
            restore_backend: Some("copy".into()),
            ..fork_params(16)
        });
        (sent, Instant::now(), answer)
    });
    let mut done = Vec::new();
    while !forked.is_finished() {
        assert_eq!(vm.ok(COMMAND), "");
        done.push(Instant::now());
    }
    let (sent, answered, answer) = forked.join().expect("fork thread");
    let result = answer.unwrap_or_else(|e| panic!("{e}"));
    let paused = Duration::from_secs_f64(result.paused_ms / 1e3);
    let clones = &result.clones;
    assert!(clones.iter().all(|c| c.error.is_none()), "{clones:?}");
    // The parent resumed `paused` after the request at the latest; clones loaded until the
    // answer. Before clone loads left the event loop, no command completed in that window.
    let resumed = sent + paused;
    let loading: Vec<&Instant> = done
        .iter()
        .filter(|t| **t > resumed && **t < answered)
        .collect();
    let load_secs = answered.saturating_duration_since(resumed).as_secs_f64();
    let mut gaps: Vec<f64> = done
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    gaps.sort_by(f64::total_cmp);
    let timeline: Vec<String> = done
        .iter()
        .map(|t| {
            format!(
                "{:.0}",
                t.saturating_duration_since(sent).as_secs_f64() * 1e3
            )
        })
        .collect();
    eprintln!(
        "parent block I/O: commands done at (ms after the fork request) {}; answer at {:.0} ms",
        timeline.join(" "),
        answered.saturating_duration_since(sent).as_secs_f64() * 1e3
    );
    eprintln!(
        "parent block I/O: {:.0} KiB/s before the fork ({before} x 4 KiB in {before_secs:.2} s)",
        kib_s(before, before_secs)
    );
    eprintln!(
        "parent block I/O: {:.0} KiB/s while 16 clones loaded ({} x 4 KiB in {load_secs:.2} s after the parent resumed; paused {:.0} ms; longest gap between commands {:.0} ms)",
        kib_s(loading.len(), load_secs),
        loading.len(),
        paused.as_secs_f64() * 1e3,
        gaps.last().copied().unwrap_or(0.0) * 1e3
    );
    for clone in clones {
        signal(pid_of(clone), libc::SIGTERM);
    }
    assert!(
        loading.len() >= 2,
        "the parent's block I/O stood still while its clones loaded ({} commands in {load_secs:.2} s)",
        loading.len()
    );
}

#[test]
fn fork_is_a_library_call_that_returns_each_clones_result() {
    if !kvm_available() {
        return;
    }
    // A microVM built in this process, as an embedding program builds it: no API socket, no
    // rollbox-vmm parent; only the clones are rollbox-vmm processes.
    let scratch = tempfile::tempdir().expect("tempdir");
    let disk = scratch.path().join("disk.img");
    raw_image(&disk, 4 << 20);
    let mut resources = vmm::vmm_config::VmResources {
        boot_source: Some(vmm::vmm_config::BootSourceConfig {
            kernel_image_path: rollbox_tests::test_guest(),
            boot_args: Some(rollbox_tests::TEST_GUEST_CMDLINE.into()),
            initrd_path: None,
        }),
        console: vmm::vmm_config::ConsoleConfig::File {
            path: scratch.path().join("console.log"),
            max_bytes: vmm::vmm_config::DEFAULT_CONSOLE_MAX_BYTES,
        },
        ..Default::default()
    };
    let drive = vmm::vmm_config::DriveConfig::new("drive0", &disk);
    resources.upsert_drive(drive).expect("drive");
    let mut vm = vmm::builder::build_microvm(&resources).expect("build the microVM");
    let launcher = vmm::fork::Launcher::new(rollbox_tests::vmm_binary()).expect("launcher");
    let mut pool = vmm::fork::ForkPool::new(launcher, 0).expect("pool");
    let result = vmm::fork::fork(&mut vm, &fork_params(3), &mut pool).expect("fork");
    assert_eq!(result.clones.len(), 3);
    assert!(!vm.paused, "the parent resumes");
    for clone in &result.clones {
        assert_eq!(clone.error, None, "clone {}", clone.index);
        assert_running(&clone.api_sock);
        let drive = clone.api_sock.with_file_name("drive0.img");
        assert!(drive.is_file(), "{} is missing", drive.display());
    }
    for clone in &result.clones {
        signal(clone.pid.expect("pid") as i32, libc::SIGTERM);
    }
    for clone in &result.clones {
        let pid = clone.pid.expect("pid") as i32;
        wait_until(Duration::from_secs(30), "clones end", || !alive(pid));
    }
    // The clones took the default fork directory with them.
    wait_until(Duration::from_secs(30), "the fork directory goes", || {
        !result.snapshot_dir.exists()
    });
}
