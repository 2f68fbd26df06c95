//! Tier 2: PCI on this machine's real KVM. MSI routing without a guest (the test drives
//! `vmm::devices::pci::router::MsiRouter` against a real VM fd and reads vCPU 0's local APIC
//! to see that the interrupts arrived), and `--pci` with the test guest reading configuration
//! space through CF8/CFC and ECAM, before and after a snapshot restored with every backend and
//! in the clones of a fork (a snapshot that resumes the parent, then restores); old-format,
//! damaged and mismatched PCI state.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rollbox_tests::kvm_available;
use snapshot::format::{read_state_file, write_state_file};
use vmm::devices::pci::msix::{Msix, Signal, CONTROL_ENABLE, TABLE_ENTRY_SIZE};
use vmm::devices::pci::router::{MsiRouter, VectorIrq};
use vmm::persist::MicroVmState;
use vmm::vstate::vm::{open_kvm, Vm};

/// Local APIC registers (offsets in KVM's `kvm_lapic_state::regs`).
const APIC_SPURIOUS_VECTOR: usize = 0xf0;
const APIC_SOFTWARE_ENABLE: u8 = 1;
const APIC_IRR: usize = 0x200;
/// An MSI to APIC ID 0, physical destination, fixed delivery.
const MSI_TO_CPU0: u64 = 0xfee0_0000;

