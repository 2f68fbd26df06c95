//! Tier 3, the guest image with Docker inside: our kernel (kernel-config/build.sh) boots under
//! QEMU TCG (scripts/tcg/boot.sh) a rootfs that our image builder (`rollbox image build`) made
//! from a Debian bookworm base with docker.io (scripts/tcg/docker-rootfs.sh). Over vsock, with
//! the host client from agent-protocol, it checks exec and files end to end, then has the agent
//! start dockerd in the guest, loads an image made on the host (`docker save
//! rollbox-test/busybox:latest`) with `docker load`, and runs a container with `--network none`.
//!
//! One VM for the whole suite. Figures (boot to agent, dockerd ready, docker run) go to stderr;
//! they are never asserted.
//!
//! Needs: root, qemu-system-x86_64, vhost-device-vsock, a guest kernel (ROLLBOX_KERNEL_DIR, else
//! kernel-config/build.sh's cache), dockerd on the host (scripts/start-dockerd.sh), debootstrap
//! and the Debian mirror on the first run, the static agent (guest-agent/build-static.sh) and
//! the rollbox binary (built when missing). Skips with one line when one is missing, unless
//! ROLLBOX_REQUIRE_ALL=1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{
    AgentClient, DockerRunRequest, ExecEvent, ExecRequest, FileKind, OutputStream, DEFAULT_PORT,
};
use rollbox_tests::{skip, workspace_root};

const TEST: &str = "tier3_guest_docker";
/// The image `scripts/start-dockerd.sh` makes on the host; it is carried into the guest.
const BUSYBOX_IMAGE: &str = "rollbox-test/busybox:latest";
const DEBIAN_REPO: &str = "rollbox-test/debian-docker";
const DOCKERD_TIMEOUT: Duration = Duration::from_secs(180);
const AGENT_TIMEOUT: Duration = Duration::from_secs(180);

fn on_path(tool: &str) -> Option<PathBuf> {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
}

fn vhost_device_vsock_installed() -> bool {
    on_path("vhost-device-vsock").is_some()
        || std::env::var_os("HOME").is_some_and(|home| {
            Path::new(&home)
                .join(".cargo/bin/vhost-device-vsock")
                .is_file()
        })
}

/// The guest kernel: ROLLBOX_KERNEL_DIR/bzImage (CI), else kernel-config/build.sh's output when
/// it is cached (the script would otherwise start a build of several minutes), else the newest
/// complete build in its cache.
fn kernel() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("ROLLBOX_KERNEL_DIR") {
        let bz = PathBuf::from(dir).join("bzImage");
        return if bz.is_file() {
            Ok(bz)
        } else {
            Err(format!(
                "ROLLBOX_KERNEL_DIR has no bzImage ({})",
                bz.display()
            ))
        };
    }
    let build = workspace_root().join("kernel-config/build.sh");
    let hash = Command::new(&build)
        .arg("--print-hash")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", build.display()))?;
    let hash = String::from_utf8_lossy(&hash.stdout).trim().to_string();
    let cache = std::env::var_os("ROLLBOX_KERNEL_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/rollbox/kernel"), PathBuf::from);
    if hash.is_empty() || !cache.join(&hash).join("vmlinux").is_file() {
        // An older complete build still boots the image (as rollbox/tests/tcg_boot.rs does).
        let newest = std::fs::read_dir(&cache)
            .ok()
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|d| d.join("vmlinux").is_file() && d.join("bzImage").is_file())
            .max_by_key(|d| d.join("bzImage").metadata().and_then(|m| m.modified()).ok());
        return match newest {
            Some(dir) => {
                eprintln!(
                    "{TEST}: kernel-config {hash:?} is not built yet; using the newest cached kernel {}",
                    dir.display()
                );
                Ok(dir.join("bzImage"))
            }
            None => Err(format!(
                "no guest kernel: kernel-config {hash:?} is not built (run kernel-config/build.sh, or set ROLLBOX_KERNEL_DIR)"
            )),
        };
    }
    // Cached: build.sh answers at once with the output directory on its last line.
    let out = Command::new(&build)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", build.display()))?;
    let dir = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string();
    let bz = Path::new(&dir).join("bzImage");
    if out.status.success() && bz.is_file() {
        Ok(bz)
    } else {
        Err(format!(
            "kernel-config/build.sh gave no bzImage: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn last_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn docker_answers() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn rollbox_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("ROLLBOX_BIN") {
        return PathBuf::from(path);
    }
    let target = workspace_root().join("target");
    for profile in ["release", "debug"] {
        let bin = target.join(profile).join("rollbox");
        if bin.is_file() {
            return bin;
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).current_dir(workspace_root()).args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "rollbox",
    ]));
    target.join("release/rollbox")
}

