//! `rollbox serve --warm-pool MIB=N` (issue 29): jailed VMM shells started ahead, each under
//! the id of the sandbox it becomes; a create restoring a snapshot of that size takes one,
//! the pool refills, a dead shell is replaced, creates a shell cannot serve start cold, the
//! pool holds only the room the node's limits leave, 1,000 cycles leave only the pool, and
//! nothing of the pool outlives the daemon; without the flag, each template with a boot
//! snapshot gets shells. Tier 2: needs /dev/kvm.

use std::collections::BTreeSet;
use std::time::Duration;

use rollbox::daemon::client::Endpoint;
use rollbox_tests::daemon::{exec, image_server, pid_of, wait_for, HostAgent, Server};
use rollbox_tests::{images, kvm_available, test_guest, TEST_GUEST_CMDLINE};
use serde_json::{json, Value};

/// The VMM's own view of its VM ("Running", "Paused", "Not started").
fn vmm_state(sandbox: &Value) -> String {
    let dir = std::path::PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    let response = Endpoint::Unix(dir.join("api.sock"))
        .request("GET", "/", &[], None, Duration::from_secs(5))
        .expect("GET / on the VMM");
    let info: Value = serde_json::from_slice(&response.body).expect("json");
    info["state"].as_str().unwrap_or("").to_string()
}

/// GET /node's warm pool: (target, ready) of the 32 MiB shells.
fn pool(server: &Server) -> (u64, u64) {
    let (status, node) = server.call("GET", "/node", None);
    assert_eq!(status, 200, "{node}");
    let shape = &node["warm_pool"][0];
    assert_eq!(shape["memory_mib"], 32, "{node}");
    (
        shape["target"].as_u64().expect("target"),
        shape["ready"].as_u64().expect("ready"),
    )
}

fn wait_full(server: &Server) {
    wait_for("a full warm pool", Duration::from_secs(30), || {
        pool(server) == (2, 2)
    });
}

/// The ids of the VMMs running now (sandboxes and shells alike).
fn vmm_ids(server: &Server) -> BTreeSet<String> {
    server.vmms().into_iter().map(|found| found.id).collect()
}

#[test]
fn restores_take_warm_shells_the_pool_refills_and_nothing_outlives_the_daemon() {
    if !kvm_available() {
        return;
    }
    let mut server = Server::start(&["--warm-pool", "32=2"]);
    let snapshot = server.guest_snapshot();
    wait_full(&server);
    let shells = vmm_ids(&server);
    assert_eq!(shells.len(), 2, "two shells and nothing else: {shells:?}");
    assert_eq!(server.dirs(), shells);

    // A restore takes a shell: the sandbox has the shell's id and its VMM.
    let restored = server.create(json!({"snapshot": snapshot, "ttl_s": 300}));
    let id = restored["id"].as_str().expect("id").to_string();
    assert!(shells.contains(&id), "{id} is not one of {shells:?}");
    assert_eq!(vmm_state(&restored), "Running");
    let (pid, _) = pid_of(&restored);
    assert!(
        server
            .vmms()
            .iter()
            .any(|found| found.id == id && found.pid == pid),
        "the sandbox's VMM is the shell's"
    );
    // It is a sandbox like any: a snapshot of it, a reset, a pause and a resume.
    let (status, snap) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{snap}");
    let (status, reset) = server.call("POST", &format!("/sandboxes/{id}/reset"), None);
    assert_eq!(status, 200, "{reset}\n{}", server.log_tail());
    let (status, _) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(status, 200);
    let (status, _) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
    assert_eq!(status, 200);
    assert_eq!(vmm_state(&server.get(&id)), "Running");

    // The pool starts another; /metrics shows it.
    wait_full(&server);
    let response = server.raw("GET", "/metrics", Some(rollbox_tests::daemon::KEY), None);
    let text = String::from_utf8_lossy(&response.body);
    assert!(
        text.lines()
            .any(|l| l.starts_with("rollbox_warm_shells_ready{")
                && l.contains("memory_mib=\"32\"")
                && l.ends_with(" 2")),
        "{text}"
    );

    // A create a shell cannot serve (a CPU limit is set as its VMM starts) starts cold.
    let before = vmm_ids(&server);
    let cold = server.create(json!({"snapshot": snapshot, "ttl_s": 300, "cpu_limit": 0.5}));
    let cold_id = cold["id"].as_str().expect("id");
    assert!(
        !before.contains(cold_id),
        "a CPU-limited create took a shell"
    );
    assert_eq!(pool(&server), (2, 2));

    // A shell whose VMM dies is replaced.
    let shells: Vec<_> = server
        .vmms()
        .into_iter()
        .filter(|found| {
            server
                .call("GET", &format!("/sandboxes/{}", found.id), None)
                .0
                == 404
        })
        .collect();
    assert_eq!(shells.len(), 2, "{shells:?}");
    // SAFETY: kill(2) of a VMM this test's daemon started, found by pid and start time.
    unsafe { libc::kill(shells[0].pid as i32, libc::SIGKILL) };
    wait_for("the dead shell replaced", Duration::from_secs(30), || {
        server.log().contains("died; replacing it")
            && pool(&server) == (2, 2)
            && !server.dirs().contains(&shells[0].id)
    });

    // Deleting the sandboxes leaves only the pool; stopping the daemon leaves nothing.
    for sandbox in server.list("running") {
        let id = sandbox["id"].as_str().expect("id");
        let (status, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204);
    }
    assert_eq!(vmm_ids(&server).len(), 2);
    let pid = server.pid();
    // SAFETY: kill(2) of the daemon this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let mut child = server.child.take().expect("daemon");
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status}\n{}", server.log_tail());
    assert!(vmm_ids(&server).is_empty(), "{:?}", server.vmms());
    assert!(server.dirs().is_empty(), "{:?}", server.dirs());

    // A daemon killed with shells ready: the next start sweeps them and makes its own.
    server.spawn();
    wait_full(&server);
    let first = vmm_ids(&server);
    server.kill9();
    server.spawn();
    wait_full(&server);
    let second = vmm_ids(&server);
    assert_eq!(second.len(), 2, "{second:?}");
    assert!(first.is_disjoint(&second), "{first:?} {second:?}");
    assert_eq!(server.dirs(), second);
}

