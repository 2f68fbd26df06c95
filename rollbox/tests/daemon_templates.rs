//! `rollbox serve` end to end, templates: one built from a crafted image with a boot snapshot,
//! and start and ready commands run after boot.
//! The real `rollbox` and `rollbox-vmm` binaries with the tier-2 test guest as the
//! template's kernel (tier 2: needs /dev/kvm); `rollbox_tests::daemon` starts the daemon.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rollbox_tests::daemon::{
    boot_config, cli, cmdline, exec, image_server, pid_of, wait_for, HostAgent, Server,
};
use rollbox_tests::{images, kvm_available, test_guest, TEST_GUEST_CMDLINE};
use serde_json::{json, Value};

#[test]
fn templates_built_from_an_image_with_a_boot_snapshot() {
    if !kvm_available()
        || !images::root_or_skip("templates_built_from_an_image_with_a_boot_snapshot")
    {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let archive = work.path().join("image.tar");
    images::standard_image().write_docker_archive(&archive, "rollbox-test/crafted:latest");
    let (_agent, server) = image_server(work.path(), &[]);
    let templates_dir = std::fs::canonicalize(server.state())
        .expect("state dir")
        .join("templates");

    // A bad image leaves nothing: no template, no directory.
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "broken",
            "kernel": test_guest(),
            "image": {"docker_archive": "/nonexistent/image.tar"},
        })),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap_or("").contains("image"),
        "{body}"
    );
    assert_eq!(server.call("GET", "/templates/broken", None).0, 404);
    assert!(!templates_dir.join("broken").exists());

    // Built from a `docker save` archive, booted once and snapshotted.
    let (status, template) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "img",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "image": {"docker_archive": archive, "reference": "rollbox-test/crafted:latest"},
            "boot_snapshot": true,
        })),
    );
    assert_eq!(status, 201, "{template}\n{}", server.log());
    let rootfs = PathBuf::from(template["rootfs"].as_str().expect("rootfs"));
    assert_eq!(rootfs, templates_dir.join("img/rootfs.ext4"));
    assert!(rootfs.is_file());
    let image = template["image"].as_str().expect("image");
    assert!(
        image.starts_with("rollbox-test/crafted:latest@sha256:"),
        "{image}"
    );
    let boot = template["boot_snapshot"]
        .as_str()
        .expect("boot_snapshot")
        .to_string();
    // The sandbox booted for it is gone.
    wait_for(
        "the boot sandbox's VMM to end",
        Duration::from_secs(20),
        || server.vmms().is_empty(),
    );
    let (_, booted) = server.call(
        "GET",
        &format!("/sandboxes?label={}%3Dimg", "rollbox.boot-snapshot-of"),
        None,
    );
    for s in booted["sandboxes"].as_array().expect("sandboxes") {
        assert_eq!(s["state"], "deleted", "{s}");
    }

    // Creates of the template's shape restore the boot snapshot; another shape boots.
    let restored = server.create(json!({"template": "img", "ttl_s": 300}));
    let (pid, _) = pid_of(&restored);
    assert!(cmdline(pid).contains("--restore"), "{}", cmdline(pid));
    let id = restored["id"].as_str().expect("id");
    let out = exec(&server, id, json!({"cmd": ["sh", "-c", "echo ok"]}));
    assert_eq!(out["stdout"], "ok\n", "{out}");
    let booted = server.create(json!({"template": "img", "ttl_s": 300, "memory_mib": 48}));
    let (pid, _) = pid_of(&booted);
    assert!(!cmdline(pid).contains("--restore"), "{}", cmdline(pid));
    // A boot: the rootfs copy is its --config file's root drive.
    let drive = &boot_config(&booted)["drives"][0];
    assert!(
        drive["drive_id"] == "rootfs" && drive["is_root_device"] == true,
        "{}",
        cmdline(pid)
    );

    // Reset goes back to the boot snapshot.
    let (status, reset) = server.call("POST", &format!("/sandboxes/{id}/reset"), Some(json!({})));
    assert_eq!(status, 200, "{reset}");
    let (pid, _) = pid_of(&reset);
    assert!(cmdline(pid).contains("--restore"), "{}", cmdline(pid));

    // The boot snapshot goes with its template only.
    let (status, body) = server.call("DELETE", &format!("/snapshots/{boot}"), None);
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap_or("").contains("img"),
        "{body}"
    );
    let (status, body) = server.call("DELETE", "/templates/img", None);
    assert_eq!(status, 204, "{body}");
    assert_eq!(
        server.call("GET", &format!("/snapshots/{boot}"), None).0,
        404
    );
    assert!(!templates_dir.join("img").exists());
    // Its sandboxes keep running on their own copies.
    assert_eq!(server.get(id)["state"], "running");
}

