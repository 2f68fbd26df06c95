//! Tier 2: what rollbox-vmm does with Firecracker's API where it differs from Firecracker:
//! endpoints it refuses, load fields that would change a restore's meaning if ignored, and
//! the few fields it accepts and ignores (README, "Firecracker compatibility").

use std::path::Path;
use std::time::Duration;

use rollbox_tests::{boot_with_api, kvm_available, wait_for_socket, Vm};
use vmm_api::{Client, Response};

/// One raw request: these tests check Firecracker's bodies and the answers' statuses and
/// fault messages as they are on the wire.
fn send(api: &Client, method: &str, path: &str, body: &str) -> Response {
    api.request(method, path, Some(body.as_bytes()))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A rollbox-vmm waiting on its API socket, with no VM yet.
fn empty_vmm() -> Vm {
    let scratch = tempfile::tempdir().expect("tempdir");
    let vm = Vm::spawn_raw(&["--api-sock".into(), "{dir}/api.sock".into()], scratch);
    wait_for_socket(&vm.path("api.sock"), Duration::from_secs(10));
    vm
}

fn full_snapshot(vm: &Vm, dir: &Path) {
    std::fs::create_dir_all(dir).expect("snapshot dir");
    let api = vm.api();
    api.pause().unwrap_or_else(|e| panic!("{e}"));
    let create = format!(
        r#"{{"snapshot_type":"Full","snapshot_path":"{0}/vmstate","mem_file_path":"{0}/memory","version":"1.0.0"}}"#,
        dir.display()
    );
    let answer = send(&api, "PUT", "/snapshot/create", &create);
    assert_eq!(
        answer.status,
        204,
        "the deprecated version is accepted and ignored: {}",
        answer.text()
    );
}

#[test]
fn firecracker_endpoints_rollbox_lacks_are_refused_by_name() {
    let vmm = empty_vmm();
    let api = vmm.api();
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
        let answer = send(&api, method, path, "{}");
        let (status, body) = (answer.status, answer.text());
        assert_eq!(status, 400, "{method} {path}: {body}");
        assert!(
            body.contains("invalid request method and/or path") && body.contains(path),
            "{method} {path}: {body}"
        );
    }
    let answer = send(&api, "PUT", "/actions", r#"{"action_type":"FlushMetrics"}"#);
    assert_eq!(
        answer.status,
        204,
        "FlushMetrics is accepted and ignored: {}",
        answer.text()
    );
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
    let api = vmm.api();
    let load = |extra: &str| {
        let body = format!(r#"{{"snapshot_path":"{}"{extra}}}"#, state.display());
        let answer = send(&api, "PUT", "/snapshot/load", &body);
        (answer.status, answer.text())
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
    let info = api.vm_info().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(info.state, "Running", "{info:?}");
}
