//! `rollbox serve` end to end, what snapshots leave behind: a daemon killed mid-snapshot (the
//! VM left paused, half-written files) and the snapshots forks take (gone with their last
//! clone, or at `--fork-snapshot-ttl`). The real `rollbox` and jailed `rollbox-vmm` with the
//! tier-2 test guest (needs /dev/kvm); `rollbox_tests::daemon` starts the daemon.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rollbox::daemon::client::Endpoint;
use rollbox_tests::daemon::{console, exec, pid_of, wait_for, HostAgent, Server, KEY};
use rollbox_tests::kvm_available;
use serde_json::{json, Value};

/// The VMM's own view of its VM (`GET /` on its API socket): "Running" or "Paused".
fn vmm_state(sandbox: &Value) -> String {
    let response = Endpoint::Unix(api_sock(sandbox))
        .request("GET", "/", &[], None, Duration::from_secs(10))
        .expect("GET / on the VMM");
    let info: Value = serde_json::from_slice(&response.body).expect("json");
    info["state"].as_str().unwrap_or("").to_string()
}

/// `PATCH /vm` straight on the VMM's API socket, behind the daemon's back.
fn set_vmm_state(sandbox: &Value, state: &str) {
    let body = json!({ "state": state }).to_string();
    let response = Endpoint::Unix(api_sock(sandbox))
        .request(
            "PATCH",
            "/vm",
            &[("Content-Type", "application/json")],
            Some(body.as_bytes()),
            Duration::from_secs(10),
        )
        .expect("PATCH /vm on the VMM");
    assert_eq!(response.status, 204, "PATCH /vm {state}");
}

fn dir_of(value: &Value) -> PathBuf {
    PathBuf::from(value["dir"].as_str().expect("dir"))
}

fn api_sock(sandbox: &Value) -> PathBuf {
    dir_of(sandbox).join("api.sock")
}

fn id_of(value: &Value) -> String {
    value["id"].as_str().expect("id").to_string()
}

/// The snapshots' ids (of one sandbox when given).
fn snapshot_ids(server: &Server, sandbox: Option<&str>) -> Vec<String> {
    let path = match sandbox {
        Some(id) => format!("/snapshots?sandbox={id}"),
        None => "/snapshots".to_string(),
    };
    let (status, list) = server.call("GET", &path, None);
    assert_eq!(status, 200, "{list}");
    list["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .map(id_of)
        .collect()
}

/// The names in a directory.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    names
}

/// A sandbox of template "guest" whose test guest has printed its ready line.
fn ready_sandbox(server: &Server) -> Value {
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    wait_for(
        "the test guest's ready line",
        Duration::from_secs(30),
        || console(&sandbox).contains("rollbox-test-guest: ready"),
    );
    sandbox
}

