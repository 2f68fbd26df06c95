//! Tier 4: Linux under `rollbox-vmm`. Real kernels (ours as vmlinux and bzImage, Debian's with
//! an initramfs) boot root filesystems that `rollbox image build` made, with `rollbox-agent` as
//! init, and the tests drive them through the agent over vsock: boot shapes, power-off, reboot
//! and panic, the clock, snapshots with every restore backend, fork, deterministic reset,
//! Docker, and the real virtio drivers against our devices.
//!
//! This needs KVM with hardware virtualization. On these build machines that is the nested lab:
//! `scripts/test.sh` runs this binary inside it (`scripts/lab/run.sh`) with the fixtures that
//! `scripts/lab/tier4-fixtures.sh` prepared (ROLLBOX_TIER4_FIXTURES). Elsewhere every test skips
//! with its reason, and ROLLBOX_REQUIRE_ALL=1 turns a skip into a failure. On the host,
//! `cargo test --workspace` filters these tests out with `--skip tier4::`.
//!
//! Figures (boot and restore to agent) go to stderr; they are never asserted.

use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{DockerRunRequest, ExecEvent, OutputStream};
use rollbox_tests::linux::*;
use rollbox_tests::rollbox_binary;

mod tier4 {
    use super::*;

    #[test]
    fn our_kernel_boots_as_vmlinux_and_bzimage_with_kvm_clock_and_powers_off() {
        let Some(fx) = fixtures("tier4::our_kernel_boots_as_vmlinux_and_bzimage") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        for kernel in ["OUR_VMLINUX", "OUR_BZIMAGE"] {
            let name = kernel.to_lowercase();
            let mut vm = LinuxVm::boot(
                work.path(),
                &name,
                &fx.path(kernel),
                &fx.path("BUSYBOX_ROOTFS"),
                &agent_cmdline(""),
                &["--vcpus", "2", "--memory-mib", "256"],
            );
            let agent = vm.agent();
            assert_eq!(agent.sh("grep -c ^processor /proc/cpuinfo"), "2");
            assert_eq!(
                agent.sh("cat /sys/devices/system/clocksource/clocksource0/current_clocksource"),
                "kvm-clock"
            );
            let dmesg = agent.sh("dmesg");
            assert!(
                clock_complaints(&dmesg).is_empty(),
                "{kernel}: the kernel complains about the clock: {:?}",
                clock_complaints(&dmesg)
            );
            assert!(
                dmesg.contains("ACPI: RSDP"),
                "{kernel}: no ACPI tables found"
            );
            note_platform_warnings(&name, &dmesg);
            // The rollbox CLI reaches the same agent.
            let out = Command::new(rollbox_binary())
                .args(["exec", "--vsock-uds"])
                .arg(vm.vsock())
                .args(["--", "uname", "-s"])
                .output()
                .expect("rollbox exec");
            assert!(out.status.success(), "rollbox exec: {out:?}");
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Linux");
            agent.start("poweroff -f");
            let status = vm.wait();
            assert_eq!(
                status.code(),
                Some(0),
                "{kernel}: poweroff\n{}",
                vm.report()
            );
        }
    }

    #[test]
    fn every_vcpu_comes_online_with_1_and_4_vcpus_and_reboot_ends_with_0() {
        let Some(fx) = fixtures("tier4::every_vcpu_comes_online") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        for (vcpus, online) in [("1", "0"), ("4", "0-3")] {
            let name = format!("vcpus{vcpus}");
            let mut vm = LinuxVm::boot(
                work.path(),
                &name,
                &fx.path("OUR_VMLINUX"),
                &fx.path("BUSYBOX_ROOTFS"),
                &agent_cmdline(""),
                &["--vcpus", vcpus, "--memory-mib", "256"],
            );
            let agent = vm.agent();
            assert_eq!(agent.sh("cat /sys/devices/system/cpu/online"), online);
            let dmesg = agent.sh("dmesg");
            assert!(
                clock_complaints(&dmesg).is_empty(),
                "{:?}",
                clock_complaints(&dmesg)
            );
            agent.start("reboot -f");
            assert_eq!(vm.wait().code(), Some(0), "reboot\n{}", vm.report());
        }
    }

