//! Tier 2: a shared volume over virtio-fs on real KVM, with the test guest's own FUSE client
//! (`fs-init`, `fs-append`): 64 clones forked from one snapshot, each with its own virtiofsd,
//! append at once to their own file and to one common file. Tier 4 (`tier4_volumes.rs`) runs
//! the same workload with Linux guests in the nested lab.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rollbox_tests::linux::ClonePids;
use rollbox_tests::{fork_params, kvm_available, skip, virtiofsd_of, wait_for_file_line, Vm};

/// Clones of the fan-out: 64, or ROLLBOX_TIER2_VOLUME_CLONES.
fn clone_count() -> usize {
    std::env::var("ROLLBOX_TIER2_VOLUME_CLONES").map_or(64, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("ROLLBOX_TIER2_VOLUME_CLONES={v:?} is not a count"))
    })
}

const RECORDS: usize = 1000;
/// `fs-append`'s record: 16 hex digits of the writer's generation, a space, 6 digits, `\n`.
const RECORD_LEN: usize = 24;

/// Checks one record line: the writer's generation (16 hex digits) and its sequence number.
fn parse_record(line: &str) -> Option<(String, usize)> {
    let (generation, seq) = line.split_once(' ')?;
    let ok = line.len() == RECORD_LEN - 1
        && generation.len() == 16
        && generation.bytes().all(|b| b.is_ascii_hexdigit())
        && seq.len() == 6
        && seq.bytes().all(|b| b.is_ascii_digit());
    if !ok {
        return None;
    }
    Some((generation.to_string(), seq.parse().ok()?))
}

#[test]
fn sixty_four_clones_append_to_their_own_files_and_one_common_file() {
    const TEST: &str = "sixty_four_clones_append_to_their_own_files_and_one_common_file";
    if !kvm_available() {
        return;
    }
    let Some(virtiofsd) = std::env::var_os("ROLLBOX_VIRTIOFSD").map(PathBuf::from) else {
        skip(
            TEST,
            "ROLLBOX_VIRTIOFSD is not set (scripts/virtiofsd.sh builds virtiofsd and prints its path)",
        );
        return;
    };
    let count = clone_count();
    let share = tempfile::tempdir().expect("share");
    let volume = format!("v={},cache=never", share.path().display());
    let virtiofsd = virtiofsd.display().to_string();
    let mut vm = Vm::boot(&[
        "--memory-mib",
        "32",
        "--api-sock",
        "{dir}/api.sock",
        "--virtiofsd",
        &virtiofsd,
        "--fs",
        &volume,
    ]);
    // `7.<minor> halt` or `7.<minor> poll`: how the guests wait for answers, named in the figure.
    let minor = vm.ok("fs-init");
    assert!(minor.starts_with("7."), "FUSE version {minor}");
    let wait = minor.split_once(' ').map_or("poll", |(_, wait)| wait);
    // The parent computes while the fork snapshots it; `fs-append` waits in the serial FIFO,
    // so every clone runs it as soon as the computation ends, all at once.
    vm.send(&format!("compute 60000\nfs-append {RECORDS}\n"));
    vm.expect_line("progress 1");
    let fork_dir = vm.path("fork");
    let started = Instant::now();
    let answer = vm
        .api()
        .fork(&vmm_api::ForkParams {
            dir: Some(fork_dir),
            ..fork_params(count as u32)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let forked = started.elapsed();
    let clones = &answer.clones;
    // A failed assertion below must not leave the clones running (64 of them spun on a CI
    // host's cores for an hour once).
    let _clones_killed = ClonePids::of(clones);
    assert_eq!(clones.len(), count, "{answer:?}");
    for clone in clones {
        assert_eq!(clone.error, None, "{clone:?}");
        let pid = clone.pid.expect("pid");
        assert_eq!(
            virtiofsd_of(pid).len(),
            1,
            "clone {}: its own virtiofsd",
            clone.index
        );
    }

    // The parent appends too, as generation 0.
    let parent = loop {
        let line = vm
            .next_line(Duration::from_secs(600))
            .unwrap_or_else(|| panic!("parent: no answer; {}", vm.stderr()));
        if line.starts_with("OK appended") || line.starts_with("ERR") {
            break line;
        }
    };
    assert_eq!(
        parent,
        format!("OK appended {RECORDS} as 0x0000000000000000")
    );
    let mut writers = BTreeSet::from(["0000000000000000".to_string()]);
    for clone in clones {
        let line = wait_for_file_line(&clone.console, Duration::from_secs(600), |l| {
            l.starts_with("OK appended") || l.starts_with("ERR")
        });
        let generation = line
            .strip_prefix(&format!("OK appended {RECORDS} as 0x"))
            .unwrap_or_else(|| panic!("clone {}: {line}", clone.index));
        assert!(
            writers.insert(generation.to_string()),
            "clone {}: generation {generation} is another writer's too",
            clone.index
        );
    }
    let all_done = started.elapsed();

    // On the host: one file per writer with its records in order, and every record in the
    // common file exactly once, none torn.
    for writer in &writers {
        let path = share.path().join(format!("{writer}.log"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let want: String = (0..RECORDS).map(|i| format!("{writer} {i:06}\n")).collect();
        assert!(
            text == want,
            "{}: records missing or out of order",
            path.display()
        );
    }
    let files = std::fs::read_dir(share.path()).expect("share").count();
    assert_eq!(
        files,
        writers.len() + 1,
        "one file per writer and the common file"
    );
    let common = std::fs::read_to_string(share.path().join("common")).expect("common");
    assert_eq!(
        common.len(),
        writers.len() * RECORDS * RECORD_LEN,
        "common file size"
    );
    let mut seen: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
    for line in common.lines() {
        let (writer, seq) =
            parse_record(line).unwrap_or_else(|| panic!("a torn record in common: {line:?}"));
        assert!(writers.contains(&writer), "a record of no writer: {line:?}");
        assert!(
            seen.entry(writer).or_default().insert(seq),
            "a duplicated record: {line:?}"
        );
    }
    for writer in &writers {
        assert_eq!(
            seen.get(writer).map_or(0, BTreeSet::len),
            RECORDS,
            "records of {writer} in common"
        );
    }
    eprintln!(
        "figure: fork of a test guest with a volume into {count} clones (each with its own virtiofsd) {:.2} s; all {} writers' {} records each to their own file and to common: {:.1} s after the fork began (guests wait for answers: {wait})",
        forked.as_secs_f64(),
        writers.len(),
        RECORDS,
        all_done.as_secs_f64()
    );

    for clone in clones {
        let pid = clone.pid.expect("pid") as libc::pid_t;
        // SAFETY: signals a clone this test forked.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    vm.send("poweroff\n");
    assert!(
        vm.wait(Duration::from_secs(30)).success(),
        "{}",
        vm.stderr()
    );
}
