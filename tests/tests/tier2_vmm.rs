//! Tier 2: the real `rollbox-vmm` boots the test guest on real KVM and the guest exercises the
//! boot path, serial, virtio-blk, virtio-vsock, hostile descriptor chains, reset and power-off.

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use rollbox_tests::{kvm_available, raw_image, Vm};

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn vm_with_drives() -> Vm {
    Vm::boot_with(
        |dir| {
            raw_image(&dir.join("rw.img"), 8 << 20);
            raw_image(&dir.join("ro.img"), 1 << 20);
            std::fs::File::options()
                .write(true)
                .open(dir.join("ro.img"))
                .and_then(|f| f.write_all_at(b"read-only contents", 0))
                .expect("seed ro image");
        },
        &[
            "--memory-mib",
            "128",
            "--drive",
            "{dir}/rw.img,id=scratch",
            "--drive",
            "{dir}/ro.img,readonly",
            "--vsock-uds",
            "{dir}/v.sock",
            "--vsock-cid",
            "7",
        ],
    )
}

#[test]
fn boots_through_the_linux_boot_path_with_boot_params() {
    if !kvm_available() {
        return;
    }
    let mut vm = Vm::boot(&[
        "--memory-mib",
        "256",
        "--cmdline",
        "console=ttyS0 rollbox.test=1 acpi=off",
    ]);
    assert_eq!(vm.ok("echo hello"), "hello");
    let cmdline = vm.ok("cmdline");
    assert!(
        cmdline.starts_with("console=ttyS0 rollbox.test=1"),
        "{cmdline}"
    );
    let e820 = vm.ok("e820");
    let fields: Vec<&str> = e820.split_whitespace().collect();
    assert_eq!(fields[0], "3", "{e820}");
    assert_eq!(fields[1], "0x0:0x9fc00:1");
    assert_eq!(
        fields[2], "0xe0000:0x20000:2",
        "ACPI tables and VMGenID: reserved"
    );
    assert_eq!(
        fields[3],
        format!("0x100000:{:#x}:1", (256u64 << 20) - 0x10_0000)
    );
    assert_eq!(vm.ok("devices"), "", "no virtio devices were configured");
    vm.send("poweroff\n");
    assert!(vm.wait(Duration::from_secs(20)).success());
}

#[test]
fn boots_with_two_vcpus_and_more_than_3_gib() {
    if !kvm_available() {
        return;
    }
    let mut vm = Vm::boot(&["--vcpus", "2", "--memory-mib", "4096"]);
    let e820 = vm.ok("e820");
    assert!(
        e820.starts_with("4 "),
        "memory above 4 GiB must be a fourth e820 entry: {e820}"
    );
    assert!(e820.contains("0x100000000:0x40000000:1"), "{e820}");
    vm.send("reset\n");
    assert!(vm.wait(Duration::from_secs(20)).success());
}

#[test]
fn block_device_reads_writes_flushes_and_names_itself() {
    if !kvm_available() {
        return;
    }
    let mut vm = vm_with_drives();
    let devices = vm.ok("devices");
    assert_eq!(devices, "0xd0000000:5:2 0xd0001000:6:2 0xd0002000:7:19");
    assert_eq!(vm.ok("blk-info 0"), "capacity=16384 ro=0 flush=1");
    assert_eq!(vm.ok("blk-id 0"), "scratch");
    assert_eq!(vm.ok("blk-id 1"), "drive1");

    // Guest writes, host reads the file.
    assert_eq!(vm.ok("blk-write 0 5 726f6c6c626f78"), "");
    assert_eq!(vm.ok("blk-flush 0"), "");
    let image = std::fs::File::open(vm.path("rw.img")).expect("open image");
    let mut sector = [0u8; 512];
    image
        .read_exact_at(&mut sector, 5 * 512)
        .expect("read back");
    assert_eq!(&sector[..7], b"rollbox");
    assert!(sector[7..].iter().all(|b| *b == 0));

    // Host writes, guest reads.
    let pattern: Vec<u8> = (0..64 * 512).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::File::options()
        .write(true)
        .open(vm.path("rw.img"))
        .and_then(|f| f.write_all_at(&pattern, 100 * 512))
        .expect("host write");
    assert_eq!(
        vm.ok("blk-sum 0 100 64"),
        format!("{:#x}", fnv1a64(&pattern))
    );
    let first = vm.ok("blk-read 0 100 1");
    let expected: String = pattern[..512].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(first, expected);

    // Guest fills many sectors; the host file has them.
    assert_eq!(vm.ok("blk-fill 0 2000 40 171"), "");
    let mut filled = vec![0u8; 40 * 512];
    image
        .read_exact_at(&mut filled, 2000 * 512)
        .expect("read fill");
    assert!(filled.iter().all(|b| *b == 171));

    // Past the end of the disk is an I/O error, not a crash.
    assert!(vm.cmd("blk-read 0 16383 2").starts_with("ERR"));
    assert_eq!(vm.ok("echo alive"), "alive");
}