    #[test]
    fn memory_from_128_mib_to_4_gib_including_above_the_mmio_gap() {
        let Some(fx) = fixtures("tier4::memory_from_128_mib_to_4_gib") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        for mib in [128u64, 4096] {
            let name = format!("mem{mib}");
            let mut vm = LinuxVm::boot(
                work.path(),
                &name,
                &fx.path("OUR_VMLINUX"),
                &fx.path("BUSYBOX_ROOTFS"),
                &agent_cmdline(""),
                &["--vcpus", "1", "--memory-mib", &mib.to_string()],
            );
            let agent = vm.agent();
            let total_kib: u64 = agent
                .sh("awk '/^MemTotal/ { print $2 }' /proc/meminfo")
                .parse()
                .expect("MemTotal");
            assert!(
                total_kib > mib * 1024 * 8 / 10 && total_kib <= mib * 1024,
                "{mib} MiB guest has MemTotal {total_kib} KiB"
            );
            if mib > 3072 {
                let iomem = agent.sh("cat /proc/iomem");
                assert!(
                    iomem.contains("100000000-13fffffff : System RAM"),
                    "RAM above the MMIO gap is missing:\n{iomem}"
                );
                // Fill 256 MiB of tmpfs: the allocator takes the Normal zone (above 4 GiB) first.
                let free_normal = "awk '/zone +Normal/ { z = 1 } z && /nr_free_pages/ { print $2; exit }' /proc/zoneinfo";
                let before: u64 = agent.sh(free_normal).parse().expect("free pages");
                agent.sh("dd if=/dev/zero of=/dev/shm/fill bs=1M count=256 2>/dev/null && sync");
                let after: u64 = agent.sh(free_normal).parse().expect("free pages");
                assert!(
                    before.saturating_sub(after) >= 50_000,
                    "the Normal zone (above 4 GiB) was not used: {before} -> {after} free pages"
                );
                assert_eq!(
                    agent.sh("cmp -n 268435456 /dev/shm/fill /dev/zero && echo same"),
                    "same"
                );
            }
            agent.start("poweroff -f");
            assert_eq!(vm.wait().code(), Some(0), "{}", vm.report());
        }
    }

    #[test]
    fn a_distro_kernel_boots_with_an_initramfs() {
        let Some(fx) = fixtures("tier4::a_distro_kernel_boots_with_an_initramfs") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let initrd = fx.text("DISTRO_INITRD");
        let mut vm = LinuxVm::boot(
            work.path(),
            "distro",
            &fx.path("DISTRO_KERNEL"),
            &fx.path("BUSYBOX_ROOTFS"),
            "console=ttyS0 reboot=k panic=1 loglevel=4",
            &["--vcpus", "2", "--memory-mib", "512", "--initrd", &initrd],
        );
        let agent = vm.agent();
        assert_eq!(agent.sh("uname -r"), fx.text("DISTRO_RELEASE"));
        assert_eq!(agent.sh("cat /sys/devices/system/cpu/online"), "0-1");
        let dmesg = agent.sh("dmesg");
        assert!(
            clock_complaints(&dmesg).is_empty(),
            "{:?}",
            clock_complaints(&dmesg)
        );
        note_platform_warnings("distro", &dmesg);
        agent.start("poweroff -f");
        assert_eq!(vm.wait().code(), Some(0), "{}", vm.report());
    }

    #[test]
    fn a_kernel_panic_is_reported_as_a_panic() {
        let Some(fx) = fixtures("tier4::a_kernel_panic_is_reported_as_a_panic") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        // init exits at once, so the kernel panics ("Attempted to kill init").
        let mut vm = LinuxVm::boot(
            work.path(),
            "panic",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            "console=ttyS0 reboot=k panic=1 loglevel=4 init=/bin/false",
            &["--memory-mib", "256"],
        );
        let status = vm.wait();
        assert_eq!(
            status.code(),
            Some(1),
            "a panic must not be a clean exit\n{}",
            vm.report()
        );
        assert!(
            vm.stderr().contains("the guest kernel panicked"),
            "{}",
            vm.report()
        );
        assert!(vm.console().contains("Kernel panic"), "{}", vm.report());
    }

