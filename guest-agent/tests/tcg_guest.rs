//! The static agent as /sbin/init of a real Linux guest under QEMU TCG,
//! reached over virtio-vsock (vhost-device-vsock's host side speaks the same
//! "CONNECT <port>" preamble as rollbox-vmm). This covers what host mode
//! cannot: the vsock listener, PID 1 mounts, cgroup2 delegation and OOM
//! detection, fixups that really set the (guest's) clock and hostname, and PTYs
//! and inotify on the guest kernel.
//!
//! Needs the guest kernel (ROLLBOX_GUEST_KERNEL, else ROLLBOX_KERNEL_DIR/bzImage, else
//! the newest /var/cache/rollbox/kernel/*/bzImage from kernel-config/build.sh), the static
//! agent (guest-agent/build-static.sh), qemu-system-x86, vhost-device-vsock,
//! busybox-static and mkfs.ext4. Skips with one line when any is missing,
//! unless ROLLBOX_REQUIRE_ALL=1.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rollbox_agent_protocol::client::connect_unix_tcp;
use rollbox_agent_protocol::{
    AgentClient, ClientMessage, ExecRequest, FsEventKind, OomDetection, PtySize, ServerMessage,
    WatchRequest, DEFAULT_PORT,
};
use rollbox_tests::skip;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn kernel() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ROLLBOX_GUEST_KERNEL") {
        return Some(PathBuf::from(path));
    }
    if let Some(dir) = std::env::var_os("ROLLBOX_KERNEL_DIR") {
        return Some(PathBuf::from(dir).join("bzImage"));
    }
    let mut kernels: Vec<(SystemTime, PathBuf)> = std::fs::read_dir("/var/cache/rollbox/kernel")
        .ok()?
        .flatten()
        .map(|e| e.path().join("bzImage"))
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .collect();
    kernels.sort();
    kernels.pop().map(|(_, p)| p)
}

fn static_agent() -> PathBuf {
    std::env::var_os("ROLLBOX_AGENT_STATIC")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            repo().join("target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent")
        })
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
        || (tool == "vhost-device-vsock"
            && Path::new(&format!(
                "{}/.cargo/bin/vhost-device-vsock",
                std::env::var("HOME").unwrap_or_default()
            ))
            .exists())
}

fn missing() -> Option<String> {
    let Some(kernel) = kernel() else {
        return Some(
            "no guest kernel (kernel-config/build.sh, or set ROLLBOX_GUEST_KERNEL)".into(),
        );
    };
    if !kernel.exists() {
        return Some(format!("guest kernel {} does not exist", kernel.display()));
    }
    if !static_agent().exists() {
        return Some(format!(
            "no static agent at {} (run guest-agent/build-static.sh)",
            static_agent().display()
        ));
    }
    for tool in ["qemu-system-x86_64", "vhost-device-vsock", "mkfs.ext4"] {
        if !have(tool) {
            return Some(format!("{tool} is not installed"));
        }
    }
    if !Command::new("dpkg")
        .args(["-s", "busybox-static"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Some("busybox-static is not installed".into());
    }
    None
}

/// Stops the guest when the test ends, however it ends.
struct Guest {
    state: PathBuf,
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = Command::new(repo().join("scripts/tcg/stop.sh"))
            .arg(&self.state)
            .output();
    }
}