/// Waits until the pool has `ready` shells (its target stays 3).
fn wait_ready(server: &Server, ready: u64) {
    wait_for(
        &format!("{ready} ready shells"),
        Duration::from_secs(30),
        || pool(server) == (3, ready),
    );
}

/// The pool's shells count against `--max-sandboxes` and `--memory-budget-mib` beside the
/// live sandboxes: it fills only the room the sandboxes leave, ends shells when sandboxes take
/// their place, and never refuses a create.
#[test]
fn the_pool_holds_only_the_room_the_node_limits_leave() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&["--warm-pool", "32=3", "--max-sandboxes", "4"]);
    let snapshot = server.guest_snapshot();
    wait_ready(&server, 3);
    let mut made = Vec::new();
    // The second create starts cold (a CPU limit): the shells beside it no longer fit, and
    // one ends.
    for (sandboxes, ready) in [(1, 3), (2, 2), (3, 1), (4, 0)] {
        let body = if sandboxes == 2 {
            json!({"snapshot": snapshot, "ttl_s": 300, "cpu_limit": 0.5})
        } else {
            json!({"snapshot": snapshot, "ttl_s": 300})
        };
        let sandbox = server.create(body);
        made.push(sandbox["id"].as_str().expect("id").to_string());
        assert_eq!(made.len(), sandboxes);
        wait_ready(&server, ready);
        // Once the pool has settled, no more VMMs than the limit, sandboxes and shells
        // together (a shell it ended may take a moment to die after it left the pool).
        wait_for("at most 4 VMMs", Duration::from_secs(30), || {
            vmm_ids(&server).len() <= 4
        });
    }
    // The node is full: the next create is refused by the limit, not by the pool.
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"snapshot": snapshot, "ttl_s": 300})),
    );
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["limit"], "max_sandboxes", "{body}");
    // Room again: the pool fills it back to its target.
    for id in made.drain(..3) {
        let (status, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204);
    }
    wait_ready(&server, 3);
    assert_eq!(
        server.log().matches("would pass --max-sandboxes").count(),
        1,
        "{}",
        server.log_tail()
    );

    // A memory budget of 64 MiB holds two 32 MiB shells, whatever the target.
    let budget = Server::start(&["--warm-pool", "32=3", "--memory-budget-mib", "64"]);
    wait_ready(&budget, 2);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(pool(&budget), (3, 2));
}

/// 1,000 creates and deletes from warm shells, four at a time, leave exactly the pool: no
/// sandbox's VMM or directory behind, and no shell beyond the pool's.
#[test]
fn a_thousand_creates_and_deletes_leave_only_the_pool() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&["--warm-pool", "32=2"]);
    let snapshot = server.guest_snapshot();
    wait_full(&server);
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (server, snapshot) = (&server, snapshot.clone());
            move || {
                for _ in 0..250 {
                    let sandbox = server.create(json!({"snapshot": snapshot, "ttl_s": 300}));
                    let id = sandbox["id"].as_str().expect("id");
                    let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
                    assert_eq!(status, 204, "{body}");
                }
            }
        })
        .collect();
    std::thread::scope(|scope| {
        for work in workers {
            scope.spawn(work);
        }
    });
    assert!(server.list("running").is_empty());
    wait_full(&server);
    // The background removal of each delete's cgroups has finished once the count settles.
    wait_for(
        "only the pool's VMMs and directories",
        Duration::from_secs(60),
        || {
            let shells = vmm_ids(&server);
            shells.len() == 2 && server.dirs() == shells
        },
    );
}