    #[test]
    fn snapshots_restore_with_cow_uffd_and_copy_with_the_right_wall_clock() {
        let Some(fx) = fixtures("tier4::snapshots_restore") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let snapshot = work.path().join("snapshot");
        {
            let mut vm = LinuxVm::boot(
                work.path(),
                "parent",
                &fx.path("OUR_VMLINUX"),
                &fx.path("BUSYBOX_ROOTFS"),
                &agent_cmdline(""),
                &["--vcpus", "2", "--memory-mib", "256"],
            );
            let agent = vm.agent();
            // State that lives only in guest memory.
            agent.sh("hostname snap-parent && echo kept-in-memory > /dev/shm/marker");
            drop(agent);
            vm.snapshot(&snapshot);
        }
        // The snapshot waits a while, as a real one would.
        std::thread::sleep(Duration::from_secs(3));
        let restores: [(&str, &[&str]); 4] = [
            ("cow", &["--restore-backend", "cow"]),
            (
                "uffd",
                &["--restore-backend", "uffd", "--record-working-set"],
            ),
            (
                "uffd-prefetch",
                &["--restore-backend", "uffd", "--prefetch"],
            ),
            ("copy", &["--restore-backend", "copy"]),
        ];
        for (name, args) in restores {
            let mut vm = LinuxVm::restore(work.path(), name, &snapshot, args);
            let agent = vm.agent();
            assert_eq!(agent.sh("hostname"), "snap-parent", "{name}");
            assert_eq!(agent.sh("cat /dev/shm/marker"), "kept-in-memory", "{name}");
            let guest: f64 = agent.sh("date +%s").parse().expect("date");
            let host = unix_seconds();
            assert!(
                (guest - host).abs() < 3.0,
                "{name}: guest wall clock {guest} vs host {host}\n{}",
                vm.report()
            );
            // A fresh vsock connection from the host, and traffic both ways on it.
            let data = pattern(1 << 20, 7);
            agent.write_file("/tmp/probe", &data);
            assert_eq!(agent.read_file("/tmp/probe"), data, "{name}");
            vm.kill();
        }
    }

    #[test]
    fn fork_makes_8_clones_that_answer_and_differ_in_rng_machine_id_and_hostname() {
        let Some(fx) = fixtures("tier4::fork_makes_8_unique_clones") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let mut parent = LinuxVm::boot(
            work.path(),
            "parent",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            &agent_cmdline(""),
            &["--vcpus", "1", "--memory-mib", "256"],
        );
        let agent = parent.agent();
        let parent_id = agent.sh("cat /etc/machine-id 2>/dev/null || echo none");
        drop(agent);
        let started = Instant::now();
        let mut clones = parent.clones(8, &work.path().join("fork"), |_| Vec::new());
        let mut seen: [BTreeSet<String>; 3] = Default::default();
        for clone in &mut clones {
            let agent = clone.agent();
            // Read first, before anything else could reseed on the agent's behalf.
            let random = agent.sh("head -c 32 /dev/urandom | od -An -tx1 -v | tr -d ' \\n'");
            assert_eq!(random.len(), 64, "{random}");
            seen[0].insert(random);
            seen[1].insert(agent.sh("cat /etc/machine-id"));
            seen[2].insert(agent.sh("hostname"));
            let dmesg = agent.sh("dmesg");
            assert!(
                dmesg.contains("crng reseeded due to virtual machine fork"),
                "the kernel's VMGenID driver did not reseed:\n{dmesg}"
            );
        }
        eprintln!(
            "fork of 8: all clones answered {:.2} s after the pause",
            seconds(started)
        );
        for (what, values) in ["/dev/urandom", "machine-id", "hostname"].iter().zip(&seen) {
            assert_eq!(
                values.len(),
                8,
                "{what} is not unique across clones: {values:?}"
            );
        }
        assert!(
            !seen[1].contains(&parent_id),
            "a clone kept the parent's machine-id"
        );
        // The parent runs on.
        assert_eq!(parent.agent().sh("echo parent"), "parent");
    }

