//! Snapshots that move between nodes: `GET /snapshots/{id}/export` on one `rollbox serve`,
//! `POST /snapshots/import` on another with a state directory of its own, and a restore
//! there; GNU tar reads the archive (holes put back); what an import refuses (another CPU
//! fingerprint, a missing or different template, hostile members) and a cut upload leave
//! nothing behind; importing again answers the snapshot again.
//! The real `rollbox` and `rollbox-vmm` binaries with the tier-2 test guest (needs /dev/kvm).

use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rollbox_tests::daemon::{cli, cli_output, cmdline, console, pid_of, wait_for, Server, KEY};
use rollbox_tests::{kvm_available, test_guest, TEST_GUEST_CMDLINE};
use serde_json::{json, Value};

fn snapshots_dir(server: &Server) -> PathBuf {
    server.state().join("snapshots")
}

/// The names in a server's snapshots directory (staging directories included).
fn snapshot_dirs(server: &Server) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(snapshots_dir(server))
        .map(|dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn export(server: &Server, id: &str, to: &Path) {
    let out = cli(
        server,
        &[
            "sandbox",
            "snapshot-export",
            id,
            "-o",
            to.to_str().expect("path"),
        ],
    );
    assert!(out.contains("bytes"), "{out}");
}

/// POST /snapshots/import of `archive`: status and body.
fn import(server: &Server, archive: &[u8]) -> (u16, Value) {
    let response = server.raw("POST", "/snapshots/import", Some(KEY), Some(archive));
    let body = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
    (response.status, body)
}

/// `archive` with its manifest (the first member) changed by `edit`.
fn with_manifest(archive: &[u8], edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let header = tar::Header::from_byte_slice(&archive[..512]);
    assert_eq!(
        header.path().expect("path").to_str(),
        Some("rollbox-snapshot.json")
    );
    let len = header.entry_size().expect("size") as usize;
    let mut manifest: Value = serde_json::from_slice(&archive[512..512 + len]).expect("manifest");
    edit(&mut manifest);
    let text = serde_json::to_vec(&manifest).expect("json");
    let mut new = tar::Header::new_gnu();
    new.set_path("rollbox-snapshot.json").expect("path");
    new.set_size(text.len() as u64);
    new.set_mode(0o600);
    new.set_cksum();
    let mut out = new.as_bytes().to_vec();
    out.extend_from_slice(&text);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out.extend_from_slice(&archive[512 + len.div_ceil(512) * 512..]);
    out
}

/// Sends the first `bytes.len()` bytes of an upload that says it has `total`; the
/// connection, which the caller closes (or not).
fn partial_upload(server: &Server, bytes: &[u8], total: usize) -> std::os::unix::net::UnixStream {
    let mut stream = std::os::unix::net::UnixStream::connect(server.sock()).expect("connect");
    let head = format!(
        "POST /snapshots/import HTTP/1.1\r\nHost: rollbox\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/x-tar\r\nContent-Length: {total}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).expect("head");
    stream.write_all(bytes).expect("body");
    stream
}

fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).expect("stat").blocks() * 512
}