#[test]
fn a_daemon_killed_mid_snapshot_restarts_with_the_sandbox_running_and_no_half_snapshot() {
    if !kvm_available() {
        return;
    }
    let agent = HostAgent::start();
    let scratch = tempfile::tempdir().expect("tempdir");
    let hold = scratch.path().join("hold");
    let mut server = Server::start(&[
        "--test-agent-socket",
        &agent.sock.display().to_string(),
        "--test-hold-snapshot",
        &hold.display().to_string(),
    ]);
    server.add_guest_template("guest");
    let sandbox = ready_sandbox(&server);
    let id = id_of(&sandbox);
    let snapshots_dir = server.sandboxes_dir().with_file_name("snapshots");

    // A paused sandbox whose VMM runs: a daemon killed between a resume's call to the VMM and
    // its write to the store. The store's word wins at the restart.
    let paused = ready_sandbox(&server);
    let paused_id = id_of(&paused);
    let (status, body) = server.call("POST", &format!("/sandboxes/{paused_id}/pause"), None);
    assert_eq!(status, 200, "{body}");
    set_vmm_state(&paused, "Resumed");

    // A snapshot that stops at the hook: the VM paused, the files written, nothing recorded.
    let sock = server.sock();
    let path = format!("/sandboxes/{id}/snapshots");
    let request = std::thread::spawn(move || {
        let auth = format!("Bearer {KEY}");
        // The daemon dies under it: no answer is the expected outcome.
        let _ = Endpoint::Unix(sock).request(
            "POST",
            &path,
            &[("Authorization", &auth)],
            None,
            Duration::from_secs(60),
        );
    });
    wait_for(
        "the snapshot to reach the hold",
        Duration::from_secs(30),
        || hold.exists(),
    );
    let held = std::fs::read_to_string(&hold).expect("held snapshot id");
    assert!(held.starts_with("snap-"), "{held}");
    assert_eq!(
        vmm_state(&sandbox),
        "Paused",
        "the hold is not mid-snapshot"
    );
    assert_eq!(server.get(&id)["state"], "running");
    assert!(snapshots_dir.join(&held).join("memory").is_file());
    // What a daemon killed inside the VMM's snapshot/create call leaves: the jailed VMM's
    // staging directory (the hook runs after it is emptied, so the test puts it back).
    let staging = dir_of(&sandbox).join("snapshot-new");
    std::fs::create_dir(&staging).expect("staging dir");
    std::fs::write(staging.join("memory"), vec![1u8; 4096]).expect("staging memory");

    server.kill9();
    request.join().expect("request thread");
    std::fs::remove_file(&hold).expect("remove the hold");
    server.spawn();

    // The restart resumed the VM the store calls running, and kept the paused one paused.
    assert_eq!(server.get(&id)["state"], "running");
    assert_eq!(vmm_state(&sandbox), "Running", "{}", server.log_tail());
    assert_eq!(server.get(&paused_id)["state"], "paused");
    assert_eq!(vmm_state(&paused), "Paused", "{}", server.log_tail());
    assert_eq!(
        pid_of(&server.get(&id)),
        pid_of(&sandbox),
        "not the same VMM"
    );
    let result = exec(&server, &id, json!({"cmd": ["echo", "alive"]}));
    assert_eq!(result["stdout"], "alive\n", "{result}");
    // No half snapshot: not listed, its directory and the staging directory gone.
    assert!(snapshot_ids(&server, None).is_empty());
    let (status, _) = server.call("GET", &format!("/snapshots/{held}"), None);
    assert_eq!(status, 404);
    assert!(
        names(&snapshots_dir).is_empty(),
        "{:?}",
        names(&snapshots_dir)
    );
    assert!(!staging.exists(), "{}", staging.display());
    assert!(
        server.log_tail().contains("resumed its VMM"),
        "{}",
        server.log_tail()
    );
}

#[test]
fn resume_and_pause_make_a_vmm_agree_with_the_store() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let sandbox = ready_sandbox(&server);
    let id = id_of(&sandbox);
    // Running in the store, paused in the VMM (as a daemon killed mid-snapshot left it).
    set_vmm_state(&sandbox, "Paused");
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
    assert_eq!((status, body["state"].as_str()), (200, Some("running")));
    assert_eq!(vmm_state(&sandbox), "Running");
    // Paused in the store, running in the VMM.
    let (status, _) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(status, 200);
    set_vmm_state(&sandbox, "Resumed");
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!((status, body["state"].as_str()), (200, Some("paused")));
    assert_eq!(vmm_state(&sandbox), "Paused");
}

/// Forks `parent` into `count`: the clones and the fork's snapshot.
fn fork(server: &Server, parent: &str, count: u32) -> (Vec<Value>, Value) {
    let before = snapshot_ids(server, Some(parent));
    let (status, forked) = server.call(
        "POST",
        &format!("/sandboxes/{parent}/fork"),
        Some(json!({ "count": count })),
    );
    assert_eq!(status, 200, "{forked}\n{}", server.log_tail());
    let clones: Vec<Value> = forked["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| {
            assert_eq!(r["error"], Value::Null, "{r}");
            r["sandbox"].clone()
        })
        .collect();
    assert_eq!(clones.len(), count as usize);
    let new: Vec<String> = snapshot_ids(server, Some(parent))
        .into_iter()
        .filter(|s| !before.contains(s))
        .collect();
    assert_eq!(new.len(), 1, "{new:?}");
    let (status, snap) = server.call("GET", &format!("/snapshots/{}", new[0]), None);
    assert_eq!(status, 200, "{snap}");
    (clones, snap)
}

