//! Tier 2: `rollbox-jailer` around the test guest on real KVM — a jailed VMM boots, snapshots,
//! and restores with cow and uffd; it runs as the unprivileged uid with no capabilities,
//! in its cgroups with their limits, sees no host file outside its directory, and killing it
//! leaves no process, mount, namespace or cgroup behind. Also the figure: what jailing adds to
//! start-up and restore latency.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox_tests::{
    api_client, jailer_binary, kvm_available, raw_image, rlimit_of, root_mount_options, skip,
    snapshot_params, test_guest, vmm_binary, Vm, TEST_GUEST_CMDLINE,
};

const UID: u32 = 64_123;
const GID: u32 = 64_124;
const CGROUP_FS: &str = "/sys/fs/cgroup";

/// Whether this host can run a jail (root, for namespaces, mounts and cgroups).
fn jail_possible() -> bool {
    if !kvm_available() {
        return false;
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip(&current_test(), "rollbox-jailer needs root");
        return false;
    }
    true
}

fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("tier2_jailer")
        .to_string()
}

/// A jail's cgroup parent: one per test process, so parallel runs never share groups.
fn cgroup_parent() -> String {
    format!("rollbox-jailer-test-{}", std::process::id())
}

/// A jail under a fresh chroot base: `setup` prepares the jail directory first.
struct Jail {
    base: tempfile::TempDir,
    id: String,
    /// `--userfaultfd`: the jail gets /dev/userfaultfd (a uffd restore).
    userfaultfd: bool,
}

impl Jail {
    fn new(id: &str, setup: impl FnOnce(&Path)) -> Jail {
        let base = tempfile::tempdir().expect("tempdir");
        let jail = Jail {
            base,
            id: id.to_string(),
            userfaultfd: false,
        };
        std::fs::create_dir(jail.root()).expect("jail dir");
        setup(&jail.root());
        jail
    }

    fn root(&self) -> PathBuf {
        self.base.path().join(&self.id)
    }

    /// The jailer command: `binds` are --bind-ro values, `vmm_args` the VMM's.
    fn command(&self, binds: &[String], vmm_args: &[&str]) -> Command {
        let mut command = Command::new(jailer_binary());
        command
            .arg("--id")
            .arg(&self.id)
            .arg("--exec")
            .arg(vmm_binary())
            .args(["--uid", &UID.to_string(), "--gid", &GID.to_string()])
            .arg("--chroot-base")
            .arg(self.base.path())
            .args(["--cgroup-parent", &cgroup_parent()])
            .args(["--cgroup", "pids.max=64"])
            .args(["--cgroup", "memory.limit_in_bytes=1073741824"])
            .args(["--cgroup", "cpu.cfs_quota_us=150000"])
            .args(["--rlimit", "nofile=1024", "--rlimit", "fsize=1073741824"]);
        for bind in binds {
            command.arg("--bind-ro").arg(bind);
        }
        if self.userfaultfd {
            command.arg("--userfaultfd");
        }
        command.arg("--").args(vmm_args);
        command
    }

    /// Starts the jail; the Vm's scratch dir is an empty one (the jail's base lives in self).
    fn spawn(&self, binds: &[String], vmm_args: &[&str]) -> Vm {
        let scratch = tempfile::tempdir().expect("tempdir");
        Vm::spawn_command(self.command(binds, vmm_args), scratch)
    }

    /// Boots the test guest in the jail with an API socket, a 4 MiB drive and vsock.
    fn boot(&self) -> Vm {
        let guest = format!("{}:/kernel", test_guest().display());
        let mut vm = self.spawn(
            &[guest],
            &[
                "--kernel",
                "/kernel",
                "--cmdline",
                TEST_GUEST_CMDLINE,
                "--api-sock",
                "/api.sock",
                "--drive",
                "/disk.img",
                "--vsock-uds",
                "/v.sock",
                "--vsock-cid",
                "5",
            ],
        );
        vm.expect_line("rollbox-test-guest: ready");
        vm
    }

