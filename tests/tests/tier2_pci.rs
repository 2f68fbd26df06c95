//! Tier 2: PCI on this machine's real KVM. MSI routing without a guest (the test drives
//! `vmm::devices::pci::router::MsiRouter` against a real VM fd and reads vCPU 0's local APIC
//! to see that the interrupts arrived), and `--pci` with the test guest reading configuration
//! space through CF8/CFC and ECAM.

use std::time::{Duration, Instant};

use rollbox_tests::kvm_available;
use vmm::devices::pci::msix::{Msix, Signal, CONTROL_ENABLE, TABLE_ENTRY_SIZE};
use vmm::devices::pci::router::MsiRouter;
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
}

/// The host bridge's vendor and device ID as one dword (1b36:0008).
const HOST_BRIDGE_ID: &str = "0x81b36";

#[test]
fn with_pci_the_guest_finds_the_host_bridge_on_cf8_and_ecam_and_snapshots_are_refused() {
    if !kvm_available() {
        return;
    }
    let mut vm = rollbox_tests::boot_with_api(&["--pci"]);
    assert_eq!(vm.ok("pci-read 0 0"), HOST_BRIDGE_ID);
    assert_eq!(
        vm.ok("pci-read 0 8"),
        "0x6000000",
        "class 06/00: host bridge"
    );
    assert_eq!(vm.ok("pci-read 1 0"), "0xffffffff", "slot 1 is empty");
    assert_eq!(vm.ok("mmio-read 0xe0000000"), HOST_BRIDGE_ID, "ECAM");
    assert_eq!(vm.ok("mmio-read 0xe0008000"), "0xffffffff");
    // PCI state is not saved yet: a snapshot and a fork are refused with the reason.
    let sock = vm.path("api.sock");
    let (code, _) = rollbox_tests::api(&sock, "PATCH", "/vm", Some(r#"{"state":"Paused"}"#));
    assert_eq!(code, 204);
    let body = format!(
        r#"{{"snapshot_type":"Full","snapshot_path":"{}","mem_file_path":"{}"}}"#,
        vm.path("vmstate").display(),
        vm.path("memory").display()
    );
    let (code, answer) = rollbox_tests::api(&sock, "PUT", "/snapshot/create", Some(&body));
    assert_eq!(code, 400, "{answer}");
    assert!(answer.contains("--pci"), "{answer}");
    assert!(!vm.path("vmstate").exists());
    let (code, answer) = rollbox_tests::api(&sock, "POST", "/fork", Some(r#"{"count":1}"#));
    assert_eq!(code, 400, "{answer}");
    assert!(answer.contains("--pci"), "{answer}");
    let (code, _) = rollbox_tests::api(&sock, "PATCH", "/vm", Some(r#"{"state":"Resumed"}"#));
    assert_eq!(code, 204);
    assert_eq!(vm.ok("pci-read 0 0"), HOST_BRIDGE_ID);
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
    use rollbox_tests::{api, test_guest, wait_for_socket, Vm};
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
    let guest = test_guest().display().to_string();
    let boot = format!(r#"{{"kernel_image_path":"{guest}","boot_args":"console=ttyS0"}}"#);
    assert_eq!(api(&sock, "PUT", "/boot-source", Some(&boot)).0, 204);

    let (status, body) = api(
        &sock,
        "PUT",
        "/vfio",
        Some(r#"{"path":"/sys/bus/pci/devices/0000:ff:1f.7"}"#),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("0000:ff:1f.7") && body.contains("not a PCI device"),
        "{body}"
    );
    let (status, body) = api(&sock, "PUT", "/vfio", Some(r#"{"path":"/x","bar":1}"#));
    assert_eq!(status, 400, "{body}");

    let good = format!(r#"{{"path":"{}"}}"#, host_device.display());
    assert_eq!(api(&sock, "PUT", "/vfio", Some(&good)).0, 204);
    let (status, body) = api(&sock, "PUT", "/vfio", Some(&good));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("given twice"), "{body}");
    let (_, machine) = api(&sock, "GET", "/machine-config", None);
    assert!(
        machine.contains(&host_device.display().to_string()),
        "{machine}"
    );

    // The start checks the binding and refuses, naming the device; the VMM stays up.
    let (status, body) = api(
        &sock,
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
    assert_eq!(api(&sock, "GET", "/", None).0, 200);
    let _ = vm.child.kill();
}
