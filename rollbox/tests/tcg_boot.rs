//! The built rootfs boots: the guest kernel under QEMU TCG (scripts/tcg/boot.sh) mounts it
//! and runs the real guest agent as PID 1 (`init=/.rollbox/rollbox-agent`).
//!
//! Needs artifacts built by other parts: the static agent
//! (target/agent-static/.../rollbox-agent), a guest kernel (ROLLBOX_KERNEL, else
//! ROLLBOX_KERNEL_DIR, else kernel-config/build.sh's cache), qemu-system-x86_64 and
//! vhost-device-vsock. Without them it skips with one line, unless ROLLBOX_REQUIRE_ALL=1.

// Test code: a panic on a broken fixture is the failure report.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox_tests::images::*;
use rollbox_tests::{skip, workspace_root as workspace};

fn kernel() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ROLLBOX_KERNEL") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    // scripts/test.sh exports the kernel-config/build.sh output directory.
    if let Some(dir) = std::env::var_os("ROLLBOX_KERNEL_DIR") {
        return Some(PathBuf::from(dir).join("bzImage")).filter(|p| p.is_file());
    }
    let cache = PathBuf::from(
        std::env::var_os("ROLLBOX_KERNEL_CACHE")
            .unwrap_or_else(|| "/var/cache/rollbox/kernel".into()),
    );
    let hash = Command::new(workspace().join("kernel-config/build.sh"))
        .arg("--print-hash")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if let Some(current) = hash
        .map(|h| cache.join(h).join("bzImage"))
        .filter(|p| p.is_file())
    {
        return Some(current);
    }
    // An older build still boots the rootfs.
    fs::read_dir(&cache)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bzImage")))
        .filter(|p| p.is_file())
        .max_by_key(|p| fs::metadata(p).and_then(|m| m.modified()).ok())
}

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn boots_under_tcg_with_the_agent_as_init() {
    const TEST: &str = "boots_under_tcg_with_the_agent_as_init";
    if !root_or_skip(TEST) {
        return;
    }
    let agent =
        workspace().join("target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent");
    if !agent.is_file() {
        return skip(
            TEST,
            &format!("the static agent is not built ({})", agent.display()),
        );
    }
    let Some(kernel) = kernel() else {
        return skip(
            TEST,
            "no guest kernel (kernel-config/build.sh, or set ROLLBOX_KERNEL)",
        );
    };
    if !on_path("qemu-system-x86_64") || !on_path("vhost-device-vsock") {
        return skip(TEST, "needs qemu-system-x86_64 and vhost-device-vsock");
    }

    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    standard_image().write_oci_layout(&layout, "boot");
    let built = build_ok(&[
        "image",
        "build",
        "--from-oci-layout",
        layout.to_str().unwrap(),
        "--agent",
        agent.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
    ]);

    let state = dir.path().join("vm");
    let boot = workspace().join("scripts/tcg/boot.sh");
    let started = Command::new(&boot)
        .args([
            "--kernel",
            kernel.to_str().unwrap(),
            "--rootfs",
            built.rootfs.to_str().unwrap(),
        ])
        .args(["--vsock-uds", dir.path().join("vm.vsock").to_str().unwrap()])
        .args([
            "--state-dir",
            state.to_str().unwrap(),
            "--mem",
            "512",
            "--append",
            "init=/.rollbox/rollbox-agent",
        ])
        .status()
        .unwrap();
    assert!(started.success(), "{} failed", boot.display());
    let stop = || {
        let _ = Command::new(workspace().join("scripts/tcg/stop.sh"))
            .arg(&state)
            .status();
    };

    let serial = state.join("serial.log");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut log = String::new();
    while Instant::now() < deadline {
        log = fs::read_to_string(&serial).unwrap_or_default();
        if log.contains("rollbox-agent") && log.contains("listening")
            || log.contains("Kernel panic")
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    stop();
    eprintln!("{log}");
    assert!(
        log.contains("Run /.rollbox/rollbox-agent as init process"),
        "the kernel did not start the agent"
    );
    assert!(!log.contains("Kernel panic"), "kernel panic");
    assert!(
        log.contains("rollbox-agent") && log.contains("listening"),
        "the agent did not come up"
    );
}
