//! Tier 2: rollbox-vmm's per-thread seccomp filters on real KVM: every thread but the
//! spawner runs filtered, a background snapshot's writer starts from the spawner, a
//! forbidden syscall kills the process with SIGSYS and the log names it, `--no-seccomp` turns
//! the filters off, and bad filter files are refused.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use rollbox_tests::{
    boot_with_api, kvm_available, skip, snapshot_params, test_guest, vmm_binary, TEST_GUEST_CMDLINE,
};

/// (thread name, the `Seccomp:` mode of /proc/PID/task/TID/status) for each thread of `pid`.
fn thread_modes(pid: u32) -> Vec<(String, String)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("task dir");
    tasks
        .filter_map(|entry| {
            let status = std::fs::read_to_string(entry.ok()?.path().join("status")).ok()?;
            let field = |name: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
                    .unwrap_or_default()
            };
            Some((field("Name:"), field("Seccomp:")))
        })
        .collect()
}

/// A kernel worker KVM attaches to the VMM process (kvm-nx-lpage-recovery, kvm-pit): it runs
/// no user code, and which filter it shows depends on the kernel version.
fn kernel_worker(thread: &str) -> bool {
    thread.starts_with("kvm-")
}

#[test]
fn every_thread_the_spawners_too_runs_filtered_and_no_seccomp_turns_it_off() {
    if !kvm_available() {
        return;
    }
    let mut vm = boot_with_api(&["--vcpus", "2"]);
    assert_eq!(vm.ok("echo hi"), "hi");
    // The API threads and the event loop run too.
    vm.api().vm_info().unwrap_or_else(|e| panic!("{e}"));
    let modes = thread_modes(vm.child.id());
    let names: Vec<&str> = modes.iter().map(|(n, _)| n.as_str()).collect();
    for want in ["vcpu0", "vcpu1", "api", "console", "spawner"] {
        assert!(names.contains(&want), "no {want} thread in {modes:?}");
    }
    assert!(names.iter().any(|n| n.starts_with("blk-")), "{modes:?}");
    for (name, mode) in modes.iter().filter(|(name, _)| !kernel_worker(name)) {
        assert_eq!(mode, "2", "thread {name}: Seccomp {mode} in {modes:?}");
    }
    vm.send("poweroff\n");
    assert!(vm.wait(Duration::from_secs(20)).success());

    let mut off = boot_with_api(&["--no-seccomp"]);
    let modes = thread_modes(off.child.id());
    assert!(modes.iter().all(|(_, m)| m == "0"), "{modes:?}");
    off.send("poweroff\n");
    assert!(off.wait(Duration::from_secs(20)).success());
}

#[test]
fn a_filtered_vmm_writes_a_snapshot_in_the_background_from_its_spawner() {
    if !kvm_available() {
        return;
    }
    // The writer is a fork(2) of the VMM made on the spawner thread (the one thread whose
    // filter allows it); the VM runs again before the memory is written.
    let mut vm = boot_with_api(&["--memory-mib", "64"]);
    assert_eq!(vm.ok("touch 4 7"), "1024");
    let snapshot = tempfile::tempdir().expect("tempdir");
    vm.api().pause().unwrap_or_else(|e| panic!("{e}"));
    let params = snapshot_params("Full", snapshot.path());
    vm.api()
        .create_snapshot_resuming(&params)
        .unwrap_or_else(|e| panic!("{e}\n{}", vm.stderr()));
    assert_eq!(vm.ok("echo running"), "running", "{}", vm.stderr());
    vm.send("poweroff\n");
    assert!(
        vm.wait(Duration::from_secs(20)).success(),
        "{}",
        vm.stderr()
    );
    let scratch = tempfile::tempdir().expect("tempdir");
    let args: Vec<String> = vec![
        "--restore".into(),
        snapshot.path().display().to_string(),
        "--vsock-uds".into(),
        "{dir}/v.sock".into(),
    ];
    let mut restored = rollbox_tests::Vm::spawn_raw(&args, scratch);
    assert_eq!(restored.ok("check 4 7"), "0", "{}", restored.stderr());
}

