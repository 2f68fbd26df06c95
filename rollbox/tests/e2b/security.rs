//! The E2B data plane as a security boundary (issue 25): tokens before lookups, traffic
//! tokens for other ports, what forwards carry, streamed uploads and ListDir's cap. A module of
//! e2b.rs (its daemon and request helpers).

use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use rollbox_tests::kvm_available;
use serde_json::json;

use super::{e2b_call, native_call, start_daemon, KEY};

/// A request to the E2B data plane of sandbox `id`, routed by the SDK's `E2b-Sandbox-*`
/// headers, with a body of `length` bytes from `body`.
pub(super) fn data_plane(
    port: u16,
    id: &str,
    sandbox_port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&mut dyn std::io::Read, u64)>,
) -> rollbox::daemon::client::Response {
    let sandbox_port = sandbox_port.to_string();
    let mut all = vec![
        ("E2b-Sandbox-Id", id),
        ("E2b-Sandbox-Port", sandbox_port.as_str()),
    ];
    all.extend_from_slice(headers);
    Endpoint::Tcp(format!("127.0.0.1:{port}"))
        .open(method, path, &all, body, Duration::from_secs(120))
        .and_then(|streaming| streaming.into_response())
        .unwrap_or_else(|e| panic!("{method} {path} of {id}:{sandbox_port}: {e}"))
}

/// One raw HTTP/1.1 request with its own `Host` (host routing: `{port}-{id}.{domain}`); the
/// status of the answer.
fn host_routed_status(port: u16, host: &str, path: &str) -> u16 {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"))
}

/// A guest service for the forwarding checks (the host agent's loopback is ours): answers
/// every request with its head as the body, and sets two cookies, one for the whole domain.
fn header_echo_server() -> u16 {
    use std::io::{BufRead as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the echo server");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(stream);
                let mut head = String::new();
                loop {
                    let mut line = String::new();
                    match reader.read_line(&mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) if line == "\r\n" => break,
                        Ok(_) => head.push_str(&line),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nSet-Cookie: guest=1; Domain=e2b.test; Path=/\r\nSet-Cookie: own=2\r\nX-Guest: yes\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{head}",
                    head.len()
                );
                let _ = reader.get_mut().write_all(answer.as_bytes());
            });
        }
    });
    port
}

/// The daemon's peak resident set (VmHWM), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in {status}"))
}

