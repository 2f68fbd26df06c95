//! `rollbox serve` end to end, snapshots: restore, fork and reset, the rootfs a snapshot
//! carries, retention, deterministic sandboxes, and symlinks a hostile jailed VMM plants in
//! its sandbox directory.
//! The real `rollbox` and `rollbox-vmm` binaries with the tier-2 test guest as the
//! template's kernel (tier 2: needs /dev/kvm); `rollbox_tests::daemon` starts the daemon.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use rollbox::daemon::client::Endpoint;
use rollbox::daemon::vm;
use rollbox_tests::daemon::{
    agent_server, boot_config, cmdline, console, pid_of, wait_for, Server,
};
use rollbox_tests::{kvm_available, rollbox_binary, test_guest, TEST_GUEST_CMDLINE};
use serde_json::{json, Value};

/// The VMM's own view of its VM (`GET /` on its API socket): state "Running" or "Paused".
fn vmm_state(sandbox: &Value) -> String {
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    let response = Endpoint::Unix(dir.join("api.sock"))
        .request("GET", "/", &[], None, Duration::from_secs(10))
        .expect("GET / on the VMM");
    let info: Value = serde_json::from_slice(&response.body).expect("json");
    info["state"].as_str().unwrap_or("").to_string()
}

#[test]
fn snapshot_restore_fork_and_reset() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    wait_for(
        "the test guest's ready line",
        Duration::from_secs(30),
        || console(&sandbox).contains("rollbox-test-guest: ready"),
    );

    // A snapshot leaves the sandbox running.
    let (status, snap) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{snap}\n{}", server.log());
    let snap_id = snap["id"].as_str().expect("snapshot id").to_string();
    assert_eq!(
        (&snap["sandbox"], &snap["parent"]),
        (&json!(id), &Value::Null),
        "{snap}"
    );
    let snap_dir = PathBuf::from(snap["dir"].as_str().expect("dir"));
    assert!(snap_dir.join("vmstate").is_file() && snap_dir.join("memory").is_file());
    assert_eq!(server.get(&id)["state"], "running");
    assert_eq!(vmm_state(&sandbox), "Running");
    let (status, list) = server.call("GET", &format!("/snapshots?sandbox={id}"), None);
    assert_eq!(status, 200);
    assert_eq!(list["snapshots"][0]["id"], snap_id.as_str(), "{list}");

    // Create from the snapshot: a restore (the guest does not boot again), with a parent chain.
    let restored = server.create(json!({"snapshot": snap_id, "ttl_s": 300}));
    let restored_id = restored["id"].as_str().expect("id").to_string();
    assert_eq!(restored["template"], "guest");
    let (pid, _) = pid_of(&restored);
    assert!(cmdline(pid).contains("--restore"), "{}", cmdline(pid));
    assert_eq!(vmm_state(&restored), "Running");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !console(&restored).contains("ready"),
        "the restored guest booted: {}",
        console(&restored)
    );
    let (status, child_snap) = server.call(
        "POST",
        &format!("/sandboxes/{restored_id}/snapshots"),
        Some(json!({"stop": true})),
    );
    assert_eq!(status, 201, "{child_snap}");
    assert_eq!(child_snap["parent"], snap_id.as_str(), "{child_snap}");
    assert_eq!(server.get(&restored_id)["state"], "deleted");
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"snapshot": "snap-00000000000000ff", "ttl_s": 30})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().expect("error").contains("snapshot"),
        "{body}"
    );

    // Fork into 3: each is its own running sandbox.
    let (status, forked) = server.call(
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(json!({"count": 3, "labels": {"fork": "1"}})),
    );
    assert_eq!(status, 200, "{forked}\n{}", server.log());
    let results = forked["results"].as_array().expect("results");
    assert_eq!(results.len(), 3);
    let mut fork_pids = BTreeSet::new();
    for result in results {
        assert_eq!(result["error"], Value::Null, "{result}");
        let child = &result["sandbox"];
        assert_eq!(
            (
                &child["state"],
                &child["labels"]["fork"],
                &child["metadata"]["forked_from"]
            ),
            (&json!("running"), &json!("1"), &json!(id)),
            "{child}"
        );
        let (pid, start) = pid_of(child);
        assert!(vm::is_ours(pid, start));
        fork_pids.insert(pid);
        assert_eq!(vmm_state(child), "Running");
    }
    assert_eq!(fork_pids.len(), 3);
    assert_eq!(server.get(&id)["state"], "running");

    // Reset: same id, a new VMM restored from the given snapshot.
    let before = pid_of(&server.get(&id));
    let (status, reset) = server.call(
        "POST",
        &format!("/sandboxes/{id}/reset"),
        Some(json!({"snapshot": snap_id})),
    );
    assert_eq!(status, 200, "{reset}\n{}", server.log());
    assert_eq!(
        (&reset["id"], &reset["state"]),
        (&json!(id), &json!("running"))
    );
    let after = pid_of(&reset);
    assert_ne!(after, before);
    assert!(!vm::is_ours(before.0, before.1), "the old VMM still runs");
    assert!(cmdline(after.0).contains("--restore"));
    assert_eq!(vmm_state(&reset), "Running");
    // The reaper does not take the reset for an exit.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(server.get(&id)["state"], "running");
    // Without a snapshot it goes back to the one it came from now.
    let (status, again) = server.call("POST", &format!("/sandboxes/{id}/reset"), Some(json!({})));
    assert_eq!(status, 200, "{again}");
    assert_ne!(pid_of(&again), after);
    // A sandbox that came from no snapshot resets by booting afresh.
    let fresh = server.create(json!({"template": "guest", "ttl_s": 300}));
    let fresh_id = fresh["id"].as_str().expect("id");
    let (status, rebooted) = server.call("POST", &format!("/sandboxes/{fresh_id}/reset"), None);
    assert_eq!(status, 200, "{rebooted}");
    wait_for(
        "the rebooted guest's ready line",
        Duration::from_secs(30),
        || console(&rebooted).contains("rollbox-test-guest: ready"),
    );

    // Delete a snapshot: its files go; deleting it again is success.
    let (status, _) = server.call("DELETE", &format!("/snapshots/{snap_id}"), None);
    assert_eq!(status, 204);
    assert!(!snap_dir.exists());
    let (status, _) = server.call("DELETE", &format!("/snapshots/{snap_id}"), None);
    assert_eq!(status, 204);
    let (status, _) = server.call("GET", &format!("/snapshots/{snap_id}"), None);
    assert_eq!(status, 404);

    // The CLI: snapshot, create --snapshot, fork, reset.
    let cli = |args: &[&str]| -> String {
        let output = Command::new(rollbox_binary())
            .args(["sandbox", "--socket"])
            .arg(server.sock())
            .arg("--api-key-file")
            .arg(server.dir.path().join("key"))
            .args(args)
            .output()
            .expect("rollbox sandbox");
        assert!(output.status.success(), "{args:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    let snap = cli(&["snapshot", &id]);
    assert!(snap.starts_with("snap-"), "{snap}");
    assert!(cli(&["snapshots", "--sandbox", &id]).contains(&snap));
    let restored = cli(&["--json", "create", "--snapshot", &snap, "--ttl", "60"]);
    let restored: Value = serde_json::from_str(&restored).expect("json");
    assert_eq!(restored["state"], "running");
    let forks = cli(&["fork", &id, "--count", "2"]);
    assert_eq!(
        forks.lines().filter(|l| l.starts_with("sb-")).count(),
        2,
        "{forks}"
    );
    assert!(cli(&["reset", &id, "--snapshot", &snap]).contains("reset"));
    cli(&["snapshot-rm", &snap]);
}

#[test]
fn snapshots_carry_the_rootfs_and_restores_get_their_own_copy() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    let image = server.dir.path().join("rootfs.img");
    std::fs::write(&image, vec![7u8; 1 << 20]).expect("write image");
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "disk",
            "kernel": test_guest(),
            "rootfs": image,
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let sandbox = server.create(json!({"template": "disk", "ttl_s": 120}));
    let id = sandbox["id"].as_str().expect("id");
    let (status, snap) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{snap}\n{}", server.log());
    let snap_dir = PathBuf::from(snap["dir"].as_str().expect("dir"));
    assert_eq!(
        std::fs::metadata(snap_dir.join("rootfs.img"))
            .expect("rootfs copy")
            .len(),
        1 << 20
    );
    let restored = server.create(json!({"snapshot": snap["id"], "ttl_s": 120}));
    let dir = PathBuf::from(restored["dir"].as_str().expect("dir"));
    assert!(dir.join("rootfs.img").is_file());
    let (pid, _) = pid_of(&restored);
    let line = cmdline(pid);
    // The jailer's command line: the sandbox directory is the jail, seen as / by the VMM.
    let jail = format!(
        "--chroot-base {}",
        dir.parent().expect("sandboxes dir").display()
    );
    assert!(
        line.contains(&jail) && line.contains("--drive-override rootfs=/rootfs.img"),
        "{line}"
    );
    assert_eq!(vmm_state(&restored), "Running");
    // A restart leaves recorded snapshots and removes stray snapshot directories.
    let stray = snap_dir.with_file_name("snap-00000000000000aa");
    std::fs::create_dir(&stray).expect("stray dir");
    let mut server = server;
    server.kill9();
    server.spawn();
    assert!(snap_dir.join("vmstate").is_file());
    assert!(!stray.exists());
    assert_eq!(
        server.get(restored["id"].as_str().expect("id"))["state"],
        "running"
    );
}