#[test]
fn a_snapshot_exported_on_one_node_restores_on_another() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = Server::start(&["--node-id", "node-a"]);
    let mut b = Server::start(&["--node-id", "node-b"]);
    // A guest that writes 8 MiB of pages, and checks them once restored as a clone.
    let template = json!({
        "name": "guest",
        "kernel": test_guest(),
        "cmdline": format!("{TEST_GUEST_CMDLINE} rollbox.test.run=touch:8:7;clone-check:8:7"),
        "memory_mib": 48,
    });
    let (status, body) = a.call("POST", "/templates", Some(template.clone()));
    assert_eq!(status, 201, "{body}");
    let parent = a.create(json!({"template": "guest", "ttl_s": 120}));
    wait_for("the pages written", Duration::from_secs(30), || {
        console(&parent).contains("OK 2048")
    });
    let parent_id = parent["id"].as_str().expect("id");
    let (status, taken) = a.call("POST", &format!("/sandboxes/{parent_id}/snapshots"), None);
    assert_eq!(status, 201, "{taken}");
    let snap = taken["id"].as_str().expect("id").to_string();
    let (status, snapshot) = a.call("GET", &format!("/snapshots/{snap}"), None);
    assert_eq!(status, 200, "{snapshot}");
    let a_dir = PathBuf::from(snapshot["dir"].as_str().expect("dir"));

    // The archive: GNU tar reads it, and its files are the snapshot's, holes put back.
    let archive_path = tmp.path().join("snap.tar");
    export(&a, &snap, &archive_path);
    let archive = std::fs::read(&archive_path).expect("archive");
    let memory_len = std::fs::metadata(a_dir.join("memory"))
        .expect("memory")
        .len();
    assert!(
        (archive.len() as u64) < memory_len,
        "holes are not sent: {} bytes for {memory_len} of memory",
        archive.len()
    );
    let untarred = tmp.path().join("untarred");
    std::fs::create_dir(&untarred).expect("mkdir");
    let tar = Command::new("tar")
        .arg("-xf")
        .arg(&archive_path)
        .arg("-C")
        .arg(&untarred)
        .output()
        .expect("tar");
    assert!(
        tar.status.success(),
        "{}",
        String::from_utf8_lossy(&tar.stderr)
    );
    for name in ["vmstate", "memory", "memory.id"] {
        let original = std::fs::read(a_dir.join(name)).expect("original");
        let extracted = std::fs::read(untarred.join(name)).expect("extracted");
        assert!(original == extracted, "GNU tar's {name} differs");
    }
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(untarred.join("rollbox-snapshot.json")).expect("manifest"),
    )
    .expect("json");
    assert_eq!(manifest["node"], "node-a", "{manifest}");
    assert_eq!(manifest["snapshot"]["id"], snap.as_str(), "{manifest}");

    // Without the template, b refuses before taking a file, naming it.
    let (status, body) = import(&b, &archive);
    assert_eq!(status, 409, "{body}");
    let error = body["error"].as_str().unwrap_or("");
    assert!(
        error.contains("\"guest\"") && error.contains("add it"),
        "{error}"
    );
    assert!(snapshot_dirs(&b).is_empty(), "{:?}", snapshot_dirs(&b));

    // With it, the CLI imports it under the same id; the files are the same bytes, holes kept.
    let (status, body) = b.call("POST", "/templates", Some(template));
    assert_eq!(status, 201, "{body}");
    let out = cli(
        &b,
        &[
            "sandbox",
            "snapshot-import",
            archive_path.to_str().expect("path"),
        ],
    );
    assert_eq!(out.trim(), snap, "{out}");
    let (status, imported) = b.call("GET", &format!("/snapshots/{snap}"), None);
    assert_eq!(status, 200, "{imported}");
    assert_eq!(imported["template"], "guest");
    let b_dir = PathBuf::from(imported["dir"].as_str().expect("dir"));
    assert!(b_dir.starts_with(snapshots_dir(&b)), "{imported}");
    for name in ["vmstate", "memory", "memory.id"] {
        let there = std::fs::read(a_dir.join(name)).expect("a");
        let here = std::fs::read(b_dir.join(name)).expect("b");
        assert!(there == here, "{name} differs after the import");
    }
    assert!(
        allocated(&b_dir.join("memory")) <= allocated(&a_dir.join("memory")) + (64 << 10),
        "the imported memory file is no denser than the original"
    );
    let (status, node) = b.call("GET", "/node", None);
    assert_eq!(status, 200);
    assert_eq!(node["snapshots"], json!([snap]), "{node}");

    // A sandbox on b restores it (no boot), and its guest finds every page it wrote on a.
    let restored = b.create(json!({"snapshot": snap, "ttl_s": 120}));
    let (pid, _) = pid_of(&restored);
    assert!(cmdline(pid).contains("--restore"), "{}", cmdline(pid));
    wait_for("the clone's check", Duration::from_secs(30), || {
        let text = console(&restored);
        // The whole line: the guest writes its answer a few bytes at a time.
        text.find("clone OK")
            .is_some_and(|at| text[at..].contains('\n'))
    });
    let console_b = console(&restored);
    assert!(console_b.contains("clone OK 0\n"), "{console_b}");
    assert!(
        !console_b.contains("ready"),
        "the imported snapshot booted: {console_b}"
    );
    assert_eq!(
        b.get(restored["id"].as_str().expect("id"))["state"],
        "running"
    );

    // Again: the same snapshot, answered (200), nothing new.
    let (status, again) = import(&b, &archive);
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["id"], snap.as_str());
    assert_eq!(snapshot_dirs(&b), std::slice::from_ref(&snap));

    // A cut upload of another snapshot leaves nothing; the whole one then imports.
    let second = {
        let sandbox = a.create(json!({"template": "guest", "ttl_s": 120}));
        let id = sandbox["id"].as_str().expect("id");
        let (status, s) = a.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
        assert_eq!(status, 201, "{s}");
        s["id"].as_str().expect("id").to_string()
    };
    let second_path = tmp.path().join("second.tar");
    export(&a, &second, &second_path);
    let second_archive = std::fs::read(&second_path).expect("second");
    for cut in [300, 5000, second_archive.len() - 700] {
        drop(partial_upload(
            &b,
            &second_archive[..cut],
            second_archive.len(),
        ));
        wait_for(
            "the cut import's staging directory to go",
            Duration::from_secs(20),
            || snapshot_dirs(&b) == [snap.clone()],
        );
        let (status, _) = b.call("GET", &format!("/snapshots/{second}"), None);
        assert_eq!(status, 404, "a cut import (at {cut}) recorded the snapshot");
    }
    // A daemon killed mid-import: its next start removes the staging directory.
    let held = partial_upload(&b, &second_archive[..5000], second_archive.len());
    wait_for(
        "the import's staging directory",
        Duration::from_secs(20),
        || snapshot_dirs(&b).iter().any(|d| d.starts_with(".import-")),
    );
    b.kill9();
    drop(held);
    b.spawn();
    assert_eq!(snapshot_dirs(&b), std::slice::from_ref(&snap));
    let (status, body) = import(&b, &second_archive);
    assert_eq!(status, 201, "{body}\n{}", b.log_tail());
    assert_eq!(body["id"], second.as_str());

    // An export of a snapshot that is not there; a cut export leaves no file.
    let missing = cli_output(
        &a,
        &[
            "sandbox",
            "snapshot-export",
            "snap-00000000000000ff",
            "-o",
            tmp.path().join("none.tar").to_str().expect("path"),
        ],
    );
    assert!(!missing.status.success());
    assert!(!tmp.path().join("none.tar").exists());
    assert!(!tmp.path().join(".none.tar.partial").exists());
}