    fn groups(&self) -> Vec<PathBuf> {
        rollbox_jailer::existing_groups(Path::new(CGROUP_FS), &cgroup_parent(), &self.id)
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        // A jailer the test SIGKILLed (or that a panicking test's Vm drop killed) leaves its
        // empty groups: the daemon's part, done here.
        let fs = Path::new(CGROUP_FS);
        let _ = rollbox_jailer::remove_jail_groups(fs, &cgroup_parent(), &self.id);
        for top in rollbox_jailer::existing_groups(fs, "", &cgroup_parent()) {
            let _ = std::fs::remove_dir(top);
        }
    }
}

fn with_disk(root: &Path) {
    let file = std::fs::File::create(root.join("disk.img")).expect("disk");
    file.set_len(4 << 20).expect("size disk");
}

/// The children of `pid` (from /proc/PID/task/PID/children).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// (PID 1 of the jail, the VMM) under the jailer `jailer`.
fn jail_pids(jailer: u32) -> (u32, u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(&init) = children(jailer).first() {
            if let Some(&vmm) = children(init).first() {
                return (init, vmm);
            }
        }
        assert!(Instant::now() < deadline, "no jailed VMM under {jailer}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn ns(pid: u32, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).expect("ns link")
}

/// Processes (any) in the namespace `link` of kind `kind`.
fn processes_in(kind: &str, link: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).is_ok_and(|l| l == link))
        .collect()
}

/// Mounts (in the test's own namespace) at or under `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&dir)))
        .map(str::to_string)
        .collect()
}

