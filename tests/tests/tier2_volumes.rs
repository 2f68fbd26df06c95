//! Tier 2: a shared volume over virtio-fs on real KVM, with the test guest's own FUSE client
//! (`fs-init`, `fs-append`): 64 clones restored from one snapshot (each with a new
//! generation and its own virtiofsd) append at once to their own file and to one common file. Tier 4 (`tier4_volumes.rs`) runs
//! the same workload with Linux guests in the nested lab.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rollbox_tests::{kvm_available, skip, snapshot_params, virtiofsd_of, Vm};

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
    // The parent computes while it is snapshotted; `fs-append` waits in the serial FIFO, so
    // every clone runs it as soon as the computation ends, all at once.
    vm.send(&format!("compute 60000\nfs-append {RECORDS}\n"));
    vm.expect_line("progress 1");
    let snapshot = vm.path("fork");
    std::fs::create_dir_all(&snapshot).expect("snapshot dir");
    let started = Instant::now();
    // A fork as the daemon makes one: the parent runs again once its memory is imaged.
    vm.api().pause().unwrap_or_else(|e| panic!("{e}"));
    let params = snapshot_params("Full", &snapshot);
    vm.api()
        .create_snapshot_resuming(&params)
        .unwrap_or_else(|e| panic!("{e}\n{}", vm.stderr()));
    let mut clones: Vec<Vm> = (0..count)
        .map(|_| {
            let args = [
                "--restore".to_string(),
                snapshot.display().to_string(),
                "--new-generation".into(),
                "--virtiofsd".into(),
                virtiofsd.clone(),
            ];
            Vm::spawn_raw(&args, tempfile::tempdir().expect("tempdir"))
        })
        .collect();
    let forked = started.elapsed();
    // Each clone's own virtiofsd, once its restore started it.
    for (index, clone) in clones.iter().enumerate() {
        let pid = clone.child.id();
        let deadline = Instant::now() + Duration::from_secs(120);
        while virtiofsd_of(pid).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            virtiofsd_of(pid).len(),
            1,
            "clone {index}: its own virtiofsd; {}",
            clone.stderr()
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
    for (index, clone) in clones.iter_mut().enumerate() {
        let line = loop {
            let line = clone
                .next_line(Duration::from_secs(600))
                .unwrap_or_else(|| panic!("clone {index}: no answer; {}", clone.stderr()));
            if line.starts_with("OK appended") || line.starts_with("ERR") {
                break line;
            }
        };
        let generation = line
            .strip_prefix(&format!("OK appended {RECORDS} as 0x"))
            .unwrap_or_else(|| panic!("clone {index}: {line}"));
        assert!(
            writers.insert(generation.to_string()),
            "clone {index}: generation {generation} is another writer's too"
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
        "figure: snapshot of a test guest with a volume and {count} restores started (each with its own virtiofsd) {:.2} s; all {} writers' {} records each to their own file and to common: {:.1} s after the fork began (guests wait for answers: {wait})",
        forked.as_secs_f64(),
        writers.len(),
        RECORDS,
        all_done.as_secs_f64()
    );

    drop(clones);
    vm.send("poweroff\n");
    assert!(
        vm.wait(Duration::from_secs(30)).success(),
        "{}",
        vm.stderr()
    );
}
