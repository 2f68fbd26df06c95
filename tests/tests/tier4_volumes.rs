//! Shared volumes over virtio-fs: `rollbox-vmm --fs` starts virtiofsd, the agent mounts the
//! volumes named by `rollbox.volume=` at boot, and the guest's file operations reach the host.
//!
//! The tests in `mod tier4` need Linux guests, so they run in the nested lab like
//! `tier4_linux.rs` (`scripts/test.sh` runs this binary there with the fixtures of
//! `scripts/lab/tier4-fixtures.sh`, ROLLBOX_TIER4_FIXTURES, and virtiofsd from
//! `scripts/virtiofsd.sh`, ROLLBOX_VIRTIOFSD). The tests outside it check bad input on the
//! host: it is refused before any VM exists.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{AgentClient, DEFAULT_PORT};
use rollbox_tests::{api, skip, vmm_binary, wait_for_socket};

const AGENT_TIMEOUT: Duration = Duration::from_secs(300);
const EXIT_TIMEOUT: Duration = Duration::from_secs(120);
const CMDLINE: &str = "console=ttyS0 reboot=k panic=1 loglevel=4 init=/.rollbox/rollbox-agent";

/// Runs rollbox-vmm with `args` and returns its status and stderr (for refusals).
fn vmm_refuses(args: &[&str]) -> (ExitStatus, String) {
    let out = Command::new(vmm_binary())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run rollbox-vmm");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_volumes_are_refused_with_a_reason_before_anything_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let share = dir.path().join("share");
    std::fs::create_dir(&share).expect("share");
    let share_s = share.display().to_string();
    let kernel = dir.path().join("no-kernel-needed");
    std::fs::write(&kernel, b"not reached").expect("kernel");
    let fake = dir.path().join("virtiofsd");
    std::fs::write(&fake, b"").expect("fake virtiofsd");
    let base = |fs: &str| {
        vec![
            "--kernel".to_string(),
            kernel.display().to_string(),
            "--virtiofsd".into(),
            fake.display().to_string(),
            "--fs".into(),
            fs.to_string(),
        ]
    };
    let cases = [
        (
            base(&format!("t={}", dir.path().join("absent").display())),
            "absent",
        ),
        (base(&format!("{}={share_s}", "x".repeat(37))), "1-36 bytes"),
        (base(&format!("={share_s}")), "fs tag \"\" is invalid"),
        (base(&format!("t={share_s},cache=sometimes")), "--fs"),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (status, stderr) = vmm_refuses(&args);
        assert!(!status.success(), "{args:?} was accepted");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    let mut clash = base(&format!("t={share_s}"));
    clash.extend(["--fs".into(), format!("t={share_s}")]);
    let clash: Vec<&str> = clash.iter().map(String::as_str).collect();
    let (status, stderr) = vmm_refuses(&clash);
    assert!(
        !status.success() && stderr.contains("already configured"),
        "{stderr}"
    );
    let missing = [
        "--kernel",
        &kernel.display().to_string(),
        "--virtiofsd",
        "/nonexistent/virtiofsd",
        "--fs",
        &format!("t={share_s}"),
    ]
    .map(str::to_string);
    let missing: Vec<&str> = missing.iter().map(String::as_str).collect();
    let (status, stderr) = vmm_refuses(&missing);
    assert!(
        !status.success() && stderr.contains("scripts/virtiofsd.sh"),
        "{stderr}"
    );
    // Nothing half-created: only what the test made is in its directory.
    let mut left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    left.sort();
    assert_eq!(left, ["no-kernel-needed", "share", "virtiofsd"]);
}

#[test]
fn put_fs_checks_each_volume_and_refuses_clashes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let share = dir.path().join("share");
    std::fs::create_dir(&share).expect("share");
    let fake = dir.path().join("virtiofsd");
    std::fs::write(&fake, b"").expect("fake virtiofsd");
    let sock = dir.path().join("api.sock");
    let mut vmm = Command::new(vmm_binary())
        .arg("--api-sock")
        .arg(&sock)
        .arg("--virtiofsd")
        .arg(&fake)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rollbox-vmm");
    wait_for_socket(&sock, Duration::from_secs(10));
    let put = |tag: &str, body: String| api(&sock, "PUT", &format!("/fs/{tag}"), Some(&body));
    let body =
        |tag: &str, dir: &Path| format!(r#"{{"tag":"{tag}","shared_dir":"{}"}}"#, dir.display());
    assert_eq!(put("a", body("a", &share)).0, 204);
    let (status, answer) = put("a", body("a", &share));
    assert!(
        status == 400 && answer.contains("already configured"),
        "{answer}"
    );
    let (status, answer) = put("b", body("b", &dir.path().join("absent")));
    assert!(status == 400 && answer.contains("absent"), "{answer}");
    let (status, answer) = put("c", body("b", &share));
    assert!(
        status == 400 && answer.contains("does not match"),
        "{answer}"
    );
    let (status, answer) = put(
        "d",
        format!(
            r#"{{"tag":"d","shared_dir":"{}","cache":"sometimes"}}"#,
            share.display()
        ),
    );
    assert!(status == 400 && answer.contains("sometimes"), "{answer}");
    let _ = vmm.kill();
    let _ = vmm.wait();
}

/// The fixtures and virtiofsd, or None after recording why this test can't run here.
fn prerequisites(test: &str) -> Option<(HashMap<String, String>, PathBuf)> {
    let no_hw = !Path::new("/dev/kvm").exists()
        || Path::new("/sys/module/kvm_pvm").exists()
        || !(Path::new("/sys/module/kvm_intel").exists()
            || Path::new("/sys/module/kvm_amd").exists());
    if no_hw {
        skip(test, "no KVM with hardware virtualization here (PVM or none); scripts/test.sh runs tier 4 in the nested lab");
        return None;
    }
    let Some(dir) = std::env::var_os("ROLLBOX_TIER4_FIXTURES") else {
        skip(
            test,
            "ROLLBOX_TIER4_FIXTURES is not set (scripts/lab/tier4-fixtures.sh DIR prepares them)",
        );
        return None;
    };
    let Some(virtiofsd) = std::env::var_os("ROLLBOX_VIRTIOFSD").map(PathBuf::from) else {
        skip(test, "ROLLBOX_VIRTIOFSD is not set (scripts/virtiofsd.sh builds virtiofsd and prints its path)");
        return None;
    };
    let env = Path::new(&dir).join("fixtures.env");
    let text = std::fs::read_to_string(&env)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", env.display()));
    let vars = text
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Some((vars, virtiofsd))
}

/// A busybox guest with volumes, driven through its agent.
struct Guest {
    child: Child,
    dir: PathBuf,
    runtime: tokio::runtime::Runtime,
    client: Option<AgentClient>,
}

impl Guest {
    /// Boots the busybox rootfs with `volumes` (`--fs` values) mounted at `mounts`
    /// (`rollbox.volume=` values).
    fn boot(
        fx: &HashMap<String, String>,
        virtiofsd: &Path,
        dir: &Path,
        volumes: &[String],
        mounts: &[&str],
    ) -> Guest {
        let rootfs = dir.join("root.ext4");
        let status = Command::new("cp")
            .arg("--sparse=always")
            .arg(&fx["BUSYBOX_ROOTFS"])
            .arg(&rootfs)
            .status()
            .expect("cp");
        assert!(status.success());
        let mut cmdline = CMDLINE.to_string();
        for m in mounts {
            cmdline.push_str(&format!(" rollbox.volume={m}"));
        }
        let mut args = vec![
            "--kernel".to_string(),
            fx["OUR_VMLINUX"].clone(),
            "--drive".into(),
            format!("{},root", rootfs.display()),
            // Room for a 256 MiB file in the guest's /tmp (tmpfs: half of RAM).
            "--memory-mib".into(),
            "1024".into(),
            "--vsock-cid".into(),
            "3".into(),
            "--vsock-uds".into(),
            dir.join("vsock").display().to_string(),
            "--console".into(),
            dir.join("console").display().to_string(),
            "--virtiofsd".into(),
            virtiofsd.display().to_string(),
            "--cmdline".into(),
            cmdline,
        ];
        for v in volumes {
            args.extend(["--fs".to_string(), v.clone()]);
        }
        let stderr = std::fs::File::create(dir.join("stderr")).expect("stderr");
        let child = Command::new(vmm_binary())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn rollbox-vmm");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut guest = Guest {
            child,
            dir: dir.to_path_buf(),
            runtime,
            client: None,
        };
        guest.connect();
        guest
    }

    fn connect(&mut self) {
        let started = Instant::now();
        let uds = self.dir.join("vsock");
        loop {
            let attempt = self.runtime.block_on(async {
                let client = tokio::time::timeout(
                    Duration::from_secs(10),
                    AgentClient::connect_unix(&uds, DEFAULT_PORT),
                )
                .await
                .ok()?
                .ok()?;
                tokio::time::timeout(Duration::from_secs(20), client.hello())
                    .await
                    .ok()?
                    .ok()?;
                Some(client)
            });
            if let Some(client) = attempt {
                self.client = Some(client);
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "rollbox-vmm ended ({status}) before the agent answered\n{}",
                    self.report()
                );
            }
            assert!(
                started.elapsed() < AGENT_TIMEOUT,
                "the agent did not answer\n{}",
                self.report()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn report(&self) -> String {
        let read = |name: &str| std::fs::read_to_string(self.dir.join(name)).unwrap_or_default();
        let tail = |text: String| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        };
        format!(
            "--- console ---\n{}\n--- rollbox-vmm stderr ---\n{}",
            tail(read("console")),
            tail(read("stderr"))
        )
    }

    /// Runs `script`; returns (exit code, stdout, stderr).
    fn sh_status(&self, script: &str) -> (Option<i32>, String, String) {
        let client = self.client.as_ref().expect("connected");
        let out = self
            .runtime
            .block_on(client.sh(script))
            .unwrap_or_else(|e| panic!("exec {script:?}: {e}\n{}", self.report()));
        (
            out.status.code,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `script` and returns its trimmed stdout; panics unless it exits 0.
    fn sh(&self, script: &str) -> String {
        let (code, stdout, stderr) = self.sh_status(script);
        assert_eq!(
            code,
            Some(0),
            "{script:?} failed:\nstdout: {stdout}\nstderr: {stderr}"
        );
        stdout.trim().to_string()
    }

    /// Waits for rollbox-vmm to end.
    fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + EXIT_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "rollbox-vmm did not end\n{}",
                self.report()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Powers the guest off and checks that rollbox-vmm ended with 0 and left no virtiofsd.
    fn poweroff(mut self) {
        let pid = self.child.id();
        // The connection ends with the guest, so only wait until the command started.
        let client = self.client.as_ref().expect("connected");
        let started = self.runtime.block_on(async {
            let mut handle = client
                .exec(rollbox_agent_protocol::ExecRequest::shell("poweroff -f"))
                .await?;
            handle.started().await
        });
        started.unwrap_or_else(|e| panic!("start poweroff: {e}\n{}", self.report()));
        let status = self.wait();
        assert_eq!(status.code(), Some(0), "poweroff\n{}", self.report());
        let leftover = std::env::temp_dir().join(format!("rollbox-vmm-{pid}-fs0"));
        assert!(!leftover.exists(), "{} was left behind", leftover.display());
        assert!(
            virtiofsd_of(pid).is_empty(),
            "a virtiofsd of {pid} outlived it"
        );
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("{}", self.report());
        }
    }
}

/// PIDs of the virtiofsd processes serving rollbox-vmm `pid` (their socket path names it).
fn virtiofsd_of(pid: u32) -> Vec<u32> {
    let needle = format!("rollbox-vmm-{pid}-fs");
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|p| {
                    std::fs::read(format!("/proc/{p}/cmdline"))
                        .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                        .unwrap_or(false)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn sha256_of(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// A scratch directory with `share/` (prepared by `setup`, given the scratch directory) and a
/// guest that has it as volume `tag` (`--fs tag=share{opts}`) mounted at boot at `mount`
/// (a `rollbox.volume=` value); None after recording why `test` can't run here.
fn share_with_guest(
    test: &str,
    tag: &str,
    opts: &str,
    mount: &str,
    setup: impl FnOnce(&Path),
) -> Option<(tempfile::TempDir, PathBuf, Guest)> {
    let (fx, virtiofsd) = prerequisites(test)?;
    let work = tempfile::tempdir().expect("tempdir");
    let share = work.path().join("share");
    std::fs::create_dir(&share).expect("share");
    setup(work.path());
    let volume = format!("{tag}={}{opts}", share.display());
    let guest = Guest::boot(&fx, &virtiofsd, work.path(), &[volume], &[mount]);
    Some((work, share, guest))
}

mod tier4 {
    use super::*;

    #[test]
    fn guest_file_operations_reach_the_host() {
        let Some((_work, share, guest)) = share_with_guest(
            "tier4::guest_file_operations_reach_the_host",
            "data",
            "",
            "data:/mnt/data",
            |work| {
                std::fs::write(work.join("share").join("from-host"), "host says hi\n")
                    .expect("host file");
            },
        ) else {
            return;
        };
        // Mounted at boot by the agent.
        assert!(guest
            .sh("cat /proc/mounts")
            .contains("data /mnt/data virtiofs rw"));
        assert_eq!(guest.sh("cat /mnt/data/from-host"), "host says hi");
        guest.sh("echo written > /mnt/data/a && mkdir /mnt/data/dir");
        assert_eq!(
            std::fs::read_to_string(share.join("a")).expect("a"),
            "written\n"
        );
        assert!(share.join("dir").is_dir());
        guest.sh("mv /mnt/data/a /mnt/data/dir/b");
        assert!(!share.join("a").exists());
        assert_eq!(
            std::fs::read_to_string(share.join("dir/b")).expect("b"),
            "written\n"
        );
        guest.sh("dd if=/dev/zero of=/mnt/data/synced bs=4096 count=3 conv=fsync 2>/dev/null");
        assert_eq!(
            std::fs::metadata(share.join("synced"))
                .expect("synced")
                .len(),
            12288
        );
        guest.sh("rm /mnt/data/dir/b /mnt/data/synced && rmdir /mnt/data/dir");
        assert!(!share.join("dir").exists() && !share.join("synced").exists());
        let mut names: Vec<_> = std::fs::read_dir(&share)
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["from-host"]);
        guest.poweroff();
    }

    #[test]
    fn a_readonly_volume_refuses_writes_with_erofs() {
        let Some((_work, share, guest)) = share_with_guest(
            "tier4::a_readonly_volume_refuses_writes_with_erofs",
            "ro",
            ",readonly",
            "ro:/mnt/ro",
            |work| {
                std::fs::write(work.join("share").join("f"), "keep\n").expect("host file");
                // Mounted read-write in the guest: virtiofsd --readonly itself must refuse.
            },
        ) else {
            return;
        };
        assert_eq!(guest.sh("cat /mnt/ro/f"), "keep");
        for script in [
            "echo x > /mnt/ro/new",
            "echo x >> /mnt/ro/f",
            "rm /mnt/ro/f",
            "mkdir /mnt/ro/d",
            "mv /mnt/ro/f /mnt/ro/g",
        ] {
            let (code, _, stderr) = guest.sh_status(script);
            assert_ne!(code, Some(0), "{script} succeeded on a readonly volume");
            assert!(
                stderr.contains("Read-only file system"),
                "{script}: {stderr}"
            );
        }
        let names: Vec<_> = std::fs::read_dir(&share)
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["f"]);
        assert_eq!(
            std::fs::read_to_string(share.join("f")).expect("f"),
            "keep\n"
        );
        guest.poweroff();
    }

    #[test]
    fn dotdot_and_symlinks_cannot_leave_the_shared_directory() {
        let Some((work, share, guest)) = share_with_guest(
            "tier4::dotdot_and_symlinks_cannot_leave_the_shared_directory",
            "data",
            "",
            "data:/mnt/data",
            |work| {
                let outside = work.join("outside");
                std::fs::create_dir(&outside).expect("outside");
                std::fs::write(outside.join("secret"), "host secret\n").expect("secret");
                std::os::unix::fs::symlink(&outside, work.join("share").join("abs"))
                    .expect("abs link");
                std::os::unix::fs::symlink("../outside", work.join("share").join("rel"))
                    .expect("rel link");
            },
        ) else {
            return;
        };
        for script in [
            "cat /mnt/data/abs/secret",
            "cat /mnt/data/rel/secret",
            "cat /mnt/data/../outside/secret",
            "cat /mnt/data/../../outside/secret",
            "echo escaped > /mnt/data/abs/new",
            "echo escaped > /mnt/data/rel/new",
        ] {
            let (_, stdout, _) = guest.sh_status(script);
            assert!(
                !stdout.contains("host secret"),
                "{script} read the host's file"
            );
        }
        // The guest's own symlink to an absolute path resolves in the guest.
        guest.sh("ln -s /etc /mnt/data/guest-etc");
        assert!(guest.sh("ls /mnt/data/guest-etc/").contains("passwd"));
        assert_eq!(
            std::fs::read_link(share.join("guest-etc")).expect("readlink"),
            PathBuf::from("/etc")
        );
        let names: Vec<_> = std::fs::read_dir(work.path().join("outside"))
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["secret"], "something was written outside the share");
        guest.poweroff();
    }

    #[test]
    fn a_256_mib_file_written_in_the_guest_has_the_same_checksum_on_the_host() {
        let Some((_work, share, guest)) = share_with_guest(
            "tier4::a_256_mib_file_written_in_the_guest_has_the_same_checksum_on_the_host",
            "data",
            "",
            "data:/mnt/data",
            |_| {},
        ) else {
            return;
        };
        let mib: u32 = 256;
        guest.sh(&format!(
            "dd if=/dev/urandom of=/tmp/big bs=1M count={mib} 2>/dev/null"
        ));
        let started = Instant::now();
        guest.sh("dd if=/tmp/big of=/mnt/data/big bs=1M conv=fsync 2>/dev/null");
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "virtio-fs: {mib} MiB written from guest tmpfs with fsync in {secs:.1} s ({:.1} MiB/s, nested lab)",
            f64::from(mib) / secs
        );
        let in_guest = guest.sh("sha256sum /tmp/big");
        let in_guest = in_guest.split_whitespace().next().unwrap_or_default();
        assert_eq!(sha256_of(&share.join("big")), in_guest);
        assert_eq!(
            std::fs::metadata(share.join("big")).expect("big").len(),
            u64::from(mib) << 20
        );
        guest.poweroff();
    }

    #[test]
    fn when_virtiofsd_dies_the_vm_stops_with_an_error_naming_the_volume() {
        let Some((work, share, mut guest)) = share_with_guest(
            "tier4::when_virtiofsd_dies_the_vm_stops_with_an_error_naming_the_volume",
            "precious",
            "",
            "precious:/mnt/p",
            |_| {},
        ) else {
            return;
        };
        guest.sh("echo before > /mnt/p/f");
        assert_eq!(
            std::fs::read_to_string(share.join("f")).expect("f"),
            "before\n"
        );
        let daemons = virtiofsd_of(guest.child.id());
        assert_eq!(daemons.len(), 1, "one virtiofsd per volume");
        // SAFETY: kill(2) on a PID we found serving our VMM.
        assert_eq!(unsafe { libc::kill(daemons[0] as i32, libc::SIGKILL) }, 0);
        let status = guest.wait();
        assert_eq!(status.code(), Some(1), "{}", guest.report());
        let stderr = std::fs::read_to_string(work.path().join("stderr")).expect("stderr");
        assert!(
            stderr.contains("volume precious: the virtio-fs backend closed"),
            "{stderr}"
        );
    }
}
