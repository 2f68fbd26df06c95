//! File operations through the real agent binary in host mode.

mod common;

use std::io::Read as _;
use std::os::unix::fs::PermissionsExt as _;

use common::AgentProcess;
use rollbox_agent_protocol::{FileKind, WriteFileRequest};

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[tokio::test]
async fn write_read_stat_list_round_trip() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let dir = agent.scratch("data");
    client
        .mkdir(&format!("{dir}/a/b"), true)
        .await
        .expect("mkdir -p");
    client
        .mkdir(&format!("{dir}/a/b"), true)
        .await
        .expect("mkdir -p again is fine");

    // Several chunks' worth, to cover streaming both ways.
    let data = pattern(1_000_003);
    let path = format!("{dir}/a/b/big.bin");
    assert_eq!(
        client.write_file(&path, &data).await.expect("write"),
        data.len() as u64
    );
    assert_eq!(client.read_file(&path).await.expect("read"), data);
    assert_eq!(
        client
            .read_file_range(&path, 10, Some(5))
            .await
            .expect("range"),
        data[10..15].to_vec()
    );
    assert_eq!(
        client
            .read_file_range(&path, 999_990, None)
            .await
            .expect("tail"),
        data[999_990..].to_vec()
    );
    assert_eq!(std::fs::read(&path).expect("host read"), data);

    let info = client.stat(&path).await.expect("stat");
    assert_eq!(
        (info.kind, info.size, info.mode),
        (FileKind::File, data.len() as u64, 0o644)
    );
    assert_eq!(info.name, "big.bin");

    std::os::unix::fs::symlink("big.bin", format!("{dir}/a/b/link")).expect("symlink");
    let link = client
        .lstat(&format!("{dir}/a/b/link"))
        .await
        .expect("lstat");
    assert_eq!(link.kind, FileKind::Symlink);
    assert_eq!(link.link_target.as_deref(), Some("big.bin"));
    assert_eq!(
        client
            .stat(&format!("{dir}/a/b/link"))
            .await
            .expect("stat")
            .kind,
        FileKind::File
    );

    client
        .write_file(&format!("{dir}/a/b/empty"), b"")
        .await
        .expect("empty file");
    assert_eq!(
        client
            .read_file(&format!("{dir}/a/b/empty"))
            .await
            .expect("read empty"),
        b""
    );
    let names: Vec<String> = client
        .list(&format!("{dir}/a/b"))
        .await
        .expect("list")
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["big.bin", "empty", "link"]);
}

#[tokio::test]
async fn atomic_write_replaces_keeps_mode_and_leaves_no_temp_files() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let dir = agent.scratch("atomic");
    client.mkdir(&dir, false).await.expect("mkdir");
    let path = format!("{dir}/config");
    let mut req = WriteFileRequest::new(&path);
    req.mode = Some(0o600);
    client
        .write_file_from(req, &b"v1"[..])
        .await
        .expect("write v1");
    assert_eq!(
        std::fs::metadata(&path).expect("meta").permissions().mode() & 0o7777,
        0o600
    );
    // Replacing keeps the mode of the file being replaced.
    client
        .write_file(&path, b"version two")
        .await
        .expect("write v2");
    assert_eq!(std::fs::read(&path).expect("read"), b"version two");
    assert_eq!(
        std::fs::metadata(&path).expect("meta").permissions().mode() & 0o7777,
        0o600
    );
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("readdir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(entries, ["config"], "temporary files left behind");

    // A write whose source fails is cancelled: the old content stays, no temp file.
    struct Failing(usize);
    impl tokio::io::AsyncRead for Failing {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if self.0 == 0 {
                return std::task::Poll::Ready(Err(std::io::Error::other("source broke")));
            }
            self.0 -= 1;
            buf.put_slice(&[b'x'; 1000]);
            std::task::Poll::Ready(Ok(()))
        }
    }
    let err = client
        .write_file_from(WriteFileRequest::new(&path), Failing(3))
        .await
        .expect_err("source fails");
    assert!(err.to_string().contains("source broke"), "{err}");
    // The agent drops the temporary file when it handles the cancel, shortly after.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let entries: Vec<_> = std::fs::read_dir(&dir)
            .expect("readdir")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        if entries == ["config"] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "temporary files left behind after cancel: {entries:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(std::fs::read(&path).expect("read"), b"version two");

    // Non-atomic mode writes in place; make_parents creates the directory.
    let mut req = WriteFileRequest::new(format!("{dir}/new/sub/file"));
    req.atomic = false;
    req.make_parents = true;
    client
        .write_file_from(req, &b"direct"[..])
        .await
        .expect("direct write");
    assert_eq!(
        std::fs::read(format!("{dir}/new/sub/file")).expect("read"),
        b"direct"
    );
}

