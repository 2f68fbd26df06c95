//! A process's output flooding E2B streams whose clients do not read (issue 25): the daemon's
//! memory stays bounded (each stream's queue is bounded and the pump waits for room, which
//! holds the agent back), a real request is still answered within a second, and the processes
//! can be killed (a stream that takes nothing is dropped at the stall deadline). A module of
//! e2b.rs (its daemon and request helpers).

use std::time::{Duration, Instant};

use rollbox::daemon::client::{Endpoint, Streaming};
use rollbox_tests::daemon::{peak_rss_kib_over_4_s, read_until_full, rss_kib};
use rollbox_tests::kvm_available;
use serde_json::{json, Value};

use super::security::data_plane;
use super::{e2b_call, start_daemon};

/// One uncompressed Connect envelope around `message`.
fn envelope(message: &Value) -> Vec<u8> {
    let payload = message.to_string().into_bytes();
    let length = u32::try_from(payload.len()).expect("a small message");
    [&[0u8][..], &length.to_be_bytes(), &payload].concat()
}

#[test]
fn e2b_process_flood_to_a_client_that_does_not_read_keeps_daemon_memory_bounded() {
    if !kvm_available() {
        return;
    }
    let (daemon, port) = start_daemon(tempfile::tempdir().expect("tempdir"), None, &[]);
    let pid = daemon.children[1].id();
    let (status, created) = e2b_call(
        port,
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"guest","timeout":300}"#),
    );
    assert_eq!(status, 201, "{created}\n{}", daemon.log());
    let id = created["sandboxID"]
        .as_str()
        .expect("sandboxID")
        .to_string();
    let envd = created["envdAccessToken"]
        .as_str()
        .expect("envdAccessToken")
        .to_string();
    let rpc = |method: &str, body: Value| {
        let body = body.to_string();
        let answer = data_plane(
            port,
            &id,
            49983,
            "POST",
            &format!("/process.Process/{method}"),
            &[
                ("X-Access-Token", &envd),
                ("Content-Type", "application/json"),
            ],
            Some((&mut body.as_bytes(), body.len() as u64)),
        );
        let value: Value = serde_json::from_slice(&answer.body).unwrap_or(Value::Null);
        assert_eq!(answer.status, 200, "{method}: {value}\n{}", daemon.log());
        value
    };
    let line = "x".repeat(4000);
    let before = rss_kib(pid);
    // Four floods whose clients read the answer's head and then nothing.
    let mut stuck: Vec<Streaming> = (0..4)
        .map(|i| {
            let start = json!({
                "process": { "cmd": "yes", "args": [line] },
                "tag": format!("flood-{i}"),
                "stdin": false,
            });
            let body = envelope(&start);
            Endpoint::Tcp(format!("127.0.0.1:{port}"))
                .open(
                    "POST",
                    "/process.Process/Start",
                    &[
                        ("E2b-Sandbox-Id", &id),
                        ("E2b-Sandbox-Port", "49983"),
                        ("X-Access-Token", &envd),
                        ("Content-Type", "application/connect+json"),
                    ],
                    Some((&mut body.as_slice(), body.len() as u64)),
                    Duration::from_secs(30),
                )
                .expect("Start")
        })
        .collect();
    // The queues fill within the first seconds (later on a loaded host); after that, bounded
    // memory stays flat while an unbounded queue grows with the flood (tens of MiB a second).
    // So: 8 s to fill, then growth over the next 4 s.
    std::thread::sleep(Duration::from_secs(8));
    let filled = rss_kib(pid);
    let peak = peak_rss_kib_over_4_s(pid, filled);
    let grown_mib = peak.saturating_sub(before) / 1024;
    let grown_late_mib = peak.saturating_sub(filled) / 1024;
    println!("daemon VmRSS {before} KiB before four floods, {filled} KiB after 8 s, peak {peak} KiB after 12 s");
    // Proof the floods ran: a stalled stream still yields output once read.
    let first = &mut stuck[0];
    assert_eq!(first.status, 200, "Start answered {}", first.status);
    let mut head = vec![0u8; 256 << 10];
    let got = read_until_full(first, &mut head);
    let text = String::from_utf8_lossy(&head[..got]);
    assert!(
        text.contains("\"stdout\"") && got == head.len(),
        "the flood did not run: {got} bytes: {}\n{}",
        text.chars().take(400).collect::<String>(),
        daemon.log()
    );
    assert!(
        grown_mib < 64 && grown_late_mib < 12,
        "the daemon grew by {grown_mib} MiB ({grown_late_mib} MiB after the first 8 s) holding output for clients that do not read\n{}",
        daemon.log()
    );
    // The daemon still answers at once, the floods still running.
    let asked = Instant::now();
    let listed = rpc("List", json!({}));
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "List took {:?}",
        asked.elapsed()
    );
    let running = listed["processes"].as_array().map_or(0, Vec::len);
    assert_eq!(running, 4, "{listed}");
    // Killed while their clients still read nothing: the pumps drop the stuck streams at the
    // stall deadline (30 s) and reach the exits.
    for i in 0..4 {
        let tag = format!("flood-{i}");
        rpc(
            "SendSignal",
            json!({ "process": { "tag": tag }, "signal": "SIGNAL_SIGKILL" }),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(75);
    loop {
        let listed = rpc("List", json!({}));
        if listed["processes"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "killed floods still run after 75 s: {listed}\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(stuck);
}