#[test]
fn a_forbidden_syscall_on_a_vcpu_kills_the_process_with_sigsys_and_the_log_names_it() {
    if !kvm_available() {
        return;
    }
    let out = Command::new(vmm_binary())
        .args(["--kernel"])
        .arg(test_guest())
        .args(["--cmdline", TEST_GUEST_CMDLINE])
        .env("ROLLBOX_TEST_FORBIDDEN_SYSCALL", "execve")
        .stdin(Stdio::null())
        .output()
        .expect("run rollbox-vmm");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !stderr.contains("test hook: vCPU 0 calls execve") {
        skip(
            "a_forbidden_syscall_on_a_vcpu_kills_the_process_with_sigsys_and_the_log_names_it",
            "rollbox-vmm was built without the test-hooks feature (or as a release build)",
        );
        return;
    }
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSYS),
        "{:?}; stderr:\n{stderr}",
        out.status
    );
    assert!(
        stderr
            .contains("seccomp: thread vcpu0 (vcpu filter) made the forbidden syscall execve (59)"),
        "{stderr}"
    );
    assert!(!stderr.contains("execve returned"), "{stderr}");
}

#[test]
fn a_custom_filter_file_is_used_and_bad_ones_are_refused_before_the_vm_starts() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |file: &std::path::Path| {
        Command::new(vmm_binary())
            .arg("--kernel")
            .arg(test_guest())
            .args(["--cmdline", TEST_GUEST_CMDLINE, "--seccomp-filter"])
            .arg(file)
            .stdin(Stdio::null())
            .output()
            .expect("run rollbox-vmm")
    };
    let refused = |file: &std::path::Path, why: &str| {
        let out = run(file);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let want = format!("seccomp filter file {}: ", file.display());
        assert!(stderr.contains(&want), "{stderr}");
        assert!(stderr.contains(why), "want {why:?} in {stderr}");
    };
    refused(&dir.path().join("missing.json"), "No such file");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{ not json").expect("write");
    refused(&bad, "line 1");
    // Every thread kind allows everything ("trap" on nothing) but the vCPU, whose filter
    // allows nothing: the custom file is the one in force.
    let kinds = ["vmm", "api", "block", "page_server"];
    let allow_all = r#"{"default_action": "allow", "filter_action": "trap", "filter": [{"syscall": "execve"}]}"#;
    let mut json: Vec<String> = kinds
        .iter()
        .map(|k| format!("\"{k}\": {allow_all}"))
        .collect();
    let partial = dir.path().join("partial.json");
    std::fs::write(&partial, format!("{{{}}}", json.join(", "))).expect("write");
    refused(&partial, "no filter for thread kind \"vcpu\"");
    json.push(
        r#""vcpu": {"default_action": "trap", "filter_action": "allow", "filter": [{"syscall": "write"}]}"#.into(),
    );
    let strict = dir.path().join("strict.json");
    std::fs::write(&strict, format!("{{{}}}", json.join(", "))).expect("write");
    let out = run(&strict);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{stderr}");
    assert!(
        stderr.contains("seccomp: thread vcpu0 (vcpu filter) made the forbidden syscall ioctl"),
        "{stderr}"
    );
    json.push(format!("\"jailer\": {allow_all}"));
    let unknown = dir.path().join("unknown.json");
    std::fs::write(&unknown, format!("{{{}}}", json.join(", "))).expect("write");
    refused(&unknown, "unknown thread kind \"jailer\"");
}

/// The figure: syscalls allowed per thread kind (run with --nocapture to see it).
#[test]
fn prints_the_syscalls_each_thread_kind_may_make() {
    let out = Command::new(vmm_binary())
        .arg("--print-seccomp-summary")
        .output()
        .expect("run rollbox-vmm");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    for kind in ["vmm", "api", "vcpu", "block", "page_server"] {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(kind))
            .unwrap_or_else(|| panic!("no {kind} line in {text}"));
        let count: usize = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count in {line:?}"));
        assert!(count > 10, "{line}");
        assert!(!line.contains(" execve"), "{line}");
    }
}
