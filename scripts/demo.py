#!/usr/bin/env python3
"""rollbox demo: boot, devices, pause, snapshot, restore and fork, with the test guest."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMM = os.path.join(ROOT, "target/release/rollbox-vmm")
GUEST = os.path.join(ROOT, "target/test-guest/test-guest")


def api(sock, method, path, body=None):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    data = json.dumps(body) if body is not None else ""
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(data)}\r\n\r\n{data}".encode())
    resp = b""
    while b"\r\n\r\n" not in resp:
        resp += s.recv(65536)
    head, _, body_bytes = resp.partition(b"\r\n\r\n")
    length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")), 0)
    while len(body_bytes) < length:
        body_bytes += s.recv(65536)
    return int(head.split()[1]), body_bytes.decode()


class Guest:
    def __init__(self, args):
        self.p = subprocess.Popen([VMM] + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def line(self):
        return self.p.stdout.readline().decode().rstrip("\n")

    def cmd(self, c):
        self.p.stdin.write((c + "\n").encode())
        self.p.stdin.flush()
        answer = self.line()
        while not answer.startswith(("OK", "ERR")):  # progress lines of long commands
            answer = self.line()
        print(f"  guest> {c:<28} {answer[:70]}")
        return answer


def vsock_echo(uds, text):
    s = socket.socket(socket.AF_UNIX)
    for _ in range(200):
        try:
            s.connect(uds)
            break
        except OSError:
            time.sleep(0.01)
    f = s.makefile("rwb", buffering=0)
    f.write(b"CONNECT 1024\n")
    ok = f.readline().decode().strip()
    f.write(text.encode() + b"\n")
    return ok, f.readline().decode().strip()


def main():
    work = tempfile.mkdtemp(prefix="rollbox-demo-")
    disk = os.path.join(work, "disk.img")
    with open(disk, "wb") as f:
        f.truncate(8 << 20)
    api_sock = os.path.join(work, "api.sock")
    print(f"== booting the test guest in rollbox-vmm (files in {work})")
    t0 = time.monotonic()
    g = Guest(["--kernel", GUEST, "--cmdline", "console=ttyS0 reboot=k panic=1 pci=off acpi=off", "--memory-mib", "256", "--drive", disk, "--vsock-uds",
               os.path.join(work, "v.sock"), "--vsock-cid", "3", "--api-sock", api_sock])
    print(f"  {g.line()}   ({(time.monotonic() - t0) * 1000:.1f} ms from process start)")
    g.cmd("cmdline")
    g.cmd("devices")
    g.cmd("blk-write 0 1 68656c6c6f2066726f6d20746865206775657374")
    with open(disk, "rb") as f:
        f.seek(512)
        print(f"  host reads the disk: {f.read(20)!r}")
    g.cmd("vsock-listen 1024")
    print(f"  host -> guest vsock echo: {vsock_echo(os.path.join(work, 'v.sock'), 'ping')}")
    g.cmd("compute 30000")
    print("== pause, Full snapshot, resume")
    snap = os.path.join(work, "snap")
    os.makedirs(snap)
    api(api_sock, "PATCH", "/vm", {"state": "Paused"})
    t0 = time.monotonic()
    print("  snapshot/create:", api(api_sock, "PUT", "/snapshot/create", {
        "snapshot_type": "Full", "snapshot_path": f"{snap}/vmstate", "mem_file_path": f"{snap}/memory"})[0],
        f"({(time.monotonic() - t0) * 1000:.1f} ms)")
    api(api_sock, "PATCH", "/vm", {"state": "Resumed"})
    expected = g.cmd("prng 3")
    print("== restore in a new process (copy-on-write memory)")
    t0 = time.monotonic()
    r = Guest(["--restore", snap, "--vsock-uds", os.path.join(work, "restored.sock")])
    got = r.cmd("prng 3")
    print(f"  first answer {(time.monotonic() - t0) * 1000:.1f} ms after process start;"
          f" same sequence as the parent: {got == expected}")
    print(f"  restored guest still listens on vsock: {vsock_echo(os.path.join(work, 'restored.sock'), 'again')}")
    r.p.stdin.write(b"poweroff\n")
    r.p.stdin.flush()
    print(f"  restored guest powered off, exit status {r.p.wait()}")
    print("== fork the running VM into 4 clones: a snapshot that resumes it, then 4 restores")
    fork = os.path.join(work, "fork")
    os.makedirs(fork)
    t0 = time.monotonic()
    api(api_sock, "PATCH", "/vm", {"state": "Paused"})
    # The disk is copied while the VM is paused, so it matches the memory.
    shutil.copyfile(disk, os.path.join(fork, "disk.img"))
    status, body = api(api_sock, "PUT", "/snapshot/create", {
        "snapshot_path": f"{fork}/vmstate", "mem_file_path": f"{fork}/memory",
        "rollbox": {"resume_vm": True}})
    result = json.loads(body)
    print(f"  snapshot/create: {status}, parent paused {result['paused_ms']:.1f} ms,"
          f" memory written in {result['elapsed_ms']:.1f} ms")
    clones = []
    for i in range(4):
        copy = os.path.join(fork, f"disk-{i}.img")
        shutil.copyfile(os.path.join(fork, "disk.img"), copy)
        uds = os.path.join(fork, f"clone-{i}.sock")
        clones.append((Guest(["--restore", fork, "--new-generation", "--drive-override", f"drive0={copy}",
                              "--vsock-uds", uds]), uds))
    for i, (c, uds) in enumerate(clones):
        ok, echo = vsock_echo(uds, f"clone {i}")
        print(f"  clone {i} pid {c.p.pid}: vsock {ok!r} echo {echo!r}")
    print(f"  all 4 clones answered {(time.monotonic() - t0) * 1000:.1f} ms after the pause")
    for c, _ in clones:
        c.p.terminate()
        c.p.wait()
    g.cmd("echo parent still running")
    g.p.stdin.write(b"poweroff\n")
    g.p.stdin.flush()
    print(f"== parent powered off, exit status {g.p.wait()}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
