//! Tier 4: a real Linux kernel with an initramfs boots under `rollbox-vmm`, and its `/init`
//! talks over virtio-blk and vsock. This needs KVM with hardware virtualization; on PVM or
//! emulation-only KVM (the build machines) Linux cannot boot, so the test says so and skips.
//!
//! The kernel comes from `ROLLBOX_LINUX_KERNEL`, else from `kernel-config/build.sh` (cached).

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rollbox_tests::{raw_image, workspace_root, Vm};

/// Why Linux can't run under this host's KVM, or None when it can.
fn hardware_virtualization_missing() -> Option<String> {
    if !Path::new("/dev/kvm").exists() {
        return Some("no /dev/kvm".into());
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Some("/dev/kvm is PVM-flavoured KVM (kvm_pvm): guest kernel code is emulated and Linux cannot boot".into());
    }
    if !Path::new("/sys/module/kvm_intel").exists() && !Path::new("/sys/module/kvm_amd").exists() {
        return Some("neither kvm_intel nor kvm_amd is loaded: no hardware virtualization".into());
    }
    None
}

fn linux_kernel() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("ROLLBOX_LINUX_KERNEL") {
        return Some(PathBuf::from(path));
    }
    let out = Command::new("bash")
        .arg(workspace_root().join("kernel-config/build.sh"))
        .output()
        .ok()?;
    let dir = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()?
        .trim()
        .to_string();
    let vmlinux = Path::new(&dir).join("vmlinux");
    vmlinux.exists().then_some(vmlinux)
}

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
echo "rollbox-tier4: init running"
echo "rollbox-tier4: disk says $(/bin/busybox dd if=/dev/vda bs=16 count=1 2>/dev/null)"
echo -n "written-by-linux" | /bin/busybox dd of=/dev/vda bs=512 seek=1 conv=fsync 2>/dev/null
echo "rollbox-tier4: listening"
/bin/vsock-echo listen 1024 1
echo "rollbox-tier4: done"
/bin/busybox reboot -f
"#;

fn build_initramfs(dir: &Path) -> PathBuf {
    let root = dir.join("initramfs");
    std::fs::create_dir_all(root.join("bin")).expect("mkdir");
    std::fs::copy("/bin/busybox", root.join("bin/busybox"))
        .expect("busybox-static is needed: apt-get install busybox-static");
    let echo_src = workspace_root().join("scripts/tcg/vsock-echo.c");
    let status = Command::new("gcc")
        .args(["-O2", "-static", "-o"])
        .arg(root.join("bin/vsock-echo"))
        .arg(&echo_src)
        .status()
        .expect("gcc");
    assert!(status.success(), "building vsock-echo failed");
    std::fs::write(root.join("init"), INIT).expect("write init");
    let out = dir.join("initramfs.cpio");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "chmod +x init bin/* && find . | cpio -o -H newc --quiet > {}",
            out.display()
        ))
        .current_dir(&root)
        .status()
        .expect("cpio");
    assert!(status.success(), "cpio failed");
    out
}

#[test]
fn linux_boots_to_init_and_uses_virtio_blk_and_vsock() {
    if let Some(reason) = hardware_virtualization_missing() {
        eprintln!("SKIP tier 4 (Linux under rollbox-vmm): {reason}");
        return;
    }
    let Some(kernel) = linux_kernel() else {
        panic!("tier 4 needs a Linux kernel: set ROLLBOX_LINUX_KERNEL or make kernel-config/build.sh work");
    };
    let scratch = tempfile::tempdir().expect("tempdir");
    let initrd = build_initramfs(scratch.path());
    let kernel = kernel.display().to_string();
    let initrd = initrd.display().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    raw_image(&dir.path().join("disk.img"), 4 << 20);
    std::fs::File::options()
        .write(true)
        .open(dir.path().join("disk.img"))
        .and_then(|f| f.write_all_at(b"hello from host!", 0))
        .expect("seed disk");
    let args: Vec<String> = [
        "--kernel",
        &kernel,
        "--initrd",
        &initrd,
        "--memory-mib",
        "256",
        "--cmdline",
        "console=ttyS0 reboot=k panic=1 pci=off rdinit=/init",
        "--drive",
        "{dir}/disk.img",
        "--vsock-uds",
        "{dir}/v.sock",
        "--vsock-cid",
        "3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut vm = Vm::spawn_raw(&args, dir);
    vm.expect_line("rollbox-tier4: init running");
    vm.expect_line("rollbox-tier4: disk says hello from host!");
    vm.expect_line("rollbox-tier4: listening");
    let mut stream = UnixStream::connect(vm.path("v.sock")).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    stream.write_all(b"CONNECT 1024\n").expect("connect");
    let mut ok = [0u8; 3];
    stream.read_exact(&mut ok).expect("OK");
    assert_eq!(&ok, b"OK ");
    let mut rest = Vec::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        stream.read_exact(&mut b).expect("OK line");
        rest.push(b[0]);
    }
    stream.write_all(b"echo me\n").expect("send");
    let mut echo = [0u8; 8];
    stream.read_exact(&mut echo).expect("echo");
    assert_eq!(&echo, b"echo me\n");
    drop(stream);
    vm.expect_line("rollbox-tier4: done");
    assert!(vm.wait(Duration::from_secs(60)).success());
    let mut sector = [0u8; 16];
    std::fs::File::open(vm.path("disk.img"))
        .expect("open")
        .read_exact_at(&mut sector, 512)
        .expect("read");
    assert_eq!(&sector, b"written-by-linux");
}
