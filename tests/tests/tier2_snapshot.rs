//! Tier 2: snapshots of the test guest on real KVM — pause/resume, full and diff snapshots,
//! restore in a new process with every memory backend, deterministic reset and clone
//! generations, snapshots that resume while their memory is written, and bad snapshot files.

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rollbox_tests::{
    api_client, boot_with_api, kvm_available, skip_even_in_ci, snapshot_params, vmm_binary, Vm,
};

fn pause(vm: &Vm) {
    vm.api().pause().unwrap_or_else(|e| panic!("{e}"));
}

/// Pauses and takes a snapshot into `dir` (vmstate + memory).
fn snapshot(vm: &Vm, dir: &Path, kind: &str) {
    std::fs::create_dir_all(dir).expect("snapshot dir");
    pause(vm);
    vm.api()
        .create_snapshot(&snapshot_params(kind, dir))
        .unwrap_or_else(|e| panic!("{e}"));
}

fn resume(vm: &Vm) {
    vm.api().resume().unwrap_or_else(|e| panic!("{e}"));
}

/// Restores `dir` in a new process; `extra` adds flags. Does not wait for output.
fn restore(dir: &Path, extra: &[&str]) -> Vm {
    let scratch = tempfile::tempdir().expect("tempdir");
    let mut args = vec![
        "--restore".to_string(),
        dir.display().to_string(),
        "--vsock-uds".into(),
        "{dir}/v.sock".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Vm::spawn_raw(&args, scratch)
}

/// Bytes of data (not holes) in a file, via SEEK_DATA / SEEK_HOLE.
fn data_bytes(path: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).expect("open");
    let end = file.metadata().expect("meta").len() as i64;
    let (mut offset, mut total) = (0i64, 0u64);
    while offset < end {
        // SAFETY: lseek on a file this function holds open.
        let data = unsafe { libc::lseek(file.as_raw_fd(), offset, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
        assert!(hole >= data, "SEEK_HOLE on {}", path.display());
        total += (hole - data) as u64;
        offset = hole;
    }
    total
}

/// A memory cgroup the test owns (under this process's own), removed on drop.
struct MemoryCgroup {
    dir: PathBuf,
    limit_file: &'static str,
}

impl MemoryCgroup {
    /// A new child of this process's memory cgroup (v1 or v2), or why there is none.
    fn create(name: &str) -> Result<Self, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let (base, limit_file) =
            if let Some(line) = own.lines().find(|l| l.split(':').nth(1) == Some("memory")) {
                let path = line.splitn(3, ':').nth(2).unwrap_or("/");
                (
                    PathBuf::from(format!("/sys/fs/cgroup/memory{path}")),
                    "memory.limit_in_bytes",
                )
            } else if let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::")) {
                (PathBuf::from(format!("/sys/fs/cgroup{path}")), "memory.max")
            } else {
                return Err("no memory cgroup in /proc/self/cgroup".into());
            };
        let dir = base.join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        Ok(Self { dir, limit_file })
    }

    fn limit(&self, bytes: u64) {
        std::fs::write(self.dir.join(self.limit_file), bytes.to_string()).expect("memory limit");
    }

    fn enter(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("join cgroup");
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A swap file enabled for one test (root only), switched off and removed on drop.
struct SwapFile {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl SwapFile {
    fn enable(mib: u64) -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("swap");
        let file = std::fs::File::create(&path).map_err(|e| e.to_string())?;
        // Swap files must not be sparse: write the zeros.
        let zeros = vec![0u8; 1 << 20];
        for i in 0..mib {
            file.write_all_at(&zeros, i << 20)
                .map_err(|e| e.to_string())?;
        }
        drop(file);
        let run = |program: &str| {
            Command::new(program)
                .arg(&path)
                .output()
                .map_err(|e| format!("{program}: {e}"))
                .and_then(|out| {
                    if out.status.success() {
                        Ok(())
                    } else {
                        Err(format!(
                            "{program}: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        ))
                    }
                })
        };
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .map_err(|e| e.to_string())?;
        run("mkswap")?;
        run("swapon")?;
        Ok(Self { _dir: dir, path })
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.path).status();
    }
}

/// `kB` of process `pid`'s memory that is swapped out.
fn swapped_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmSwap:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn snapdir(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    (dir, path)
}

fn compute_reference(n: u32) -> String {
    let mut vm = Vm::boot(&[]);
    let mut last = String::new();
    vm.send(&format!("compute {n}\n"));
    while let Some(line) = vm.next_line(Duration::from_secs(120)) {
        if line.starts_with("OK") {
            last = line;
            break;
        }
    }
    assert!(last.starts_with("OK 0x"), "reference compute: {last:?}");
    last
}

#[test]
fn snapshot_mid_computation_continues_in_a_new_process_for_every_backend() {
    if !kvm_available() {
        return;
    }
    const N: u32 = 100_000;
    let expected = compute_reference(N);
    for vcpus in ["1", "2"] {
        let (_keep, dir) = snapdir("snap");
        let mut vm = boot_with_api(&["--vcpus", vcpus]);
        if vcpus == "2" {
            // vCPU 1 counts in guest memory while vCPU 0 computes.
            assert_eq!(vm.ok("smp-start"), "");
        }
        vm.send(&format!("compute {N}\n"));
        vm.expect_line("progress 3");
        snapshot(&vm, &dir, "Full");
        let _ = vm.child.kill();
        for backend in ["cow", "uffd", "copy"] {
            let mut clone = restore(&dir, &["--restore-backend", backend]);
            let mut saw_progress = Vec::new();
            let result = loop {
                let line = clone
                    .next_line(Duration::from_secs(120))
                    .unwrap_or_else(|| panic!("{backend}/{vcpus}: no output; {}", clone.stderr()));
                if let Some(k) = line.strip_prefix("progress ") {
                    saw_progress.push(k.parse::<u32>().expect("progress number"));
                } else if line.starts_with("OK") {
                    break line;
                }
            };
            assert_eq!(result, expected, "backend {backend}, {vcpus} vCPUs");
            assert!(
                saw_progress.iter().all(|k| *k > 3),
                "{backend}: restarted instead of continuing: {saw_progress:?}"
            );
            assert_eq!(clone.ok("echo alive"), "alive");
            if vcpus == "2" {
                let count =
                    |clone: &mut Vm| clone.ok("smp-count").parse::<u64>().expect("smp-count");
                let first = count(&mut clone);
                std::thread::sleep(Duration::from_millis(200));
                assert!(
                    count(&mut clone) > first,
                    "{backend}: vCPU 1 stopped after the restore"
                );
            }
        }
    }
}

#[test]
fn a_block_request_in_flight_spans_the_snapshot() {
    if !kvm_available() {
        return;
    }
    let (_keep, dir) = snapdir("inflight");
    let mut vm = boot_with_api(&[]);
    std::fs::File::options()
        .write(true)
        .open(vm.path("disk.img"))
        .and_then(|f| f.write_all_at(b"in flight across a snapshot", 7 * 512))
        .expect("seed disk");
    assert_eq!(vm.ok("blk-post 0 7"), "");
    snapshot(&vm, &dir, "Full");
    let _ = vm.child.kill();
    let mut clone = restore(
        &dir,
        &[
            "--drive-override",
            &format!("drive0={}", vm.path("disk.img").display()),
        ],
    );
    let data = clone.ok("blk-complete 0");
    let expected: String = b"in flight across a snapshot"
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(data.starts_with(&expected), "{data}");
}

/// The values of one `prng N` answer (`OK v1 v2 ...` without the `OK`).
fn prng_values(answer: &str) -> Vec<String> {
    answer.split_whitespace().map(str::to_string).collect()
}

#[test]
fn deterministic_restores_repeat_and_new_generations_diverge() {
    if !kvm_available() {
        return;
    }
    const DRAWS: usize = 64;
    let (_keep, dir) = snapdir("det");
    let mut vm = boot_with_api(&[]);
    let first = prng_values(&vm.ok("prng 4"));
    let generation = vm.ok("generation");
    snapshot(&vm, &dir, "Full");
    resume(&vm);
    // What the snapshot state draws with no reseed: the parent's own next values.
    let parent_next = prng_values(&vm.ok(&format!("prng {DRAWS}")));
    assert_eq!(parent_next.len(), DRAWS, "{parent_next:?}");
    for _ in 0..2 {
        let mut clone = restore(&dir, &[]);
        assert_eq!(clone.ok("generation"), generation);
        assert_eq!(
            prng_values(&clone.ok(&format!("prng {DRAWS}"))),
            parent_next,
            "a restore without a new generation must draw exactly the parent's values"
        );
    }
    assert!(first.iter().all(|v| !parent_next.contains(v)), "{first:?}");
    let mut fresh = Vec::new();
    for _ in 0..2 {
        let mut clone = restore(&dir, &["--new-generation"]);
        assert_ne!(
            clone.ok("generation"),
            generation,
            "a clone must see a new generation"
        );
        let values = prng_values(&clone.ok("prng 8"));
        assert_eq!(values.len(), 8, "{values:?}");
        fresh.push(values);
    }
    // A reseed must move the generator off the snapshot's sequence, not merely skip
    // along it: no value a reseeded clone draws may be one of the parent's next draws.
    for (clone, values) in fresh.iter().enumerate() {
        let shared: Vec<_> = values.iter().filter(|v| parent_next.contains(v)).collect();
        assert!(
            shared.is_empty(),
            "clone {clone} with a new generation drew {shared:?}, values of the parent's own \
             sequence {parent_next:?}: its generator was not reseeded"
        );
    }
    let shared: Vec<_> = fresh[0].iter().filter(|v| fresh[1].contains(v)).collect();
    assert!(
        shared.is_empty(),
        "two clones with new generations drew the same values {shared:?}: they must reseed differently"
    );
}

#[test]
fn twenty_clones_run_at_once_and_each_gets_the_right_answer() {
    if !kvm_available() {
        return;
    }
    let (_keep, dir) = snapdir("fan");
    let mut vm = boot_with_api(&["--memory-mib", "128"]);
    assert_eq!(vm.ok("touch 16 77"), "4096");
    assert_eq!(vm.ok("vsock-listen 1024"), "");
    snapshot(&vm, &dir, "Full");
    let _ = vm.child.kill();
    let mut clones: Vec<Vm> = (0..20).map(|_| restore(&dir, &[])).collect();
    for clone in &mut clones {
        clone.send("check 16 77\n");
    }
    for (i, clone) in clones.iter_mut().enumerate() {
        let answer = clone
            .next_line(Duration::from_secs(120))
            .unwrap_or_else(|| panic!("clone {i}: {}", clone.stderr()));
        assert_eq!(answer, "OK 0", "clone {i}");
        let mut s = UnixStream::connect(clone.path("v.sock")).expect("clone vsock");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        s.write_all(b"CONNECT 1024\n").expect("connect");
        let mut ok = [0u8; 3];
        s.read_exact(&mut ok).expect("OK");
        assert_eq!(&ok, b"OK ");
    }
}

#[test]
fn a_diff_chain_of_three_restores_correctly_and_folds() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let s = |n: &str| scratch.path().join(n);
    let mut vm = boot_with_api(&["--memory-mib", "128", "--track-dirty-pages"]);
    assert_eq!(vm.ok("touch 8 1"), "2048");
    snapshot(&vm, &s("s0"), "Full");
    resume(&vm);
    assert_eq!(vm.ok("touch 4 2"), "1024");
    snapshot(&vm, &s("s1"), "Diff");
    resume(&vm);
    assert_eq!(vm.ok("touch 2 3"), "512");
    assert_eq!(vm.ok("blk-write 0 9 64696666"), "");
    snapshot(&vm, &s("s2"), "Diff");
    resume(&vm);
    assert_eq!(vm.ok("touch 1 4"), "256");
    snapshot(&vm, &s("s3"), "Diff");
    let _ = vm.child.kill();
    // The file's length is guest memory whatever it holds: count its data.
    let diff_data = data_bytes(&s("s3").join("memory"));
    assert!(
        (1 << 20..32 << 20).contains(&diff_data),
        "the last diff holds the 1 MiB touched since s2 (and little else): {diff_data} bytes"
    );

    let check = |clone: &mut Vm| {
        assert_eq!(clone.ok("check 1 4"), "0");
        assert_eq!(clone.ok("check 2 3"), "256", "pages 1-2 MiB hold seed 3");
        assert_eq!(clone.ok("check 4 2"), "512");
        assert_eq!(clone.ok("check 8 1"), "1024");
    };
    for backend in ["cow", "uffd", "copy"] {
        let mut clone = restore(&s("s3"), &["--restore-backend", backend]);
        check(&mut clone);
    }
    let mut middle = restore(&s("s2"), &[]);
    assert_eq!(middle.ok("check 2 3"), "0");

    let out = Command::new(vmm_binary().with_file_name("rollbox-snapshot"))
        .args(["fold"])
        .arg(s("s3"))
        .arg("--output")
        .arg(s("folded"))
        .output()
        .expect("rollbox-snapshot");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut folded = restore(&s("folded"), &[]);
    check(&mut folded);
}

fn restore_fails(args: &[String]) -> String {
    let out = Command::new(vmm_binary())
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(stderr.lines().count(), 1, "want one line: {stderr}");
    stderr
}

#[test]
fn bad_snapshots_get_clear_errors() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let good = scratch.path().join("good");
    let vm = boot_with_api(&[]);
    snapshot(&vm, &good, "Full");
    drop(vm);
    let copy = |name: &str| {
        let dir = scratch.path().join(name);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::copy(good.join("vmstate"), dir.join("vmstate")).expect("copy state");
        dir
    };
    let arg = |p: &Path| vec!["--restore".to_string(), p.display().to_string()];

    let corrupt = copy("corrupt");
    let mut bytes = std::fs::read(corrupt.join("vmstate")).expect("read");
    let last = bytes.len() - 5;
    bytes[last] ^= 0x5a;
    std::fs::write(corrupt.join("vmstate"), &bytes).expect("write");
    assert!(restore_fails(&arg(&corrupt)).contains("corrupted: CRC-32"));

    let truncated = copy("truncated");
    std::fs::write(truncated.join("vmstate"), &bytes[..bytes.len() / 2]).expect("write");
    assert!(restore_fails(&arg(&truncated)).contains("truncated"));

    let version = copy("version");
    let mut v = std::fs::read(version.join("vmstate")).expect("read");
    v[8] = 42;
    std::fs::write(version.join("vmstate"), &v).expect("write");
    assert!(restore_fails(&arg(&version)).contains("version 42 is not supported"));

    let garbage = copy("garbage");
    std::fs::write(garbage.join("vmstate"), b"not a snapshot at all").expect("write");
    assert!(restore_fails(&arg(&garbage)).contains("bad magic"));

    let missing = scratch.path().join("does-not-exist");
    assert!(restore_fails(&arg(&missing)).contains("does-not-exist"));

    // The memory file is shorter than the snapshot's memory.
    std::fs::copy(good.join("memory"), scratch.path().join("memory-copy")).expect("copy");
    std::fs::File::options()
        .write(true)
        .open(good.join("memory"))
        .and_then(|f| f.set_len(4096))
        .expect("truncate");
    assert!(
        restore_fails(&arg(&good)).contains("needs"),
        "wrong-size memory must be refused"
    );
    std::fs::rename(scratch.path().join("memory-copy"), good.join("memory")).expect("put back");

    let mut more = arg(&good);
    more.extend(["--memory-mib".to_string(), "512".to_string()]);
    assert!(restore_fails(&more).contains("the snapshot has 128 MiB"));
}

/// The temporary memory file of a snapshot being written into `dir` (`.memory.tmp-PID`).
fn memory_temp_file(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|entry| entry.path())
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(".memory.tmp-"))
        })
}