#[tokio::test]
async fn move_and_remove() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let dir = agent.scratch("mv");
    client
        .mkdir(&format!("{dir}/tree/deep"), true)
        .await
        .expect("mkdir");
    client
        .write_file(&format!("{dir}/tree/deep/f"), b"x")
        .await
        .expect("write");
    client
        .rename(&format!("{dir}/tree"), &format!("{dir}/moved"))
        .await
        .expect("move");
    assert!(!std::path::Path::new(&format!("{dir}/tree")).exists());
    assert_eq!(
        std::fs::read(format!("{dir}/moved/deep/f")).expect("read"),
        b"x"
    );

    let err = client
        .remove(&format!("{dir}/moved"), false)
        .await
        .expect_err("not empty");
    assert_eq!(
        err.agent_error().expect("agent").message,
        format!("remove {dir}/moved: Directory not empty")
    );
    assert_eq!(err.agent_error().expect("agent").code, "ENOTEMPTY");
    client
        .remove(&format!("{dir}/moved"), true)
        .await
        .expect("remove -r");
    assert!(!std::path::Path::new(&format!("{dir}/moved")).exists());
    client
        .write_file(&format!("{dir}/file"), b"x")
        .await
        .expect("write");
    client
        .remove(&format!("{dir}/file"), false)
        .await
        .expect("remove file");
}

#[tokio::test]
async fn errors_say_path_and_errno_meaning() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let missing = agent.scratch("nope/x");
    let err = client.read_file(&missing).await.expect_err("missing");
    assert_eq!(
        err.agent_error().expect("agent").message,
        format!("open {missing}: No such file or directory")
    );
    let err = client
        .write_file(&missing, b"x")
        .await
        .expect_err("no parent");
    assert_eq!(
        err.agent_error().expect("agent").message,
        format!("open {missing}: No such file or directory")
    );
    let err = client.stat(&missing).await.expect_err("stat");
    assert_eq!(err.agent_error().expect("agent").code, "ENOENT");
    let err = client.list(&missing).await.expect_err("list");
    assert!(
        err.to_string()
            .contains(&format!("opendir {missing}: No such file or directory")),
        "{err}"
    );
    let err = client
        .mkdir(&agent.scratch("a/b/c"), false)
        .await
        .expect_err("mkdir without -p");
    assert!(
        err.to_string().contains("No such file or directory"),
        "{err}"
    );
    let err = client
        .read_file("relative/path")
        .await
        .expect_err("relative");
    assert!(
        err.to_string()
            .contains("\"relative/path\" is not absolute"),
        "{err}"
    );
    let dir = agent.scratch("");
    let err = client.read_file(&dir).await.expect_err("read a directory");
    assert!(err.to_string().contains("Is a directory"), "{err}");
    let err = client.remove("/", true).await.expect_err("remove /");
    assert!(err.to_string().contains("refusing"), "{err}");
    let err = client
        .rename(&missing, &agent.scratch("y"))
        .await
        .expect_err("rename missing");
    assert!(
        err.to_string().contains(&format!("rename {missing} -> ")),
        "{err}"
    );
}

/// FIFOs and sockets in a tree are left out of its download, which finishes: opening a FIFO
/// would block the agent, and a socket cannot be archived.
#[tokio::test]
async fn tar_download_leaves_out_fifos_and_sockets() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let src = agent.scratch("special");
    client
        .mkdir(&format!("{src}/sub"), true)
        .await
        .expect("mkdir");
    client
        .write_file(&format!("{src}/sub/kept.txt"), b"kept")
        .await
        .expect("write");
    let made = std::process::Command::new("mkfifo")
        .arg(format!("{src}/sub/fifo"))
        .status()
        .expect("run mkfifo");
    assert!(made.success(), "mkfifo: {made}");
    let _socket = std::os::unix::net::UnixListener::bind(format!("{src}/socket")).expect("bind");
    let archive = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        client.tar_download(&src),
    )
    .await
    .expect("the download finishes")
    .expect("tar download");
    let mut names: Vec<String> = tar::Archive::new(&archive[..])
        .entries()
        .expect("entries")
        .map(|e| {
            let name = e
                .expect("entry")
                .path()
                .expect("path")
                .display()
                .to_string();
            name.trim_start_matches("./")
                .trim_end_matches('/')
                .to_owned()
        })
        .collect();
    names.sort();
    assert_eq!(names, ["sub", "sub/kept.txt"]);
}