/// Pauses the jailed VM and snapshots it into its jail's `/snap/` (`snap` on the host).
fn snapshot_in_jail(jail: &Jail) {
    let snap = jail.root().join("snap");
    std::fs::create_dir(&snap).expect("snap dir");
    std::os::unix::fs::chown(&snap, Some(UID), Some(GID)).expect("chown snap dir");
    let api = api_client(&jail.root().join("api.sock"));
    api.pause().unwrap_or_else(|e| panic!("{e}"));
    // The VMM sees the jail's paths.
    api.create_snapshot(&snapshot_params("Full", Path::new("/snap")))
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Restores the snapshot in `from`'s jail, in a new jail, with `backend`.
fn restore_jailed(from: &Jail, id: &str, backend: &str) -> (Jail, Vm) {
    let mut jail = Jail::new(id, |root| {
        std::fs::copy(from.root().join("disk.img"), root.join("disk.img")).expect("copy disk");
    });
    jail.userfaultfd = backend == "uffd";
    let binds = [format!("{}:/snap", from.root().join("snap").display())];
    let vm = jail.spawn(
        &binds,
        &[
            "--restore",
            "/snap",
            "--restore-backend",
            backend,
            "--api-sock",
            "/api.sock",
            "--vsock-uds",
            "/v.sock",
        ],
    );
    (jail, vm)
}

#[test]
fn a_jailed_vmm_boots_snapshots_and_restores_unprivileged_in_its_cgroups() {
    if !jail_possible() {
        return;
    }
    let jail = Jail::new("boot", with_disk);
    // A descriptor without close-on-exec, as a careless parent would leave one.
    let marker = jail.base.path().join("inherited-marker");
    std::fs::write(&marker, "secret").expect("marker");
    let path = std::ffi::CString::new(marker.display().to_string()).expect("path");
    // SAFETY: open on a NUL-terminated path; the descriptor is closed below.
    let leaked = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY) };
    assert!(leaked >= 0);
    let mut vm = jail.boot();
    // SAFETY: closes the descriptor opened above.
    unsafe { libc::close(leaked) };
    assert_eq!(vm.ok("echo jailed"), "jailed");
    assert_eq!(vm.ok("blk-write 0 3 6a61696c"), "");

    // Unprivileged, with no capabilities, no-new-privs and the rlimits.
    let (init, vmm) = jail_pids(vm.child.id());
    for pid in [init, vmm] {
        assert_eq!(status_field(pid, "Uid"), format!("{UID} {UID} {UID} {UID}"));
        assert_eq!(status_field(pid, "Gid"), format!("{GID} {GID} {GID} {GID}"));
        assert_eq!(status_field(pid, "Groups"), "");
        for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(
                status_field(pid, caps),
                "0000000000000000",
                "{caps} of {pid}"
            );
        }
        assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    }
    assert_eq!(status_field(vmm, "NSpid").split(' ').nth(1), Some("2"));
    let limits = std::fs::read_to_string(format!("/proc/{vmm}/limits")).expect("limits");
    assert!(
        limits.lines().any(|l| l.starts_with("Max open files")
            && l.split_whitespace().filter(|w| *w == "1024").count() == 2),
        "{limits}"
    );
    let fsize = "1073741824".to_string();
    assert_eq!(rlimit_of(vmm, "Max file size"), (fsize.clone(), fsize));
    // Its root runs nothing it writes there, and holds no setuid file or device that works.
    let options = root_mount_options(vmm);
    for want in ["nosuid", "nodev", "noexec"] {
        assert!(
            options.iter().any(|o| o == want),
            "{want} not in {options:?}"
        );
    }
    // No userfaultfd device but for a uffd restore (below, with --userfaultfd).
    let dev = std::fs::read_dir(format!("/proc/{vmm}/root/dev"))
        .expect("jail /dev")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
    assert!(dev.iter().any(|d| d == "kvm"), "{dev:?}");
    assert!(!dev.iter().any(|d| d == "userfaultfd"), "{dev:?}");
    // Every inherited descriptor but stdin, stdout and stderr was closed.
    for pid in [init, vmm] {
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("fds")
            .flatten()
        {
            let target = std::fs::read_link(fd.path()).unwrap_or_default();
            assert!(
                !target.ends_with("inherited-marker"),
                "{pid} holds {target:?}"
            );
        }
    }
    for kind in ["mnt", "pid", "ipc", "uts"] {
        assert_ne!(
            ns(vmm, kind),
            ns(std::process::id(), kind),
            "{kind} namespace"
        );
    }
    assert_eq!(
        ns(vmm, "net"),
        ns(std::process::id(), "net"),
        "no --netns: host net"
    );
    let root = std::fs::read_link(format!("/proc/{vmm}/root")).expect("root link");
    assert_eq!(root, PathBuf::from("/"), "its root as it sees it");

    // Its cgroups hold it and have the limits.
    let groups = jail.groups();
    assert_eq!(groups.len(), 3, "{groups:?}");
    let read = |file: &str| {
        groups
            .iter()
            .map(|g| g.join(file))
            .find(|f| f.exists())
            .map(|f| std::fs::read_to_string(f).expect("read").trim().to_string())
            .unwrap_or_else(|| panic!("no {file} in {groups:?}"))
    };
    assert_eq!(read("pids.max"), "64");
    assert_eq!(read("memory.limit_in_bytes"), "1073741824");
    assert_eq!(read("cpu.cfs_quota_us"), "150000");
    let pids_current: u32 = read("pids.current").parse().expect("pids.current");
    assert!((3..=64).contains(&pids_current), "{pids_current}");
    let usage: u64 = read("memory.usage_in_bytes").parse().expect("usage");
    assert!(usage > 0, "the memory group charges the VM");
    let cgroup = std::fs::read_to_string(format!("/proc/{vmm}/cgroup")).expect("cgroup");
    for controller in ["pids", "memory", "cpu"] {
        let want = format!(":{controller}:/{}/boot", cgroup_parent());
        assert!(
            cgroup.lines().any(|l| l.ends_with(&want)),
            "{want} in {cgroup}"
        );
    }

    // Snapshot into the jail, then restores with cow and uffd, each in a jail of its own.
    snapshot_in_jail(&jail);
    let owner = std::fs::metadata(jail.root().join("snap/memory")).expect("memory");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&owner), UID);
    for backend in ["cow", "uffd"] {
        let (_restored_jail, mut clone) =
            restore_jailed(&jail, &format!("restore-{backend}"), backend);
        assert_eq!(clone.ok("echo restored"), "restored", "{backend}");
        assert_eq!(
            clone.ok("blk-read 0 3 1").get(..8),
            Some("6a61696c"),
            "{backend}"
        );
    }
}