/// The E2B data plane as a security boundary (issue 25, findings 4, 6, 13, 15): tokens are
/// checked before any lookup (a paused `autoResume` sandbox stays paused for a request
/// without one), other ports need a token unless the sandbox is public, host credentials and
/// cookies stay out of forwards, uploads stream in bounded memory, a pathological multipart
/// body is refused fast, and ListDir stops at its cap with an error naming it.
#[test]
fn e2b_data_plane_security() {
    if !kvm_available() {
        return;
    }
    let (daemon, port) = start_daemon(tempfile::tempdir().expect("tempdir"), None, &[]);
    let daemon_pid = daemon.children[1].id();
    let create = |body: &str| {
        let (status, created) = e2b_call(port, "POST", "/v2/sandboxes", Some(body));
        assert_eq!(status, 201, "{created}\n{}", daemon.log());
        created
    };
    let public = create(
        r#"{"templateID":"guest","timeout":120,"autoPause":true,"autoResume":{"enabled":true}}"#,
    );
    assert!(public["trafficAccessToken"].is_null(), "{public}");
    let private = create(
        r#"{"templateID":"guest","timeout":120,"autoPause":true,"autoResume":{"enabled":true},"network":{"allowPublicTraffic":false}}"#,
    );
    let id = |v: &serde_json::Value| v["sandboxID"].as_str().expect("sandboxID").to_string();
    let token = |v: &serde_json::Value, k: &str| {
        v[k].as_str()
            .unwrap_or_else(|| panic!("no {k}: {v}"))
            .to_string()
    };
    let (public_id, private_id) = (id(&public), id(&private));
    let (public_envd, private_envd) = (
        token(&public, "envdAccessToken"),
        token(&private, "envdAccessToken"),
    );
    let traffic = token(&private, "trafficAccessToken");
    assert_eq!(traffic.len(), 32, "{private}");
    let state = |sandbox: &str| {
        let (_, value) = native_call(&daemon, "GET", &format!("/sandboxes/{sandbox}"), None);
        value["state"].as_str().unwrap_or("").to_string()
    };

    // Authenticate before any lookup: a paused autoResume sandbox is not resumed (nor its
    // row written) by a request without a valid token, on envd or on another port.
    for sandbox in [&public_id, &private_id] {
        let (status, body) = e2b_call(port, "POST", &format!("/sandboxes/{sandbox}/pause"), None);
        assert_eq!(status, 204, "{body}\n{}", daemon.log());
    }
    let echo = header_echo_server();
    for (sandbox, target, headers) in [
        (&public_id, 49983, vec![]),
        (&public_id, 49983, vec![("X-Access-Token", "wrong")]),
        (
            &private_id,
            49983,
            vec![("X-Access-Token", public_envd.as_str())],
        ),
        (&private_id, echo, vec![]),
        (
            &private_id,
            echo,
            vec![("e2b-traffic-access-token", "wrong")],
        ),
    ] {
        let answer = data_plane(port, sandbox, target, "GET", "/envs", &headers, None);
        assert!(
            matches!(answer.status, 401 | 403),
            "{sandbox}:{target} {headers:?}: {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(state(sandbox), "paused", "{sandbox}:{target} {headers:?}");
    }
    let host = format!("49983-{public_id}.e2b.test");
    assert_eq!(host_routed_status(port, &host, "/envs"), 401);
    assert_eq!(host_routed_status(port, &host, "/health"), 502);
    assert_eq!(
        state(&public_id),
        "paused",
        "host-routed requests without a token"
    );
    // With the token, the same request resumes it.
    let answer = data_plane(
        port,
        &public_id,
        49983,
        "GET",
        "/envs",
        &[("X-Access-Token", &public_envd)],
        None,
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(state(&public_id), "running");

    // Other ports: the private sandbox needs its traffic token (or the envd token), the
    // public one takes anyone.
    let answer = data_plane(
        port,
        &private_id,
        echo,
        "GET",
        "/x",
        &[("e2b-traffic-access-token", &traffic)],
        None,
    );
    assert_eq!(
        answer.status,
        200,
        "{}\n{}",
        String::from_utf8_lossy(&answer.body),
        daemon.log()
    );
    assert_eq!(state(&private_id), "running");
    let answer = data_plane(port, &private_id, echo, "GET", "/x", &[], None);
    assert_eq!(
        answer.status,
        403,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert!(String::from_utf8_lossy(&answer.body).contains("e2b-traffic-access-token"));
    let answer = data_plane(
        port,
        &private_id,
        echo,
        "GET",
        "/x",
        &[("X-Access-Token", &private_envd)],
        None,
    );
    assert_eq!(answer.status, 200);
    // A fork of the private sandbox is private too, with a token of its own.
    let (status, forks) = e2b_call(
        port,
        "POST",
        &format!("/sandboxes/{private_id}/fork"),
        Some(r#"{"count":1}"#),
    );
    assert_eq!(status, 201, "{forks}\n{}", daemon.log());
    let fork = &forks[0]["sandbox"];
    let fork_traffic = token(fork, "trafficAccessToken");
    assert_ne!(fork_traffic, traffic);
    let fork_id = id(fork);
    let answer = data_plane(port, &fork_id, echo, "GET", "/x", &[], None);
    assert_eq!(
        answer.status,
        403,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let answer = data_plane(
        port,
        &fork_id,
        echo,
        "GET",
        "/x",
        &[("e2b-traffic-access-token", &fork_traffic)],
        None,
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let (status, _) = e2b_call(port, "DELETE", &format!("/sandboxes/{fork_id}"), None);
    assert_eq!(status, 204);
    // The traffic token is not envd's.
    let answer = data_plane(
        port,
        &private_id,
        49983,
        "GET",
        "/envs",
        &[("e2b-traffic-access-token", &traffic)],
        None,
    );
    assert_eq!(
        answer.status,
        401,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let answer = data_plane(port, &public_id, echo, "GET", "/x", &[], None);
    assert_eq!(answer.status, 200);

    // Host credentials and cookies do not reach the guest; its Set-Cookie does not come back.
    let bearer = format!("Bearer {KEY}");
    let answer = data_plane(
        port,
        &private_id,
        echo,
        "GET",
        "/headers",
        &[
            ("e2b-traffic-access-token", &traffic),
            ("X-Access-Token", &private_envd),
            ("X-API-KEY", KEY),
            ("Authorization", &bearer),
            ("Cookie", "session=host-cookie"),
            ("X-Custom", "kept"),
        ],
        None,
    );
    let seen = String::from_utf8_lossy(&answer.body).to_ascii_lowercase();
    assert_eq!(answer.status, 200, "{seen}");
    assert!(seen.contains("x-custom: kept"), "{seen}");
    for secret in [
        KEY,
        traffic.as_str(),
        private_envd.as_str(),
        "host-cookie",
        "authorization",
    ] {
        assert!(
            !seen.contains(&secret.to_ascii_lowercase()),
            "the guest saw {secret:?}:\n{seen}"
        );
    }
    assert_eq!(answer.header("x-guest"), Some("yes"));
    assert!(
        answer.header("set-cookie").is_none(),
        "{:?}",
        answer.headers
    );

    // Uploads stream: 64 MiB (octet-stream, then multipart) leave the daemon's peak RSS well
    // below the upload's size (a buffered upload grows it by the body, and more).
    let scratch = tempfile::tempdir().expect("scratch");
    let envd = [("X-Access-Token", public_envd.as_str())];
    const BIG: u64 = 64 << 20;
    const RSS_GROWTH_KIB: u64 = 16 << 10;
    let before = peak_rss_kib(daemon_pid);
    let path = scratch.path().join("big.bin");
    let mut zeros = std::io::Read::take(std::io::repeat(7), BIG);
    let mut headers = envd.to_vec();
    headers.push(("Content-Type", "application/octet-stream"));
    let answer = data_plane(
        port,
        &public_id,
        49983,
        "POST",
        &format!("/files?path={}", path.display()),
        &headers,
        Some((&mut zeros, BIG)),
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(std::fs::metadata(&path).expect("uploaded").len(), BIG);
    let boundary = "rollbox-boundary-0123";
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\n\r\n",
        scratch.path().join("multi.bin").display()
    );
    let tail = format!("\r\n--{boundary}--\r\n");
    let length = head.len() as u64 + BIG + tail.len() as u64;
    let mut body = std::io::Read::chain(
        std::io::Read::chain(
            head.as_bytes(),
            std::io::Read::take(std::io::repeat(9), BIG),
        ),
        tail.as_bytes(),
    );
    let content_type = format!("multipart/form-data; boundary={boundary}");
    let mut headers = envd.to_vec();
    headers.push(("Content-Type", &content_type));
    let answer = data_plane(
        port,
        &public_id,
        49983,
        "POST",
        "/files",
        &headers,
        Some((&mut body, length)),
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(
        std::fs::metadata(scratch.path().join("multi.bin"))
            .expect("uploaded")
            .len(),
        BIG
    );
    let after = peak_rss_kib(daemon_pid);
    println!("daemon VmHWM {before} KiB before two 64 MiB uploads, {after} KiB after");
    assert!(
        after < before + RSS_GROWTH_KIB,
        "the daemon's peak RSS grew from {before} to {after} KiB"
    );
    std::fs::remove_file(&path).expect("remove");
    std::fs::remove_file(scratch.path().join("multi.bin")).expect("remove");

    // A pathological multipart body (a 4000-byte boundary over 8 MiB of near-matches) is
    // answered at once, naming the boundary.
    let long = "b".repeat(4000);
    let near = format!("\r\n--{}", &long[..3999]).repeat(2048);
    let evil = format!("--{long}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/x\"\r\n\r\n{near}");
    let content_type = format!("multipart/form-data; boundary={long}");
    let mut headers = envd.to_vec();
    headers.push(("Content-Type", &content_type));
    let started = Instant::now();
    let mut source = evil.as_bytes();
    let answer = data_plane(
        port,
        &public_id,
        49983,
        "POST",
        "/files",
        &headers,
        Some((&mut source, evil.len() as u64)),
    );
    assert_eq!(
        answer.status,
        400,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert!(String::from_utf8_lossy(&answer.body).contains("boundary"));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // ListDir stops at its entry cap with an error that names it; under it, it answers.
    // (On tmpfs where there is one: 55,000 files on a disk take seconds to make.)
    let shm = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("tempdir");
    let list = shm.path().join("list");
    for (dir, count) in [("a", 30_000), ("b", 25_000)] {
        std::fs::create_dir_all(list.join(dir)).expect("mkdir");
        for i in 0..count {
            std::fs::File::create(list.join(dir).join(i.to_string())).expect("create");
        }
    }
    let mut headers = envd.to_vec();
    headers.push(("Content-Type", "application/json"));
    let request = |depth: u32| {
        let body = json!({ "path": list, "depth": depth }).to_string();
        let mut source = body.as_bytes();
        data_plane(
            port,
            &public_id,
            49983,
            "POST",
            "/filesystem.Filesystem/ListDir",
            &headers,
            Some((&mut source, body.len() as u64)),
        )
    };
    let answer = request(1);
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let answer = request(2);
    let error: serde_json::Value = serde_json::from_slice(&answer.body).expect("json");
    assert_eq!(
        (answer.status, error["code"].as_str()),
        (400, Some("invalid_argument")),
        "{error}"
    );
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains("50000 entries"),
        "{error}"
    );
}
