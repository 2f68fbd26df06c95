//! `rollbox serve` under load and under `kill -9` (tier 2: the real `rollbox` and `rollbox-vmm`
//! binaries, the test guest on /dev/kvm): 1,000 create/delete cycles leak nothing, and a daemon
//! killed while creates are in flight loses and leaks nothing once restarted.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rollbox::daemon::vm;
use rollbox_tests::daemon::leaks::{children_of, fds, ids, interfaces, tree};
use rollbox_tests::daemon::{wait_for, Server};
use rollbox_tests::kvm_available;
use serde_json::{json, Value};

/// Create/delete cycles of the load test and how many run at once.
const CYCLES: usize = 1000;
const LOAD_CONCURRENCY: usize = 8;
/// Fds the daemon may hold beyond its count before the cycles (tokio and SQLite may open a
/// few lazily).
const FD_SLACK: usize = 4;
/// Room for every create of the load (the daemon's default limit is lower).
const SERVE_FLAGS: &[&str] = &["--max-pending-creates", "1000"];

#[test]
fn thousand_create_delete_cycles_leak_nothing() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(SERVE_FLAGS);
    let snapshot = server.guest_snapshot();
    let body = json!({"snapshot": snapshot, "ttl_s": 300, "labels": {"load": "1"}});
    // One cycle first: whatever the daemon opens once (thread pools, SQLite pages) is open.
    let cycle = |n: usize| {
        let (status, sandbox) = server.call("POST", "/sandboxes", Some(body.clone()));
        assert_eq!(status, 201, "create {n}: {sandbox}\n{}", server.log_tail());
        let id = sandbox["id"].as_str().expect("id").to_string();
        let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "delete {id}: {body}");
    };
    cycle(0);
    let daemon = server.pid();
    let fds_before = fds(daemon);
    let tree_before = tree(&server.state());
    let interfaces_before = interfaces();

    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..LOAD_CONCURRENCY {
            scope.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= CYCLES {
                    return;
                }
                cycle(n + 1);
            });
        }
    });
    let took = started.elapsed();
    eprintln!(
        "{CYCLES} create/delete cycles ({LOAD_CONCURRENCY} at once) in {:.1} s: {:.0} cycles/s",
        took.as_secs_f64(),
        CYCLES as f64 / took.as_secs_f64()
    );

    // Nothing live in the DB, no VMM, no child (zombies included), no directory.
    for state in ["creating", "running", "paused"] {
        assert!(
            server.list(state).is_empty(),
            "sandboxes left {state}: {:?}",
            ids(&server.list(state))
        );
    }
    let (_, deleted) = server.call(
        "GET",
        "/sandboxes?state=deleted&label=load%3D1&limit=1",
        None,
    );
    assert!(deleted["next_page_token"].is_string(), "{deleted}");
    assert!(server.vmms().is_empty(), "VMMs left: {:?}", server.vmms());
    // The daemon reaps a deleted sandbox's VMM before DELETE answers.
    assert!(
        children_of(daemon).is_empty(),
        "children of the daemon left: {:?}",
        children_of(daemon)
    );
    assert!(
        server.dirs().is_empty(),
        "directories left: {:?}",
        server.dirs()
    );
    assert_eq!(tree(&server.state()), tree_before, "files in the state dir");
    // Taps of rollbox sandboxes are named rbx…; other interfaces come and go with other
    // work on a shared host.
    let new_taps: Vec<String> = interfaces()
        .difference(&interfaces_before)
        .filter(|name| name.starts_with("rbx"))
        .cloned()
        .collect();
    assert!(new_taps.is_empty(), "tap devices left: {new_taps:?}");
    let fds_after = fds(daemon);
    let sockets = |fds: &[String]| fds.iter().filter(|f| f.starts_with("socket:")).count();
    assert!(
        fds_after.len() <= fds_before.len() + FD_SLACK,
        "the daemon held {} fds before the cycles and {} after:\nbefore {fds_before:?}\nafter {fds_after:?}",
        fds_before.len(),
        fds_after.len()
    );
    assert!(
        sockets(&fds_after) <= sockets(&fds_before) + FD_SLACK,
        "sockets: before {fds_before:?}\nafter {fds_after:?}"
    );
}

/// A create of one sandbox per element, all at once: 201s' ids and how many were in flight
/// (sent, never answered) when the daemon died. The batch route replaces this body with one
/// `POST /sandboxes/batch` once the daemon has it.
fn create_batch(server: &Server, specs: &[Value]) -> (Vec<String>, usize) {
    let made = Mutex::new(Vec::new());
    let in_flight = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for spec in specs {
            let (made, in_flight) = (&made, &in_flight);
            scope.spawn(
                move || match server.try_call("POST", "/sandboxes", Some(spec)) {
                    Ok(response) if response.status == 201 => {
                        let sandbox: Value =
                            serde_json::from_slice(&response.body).expect("sandbox JSON");
                        let id = sandbox["id"].as_str().expect("id").to_string();
                        made.lock().expect("lock").push(id);
                    }
                    Ok(_) => {}
                    Err(e) if !e.is_connect() => {
                        in_flight.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {}
                },
            );
        }
    });
    (
        made.into_inner().expect("lock"),
        in_flight.load(Ordering::Relaxed),
    )
}

