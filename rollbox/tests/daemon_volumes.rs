//! `rollbox serve` end to end, shared volumes: the volume routes and their refusals, files
//! read and written from the host, and 64 forks of a test-guest sandbox appending records to
//! one volume through the test guest's own FUSE client, each with its own virtiofsd; then a
//! kill -9 of the daemon and a restart that leaves no virtiofsd behind. The daemon's volumes
//! are `--volume-uid`'s and their virtiofsd runs as it; root-owned ones keep a root virtiofsd.
//! Tier 2 (the forks need /dev/kvm and virtiofsd: scripts/test.sh sets ROLLBOX_VIRTIOFSD).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rollbox_tests::daemon::{cmdline, console, pid_of, wait_for, HostAgent, Server, KEY};
use rollbox_tests::{kvm_available, rollbox_binary, skip, test_guest, TEST_GUEST_CMDLINE};
use serde_json::{json, Value};

const RECORDS: usize = 1000;
/// `fs-append`'s record: 16 hex digits of the writer's generation, a space, 6 digits, `\n`.
const RECORD_LEN: usize = 24;

/// `rollbox serve --volume-uid`'s default: who owns the volumes the daemon makes.
const VOLUME_UID: u32 = 64001;

/// Whether `pid` runs virtiofsd.
fn is_virtiofsd(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .and_then(|c| c.split(|b| *b == 0).next().map(<[u8]>::to_vec))
        .is_some_and(|arg0| arg0.ends_with(b"virtiofsd"))
}

/// The live virtiofsd processes a daemon recorded under `dir` (its state): in
/// `STATE/virtiofsd/ID`, a line `VOLUME PID START` per (sandbox, volume).
fn virtiofsd_under(dir: &std::path::Path) -> BTreeSet<u32> {
    std::fs::read_dir(dir.join("virtiofsd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.split(' ').nth(1)?.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .filter(|pid| is_virtiofsd(*pid))
        .collect()
}

/// `pids` and their virtiofsd children (with `--sandbox namespace`, virtiofsd forks the
/// process that serves).
fn with_children(pids: &BTreeSet<u32>) -> BTreeSet<u32> {
    let children = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| status_field(&s, "PPid:").parse::<u32>().ok())
                .is_some_and(|ppid| pids.contains(&ppid))
        })
        .filter(|pid| is_virtiofsd(*pid));
    pids.iter().copied().chain(children).collect()
}

/// The value of a `/proc/PID/status` line.
fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or("")
        .trim()
        .to_string()
}

/// The uids (real, effective, saved, fs) and gids of every one of `pids` and its children:
/// each must be `id` four times.
fn assert_runs_as(pids: &BTreeSet<u32>, id: u32) {
    let all = with_children(pids);
    assert!(
        all.len() > pids.len(),
        "virtiofsd forks its server: {all:?}"
    );
    let want = format!("{id}\t{id}\t{id}\t{id}");
    for pid in all {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        for key in ["Uid:", "Gid:"] {
            assert_eq!(status_field(&status, key), want, "virtiofsd {pid} {key}");
        }
    }
}

/// Whether `dir` is a mount point (in /proc/mounts).
fn mounted(dir: &std::path::Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
    let dir = dir.display().to_string();
    mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(dir.as_str()))
}

/// Unmounts a size-limited volume's file system if a failed test left it.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        if mounted(&self.0) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
}

fn status_and_error(
    server: &Server,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, String) {
    let (status, answer) = server.call(method, path, body);
    (status, answer["error"].as_str().unwrap_or("").to_string())
}

