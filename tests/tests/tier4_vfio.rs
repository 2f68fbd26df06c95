//! Tier 4: VFIO passthrough with a Linux guest. In the nested lab, L1's QEMU has the emulated
//! `edu` device (1234:11e8) behind its emulated Intel IOMMU; the test binds it to `vfio-pci` in
//! L1, boots a Linux L2 with `--vfio`, and checks from inside the guest that the device is on
//! the guest's PCI bus, that its BAR 0 answers (identification, liveness and factorial
//! registers, through an mmap of sysfs `resource0`), that it DMAs guest RAM both ways, that its
//! MSI (programmed by hand through sysfs `config`, no guest driver) reaches the guest's vCPU,
//! and that all of it works again in a second VM.
//!
//! Runs in the nested lab with `--modprobe vfio-pci --qemu-arg -device --qemu-arg edu`;
//! elsewhere every test skips with its reason (ROLLBOX_REQUIRE_ALL=1 turns a skip into a
//! failure).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use rollbox_tests::linux::*;

/// QEMU's `edu` teaching device.
const EDU_VENDOR: &str = "0x1234";
const EDU_DEVICE: &str = "0x11e8";

/// A static guest tool: maps a sysfs `resourceN` file and reads (or writes, then reads) one
/// 32-bit register at OFFSET (our guest kernel has no /dev/mem, and memory BARs in sysfs can
/// only be mapped, not read); or, with `DEVDIR dma`, turns on bus mastering and has the edu
/// device copy 2 KiB of guest RAM into its buffer and back into another page (guest-physical
/// addresses from /proc/self/pagemap), which crosses the VFIO DMA mapping both ways.
const PCIPEEK_C: &str = r#"
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static volatile uint8_t *map_bar(const char *path, unsigned long len) {
    int fd = open(path, O_RDWR | O_SYNC);
    if (fd < 0) { perror(path); exit(1); }
    volatile uint8_t *p = mmap(0, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(1); }
    return p;
}

/* The guest-physical address of a locked page, from /proc/self/pagemap. */
static uint64_t phys(void *page) {
    int fd = open("/proc/self/pagemap", O_RDONLY);
    uint64_t entry = 0;
    if (fd < 0 || pread(fd, &entry, 8, ((uintptr_t)page / 4096) * 8) != 8) { perror("pagemap"); exit(1); }
    if (!(entry >> 63)) { fprintf(stderr, "page not present\n"); exit(1); }
    return (entry & ((1ULL << 55) - 1)) * 4096;
}

/* edu DMA of LEN bytes from src to dst (one side is the device buffer at 0x40000). QEMU 7.2's
   edu stops the whole machine (hw_error) on a transfer that ends at the buffer's end, so LEN
   stays below its 4 KiB. */
#define LEN 2048
static int edu_dma(volatile uint8_t *bar, uint64_t src, uint64_t dst, uint32_t cmd) {
    *(volatile uint64_t *)(bar + 0x80) = src;
    *(volatile uint64_t *)(bar + 0x88) = dst;
    *(volatile uint64_t *)(bar + 0x90) = LEN;
    *(volatile uint64_t *)(bar + 0x98) = cmd;
    for (int i = 0; i < 5000; i++) {
        if (!(*(volatile uint64_t *)(bar + 0x98) & 1)) return 0;
        usleep(1000);
    }
    return -1;
}

/* Programs the device's MSI capability by hand (no guest driver): one vector, VECTOR, to APIC
   ID 0, then has edu raise an interrupt (register 0x60). With no handler on VECTOR the guest
   kernel logs "No irq handler for vector". */