#[tokio::test]
async fn tar_download_and_upload_of_a_directory() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let src = agent.scratch("src");
    client
        .mkdir(&format!("{src}/sub/inner"), true)
        .await
        .expect("mkdir");
    client
        .write_file(&format!("{src}/top.txt"), b"top")
        .await
        .expect("write");
    let big = pattern(300_000);
    client
        .write_file(&format!("{src}/sub/inner/big.bin"), &big)
        .await
        .expect("write");
    std::os::unix::fs::symlink("top.txt", format!("{src}/link")).expect("symlink");
    let mut req = WriteFileRequest::new(format!("{src}/sub/run.sh"));
    req.mode = Some(0o755);
    client
        .write_file_from(req, &b"#!/bin/sh\n"[..])
        .await
        .expect("write exec");

    let archive = client.tar_download(&src).await.expect("tar download");
    let mut names = Vec::new();
    let mut tar = tar::Archive::new(&archive[..]);
    for entry in tar.entries().expect("entries") {
        let mut entry = entry.expect("entry");
        let name = entry.path().expect("path").display().to_string();
        if name.ends_with("big.bin") {
            let mut content = Vec::new();
            entry.read_to_end(&mut content).expect("read");
            assert_eq!(content, big);
        }
        names.push(name.trim_start_matches("./").to_owned());
    }
    for expected in ["top.txt", "link", "sub/inner/big.bin", "sub/run.sh"] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }

    let dst = agent.scratch("dst/nested");
    let bytes = client
        .tar_upload(&dst, &archive[..])
        .await
        .expect("tar upload");
    assert_eq!(bytes, archive.len() as u64);
    assert_eq!(
        std::fs::read(format!("{dst}/top.txt")).expect("read"),
        b"top"
    );
    assert_eq!(
        std::fs::read(format!("{dst}/sub/inner/big.bin")).expect("read"),
        big
    );
    assert_eq!(
        std::fs::read_link(format!("{dst}/link"))
            .expect("link")
            .display()
            .to_string(),
        "top.txt"
    );
    assert_eq!(
        std::fs::metadata(format!("{dst}/sub/run.sh"))
            .expect("meta")
            .permissions()
            .mode()
            & 0o777,
        0o755
    );

    // A single file downloads as a one-entry archive.
    let one = client
        .tar_download(&format!("{src}/top.txt"))
        .await
        .expect("tar of a file");
    let mut tar = tar::Archive::new(&one[..]);
    let names: Vec<String> = tar
        .entries()
        .expect("entries")
        .map(|e| {
            e.expect("entry")
                .path()
                .expect("path")
                .display()
                .to_string()
        })
        .collect();
    assert_eq!(names, ["top.txt"]);

    // Garbage is refused with a clear error and nothing is half-written outside the target.
    let err = client
        .tar_upload(&agent.scratch("bad"), &pattern(10_000)[..])
        .await
        .expect_err("not a tar");
    assert!(err.to_string().contains("unpack tar into"), "{err}");
    let err = client
        .tar_download(&agent.scratch("missing"))
        .await
        .expect_err("missing");
    assert!(
        err.to_string().contains("No such file or directory"),
        "{err}"
    );
}

