//! `rollbox serve` end to end, GPUs without one: a `--gpu` that is not a vfio-pci device stops
//! the daemon naming it, `GET /gpus` lists what the node has (nothing on these hosts), and a
//! create asking for a GPU the node lacks is a 400 naming the field. A sandbox that holds a
//! real device (passthrough, exclusivity, refusals, release) is `tier4_vfio.rs`'s, with the
//! lab's emulated edu device.

use std::process::Command;

use rollbox_tests::daemon::{Server, KEY};
use rollbox_tests::{rollbox_binary, test_guest};
use serde_json::json;

/// Devices bound to vfio-pci on this host (the daemon's GPUs when no --gpu is given).
fn vfio_bound() -> usize {
    std::fs::read_dir("/sys/bus/pci/drivers/vfio-pci")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().contains(':'))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn a_gpu_that_is_not_a_vfio_device_stops_serve_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (flag, want) in [
        ("0000:ff:1f.7", "--gpu 0000:ff:1f.7: no PCI device"),
        ("gpu0", "--gpu \"gpu0\": expected DDDD:BB:DD.F[=NAME]"),
    ] {
        let out = Command::new(rollbox_binary())
            .arg("serve")
            .arg("--socket")
            .arg(dir.path().join("d.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--gpu", flag])
            .env("ROLLBOX_API_KEY", KEY)
            .output()
            .expect("rollbox serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}: serve started");
        assert!(stderr.contains(want), "{flag}: {stderr}");
    }
}

#[test]
fn gpu_requests_on_a_node_without_gpus_are_refused_by_field() {
    let server = Server::start(&[]);
    let (status, list) = server.call("GET", "/gpus", None);
    assert_eq!(status, 200, "{list}");
    if vfio_bound() > 0 {
        // A host with vfio-pci devices: they are its GPUs; the rest is the lab test's.
        return;
    }
    assert_eq!(list, json!({"gpus": []}));
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({"name": "guest", "kernel": test_guest(), "memory_mib": 32})),
    );
    assert_eq!(status, 201, "{body}");
    for (body, field) in [
        (
            json!({"template": "guest", "ttl_s": 60, "gpu": "H100"}),
            "gpu: this node has 0 GPU(s) matching \"H100\"",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "gpu_count": 2}),
            "gpu: this node has 0 GPU(s) matching \"any\", 2 asked for",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "gpu": "any", "gpu_count": 0}),
            "gpu_count: 0 is out of range",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "gpu": ""}),
            "gpu: \"\" is not a GPU name",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "gpu_wait_s": 5}),
            "gpu_wait_s: needs gpu",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "gpu": "any", "gpu_wait_s": 4000}),
            "gpu_wait_s: 4000 is out of range",
        ),
        (
            json!({"snapshot": "snap-0123456789abcdef", "gpu": "any"}),
            "gpu: a sandbox with a GPU boots",
        ),
    ] {
        let (status, answer) = server.call("POST", "/sandboxes", Some(body.clone()));
        assert_eq!(status, 400, "{body}: {answer}");
        let error = answer["error"].as_str().unwrap_or("");
        assert!(error.starts_with(field), "{body}: {error}");
    }
    assert!(server.list("running").is_empty(), "nothing was created");
}