fn allocated_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|meta| meta.blocks() * 512)
}

/// Boots a guest that touched `touched_mib` MiB, starts a Full snapshot into `dir` and
/// SIGKILLs the VMM once the snapshot's temporary memory file holds 8 MiB and is growing.
/// Returns the temporary file and its allocated bytes after the kill, or None when the
/// snapshot got past its memory file before the kill could land.
fn kill_while_memory_is_written(dir: &Path, touched_mib: u64) -> Option<(PathBuf, u64)> {
    let mut vm = boot_with_api(&["--memory-mib", "1024"]);
    assert_eq!(
        vm.ok(&format!("touch {touched_mib} 9")),
        (touched_mib * 256).to_string()
    );
    pause(&vm);
    std::fs::create_dir_all(dir).expect("mkdir");
    let api = vm.api();
    let params = snapshot_params("Full", dir);
    // The VMM is killed before it answers: the call ends with an error, which is expected.
    let writer = std::thread::spawn(move || {
        let _ = api.create_snapshot(&params);
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut last_seen = 0;
    let mut growing = false;
    while std::time::Instant::now() < deadline {
        let exited = matches!(vm.child.try_wait(), Ok(Some(_)));
        if exited || dir.join("memory").exists() || dir.join("vmstate").exists() {
            break;
        }
        if let Some(size) = memory_temp_file(dir).and_then(|tmp| allocated_bytes(&tmp)) {
            if last_seen >= 8 << 20 && size > last_seen {
                growing = true;
                break;
            }
            last_seen = size;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let _ = vm.child.kill();
    let _ = vm.child.wait();
    let _ = writer.join();
    if !growing {
        return None;
    }
    // The kill landed mid-snapshot only if the memory file was never renamed into place.
    let tmp = memory_temp_file(dir)?;
    if dir.join("memory").exists() {
        return None;
    }
    let allocated = allocated_bytes(&tmp)?;
    Some((tmp, allocated))
}

#[test]
fn kill_during_snapshot_never_leaves_a_complete_looking_snapshot() {
    if !kvm_available() {
        return;
    }
    const TOUCHED_MIB: u64 = 512;
    const ATTEMPTS: usize = 3;
    let scratch = tempfile::tempdir().expect("tempdir");
    for attempt in 1..=ATTEMPTS {
        let dir = scratch.path().join(format!("killed{attempt}"));
        let Some((tmp, allocated)) = kill_while_memory_is_written(&dir, TOUCHED_MIB) else {
            eprintln!(
                "attempt {attempt}: the kill did not land while the memory file was being written; again"
            );
            continue;
        };
        eprintln!(
            "attempt {attempt}: killed mid-snapshot, {} KiB of the {TOUCHED_MIB} MiB the guest \
             touched written to {}",
            allocated >> 10,
            tmp.display()
        );
        // Nothing that looks like a finished snapshot: no memory file, no state file.
        assert!(
            !dir.join("memory").exists(),
            "a complete-looking memory file"
        );
        assert!(!dir.join("vmstate").exists(), "a complete-looking vmstate");
        let err = restore_fails(&["--restore".to_string(), dir.display().to_string()]);
        assert!(
            err.contains("no vmstate") && err.contains(&dir.display().to_string()),
            "{err}"
        );
        return;
    }
    panic!(
        "in {ATTEMPTS} attempts the kill never landed while the snapshot's memory file was being \
         written, so the test proved nothing"
    );
}

#[test]
fn a_network_interface_is_restored_onto_its_tap_or_an_override() {
    if !kvm_available() {
        return;
    }
    let tap_exists = |name: &str| Path::new("/sys/class/net").join(name).exists();
    let (_keep, dir) = snapdir("snap");
    let mut vm = boot_with_api(&["--net", "rbxt2s0,mac=06:00:0a:00:01:02"]);
    snapshot(&vm, &dir, "Full");
    // While the parent holds its tap, a restore onto the same tap is refused by name.
    let mut refused = restore(&dir, &[]);
    let status = refused.wait(Duration::from_secs(30));
    assert!(!status.success());
    assert!(
        refused
            .stderr()
            .contains("tap rbxt2s0 is in use by another process"),
        "{}",
        refused.stderr()
    );
    // Onto another tap it restores and runs.
    let mut clone = restore(&dir, &["--net-override", "eth0=rbxt2s1"]);
    assert_eq!(clone.ok("echo alive"), "alive");
    assert!(tap_exists("rbxt2s1"));
    let _ = clone.child.kill();
    let _ = vm.child.kill();
    let _ = clone.child.wait();
    let _ = vm.child.wait();
    // A bad override is refused before anything starts.
    let err = restore_fails(&[
        "--restore".to_string(),
        dir.display().to_string(),
        "--net-override".into(),
        "eth0=much-too-long-tap".into(),
    ]);
    assert!(err.contains("much-too-long-tap"), "{err}");
    assert!(!tap_exists("rbxt2s1") && !tap_exists("rbxt2s0"));
}

#[test]
fn a_full_snapshot_keeps_pages_that_are_swapped_out() {
    if !kvm_available() {
        return;
    }
    let test = "a_full_snapshot_keeps_pages_that_are_swapped_out";
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    let _swap = if swaps.lines().count() >= 2 {
        None
    } else if std::env::var("ROLLBOX_TEST_SWAPFILE").is_ok_and(|v| v == "1") {
        match SwapFile::enable(256) {
            Ok(swap) => Some(swap),
            Err(e) => {
                skip_even_in_ci(test, &format!("cannot enable a swap file: {e}"));
                return;
            }
        }
    } else {
        skip_even_in_ci(
            test,
            "the host has no swap (ROLLBOX_TEST_SWAPFILE=1 lets the test, as root, add a 256 MiB swap file while it runs)",
        );
        return;
    };
    let cgroup = match MemoryCgroup::create("rollbox-swap") {
        Ok(c) => c,
        Err(e) => {
            skip_even_in_ci(test, &format!("cannot make a memory cgroup: {e}"));
            return;
        }
    };
    let (_keep, dir) = snapdir("swapped");
    let mut vm = boot_with_api(&["--memory-mib", "256"]);
    // Pages the guest writes from now on are charged to a cgroup of 24 MiB: most of the
    // 64 MiB it touches goes to swap.
    let pid = vm.child.id();
    cgroup.enter(pid);
    cgroup.limit(24 << 20);
    assert_eq!(vm.ok("touch 64 7"), "16384");
    let swapped = swapped_kib(pid);
    assert!(
        swapped > 16 << 10,
        "only {swapped} KiB of the VMM went to swap"
    );
    snapshot(&vm, &dir, "Full");
    let _ = vm.child.kill();
    let _ = vm.child.wait();
    drop(cgroup);
    println!("swapped out at the snapshot: {} MiB", swapped >> 10);
    let mut clone = restore(&dir, &["--restore-backend", "copy"]);
    assert_eq!(
        clone.ok("check 64 7"),
        "0",
        "pages that were in swap came back"
    );
}

/// A tmpfs of `size` mounted on `dir`, unmounted on drop.
struct SmallTmpfs(PathBuf);

impl SmallTmpfs {
    fn mount(dir: &Path, size: &str) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(Self(dir.to_path_buf()))
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_diff_that_fails_on_a_full_disk_or_over_its_base_loses_nothing() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let s = |n: &str| scratch.path().join(n);
    let full = match SmallTmpfs::mount(&s("full"), "256k") {
        Ok(m) => m,
        Err(e) => {
            skip_even_in_ci(
                "a_diff_that_fails_on_a_full_disk_or_over_its_base_loses_nothing",
                &format!("cannot mount a small tmpfs (needs root): {e}"),
            );
            return;
        }
    };
    let mut vm = boot_with_api(&["--memory-mib", "128", "--track-dirty-pages"]);
    assert_eq!(vm.ok("touch 8 1"), "2048");
    snapshot(&vm, &s("s0"), "Full");
    resume(&vm);
    assert_eq!(vm.ok("touch 4 2"), "1024");
    pause(&vm);
    // Raw: the test checks the refusals' statuses and fault messages.
    let create = |body: &str| {
        let answer = api_client(&vm.path("api.sock"))
            .request("PUT", "/snapshot/create", Some(body.as_bytes()))
            .unwrap_or_else(|e| panic!("{e}"));
        (answer.status, answer.text())
    };
    let body = format!(
        r#"{{"snapshot_type":"Diff","snapshot_path":"{0}/vmstate","mem_file_path":"{0}/memory"}}"#,
        full.0.display()
    );
    let (status, answer) = create(&body);
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("No space left"), "{answer}");
    assert!(!full.0.join("vmstate").exists());
    // A diff over the file it builds on is refused before anything is written.
    let body = format!(
        r#"{{"snapshot_type":"Diff","snapshot_path":"{0}/vmstate","mem_file_path":"{0}/memory"}}"#,
        s("s0").display()
    );
    let (status, answer) = create(&body);
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("layer 0 of the memory chain"), "{answer}");
    resume(&vm);
    snapshot(&vm, &s("s1"), "Diff");
    let _ = vm.child.kill();
    let mut clone = restore(&s("s1"), &[]);
    assert_eq!(
        clone.ok("check 4 2"),
        "0",
        "pages written before the failed diffs are in the next one"
    );
    let mut base = restore(&s("s0"), &[]);
    assert_eq!(base.ok("check 8 1"), "0", "the base is intact");
}

#[test]
fn a_snapshot_that_resumes_while_writing_holds_its_pause_and_leaves_the_diff_base_alone() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let s = |n: &str| scratch.path().join(n);
    let mut vm = boot_with_api(&["--memory-mib", "128", "--track-dirty-pages"]);
    snapshot(&vm, &s("s0"), "Full");
    resume(&vm);
    assert_eq!(vm.ok("touch 4 2"), "1024");
    // The daemon's fork snapshot: the VM runs again once its memory is imaged.
    std::fs::create_dir_all(s("bg")).expect("snapshot dir");
    pause(&vm);
    let resumed = vm
        .api()
        .create_snapshot_resuming(&snapshot_params("Full", &s("bg")))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        resumed.paused_ms <= resumed.elapsed_ms,
        "the pause ends before the memory is written: {resumed:?}"
    );
    assert_eq!(vm.api().vm_info().expect("vm info").state, "Running");
    assert_eq!(vm.ok("touch 2 3"), "512", "the VM runs without a resume");
    // resume_vm on a Diff is refused by name, and the VM stays paused for the next one.
    std::fs::create_dir_all(s("s1")).expect("snapshot dir");
    pause(&vm);
    let err = vm
        .api()
        .create_snapshot_resuming(&snapshot_params("Diff", &s("s1")))
        .expect_err("Diff with resume_vm");
    assert!(
        err.to_string().contains("resume_vm needs a Full snapshot"),
        "{err}"
    );
    vm.api()
        .create_snapshot(&snapshot_params("Diff", &s("s1")))
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = vm.child.kill();
    // The resuming snapshot holds the memory of its pause, not what came after.
    let mut at_pause = restore(&s("bg"), &[]);
    assert_eq!(at_pause.ok("check 4 2"), "0", "{}", at_pause.stderr());
    assert_eq!(at_pause.ok("check 2 3"), "512", "{}", at_pause.stderr());
    drop(at_pause);
    // The next Diff holds everything written since s0, on top of s0.
    let mut clone = restore(&s("s1"), &[]);
    assert_eq!(clone.ok("check 2 3"), "0", "{}", clone.stderr());
    assert_eq!(
        clone.ok("check 4 2"),
        "512",
        "the diff after a resuming snapshot holds what was written since s0; {}",
        clone.stderr()
    );
}