#[test]
fn msi_routes_irqfds_and_signal_msi_reach_the_local_apic() {
    if !kvm_available() {
        return;
    }
    let kvm = open_kvm().expect("open /dev/kvm");
    let vm = Vm::new(&kvm).expect("create VM");
    vm.setup_irqchip().expect("irqchip");
    let vcpu = vm.fd().create_vcpu(0).expect("create vCPU 0");
    // The APIC accepts fixed interrupts only when software-enabled.
    let mut lapic = vcpu.get_lapic().expect("KVM_GET_LAPIC");
    lapic.regs[APIC_SPURIOUS_VECTOR + 1] |= APIC_SOFTWARE_ENABLE as std::os::raw::c_char;
    lapic.regs[APIC_SPURIOUS_VECTOR] = 0xff_u8 as std::os::raw::c_char;
    vcpu.set_lapic(&lapic).expect("KVM_SET_LAPIC");
    let requested = |vector: u8| {
        let lapic = vcpu.get_lapic().expect("KVM_GET_LAPIC");
        let reg = APIC_IRR + usize::from(vector / 32) * 0x10;
        let word = u32::from_le_bytes(std::array::from_fn(|i| lapic.regs[reg + i] as u8));
        word & (1 << (vector % 32)) != 0
    };
    let wait_for = |vector: u8| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !requested(vector) {
            assert!(
                Instant::now() < deadline,
                "vector {vector:#x} never reached the local APIC's IRR"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };

    // An MSI-X vector as a guest would program it, then routed through a GSI and an irqfd.
    let mut msix = Msix::new(2).expect("msix");
    let vector = 1u16;
    let entry = u64::from(vector) * TABLE_ENTRY_SIZE;
    msix.write_table(entry, &(MSI_TO_CPU0 as u32).to_le_bytes())
        .expect("address");
    msix.write_table(entry + 8, &0x41u32.to_le_bytes())
        .expect("data");
    msix.write_table(entry + 12, &0u32.to_le_bytes())
        .expect("unmask");
    msix.control_written(CONTROL_ENABLE);
    let message = msix
        .message(vector)
        .expect("routable once enabled and unmasked");
    assert_eq!(msix.signal(vector), Ok(Signal::Deliver(message)));

    let mut router = MsiRouter::for_kvm(&kvm);
    assert!(
        router.capacity() > 0,
        "KVM_CAP_IRQ_ROUTING reports no room for MSI routes"
    );
    let gsi = router.allocate().expect("GSI");
    router.set_route(gsi, Some(message)).expect("route");
    router.apply(vm.fd()).expect("KVM_SET_GSI_ROUTING");
    let irqfd = router.irqfd(vm.fd(), gsi).expect("irqfd");
    assert!(!requested(0x41));
    irqfd.write(1).expect("signal the irqfd");
    wait_for(0x41);

    // Without a route, KVM_SIGNAL_MSI delivers directly.
    assert!(!requested(0x52));
    MsiRouter::signal(
        vm.fd(),
        vmm::devices::pci::msix::MsiMessage {
            address: MSI_TO_CPU0,
            data: 0x52,
        },
    )
    .expect("KVM_SIGNAL_MSI");
    wait_for(0x52);

    // A masked vector loses its route; the table without it applies.
    router.set_route(gsi, None).expect("unroute");
    router
        .apply(vm.fd())
        .expect("KVM_SET_GSI_ROUTING without MSI routes");
    router.release(gsi).expect("release");

    // A device's eventfd vector (VFIO's path): a signal while masked is kept, not dropped,
    // and arrives at the unmask; once as a pending bit the VMM took, once left in the eventfd.
    for (data, taken) in [(0x61u32, true), (0x62, false)] {
        let gsi = router.allocate().expect("GSI");
        let message = vmm::devices::pci::msix::MsiMessage {
            address: MSI_TO_CPU0,
            data,
        };
        let mut irq = VectorIrq::new(&router, vm.fd(), gsi).expect("irqfd");
        irq.mask(vm.fd()).expect("mask");
        router.apply(vm.fd()).expect("no route while masked");
        irq.fd().write(1).expect("the device signals while masked");
        std::thread::sleep(Duration::from_millis(50));
        assert!(!requested(data as u8), "delivered while masked");
        let pending = taken && irq.take_pending();
        assert_eq!(pending, taken, "the masked signal is pending");
        router.set_route(gsi, Some(message)).expect("route");
        router.apply(vm.fd()).expect("route on unmask");
        irq.unmask(vm.fd(), pending).expect("unmask");
        wait_for(data as u8);
        irq.mask(vm.fd()).expect("mask");
        router.release(gsi).expect("release");
    }
}

/// The host bridge's vendor and device ID as one dword (1b36:0008).
const HOST_BRIDGE_ID: &str = "0x81b36";

/// The guest reads the host bridge through CF8/CFC and ECAM, and nothing at slot 1.
fn reads_the_host_bridge(vm: &mut rollbox_tests::Vm, who: &str) {
    assert_eq!(vm.ok("pci-read 0 0"), HOST_BRIDGE_ID, "{who}: CF8/CFC");
    assert_eq!(
        vm.ok("pci-read 0 8"),
        "0x6000000",
        "{who}: class 06/00: host bridge"
    );
    assert_eq!(
        vm.ok("pci-read 1 0"),
        "0xffffffff",
        "{who}: slot 1 is empty"
    );
    assert_eq!(vm.ok("mmio-read 0xe0000000"), HOST_BRIDGE_ID, "{who}: ECAM");
    assert_eq!(vm.ok("mmio-read 0xe0008000"), "0xffffffff", "{who}");
}

/// Pauses `vm` and takes a Full snapshot into `dir` (vmstate + memory).
fn snapshot(vm: &rollbox_tests::Vm, dir: &Path) {
    std::fs::create_dir_all(dir).expect("snapshot dir");
    let api = vm.api();
    api.pause().unwrap_or_else(|e| panic!("{e}"));
    api.create_snapshot(&rollbox_tests::snapshot_params("Full", dir))
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Restores `dir` in a new process with `backend`.
fn restore(dir: &Path, backend: &str) -> rollbox_tests::Vm {
    let scratch = tempfile::tempdir().expect("tempdir");
    let args: Vec<String> = [
        "--restore",
        &dir.display().to_string(),
        "--vsock-uds",
        "{dir}/v.sock",
        "--restore-backend",
        backend,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    rollbox_tests::Vm::spawn_raw(&args, scratch)
}

/// A restore of `dir` that fails; returns its one line of stderr.
fn restore_fails(dir: &Path) -> String {
    let out = std::process::Command::new(rollbox_tests::vmm_binary())
        .arg("--restore")
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run rollbox-vmm");
    assert!(
        !out.status.success(),
        "the restore of {} ran",
        dir.display()
    );
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(stderr.trim().lines().count(), 1, "want one line: {stderr}");
    stderr
}

/// A copy of the snapshot in `from` at `to`, its state rewritten by `change`.
fn rewritten(from: &Path, to: &Path, change: impl FnOnce(&mut MicroVmState)) -> PathBuf {
    std::fs::create_dir_all(to).expect("mkdir");
    // The memory file and its identity file are shared; only the state differs.
    for entry in std::fs::read_dir(from).expect("snapshot dir").flatten() {
        if entry.file_name() != "vmstate" {
            std::fs::hard_link(entry.path(), to.join(entry.file_name())).expect("link");
        }
    }
    let mut state: MicroVmState = read_state_file(&from.join("vmstate")).expect("read state");
    change(&mut state);
    write_state_file(&to.join("vmstate"), &state).expect("write state");
    to.to_path_buf()
}

#[test]
fn with_pci_the_guest_finds_the_host_bridge_and_keeps_it_across_snapshot_and_restore() {
    if !kvm_available() {
        return;
    }
    let mut vm = rollbox_tests::boot_with_api(&["--pci"]);
    reads_the_host_bridge(&mut vm, "booted");
    let scratch = tempfile::tempdir().expect("tempdir");
    let snap = scratch.path().join("snap");
    snapshot(&vm, &snap);
    vm.api().resume().unwrap_or_else(|e| panic!("{e}"));
    reads_the_host_bridge(&mut vm, "parent after the snapshot");
    for backend in ["cow", "uffd", "copy"] {
        let mut clone = restore(&snap, backend);
        reads_the_host_bridge(&mut clone, backend);
        assert_eq!(clone.ok("echo restored"), "restored", "{}", clone.stderr());
    }

    // A state file as builds before PCI state wrote it (no `pci` field, a VM without a bus)
    // still loads; the guest then finds no bus.
    let old = rewritten(&snap, &scratch.path().join("old"), |state| {
        state.pci = None;
        state.machine.rollbox.pci = false;
    });
    let mut clone = restore(&old, "cow");
    assert_eq!(clone.ok("echo old"), "old", "{}", clone.stderr());
    assert_eq!(clone.ok("pci-read 0 0"), "0xffffffff");

    // A damaged PCI state (the state file's own CRC still right) is refused by name.
    let damaged = rewritten(&snap, &scratch.path().join("damaged"), |state| {
        let pci = state.pci.as_mut().expect("PCI state saved");
        pci.functions[0].config[0x3c] ^= 0x5a;
    });
    let error = restore_fails(&damaged);
    assert!(error.contains("PCI state is damaged"), "{error}");
    // PCI state for a machine without a bus, and a bus without PCI state, are refused.
    let stray = rewritten(&snap, &scratch.path().join("stray"), |state| {
        state.machine.rollbox.pci = false;
    });
    let error = restore_fails(&stray);
    assert!(error.contains("no PCI bus"), "{error}");
    let lost = rewritten(&snap, &scratch.path().join("lost"), |state| {
        state.pci = None;
    });
    let error = restore_fails(&lost);
    assert!(error.contains("holds no PCI state"), "{error}");
    let newer = rewritten(&snap, &scratch.path().join("newer"), |state| {
        let pci = state.pci.as_mut().expect("PCI state saved");
        pci.version = 99;
        pci.crc = pci.checksum();
    });
    let error = restore_fails(&newer);
    assert!(error.contains("PCI state is version 99"), "{error}");
}

/// Reads `vm`'s console until it has seen `count` lines equal to `want` (up to 120 s).
fn wait_for_lines(vm: &mut rollbox_tests::Vm, want: &str, count: usize) {
    let mut seen = 0;
    while seen < count {
        let line = vm
            .next_line(Duration::from_secs(120))
            .unwrap_or_else(|| panic!("no {want:?} ({seen} of {count}); {}", vm.stderr()));
        if line == want {
            seen += 1;
        }
    }
}

#[test]
fn clones_of_a_pci_vm_read_the_host_bridge() {
    if !kvm_available() {
        return;
    }
    let mut vm = rollbox_tests::boot_with_api(&["--pci"]);
    // The reads wait in the serial FIFO behind the computation the snapshot interrupts, so
    // each clone runs them after its restore.
    vm.send("compute 60000\npci-read 0 0\nmmio-read 0xe0000000\npci-read 1 0\n");
    vm.expect_line("progress 1");
    // A fork as the daemon makes one: a snapshot after which the parent runs on, then
    // restores of it.
    let snapshot = vm.path("fork");
    std::fs::create_dir_all(&snapshot).expect("snapshot dir");
    vm.api().pause().unwrap_or_else(|e| panic!("{e}"));
    let params = rollbox_tests::snapshot_params("Full", &snapshot);
    vm.api()
        .create_snapshot_resuming(&params)
        .unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..2 {
        let args = [
            "--restore".to_string(),
            snapshot.display().to_string(),
            "--new-generation".into(),
            "--vsock-uds".into(),
            "{dir}/v.sock".into(),
        ];
        let mut clone = rollbox_tests::Vm::spawn_raw(&args, tempfile::tempdir().expect("tempdir"));
        // CF8/CFC and ECAM read the host bridge; slot 1 reads all ones.
        wait_for_lines(&mut clone, &format!("OK {HOST_BRIDGE_ID}"), 2);
        wait_for_lines(&mut clone, "OK 0xffffffff", 1);
    }
    // The parent keeps its bus too.
    wait_for_lines(&mut vm, "OK 0xffffffff", 1);
    reads_the_host_bridge(&mut vm, "parent after the fork");
}

#[test]
fn without_pci_nothing_answers_on_cf8_or_ecam() {
    if !kvm_available() {
        return;
    }
    let mut vm = rollbox_tests::Vm::boot(&[]);
    assert_eq!(vm.ok("pci-read 0 0"), "0xffffffff");
    // Unclaimed MMIO reads zero in rollbox-vmm.
    assert_ne!(vm.ok("mmio-read 0xe0000000"), HOST_BRIDGE_ID);
}

#[test]
fn a_vfio_path_that_is_no_vfio_device_is_one_error_line_naming_it() {
    if !kvm_available() {
        return;
    }
    let path = "/sys/bus/pci/devices/0000:ff:1f.7";
    let out = std::process::Command::new(rollbox_tests::vmm_binary())
        .args(["--kernel"])
        .arg(rollbox_tests::test_guest())
        .args(["--vfio", path])
        .output()
        .expect("run rollbox-vmm");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(path) && stderr.contains("not a PCI device"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

#[test]
fn put_vfio_over_the_api_checks_the_path_and_the_start_names_an_unbound_device() {
    use rollbox_tests::{api_client, test_guest, wait_for_socket, Vm};
    if !kvm_available() {
        return;
    }
    // A PCI device of this host that is not bound to vfio-pci.
    let Some(host_device) = std::fs::read_dir("/sys/bus/pci/devices")
        .ok()
        .and_then(|entries| {
            entries.flatten().map(|e| e.path()).find(|dev| {
                std::fs::read_link(dev.join("driver")).map_or(true, |d| !d.ends_with("vfio-pci"))
            })
        })
    else {
        rollbox_tests::skip(
            "put_vfio_over_the_api",
            "this host shows no PCI device that is not bound to vfio-pci",
        );
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("api.sock");
    let mut vm = Vm::spawn_raw(&["--api-sock".into(), sock.display().to_string()], dir);
    wait_for_socket(&sock, Duration::from_secs(10));
    // Raw: the test checks the statuses and the fault messages of the answers.
    let client = api_client(&sock);
    let api = |method: &str, path: &str, body: Option<&str>| {
        let answer = client
            .request(method, path, body.map(str::as_bytes))
            .unwrap_or_else(|e| panic!("{e}"));
        (answer.status, answer.text())
    };
    let guest = test_guest().display().to_string();
    let boot = format!(r#"{{"kernel_image_path":"{guest}","boot_args":"console=ttyS0"}}"#);
    assert_eq!(api("PUT", "/boot-source", Some(&boot)).0, 204);

    let (status, body) = api(
        "PUT",
        "/vfio",
        Some(r#"{"path":"/sys/bus/pci/devices/0000:ff:1f.7"}"#),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("0000:ff:1f.7") && body.contains("not a PCI device"),
        "{body}"
    );
    let (status, body) = api("PUT", "/vfio", Some(r#"{"path":"/x","bar":1}"#));
    assert_eq!(status, 400, "{body}");

    let good = format!(r#"{{"path":"{}"}}"#, host_device.display());
    assert_eq!(api("PUT", "/vfio", Some(&good)).0, 204);
    let (status, body) = api("PUT", "/vfio", Some(&good));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("given twice"), "{body}");
    let (_, machine) = api("GET", "/machine-config", None);
    assert!(
        machine.contains(&host_device.display().to_string()),
        "{machine}"
    );

    // The start checks the binding and refuses, naming the device; the VMM stays up.
    let (status, body) = api(
        "PUT",
        "/actions",
        Some(r#"{"action_type":"InstanceStart"}"#),
    );
    assert_eq!(status, 400, "{body}");
    let name = host_device
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    assert!(body.contains(&name), "{body}");
    assert_eq!(api("GET", "/", None).0, 200);
    let _ = vm.child.kill();
}
