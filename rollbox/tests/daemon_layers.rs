//! `rollbox serve` end to end, shared layers: templates built from images that share their
//! first layers share one read-only base file, and their sandboxes boot, restore, snapshot and
//! fork with it as a second drive. The real binaries with the tier-2 test guest as the kernel
//! (it never reads its disks, so this proves the host side; the lab boots Linux on the overlay).

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use rollbox_tests::daemon::{boot_config, cmdline, exec, image_server, pid_of, Server};
use rollbox_tests::images::{self, images_on_one_base};
use rollbox_tests::kvm_available;
use serde_json::{json, Value};

fn path_of(value: &Value) -> PathBuf {
    PathBuf::from(value.as_str().unwrap_or_else(|| panic!("no path: {value}")))
}

fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).expect("metadata").blocks() * 512
}

fn assert_echo(server: &Server, sandbox: &Value) {
    let id = sandbox["id"].as_str().expect("id");
    let out = exec(server, id, json!({"cmd": ["sh", "-c", "echo ok"]}));
    assert_eq!(out["stdout"], "ok\n", "{out}");
}

#[test]
fn templates_from_images_with_common_layers_share_one_base_file() {
    let test = "templates_from_images_with_common_layers_share_one_base_file";
    if !kvm_available() || !images::root_or_skip(test) {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let archives = images_on_one_base(work.path());
    let (_agent, server) = image_server(work.path(), &[]);

    // The first image of its kind is one whole disk; the next ones stack on a base of the
    // layers they share with it, linked from the image cache, not copied.
    let first = server.add_image_template("task0", &archives[0], false);
    assert_eq!(first["base_rootfs"], Value::Null, "{first}");
    let second = server.add_image_template("task1", &archives[1], true);
    let third = server.add_image_template("task2", &archives[2], false);
    let base = path_of(&second["base_rootfs"]);
    let base_of_third = path_of(&third["base_rootfs"]);
    assert_eq!(base.file_name(), Some("base.ext4".as_ref()));
    let inode = |p: &Path| std::fs::metadata(p).expect("base").ino();
    assert_eq!(inode(&base), inode(&base_of_third), "one base file");
    assert!(std::fs::metadata(&base).expect("base").nlink() >= 3);
    let whole = allocated(&path_of(&first["rootfs"]));
    let top = allocated(&path_of(&third["rootfs"]));
    eprintln!(
        "whole image {} KiB; base {} KiB once, then a top disk of {} KiB per template",
        whole >> 10,
        allocated(&base) >> 10,
        top >> 10
    );
    assert!(
        top < whole,
        "top disk {top} B against the whole image's {whole} B"
    );

    // A boot: the top disk is the root drive, the base a read-only second drive, and the
    // agent is told to stack them.
    let booted = server.create(json!({"template": "task2", "ttl_s": 300}));
    let config = boot_config(&booted);
    let drives = &config["drives"];
    assert_eq!(
        (&drives[0]["drive_id"], &drives[0]["is_root_device"]),
        (&json!("rootfs"), &json!(true)),
        "{config}"
    );
    assert_eq!(
        (&drives[1]["drive_id"], &drives[1]["is_read_only"]),
        (&json!("base"), &json!(true)),
        "{config}"
    );
    let boot_args = config["boot-source"]["boot_args"].as_str().unwrap_or("");
    assert!(boot_args.contains("rollbox.lower=/dev/vdb"), "{config}");
    assert_echo(&server, &booted);
    // Nothing of the base is copied into the sandbox (its jail has an empty mount point).
    let mount_point = path_of(&booted["dir"]).join("base.ext4");
    assert!(!mount_point.exists() || allocated(&mount_point) == 0);

    // A create of the template with a boot snapshot restores it with the base.
    let restored = server.create(json!({"template": "task1", "ttl_s": 300}));
    let (pid, _) = pid_of(&restored);
    let line = cmdline(pid);
    assert!(line.contains("--drive-override base="), "{line}");
    assert_echo(&server, &restored);

    // Snapshot, restore and fork of a sandbox on a base.
    let id = booted["id"].as_str().expect("id");
    let (status, snapshot) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{snapshot}\n{}", server.log());
    let snapshot_dir = path_of(&snapshot["dir"]);
    assert!(
        !snapshot_dir.join("base.ext4").exists(),
        "the base is not copied"
    );
    let from_snapshot = server.create(json!({"snapshot": snapshot["id"], "ttl_s": 300}));
    assert_echo(&server, &from_snapshot);
    let (status, forked) = server.call(
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(json!({"count": 2})),
    );
    assert_eq!(status, 200, "{forked}\n{}", server.log());
    for result in forked["results"].as_array().expect("results") {
        assert_eq!(result["error"], Value::Null, "{result}");
        assert_echo(&server, &result["sandbox"]);
    }

    // Deleting one template leaves the base of the others, and their sandboxes running.
    let (status, body) = server.call("DELETE", "/templates/task1", None);
    assert_eq!(status, 204, "{body}");
    assert_eq!(
        inode(&base_of_third),
        inode(&path_of(&third["base_rootfs"]))
    );
    assert_eq!(server.get(id)["state"], "running");
    let again = server.create(json!({"template": "task2", "ttl_s": 300}));
    assert_echo(&server, &again);
}

#[test]
fn no_layer_sharing_builds_every_template_whole() {
    let test = "no_layer_sharing_builds_every_template_whole";
    if !kvm_available() || !images::root_or_skip(test) {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let archives = images_on_one_base(work.path());
    let cache = work.path().join("cache").display().to_string();
    let guest_agent = images::agent().display().to_string();
    let server = Server::start(&[
        "--agent",
        &guest_agent,
        "--image-cache",
        &cache,
        "--no-layer-sharing",
    ]);
    for (i, archive) in archives.iter().enumerate().take(2) {
        let template = server.add_image_template(&format!("whole{i}"), archive, false);
        assert_eq!(template["base_rootfs"], Value::Null, "{template}");
    }
}