fn snapshot_ids(server: &Server, sandbox: &str) -> Vec<String> {
    let (status, list) = server.call("GET", &format!("/snapshots?sandbox={sandbox}"), None);
    assert_eq!(status, 200, "{list}");
    list["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

fn take_snapshot(server: &Server, id: &str, body: Value) -> (String, PathBuf) {
    let (status, snap) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), Some(body));
    assert_eq!(status, 201, "{snap}\n{}", server.log());
    (
        snap["id"].as_str().expect("id").to_string(),
        PathBuf::from(snap["dir"].as_str().expect("dir")),
    )
}

#[test]
fn snapshot_retention_keeps_the_newest_n_and_ttls_but_never_a_live_sandboxs_source() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&["--snapshot-retention", "2"]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    let (_s1, s1_dir) = take_snapshot(&server, &id, json!({}));
    let (s2, _) = take_snapshot(&server, &id, json!({}));
    let (s3, _) = take_snapshot(&server, &id, json!({}));
    assert_eq!(snapshot_ids(&server, &id), [s2.clone(), s3.clone()]);
    assert!(!s1_dir.exists(), "{} outlived retention", s1_dir.display());

    // s2 is the source of a live sandbox: kept past the newest two until that one ends.
    let restored = server.create(json!({"snapshot": s2, "ttl_s": 300}));
    let restored_id = restored["id"].as_str().expect("id").to_string();
    let (s4, _) = take_snapshot(&server, &id, json!({}));
    let (s5, _) = take_snapshot(&server, &id, json!({}));
    assert_eq!(
        snapshot_ids(&server, &id),
        [s2.clone(), s4.clone(), s5.clone()]
    );
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{restored_id}"), None);
    assert_eq!(status, 204);
    wait_for("s2 to go once unused", Duration::from_secs(10), || {
        snapshot_ids(&server, &id) == [s4.clone(), s5.clone()]
    });

    // ttl_s: gone when it runs out, unless a live sandbox came from it.
    let other = server.create(json!({"template": "guest", "ttl_s": 300}));
    let other_id = other["id"].as_str().expect("id").to_string();
    let (short, short_dir) = take_snapshot(&server, &other_id, json!({"ttl_s": 1}));
    let (kept, _) = take_snapshot(&server, &other_id, json!({"ttl_s": 2}));
    let (status, got) = server.call("GET", &format!("/snapshots/{kept}"), None);
    assert_eq!(status, 200);
    assert!(got["expires_at_ms"].as_u64().is_some(), "{got}");
    let user = server.create(json!({"snapshot": kept, "ttl_s": 300}));
    wait_for(
        "the short snapshot to expire",
        Duration::from_secs(10),
        || snapshot_ids(&server, &other_id) == [kept.clone()],
    );
    // The row goes first, then the files (off the reaper's thread).
    wait_for(
        &format!("{short}'s files to go after it expired"),
        Duration::from_secs(10),
        || !short_dir.exists(),
    );
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(snapshot_ids(&server, &other_id), [kept]);
    let user_id = user["id"].as_str().expect("id");
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{user_id}"), None);
    assert_eq!(status, 204);
    wait_for(
        "the kept snapshot to expire",
        Duration::from_secs(10),
        || snapshot_ids(&server, &other_id).is_empty(),
    );
}