    #[test]
    fn deterministic_restores_repeat_urandom_and_a_prng() {
        let Some(fx) = fixtures("tier4::deterministic_restores_repeat") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let snapshot = work.path().join("snapshot");
        {
            let mut vm = LinuxVm::boot(
                work.path(),
                "det",
                &fx.path("OUR_VMLINUX"),
                &fx.path("BUSYBOX_ROOTFS"),
                &agent_cmdline(""),
                &["--deterministic", "--vcpus", "1", "--memory-mib", "256"],
            );
            let agent = vm.agent();
            assert_eq!(
                agent.sh("grep -c -w -e rdrand -e rdseed /proc/cpuinfo || true"),
                "0",
                "a deterministic machine must hide RDRAND and RDSEED"
            );
            // The CRNG reseeds on a timer (every uptime/2 seconds, at most 60 s, early on):
            // reseed it just before the snapshot, late enough that the next reseed is at least
            // 15 s of guest time away from every read below.
            agent.sh("while [ $(cut -d. -f1 /proc/uptime) -lt 30 ]; do sleep 1; done");
            // Without RDRAND the guest's CRNG may not be initialized yet: 64 credited bytes
            // initialize it, and the reseed then starts its interval afresh.
            let applied = agent.call("reseed", agent.client.reseed(&pattern(64, 4)));
            assert!(
                applied.detail.contains("reseeded the CRNG"),
                "{}",
                applied.detail
            );
            drop(agent);
            vm.snapshot(&snapshot);
        }
        // The read comes first and alone: every exec draws from the CRNG too (AT_RANDOM, ASLR),
        // so a pipeline whose processes start in a scheduler-dependent order would not repeat.
        let read = "head -c 32 /dev/urandom > /tmp/r; r=$(od -An -tx1 -v /tmp/r | tr -d ' \\n'); \
                    echo $r; awk -v s=$((0x${r%${r#????????}})) \
                    'BEGIN { srand(s); for (i = 0; i < 4; i++) printf \"%d \", int(rand() * 1e9) }'";
        let mut runs = Vec::new();
        for (i, args) in [
            &["--deterministic"][..],
            &["--deterministic"][..],
            &["--new-generation"][..],
        ]
        .iter()
        .enumerate()
        {
            let mut vm = LinuxVm::restore(work.path(), &format!("restore{i}"), &snapshot, args);
            let agent = vm.agent();
            runs.push(agent.sh(read));
            vm.kill();
        }
        assert_eq!(
            runs[0], runs[1],
            "two deterministic restores of one snapshot differ"
        );
        assert_ne!(
            runs[0], runs[2],
            "a new generation must give new randomness"
        );
    }