static int edu_msi(const char *dir, unsigned vector) {
    char path[512];
    snprintf(path, sizeof path, "%s/config", dir);
    int cfg = open(path, O_RDWR);
    uint8_t header[256];
    if (cfg < 0 || pread(cfg, header, 256, 0) != 256) { perror(path); return 1; }
    unsigned at = header[0x34] & ~3u;
    while (at && header[at] != 0x05) at = header[at + 1] & ~3u;
    if (!at) { printf("no MSI capability\n"); return 1; }
    uint16_t control = header[at + 2] | header[at + 3] << 8;
    int wide = control & 0x80;
    uint32_t addr = 0xfee00000, zero = 0, data = vector;
    uint16_t command = header[4] | header[5] << 8;
    command |= 0x6; /* memory space, bus master: an MSI is a memory write */
    control = (control & ~0x70) | 1;
    if (pwrite(cfg, &command, 2, 4) != 2 || pwrite(cfg, &addr, 4, at + 4) != 4 ||
        (wide && pwrite(cfg, &zero, 4, at + 8) != 4) ||
        pwrite(cfg, &data, 2, at + (wide ? 12 : 8)) != 2 || pwrite(cfg, &control, 2, at + 2) != 2) {
        perror("MSI capability"); return 1;
    }
    snprintf(path, sizeof path, "%s/resource0", dir);
    volatile uint8_t *bar = map_bar(path, 4096);
    *(volatile uint32_t *)(bar + 0x60) = 1;
    usleep(200000);
    *(volatile uint32_t *)(bar + 0x64) = 1;
    printf("msi raised on vector %u (capability at %#x)\n", vector, at);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[2], "msi") == 0) return edu_msi(argv[1], strtoul(argv[3], 0, 0));
    if (argc == 3 && strcmp(argv[2], "dma") == 0) {
        /* argv[1] is the device's sysfs directory. */
        char path[512];
        snprintf(path, sizeof path, "%s/config", argv[1]);
        int cfg = open(path, O_RDWR);
        uint16_t command = 0;
        if (cfg < 0 || pread(cfg, &command, 2, 4) != 2) { perror(path); return 1; }
        command |= 0x6; /* memory space, bus master */
        if (pwrite(cfg, &command, 2, 4) != 2) { perror("bus master"); return 1; }
        snprintf(path, sizeof path, "%s/resource0", argv[1]);
        volatile uint8_t *bar = map_bar(path, 4096);
        uint8_t *a, *b;
        if (posix_memalign((void **)&a, 4096, 4096) || posix_memalign((void **)&b, 4096, 4096)) return 1;
        for (int i = 0; i < 4096; i++) { a[i] = (uint8_t)(i * 7 + 3); b[i] = 0; }
        if (mlock(a, 4096) || mlock(b, 4096)) { perror("mlock"); return 1; }
        uint64_t pa = phys(a), pb = phys(b);
        if (edu_dma(bar, pa, 0x40000, 1)) { printf("timeout to device\n"); return 1; }
        if (edu_dma(bar, 0x40000, pb, 3)) { printf("timeout to RAM\n"); return 1; }
        for (int i = 0; i < LEN; i++)
            if (a[i] != b[i]) { printf("mismatch at %d (RAM %#lx -> %#lx)\n", i, (unsigned long)pa, (unsigned long)pb); return 1; }
        printf("dma ok %#lx %#lx\n", (unsigned long)pa, (unsigned long)pb);
        return 0;
    }
    if (argc < 3) { fprintf(stderr, "usage: pcipeek RESOURCE OFFSET [VALUE] | pcipeek DEVDIR dma\n"); return 2; }
    unsigned long off = strtoul(argv[2], 0, 0);
    volatile uint8_t *p = map_bar(argv[1], (off & ~4095UL) + 4096);
    volatile uint32_t *r = (volatile uint32_t *)(p + off);
    if (argc > 3) *r = (uint32_t)strtoul(argv[3], 0, 0);
    printf("0x%08x\n", *r);
    return 0;
}
"#;

/// The sysfs path in L1 of the first device `vendor`:`device`, or None.
fn find_device(vendor: &str, device: &str) -> Option<PathBuf> {
    let entries = std::fs::read_dir("/sys/bus/pci/devices").ok()?;
    entries.flatten().map(|e| e.path()).find(|dev| {
        let read = |f: &str| std::fs::read_to_string(dev.join(f)).unwrap_or_default();
        read("vendor").trim() == vendor && read("device").trim() == device
    })
}

/// `vendor`:`device`'s sysfs path when the device is there and vfio-pci is loaded; otherwise a
/// skip saying what is missing (`missing` for the device), and None.
fn device_for_vfio(test: &str, vendor: &str, device: &str, missing: &str) -> Option<PathBuf> {
    let Some(dev) = find_device(vendor, device) else {
        rollbox_tests::skip(test, missing);
        return None;
    };
    if !Path::new("/sys/bus/pci/drivers/vfio-pci").exists() {
        rollbox_tests::skip(
            test,
            "vfio-pci is not loaded: run the lab with --modprobe vfio-pci",
        );
        return None;
    }
    Some(dev)
}

/// As [`device_for_vfio`], with the device's backing file on L0 named by the variable `var`.
fn device_with_backing_file(
    test: &str,
    vendor: &str,
    device: &str,
    var: &str,
    missing: &str,
) -> Option<(PathBuf, std::ffi::OsString)> {
    let Some(backing) = std::env::var_os(var) else {
        rollbox_tests::skip(test, missing);
        return None;
    };
    Some((device_for_vfio(test, vendor, device, missing)?, backing))
}

/// QEMU's ivshmem-plain: a 64-bit prefetchable BAR 2 backed by a host file, shaped like a
/// GPU's BAR1.
const IVSHMEM_VENDOR: &str = "0x1af4";
const IVSHMEM_DEVICE: &str = "0x1110";

/// QEMU's NVMe controller.
const NVME_VENDOR: &str = "0x1b36";
const NVME_DEVICE: &str = "0x0010";
/// The sequential read checked by checksum (the backing file is larger).
const NVME_READ_MIB: usize = 256;
/// Where the guest writes its 1 MiB pattern: past the range the test reads over 9p.
const NVME_WRITE_MIB: usize = 264;