fn make_rootfs(work: &Path) -> PathBuf {
    let root = work.join("root");
    for dir in ["bin", "etc", "root", "sbin"] {
        std::fs::create_dir_all(root.join(dir)).expect("mkdir");
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).expect("copy busybox");
    let list = Command::new("/bin/busybox")
        .arg("--list")
        .output()
        .expect("busybox --list");
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))
                .expect("applet link");
        }
    }
    std::fs::copy(static_agent(), root.join("sbin/rollbox-agent")).expect("copy agent");
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
    )
    .expect("passwd");
    std::fs::write(root.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n").expect("group");
    let image = work.join("rootfs.ext4");
    let status = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-m", "0", "-d"])
        .arg(&root)
        .arg(&image)
        .arg("64M")
        .output()
        .expect("mkfs.ext4");
    assert!(
        status.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    image
}

#[tokio::test]
async fn agent_is_init_of_a_tcg_guest_over_vsock() {
    if let Some(reason) = missing() {
        return skip("agent_is_init_of_a_tcg_guest_over_vsock", &reason);
    }
    let work = tempfile::tempdir().expect("tempdir");
    let image = make_rootfs(work.path());
    let state = work.path().join("vm");
    let uds = work.path().join("vm.vsock");
    let started = Instant::now();
    let boot = Command::new(repo().join("scripts/tcg/boot.sh"))
        .args(["--kernel"])
        .arg(kernel().expect("kernel"))
        .arg("--rootfs")
        .arg(&image)
        .arg("--vsock-uds")
        .arg(&uds)
        .arg("--state-dir")
        .arg(&state)
        .args([
            "--mem",
            "512",
            "--cpus",
            "1",
            "--append",
            "init=/sbin/rollbox-agent",
        ])
        .output()
        .expect("boot.sh");
    let _guest = Guest {
        state: state.clone(),
    };
    assert!(
        boot.status.success(),
        "boot.sh: {}",
        String::from_utf8_lossy(&boot.stderr)
    );

    let serial = state.join("serial.log");
    let console = || std::fs::read_to_string(&serial).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(180);
    let client = loop {
        if let Ok(Ok(client)) = tokio::time::timeout(
            Duration::from_secs(5),
            AgentClient::connect_unix(&uds, DEFAULT_PORT),
        )
        .await
        {
            break client;
        }
        assert!(
            Instant::now() < deadline,
            "agent did not answer on vsock; console:\n{}",
            console()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    println!(
        "boot to agent answering over vsock: {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let health = client.health().await.expect("health");
    assert_eq!(health.pid, 1);
    assert!(health.is_init);
    println!("guest health: {health:?}");

    let mounts =
        String::from_utf8(client.read_file("/proc/mounts").await.expect("mounts")).expect("utf8");
    for (target, fstype) in [
        ("/proc", "proc"),
        ("/sys", "sysfs"),
        ("/dev", "devtmpfs"),
        ("/dev/pts", "devpts"),
        ("/dev/shm", "tmpfs"),
        ("/run", "tmpfs"),
        ("/tmp", "tmpfs"),
        ("/sys/fs/cgroup", "cgroup2"),
    ] {
        assert!(mounts.lines().any(|l| l.split(' ').nth(1) == Some(target) && l.split(' ').nth(2) == Some(fstype)), "{target} ({fstype}) not mounted:\n{mounts}");
    }
    let hostname = client
        .read_file("/proc/sys/kernel/hostname")
        .await
        .expect("hostname");
    assert_eq!(String::from_utf8_lossy(&hostname).trim(), "rollbox");

    // cgroup2 delegation: an exact OOM verdict in the exec's own cgroup.
    // One 64 MiB buffer, touched at once, overshoots the 16 MiB limit in a single step; a
    // slowly growing shell string could leave the kernel reclaiming file pages under TCG for
    // minutes before it declared the OOM.
    let mut req = ExecRequest::shell(
        "dd if=/dev/zero of=/dev/null bs=64M count=1 2>/dev/null; echo survived",
    );
    req.memory_limit_bytes = Some(16 << 20);
    req.timeout_ms = Some(120_000);
    let output = client.run(req).await.expect("oom run");
    assert_eq!(
        output.status.oom_detection,
        OomDetection::CgroupV2,
        "{:?}",
        output.status
    );
    assert!(output.status.oom_killed, "{:?}", output.status);
    let output = client.sh("echo fine").await.expect("run");
    assert!(!output.status.oom_killed && output.status.oom_detection == OomDetection::CgroupV2);

    // Orphans are reaped by PID 1.
    let output = client.sh("sleep 0.1 & echo $!").await.expect("run");
    let orphan = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let reaped_by = Instant::now() + Duration::from_secs(20);
    while client.stat(&format!("/proc/{orphan}")).await.is_ok() {
        assert!(Instant::now() < reaped_by, "orphan {orphan} never reaped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Restore fixups, for real inside the guest.
    let target = UNIX_EPOCH + Duration::from_secs(1_900_000_000);
    assert!(client.set_time(target).await.expect("set_time").applied);
    let output = client.sh("date +%s").await.expect("date");
    let now: u64 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("seconds");
    assert!(
        (1_900_000_000..1_900_000_600).contains(&now),
        "guest clock reads {now}"
    );
    assert!(client.reseed(&[42u8; 32]).await.expect("reseed").applied);
    let applied = client
        .set_identity(Some("clone-7"), Some("fedcba9876543210fedcba9876543210"))
        .await
        .expect("identity");
    assert!(applied.applied);
    assert_eq!(
        client.sh("hostname").await.expect("hostname").stdout,
        b"clone-7\n"
    );
    assert_eq!(
        client
            .read_file("/etc/machine-id")
            .await
            .expect("machine-id"),
        b"fedcba9876543210fedcba9876543210\n"
    );

    // Exec as another user, files, tar, on the guest's own rootfs.
    let mut req = ExecRequest::argv(["id", "-u"]);
    req.user = Some("nobody".into());
    assert_eq!(client.run(req).await.expect("id").stdout, b"65534\n");
    client.mkdir("/root/work/sub", true).await.expect("mkdir");
    client
        .write_file("/root/work/sub/a.txt", b"in the guest")
        .await
        .expect("write");
    let archive = client.tar_download("/root/work").await.expect("tar");
    client
        .tar_upload("/tmp/copy", &archive[..])
        .await
        .expect("untar");
    assert_eq!(
        client.read_file("/tmp/copy/sub/a.txt").await.expect("read"),
        b"in the guest"
    );

    // A terminal on the guest's devpts, resized while the command waits for input.
    let mut req = ExecRequest::shell("tty; stty size; read a; stty size");
    req.pty = Some(PtySize { rows: 30, cols: 90 });
    let handle = client.exec(req).await.expect("exec on a pty");
    handle
        .resize(PtySize {
            rows: 40,
            cols: 100,
        })
        .await
        .expect("resize");
    handle.write_stdin(b"\n").await.expect("type");
    let output = handle.collect().await.expect("collect");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("/dev/pts/") && text.contains("40 100"),
        "{output:?}"
    );

    // inotify on the guest kernel, recursive.
    let mut watch = client
        .watch(WatchRequest {
            path: "/root/work".into(),
            recursive: true,
            refuse_network_mounts: false,
        })
        .await
        .expect("watch");
    client
        .sh("echo more >> /root/work/sub/a.txt")
        .await
        .expect("append");
    loop {
        match watch.recv().await.expect("watch reply") {
            ServerMessage::FsEvents { events }
                if events
                    .iter()
                    .any(|e| e.name == "sub/a.txt" && e.kind == FsEventKind::Write) =>
            {
                break
            }
            ServerMessage::FsEvents { .. } => continue,
            other => panic!("unexpected {other:?}"),
        }
    }
    watch.send(ClientMessage::Cancel).await.expect("cancel");

    // tcp_connect over vsock to a service on the guest's loopback: busybox httpd.
    let body = "from the guest's httpd";
    client.mkdir("/www", true).await.expect("mkdir /www");
    client
        .write_file("/www/hello.txt", body.as_bytes())
        .await
        .expect("write");
    let output = client
        .sh("httpd -p 127.0.0.1:8080 -h /www")
        .await
        .expect("httpd");
    assert!(output.status.success(), "httpd: {output:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut pipe = loop {
        match connect_unix_tcp(&uds, DEFAULT_PORT, "127.0.0.1", 8080).await {
            Ok(pipe) => break pipe,
            // httpd forks into the background: it may not listen yet.
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("tcp_connect to the guest's httpd: {e}"),
        }
    };
    pipe.write_all(b"GET /hello.txt HTTP/1.0\r\n\r\n")
        .await
        .expect("request");
    // Read up to the body's end, whether or not the transport passes httpd's close on.
    let mut answer = Vec::new();
    let read_answer = async {
        let mut chunk = [0u8; 4096];
        while !answer.ends_with(body.as_bytes()) {
            match pipe.read(&mut chunk).await.expect("answer") {
                0 => break,
                n => answer.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read_answer)
        .await
        .expect("answer in time");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.") && answer.contains(" 200 ") && answer.ends_with(body),
        "{answer}"
    );
    let refused = connect_unix_tcp(&uds, DEFAULT_PORT, "127.0.0.1", 8081)
        .await
        .expect_err("nothing listens on 8081");
    assert_eq!(
        refused.agent_error().map(|e| e.code.as_str()),
        Some("ECONNREFUSED"),
        "{refused}"
    );

    println!(
        "whole guest check: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
