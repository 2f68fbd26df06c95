#!/usr/bin/env python3
"""Runs every command of PROTOCOL.md against a VMM and checks the answers.

Default: cross-checks the test guest against QEMU's reference virtio devices. It boots
target/test-guest/test-guest under QEMU's microvm machine (TCG) through the PVH shim in
this folder, with two virtio-mmio block devices (one read-only) and, when
vhost-device-vsock is installed, a vhost-user vsock device. (reset/poweroff/crash are not
checked there: microvm has no i8042 or port 0x3c0.)

With `--vmm PATH` it boots the guest under rollbox-vmm instead, with the same devices,
and also checks that `poweroff` and `reset` end the VMM with status 0 and `crash` with a
failure.

The disk images are checked afterwards. Exits 0 when all checks pass, 1 on a failed
check. A missing tool (qemu-system-x86_64, gcc, ld; vhost-device-vsock for the vsock
part) skips with one line, or exits 2 when ROLLBOX_REQUIRE_ALL=1.

usage: cargo xtask test-guest && python3 tests/test-guest/qemu/check.py [--keep] [--vmm PATH]
"""
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
GUEST = os.path.join(ROOT, "target", "test-guest", "test-guest")
SECTOR = 512
GUEST_CID = 3


def fnv1a(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "0x%016x" % h


class Guest:
    def __init__(self, argv, log_path):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.buf = b""

    def line(self, timeout=30.0):
        deadline = time.time() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError("no line from the guest within %.0f s (got %r)" % (timeout, self.buf))
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise EOFError("QEMU exited (status %s)" % self.proc.poll())
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace").rstrip("\r")

    def send(self, text):
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class Checker:
    def __init__(self, guest):
        self.guest = guest
        self.failures = 0
        self.passed = 0

    def expect(self, command, pattern, timeout=30.0):
        """Sends `command`; the answer must match `pattern` (a regex, whole line)."""
        self.guest.send(command)
        answer = self.guest.line(timeout)
        shown = command if len(command) < 60 else command[:57] + "..."
        if re.fullmatch(pattern, answer):
            self.passed += 1
            print("ok    %-40s -> %s" % (shown, answer[:70]))
        else:
            self.failures += 1
            print("FAIL  %-40s -> %r (wanted /%s/)" % (shown, answer[:200], pattern[:80]))
        return answer

    def check(self, what, ok):
        if ok:
            self.passed += 1
            print("ok    %s" % what)
        else:
            self.failures += 1
            print("FAIL  %s" % what)


REQUIRE_ALL = os.environ.get("ROLLBOX_REQUIRE_ALL") == "1"


def need(tool):
    """A missing tool skips the check with one line, or fails it under ROLLBOX_REQUIRE_ALL=1."""
    if shutil.which(tool) is None:
        print("skip: check.py needs %s (see tests/test-guest/README.md)" % tool)
        sys.exit(2 if REQUIRE_ALL else 0)


def build_shim(work):
    obj = os.path.join(work, "pvh-shim.o")
    elf = os.path.join(work, "pvh-shim.elf")
    subprocess.run(["gcc", "-O2", "-ffreestanding", "-nostdlib", "-mgeneral-regs-only", "-mno-red-zone",
                    "-fno-pic", "-static", "-fno-stack-protector", "-c", os.path.join(HERE, "pvh-shim.c"),
                    "-o", obj], check=True)
    subprocess.run(["ld", "-T", os.path.join(HERE, "pvh-shim.ld"), "-o", elf, obj], check=True)
    return elf


def host_echo(uds, port, payload, timeout=20.0):
    """Connects to the guest through the vsock backend's Unix socket; returns the echo."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(uds)
    s.sendall(b"CONNECT %d\n" % port)
    hello = b""
    while not hello.endswith(b"\n"):
        c = s.recv(1)
        if not c:
            break
        hello += c
    got = b""
    if hello.startswith(b"OK"):
        s.sendall(payload)
        while len(got) < len(payload):
            d = s.recv(65536)
            if not d:
                break
            got += d
    s.close()
    return hello, got


# The test guest finds its virtio devices on the command line: with ACPI on, rollbox-vmm names
# them in the DSDT instead.
VMM_CMDLINE = "console=ttyS0 reboot=k panic=1 pci=off acpi=off"


def vmm_argv(vmm, disk, ro, uds):
    return [vmm, "--kernel", GUEST, "--cmdline", VMM_CMDLINE, "--console", "stdout", "--memory-mib", "128",
            "--drive", disk + ",id=disk-zero", "--drive", ro + ",readonly",
            "--vsock-uds", uds, "--vsock-cid", str(GUEST_CID)]


def check_exit(ck, vmm, work, command, want_zero):
    """Boots the guest, sends `command`, and checks how the VMM exits."""
    disk = os.path.join(work, "exit.img")
    with open(disk, "wb") as f:
        f.truncate(1 << 20)
    uds = os.path.join(work, "exit.sock")
    argv = [vmm, "--kernel", GUEST, "--cmdline", VMM_CMDLINE, "--console", "stdout", "--memory-mib", "128",
            "--drive", disk]
    guest = Guest(argv, os.path.join(work, "vmm-%s.log" % command))
    try:
        ready = guest.line(30)
        guest.send(command)
        status = guest.proc.wait(timeout=30)
        ok = ready.endswith("ready") and ((status == 0) == want_zero)
        ck.check("`%s` ends the VMM with status %d (want %s)" % (command, status, "0" if want_zero else "non-zero"), ok)
    except (TimeoutError, EOFError, subprocess.TimeoutExpired) as e:
        ck.check("`%s` ends the VMM: %s" % (command, e), False)
    finally:
        guest.close()


def main():
    keep = "--keep" in sys.argv
    vmm = None
    if "--vmm" in sys.argv:
        at = sys.argv.index("--vmm")
        if at + 1 >= len(sys.argv):
            print("check.py: --vmm needs a path")
            sys.exit(2)
        vmm = os.path.abspath(sys.argv[at + 1])
    tools = ("gcc", "ld") if vmm is None else ()
    for tool in tools + (("qemu-system-x86_64",) if vmm is None else ()):
        need(tool)
    if not os.path.exists(GUEST):
        print("check.py: %s missing; run `cargo xtask test-guest` first" % GUEST)
        sys.exit(2)
    vsock = shutil.which("vhost-device-vsock") if vmm is None else vmm
    if vsock is None and REQUIRE_ALL:
        need("vhost-device-vsock")
    work = tempfile.mkdtemp(prefix="test-guest-check-")
    shim = build_shim(work) if vmm is None else None
    disk = os.path.join(work, "d.img")
    ro = os.path.join(work, "ro.img")
    with open(disk, "wb") as f:
        f.truncate(64 << 20)
    ro_content = bytes((i * 7 + 3) & 0xFF for i in range(16 * SECTOR))
    with open(ro, "wb") as f:
        f.write(ro_content)
        f.truncate(8 << 20)

    uds = os.path.join(work, "v.sock")
    argv = ["qemu-system-x86_64", "-M", "microvm,acpi=off,pic=off,pit=off,rtc=off,isa-serial=on,auto-kernel-cmdline=on",
            "-accel", "tcg", "-m", "128", "-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio",
            "-kernel", shim, "-device", "loader,file=" + GUEST, "-append", "console=ttyS0",
            "-global", "virtio-mmio.force-legacy=false",
            "-drive", "id=d0,file=%s,format=raw,if=none" % disk, "-device", "virtio-blk-device,drive=d0,serial=disk-zero",
            "-drive", "id=d1,file=%s,format=raw,if=none,readonly=on" % ro, "-device", "virtio-blk-device,drive=d1"]
    backend = None
    if vmm:
        argv = vmm_argv(vmm, disk, ro, uds)
    elif vsock:
        vhost = os.path.join(work, "vhost.sock")
        backend = subprocess.Popen([vsock, "--guest-cid", str(GUEST_CID), "--socket", vhost, "--uds-path", uds],
                                   stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "vsock.log"), "w"))
        for _ in range(100):
            if os.path.exists(vhost):
                break
            time.sleep(0.05)
        argv += ["-object", "memory-backend-memfd,id=mem,size=128M,share=on", "-machine", "memory-backend=mem",
                 "-chardev", "socket,id=c0,path=" + vhost, "-device", "vhost-user-vsock-device,chardev=c0"]
    else:
        print("skip  vsock checks: vhost-device-vsock not installed (cargo install vhost-device-vsock)")

    # Host side of guest-initiated connections. Port 5001 answers "pong:<line>" and
    # lingers, 5003 answers and closes at once, 5004 closes without answering.
    listeners = []
    if vsock:
        def serve(listener, reply, linger):
            while True:
                try:
                    c, _ = listener.accept()
                except OSError:
                    return
                data = b""
                while reply and not data.endswith(b"\n"):
                    d = c.recv(4096)
                    if not d:
                        break
                    data += d
                if reply:
                    c.sendall(b"pong:" + data)
                time.sleep(linger)
                c.close()
        for port, reply, linger in ((5001, True, 0.2), (5003, True, 0.0), (5004, False, 0.0)):
            listener = socket.socket(socket.AF_UNIX)
            listener.bind("%s_%d" % (uds, port))
            listener.listen(4)
            listeners.append(listener)
            threading.Thread(target=serve, args=(listener, reply, linger), daemon=True).start()

    guest = Guest(argv, os.path.join(work, "vmm.log"))
    big_sum = None
    ck = Checker(guest)
    try:
        t0 = time.time()
        ready = guest.line(60)
        ck.check("boot banner after %.2f s: %r" % (time.time() - t0, ready), ready == "rollbox-test-guest: ready")
        ck.expect("echo hello  world", r"OK hello  world")
        ck.expect("cmdline", r"OK console=ttyS0 .*virtio_mmio\.device=\w+@0x[0-9a-f]+:\d+.*")
        ck.expect("e820", r"OK \d+( 0x[0-9a-f]+:0x[0-9a-f]+:\d+)+")
        ck.expect("devices", r"OK 0x[0-9a-f]+:\d+:2 0x[0-9a-f]+:\d+:2" + (r" 0x[0-9a-f]+:\d+:19" if vsock else ""))
        ck.expect("blk-info 0", r"OK capacity=131072 ro=0 flush=1")
        ck.expect("blk-info 1", r"OK capacity=16384 ro=1 flush=1")
        ck.expect("blk-id 0", r"OK disk-zero")
        sector3 = bytes((i * 13 + 1) & 0xFF for i in range(SECTOR))
        ck.expect("blk-write 0 3 " + sector3.hex(), r"OK")
        ck.expect("blk-read 0 3 1", "OK " + sector3.hex())
        ck.expect("blk-write 0 4 00ff", r"OK")
        ck.expect("blk-read 1 0 2", "OK " + ro_content[: 2 * SECTOR].hex())
        ck.expect("blk-sum 1 0 16", "OK " + fnv1a(ro_content))
        ck.expect("blk-fill 0 100 40 0x5a", r"OK")
        ck.expect("blk-sum 0 100 40", "OK " + fnv1a(b"\x5a" * 40 * SECTOR))
        ck.expect("blk-flush 0", r"OK")
        ck.expect("blk-write 1 0 00", r"ERR status=[12]")
        ck.expect("blk-read 0 16384000 1", r"ERR status=[12]")
        for bad, pattern in [("blk-read 0 0 9", r"ERR count-out-of-range"), ("blk-read 7 0 1", r"ERR no-such-block-device"),
                             ("blk-write 0 0 abc", r"ERR bad-hex-length"), ("blk-write 0 0 zz", r"ERR bad-hex-digit"),
                             ("blk-fill 0 0 1 256", r"ERR byte-out-of-range"), ("hostile 0 nope", r"ERR unknown-hostile-kind"),
                             ("frobnicate", r"ERR unknown-command"), ("", r"ERR empty-command"),
                             ("echo " + "x" * 2100, r"ERR line-too-long")]:
            ck.expect(bad, pattern)
        for kind in ("oob", "loop", "long", "dir", "badnext", "badavail"):
            ck.expect("hostile 0 " + kind, r"OK survived")
            ck.expect("blk-read 0 3 1", "OK " + sector3.hex())
        # Snapshot and benchmark commands (one vCPU here, so smp-start must fail).
        ck.expect("generation", r"OK 0x[0-9a-f]+")
        ck.expect("prng 3", r"OK 0x0d83b3e29a21487a 0x54c44c79f1fe9d67 0xa845f342007a0e78")
        ck.expect("prng 1", r"OK 0x7d6e0b878a794779")
        ck.expect("prng 65", r"ERR count-out-of-range")
        ck.expect("compute 20000", r"progress 1")
        progress = [guest.line(60) for _ in range(9)]
        ck.check("compute prints progress 2..10", progress == ["progress %d" % k for k in range(2, 11)])
        ck.check("compute 20000 hash", guest.line(60) == "OK 0xebb0a3eaeb6176e9")
        ck.expect("touch 16 9", r"OK 4096")
        ck.expect("check 16 9", r"OK 0")
        ck.expect("check 16 8", r"OK 4096")
        ck.expect("touch 200 1", r"ERR not-covered-by-e820-ram")
        ck.expect("touch 0 1", r"ERR size-out-of-range")
        ck.expect("blk-post 0 3", r"OK")
        ck.expect("blk-read 0 3 1", r"ERR request-posted")
        ck.expect("blk-complete 0", "OK " + sector3.hex())
        ck.expect("blk-complete 0", r"ERR nothing-posted")
        for bench in ("bench-loop", "bench-pio", "bench-mmio"):
            ck.expect(bench + " 1000", r"OK")
        ck.expect("smp-count", r"OK 0")
        ck.expect("smp-start", r"ERR ap-did-not-start")
        if vsock:
            ck.expect("vsock-cid", "OK %d" % GUEST_CID)
            ck.expect("vsock-listen 5000", r"OK")
            ck.expect("vsock-listen 5002", r"OK")
            hello, got = host_echo(uds, 5000, b"hello guest\n")
            ck.check("host -> guest:5000 echo (%r)" % hello, got == b"hello guest\n")
            big = bytes(range(256)) * 400
            t0 = time.time()
            hello, got = host_echo(uds, 5002, big)
            ck.check("host -> guest:5002 echo of %d bytes (credit flow) in %.2f s" % (len(big), time.time() - t0), got == big)
            ck.expect("vsock-connect 5001 hi there", r"OK pong:hi there")
            hello, got = host_echo(uds, 5000, b"again\n")
            ck.check("echo still served after vsock-connect", got == b"again\n")
            ck.expect("vsock-connect 5001 second", r"OK pong:second")
            ck.expect("vsock-connect 5003 quick close", r"OK pong:quick close")
            ck.expect("vsock-connect 5004 no answer", r"ERR (connection-reset|timeout)")
            ck.expect("vsock-connect 5003 again", r"OK pong:again")
            ck.expect("echo still alive", r"OK still alive")
        t0 = time.time()
        big_sum = ck.expect("blk-sum 0 0 2048", r"OK 0x[0-9a-f]{16}", timeout=120)
        print("      blk-sum of 2048 sectors took %.2f s" % (time.time() - t0))
    except (TimeoutError, EOFError) as e:
        big_sum = None
        ck.check("guest answered: %s" % e, False)
    finally:
        guest.close()
        if backend:
            backend.kill()
            backend.wait()
        for listener in listeners:
            listener.close()

    with open(disk, "rb") as f:
        data = f.read(140 * SECTOR)
    ck.check("disk image holds the written sectors", data[3 * SECTOR:4 * SECTOR] == sector3
             and data[4 * SECTOR:5 * SECTOR] == b"\x00\xff" + bytes(SECTOR - 2)
             and data[100 * SECTOR:140 * SECTOR] == b"\x5a" * 40 * SECTOR)
    with open(disk, "rb") as f:
        whole = f.read(2048 * SECTOR)
    if big_sum is not None:
        ck.check("blk-sum 0 0 2048 matches the image", big_sum == "OK " + fnv1a(whole))
    with open(ro, "rb") as f:
        ck.check("read-only image unchanged", f.read(16 * SECTOR) == ro_content)
    if vmm:
        check_exit(ck, vmm, work, "poweroff", True)
        check_exit(ck, vmm, work, "reset", True)
        check_exit(ck, vmm, work, "crash", False)
    print("%d passed, %d failed (logs in %s)" % (ck.passed, ck.failures, work))
    if not keep and ck.failures == 0:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if ck.failures else 0)


if __name__ == "__main__":
    main()