/// The sum of every CPU's count on the `/proc/interrupts` lines given.
fn nvme_interrupts(lines: &str) -> u64 {
    lines
        .lines()
        .flat_map(|l| {
            l.split_whitespace()
                .skip(1)
                .map_while(|f| f.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// 4 KiB direct reads for the IOPS figure, from a range no other read touches (MiB 272..).
const IOPS_READS: usize = 2048;
const IOPS_SKIP_4K: usize = 272 * 256;

/// The shell command that makes IOPS_READS direct 4 KiB reads from `block`.
fn iops_command(block: &str) -> String {
    format!(
        "dd if={block} of=/dev/null bs=4k count={IOPS_READS} skip={IOPS_SKIP_4K} iflag=direct 2>&1"
    )
}

/// Reads NVME_READ_MIB MiB from the controller at `dev` in L1 through L1's own nvme driver,
/// checks the checksum, and returns MiB/s and the IOPS of 4 KiB direct reads.
fn l1_nvme_read_mib_s(dev: &Path, want_sha: &str) -> (f64, f64) {
    if !dev.join("driver").exists() {
        assert!(
            Path::new("/sys/bus/pci/drivers/nvme").exists(),
            "L1 has no nvme driver for the baseline read: run the lab with --modprobe nvme"
        );
        let name = dev
            .file_name()
            .expect("a sysfs device name")
            .to_string_lossy()
            .into_owned();
        write_sysfs("/sys/bus/pci/drivers/nvme/bind", &name);
    }
    let namespace = std::fs::read_dir(dev.join("nvme"))
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .unwrap_or_else(|| {
            panic!(
                "{} has no nvme controller in L1 (nvme driver bound?)",
                dev.display()
            )
        });
    let block = format!("/dev/{namespace}n1");
    for _ in 0..100 {
        if Path::new(&block).exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let started = std::time::Instant::now();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "dd if={block} bs=1M count={NVME_READ_MIB} iflag=direct 2>/dev/null | sha256sum"
        ))
        .output()
        .expect("run dd in L1");
    let mib_s = NVME_READ_MIB as f64 / seconds(started);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.split_whitespace().next(),
        Some(want_sha),
        "L1's own read of {block} differs from the backing file"
    );
    let started = std::time::Instant::now();
    let out = Command::new("sh")
        .arg("-c")
        .arg(iops_command(&block))
        .output()
        .expect("run dd in L1");
    assert!(out.status.success(), "L1's 4 KiB reads: {out:?}");
    (mib_s, IOPS_READS as f64 / seconds(started))
}

/// The guest's sysfs path of `vendor`:`device` (bus 0), found through the agent.
fn guest_device(agent: &Agent, vendor: &str, device: &str) -> String {
    agent.sh(&format!(
        "for d in /sys/bus/pci/devices/*; do \
         [ \"$(cat $d/vendor) $(cat $d/device)\" = \"{vendor} {device}\" ] && echo $d; \
         done"
    ))
}

fn write_sysfs(path: &str, value: &str) {
    std::fs::write(path, value).unwrap_or_else(|e| panic!("echo {value} > {path}: {e}"));
}

/// Huge pages neither in use nor reserved by a mapping (HugePages_Free less HugePages_Rsvd).
fn huge_pages_free() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    let field = |name: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .expect(name)
    };
    field("HugePages_Free:").saturating_sub(field("HugePages_Rsvd:"))
}

/// Binds `dev` to vfio-pci (driver_override, unbind, bind), as an operator would.
fn bind_vfio_pci(dev: &Path) {
    let name = dev
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let driver = std::fs::read_link(dev.join("driver"))
        .ok()
        .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()));
    if driver.as_deref() == Some("vfio-pci") {
        return;
    }
    write_sysfs(&format!("{}/driver_override", dev.display()), "vfio-pci");
    if driver.is_some() {
        write_sysfs(&format!("{}/driver/unbind", dev.display()), &name);
    }
    write_sysfs("/sys/bus/pci/drivers/vfio-pci/bind", &name);
    let now = std::fs::read_link(dev.join("driver")).expect("driver after bind");
    assert!(
        now.ends_with("vfio-pci"),
        "{name} bound to {}",
        now.display()
    );
}

/// Runs rollbox-vmm with `--vfio dev` and returns its stderr, asserting that it failed at once
/// with one line that names the device and contains `want`.
fn refused(kernel: &Path, dev: &Path, want: &str) -> String {
    let out = Command::new(rollbox_tests::vmm_binary())
        .arg("--kernel")
        .arg(kernel)
        .arg("--vfio")
        .arg(dev)
        .output()
        .expect("run rollbox-vmm");
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(
        !out.status.success(),
        "--vfio {} was accepted",
        dev.display()
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&dev.display().to_string()) && stderr.contains(want),
        "{stderr}"
    );
    stderr
}