    #[test]
    fn docker_runs_in_a_debian_guest() {
        let Some(fx) = fixtures("tier4::docker_runs_in_a_debian_guest") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let mut vm = LinuxVm::boot(
            work.path(),
            "docker",
            &fx.path("OUR_VMLINUX"),
            &fx.path("DEBIAN_ROOTFS"),
            &agent_cmdline(""),
            &["--vcpus", "2", "--memory-mib", "1024"],
        );
        let agent = vm.agent();
        assert!(agent.sh("cat /etc/os-release").contains("bookworm"));
        let t = Instant::now();
        let ensured = agent.runtime.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(400),
                agent.client.docker_ensure(Some(Duration::from_secs(360))),
            )
            .await
        });
        match ensured {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("dockerd did not start: {e}\n{}", vm.report()),
            Err(_) => panic!("docker_ensure: no answer within 400 s\n{}", vm.report()),
        }
        eprintln!("docker: dockerd ready in {:.1} s", seconds(t));
        let image = std::fs::read(fx.path("BUSYBOX_IMAGE_TAR")).expect("busybox image tar");
        agent.write_file("/root/busybox.tar", &image);
        let t = Instant::now();
        agent.sh("docker load -i /root/busybox.tar >/dev/null && rm /root/busybox.tar");
        eprintln!("docker: load in {:.1} s", seconds(t));
        let t = Instant::now();
        let mut request = DockerRunRequest {
            image: "rollbox-test/busybox:latest".into(),
            command: vec![
                "sh".into(),
                "-c".into(),
                "echo tier4-docker-marker; exit 3".into(),
            ],
            env: Default::default(),
            workdir: None,
            user: None,
            network: Some("none".into()),
            extra_args: vec!["--rm".into()],
            timeout_ms: Some(600_000),
            kill_grace_ms: None,
            output_limit_bytes: None,
            stdin: false,
            ensure_daemon: true,
        };
        request.env.insert("TIER".into(), "4".into());
        let (stdout, status) = agent.call("docker run", async {
            let mut handle = agent.client.docker_run(request).await?;
            let mut stdout = Vec::new();
            loop {
                match handle.next_event().await? {
                    Some(ExecEvent::Output {
                        stream: OutputStream::Stdout,
                        data,
                        ..
                    }) => stdout.extend(data),
                    Some(ExecEvent::Exited(status)) => {
                        return Ok::<_, rollbox_agent_protocol::ClientError>((stdout, status))
                    }
                    Some(_) => {}
                    None => panic!("docker run ended without an exit status"),
                }
            }
        });
        eprintln!("docker: run in {:.1} s", seconds(t));
        assert_eq!(
            String::from_utf8_lossy(&stdout).trim(),
            "tier4-docker-marker"
        );
        assert_eq!(status.code, Some(3), "{status:?}");
        // Debian minbase has no poweroff binary: the agent ends the machine itself.
        let applied = agent.call("power_off", agent.client.power_off(false));
        assert!(applied.applied, "{}", applied.detail);
        assert_eq!(vm.wait().code(), Some(0), "{}", vm.report());
    }

    #[test]
    fn parallel_block_io_and_100_mib_over_vsock_verify_by_checksum() {
        let Some(fx) = fixtures("tier4::parallel_block_io_and_vsock_transfer") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        // A data disk: four 8 MiB regions the host fills, four the guest fills.
        const REGION: usize = 8 << 20;
        let data_disk = work.path().join("data.img");
        let disk = std::fs::File::create(&data_disk).expect("data disk");
        disk.set_len((8 * REGION) as u64).expect("size data disk");
        let mut host_sums = Vec::new();
        for i in 0..4 {
            let bytes = pattern(REGION, 100 + i as u64);
            disk.write_all_at(&bytes, (i * REGION) as u64)
                .expect("seed data disk");
            host_sums.push(sha256_hex(&bytes));
        }
        disk.sync_all().expect("sync data disk");
        let data = format!("{},id=data", data_disk.display());
        let mut vm = LinuxVm::boot(
            work.path(),
            "io",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            &agent_cmdline(""),
            &["--vcpus", "2", "--memory-mib", "512", "--drive", &data],
        );
        let agent = vm.agent();
        // Parallel reads of the host's regions.
        let read_all = (0..4)
            .map(|i| {
                format!(
                    "(dd if=/dev/vdb bs=1M skip={} count=8 2>/dev/null | sha256sum | cut -d' ' -f1 > /tmp/r{i}) &",
                    i * 8
                )
            })
            .collect::<Vec<_>>()
            .join(" ");
        agent.sh(&format!("{read_all} wait"));
        for (i, want) in host_sums.iter().enumerate() {
            assert_eq!(&agent.sh(&format!("cat /tmp/r{i}")), want, "region {i}");
        }
        // Parallel writes of guest data into the other four regions.
        let write_all = (4..8)
            .map(|i| {
                format!(
                    "(head -c {REGION} /dev/urandom > /tmp/w{i} && sha256sum /tmp/w{i} | cut -d' ' -f1 > /tmp/s{i} && \
                     dd if=/tmp/w{i} of=/dev/vdb bs=1M seek={} conv=fsync 2>/dev/null) &",
                    i * 8
                )
            })
            .collect::<Vec<_>>()
            .join(" ");
        agent.sh(&format!("{write_all} wait; sync"));
        let guest_sums: Vec<String> = (4..8)
            .map(|i| agent.sh(&format!("cat /tmp/s{i}")))
            .collect();

        // 100 MiB host -> guest and back over vsock, through the agent's file transfer.
        let big = pattern(100 << 20, 42);
        let big_sum = sha256_hex(&big);
        let t = Instant::now();
        agent.write_file("/tmp/big", &big);
        let to_guest = seconds(t);
        assert_eq!(agent.sh("sha256sum /tmp/big | cut -d' ' -f1"), big_sum);
        let t = Instant::now();
        let back = agent.read_file("/tmp/big");
        let from_guest = seconds(t);
        assert_eq!(back.len(), big.len());
        assert_eq!(sha256_hex(&back), big_sum);
        eprintln!(
            "vsock: 100 MiB host->guest {:.1} MiB/s, guest->host {:.1} MiB/s (nested lab)",
            100.0 / to_guest,
            100.0 / from_guest
        );
        agent.start("poweroff -f");
        assert_eq!(vm.wait().code(), Some(0), "{}", vm.report());
        // What the guest wrote is on the host's disk.
        for (i, want) in (4..8).zip(&guest_sums) {
            let mut region = vec![0u8; REGION];
            std::fs::File::open(&data_disk)
                .and_then(|f| f.read_exact_at(&mut region, (i * REGION) as u64))
                .expect("read data disk");
            assert_eq!(
                &sha256_hex(&region),
                want,
                "region {i} as the guest wrote it"
            );
        }
    }
}