#[test]
fn volume_routes_files_and_refusals() {
    let server = Server::start(&[]);
    let (status, volume) = server.call("POST", "/volumes", Some(json!({"name": "traj"})));
    assert_eq!(status, 201, "{volume}");
    assert_eq!(volume["mounted_by"], json!([]));
    let host_dir = std::path::PathBuf::from(volume["host_path"].as_str().expect("host_path"));
    assert!(host_dir.is_dir(), "{volume}");
    let (status, error) =
        status_and_error(&server, "POST", "/volumes", Some(json!({"name": "traj"})));
    assert_eq!((status, error.contains("exists")), (409, true), "{error}");
    for (body, field) in [
        (json!({"name": "Bad Name"}), "name: "),
        (json!({"name": "x", "host_path": "relative"}), "host_path"),
        (
            json!({"name": "x", "host_path": "/"}),
            "host_path: / is not under a --volume-dir",
        ),
        (json!({"name": "x", "size": 1}), "size"),
    ] {
        let (status, error) = status_and_error(&server, "POST", "/volumes", Some(body.clone()));
        assert_eq!(status, 400, "{body}: {error}");
        assert!(error.contains(field), "{body}: {error}");
    }

    // Files from the host: written whole, read back, listed, archived.
    let put = server.raw(
        "PUT",
        "/volumes/traj/files?path=/runs/1/log.txt",
        Some(KEY),
        Some(b"step 1\n"),
    );
    assert_eq!(put.status, 201, "{}", String::from_utf8_lossy(&put.body));
    assert_eq!(
        std::fs::read(host_dir.join("runs/1/log.txt")).expect("on host"),
        b"step 1\n"
    );
    let get = server.raw(
        "GET",
        "/volumes/traj/files?path=runs/1/log.txt",
        Some(KEY),
        None,
    );
    assert_eq!((get.status, get.body.as_slice()), (200, &b"step 1\n"[..]));
    let (status, listing) = server.call("GET", "/volumes/traj/files?path=/runs", None);
    assert_eq!(status, 200, "{listing}");
    assert_eq!(listing["entries"][0]["name"], "1", "{listing}");
    assert_eq!(listing["entries"][0]["kind"], "dir", "{listing}");
    let tar = server.raw("GET", "/volumes/traj/tar", Some(KEY), None);
    assert_eq!(tar.status, 200);
    let names: Vec<String> = tar::Archive::new(tar.body.as_slice())
        .entries()
        .expect("tar")
        .map(|e| {
            e.expect("entry")
                .path()
                .expect("path")
                .display()
                .to_string()
        })
        .collect();
    assert!(
        names.iter().any(|n| n.ends_with("runs/1/log.txt")),
        "{names:?}"
    );

    // Nothing outside the volume is reached: `..`, and a symlink a guest could have made.
    let outside = tempfile::tempdir().expect("outside");
    std::fs::write(outside.path().join("secret"), "s").expect("secret");
    std::os::unix::fs::symlink(outside.path(), host_dir.join("out")).expect("symlink");
    for path in [
        "/volumes/traj/files?path=../etc/passwd",
        "/volumes/traj/files?path=out/secret",
    ] {
        let (status, error) = status_and_error(&server, "GET", path, None);
        assert_eq!(status, 400, "{path}: {error}");
        assert!(
            error.contains("leave") || error.contains("outside"),
            "{path}: {error}"
        );
    }
    let put = server.raw(
        "PUT",
        "/volumes/traj/files?path=out/x",
        Some(KEY),
        Some(b"x"),
    );
    assert_eq!(put.status, 400, "{}", String::from_utf8_lossy(&put.body));
    assert!(!outside.path().join("x").exists());
    // A size limit: an ext4 file system of that size under the volume's directory.
    let (status, small) = server.call(
        "POST",
        "/volumes",
        Some(json!({"name": "small", "size_limit_mib": 16})),
    );
    assert_eq!(status, 201, "{small}");
    assert_eq!(small["size_limit_mib"], 16);
    let small_dir = std::path::PathBuf::from(small["host_path"].as_str().expect("host_path"));
    let _unmount = Unmount(small_dir.clone());
    assert!(
        mounted(&small_dir),
        "{} is not a mount",
        small_dir.display()
    );
    let eight = vec![7u8; 8 << 20];
    let put = server.raw(
        "PUT",
        "/volumes/small/files?path=a.bin",
        Some(KEY),
        Some(&eight),
    );
    assert_eq!(put.status, 201, "{}", String::from_utf8_lossy(&put.body));
    let twelve = vec![9u8; 12 << 20];
    let put = server.raw(
        "PUT",
        "/volumes/small/files?path=b.bin",
        Some(KEY),
        Some(&twelve),
    );
    let answer = String::from_utf8_lossy(&put.body);
    assert_eq!(put.status, 409, "{answer}");
    assert!(answer.contains("full"), "{answer}");
    assert_eq!(
        std::fs::read(small_dir.join("a.bin")).expect("a.bin"),
        eight
    );
    assert!(!small_dir.join("b.bin").exists(), "no partial file is left");
    assert_eq!(server.call("DELETE", "/volumes/small", None).0, 204);
    assert!(!mounted(&small_dir), "unmounted with its volume");
    assert!(!small_dir.exists());

    let (status, _) = status_and_error(&server, "GET", "/volumes/traj/files?path=nope", None);
    assert_eq!(status, 404);
    let (status, error) = status_and_error(&server, "GET", "/volumes/nope", None);
    assert_eq!((status, error.as_str()), (404, "no volume nope"));

    // Mounts a create names: the volume must exist, the mount point be one.
    server.call(
        "POST",
        "/templates",
        Some(json!({"name": "guest", "kernel": test_guest(), "memory_mib": 32})),
    );
    for (volumes, field) in [
        (
            json!([{"name": "nope", "mount_path": "/data"}]),
            "volumes[0].name: no volume",
        ),
        (
            json!([{"name": "traj", "mount_path": "data"}]),
            "volumes[0].mount_path",
        ),
        (
            json!([{"name": "traj", "mount_path": "/a"}, {"name": "traj", "mount_path": "/b"}]),
            "volumes[1].name",
        ),
        (
            json!([{"name": "traj", "mount_path": "/a", "rw": true}]),
            "rw",
        ),
    ] {
        let body = json!({"template": "guest", "ttl_s": 60, "volumes": volumes});
        let (status, error) = status_and_error(&server, "POST", "/sandboxes", Some(body));
        assert_eq!(status, 400, "{volumes}: {error}");
        assert!(error.contains(field), "{volumes}: {error}");
    }

    // A tenant sees its own volumes only; another's is as unknown as a missing one.
    let (status, made) = server.call("POST", "/keys", Some(json!({"tenant": "team-a"})));
    assert_eq!(status, 201, "{made}");
    let tenant = made["key"].as_str().expect("key").to_string();
    let as_tenant = |method: &str, path: &str, body: Option<&str>| {
        let r = server.raw(method, path, Some(&tenant), body.map(str::as_bytes));
        (
            r.status,
            serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null),
        )
    };
    assert_eq!(as_tenant("GET", "/volumes/traj", None).0, 404);
    assert_eq!(as_tenant("GET", "/volumes", None).1, json!({"volumes": []}));
    assert_eq!(
        as_tenant("POST", "/volumes", Some(r#"{"name":"mine"}"#)).0,
        201
    );
    let (status, _) = as_tenant(
        "POST",
        "/volumes",
        Some(r#"{"name":"x","host_path":"/tmp"}"#),
    );
    assert_eq!(status, 403);
    let (status, body) = server.call("GET", "/volumes", None);
    assert_eq!(status, 200);
    let names: Vec<&str> = body["volumes"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["mine", "traj"]);

    let (status, _) = server.call("DELETE", "/volumes/traj", None);
    assert_eq!(status, 204);
    assert!(!host_dir.exists(), "a state-dir volume's files go with it");
    assert_eq!(server.call("DELETE", "/volumes/traj", None).0, 404);
}

#[test]
fn sixty_four_forks_append_to_one_volume_and_a_restart_leaves_no_virtiofsd() {
    const TEST: &str = "sixty_four_forks_append_to_one_volume_and_a_restart_leaves_no_virtiofsd";
    if !kvm_available() {
        return;
    }
    if std::env::var_os("ROLLBOX_VIRTIOFSD").is_none() {
        skip(TEST, "ROLLBOX_VIRTIOFSD is not set (scripts/virtiofsd.sh builds virtiofsd and prints its path)");
        return;
    }
    let clones: u32 = std::env::var("ROLLBOX_DAEMON_VOLUME_FORKS").map_or(64, |v| {
        v.parse().expect("ROLLBOX_DAEMON_VOLUME_FORKS is a count")
    });
    let mut server = Server::start(&[]);
    // The guest runs `fs-init`, then waits to be a clone and appends as itself.
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "writer",
            "kernel": test_guest(),
            "cmdline": format!("{TEST_GUEST_CMDLINE} rollbox.test.run=fs-init;fs-append-clone:{RECORDS}"),
            "memory_mib": 32,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let (status, volume) = server.call("POST", "/volumes", Some(json!({"name": "traj"})));
    assert_eq!(status, 201, "{volume}");
    let started = Instant::now();
    let parent = server.create(json!({
        "template": "writer",
        "ttl_s": 900,
        "volumes": [{"name": "traj", "mount_path": "/data"}],
    }));
    let created = started.elapsed();
    let parent_id = parent["id"].as_str().expect("id").to_string();
    assert_eq!(
        parent["volumes"],
        json!([{"name": "traj", "mount_path": "/data", "readonly": false}])
    );
    assert_eq!(
        virtiofsd_under(&server.state()).len(),
        1,
        "the parent's virtiofsd"
    );
    // The daemon's volume is --volume-uid's, and its virtiofsd runs as it, not as root.
    let host_dir = std::path::PathBuf::from(volume["host_path"].as_str().expect("host_path"));
    let owner = |path: &std::path::Path| {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path).expect("stat");
        (meta.uid(), meta.gid())
    };
    assert_eq!(owner(&host_dir), (VOLUME_UID, VOLUME_UID));
    assert_runs_as(&virtiofsd_under(&server.state()), VOLUME_UID);
    wait_for("the guest's FUSE session", Duration::from_secs(60), || {
        console(&parent).contains("OK 7.")
    });
    let (status, error) = status_and_error(&server, "DELETE", "/volumes/traj", None);
    assert_eq!(status, 409, "{error}");
    assert!(error.contains(&parent_id), "{error}");

    let started = Instant::now();
    let (status, forked) = server.call(
        "POST",
        &format!("/sandboxes/{parent_id}/fork"),
        Some(json!({"count": clones})),
    );
    let fork_s = started.elapsed().as_secs_f64();
    assert_eq!(status, 200, "{forked}\n{}", server.log_tail());
    let results = forked["results"].as_array().expect("results");
    let sandboxes: Vec<Value> = results
        .iter()
        .map(|r| {
            assert!(r["error"].is_null(), "{r}");
            r["sandbox"].clone()
        })
        .collect();
    assert_eq!(sandboxes.len(), clones as usize);
    for sandbox in &sandboxes {
        assert_eq!(sandbox["volumes"], parent["volumes"], "{sandbox}");
    }
    assert_eq!(
        virtiofsd_under(&server.state()).len(),
        clones as usize + 1,
        "one virtiofsd per (sandbox, volume)"
    );
    let mut writers = BTreeSet::new();
    for sandbox in &sandboxes {
        wait_for("a clone's records", Duration::from_secs(600), || {
            console(sandbox).contains("OK appended") || console(sandbox).contains("ERR")
        });
        let text = console(sandbox);
        let line = text
            .lines()
            .find(|l| l.starts_with("OK appended") || l.starts_with("ERR"))
            .unwrap_or("");
        let generation = line
            .strip_prefix(&format!("OK appended {RECORDS} as 0x"))
            .unwrap_or_else(|| panic!("{}: {line}", sandbox["id"]));
        assert!(
            writers.insert(generation.to_string()),
            "generation {generation} twice"
        );
    }
    let appended_s = started.elapsed().as_secs_f64();
    assert!(
        !console(&parent).contains("OK appended"),
        "the parent appends nothing"
    );

    // From the host, through the API: one file per writer and every record once in common.
    let (status, listing) = server.call("GET", "/volumes/traj/files?path=/", None);
    assert_eq!(status, 200, "{listing}");
    let files: BTreeSet<String> = listing["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["name"].as_str().map(str::to_string))
        .collect();
    let mut want: BTreeSet<String> = writers.iter().map(|w| format!("{w}.log")).collect();
    want.insert("common".into());
    assert_eq!(files, want);
    let common = server.raw("GET", "/volumes/traj/files?path=common", Some(KEY), None);
    assert_eq!(common.status, 200);
    assert_eq!(
        common.body.len(),
        writers.len() * RECORDS * RECORD_LEN,
        "common's size"
    );
    let mut seen: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
    for line in String::from_utf8(common.body).expect("text").lines() {
        let (writer, seq) = line
            .split_once(' ')
            .unwrap_or_else(|| panic!("torn: {line:?}"));
        assert!(writers.contains(writer), "a record of no writer: {line:?}");
        let seq: usize = seq.parse().unwrap_or_else(|_| panic!("torn: {line:?}"));
        assert!(
            seen.entry(writer.to_string()).or_default().insert(seq),
            "twice: {line:?}"
        );
    }
    assert!(seen.values().all(|s| s.len() == RECORDS));
    // What the guests' root wrote is the volume uid's on the host.
    assert_eq!(owner(&host_dir.join("common")), (VOLUME_UID, VOLUME_UID));
    eprintln!(
        "figure: daemon create with a volume {:.0} ms; fork into {clones} (a virtiofsd each) {fork_s:.2} s; {} writers x {RECORDS} records on one volume {appended_s:.1} s after the fork began ({:.0} records/s)",
        created.as_secs_f64() * 1000.0,
        writers.len(),
        (writers.len() * RECORDS) as f64 / appended_s,
    );

    // kill -9 of the daemon: the virtiofsd processes serve on; the restarted daemon watches
    // them, and ends each with its sandbox.
    server.kill9();
    assert_eq!(virtiofsd_under(&server.state()).len(), clones as usize + 1);
    let every = with_children(&virtiofsd_under(&server.state()));
    server.spawn();
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{parent_id}"), None);
    assert_eq!(status, 204);
    for sandbox in &sandboxes {
        let id = sandbox["id"].as_str().expect("id");
        assert_eq!(
            server.call("DELETE", &format!("/sandboxes/{id}"), None).0,
            204
        );
    }
    wait_for("every virtiofsd to end", Duration::from_secs(30), || {
        virtiofsd_under(&server.state()).is_empty() && !every.iter().any(|p| is_virtiofsd(*p))
    });
    assert_eq!(server.call("DELETE", "/volumes/traj", None).0, 204);
}

#[test]
fn a_template_with_a_volume_gives_restored_sandboxes_that_mount_it() {
    const TEST: &str = "a_template_with_a_volume_gives_restored_sandboxes_that_mount_it";
    const WRITERS: usize = 8;
    const FEW: usize = 100;
    if !kvm_available() {
        return;
    }
    if std::env::var_os("ROLLBOX_VIRTIOFSD").is_none() {
        skip(TEST, "ROLLBOX_VIRTIOFSD is not set (scripts/virtiofsd.sh builds virtiofsd and prints its path)");
        return;
    }
    // The boot snapshot waits for an agent: a host agent stands in for the guest's.
    let agent = HostAgent::start();
    let server = Server::start(&["--test-agent-socket", &agent.sock.display().to_string()]);
    let (status, volume) = server.call("POST", "/volumes", Some(json!({"name": "traj"})));
    assert_eq!(status, 201, "{volume}");
    let mounts = json!([{"name": "traj", "mount_path": "/data", "readonly": false}]);
    let (status, template) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "writer",
            "kernel": test_guest(),
            "cmdline": format!("{TEST_GUEST_CMDLINE} rollbox.test.run=fs-init;fs-append-clone:{FEW}"),
            "memory_mib": 32,
            "boot_snapshot": true,
            "volumes": mounts,
        })),
    );
    assert_eq!(status, 201, "{template}\n{}", server.log_tail());
    assert_eq!(template["volumes"], mounts);
    let (status, error) = status_and_error(
        &server,
        "POST",
        "/templates",
        Some(
            json!({"name": "other", "kernel": test_guest(), "volumes": [{"name": "nope", "mount_path": "/d"}]}),
        ),
    );
    assert_eq!(status, 400, "{error}");
    assert!(error.starts_with("volumes[0].name: no volume"), "{error}");
    // The file the writers append to, made from the host: the volume uid's, so the guests'
    // root (that uid to their virtiofsd) may append to it.
    let put = server.raw(
        "PUT",
        "/volumes/traj/files?path=common",
        Some(KEY),
        Some(b""),
    );
    assert_eq!(put.status, 201, "{}", String::from_utf8_lossy(&put.body));

    // A batch of creates from the template: restores of its boot snapshot, each with the
    // volume (a virtiofsd of its own) and a new generation, so each appends as itself.
    let (status, batch) = server.call(
        "POST",
        "/sandboxes/batch",
        Some(json!({"template": "writer", "count": WRITERS, "ttl_s": 300})),
    );
    assert_eq!(status, 200, "{batch}\n{}", server.log_tail());
    let sandboxes: Vec<Value> = batch["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| {
            assert!(r["error"].is_null(), "{r}");
            r["sandbox"].clone()
        })
        .collect();
    let mut writers = BTreeSet::new();
    for sandbox in &sandboxes {
        assert_eq!(sandbox["volumes"], mounts, "{sandbox}");
        let (pid, _) = pid_of(sandbox);
        assert!(
            cmdline(pid).contains("--restore"),
            "a restore: {}",
            cmdline(pid)
        );
        let deadline = Instant::now() + Duration::from_secs(120);
        while !(console(sandbox).contains("OK appended") || console(sandbox).contains("ERR")) {
            assert!(
                Instant::now() < deadline,
                "{}: no records; its console: {}\n{}",
                sandbox["id"],
                console(sandbox),
                server.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = console(sandbox);
        let generation = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("OK appended {FEW} as 0x")))
            .unwrap_or_else(|| panic!("{}: {text}", sandbox["id"]))
            .to_string();
        assert!(
            writers.insert(generation),
            "two writers with one generation"
        );
    }
    assert_eq!(virtiofsd_under(&server.state()).len(), WRITERS);
    let common = server.raw("GET", "/volumes/traj/files?path=common", Some(KEY), None);
    assert_eq!(
        common.body.len(),
        WRITERS * FEW * RECORD_LEN,
        "common's size"
    );

    // The volume goes only after its template.
    let (status, error) = status_and_error(&server, "DELETE", "/volumes/traj", None);
    assert_eq!(status, 409, "{error}");
    assert!(error.contains("template writer"), "{error}");
    for sandbox in &sandboxes {
        let id = sandbox["id"].as_str().expect("id");
        assert_eq!(
            server.call("DELETE", &format!("/sandboxes/{id}"), None).0,
            204
        );
    }
    assert_eq!(server.call("DELETE", "/templates/writer", None).0, 204);
    assert_eq!(server.call("DELETE", "/volumes/traj", None).0, 204);
    drop(agent);
}

