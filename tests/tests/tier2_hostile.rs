//! Tier 2: a guest or a host peer that misbehaves must not grow the VMM's memory or fds without
//! bound, and must not stop the API from answering. The flood tests print the VMM's RSS and
//! fd count before and after.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rollbox_tests::{
    api_client, kvm_available, snapshot_params, test_guest, vmm_binary, wait_for_socket, Vm,
    TEST_GUEST_CMDLINE,
};

/// The connection limit of rollbox-vmm's vsock muxer (Firecracker's).
const MAX_CONNECTIONS: usize = 1023;

/// The VMM's resident memory in KiB and its open fds.
fn rss_kib_and_fds(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .count();
    (rss, fds)
}

fn vsock_vm() -> Vm {
    Vm::boot(&[
        "--vsock-uds",
        "{dir}/v.sock",
        "--vsock-cid",
        "7",
        "--api-sock",
        "{dir}/api.sock",
    ])
}

/// Kills the VMM when the test ends, passed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// GET / answers within `limit`.
fn api_answers(sock: &Path, limit: Duration) {
    let started = Instant::now();
    api_client(sock).vm_info().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        started.elapsed() < limit,
        "the API took {:?} to answer",
        started.elapsed()
    );
}

#[test]
fn a_guest_connecting_to_a_full_host_listener_is_refused_and_the_api_keeps_answering() {
    if !kvm_available() {
        return;
    }
    let mut vm = vsock_vm();
    let listener = UnixListener::bind(vm.path("v.sock_5000")).expect("listen");
    // SAFETY: listen(2) on a socket we own; a second call only shrinks the backlog.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    listener.set_nonblocking(true).expect("nonblocking");
    // Fill the backlog: connects that are never accepted.
    let mut queued = Vec::new();
    loop {
        let (tx, rx) = std::sync::mpsc::channel();
        let path = vm.path("v.sock_5000");
        std::thread::spawn(move || {
            let _ = tx.send(UnixStream::connect(path));
        });
        match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(Ok(s)) => queued.push(s),
            _ => break,
        }
        assert!(queued.len() < 4096, "the backlog never filled");
    }
    let answer = vm.cmd("vsock-connect 5000 hello");
    assert_eq!(answer, "ERR connection-reset");
    api_answers(&vm.path("api.sock"), Duration::from_secs(5));
    let log = vm.stderr_after(0, "has a full backlog", Duration::from_secs(5));
    assert!(log.contains("has a full backlog"), "stderr:\n{log}");
    vm.send("poweroff\n");
    assert!(
        vm.wait(Duration::from_secs(30)).success(),
        "{}",
        vm.stderr()
    );
}

#[test]
fn a_host_connection_flood_is_capped_and_the_vmm_stays_flat() {
    if !kvm_available() {
        return;
    }
    let mut vm = vsock_vm();
    assert_eq!(vm.ok("vsock-listen 1024"), "");
    let pid = vm.child.id();
    let before = rss_kib_and_fds(pid);
    // Connections that never send CONNECT: each holds a VMM fd until the limit.
    let flood = MAX_CONNECTIONS + 500;
    let mut streams = Vec::new();
    let mut refused = 0;
    for _ in 0..flood {
        let s = UnixStream::connect(vm.path("v.sock")).expect("connect");
        streams.push(s);
    }
    api_answers(&vm.path("api.sock"), Duration::from_secs(5));
    for s in &mut streams {
        s.set_nonblocking(true).expect("nonblocking");
        let mut buf = [0u8; 64];
        if let Ok(n) = s.read(&mut buf) {
            if buf[..n].starts_with(b"ERR too many connections") {
                refused += 1;
            }
        }
    }
    let during = rss_kib_and_fds(pid);
    drop(streams);
    api_answers(&vm.path("api.sock"), Duration::from_secs(5));
    // The VMM notices the closed connections as its event loop serves them.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut after = rss_kib_and_fds(pid);
    while after.1 > before.1 + 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        after = rss_kib_and_fds(pid);
    }
    eprintln!(
        "vsock host flood of {flood}: VMM RSS {} -> {} -> {} KiB, fds {} -> {} -> {}, {refused} refused",
        before.0, during.0, after.0, before.1, during.1, after.1
    );
    // Two more for what may be open at that moment: an API connection, a refused stream.
    assert!(
        during.1 <= before.1 + MAX_CONNECTIONS + 2,
        "fds grew past the connection limit: {} -> {}",
        before.1,
        during.1
    );
    assert!(refused > 0, "no connection was refused");
    assert!(
        after.1 <= before.1 + 2,
        "fds leaked: {} -> {}",
        before.1,
        after.1
    );
    // vsock still works.
    let mut s = UnixStream::connect(vm.path("v.sock")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    s.write_all(b"CONNECT 1024\nping\n").expect("send");
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"ping\n") {
        s.read_exact(&mut byte).expect("echo after the flood");
        got.push(byte[0]);
    }
    vm.send("poweroff\n");
    assert!(
        vm.wait(Duration::from_secs(30)).success(),
        "{}",
        vm.stderr()
    );
}

