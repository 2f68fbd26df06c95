//! `rollbox serve` against hostile clients and a hostile agent: a guest flooding output to an
//! API client that does not read (the daemon's memory stays bounded: backpressure through the
//! agent connection), thousands of idle connections on each TCP listener (a real client is
//! still answered within 1 s, the descriptors stay bounded), slow headers, idle keep-alive
//! connections and silent TLS handshakes (closed at their timeouts), and an agent that
//! accepts and never answers (the call ends at the agent timeout with an error naming the
//! sandbox). The flood and agent tests run the tier-2 test guest (need /dev/kvm); the
//! listener tests need no VM.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox_tests::daemon::{
    agent_server, peak_rss_kib_over_4_s, read_until_full, rss_kib, Server, KEY,
};
use rollbox_tests::{jailer_binary, kvm_available, rollbox_binary, vmm_binary};
use serde_json::json;

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the daemon's fds")
        .count()
}

/// A whole HTTP/1.1 request with `Connection: close`, as bytes.
fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut text = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() {
        text.push_str("Content-Type: application/json\r\n");
    }
    text.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    text.into_bytes()
}

/// Sends `request` and reads the whole answer: (status, body text).
fn exchange(mut stream: impl Read + Write, request: &[u8]) -> (u16, String) {
    stream.write_all(request).expect("send the request");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("read the answer");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn output_flooding_a_client_that_does_not_read_keeps_daemon_memory_bounded() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let pid = server.pid();
    let line = "x".repeat(4000);
    let body = json!({"cmd": ["yes", line], "max_output_bytes": 67_108_864}).to_string();
    let auth = format!("Bearer {KEY}");
    let exec = request(
        "POST",
        &format!("/sandboxes/{id}/exec?stream=true"),
        &[("Authorization", &auth)],
        &body,
    );
    let before = rss_kib(pid);
    // Four floods whose clients read nothing: 4 x 64 MiB of output waiting for them.
    let mut stuck = Vec::new();
    for _ in 0..4 {
        let mut stream = UnixStream::connect(server.sock()).expect("connect");
        stream.write_all(&exec).expect("send the exec");
        stuck.push(stream);
    }
    // The queues fill within the first seconds; after that, bounded memory stays flat while
    // an unbounded queue grows with the flood (tens of MiB a second).
    std::thread::sleep(Duration::from_secs(3));
    let filled = rss_kib(pid);
    let peak = peak_rss_kib_over_4_s(pid, filled);
    let grown_mib = peak.saturating_sub(before) / 1024;
    let grown_late_mib = peak.saturating_sub(filled) / 1024;
    // Proof the floods ran: a stalled stream still yields output once read.
    let mut first = stuck.swap_remove(0);
    first
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut head = vec![0u8; 256 << 10];
    let got = read_until_full(&mut first, &mut head);
    let text = String::from_utf8_lossy(&head[..got]);
    assert!(
        text.contains(" 200 ") && text.contains("\"stdout\"") && got == head.len(),
        "the flood did not run: {got} bytes: {}\n{}",
        text.chars().take(400).collect::<String>(),
        server.log_tail()
    );
    assert!(
        grown_mib < 48 && grown_late_mib < 12,
        "the daemon grew by {grown_mib} MiB ({grown_late_mib} MiB after the first 3 s) holding output for clients that do not read\n{}",
        server.log_tail()
    );
    drop(stuck);
    drop(first);
    // The daemon still answers, and ended the floods with their clients.
    let (status, listed) = server.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 200, "{listed}");
}

/// A `rollbox serve` on TCP listeners (native and E2B), no VM needed.
struct TcpDaemon {
    child: Child,
    dir: tempfile::TempDir,
    native: u16,
    e2b: u16,
}