#[test]
fn deterministic_sandboxes_boot_restore_reset_and_fork_deterministically() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, plain) = agent_server();
    // A boot says so in its --config file, a restore with the flag.
    let has_flag = |sandbox: &Value| {
        cmdline(pid_of(sandbox).0).contains("--deterministic")
            || boot_config(sandbox)["machine-config"]["deterministic"] == true
    };
    assert!(!has_flag(&server.get(&plain)));
    let (plain_snap, _) = take_snapshot(&server, &plain, json!({}));

    // A deterministic boot: the VMM runs with --deterministic, and the sandbox says so.
    let det = server.create(json!({"template": "guest", "ttl_s": 300, "deterministic": true}));
    assert_eq!(det["deterministic"], true, "{det}");
    assert!(has_flag(&det), "{}", cmdline(pid_of(&det).0));
    let id = det["id"].as_str().expect("id").to_string();
    let (det_snap, _) = take_snapshot(&server, &id, json!({}));
    let (_, snapshot) = server.call("GET", &format!("/snapshots/{det_snap}"), None);
    assert_eq!(snapshot["deterministic"], true, "{snapshot}");

    // Its resets restore deterministically; a snapshot of another sandbox is refused by name.
    let (status, reset) = server.call(
        "POST",
        &format!("/sandboxes/{id}/reset"),
        Some(json!({"snapshot": det_snap})),
    );
    assert_eq!(status, 200, "{reset}\n{}", server.log());
    let line = cmdline(pid_of(&reset).0);
    assert!(
        line.contains("--restore") && line.contains("--deterministic"),
        "{line}"
    );
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/reset"),
        Some(json!({"snapshot": plain_snap})),
    );
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap_or("");
    assert!(
        error.starts_with("deterministic:") && error.contains(&plain_snap),
        "{body}"
    );
    assert_eq!(
        server.get(&id)["state"],
        "running",
        "a refused reset leaves it running"
    );

    // Creates from snapshots: a deterministic one only of a deterministic snapshot.
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"snapshot": plain_snap, "ttl_s": 300, "deterministic": true})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]
        .as_str()
        .unwrap_or("")
        .starts_with("deterministic:"));
    let restored =
        server.create(json!({"snapshot": det_snap, "ttl_s": 300, "deterministic": true}));
    assert!(has_flag(&restored));
    let restored_plain = server.create(json!({"snapshot": det_snap, "ttl_s": 300}));
    assert!(!has_flag(&restored_plain));

    // A new sandbox from a snapshot is a clone of its VM: a new generation, unless it is
    // deterministic. A reset keeps the sandbox's identity.
    let new_generation = |sandbox: &Value| cmdline(pid_of(sandbox).0).contains("--new-generation");
    assert!(new_generation(&restored_plain));
    assert!(!new_generation(&restored) && !new_generation(&reset));
    let (status, plain_reset) = server.call(
        "POST",
        &format!("/sandboxes/{plain}/reset"),
        Some(json!({"snapshot": plain_snap})),
    );
    assert_eq!(status, 200, "{plain_reset}");
    assert!(!new_generation(&plain_reset) && !has_flag(&plain_reset));

    // Forks inherit it.
    let (status, forked) = server.call(
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(json!({"count": 1})),
    );
    assert_eq!(status, 200, "{forked}\n{}", server.log());
    let clone = &forked["results"][0]["sandbox"];
    assert_eq!(clone["deterministic"], true, "{forked}");
    assert!(has_flag(clone));
}