#[test]
fn a_host_that_never_reads_stdout_stalls_neither_guest_nor_api() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("api.sock");
    let child = Command::new(vmm_binary())
        .args(["--kernel", &test_guest().display().to_string()])
        .args(["--cmdline", TEST_GUEST_CMDLINE])
        .args(["--api-sock", &sock.display().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rollbox-vmm");
    let mut child = KillOnDrop(child);
    // Held, never read: the pipe fills after 64 KiB.
    let _stdout = child.0.stdout.take().expect("stdout");
    let mut stdin = child.0.stdin.take().expect("stdin");
    wait_for_socket(&sock, Duration::from_secs(10));
    let line = format!("echo {}\n", "x".repeat(1000));
    for _ in 0..200 {
        stdin.write_all(line.as_bytes()).expect("command");
    }
    api_answers(&sock, Duration::from_secs(5));
    // The guest still serves its console: it powers off when asked.
    stdin.write_all(b"poweroff\n").expect("poweroff");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            panic!("the guest stalled behind an unread stdout");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

/// Connects to guest port `port` through the vsock socket and checks an echo.
fn echo_through_vsock(vm: &Vm, port: u32) {
    let mut s = UnixStream::connect(vm.path("v.sock")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    s.write_all(format!("CONNECT {port}\nping\n").as_bytes())
        .expect("send");
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"ping\n") {
        s.read_exact(&mut byte)
            .unwrap_or_else(|e| panic!("vsock echo: {e}; got {got:?}"));
        got.push(byte[0]);
    }
}

/// Accepts and holds every connection to `listener` until dropped.
struct Holder {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    path: std::path::PathBuf,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Holder {
    fn new(path: std::path::PathBuf) -> Holder {
        let listener = UnixListener::bind(&path).expect("listen");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let theirs = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in listener.incoming() {
                if theirs.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                held.extend(s.ok());
            }
            held.len()
        });
        Holder {
            stop,
            path,
            thread: Some(thread),
        }
    }

    /// Stops accepting (a last connection wakes the thread); returns how many it held.
    fn finish(mut self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = UnixStream::connect(&self.path);
        self.thread
            .take()
            .map(|t| t.join().expect("holder"))
            .unwrap_or(0)
    }
}

#[test]
fn guest_floods_without_rx_buffers_keep_the_vmm_flat_and_the_api_answering() {
    if !kvm_available() {
        return;
    }
    let mut vm = vsock_vm();
    let holder = Holder::new(vm.path("v.sock_5000"));
    assert_eq!(vm.ok("vsock-listen 1024"), "");
    let pid = vm.child.id();
    let before = rss_kib_and_fds(pid);
    for kind in ["flood-bogus", "flood-connect"] {
        let started = Instant::now();
        assert_eq!(
            vm.ok(&format!("vsock-hostile {kind}")),
            "survived",
            "{kind}"
        );
        let took = started.elapsed();
        let during = rss_kib_and_fds(pid);
        api_answers(&vm.path("api.sock"), Duration::from_secs(5));
        eprintln!(
            "vsock guest {kind} of 3000 packets in {took:?}, no RX buffers: VMM RSS {} -> {} KiB, fds {} -> {}",
            before.0, during.0, before.1, during.1
        );
        assert!(
            during.1 <= before.1 + MAX_CONNECTIONS + 2,
            "{kind}: fds {} -> {}",
            before.1,
            during.1
        );
        assert!(
            during.0 < before.0 + 16 * 1024,
            "{kind}: RSS {} -> {} KiB",
            before.0,
            during.0
        );
        // The guest sets the device up afresh; vsock serves again.
        assert_eq!(vm.ok("vsock-listen 1024"), "");
        echo_through_vsock(&vm, 1024);
    }
    let after = rss_kib_and_fds(pid);
    eprintln!(
        "vsock guest floods: VMM RSS {} -> {} KiB, fds {} -> {} after the device reset",
        before.0, after.0, before.1, after.1
    );
    assert!(
        after.1 <= before.1 + 2,
        "fds leaked: {} -> {}",
        before.1,
        after.1
    );
    let held = holder.finish();
    assert!(held > 0, "no guest connection reached the host listener");
    let log = vm.stderr_after(0, "guest gives no RX buffers", Duration::from_secs(5));
    let dropped_lines = log
        .lines()
        .filter(|l| l.contains("guest gives no RX buffers"))
        .count();
    assert!(
        (1..=32).contains(&dropped_lines),
        "want the dropped control packets logged, rate-limited; got {dropped_lines} lines"
    );
    // 1500 packets with an unknown operation: the log holds at most a burst of them.
    let unknown = log
        .lines()
        .filter(|l| l.contains("unknown operation 99"))
        .count();
    assert!(
        (1..=32).contains(&unknown),
        "want the unknown operations logged, rate-limited; got {unknown} lines"
    );
    vm.send("poweroff\n");
    assert!(
        vm.wait(Duration::from_secs(30)).success(),
        "{}",
        vm.stderr()
    );
}

#[test]
fn a_memory_file_truncated_under_a_lazy_restore_ends_the_vm_naming_it() {
    if !kvm_available() {
        return;
    }
    let mut vm = Vm::boot(&["--memory-mib", "128", "--api-sock", "{dir}/api.sock"]);
    wait_for_socket(&vm.path("api.sock"), Duration::from_secs(10));
    assert_eq!(vm.ok("touch 16 77"), "4096");
    let snap = tempfile::tempdir().expect("snapshot dir");
    let memory = snap.path().join("memory");
    let api = vm.api();
    api.pause().unwrap_or_else(|e| panic!("{e}"));
    api.create_snapshot(&snapshot_params("Full", snap.path()))
        .unwrap_or_else(|e| panic!("{e}"));
    drop(vm);

    let scratch = tempfile::tempdir().expect("tempdir");
    let restore_sock = scratch.path().join("api.sock");
    let mut clone = Vm::spawn_raw(
        &[
            "--restore".into(),
            snap.path().display().to_string(),
            "--restore-backend".into(),
            "uffd".into(),
            "--api-sock".into(),
            restore_sock.display().to_string(),
        ],
        scratch,
    );
    // The API socket appears once the restore is done: the page server is serving.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !restore_sock.exists() {
        if let Some(status) = clone.child.try_wait().expect("try_wait") {
            let log = clone.stderr();
            if log.contains("userfaultfd") {
                rollbox_tests::skip(
                    "a_memory_file_truncated_under_a_lazy_restore_ends_the_vm_naming_it",
                    &format!("no userfaultfd here: {log}"),
                );
                return;
            }
            panic!("the lazy restore failed ({status}): {log}");
        }
        assert!(Instant::now() < deadline, "the restore never finished");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::File::options()
        .write(true)
        .open(&memory)
        .and_then(|f| f.set_len(1 << 20))
        .expect("truncate the memory file");
    let started = Instant::now();
    // Reading the working set faults in pages the file no longer holds.
    clone.send("check 16 77\n");
    let status = clone.wait(Duration::from_secs(60));
    let took = started.elapsed();
    eprintln!("a fault on the truncated memory file ended the VMM in {took:?} with {status}");
    assert!(!status.success(), "the VM must fail");
    let log = clone.stderr();
    assert!(
        log.contains(&format!(
            "memory file {} ends before offset",
            memory.display()
        )),
        "the error must name the memory file:\n{log}"
    );
}