#[tokio::test]
async fn watch_reports_writes_through_the_agent_and_ends_on_cancel() {
    use rollbox_agent_protocol::{
        ClientMessage, FsEvent, FsEventKind, ServerMessage, WatchRequest,
    };
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let dir = agent.scratch("watched");
    client.mkdir(&dir, true).await.expect("mkdir");
    let mut watch = client
        .watch(WatchRequest {
            path: dir.clone(),
            recursive: false,
            refuse_network_mounts: false,
        })
        .await
        .expect("watch");
    // The agent's atomic write makes a temporary file and renames it over the target.
    client
        .write_file(&format!("{dir}/note.txt"), b"hi")
        .await
        .expect("write");
    let want = FsEvent {
        name: "note.txt".into(),
        kind: FsEventKind::Create,
    };
    let mut seen = Vec::new();
    while !seen.contains(&want) {
        let reply = tokio::time::timeout(std::time::Duration::from_secs(10), watch.recv())
            .await
            .unwrap_or_else(|_| panic!("no {want:?} within 10 s; saw {seen:?}"))
            .expect("reply");
        match reply {
            ServerMessage::FsEvents { events } => seen.extend(events),
            other => panic!("unexpected {other:?}"),
        }
    }
    watch.send(ClientMessage::Cancel).await.expect("cancel");
    loop {
        match watch.recv().await.expect("reply") {
            ServerMessage::FsEvents { .. } => continue,
            ServerMessage::WatchEnded { reason } => {
                assert_eq!(reason, "cancelled");
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let err = client
        .watch(WatchRequest {
            path: format!("{dir}/note.txt"),
            recursive: false,
            refuse_network_mounts: false,
        })
        .await
        .expect_err("a plain file cannot be watched");
    assert!(
        err.to_string().contains("note.txt: Not a directory"),
        "{err}"
    );
}

/// E2B's writes: in place (a watch sees the file's own name written, never a temporary one),
/// given to an owner, with metadata that stat and list return and that a later write with an
/// empty map clears; and a watch that refuses network mounts still watches a local directory.
#[tokio::test]
async fn in_place_write_with_owner_and_metadata() {
    use rollbox_agent_protocol::{FsEventKind, ServerMessage, WatchRequest};
    use std::collections::BTreeMap;
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let dir = agent.scratch("in-place");
    client.mkdir(&dir, true).await.expect("mkdir");
    let mut watch = client
        .watch(WatchRequest {
            path: dir.clone(),
            recursive: false,
            refuse_network_mounts: true,
        })
        .await
        .expect("a local directory is watched even when network mounts are refused");
    let path = format!("{dir}/e2b.txt");
    let metadata = BTreeMap::from([("owner".to_string(), "alice".to_string())]);
    let mut req = WriteFileRequest::new(&path);
    req.atomic = false;
    req.owner = Some("0".into());
    req.metadata = Some(metadata.clone());
    let xattrs = client.write_file_from(req.clone(), &b"first"[..]).await;
    let supported = match xattrs {
        Ok(_) => true,
        // This host's scratch file system keeps no user xattrs (or we may not chown to 0).
        Err(e) => {
            eprintln!("skip the metadata part: {e}");
            req.metadata = None;
            req.owner = None;
            client
                .write_file_from(req.clone(), &b"first"[..])
                .await
                .expect("write in place");
            false
        }
    };
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|e: &rollbox_agent_protocol::FsEvent| e.kind == FsEventKind::Write)
    {
        let reply = tokio::time::timeout(std::time::Duration::from_secs(10), watch.recv())
            .await
            .unwrap_or_else(|_| panic!("no write within 10 s; saw {seen:?}"))
            .expect("reply");
        match reply {
            ServerMessage::FsEvents { events } => seen.extend(events),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(seen.iter().all(|e| e.name == "e2b.txt"), "{seen:?}");
    assert!(
        seen.iter().all(|e| e.kind != FsEventKind::Rename),
        "{seen:?}"
    );
    assert_eq!(std::fs::read(&path).expect("host read"), b"first");
    if supported {
        assert_eq!(client.stat(&path).await.expect("stat").metadata, metadata);
        let listed = client.list(&dir).await.expect("list");
        assert_eq!(listed[0].metadata, metadata);
        req.metadata = Some(BTreeMap::new());
        client
            .write_file_from(req.clone(), &b"second"[..])
            .await
            .expect("overwrite");
        assert!(client.stat(&path).await.expect("stat").metadata.is_empty());
    }
    req.owner = Some("no-such-user-rollbox".into());
    let err = client
        .write_file_from(req, &b"x"[..])
        .await
        .expect_err("an unknown owner");
    assert!(err.to_string().contains("no-such-user-rollbox"), "{err}");
}