#[test]
fn read_only_drive_refuses_writes() {
    if !kvm_available() {
        return;
    }
    let mut vm = vm_with_drives();
    assert_eq!(vm.ok("blk-info 1"), "capacity=2048 ro=1 flush=1");
    assert_eq!(vm.cmd("blk-write 1 0 00ff00ff"), "ERR status=1");
    let mut head = [0u8; 18];
    std::fs::File::open(vm.path("ro.img"))
        .expect("open")
        .read_exact_at(&mut head, 0)
        .expect("read");
    assert_eq!(&head, b"read-only contents");
    let hex: String = b"read-only contents"
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(vm.ok("blk-read 1 0 1").starts_with(&hex));
    assert_eq!(vm.ok("blk-flush 1"), "");
}

fn connect_to_guest(vm: &Vm, port: u32) -> UnixStream {
    let mut stream = UnixStream::connect(vm.path("v.sock")).expect("connect vsock uds");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .expect("send CONNECT");
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while reply.last() != Some(&b'\n') {
        stream.read_exact(&mut byte).expect("read OK line");
        reply.push(byte[0]);
    }
    let reply = String::from_utf8_lossy(&reply).to_string();
    assert!(reply.starts_with("OK "), "CONNECT answered {reply:?}");
    stream
}

#[test]
fn vsock_host_to_guest_echo_and_guest_to_host() {
    if !kvm_available() {
        return;
    }
    let mut vm = vm_with_drives();
    assert_eq!(vm.ok("vsock-cid"), "7");
    assert_eq!(vm.ok("vsock-listen 1024"), "");

    let mut stream = connect_to_guest(&vm, 1024);
    stream.write_all(b"hello guest\n").expect("send");
    let mut echo = [0u8; 12];
    stream.read_exact(&mut echo).expect("echo");
    assert_eq!(&echo, b"hello guest\n");
    // More than the credit window, so flow control must work both ways.
    let big: Vec<u8> = (0..600_000u32).map(|i| (i % 253) as u8).collect();
    let writer = {
        let mut w = stream.try_clone().expect("clone");
        let big = big.clone();
        std::thread::spawn(move || w.write_all(&big).expect("send big"))
    };
    let mut got = vec![0u8; big.len()];
    stream.read_exact(&mut got).expect("big echo");
    writer.join().expect("writer");
    assert!(got == big, "echoed bytes differ");
    drop(stream);

    // A second connection while the guest keeps serving.
    let mut again = connect_to_guest(&vm, 1024);
    again.write_all(b"x").expect("send");
    let mut one = [0u8; 1];
    again.read_exact(&mut one).expect("echo");
    assert_eq!(&one, b"x");

    // Guest dials the host on <uds>_<port>.
    let listener = UnixListener::bind(vm.path("v.sock_5000")).expect("bind host port");
    vm.send("vsock-connect 5000 ping\n");
    let (mut conn, _) = listener.accept().expect("guest connection");
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).expect("ping");
    assert_eq!(&got, b"ping\n");
    conn.write_all(b"pong\n").expect("pong");
    let answer = vm.next_line(Duration::from_secs(20)).expect("answer");
    assert_eq!(answer, "OK pong");

    // Nobody listens on port 5001: the guest's connect is refused, not hung.
    assert!(vm.cmd("vsock-connect 5001 hello").starts_with("ERR"));
    // CONNECT to a port the guest doesn't listen on is refused too.
    let mut refused = UnixStream::connect(vm.path("v.sock")).expect("connect");
    refused
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    refused.write_all(b"CONNECT 4444\n").expect("send");
    let mut buf = [0u8; 16];
    assert_eq!(
        refused.read(&mut buf).expect("read"),
        0,
        "refused connection must close"
    );
    assert_eq!(vm.ok("echo alive"), "alive");
}