/// A host file and directory a hostile VMM aims its symlinks at, and what they hold.
struct HostTargets {
    secret: PathBuf,
    dir: PathBuf,
}

impl HostTargets {
    fn new(under: &std::path::Path) -> HostTargets {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = under.join("host-etc");
        std::fs::create_dir(&dir).expect("host dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let secret = under.join("host-shadow");
        std::fs::write(&secret, "root:host-secret\n").expect("secret");
        std::fs::write(dir.join("passwd"), "root:x:0:0\n").expect("passwd");
        HostTargets { secret, dir }
    }

    /// (path, content, uid, gid, mode) of each: a refusal leaves them all as they were.
    fn state(&self) -> Vec<(PathBuf, Vec<u8>, u32, u32, u32)> {
        use std::os::unix::fs::MetadataExt as _;
        [
            self.secret.clone(),
            self.dir.clone(),
            self.dir.join("passwd"),
        ]
        .into_iter()
        .map(|path| {
            let meta = std::fs::symlink_metadata(&path).expect("host target");
            let data = if meta.is_file() {
                std::fs::read(&path).expect("read")
            } else {
                Vec::new()
            };
            (path, data, meta.uid(), meta.gid(), meta.mode())
        })
        .collect()
    }
}

/// Replaces `dir/name` with a symlink to `target`, as a VMM that owns `dir` can; returns the
/// real file, moved aside, to [`unplant`] later.
fn plant(dir: &std::path::Path, name: &str, target: &std::path::Path) -> Option<PathBuf> {
    let real = dir.join(format!("{name}.real"));
    let moved = std::fs::rename(dir.join(name), &real).is_ok();
    std::os::unix::fs::symlink(target, dir.join(name)).expect("plant symlink");
    moved.then_some(real)
}

fn unplant(dir: &std::path::Path, name: &str, real: Option<PathBuf>) {
    std::fs::remove_file(dir.join(name)).expect("remove symlink");
    if let Some(real) = real {
        std::fs::rename(real, dir.join(name)).expect("put back");
    }
}

/// The error text of a refused call, which names the file.
fn refused(status: u16, body: &Value, name: &str) {
    let error = body["error"].as_str().unwrap_or_default();
    assert!(
        status >= 400 && error.contains(&format!("refused {name}: a symlink")),
        "{status} {body}"
    );
}

#[test]
fn symlinks_a_jailed_vmm_plants_are_refused_and_nothing_outside_is_touched() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    let host = HostTargets::new(server.dir.path());
    let before = host.state();
    let image = server.dir.path().join("rootfs.img");
    std::fs::write(&image, vec![7u8; 1 << 20]).expect("write image");
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "disk",
            "kernel": test_guest(),
            "rootfs": image,
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let sandbox = server.create(json!({"template": "disk", "ttl_s": 120}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    let snapshots = |server: &Server| snapshot_ids(server, &id).len();

    // rootfs.img -> a host file: snapshot and fork refuse to copy it.
    let real = plant(&dir, "rootfs.img", &host.secret);
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    refused(status, &body, "rootfs.img");
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(json!({"count": 1})),
    );
    refused(status, &body, "rootfs.img");
    assert_eq!(snapshots(&server), 0);
    unplant(&dir, "rootfs.img", real);
    assert_eq!(server.get(&id)["state"], "running");

    // snapshot-new -> a host directory: replaced by a directory of the jail's, never chowned
    // or emptied through the link; the snapshot works.
    plant(&dir, "snapshot-new", &host.dir);
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{body}\n{}", server.log_tail());
    assert!(!dir.join("snapshot-new").exists());
    assert_eq!(host.state(), before);

    // api.sock -> a host service's socket: a pause refuses to connect there.
    let service = host.dir.join("service.sock");
    let listener = std::os::unix::net::UnixListener::bind(&service).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let real = plant(&dir, "api.sock", &service);
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    refused(status, &body, "api.sock");
    assert!(
        listener.accept().is_err(),
        "the daemon connected to the host socket"
    );
    unplant(&dir, "api.sock", real);
    drop(listener);
    std::fs::remove_file(&service).expect("rm service socket");

    // A symlink out of the directory when the sandbox is deleted: the target stays.
    std::os::unix::fs::symlink(&host.dir, dir.join("escape")).expect("symlink");
    let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert!(status < 300, "{status} {body}");
    assert!(!dir.exists());
    assert_eq!(host.state(), before);

    // vmm.log -> a host file, then the VMM ends: its end reason is the refusal, never the
    // file's text.
    let sandbox = server.create(json!({"template": "disk", "ttl_s": 120}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    plant(&dir, "vmm.log", &host.secret);
    let (pid, _) = pid_of(&sandbox);
    // SAFETY: kill(2) on the sandbox's own jailer; its jail ends with it.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let mut last = Value::Null;
    wait_for(&format!("{id} to end"), Duration::from_secs(20), || {
        last = server.get(&id);
        last["state"] == "exited"
    });
    let reason = last["end_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("refused vmm.log: a symlink"), "{last}");
    assert!(!reason.contains("host-secret"), "{last}");
    assert_eq!(host.state(), before);
}