#[test]
fn imports_refuse_another_cpu_template_or_hostile_members_and_leave_nothing() {
    if !kvm_available() {
        return;
    }
    let a = Server::start(&["--node-id", "node-a"]);
    let b = Server::start(&[]);
    let snap = a.guest_snapshot();
    b.add_guest_template("guest");
    let archive = a.raw("GET", &format!("/snapshots/{snap}/export"), Some(KEY), None);
    assert_eq!(archive.status, 200);
    assert_eq!(archive.header("content-type"), Some("application/x-tar"));
    let archive = archive.body;

    let refusals: Vec<(u16, &str, Vec<u8>)> = vec![
        (
            409,
            "CPU fingerprint",
            with_manifest(&archive, |m| m["cpu"]["id"] = json!("00000000deadbeef")),
        ),
        (
            409,
            "not built from an image",
            with_manifest(&archive, |m| {
                m["template"]["image"] = json!("registry.test/app@sha256:00")
            }),
        ),
        (
            409,
            "shared base",
            with_manifest(&archive, |m| m["template"]["base"] = json!("00ff")),
        ),
        (
            400,
            "not a snapshot's",
            with_manifest(&archive, |m| m["files"][0]["name"] = json!("../evil")),
        ),
        (
            400,
            "its manifest says",
            // The manifest's vmstate is a byte longer than the archive's.
            with_manifest(&archive, |m| {
                let size = m["files"][0]["size"].as_u64().expect("size");
                m["files"][0]["size"] = json!(size + 1);
            }),
        ),
        (
            400,
            "format 2",
            with_manifest(&archive, |m| m["format"] = json!(2)),
        ),
        (
            400,
            "not a snapshot id",
            with_manifest(&archive, |m| m["snapshot"]["id"] = json!("../../etc")),
        ),
        (400, "empty", vec![0u8; 1024]),
        (400, "malformed", vec![b'x'; 2048]),
    ];
    for (want_status, want, body) in refusals {
        let (status, answer) = import(&b, &body);
        let error = answer["error"].as_str().unwrap_or("");
        assert_eq!(status, want_status, "{want}: {answer}");
        assert!(error.contains(want), "want {want:?}: {error}");
        assert!(
            snapshot_dirs(&b).is_empty(),
            "{want}: {:?}",
            snapshot_dirs(&b)
        );
    }
    assert!(!b.state().join("evil").exists());
    let (status, list) = b.call("GET", "/snapshots", None);
    assert_eq!((status, &list["snapshots"]), (200, &json!([])), "{list}");
}