#[test]
fn a_moved_snapshot_chain_restores_from_its_new_place() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let s = |n: &str| scratch.path().join(n);
    let mut vm = boot_with_api(&["--memory-mib", "128", "--track-dirty-pages"]);
    assert_eq!(vm.ok("touch 8 1"), "2048");
    snapshot(&vm, &s("a/s0"), "Full");
    resume(&vm);
    assert_eq!(vm.ok("touch 4 2"), "1024");
    snapshot(&vm, &s("a/s1"), "Diff");
    resume(&vm);
    assert_eq!(vm.ok("touch 2 3"), "512");
    snapshot(&vm, &s("a/s2"), "Diff");
    let _ = vm.child.kill();
    // Firecracker's tools compute pages from the size: the file is exactly guest memory.
    for layer in ["s0", "s1", "s2"] {
        let len = std::fs::metadata(s("a").join(layer).join("memory"))
            .expect("memory")
            .len();
        assert_eq!(len, 128 << 20, "{layer}/memory");
    }
    // Copy the whole chain to a new place; the old one is gone.
    let out = Command::new("cp")
        .arg("-r")
        .arg(s("a"))
        .arg(s("b"))
        .status()
        .expect("cp");
    assert!(out.success());
    std::fs::remove_dir_all(s("a")).expect("remove the original");
    let check = |clone: &mut Vm| {
        assert_eq!(clone.ok("check 2 3"), "0");
        assert_eq!(clone.ok("check 4 2"), "512");
        assert_eq!(clone.ok("check 8 1"), "1024");
    };
    for backend in ["cow", "copy", "uffd"] {
        let started = std::time::Instant::now();
        let mut clone = restore(&s("b/s2"), &["--restore-backend", backend]);
        assert_eq!(clone.ok("echo up"), "up", "{}", clone.stderr());
        println!(
            "restore of the moved 3-layer chain ({backend}): {:.0} ms to the first answer",
            started.elapsed().as_secs_f64() * 1e3
        );
        check(&mut clone);
    }

    // A layer moved on its own is named with --layer-override.
    std::fs::create_dir_all(s("elsewhere")).expect("mkdir");
    for name in ["memory", "memory.id"] {
        std::fs::rename(s("b/s0").join(name), s("elsewhere").join(name)).expect("move");
    }
    let mut clone = restore(
        &s("b/s2"),
        &[
            "--layer-override",
            &format!("0={}", s("elsewhere/memory").display()),
        ],
    );
    check(&mut clone);
    let err = restore_fails(&[
        "--restore".into(),
        s("b/s2").display().to_string(),
        "--layer-override".into(),
        "3=/nowhere".into(),
    ]);
    assert!(err.contains("has 3 memory layers"), "{err}");
    for name in ["memory", "memory.id"] {
        std::fs::rename(s("elsewhere").join(name), s("b/s0").join(name)).expect("move back");
    }

    // fold -o with a relative directory: the folded state names its memory relatively.
    let out = Command::new(vmm_binary().with_file_name("rollbox-snapshot"))
        .current_dir(scratch.path())
        .args(["fold", "b/s1", "-o", "folded"])
        .output()
        .expect("rollbox-snapshot");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut folded = restore(&s("folded"), &[]);
    assert_eq!(folded.ok("check 4 2"), "0", "{}", folded.stderr());
}