impl Drop for TcpDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl TcpDaemon {
    fn start(extra: &[&str]) -> TcpDaemon {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("key"), format!("{KEY}\n")).expect("key");
        let log = std::fs::File::create(dir.path().join("serve.log")).expect("log");
        let (native, e2b) = (free_port(), free_port());
        let child = Command::new(rollbox_binary())
            .arg("serve")
            .arg("--vmm")
            .arg(vmm_binary())
            .arg("--jailer")
            .arg(jailer_binary())
            .arg("--listen")
            .arg(format!("127.0.0.1:{native}"))
            .arg("--e2b-listen")
            .arg(format!("127.0.0.1:{e2b}"))
            .arg("--api-key-file")
            .arg(dir.path().join("key"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn rollbox serve");
        let mut daemon = TcpDaemon {
            child,
            dir,
            native,
            e2b,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", native)).is_err()
            || TcpStream::connect(("127.0.0.1", e2b)).is_err()
        {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!("rollbox serve ended: {status}\n{}", daemon.log());
            }
            assert!(Instant::now() < deadline, "no listener\n{}", daemon.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default()
    }

    /// A real client on each listener: (native status, E2B status), each answered within 1 s.
    fn real_clients(&self) -> (u16, u16) {
        let auth = format!("Bearer {KEY}");
        let native = request("GET", "/sandboxes", &[("Authorization", &auth)], "");
        let e2b = request("GET", "/sandboxes", &[("X-API-KEY", KEY)], "");
        let mut statuses = Vec::new();
        for (port, request) in [(self.native, native), (self.e2b, e2b)] {
            let started = Instant::now();
            let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            let (status, body) = exchange(stream, &request);
            let took = started.elapsed();
            assert!(
                took < Duration::from_secs(1),
                "port {port} answered in {took:?}\n{}",
                self.log()
            );
            assert_eq!(status, 200, "port {port}: {body}");
            statuses.push(status);
        }
        (statuses[0], statuses[1])
    }
}

/// Lets this process hold thousands of sockets.
fn raise_own_nofile() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write one rlimit we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = limit.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
    assert!(
        limit.rlim_cur >= 5000,
        "this test needs 5000 descriptors; the hard limit is {}",
        limit.rlim_cur
    );
}

#[test]
fn idle_connections_cannot_lock_out_a_real_client_or_exhaust_descriptors() {
    raise_own_nofile();
    let cap = 256;
    let daemon = TcpDaemon::start(&["--max-connections", &cap.to_string()]);
    let pid = daemon.child.id();
    daemon.real_clients();
    let baseline = open_fds(pid);
    // 2,000 connections without a key on each listener: half send nothing, half a header
    // that never ends (slowloris).
    let mut idle = Vec::new();
    for port in [daemon.native, daemon.e2b] {
        for i in 0..2000 {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            if i % 2 == 1 {
                let _ = stream.write_all(b"GET /sandboxes HTTP/1.1\r\nHost: x\r\n");
            }
            idle.push(stream);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    daemon.real_clients();
    let fds = open_fds(pid);
    assert!(
        fds <= baseline + 2 * cap + 16,
        "the daemon holds {fds} descriptors with {} idle connections open (baseline {baseline}, cap {cap} per listener)",
        idle.len()
    );
    // The nofile soft limit was raised to the hard one.
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files")
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(
        open_files[3], open_files[4],
        "soft limit not raised: {limits}"
    );
}

/// Whether the server closes `stream` within `within` (a read returns end of file or a reset).
fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).expect("timeout");
    let mut buf = [0u8; 4096];
    let started = Instant::now();
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
        if started.elapsed() > within {
            return false;
        }
    }
}

/// A self-signed certificate and key (openssl CLI) in `dir`.
fn self_signed(dir: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let status = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run openssl (needed to test the TLS handshake timeout)");
    assert!(status.success(), "openssl could not make a certificate");
    (cert, key)
}

#[test]
fn slow_headers_idle_keep_alives_and_silent_tls_handshakes_are_closed() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let (cert, key) = self_signed(scratch.path());
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let daemon = TcpDaemon::start(&[
        "--http-header-timeout",
        "0.5",
        "--tls-handshake-timeout",
        "0.5",
        "--e2b-tls-cert",
        &cert,
        "--e2b-tls-key",
        &key,
    ]);
    // A header that never ends.
    let mut slow = TcpStream::connect(("127.0.0.1", daemon.native)).expect("connect");
    slow.write_all(b"GET /sandboxes HTTP/1.1\r\nHost: x\r\n")
        .expect("send");
    // A keep-alive connection, idle after one answer.
    let mut kept = TcpStream::connect(("127.0.0.1", daemon.native)).expect("connect");
    kept.write_all(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let mut answer = [0u8; 1024];
    kept.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let n = kept.read(&mut answer).expect("an answer");
    assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 401"));
    // A TLS client that never says hello.
    let mut silent = TcpStream::connect(("127.0.0.1", daemon.e2b)).expect("connect");
    for (what, stream) in [
        ("a slow header", &mut slow),
        ("an idle keep-alive connection", &mut kept),
        ("a silent TLS handshake", &mut silent),
    ] {
        assert!(
            closed_within(stream, Duration::from_secs(3)),
            "{what} was not closed within 3 s of a 0.5 s timeout"
        );
    }
}

/// An agent socket that accepts and never answers: not the hybrid-vsock handshake, or (once
/// `handshake` is set) nothing after it.
fn silent_agent(path: &Path, handshake: std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let listener = std::os::unix::net::UnixListener::bind(path).expect("bind the stand-in");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            if handshake.load(std::sync::atomic::Ordering::SeqCst) {
                let mut line = [0u8; 64];
                let _ = stream.read(&mut line);
                let _ = stream.write_all(b"OK 1\n");
            }
            held.push(stream);
        }
    });
}

#[test]
fn an_agent_that_never_answers_ends_the_call_naming_the_sandbox() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let sock = scratch.path().join("silent.sock");
    let handshake = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    silent_agent(&sock, std::sync::Arc::clone(&handshake));
    let sock_text = sock.display().to_string();
    let server = Server::start(&["--test-agent-socket", &sock_text, "--agent-timeout", "1"]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    let calls = [
        ("no handshake", "files/stat", "did not answer on"),
        (
            "no answer after the handshake",
            "files/stat",
            "did not answer stat",
        ),
        (
            "no answer after the handshake",
            "files",
            "did not answer read_file",
        ),
        (
            "no answer after the handshake",
            "tar",
            "did not answer tar_download",
        ),
    ];
    for (phase, route, said) in calls {
        handshake.store(phase != "no handshake", std::sync::atomic::Ordering::SeqCst);
        let started = Instant::now();
        let (status, body) =
            server.call("GET", &format!("/sandboxes/{id}/{route}?path=/etc"), None);
        let took = started.elapsed();
        assert_eq!(status, 503, "{phase}, {route}: {body}");
        let message = body.to_string();
        assert!(
            message.contains(&format!("sandbox {id}")) && message.contains(said),
            "{phase}, {route}: {message}"
        );
        assert!(
            took < Duration::from_secs(4),
            "{phase}, {route}: the call took {took:?} with a 1 s agent timeout"
        );
    }
}
