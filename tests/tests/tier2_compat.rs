//! Tier 2: what rollbox-vmm does with Firecracker's API where it differs from Firecracker:
//! endpoints it refuses, load fields that would change a restore's meaning if ignored, and
//! the few fields it accepts and ignores (README, "Firecracker compatibility").

use std::path::Path;
use std::time::Duration;

use rollbox_tests::{api, boot_with_api, kvm_available, wait_for_socket, Vm};

/// A rollbox-vmm waiting on its API socket, with no VM yet.
fn empty_vmm() -> Vm {
    let scratch = tempfile::tempdir().expect("tempdir");
    let vm = Vm::spawn_raw(&["--api-sock".into(), "{dir}/api.sock".into()], scratch);
    wait_for_socket(&vm.path("api.sock"), Duration::from_secs(10));
    vm
}

fn full_snapshot(vm: &Vm, dir: &Path) {
    std::fs::create_dir_all(dir).expect("snapshot dir");
    let sock = vm.path("api.sock");
    let (status, body) = api(&sock, "PATCH", "/vm", Some(r#"{"state":"Paused"}"#));
    assert_eq!(status, 204, "{body}");
    let create = format!(
        r#"{{"snapshot_type":"Full","snapshot_path":"{0}/vmstate","mem_file_path":"{0}/memory","version":"1.0.0"}}"#,
        dir.display()
    );
    let (status, body) = api(&sock, "PUT", "/snapshot/create", Some(&create));
    assert_eq!(
        status, 204,
        "the deprecated version is accepted and ignored: {body}"
    );
}

#[test]
fn firecracker_endpoints_rollbox_lacks_are_refused_by_name() {
    let vmm = empty_vmm();
    let sock = vmm.path("api.sock");
    for (method, path) in [
        ("PUT", "/logger"),
        ("PUT", "/metrics"),
        ("PUT", "/mmds"),
        ("PUT", "/mmds/config"),
        ("PUT", "/balloon"),
        ("GET", "/balloon/statistics"),
        ("PUT", "/entropy"),
        ("PUT", "/cpu-config"),
        ("GET", "/vm/config"),
        ("GET", "/version"),
        ("PUT", "/hotplug/memory"),
    ] {
        let (status, body) = api(&sock, method, path, Some("{}"));
        assert_eq!(status, 400, "{method} {path}: {body}");
        assert!(
            body.contains("invalid request method and/or path") && body.contains(path),
            "{method} {path}: {body}"
        );
    }
    let (status, body) = api(
        &sock,
        "PUT",
        "/actions",
        Some(r#"{"action_type":"FlushMetrics"}"#),
    );
    assert_eq!(status, 204, "FlushMetrics is accepted and ignored: {body}");
}

#[test]
fn load_fields_that_would_change_the_restore_are_refused_not_ignored() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let snap = scratch.path().join("snap");
    let mut vm = boot_with_api(&[]);
    full_snapshot(&vm, &snap);
    let _ = vm.child.kill();
    let memory = snap.join("memory");
    let state = snap.join("vmstate");

    let vmm = empty_vmm();
    let sock = vmm.path("api.sock");
    let load = |extra: &str| {
        let body = format!(r#"{{"snapshot_path":"{}"{extra}}}"#, state.display());
        api(&sock, "PUT", "/snapshot/load", Some(&body))
    };
    let (status, body) = load(&format!(
        r#","mem_file_path":"{0}","mem_backend":{{"backend_type":"File","backend_path":"{0}"}}"#,
        memory.display()
    ));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("give one"), "{body}");

    let (status, body) = load(r#","rollbox":{"drive_overrides":{"nope":"/nowhere.img"}}"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("no drive with ID \\\"nope\\\""), "{body}");

    let (status, body) =
        load(r#","network_overrides":[{"iface_id":"eth9","host_dev_name":"tap9"}]"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("iface_id \\\"eth9\\\""), "{body}");

    let (status, body) = load(r#","clock_realtime":true"#);
    assert_eq!(status, 400, "an unknown field is refused: {body}");

    // After the refusals the same VMM still loads the snapshot.
    let (status, body) = load(&format!(
        r#","mem_backend":{{"backend_type":"File","backend_path":"{}"}},"resume_vm":true,"vsock_override":{{"uds_path":"{}"}}"#,
        memory.display(),
        vmm.path("v.sock").display()
    ));
    assert_eq!(status, 204, "{body}");
    let (_, info) = api(&sock, "GET", "/", None);
    assert!(info.contains("Running"), "{info}");
}