/// Checks a freshly restarted daemon: every sandbox the DB calls live runs (GET, pause,
/// resume) or is marked failed/exited with its VMM gone; no VMM or directory of no live
/// sandbox. The live ids.
fn check_after_restart(server: &Server, answered: &BTreeSet<String>) -> BTreeSet<String> {
    assert!(
        server.list("creating").is_empty(),
        "a create is stuck after the restart"
    );
    let running = server.list("running");
    let paused = server.list("paused");
    assert!(paused.is_empty(), "nothing was paused: {paused:?}");
    let running_ids = ids(&running);
    let lost: Vec<&String> = answered.difference(&running_ids).collect();
    assert!(
        lost.is_empty(),
        "created (201) before the kill but not running after the restart: {lost:?}\n{}",
        server.log_tail()
    );
    for sandbox in &running {
        let id = sandbox["id"].as_str().expect("id");
        let pid = u32::try_from(sandbox["pid"].as_u64().expect("pid")).expect("pid");
        let start = sandbox["pid_start_time"].as_u64().expect("start time");
        assert!(vm::is_ours(pid, start), "running {sandbox} has no VMM");
        let (status, got) = server.call("GET", &format!("/sandboxes/{id}"), None);
        assert_eq!((status, got["state"].as_str()), (200, Some("running")));
        let (status, got) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
        assert_eq!(
            (status, got["state"].as_str()),
            (200, Some("paused")),
            "{got}"
        );
        let (status, got) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
        assert_eq!(
            (status, got["state"].as_str()),
            (200, Some("running")),
            "{got}"
        );
    }
    let vmm_ids: BTreeSet<String> = server.vmms().into_iter().map(|f| f.id).collect();
    for state in ["failed", "exited"] {
        for sandbox in server.list(state) {
            let id = sandbox["id"].as_str().expect("id");
            assert!(!vmm_ids.contains(id), "{state} {id} still has a VMM");
            let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
            assert!(!dir.exists(), "{state} {id} still has {}", dir.display());
            assert!(
                sandbox["end_reason"]
                    .as_str()
                    .is_some_and(|r| !r.is_empty()),
                "{sandbox}"
            );
        }
    }
    assert_eq!(vmm_ids, running_ids, "VMMs of no live sandbox (or lost)");
    assert_eq!(server.dirs(), running_ids, "directories of no live sandbox");
    running_ids
}

#[test]
fn kill_9_mid_batch_then_restart_repeatedly_loses_and_leaks_nothing() {
    if !kvm_available() {
        return;
    }
    let mut server = Server::start(SERVE_FLAGS);
    let snapshot = server.guest_snapshot();
    let mut live = BTreeSet::new();
    let mut in_flight_total = 0;
    // Kill delays after the batch started: early (most creates in flight), middle, late.
    for (round, delay_ms) in [40u64, 150, 400, 900].into_iter().enumerate() {
        // Restores and boots, so both create paths are cut mid-way.
        let specs: Vec<Value> = (0..24)
            .map(|i| {
                let key = format!("r{round}-{i}");
                if i % 4 == 0 {
                    json!({"template": "guest", "ttl_s": 600, "idempotency_key": key})
                } else {
                    json!({"snapshot": snapshot, "ttl_s": 600, "idempotency_key": key})
                }
            })
            .collect();
        let done = AtomicBool::new(false);
        let (answered, in_flight, finished_before_kill) = std::thread::scope(|scope| {
            let batch = scope.spawn(|| {
                let result = create_batch(&server, &specs);
                done.store(true, Ordering::Relaxed);
                result
            });
            std::thread::sleep(Duration::from_millis(delay_ms));
            let pid = server.pid();
            let finished = done.load(Ordering::Relaxed);
            // SIGKILL from outside, like an OOM kill: the daemon gets no chance to clean up.
            // SAFETY: kill only sends a signal, to the daemon this test started.
            unsafe { libc::kill(i32::try_from(pid).expect("pid"), libc::SIGKILL) };
            let (answered, in_flight) = batch.join().expect("batch thread");
            (answered, in_flight, finished)
        });
        server.kill9();
        in_flight_total += in_flight;
        eprintln!(
            "round {round}: kill -9 after {delay_ms} ms: {} created, {in_flight} in flight{}",
            answered.len(),
            if finished_before_kill {
                " (the batch had finished)"
            } else {
                ""
            }
        );
        server.spawn();
        let answered: BTreeSet<String> = answered.into_iter().collect();
        live = check_after_restart(&server, &answered.union(&live).cloned().collect());
        eprintln!("round {round}: after the restart {} running", live.len());
    }
    assert!(
        in_flight_total > 0,
        "no create was in flight at any kill: the test did not test the crash"
    );
    // Then everything goes cleanly.
    for id in &live {
        let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "{body}");
    }
    wait_for("no VMM left", Duration::from_secs(10), || {
        server.vmms().is_empty()
    });
    assert!(server.dirs().is_empty(), "{:?}", server.dirs());
}