/// Stops the guest (QEMU, then the vsock backend) however the test ends.
struct Guest {
    state: PathBuf,
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = Command::new(workspace_root().join("scripts/tcg/stop.sh"))
            .arg(&self.state)
            .output();
    }
}

/// What the host prepares before the VM starts.
struct Prepared {
    rootfs: PathBuf,
    kernel_cmdline: String,
    busybox_tar: PathBuf,
}

fn seconds(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

/// Base tarball -> `docker import` (once per tarball) -> `docker save` -> `rollbox image build`.
fn prepare(work: &Path) -> Prepared {
    let t = Instant::now();
    let out = run(&mut Command::new(
        workspace_root().join("scripts/tcg/docker-rootfs.sh"),
    ));
    let tarball = PathBuf::from(last_line(&out));
    assert!(
        tarball.is_file(),
        "docker-rootfs.sh printed {} which is no file",
        tarball.display()
    );
    eprintln!(
        "{TEST}: base tarball {} ({:.1} s)",
        tarball.display(),
        seconds(t)
    );

    // The cache directory's name is the script's hash: one imported image per tarball.
    let hash = tarball
        .parent()
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tag = format!("{DEBIAN_REPO}:{hash}");
    let t = Instant::now();
    let present = Command::new("docker")
        .args(["image", "inspect", &tag])
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        run(Command::new("docker")
            .args([
                "import",
                "--message",
                "rollbox TCG-tier base (scripts/tcg/docker-rootfs.sh)",
            ])
            .arg(&tarball)
            .arg(&tag));
        // Images of older base tarballs (an older script) are never used again.
        let listed = run(Command::new("docker").args([
            "images",
            "--format",
            "{{.Repository}}:{{.Tag}}",
            DEBIAN_REPO,
        ]));
        for old in String::from_utf8_lossy(&listed.stdout).lines() {
            if old.trim() != tag && !old.trim().is_empty() {
                let _ = Command::new("docker").args(["rmi", old.trim()]).output();
            }
        }
    }
    let archive = work.join("debian-docker.tar");
    run(Command::new("docker")
        .args(["save", "-o"])
        .arg(&archive)
        .arg(&tag));
    eprintln!(
        "{TEST}: docker import{} + save {tag}: {:.1} s",
        if present { " (cached)" } else { "" },
        seconds(t)
    );

    let busybox_tar = work.join("busybox.tar");
    run(Command::new("docker")
        .args(["save", "-o"])
        .arg(&busybox_tar)
        .arg(BUSYBOX_IMAGE));

    let agent = match std::env::var_os("ROLLBOX_AGENT_STATIC") {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from(last_line(&run(&mut Command::new(
            workspace_root().join("guest-agent/build-static.sh"),
        )))),
    };
    assert!(
        agent.is_file(),
        "static agent {} is missing",
        agent.display()
    );

    let t = Instant::now();
    let out = run(Command::new(rollbox_binary())
        .args(["image", "build", &tag, "--from-docker-archive"])
        .arg(&archive)
        .args(["--size", "1024", "--agent"])
        .arg(&agent)
        .arg("--cache-dir")
        .arg(work.join("image-cache")));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| PathBuf::from(v.trim()))
            .unwrap_or_else(|| panic!("rollbox image build printed no '{name}' line:\n{text}"))
    };
    let rootfs = field("rootfs:");
    let metadata = field("metadata:");
    // The archive is no longer needed; free its disk space before the VM runs.
    let _ = std::fs::remove_file(&archive);
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&metadata).unwrap_or_else(|e| panic!("read {}: {e}", metadata.display())),
    )
    .unwrap_or_else(|e| panic!("parse {}: {e}", metadata.display()));
    let kernel_cmdline = meta["kernel_cmdline"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        kernel_cmdline.contains("init=/.rollbox/rollbox-agent"),
        "image.json kernel_cmdline: {kernel_cmdline:?}"
    );
    let apparent = std::fs::metadata(&rootfs)
        .map(|m| m.len())
        .unwrap_or_default();
    let allocated = std::fs::metadata(&rootfs)
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .unwrap_or_default();
    eprintln!(
        "{TEST}: rollbox image build: {:.1} s; rootfs.ext4 {} MiB apparent, {} MiB allocated",
        seconds(t),
        apparent >> 20,
        allocated >> 20
    );
    Prepared {
        rootfs,
        kernel_cmdline,
        busybox_tar,
    }
}