#[test]
fn a_jailed_vmm_cannot_read_a_host_file_outside_its_directory() {
    if !jail_possible() {
        return;
    }
    // The test guest is a host file that rollbox-vmm reads fine outside a jail; jailed, the
    // same path (or one climbing out with ..) names nothing.
    let guest = test_guest().display().to_string();
    assert!(std::fs::File::open(&guest).is_ok());
    let climbing = format!("../../../../../../..{guest}");
    for kernel in [guest.as_str(), climbing.as_str()] {
        let jail = Jail::new("escape", |_| {});
        let mut vm = jail.spawn(&[], &["--kernel", kernel, "--cmdline", TEST_GUEST_CMDLINE]);
        let status = vm.wait(Duration::from_secs(30));
        assert!(!status.success(), "a jailed VMM booted host file {kernel}");
        let stderr = vm.stderr();
        assert!(
            stderr.contains("No such file") && stderr.contains(&guest),
            "{kernel}: {stderr}"
        );
    }
    // A running jailed VMM cannot write outside either: a snapshot into a host directory fails.
    let jail = Jail::new("escape2", with_disk);
    let _vm = jail.boot();
    let outside = tempfile::tempdir().expect("tempdir");
    let api = api_client(&jail.root().join("api.sock"));
    api.pause().unwrap_or_else(|e| panic!("{e}"));
    let body = format!(
        r#"{{"snapshot_type":"Full","snapshot_path":"{0}/vmstate","mem_file_path":"{0}/memory"}}"#,
        outside.path().display()
    );
    // Raw: the test checks the refusal's status.
    let answer = api
        .request("PUT", "/snapshot/create", Some(body.as_bytes()))
        .unwrap_or_else(|e| panic!("{e}"));
    let (status, answer) = (answer.status, answer.text());
    assert!(status >= 400, "{status} {answer}");
    assert_eq!(
        std::fs::read_dir(outside.path()).expect("readdir").count(),
        0
    );
}

/// What a jail leaves: (processes in its mount and pid namespaces, mounts under its root, its
/// cgroups, the mount points the jailer made).
fn leftovers(
    jail: &Jail,
    mnt: &Path,
    pid: &Path,
) -> (Vec<u32>, Vec<String>, Vec<PathBuf>, Vec<PathBuf>) {
    let made = ["kernel", "dev", "proc", "rollbox-vmm"]
        .iter()
        .map(|n| jail.root().join(n))
        .filter(|p| p.exists())
        .collect();
    let mut processes = processes_in("mnt", mnt);
    processes.extend(processes_in("pid", pid));
    (processes, mounts_under(&jail.root()), jail.groups(), made)
}

#[test]
fn killing_a_jail_leaves_no_process_mount_namespace_or_cgroup() {
    if !jail_possible() {
        return;
    }
    for (case, how) in [
        ("vmm", "SIGKILL the VMM"),
        ("term", "SIGTERM the jailer"),
        ("kill", "SIGKILL the jailer"),
    ] {
        let jail = Jail::new(case, with_disk);
        let mut vm = jail.boot();
        let jailer = vm.child.id();
        let (init, vmm) = jail_pids(jailer);
        let (mnt, pid) = (ns(vmm, "mnt"), ns(vmm, "pid"));
        assert!(!processes_in("mnt", &mnt).is_empty());
        assert_eq!(jail.groups().len(), 3);
        let (target, signal) = match case {
            "vmm" => (vmm, libc::SIGKILL),
            "term" => (jailer, libc::SIGTERM),
            _ => (jailer, libc::SIGKILL),
        };
        // SAFETY: signals a process this test started.
        unsafe { libc::kill(target as i32, signal) };
        let status = vm.wait(Duration::from_secs(30));
        assert!(!status.success(), "{how}: {status}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{init}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        // The kernel ends the rest of the jail with its PID 1, and the VMM's helpers die with
        // it (their parent-death signal); on a loaded machine that may take a moment.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(processes_in("pid", &pid).is_empty() && processes_in("mnt", &mnt).is_empty())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        if case == "kill" {
            // Nothing was left to remove the groups: `rollbox serve` does, with this call.
            let errors = rollbox_jailer::remove_jail_groups(
                Path::new(CGROUP_FS),
                &cgroup_parent(),
                &jail.id,
            );
            assert!(errors.is_empty(), "{errors:?}");
        }
        let (processes, mounts, groups, made) = leftovers(&jail, &mnt, &pid);
        assert!(
            processes.is_empty(),
            "{how}: processes left in the jail's namespaces: {processes:?}"
        );
        assert!(mounts.is_empty(), "{how}: mounts left: {mounts:?}");
        assert!(groups.is_empty(), "{how}: cgroups left: {groups:?}");
        if case != "kill" {
            assert!(made.is_empty(), "{how}: mount points left: {made:?}");
        }
        // The VM's own files stay for whoever owns the directory.
        assert!(jail.root().join("disk.img").exists());
    }
    for dir in rollbox_jailer::existing_groups(Path::new(CGROUP_FS), "", &cgroup_parent()) {
        let _ = std::fs::remove_dir(dir);
    }
}