#[test]
fn hostile_descriptor_chains_are_logged_and_survived() {
    if !kvm_available() {
        return;
    }
    let mut vm = vm_with_drives();
    assert_eq!(vm.ok("blk-write 0 1 c0ffee"), "");
    assert_eq!(vm.ok("vsock-listen 1024"), "");
    // (kind, what its refusal says, and no other kind's does)
    let kinds = [
        ("oob", "lies outside guest memory"),
        (
            "loop",
            "loops after 2 descriptor(s), descriptor 1 linking back to descriptor 0",
        ),
        (
            "long",
            "loops after 16 descriptor(s), descriptor 15 linking back to descriptor 0",
        ),
        ("dir", "request header must be a device-readable buffer"),
        ("badnext", "the last names next index 21"),
        ("badavail", "more than the queue size"),
    ];
    for (kind, problem) in kinds {
        let before = vm.stderr().len();
        assert_eq!(
            vm.ok(&format!("hostile 0 {kind}")),
            "survived",
            "hostile {kind}"
        );
        let new = vm.stderr_after(before, problem, Duration::from_secs(5));
        assert!(
            new.contains(problem),
            "hostile {kind}: no line saying {problem:?} in:\n{new}"
        );
        for (other, other_problem) in kinds {
            assert!(
                other == kind || !new.contains(other_problem),
                "hostile {kind} logged what {other} should: {other_problem:?}"
            );
        }
        // The block device works again after the guest reset it, and other devices never stopped.
        assert!(
            vm.ok("blk-read 0 1 1").starts_with("c0ffee"),
            "after hostile {kind}"
        );
        let mut s = connect_to_guest(&vm, 1024);
        s.write_all(b"k").expect("send");
        let mut b = [0u8; 1];
        s.read_exact(&mut b)
            .expect("vsock echo after hostile chain");
    }
    vm.send("poweroff\n");
    assert!(vm.wait(Duration::from_secs(20)).success());
}

/// CPU ticks (utime + stime) the VMM's main thread, its event loop, has used so far. The
/// vCPU threads are busy by design: the guest polls its serial port.
fn event_loop_cpu_ticks(vm: &Vm) -> u64 {
    let pid = vm.child.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat"))
        .expect("read the VMM main thread's stat");
    // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let field = |n: usize| -> u64 {
        fields
            .get(n - 3)
            .and_then(|f| f.parse().ok())
            .unwrap_or_else(|| panic!("field {n} of {stat:?}"))
    };
    field(14) + field(15)
}