/// The guest's dockerd log and kernel messages, for a failure report.
async fn guest_diagnostics(client: &AgentClient) -> String {
    let script =
        "echo '--- /var/log/rollbox-dockerd.log'; tail -n 40 /var/log/rollbox-dockerd.log; \
                  echo '--- dmesg'; dmesg | tail -n 40";
    match client.sh(script).await {
        Ok(out) => format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => format!("(no diagnostics: {e})"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier3_guest_docker() {
    let whole = Instant::now();
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return skip(
            TEST,
            "needs root (the image builder reproduces ownership; QEMU and dockerd)",
        );
    }
    if on_path("qemu-system-x86_64").is_none() {
        return skip(
            TEST,
            "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)",
        );
    }
    if !vhost_device_vsock_installed() {
        return skip(
            TEST,
            "vhost-device-vsock is not installed (scripts/tcg/install-vhost-device-vsock.sh)",
        );
    }
    let kernel = match kernel() {
        Ok(k) => k,
        Err(reason) => return skip(TEST, &reason),
    };
    if on_path("docker").is_none() || (!docker_answers() && on_path("dockerd").is_none()) {
        return skip(TEST, "no dockerd on the host (scripts/start-dockerd.sh)");
    }
    // Starts dockerd when it is down and makes rollbox-test/busybox:latest; a no-op otherwise.
    run(&mut Command::new(
        workspace_root().join("scripts/start-dockerd.sh"),
    ));

    let work = tempfile::Builder::new()
        .prefix("rollbox-tier3-docker.")
        .tempdir_in("/var/tmp")
        .expect("tempdir");
    let prepared = prepare(work.path());

    // Boot.
    let state = work.path().join("vm");
    let uds = work.path().join("vm.vsock");
    let booted = Instant::now();
    let boot = Command::new(workspace_root().join("scripts/tcg/boot.sh"))
        .arg("--kernel")
        .arg(&kernel)
        .arg("--rootfs")
        .arg(&prepared.rootfs)
        .arg("--vsock-uds")
        .arg(&uds)
        .arg("--state-dir")
        .arg(&state)
        .args([
            "--mem",
            "2048",
            "--cpus",
            "2",
            "--append",
            &prepared.kernel_cmdline,
        ])
        .output()
        .expect("run scripts/tcg/boot.sh");
    let _guest = Guest {
        state: state.clone(),
    };
    assert!(
        boot.status.success(),
        "boot.sh failed: {}",
        String::from_utf8_lossy(&boot.stderr)
    );
    let console = || std::fs::read_to_string(state.join("serial.log")).unwrap_or_default();

    let deadline = Instant::now() + AGENT_TIMEOUT;
    let client = loop {
        if let Ok(Ok(client)) = tokio::time::timeout(
            Duration::from_secs(5),
            AgentClient::connect_unix(&uds, DEFAULT_PORT),
        )
        .await
        {
            if client.hello().await.is_ok() {
                break client;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not answer on vsock within {AGENT_TIMEOUT:?}; console:\n{}",
            console()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let boot_to_agent = seconds(booted);
    eprintln!(
        "{TEST}: boot to agent answering over vsock: {boot_to_agent:.1} s (kernel {})",
        kernel.display()
    );
    let health = client.health().await.expect("health");
    assert!(
        health.is_init && health.pid == 1,
        "the agent is not PID 1: {health:?}"
    );

    // Exec end to end: output on both streams and the exit code.
    let out = client
        .sh("echo out-$((6*7)); echo err >&2; uname -s; exit 7")
        .await
        .expect("exec");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out-42\nLinux\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.status.code, Some(7), "{:?}", out.status);
    let out = client
        .run(ExecRequest::argv(["cat", "/etc/os-release"]))
        .await
        .expect("cat os-release");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("bookworm"),
        "not the Debian base: {:?}",
        out
    );

    // Files end to end: write, read back, stat, and the guest sees the same bytes.
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(
        client
            .write_file("/root/probe.bin", &payload)
            .await
            .expect("write_file"),
        payload.len() as u64
    );
    assert_eq!(
        client
            .read_file("/root/probe.bin")
            .await
            .expect("read_file"),
        payload
    );
    let info = client.stat("/root/probe.bin").await.expect("stat");
    assert_eq!(
        (info.kind, info.size),
        (FileKind::File, payload.len() as u64),
        "{info:?}"
    );
    let out = client.sh("wc -c < /root/probe.bin").await.expect("wc");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        payload.len().to_string()
    );

    // dockerd in the guest, started by the agent.
    let t = Instant::now();
    if let Err(e) = client.docker_ensure(Some(DOCKERD_TIMEOUT)).await {
        panic!(
            "dockerd did not come up in the guest: {e}\n{}",
            guest_diagnostics(&client).await
        );
    }
    let dockerd_ready = seconds(t);
    eprintln!("{TEST}: dockerd ready in the guest: {dockerd_ready:.1} s");
    let info = client
        .sh("docker info --format '{{.ServerVersion}} {{.Driver}} cgroup-v{{.CgroupVersion}}'")
        .await
        .expect("docker info");
    eprintln!(
        "{TEST}: guest docker: {}",
        String::from_utf8_lossy(&info.stdout).trim()
    );

    // An image made on the host, loaded into the guest's dockerd.
    let t = Instant::now();
    let image = std::fs::read(&prepared.busybox_tar).expect("read busybox.tar");
    client
        .write_file("/var/tmp/busybox.tar", &image)
        .await
        .expect("upload busybox.tar");
    let mut load = ExecRequest::argv(["docker", "load", "-i", "/var/tmp/busybox.tar"]);
    load.timeout_ms = Some(120_000);
    let out = client.run(load).await.expect("docker load");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains(BUSYBOX_IMAGE),
        "docker load failed: {:?}\n{}{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        guest_diagnostics(&client).await
    );
    eprintln!(
        "{TEST}: upload ({} KiB) + docker load: {:.1} s",
        image.len() >> 10,
        seconds(t)
    );

    // A container with no network: the marker streams back, and its exit status comes through.
    let marker = format!("rollbox-tier3-marker-{}", std::process::id());
    let mut request = DockerRunRequest::new(
        BUSYBOX_IMAGE,
        vec!["sh".into(), "-c".into(), format!("echo {marker}; exit 3")],
    );
    request.network = Some("none".into());
    request.timeout_ms = Some(120_000);
    let t = Instant::now();
    let mut handle = client.docker_run(request).await.expect("docker_run");
    let (mut stdout, mut stderr, mut started, mut exited) = (Vec::new(), Vec::new(), false, None);
    while let Some(event) = handle.next_event().await.expect("docker_run event") {
        match event {
            ExecEvent::Started { .. } => started = true,
            ExecEvent::Output {
                stream: OutputStream::Stdout,
                data,
                ..
            } => stdout.extend(data),
            ExecEvent::Output {
                stream: OutputStream::Stderr,
                data,
                ..
            } => stderr.extend(data),
            ExecEvent::Output {
                stream: OutputStream::Pty,
                ..
            } => panic!("docker_run has no terminal, yet sent pty output"),
            ExecEvent::Exited(status) => exited = Some(status),
            ExecEvent::Notice(notice) => eprintln!("{TEST}: notice: {notice}"),
        }
    }
    let docker_run = seconds(t);
    let status = exited.expect("docker_run ended without an exit status");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr),
    );
    assert!(started, "no started event");
    assert!(
        stdout.contains(&marker) && status.code == Some(3),
        "container: {status:?}\nstdout: {stdout}\nstderr: {stderr}\n{}",
        guest_diagnostics(&client).await
    );
    eprintln!("{TEST}: docker run --rm --network none: {docker_run:.1} s");

    let _ = client.close().await;
    eprintln!(
        "{TEST}: figures: boot-to-agent {boot_to_agent:.1} s, dockerd ready {dockerd_ready:.1} s, docker run {docker_run:.1} s, whole test {:.1} s",
        seconds(whole)
    );
}