#[test]
fn templates_run_their_start_command_after_boot_and_wait_until_ready() {
    if !kvm_available() {
        return;
    }
    // The host agent runs the commands on this host: they mark files in a scratch directory.
    let agent = HostAgent::start();
    let agent_sock = agent.sock.display().to_string();
    let server = Server::start(&["--test-agent-socket", &agent_sock]);
    let work = tempfile::tempdir().expect("tempdir");
    let dir = work.path().display().to_string();
    let started = work.path().join("started");
    let want = work.path().join("want");
    let lines = || {
        std::fs::read_to_string(&started)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // The start command marks itself a second late; the ready command waits for the mark the
    // test expects, so a template add or create that returns early sees too few lines.
    let start_cmd = format!("sleep 1; echo \"up $GREETING\" >> {dir}/started");
    let ready_cmd = format!("[ \"$(wc -l < {dir}/started)\" -ge \"$(cat {dir}/want)\" ]");
    std::fs::write(&want, "1").expect("want");
    let (status, template) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "svc",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "boot_snapshot": true,
            "start_cmd": start_cmd,
            "ready_cmd": ready_cmd,
            "ready_timeout_s": 60,
        })),
    );
    assert_eq!(status, 201, "{template}\n{}", server.log());
    assert_eq!(template["start_cmd"], start_cmd.as_str());
    assert_eq!(template["ready_timeout_s"], 60);
    assert!(template["boot_snapshot"].is_string(), "{template}");
    assert_eq!(lines(), ["up "], "the boot before the snapshot ran it once");

    // A restore of the boot snapshot does not run it again: the snapshot has it running.
    let restored = server.create(json!({"template": "svc", "ttl_s": 300}));
    assert!(cmdline(pid_of(&restored).0).contains("--restore"));
    assert_eq!(lines(), ["up "]);

    // A boot (another shape) runs it with the sandbox's env, and returns once it is ready.
    std::fs::write(&want, "2").expect("want");
    let booted = server.create(json!({
        "template": "svc", "ttl_s": 300, "memory_mib": 48, "env": {"GREETING": "hi"},
    }));
    assert!(!cmdline(pid_of(&booted).0).contains("--restore"));
    assert_eq!(lines(), ["up ", "up hi"]);

    // A ready command that never succeeds fails the template add within its timeout and
    // leaves nothing: no template, no snapshot, no VMM beyond the two above.
    let before = server.vmms().len();
    let asked = Instant::now();
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "never",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "boot_snapshot": true,
            "start_cmd": "true",
            "ready_cmd": "echo not yet >&2; false",
            "ready_timeout_s": 2,
        })),
    );
    assert_eq!(status, 503, "{body}");
    let error = body["error"].as_str().unwrap_or("");
    assert!(
        error.contains("ready_cmd") && error.contains("within 2 s") && error.contains("not yet"),
        "{body}"
    );
    assert!(asked.elapsed() < Duration::from_secs(30));
    assert_eq!(server.call("GET", "/templates/never", None).0, 404);
    wait_for(
        "the failed boot's VMM to end",
        Duration::from_secs(20),
        || server.vmms().len() == before,
    );

    // The same failure on a create's boot: the create fails and its sandbox is failed.
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "late",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "start_cmd": "true",
            "ready_cmd": "false",
            "ready_timeout_s": 1,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"template": "late", "ttl_s": 300})),
    );
    assert_eq!(status, 503, "{body}");
    wait_for(
        "the failed create's VMM to end",
        Duration::from_secs(20),
        || server.vmms().len() == before,
    );
    let (_, list) = server.call("GET", "/sandboxes?state=failed", None);
    let failed: Vec<&Value> = list["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .filter(|s| s["template"] == "late")
        .collect();
    assert_eq!(failed.len(), 1, "{list}");
    assert!(
        failed[0]["end_reason"]
            .as_str()
            .unwrap_or("")
            .contains("ready_cmd"),
        "{list}"
    );
}

/// A stand-in dockerd for the host agent: answers `GET /_ping` with 200 on a Unix socket and
/// counts the pings (the agent's DockerEnsure pings first and starts nothing when answered).
fn fake_dockerd(sock: &std::path::Path) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::os::unix::net::UnixListener::bind(sock).expect("bind the fake dockerd");
    let pings = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = pings.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 512];
            let _ = conn.read(&mut buf);
            if buf.starts_with(b"GET /_ping") {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            let _ = conn.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nOK");
        }
    });
    pings
}

#[test]
fn docker_templates_have_the_agent_start_dockerd_after_each_boot() {
    use std::sync::atomic::Ordering;
    if !kvm_available() {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let docker_sock = work.path().join("docker.sock");
    let pings = fake_dockerd(&docker_sock);
    let docker_sock = docker_sock.display().to_string();
    let agent = HostAgent::start_with(&["--docker-socket", &docker_sock]);
    let agent_sock = agent.sock.display().to_string();
    let server = Server::start(&["--test-agent-socket", &agent_sock]);
    // The boot before the boot snapshot asks the agent for dockerd.
    let (status, template) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "dock",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "boot_snapshot": true,
            "docker": true,
            "ready_timeout_s": 30,
        })),
    );
    assert_eq!(status, 201, "{template}\n{}", server.log());
    assert_eq!(template["docker"], true, "{template}");
    assert_eq!(
        server.call("GET", "/templates/dock", None).1["docker"],
        true
    );
    let after_add = pings.load(Ordering::SeqCst);
    assert!(
        after_add >= 1,
        "the template's boot did not ask for dockerd"
    );
    // A restore has dockerd from its snapshot: nothing asked.
    server.create(json!({"template": "dock", "ttl_s": 300}));
    assert_eq!(pings.load(Ordering::SeqCst), after_add);
    // A boot (another shape) asks again before the create returns.
    server.create(json!({"template": "dock", "ttl_s": 300, "memory_mib": 48}));
    assert!(pings.load(Ordering::SeqCst) > after_add);

    // The CLI's --docker; a template without it does not show the field.
    let kernel = test_guest().display().to_string();
    let added: Value = serde_json::from_str(&cli(
        &server,
        &[
            "template",
            "add",
            "dock2",
            "--kernel",
            &kernel,
            "--docker",
            "--ready-timeout",
            "30",
            "--json",
        ],
    ))
    .expect("template add prints JSON");
    assert_eq!(added["docker"], true, "{added}");
    let plain: Value = serde_json::from_str(&cli(
        &server,
        &["template", "add", "plain", "--kernel", &kernel, "--json"],
    ))
    .expect("template add prints JSON");
    assert!(plain.get("docker").is_none(), "{plain}");
}
