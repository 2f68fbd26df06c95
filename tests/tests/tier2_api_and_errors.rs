//! Tier 2: the Firecracker-compatible API, JSON configuration files, and bad input: each gets
//! one clear line, a non-zero exit, and leaves nothing behind.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rollbox_tests::{
    api_client, kvm_available, raw_image, test_guest, vmm_binary, wait_for_socket, Vm,
};

/// Runs rollbox-vmm to completion in `dir` and returns (exit code, stderr).
fn run_to_failure(dir: &Path, args: &[String]) -> (Option<i32>, String) {
    let out = Command::new(vmm_binary())
        .args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run rollbox-vmm");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn assert_one_clear_line(code: Option<i32>, stderr: &str, needle: &str) {
    assert_ne!(code, Some(0), "must fail: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "want one line, got: {stderr}");
    assert!(
        lines[0].contains(needle),
        "{needle:?} not in {:?}",
        lines[0]
    );
}

fn leftovers(dir: &Path, expected: &[&str]) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| !expected.contains(&n.as_str()))
        .collect()
}

#[test]
fn bad_input_gets_one_clear_line_and_leaves_nothing_behind() {
    if !kvm_available() {
        return;
    }
    let guest = test_guest().display().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("script.sh"), "#!/bin/sh\necho not a kernel\n").expect("write");
    std::fs::write(
        d.join("bad.json"),
        r#"{"machine-config":{"vcpu_count":1,"mem_size_mib":64,"turbo":true}}"#,
    )
    .expect("write");
    std::fs::write(d.join("in-use.sock"), "").expect("write");
    let s = |v: &str| v.to_string();
    let api = d.join("api.sock").display().to_string();
    let vs = d.join("v.sock").display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                s("--kernel"),
                s("/nonexistent/vmlinux"),
                s("--api-sock"),
                api.clone(),
            ],
            "/nonexistent/vmlinux",
        ),
        (
            vec![
                s("--kernel"),
                d.join("script.sh").display().to_string(),
                s("--api-sock"),
                api.clone(),
            ],
            "neither an ELF vmlinux nor a bzImage",
        ),
        (
            vec![
                s("--kernel"),
                guest.clone(),
                s("--memory-mib"),
                s("0"),
                s("--api-sock"),
                api.clone(),
            ],
            "mem_size_mib 0",
        ),
        (
            vec![
                s("--kernel"),
                guest.clone(),
                s("--memory-mib"),
                s("100000000"),
                s("--api-sock"),
                api.clone(),
            ],
            "exceeds the host's memory",
        ),
        (
            vec![
                s("--config"),
                d.join("bad.json").display().to_string(),
                s("--api-sock"),
                api.clone(),
            ],
            "unknown field `turbo`",
        ),
        (
            vec![
                s("--kernel"),
                guest.clone(),
                s("--drive"),
                s("/nonexistent/disk.img"),
                s("--api-sock"),
                api.clone(),
            ],
            "/nonexistent/disk.img",
        ),
        (
            vec![
                s("--kernel"),
                guest.clone(),
                s("--api-sock"),
                d.join("in-use.sock").display().to_string(),
            ],
            "in-use.sock already exists",
        ),
        (
            vec![
                s("--kernel"),
                guest.clone(),
                s("--vsock-uds"),
                d.join("in-use.sock").display().to_string(),
                s("--vsock-cid"),
                s("3"),
                s("--api-sock"),
                api.clone(),
            ],
            "in-use.sock already exists",
        ),
        (
            vec![
                s("--kernel"),
                guest.clone(),
                s("--vsock-uds"),
                vs.clone(),
                s("--vsock-cid"),
                s("2"),
                s("--api-sock"),
                api.clone(),
            ],
            "guest_cid 2",
        ),
        (
            vec![s("--kernel"), guest.clone(), s("--vcpus"), s("0")],
            "vcpu_count 0",
        ),
        (vec![], "nothing to do"),
    ];
    for (args, needle) in cases {
        let (code, stderr) = run_to_failure(d, &args);
        assert_one_clear_line(code, &stderr, needle);
        let left = leftovers(d, &["script.sh", "bad.json", "in-use.sock"]);
        assert!(left.is_empty(), "{args:?} left {left:?} behind");
    }
}