/// Whether the VMM's vCPU 0 thread is halted inside KVM (its wchan is `kvm_vcpu_block`) in
/// 20 samples 10 ms apart, tried for up to 10 s. A guest that busy-polls its serial port is
/// running or in the serial device's paced `nanosleep` instead.
fn vcpu0_halted_in_kvm(vm: &Vm) -> bool {
    let pid = vm.child.id();
    let task = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("list the VMM's threads")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            std::fs::read_to_string(path.join("comm")).is_ok_and(|name| name.trim() == "vcpu0")
        })
        .expect("the VMM has a vcpu0 thread");
    let halted =
        || std::fs::read_to_string(task.join("wchan")).is_ok_and(|w| w.trim() == "kvm_vcpu_block");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut in_a_row = 0;
    while std::time::Instant::now() < deadline {
        in_a_row = if halted() { in_a_row + 1 } else { 0 };
        if in_a_row == 20 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn an_idle_guest_halts_and_its_clones_wake_on_serial_input() {
    if !kvm_available() {
        return;
    }
    let (_keep, dir) = snapdir("idle");
    let mut vm = boot_with_api(&["--memory-mib", "64"]);
    assert_eq!(vm.ok("idle"), "");
    assert!(vcpu0_halted_in_kvm(&vm), "vcpu0 did not halt after `idle`");
    assert_eq!(vm.ok("echo woken"), "woken");
    snapshot(&vm, &dir, "Full");
    let _ = vm.child.kill();
    for i in 0..3 {
        let mut clone = restore(&dir, &[]);
        assert_eq!(clone.ok(&format!("echo clone{i}")), format!("clone{i}"));
        assert!(vcpu0_halted_in_kvm(&clone), "clone {i}: vcpu0 did not halt");
        assert_eq!(clone.ok("echo again"), "again", "clone {i}");
    }
}