/// Compiles PCIPEEK_C statically into `dir`.
fn build_pcipeek(dir: &Path) -> Vec<u8> {
    let src = dir.join("pcipeek.c");
    let bin = dir.join("pcipeek");
    std::fs::write(&src, PCIPEEK_C).expect("write pcipeek.c");
    let out = Command::new("cc")
        .args(["-static", "-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc -static pcipeek.c: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&bin).expect("read pcipeek")
}

mod tier4 {
    use super::*;

    #[test]
    fn edu_passed_through_with_vfio_answers_from_a_linux_guest_twice() {
        let test = "tier4::edu_passed_through_with_vfio";
        let Some(fx) = fixtures(test) else {
            return;
        };
        let Some(edu) = device_for_vfio(
            test,
            EDU_VENDOR,
            EDU_DEVICE,
            "no edu device (1234:11e8): run the lab with --qemu-arg -device --qemu-arg edu",
        ) else {
            return;
        };
        // Not bound to vfio-pci yet (edu has no host driver): refused, naming the device.
        let bound =
            std::fs::read_link(edu.join("driver")).is_ok_and(|driver| driver.ends_with("vfio-pci"));
        if !bound {
            eprintln!("{}", refused(&fx.path("OUR_VMLINUX"), &edu, "not vfio-pci"));
        }
        bind_vfio_pci(&edu);
        let work = tempfile::tempdir().expect("tempdir");
        let pcipeek = build_pcipeek(work.path());
        let edu_arg = edu.display().to_string();
        for round in 1..=2 {
            let name = format!("edu{round}");
            let mut vm = LinuxVm::boot(
                work.path(),
                &name,
                &fx.path("OUR_VMLINUX"),
                &fx.path("BUSYBOX_ROOTFS"),
                &agent_cmdline(""),
                &[
                    "--vcpus",
                    "1",
                    "--memory-mib",
                    "256",
                    "--vfio",
                    &edu_arg,
                    "--level",
                    "Info",
                ],
            );
            let agent = vm.agent();
            if round == 1 {
                // A second VM cannot take the device this one holds; this one goes on.
                eprintln!("{}", refused(&fx.path("OUR_VMLINUX"), &edu, "in use"));
            }
            let found = guest_device(&agent, EDU_VENDOR, EDU_DEVICE);
            assert!(
                found.starts_with("/sys/bus/pci/devices/0000:00:"),
                "{name}: the guest has no edu device on bus 0: {found:?}\n{}\n{}",
                agent.sh("ls /sys/bus/pci/devices; dmesg | grep -i pci | tail -30"),
                vm.report()
            );
            let resource = agent.sh(&format!("head -1 {found}/resource"));
            eprintln!("{name}: edu at {found}, BAR 0 {resource}");
            assert!(
                resource.starts_with("0x00000000c"),
                "{name}: BAR 0 is not in the 32-bit PCI window: {resource}"
            );
            agent.sh("mkdir -p /tmp");
            agent.write_file("/tmp/pcipeek", &pcipeek);
            agent.sh("chmod 755 /tmp/pcipeek");
            let peek = |args: &str| {
                let (code, out, err) =
                    agent.sh_status(&format!("/tmp/pcipeek {found}/resource0 {args}"));
                assert_eq!(code, Some(0), "{name}: pcipeek {args}: {out} {err}");
                out.trim().to_string()
            };
            assert_eq!(
                peek("0x0"),
                "0x010000ed",
                "{name}: edu identification register"
            );
            assert_eq!(
                peek("0x4 0x12345678"),
                "0xedcba987",
                "{name}: liveness (NOT)"
            );
            assert_eq!(peek("0x4 0x0"), "0xffffffff", "{name}: liveness (NOT)");
            // Factorial: write N to 0x08; the device computes while status bit 0 is set.
            peek("0x8 5");
            let mut status = peek("0x20");
            for _ in 0..100 {
                if status == "0x00000000" {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
                status = peek("0x20");
            }
            assert_eq!(peek("0x8"), "0x00000078", "{name}: 5! from the device");
            // DMA both ways through the IOMMU mapping of guest memory.
            let (code, out, err) = agent.sh_status(&format!("/tmp/pcipeek {found} dma"));
            assert_eq!(
                code,
                Some(0),
                "{name}: edu DMA: {out} {err}\n{}",
                vm.report()
            );
            eprintln!("{name}: {}", out.trim());
            // MSI through VFIO: the device's interrupt reaches the guest's vCPU 0 on vector 208.
            let before = agent.sh("dmesg | grep 'No irq handler for vector' || true");
            assert!(
                !before.contains(".208 "),
                "{name}: vector 208 before the MSI: {before}"
            );
            let (code, out, err) = agent.sh_status(&format!("/tmp/pcipeek {found} msi 208"));
            assert_eq!(
                code,
                Some(0),
                "{name}: edu MSI: {out} {err}\n{}",
                vm.report()
            );
            let mut delivered = String::new();
            for _ in 0..50 {
                delivered = agent.sh("dmesg | grep 'No irq handler for vector' || true");
                if delivered.contains(".208 ") {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            assert!(
                delivered.contains(".208 "),
                "{name}: the MSI on vector 208 never reached the guest: {out}\n{}\n{}",
                agent.sh("dmesg | tail -20"),
                vm.report()
            );
            eprintln!("{name}: {}; guest: {}", out.trim(), delivered.trim());
            // BAR 0 was a KVM memory slot (the mmap path), not trapped accesses.
            assert!(
                vm.stderr()
                    .contains("BAR 0 at 0xc0000000 mapped into the guest"),
                "{name}: BAR 0 was not mapped as a KVM slot\n{}",
                vm.report()
            );
            agent.start("poweroff -f");
            let status = vm.wait();
            assert_eq!(status.code(), Some(0), "{name}: poweroff\n{}", vm.report());
        }
    }

    #[test]
    fn ivshmem_16_gib_bar_lands_above_4_gib_and_guest_writes_reach_its_backing_file() {
        let test = "tier4::ivshmem_16_gib_bar";
        let Some(fx) = fixtures(test) else {
            return;
        };
        let Some((dev, backing)) = device_with_backing_file(
            test,
            IVSHMEM_VENDOR,
            IVSHMEM_DEVICE,
            "ROLLBOX_IVSHMEM_FILE",
            "no ivshmem-plain device with ROLLBOX_IVSHMEM_FILE naming its backing file (see README, PCI and VFIO)",
        ) else {
            return;
        };
        bind_vfio_pci(&dev);
        let work = tempfile::tempdir().expect("tempdir");
        let pcipeek = build_pcipeek(work.path());
        // Start to agent without the device first, for the figure below (same guest and flags).
        let started = std::time::Instant::now();
        let mut plain = LinuxVm::boot(
            work.path(),
            "plain",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            &agent_cmdline(""),
            &["--vcpus", "1", "--memory-mib", "256", "--level", "Info"],
        );
        let plain_agent = plain.agent();
        let plain_s = seconds(started);
        plain_agent.start("poweroff -f");
        assert_eq!(plain.wait().code(), Some(0), "poweroff\n{}", plain.report());
        let started = std::time::Instant::now();
        let dev_arg = dev.display().to_string();
        let mut vm = LinuxVm::boot(
            work.path(),
            "ivshmem",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            &agent_cmdline(""),
            &[
                "--vcpus",
                "1",
                "--memory-mib",
                "256",
                "--vfio",
                &dev_arg,
                "--level",
                "Info",
            ],
        );
        let agent = vm.agent();
        let bar_s = seconds(started);
        eprintln!(
            "figure: start to agent (lab, ratio only): with the 16 GiB BAR passed through \
             {bar_s:.2} s, without {plain_s:.2} s, ratio {:.2}",
            bar_s / plain_s
        );
        let found = guest_device(&agent, IVSHMEM_VENDOR, IVSHMEM_DEVICE);
        assert!(
            found.starts_with("/sys/bus/pci/devices/0000:00:"),
            "no ivshmem in the guest: {found:?}\n{}",
            vm.report()
        );
        let bar2 = agent.sh(&format!("sed -n 3p {found}/resource"));
        eprintln!("ivshmem: {found}, BAR 2 {bar2}");
        let fields: Vec<u64> = bar2
            .split_whitespace()
            .filter_map(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok())
            .collect();
        assert_eq!(fields.len(), 3, "{bar2}");
        let (start, end) = (fields[0], fields[1]);
        assert_eq!(end - start + 1, 16 << 30, "BAR 2 is 16 GiB: {bar2}");
        assert!(
            start >= 1 << 32 && start % (16 << 30) == 0,
            "BAR 2 above 4 GiB, aligned: {bar2}"
        );
        assert!(
            vm.stderr()
                .contains(&format!("BAR 2 at {start:#x} mapped into the guest")),
            "BAR 2 was not mapped as a KVM slot\n{}",
            vm.report()
        );
        agent.sh("mkdir -p /tmp");
        agent.write_file("/tmp/pcipeek", &pcipeek);
        agent.sh("chmod 755 /tmp/pcipeek");
        let marks = [
            (0x0u64, 0x5a5a_a5a5u32),
            ((16u64 << 30) - 4096, 0x0bad_cafe),
        ];
        for (offset, value) in marks {
            let (code, out, err) = agent.sh_status(&format!(
                "/tmp/pcipeek {found}/resource2 {offset:#x} {value:#x}"
            ));
            assert_eq!(code, Some(0), "pcipeek at {offset:#x}: {out} {err}");
            assert_eq!(
                out.trim(),
                format!("{value:#010x}"),
                "read back at {offset:#x}"
            );
        }
        agent.start("poweroff -f");
        assert_eq!(vm.wait().code(), Some(0), "poweroff\n{}", vm.report());
        // The host (L0) file behind the BAR holds what the L2 guest wrote.
        let file = std::fs::File::open(&backing).expect("open the ivshmem backing file");
        for (offset, value) in marks {
            let mut word = [0u8; 4];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut word, offset)
                .expect("read the backing file");
            assert_eq!(
                u32::from_le_bytes(word),
                value,
                "backing file at {offset:#x}"
            );
        }
    }

    #[test]
    fn nvme_passed_through_reads_and_writes_its_backing_file_with_msix_interrupts() {
        let test = "tier4::nvme_passed_through";
        let Some(fx) = fixtures(test) else {
            return;
        };
        let Some((dev, backing)) = device_with_backing_file(
            test,
            NVME_VENDOR,
            NVME_DEVICE,
            "ROLLBOX_NVME_FILE",
            "no QEMU NVMe controller with ROLLBOX_NVME_FILE naming its backing file (see README, PCI and VFIO)",
        ) else {
            return;
        };
        // What the host wrote into the backing file (read before the guest writes).
        let file = std::fs::File::open(&backing).expect("open the NVMe backing file");
        let mut head = vec![0u8; 1 << 20];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0).expect("read the file");
        assert!(
            head.iter().any(|&b| b != 0),
            "the NVMe backing file starts with zeros"
        );
        let mut first = vec![0u8; NVME_READ_MIB << 20];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut first, 0).unwrap_or_else(|e| {
            panic!(
                "the NVMe backing file needs {NVME_READ_MIB} MiB (scripts/test.sh makes it): {e}"
            )
        });
        let first_sha = sha256_hex(&first);
        drop(first);
        // The baseline: the same read in L1 through its own nvme driver, before VFIO takes it.
        let (l1_mib_s, l1_iops) = l1_nvme_read_mib_s(&dev, &first_sha);
        bind_vfio_pci(&dev);
        let work = tempfile::tempdir().expect("tempdir");
        let dev_arg = dev.display().to_string();
        let mut vm = LinuxVm::boot(
            work.path(),
            "nvme",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            &agent_cmdline(""),
            &[
                "--vcpus",
                "2",
                "--memory-mib",
                "256",
                "--vfio",
                &dev_arg,
                "--level",
                "Info",
            ],
        );
        let agent = vm.agent();
        let (code, out, err) = agent.sh_status(
            "for i in $(seq 100); do [ -b /dev/nvme0n1 ] && break; sleep 0.1; done; \
             dd if=/dev/nvme0n1 of=/tmp/head bs=1M count=1 2>&1",
        );
        assert_eq!(
            code,
            Some(0),
            "no /dev/nvme0n1 or read failed: {out} {err}\n{}\n{}",
            agent.sh("dmesg | grep -i -e nvme -e pci | tail -30"),
            vm.report()
        );
        assert!(
            agent.read_file("/tmp/head") == head,
            "the guest read other bytes than the backing file's first MiB"
        );
        // 256 MiB read in the guest: the same bytes, and the controller's interrupts rise.
        let before = nvme_interrupts(&agent.sh("grep -i nvme /proc/interrupts"));
        let started = std::time::Instant::now();
        let sum = agent.sh(&format!(
            "dd if=/dev/nvme0n1 bs=1M count={NVME_READ_MIB} 2>/dev/null | sha256sum"
        ));
        let l2_mib_s = NVME_READ_MIB as f64 / seconds(started);
        let after = nvme_interrupts(&agent.sh("grep -i nvme /proc/interrupts"));
        assert_eq!(
            sum.split_whitespace().next(),
            Some(first_sha.as_str()),
            "the guest's {NVME_READ_MIB} MiB read differs from the backing file"
        );
        assert!(
            after > before,
            "nvme interrupts did not rise over a {NVME_READ_MIB} MiB read: {before} -> {after}"
        );
        let started = std::time::Instant::now();
        let (code, out, err) = agent.sh_status(&iops_command("/dev/nvme0n1"));
        let l2_iops = IOPS_READS as f64 / seconds(started);
        assert_eq!(code, Some(0), "the guest's 4 KiB direct reads: {out} {err}");
        eprintln!(
            "figure: NVMe 4 KiB direct reads (lab, ratio only): L2 through VFIO {l2_iops:.0} IOPS, \
             L1 directly {l1_iops:.0} IOPS, ratio {:.2}",
            l2_iops / l1_iops
        );
        eprintln!(
            "figure: NVMe sequential read of {NVME_READ_MIB} MiB (lab, ratio only): L2 through VFIO \
             {l2_mib_s:.1} MiB/s, L1 directly {l1_mib_s:.1} MiB/s, ratio {:.2}; \
             nvme interrupts {before} -> {after}",
            l2_mib_s / l1_mib_s
        );
        // A new pattern past the range read above (L1 reads the file over 9p, whose page cache
        // would still hold the old bytes there), written by the guest, read by the host after
        // the VM ends.
        let written = pattern(1 << 20, 0x9);
        agent.write_file("/tmp/new", &written);
        let (code, out, err) = agent.sh_status(&format!(
            "dd if=/tmp/new of=/dev/nvme0n1 bs=1M seek={NVME_WRITE_MIB} count=1 2>&1 && sync"
        ));
        assert_eq!(code, Some(0), "write to /dev/nvme0n1: {out} {err}");
        // The controller's vectors are MSI-X in the guest, and they fired.
        let modes = agent.sh(&format!(
            "d=$(grep -l {NVME_DEVICE} /sys/bus/pci/devices/*/device); \
             cat $(dirname $d)/msi_irqs/*"
        ));
        let interrupts = agent.sh("grep -i nvme /proc/interrupts");
        eprintln!(
            "nvme: {} vectors, modes {:?}; /proc/interrupts:\n{interrupts}",
            modes.lines().count(),
            modes.lines().collect::<BTreeSet<_>>()
        );
        assert!(
            !modes.is_empty() && modes.lines().all(|m| m == "msix"),
            "the guest's nvme vectors are not MSI-X: {modes:?}"
        );
        let fired = nvme_interrupts(&interrupts);
        assert!(fired > 0, "no nvme interrupts counted:\n{interrupts}");
        assert!(
            vm.stderr().contains("MSI-X vector(s) enabled"),
            "rollbox-vmm did not enable MSI-X through VFIO\n{}",
            vm.report()
        );
        agent.start("poweroff -f");
        assert_eq!(vm.wait().code(), Some(0), "poweroff\n{}", vm.report());
        let mut back = vec![0u8; 1 << 20];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut back, (NVME_WRITE_MIB as u64) << 20)
            .expect("read the file where the guest wrote");
        assert!(
            back == written,
            "the backing file at {NVME_WRITE_MIB} MiB lacks the guest's write"
        );
    }

    /// `rollbox serve --gpu BDF=edu` (a LabDaemon: every sandbox is deleted on drop), driven
    /// with `rollbox ARGS`.
    struct GpuDaemon(LabDaemon);

    impl GpuDaemon {
        const KEY: &'static str = "gpu-lab-key-0123";

        fn start(edu: &Path) -> GpuDaemon {
            let bdf = edu.file_name().expect("bdf").to_string_lossy().into_owned();
            let extra = ["--gpu".to_string(), format!("{bdf}=edu")];
            GpuDaemon(LabDaemon::start(Self::KEY, &extra, None))
        }

        fn log(&self) -> String {
            self.0.log()
        }

        /// `rollbox ARGS`: (success, stdout, stderr).
        fn cli(&self, args: &[&str]) -> (bool, String, String) {
            let out = self.0.cli(args);
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }

        fn ok(&self, args: &[&str]) -> String {
            let (ok, stdout, stderr) = self.cli(args);
            assert!(ok, "rollbox {args:?}: {stderr}\n{}", self.log());
            stdout
        }

        fn holder(&self) -> serde_json::Value {
            let list: serde_json::Value =
                serde_json::from_str(&self.ok(&["gpu", "ls", "--json"])).expect("json");
            list["gpus"][0]["holder"].clone()
        }
    }

    /// The daemon's GPUs: edu bound to vfio-pci is the node's one GPU; a sandbox asking for
    /// it boots with it passed through its jail (the guest sees 1234:11e8 on its PCI bus), a
    /// second is refused naming the holder, as are a snapshot and a pause, and the device is
    /// free again once the sandbox is deleted; its memory is in 2 MiB huge pages (the daemon
    /// asks for them when the host has enough free). Then the issue's program: rollbox's SDK runs a
    /// `@function(gpu="edu", volumes=[...])` on a template with python, which sees the device
    /// and writes what it found to the volume, read back from the host.
    #[test]
    fn daemon_gives_a_sandbox_the_edu_gpu_exclusively() {
        let test = "tier4::daemon_gives_a_sandbox_the_edu_gpu_exclusively";
        let Some(fx) = fixtures(test) else {
            return;
        };
        let Some(edu) = device_for_vfio(
            test,
            EDU_VENDOR,
            EDU_DEVICE,
            "no edu device (1234:11e8): run the lab with --qemu-arg -device --qemu-arg edu",
        ) else {
            return;
        };
        bind_vfio_pci(&edu);
        // Huge pages for the GPU sandbox's memory (L1 is the lab's own: nothing else uses them).
        write_sysfs("/proc/sys/vm/nr_hugepages", "160");
        let daemon = GpuDaemon::start(&edu);
        assert_eq!(daemon.holder(), serde_json::Value::Null);
        let kernel = fx.path("OUR_VMLINUX").display().to_string();
        let rootfs = fx.path("BUSYBOX_ROOTFS").display().to_string();
        daemon.ok(&[
            "template",
            "add",
            "busybox",
            "--kernel",
            &kernel,
            "--rootfs",
            &rootfs,
            "--memory-mib",
            "256",
            "--cmdline",
            &agent_cmdline(""),
        ]);
        let created = daemon.ok(&[
            "sandbox", "create", "busybox", "--ttl", "900", "--gpu", "edu", "--label", "gpu=edu",
            "--json",
        ]);
        let sandbox: serde_json::Value = serde_json::from_str(&created).expect("json");
        let id = sandbox["id"].as_str().expect("id").to_string();
        let bdf = edu.file_name().expect("bdf").to_string_lossy().into_owned();
        assert_eq!(sandbox["gpus"], serde_json::json!([bdf]), "{sandbox}");
        assert_eq!(daemon.holder(), serde_json::json!(id));
        let free = huge_pages_free();
        assert!(
            free <= 160 - 128,
            "the 256 MiB GPU guest is not in huge pages: {free} of 160 still free"
        );
        let ids = daemon.ok(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "cat /sys/bus/pci/devices/*/vendor /sys/bus/pci/devices/*/device",
        ]);
        assert!(
            ids.contains(EDU_VENDOR) && ids.contains(EDU_DEVICE),
            "the guest has no edu device: {ids}\n{}",
            daemon.log()
        );
        let waited = std::time::Instant::now();
        let (ok, _, refused) = daemon.cli(&[
            "sandbox",
            "create",
            "busybox",
            "--ttl",
            "60",
            "--gpu",
            "edu",
            "--gpu-wait",
            "2",
        ]);
        assert!(
            !ok && refused.contains(&format!("held by {id}")) && refused.contains("waited"),
            "{refused}"
        );
        assert!(
            waited.elapsed().as_secs_f64() >= 2.0,
            "it waited gpu_wait_s"
        );
        let (ok, _, refused) = daemon.cli(&["sandbox", "snapshot", &id]);
        assert!(!ok && refused.contains("holds GPU"), "{refused}");
        let (ok, _, refused) = daemon.cli(&["sandbox", "pause", &id]);
        assert!(!ok && refused.contains("holds GPU"), "{refused}");
        daemon.ok(&["sandbox", "rm", &id]);
        assert_eq!(
            daemon.holder(),
            serde_json::Value::Null,
            "freed with its sandbox"
        );

        // The issue's program: a `@function(gpu=..., volumes=[...])` of rollbox's SDK, on a
        // template with python, gets the device and writes its result to the volume.
        let python = match rollbox_tests::venv_python("scripts/sdk-venv.sh", &[]) {
            Ok(python) => python,
            Err(reason) => return rollbox_tests::skip(test, &format!("no SDK venv: {reason}")),
        };
        let rootfs = fx.path("CODE_INTERPRETER_ROOTFS").display().to_string();
        daemon.ok(&[
            "template",
            "add",
            "python",
            "--kernel",
            &kernel,
            "--rootfs",
            &rootfs,
            "--memory-mib",
            "256",
            "--cmdline",
            &agent_cmdline(""),
        ]);
        let out = Command::new(&python)
            .args(["-c", GPU_FUNCTION])
            .env("ROLLBOX_SOCKET", daemon.0.socket())
            .env("ROLLBOX_API_KEY", GpuDaemon::KEY)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .expect("python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("gpu function: ok"),
            "{stdout}\n{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            daemon.log()
        );
        println!("{stdout}");
        assert_eq!(
            daemon.holder(),
            serde_json::Value::Null,
            "freed after the call"
        );
    }

    /// `update_policy` of the issue, with the lab's edu device as the GPU.
    const GPU_FUNCTION: &str = r#"
import glob
from rollbox_sdk import Client, Volume, function

rb = Client()

@function(template="python", gpu="edu", volumes=[Volume("ckpt", "./data")], timeout_s=600)
def update_policy(version):
    ids = sorted(
        open(d + "/vendor").read().strip() + ":" + open(d + "/device").read().strip()
        for d in glob.glob("/sys/bus/pci/devices/*")
    )
    with open(f"data/policy-v{version}.txt", "w") as f:
        f.write("\n".join(ids))
    return ids

ids = update_policy.remote(43)
print("devices in the function's sandbox:", ids)
assert "0x1234:0x11e8" in ids, ids
assert rb.read_volume_file("ckpt", "policy-v43.txt").decode().split("\n") == ids
print("gpu function: ok")
"#;
}