fn mean_ms(samples: &[Duration]) -> f64 {
    samples.iter().map(Duration::as_secs_f64).sum::<f64>() * 1000.0 / samples.len() as f64
}

#[test]
fn figure_what_jailing_adds_to_start_and_restore() {
    if !jail_possible() {
        return;
    }
    const RUNS: usize = 3;
    let (mut boot_plain, mut boot_jailed) = (Vec::new(), Vec::new());
    let (mut restore_plain, mut restore_jailed_ms) = (Vec::new(), Vec::new());
    let source = Jail::new("figure", with_disk);
    {
        let _vm = source.boot();
        snapshot_in_jail(&source);
    }
    for run in 0..RUNS {
        let started = Instant::now();
        let _vm = Vm::boot_with(
            |d| raw_image(&d.join("disk.img"), 4 << 20),
            &["--drive", "{dir}/disk.img"],
        );
        boot_plain.push(started.elapsed());

        let jail = Jail::new(&format!("figure-boot-{run}"), with_disk);
        let started = Instant::now();
        let _vm = jail.boot();
        boot_jailed.push(started.elapsed());

        // Restores until the guest answers, with the cow backend.
        let scratch = tempfile::tempdir().expect("tempdir");
        std::fs::copy(
            source.root().join("disk.img"),
            scratch.path().join("disk.img"),
        )
        .expect("copy");
        let started = Instant::now();
        let mut command = Command::new(vmm_binary());
        command
            .arg("--restore")
            .arg(source.root().join("snap"))
            .arg("--drive-override")
            .arg(format!(
                "drive0={}",
                scratch.path().join("disk.img").display()
            ))
            .arg("--vsock-uds")
            .arg(scratch.path().join("v.sock"));
        let mut plain = Vm::spawn_command(command, scratch);
        assert_eq!(plain.ok("echo r"), "r", "{}", plain.stderr());
        restore_plain.push(started.elapsed());

        let started = Instant::now();
        let (_jail, mut jailed) = restore_jailed(&source, &format!("figure-restore-{run}"), "cow");
        assert_eq!(jailed.ok("echo r"), "r");
        restore_jailed_ms.push(started.elapsed());
    }
    let show = |s: &[Duration]| {
        s.iter()
            .map(|d| format!("{:.1}", d.as_secs_f64() * 1000.0))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("jailer figure ({RUNS} runs each, ms; boot = spawn to the guest's ready line, restore = spawn to the first answer):");
    println!(
        "  boot    plain:  mean {:.1}  [{}]",
        mean_ms(&boot_plain),
        show(&boot_plain)
    );
    println!(
        "  boot    jailed: mean {:.1}  [{}]",
        mean_ms(&boot_jailed),
        show(&boot_jailed)
    );
    println!(
        "  restore plain:  mean {:.1}  [{}]",
        mean_ms(&restore_plain),
        show(&restore_plain)
    );
    println!(
        "  restore jailed: mean {:.1}  [{}]",
        mean_ms(&restore_jailed_ms),
        show(&restore_jailed_ms)
    );
}