#[test]
fn root_owned_volumes_keep_a_root_virtiofsd() {
    const TEST: &str = "root_owned_volumes_keep_a_root_virtiofsd";
    const FEW: usize = 100;
    if !kvm_available() {
        return;
    }
    if std::env::var_os("ROLLBOX_VIRTIOFSD").is_none() {
        skip(TEST, "ROLLBOX_VIRTIOFSD is not set (scripts/virtiofsd.sh builds virtiofsd and prints its path)");
        return;
    }
    let admin = tempfile::tempdir().expect("tempdir");
    let admin_dir = admin.path().canonicalize().expect("canonical").join("data");
    std::fs::create_dir(&admin_dir).expect("mkdir");
    let server = Server::start(&["--volume-dir", &admin.path().display().to_string()]);
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "writer",
            "kernel": test_guest(),
            "cmdline": format!("{TEST_GUEST_CMDLINE} rollbox.test.run=fs-init;fs-append:{FEW}"),
            "memory_mib": 32,
        })),
    );
    assert_eq!(status, 201, "{body}");
    // An admin's root-owned directory, and a volume as an older daemon made it (root's).
    let (status, body) = server.call(
        "POST",
        "/volumes",
        Some(json!({"name": "admin", "host_path": admin_dir})),
    );
    assert_eq!(status, 201, "{body}");
    let (status, old) = server.call("POST", "/volumes", Some(json!({"name": "old"})));
    assert_eq!(status, 201, "{old}");
    let old_dir = std::path::PathBuf::from(old["host_path"].as_str().expect("host_path"));
    std::os::unix::fs::chown(&old_dir, Some(0), Some(0)).expect("chown");
    for (name, dir) in [("admin", &admin_dir), ("old", &old_dir)] {
        let sandbox = server.create(json!({
            "template": "writer",
            "ttl_s": 300,
            "volumes": [{"name": name, "mount_path": "/data"}],
        }));
        wait_for("the guest's records", Duration::from_secs(60), || {
            console(&sandbox).contains("OK appended") || console(&sandbox).contains("ERR")
        });
        assert!(
            console(&sandbox).contains(&format!("OK appended {FEW} as 0x")),
            "{name}: {}",
            console(&sandbox)
        );
        let recorded = std::fs::read_to_string(
            server
                .state()
                .join("virtiofsd")
                .join(sandbox["id"].as_str().expect("id")),
        )
        .expect("its record");
        let pids: BTreeSet<u32> = recorded
            .lines()
            .filter_map(|l| l.split(' ').nth(1)?.parse().ok())
            .collect();
        assert_eq!(pids.len(), 1, "{recorded}");
        assert_runs_as(&pids, 0);
        let common = server.raw(
            "GET",
            &format!("/volumes/{name}/files?path=common"),
            Some(KEY),
            None,
        );
        assert_eq!(common.status, 200);
        assert_eq!(common.body.len(), FEW * RECORD_LEN, "{name}: common's size");
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(dir.join("common")).expect("stat");
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "{name}: root's");
        let id = sandbox["id"].as_str().expect("id");
        assert_eq!(
            server.call("DELETE", &format!("/sandboxes/{id}"), None).0,
            204
        );
    }
}

/// Volumes owned by the jails' uid would let a jailed VMM own their virtiofsd: refused.
#[test]
fn serve_refuses_the_jails_uid_for_volumes() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let log = scratch.path().join("serve.log");
    let mut serve = std::process::Command::new(rollbox_binary())
        .arg("serve")
        .arg("--socket")
        .arg(scratch.path().join("d.sock"))
        .arg("--state-dir")
        .arg(scratch.path().join("state"))
        .args(["--jail-uid", "64000", "--volume-uid", "64000"])
        .env("ROLLBOX_API_KEY", KEY)
        .stdin(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("run rollbox serve");
    // It must end at once; one that serves is killed and the test fails.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = serve.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = serve.kill();
            let _ = serve.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.is_some_and(|s| !s.success()), "{status:?}: {text}");
    assert!(
        text.contains("--volume-uid 64000 is the jails' uid"),
        "{text}"
    );
}