#[test]
fn hostile_vsock_chains_are_logged_and_survived() {
    if !kvm_available() {
        return;
    }
    let mut vm = vm_with_drives();
    assert_eq!(vm.ok("blk-write 0 1 c0ffee"), "");
    assert_eq!(vm.ok("vsock-listen 1024"), "");
    // (kind, the queue its refusal names, what the refusal says)
    let kinds = [
        ("oob", "TX", "lies outside guest memory"),
        (
            "loop",
            "TX",
            "loops after 2 descriptor(s), descriptor 1 linking back to descriptor 0",
        ),
        (
            "long",
            "TX",
            "loops after 16 descriptor(s), descriptor 15 linking back to descriptor 0",
        ),
        ("dir", "TX", "is device-writable"),
        ("badnext", "TX", "next index 21, beyond the queue of 16"),
        ("badavail", "TX", "more than the queue size"),
        ("shortlen", "TX", "claims 100 payload bytes but carries 16"),
        (
            "shorthdr",
            "TX",
            "16 bytes are too few for the 44-byte packet header",
        ),
        ("rxdir", "RX", "is device-readable"),
        (
            "rxsmall",
            "RX",
            "16 bytes are too few for the 44-byte packet header",
        ),
        ("evdir", "event", "is device-readable"),
    ];
    for (kind, queue, problem) in kinds {
        let before = vm.stderr().len();
        assert_eq!(
            vm.ok(&format!("vsock-hostile {kind}")),
            "survived",
            "vsock-hostile {kind}"
        );
        // Wait for the first line, then a little more to catch any second line.
        vm.stderr_after(before, "\n", Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(200));
        let log = vm.stderr();
        let new = log.get(before..).unwrap_or_default();
        // One line, from the device, naming the queue and the problem.
        let lines: Vec<&str> = new.lines().collect();
        assert!(
            lines.len() == 1
                && lines[0].contains("[WARN] virtio-vsock: ")
                && lines[0].contains(&format!(" {queue} queue: "))
                && lines[0].contains(problem),
            "vsock-hostile {kind}: want one {queue}-queue refusal saying {problem:?}, got:\n{new}"
        );
        // The vsock device serves again after the guest reset it, and the block device
        // never stopped.
        let mut s = connect_to_guest(&vm, 1024);
        s.write_all(b"after\n").expect("send");
        let mut echo = [0u8; 6];
        s.read_exact(&mut echo)
            .unwrap_or_else(|e| panic!("vsock echo after {kind}: {e}"));
        assert_eq!(&echo, b"after\n", "after vsock-hostile {kind}");
        drop(s);
        assert!(
            vm.ok("blk-read 0 1 1").starts_with("c0ffee"),
            "after vsock-hostile {kind}"
        );
    }
    assert!(vm
        .cmd("vsock-hostile nope")
        .starts_with("ERR unknown-hostile-kind"));
    // Idle now: the event loop must not spin on a chain it refused.
    let ticks = event_loop_cpu_ticks(&vm);
    std::thread::sleep(Duration::from_secs(2));
    let used = event_loop_cpu_ticks(&vm) - ticks;
    assert!(
        used < 100,
        "the VMM's event loop used {used} CPU ticks in 2 s of idling"
    );
    vm.send("poweroff\n");
    assert!(
        vm.wait(Duration::from_secs(20)).success(),
        "{}",
        vm.stderr()
    );
}

#[test]
fn reset_and_poweroff_end_the_vmm_with_status_0() {
    if !kvm_available() {
        return;
    }
    for command in ["reset", "poweroff"] {
        let mut vm = vm_with_drives();
        vm.send(&format!("{command}\n"));
        let status = vm.wait(Duration::from_secs(20));
        assert_eq!(status.code(), Some(0), "{command}: {}", vm.stderr());
        assert!(
            !vm.path("v.sock").exists(),
            "{command} left the vsock socket behind"
        );
    }
}

#[test]
fn a_crash_ends_the_vmm_non_zero_with_exit_reason_and_registers() {
    if !kvm_available() {
        return;
    }
    let mut vm = Vm::boot(&[]);
    vm.send("crash\n");
    let status = vm.wait(Duration::from_secs(20));
    assert_ne!(status.code(), Some(0));
    let log = vm.stderr();
    assert!(
        log.contains("KVM_EXIT_SHUTDOWN") || log.contains("KVM_EXIT_INTERNAL_ERROR"),
        "no exit reason in: {log}"
    );
    assert!(log.contains("rip=0x"), "no registers in: {log}");
}

#[test]
fn sigterm_ends_the_vmm_and_removes_its_sockets() {
    if !kvm_available() {
        return;
    }
    let mut vm = Vm::boot(&[
        "--vsock-uds",
        "{dir}/v.sock",
        "--vsock-cid",
        "3",
        "--api-sock",
        "{dir}/api.sock",
    ]);
    assert!(vm.path("api.sock").exists() && vm.path("v.sock").exists());
    // SAFETY: sends SIGTERM to our own child process.
    unsafe { libc::kill(vm.child.id() as i32, libc::SIGTERM) };
    let status = vm.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    assert!(!vm.path("api.sock").exists());
    assert!(!vm.path("v.sock").exists());
}