/// GET /node's warm pool as (template, target, ready), sorted.
fn template_shapes(server: &Server) -> Vec<(String, u64, u64)> {
    let (_, node) = server.call("GET", "/node", None);
    let mut shapes: Vec<(String, u64, u64)> = node["warm_pool"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|s| {
            (
                s["template"].as_str().unwrap_or("").to_string(),
                s["target"].as_u64().unwrap_or(0),
                s["ready"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    shapes.sort();
    shapes
}

/// `--warm-pool templates=1`: a shell per template with a boot snapshot, made for its disk and
/// shared base (bound into the shell's jail as it starts); creates of each template take
/// theirs, and a template deleted takes its shell with it.
#[test]
fn each_template_with_a_boot_snapshot_gets_shells_made_for_its_disk_and_base() {
    let test = "each_template_with_a_boot_snapshot_gets_shells_made_for_its_disk_and_base";
    if !kvm_available() || !images::root_or_skip(test) {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let archives = images::images_on_one_base(work.path());
    let (_agent, server) = image_server(work.path(), &["--warm-pool", "templates=1"]);
    // The first is one whole disk; the second stacks on a base of the layers they share.
    for (name, archive) in [("whole", &archives[0]), ("layered", &archives[1])] {
        let template = server.add_image_template(name, archive, true);
        assert_eq!(
            template["base_rootfs"].is_string(),
            name == "layered",
            "{template}"
        );
    }
    let shapes = || template_shapes(&server);
    let full = vec![("layered".to_string(), 1, 1), ("whole".to_string(), 1, 1)];
    wait_for("a shell per template", Duration::from_secs(30), || {
        shapes() == full
    });
    for name in ["whole", "layered"] {
        let before = vmm_ids(&server);
        let sandbox = server.create(json!({"template": name, "ttl_s": 300}));
        let id = sandbox["id"].as_str().expect("id");
        assert!(
            before.contains(id),
            "{name}: {id} took no shell of {before:?}"
        );
        assert_eq!(vmm_state(&sandbox), "Running");
        let out = exec(&server, id, json!({"cmd": ["sh", "-c", "echo ok"]}));
        assert_eq!(out["stdout"], "ok\n", "{out}");
        let dir = std::path::PathBuf::from(sandbox["dir"].as_str().expect("dir"));
        assert!(dir.join("rootfs.img").is_file(), "{name}: no disk copy");
    }
    wait_for("the pool refilled", Duration::from_secs(30), || {
        shapes() == full
    });

    // A template deleted: its shells go.
    let (status, body) = server.call("DELETE", "/templates/whole", None);
    assert!((200..300).contains(&status), "{body}");
    wait_for(
        "the deleted template's shell ended",
        Duration::from_secs(30),
        || {
            shapes() == vec![("layered".to_string(), 1, 1)]
                && server.log().contains("is for a template gone or changed")
        },
    );
}

/// Without `--warm-pool`, a daemon keeps two shells for each template with a boot snapshot,
/// and its creates take them; `--no-warm-pool` keeps none, and so does `templates=0`.
#[test]
fn templates_with_boot_snapshots_get_shells_by_default() {
    if !kvm_available() {
        return;
    }
    let agent = HostAgent::start();
    let socket = agent.sock.display().to_string();
    let boot_template = |server: &Server| {
        let (status, template) = server.call(
            "POST",
            "/templates",
            Some(json!({
                "name": "rl-env",
                "kernel": test_guest(),
                "cmdline": TEST_GUEST_CMDLINE,
                "memory_mib": 32,
                "boot_snapshot": true,
            })),
        );
        assert_eq!(status, 201, "{template}\n{}", server.log_tail());
    };

    let server = Server::start(&["--test-agent-socket", &socket]);
    boot_template(&server);
    let full = vec![("rl-env".to_string(), 2, 2)];
    wait_for(
        "two shells for the template",
        Duration::from_secs(30),
        || template_shapes(&server) == full,
    );
    let shells = vmm_ids(&server);
    assert_eq!(shells.len(), 2, "two shells and nothing else: {shells:?}");
    let sandbox = server.create(json!({"template": "rl-env", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id");
    assert!(shells.contains(id), "{id} took no shell of {shells:?}");
    let out = exec(&server, id, json!({"cmd": ["sh", "-c", "echo ok"]}));
    assert_eq!(out["stdout"], "ok\n", "{out}");
    wait_for("the pool refilled", Duration::from_secs(30), || {
        template_shapes(&server) == full
    });
    drop(server);

    for off in [&["--no-warm-pool"][..], &["--warm-pool", "templates=0"]] {
        let server = Server::start(&[&["--test-agent-socket", socket.as_str()][..], off].concat());
        boot_template(&server);
        // A pass of the refill (every second) would have started a shell by now.
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(template_shapes(&server), Vec::new(), "{off:?}");
        assert!(
            vmm_ids(&server).is_empty(),
            "{off:?}: {:?}",
            vmm_ids(&server)
        );
        let sandbox = server.create(json!({"template": "rl-env", "ttl_s": 300}));
        assert_eq!(vmm_ids(&server).len(), 1, "{off:?}: {sandbox}");
    }
    let refused = std::process::Command::new(rollbox_tests::rollbox_binary())
        .args(["serve", "--no-warm-pool", "--warm-pool", "32=1"])
        .output()
        .expect("run rollbox serve");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--no-warm-pool"), "{stderr}");
}