#[test]
fn configured_over_firecrackers_api_then_paused_and_resumed() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    raw_image(&dir.path().join("disk.img"), 1 << 20);
    let sock = dir.path().join("api.sock");
    let mut vm = Vm::spawn_raw(&["--api-sock".into(), sock.display().to_string()], dir);
    wait_for_socket(&sock, Duration::from_secs(10));

    // Firecracker's requests as its clients write them, and its answers' statuses: raw.
    let api = api_client(&sock);
    let send = |method: &str, path: &str, body: Option<&str>| {
        api.request(method, path, body.map(str::as_bytes))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let answer = send("GET", "/", None);
    assert_eq!(answer.status, 200);
    let info: serde_json::Value = serde_json::from_slice(&answer.body).expect("json");
    assert_eq!(info["state"], "Not started");

    let guest = test_guest().display().to_string();
    let boot = format!(
        r#"{{"kernel_image_path":"{guest}","boot_args":"console=ttyS0 via-api acpi=off"}}"#
    );
    assert_eq!(send("PUT", "/boot-source", Some(&boot)).status, 204);
    assert_eq!(
        send(
            "PUT",
            "/machine-config",
            Some(r#"{"vcpu_count":2,"mem_size_mib":96,"smt":false}"#)
        )
        .status,
        204
    );
    let disk = vm.path("disk.img").display().to_string();
    let drive = format!(
        r#"{{"drive_id":"rootfs","path_on_host":"{disk}","is_root_device":true,"is_read_only":false}}"#
    );
    assert_eq!(send("PUT", "/drives/rootfs", Some(&drive)).status, 204);
    let vsock = format!(
        r#"{{"guest_cid":9,"uds_path":"{}"}}"#,
        vm.path("v.sock").display()
    );
    assert_eq!(send("PUT", "/vsock", Some(&vsock)).status, 204);

    // Bad requests are refused with a fault message naming the problem.
    let answer = send(
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count":1,"mem_size_mib":64,"x":1}"#),
    );
    let body = answer.text();
    assert_eq!(answer.status, 400);
    assert!(
        body.contains("fault_message") && body.contains("unknown field `x`"),
        "{body}"
    );
    let answer = send(
        "PUT",
        "/boot-source",
        Some(r#"{"kernel_image_path":"/nope"}"#),
    );
    let body = answer.text();
    assert_eq!(answer.status, 400);
    assert!(body.contains("/nope"), "{body}");
    let answer = send("PUT", "/actions", Some(r#"{"action_type":"Explode"}"#));
    let body = answer.text();
    assert_eq!(answer.status, 400);
    assert!(body.contains("Explode"), "{body}");
    let answer = send("PATCH", "/vm", Some(r#"{"state":"Paused"}"#));
    assert_eq!(answer.status, 400, "pausing before start must fail");

    assert_eq!(
        send(
            "PUT",
            "/actions",
            Some(r#"{"action_type":"InstanceStart"}"#)
        )
        .status,
        204
    );
    vm.expect_line("rollbox-test-guest: ready");
    let cmdline = vm.ok("cmdline");
    assert!(
        cmdline.starts_with(
            "console=ttyS0 via-api acpi=off root=/dev/vda rw virtio_mmio.device=4K@0xd0000000:5"
        ),
        "{cmdline}"
    );
    assert_eq!(vm.ok("blk-id 0"), "rootfs");
    assert_eq!(vm.ok("vsock-cid"), "9");
    let answer = send("GET", "/machine-config", None);
    let body = answer.text();
    assert_eq!(answer.status, 200);
    assert!(body.contains(r#""mem_size_mib":96"#), "{body}");

    // Configuration after boot is refused.
    let answer = send(
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count":1,"mem_size_mib":64}"#),
    );
    let body = answer.text();
    assert_eq!(answer.status, 400);
    assert!(
        body.contains("not allowed after the microVM started"),
        "{body}"
    );

    // Pause: the guest stops answering; resume: the answer arrives.
    assert_eq!(
        send("PATCH", "/vm", Some(r#"{"state":"Paused"}"#)).status,
        204
    );
    let body = send("GET", "/", None).text();
    assert!(body.contains(r#""state":"Paused""#), "{body}");
    vm.send("echo while-paused\n");
    assert_eq!(
        vm.next_line(Duration::from_millis(500)),
        None,
        "a paused guest must not answer"
    );
    assert_eq!(
        send("PATCH", "/vm", Some(r#"{"state":"Resumed"}"#)).status,
        204
    );
    assert_eq!(
        vm.next_line(Duration::from_secs(20)).as_deref(),
        Some("OK while-paused")
    );
    assert_eq!(
        send(
            "PUT",
            "/actions",
            Some(r#"{"action_type":"SendCtrlAltDel"}"#)
        )
        .status,
        204
    );

    vm.send("poweroff\n");
    assert!(vm.wait(Duration::from_secs(20)).success());
    assert!(!sock.exists(), "API socket must be removed on exit");
}

#[test]
fn boots_from_a_firecracker_config_file() {
    if !kvm_available() {
        return;
    }
    let guest = test_guest().display().to_string();
    let mut vm = Vm::boot_with(
        |dir| {
            raw_image(&dir.join("data.img"), 2 << 20);
            let config = format!(
                r#"{{"boot-source":{{"kernel_image_path":"{guest}","boot_args":"console=ttyS0 from-file acpi=off"}},
                    "machine-config":{{"vcpu_count":1,"mem_size_mib":64}},
                    "drives":[{{"drive_id":"data","path_on_host":"{}","is_root_device":false,"is_read_only":true}}],
                    "console":"stdout"}}"#,
                dir.join("data.img").display()
            );
            std::fs::write(dir.join("vm.json"), config).expect("write config");
        },
        &["--config", "{dir}/vm.json"],
    );
    assert!(vm.ok("cmdline").starts_with("console=ttyS0 from-file"));
    assert_eq!(vm.ok("blk-info 0"), "capacity=4096 ro=1 flush=1");
    vm.send("poweroff\n");
    assert!(vm.wait(Duration::from_secs(20)).success());
}

#[test]
fn console_can_go_to_a_file() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("console.log");
    let guest = test_guest().display().to_string();
    let mut vm = Vm::spawn_raw(
        &[
            "--kernel".into(),
            guest,
            "--console".into(),
            log.display().to_string(),
        ],
        dir,
    );
    vm.send("poweroff\n");
    assert!(vm.wait(Duration::from_secs(20)).success());
    let text = std::fs::read_to_string(&log).expect("console log");
    assert!(text.contains("rollbox-test-guest: ready"), "{text}");
}

/// Whether a network interface named `name` exists on the host.
fn host_link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

#[test]
fn bad_network_interfaces_get_one_clear_line_and_leave_no_tap() {
    if !kvm_available() {
        return;
    }
    let guest = test_guest().display().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(
        d.join("limited.json"),
        r#"{"network-interfaces":[{"iface_id":"eth0","host_dev_name":"rbxt2lim","rx_rate_limiter":{"bandwidth":{"size":1,"refill_time":1}}}]}"#,
    )
    .expect("write");
    let base = |extra: &[&str]| {
        let mut all = vec!["--kernel".to_string(), guest.clone()];
        all.extend(extra.iter().map(|s| s.to_string()));
        all
    };
    let config = d.join("limited.json").display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            base(&["--net", "rbx-name-too-long"]),
            "host_dev_name \"rbx-name-too-long\" is invalid",
        ),
        (
            base(&["--net", "rbxt2x,speed=10"]),
            "--net \"rbxt2x,speed=10\"",
        ),
        (
            base(&["--net", "rbxt2x,mac=01:00:5e:00:00:01"]),
            "guest_mac \"01:00:5e:00:00:01\" is invalid",
        ),
        (
            base(&[
                "--net",
                "rbxt2a,mac=06:00:0a:00:00:02",
                "--net",
                "rbxt2b,mac=06:00:0a:00:00:02",
            ]),
            "guest_mac 06:00:0a:00:00:02 is already used by interface eth0",
        ),
        (
            base(&["--net", "rbxt2a", "--net", "rbxt2a,id=eth9"]),
            "host_dev_name rbxt2a is already used by interface eth0",
        ),
        (
            base(&["--config", &config]),
            "rx_rate_limiter is not supported",
        ),
    ];
    for (args, needle) in cases {
        let (code, stderr) = run_to_failure(d, &args);
        assert_one_clear_line(code, &stderr, needle);
    }
    for tap in ["rbxt2x", "rbxt2a", "rbxt2b", "rbxt2lim"] {
        assert!(!host_link_exists(tap), "tap {tap} was left behind");
    }

    // A tap another process holds.
    let held = vmm::devices::virtio::net::tap::Tap::open("rbxt2held").expect("hold a tap");
    let (code, stderr) = run_to_failure(d, &base(&["--net", "rbxt2held"]));
    assert_one_clear_line(code, &stderr, "tap rbxt2held is in use by another process");
    drop(held);
    // The kernel unregisters a closed tap shortly after the close, not within it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while host_link_exists("rbxt2held") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(!host_link_exists("rbxt2held"), "the test's tap outlived it");
    assert_eq!(leftovers(d, &["limited.json"]), Vec::<String>::new());
}

#[test]
fn network_interfaces_over_the_api() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("api.sock");
    let mut vm = Vm::spawn_raw(&["--api-sock".into(), sock.display().to_string()], dir);
    wait_for_socket(&sock, Duration::from_secs(10));
    // Refusals and their fault messages, and Firecracker's 204s: raw.
    let api = api_client(&sock);
    let send = |method: &str, path: &str, body: &str| {
        let answer = api
            .request(method, path, Some(body.as_bytes()))
            .unwrap_or_else(|e| panic!("{e}"));
        (answer.status, answer.text())
    };
    let put = |path: &str, body: &str| send("PUT", path, body);
    let (status, body) = put(
        "/network-interfaces/eth0",
        r#"{"iface_id":"eth1","host_dev_name":"rbxt2api"}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("does not match"), "{body}");
    let (status, body) = put(
        "/network-interfaces/eth0",
        r#"{"iface_id":"eth0","host_dev_name":"rbxt2api","guest_mac":"06:00:0a:00:00:09"}"#,
    );
    assert_eq!(status, 204, "{body}");
    let (status, body) = put(
        "/network-interfaces/eth1",
        r#"{"iface_id":"eth1","host_dev_name":"rbxt2api"}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("already used by interface eth0"), "{body}");
    let (status, body) = send(
        "PATCH",
        "/network-interfaces/eth0",
        r#"{"iface_id":"eth0","rx_rate_limiter":{}}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("rate limiters are not supported"), "{body}");
    let boot = format!(
        r#"{{"kernel_image_path":"{}","boot_args":"{}"}}"#,
        test_guest().display(),
        rollbox_tests::TEST_GUEST_CMDLINE
    );
    assert_eq!(put("/boot-source", &boot).0, 204);
    assert_eq!(put("/actions", r#"{"action_type":"InstanceStart"}"#).0, 204);
    vm.expect_line("rollbox-test-guest: ready");
    // The VM holds the tap it was given.
    assert!(host_link_exists("rbxt2api"));
    let (status, body) = put(
        "/network-interfaces/eth2",
        r#"{"iface_id":"eth2","host_dev_name":"rbxt2late"}"#,
    );
    assert_eq!(status, 400, "{body}");
    vm.send("poweroff\n");
    vm.wait(Duration::from_secs(30));
    assert!(!host_link_exists("rbxt2api"), "the VM's tap outlived it");
}