#[test]
fn a_console_file_flooded_by_the_guest_stops_at_its_cap_and_the_api_keeps_answering() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let console = dir.path().join("console.log");
    let args: Vec<String> = [
        "--kernel",
        &rollbox_tests::test_guest().display().to_string(),
        "--cmdline",
        rollbox_tests::TEST_GUEST_CMDLINE,
        "--console",
        "{dir}/console.log",
        "--console-max-bytes",
        "1024",
        "--api-sock",
        "{dir}/api.sock",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let mut vm = Vm::spawn_raw(&args, dir);
    rollbox_tests::wait_for_file_line(&console, Duration::from_secs(30), |l| {
        l == "rollbox-test-guest: ready"
    });
    rollbox_tests::wait_for_socket(&vm.path("api.sock"), Duration::from_secs(10));
    // About 2.5 KiB of answers, over twice the cap (each byte is a trap to the VMM: keep it short).
    let line = "x".repeat(600);
    for _ in 0..4 {
        vm.send(&format!("echo {line}\n"));
    }
    let log = vm.stderr_after(0, "reached its cap", Duration::from_secs(60));
    assert!(log.contains("reached its cap of 1024 bytes"), "{log}");
    let info = vm
        .api()
        .vm_info()
        .expect("the API answers while the guest floods");
    assert_eq!(info.state, "Running");
    let size = std::fs::metadata(&console).expect("console").len();
    assert!(size <= 1024, "the console file grew past its cap: {size}");
    // Power off: the file's last line counts what was dropped, and it still fits the cap.
    vm.send("poweroff\n");
    assert_eq!(
        vm.wait(Duration::from_secs(60)).code(),
        Some(0),
        "{}",
        vm.stderr()
    );
    let text = std::fs::read_to_string(&console).expect("console");
    assert!(text.len() <= 1024, "{}", text.len());
    assert!(text.starts_with("rollbox-test-guest: ready\n"), "{text}");
    assert!(
        text.contains("[rollbox-vmm: console capped at 1024 bytes; later output is dropped]"),
        "{text}"
    );
    assert!(
        text.trim_end()
            .ends_with("console bytes dropped past the cap]"),
        "{text}"
    );
}

/// HugePages_Total of /proc/meminfo, and the pages neither in use nor reserved by a mapping
/// (HugePages_Free less HugePages_Rsvd: a mapping reserves its pages, faults take them).
fn huge_pages() -> (u64, u64) {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .expect(name)
    };
    let free: u64 = field("HugePages_Free:");
    let reserved: u64 = field("HugePages_Rsvd:");
    (field("HugePages_Total:"), free.saturating_sub(reserved))
}

#[test]
fn guest_memory_in_2_mib_huge_pages() {
    const TEST: &str = "guest_memory_in_2_mib_huge_pages";
    if !kvm_available() {
        return;
    }
    // 16 more pages for this guest's 32 MiB, given back at the end.
    let (total, _) = huge_pages();
    let want = total + 16;
    if std::fs::write("/proc/sys/vm/nr_hugepages", want.to_string()).is_err()
        || huge_pages().0 < want
    {
        rollbox_tests::skip(TEST, "this host cannot reserve 16 more 2 MiB huge pages");
        let _ = std::fs::write("/proc/sys/vm/nr_hugepages", total.to_string());
        return;
    }
    let (_, free_before) = huge_pages();
    let mut vm = Vm::boot(&["--memory-mib", "32", "--huge-pages", "2M"]);
    assert_eq!(vm.ok("echo hugepages"), "hugepages");
    let (_, free_during) = huge_pages();
    vm.send("reset\n");
    assert!(
        vm.wait(Duration::from_secs(20)).success(),
        "{}",
        vm.stderr()
    );
    let _ = std::fs::write("/proc/sys/vm/nr_hugepages", total.to_string());
    assert!(
        free_before - free_during >= 16,
        "the guest's 32 MiB took {} huge pages",
        free_before - free_during
    );
    // An odd size is refused by name.
    let out = std::process::Command::new(rollbox_tests::vmm_binary())
        .args([
            "--kernel",
            "/nonexistent",
            "--memory-mib",
            "33",
            "--huge-pages",
            "2M",
        ])
        .output()
        .expect("rollbox-vmm");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("even mem_size_mib"),
        "{stderr}"
    );
}