fn delete(server: &Server, id: &str) {
    let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 204, "{body}");
}

#[test]
fn a_fork_snapshot_goes_with_its_last_clone() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let parent = ready_sandbox(&server);
    let parent_id = id_of(&parent);
    // A user's snapshot of the same sandbox is kept throughout.
    let (status, user) = server.call("POST", &format!("/sandboxes/{parent_id}/snapshots"), None);
    assert_eq!(status, 201, "{user}");
    let user_id = id_of(&user);

    let (clones, snap) = fork(&server, &parent_id, 3);
    let snap_id = id_of(&snap);
    let snap_dir = dir_of(&snap);
    assert_eq!(snap["expires_at_ms"], Value::Null, "{snap}");
    delete(&server, &id_of(&clones[0]));
    delete(&server, &id_of(&clones[1]));
    // One clone still restores from it: kept, and a reset of that clone goes back to it.
    std::thread::sleep(Duration::from_millis(600));
    assert!(snapshot_ids(&server, Some(&parent_id)).contains(&snap_id));
    let last = id_of(&clones[2]);
    let (status, reset) = server.call("POST", &format!("/sandboxes/{last}/reset"), None);
    assert_eq!(status, 200, "{reset}\n{}", server.log_tail());
    delete(&server, &last);
    wait_for(
        "the fork snapshot to go with its last clone",
        Duration::from_secs(10),
        || snapshot_ids(&server, Some(&parent_id)) == [user_id.clone()],
    );
    wait_for(
        "the fork snapshot's files to go",
        Duration::from_secs(10),
        || !snap_dir.exists(),
    );
    let (status, _) = server.call("GET", &format!("/snapshots/{snap_id}"), None);
    assert_eq!(status, 404);
    assert!(dir_of(&user).join("memory").is_file());

    // A fork whose clones all ended at once leaves nothing either.
    let (clones, snap) = fork(&server, &parent_id, 2);
    for clone in &clones {
        delete(&server, &id_of(clone));
    }
    wait_for(
        "the second fork's snapshot to go",
        Duration::from_secs(10),
        || !dir_of(&snap).exists() && snapshot_ids(&server, None) == [user_id.clone()],
    );
}

#[test]
fn a_fork_snapshot_goes_at_the_fork_snapshot_ttl_while_its_clones_run() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&["--fork-snapshot-ttl", "3"]);
    server.add_guest_template("guest");
    let parent = ready_sandbox(&server);
    let parent_id = id_of(&parent);
    let (clones, snap) = fork(&server, &parent_id, 2);
    let snap_id = id_of(&snap);
    let created = snap["created_at_ms"].as_u64().expect("created_at_ms");
    assert_eq!(
        snap["expires_at_ms"].as_u64(),
        Some(created + 3000),
        "{snap}"
    );
    wait_for(
        "the fork snapshot to go at its TTL",
        Duration::from_secs(10),
        || !snapshot_ids(&server, None).contains(&snap_id) && !dir_of(&snap).exists(),
    );
    // The clones run on: their VMMs keep the memory file they map open (the jail's view of
    // the snapshot now names a deleted file), and their rootfs is their own.
    for clone in &clones {
        let id = id_of(clone);
        assert_eq!(server.get(&id)["state"], "running");
        assert_eq!(vmm_state(clone), "Running");
    }
    // A clone's memory is whole: its own snapshot restores and runs.
    let first = id_of(&clones[0]);
    let (status, again) = server.call("POST", &format!("/sandboxes/{first}/snapshots"), None);
    assert_eq!(status, 201, "{again}\n{}", server.log_tail());
    assert_eq!(again["parent"], snap_id.as_str(), "{again}");
    let restored = server.create(json!({"snapshot": id_of(&again), "ttl_s": 60}));
    assert_eq!(vmm_state(&restored), "Running");
    // Only a reset back to the fork snapshot needs it: refused, naming it; the clone runs on.
    let second = id_of(&clones[1]);
    let (status, body) = server.call("POST", &format!("/sandboxes/{second}/reset"), None);
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap_or("").contains(&snap_id),
        "{body}"
    );
    assert_eq!(server.get(&second)["state"], "running");
    assert_eq!(vmm_state(&clones[1]), "Running");
}
