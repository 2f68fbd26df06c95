//! Builds a running microVM from [`VmResources`].

use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};

use kvm_ioctls::Kvm;
use snapshot::memory::MemoryLayer;
use snapshot::uffd::PageServer;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::acpi::{setup_acpi, AcpiConfig, AcpiError};
use crate::arch::boot::{build_cmdline, detect_kernel_format, load_boot_payload, BootError};
use crate::arch::mptable::{ioapic_id, setup_mptable, MptableError};
use crate::arch::regs::{write_boot_tables, RegsError};
use crate::device_manager::{
    attach_devices, console_out, create_devices, Attached, DeviceManager, DeviceManagerError,
    GenerationView, VmEvents,
};
use crate::devices::legacy::generation::{
    random_generation_id, write_generation_id, GenerationError,
};
use crate::devices::pci::bus::PciRoot;
use crate::devices::pci::router::MsiRouter;
use crate::devices::pci::{host_phys_bits, PciError, PciMachine};
use crate::vmm_config::{
    ConfigError, MachineConfig, VmResources, DEFAULT_BOOT_ARGS, DEFAULT_BOOT_ARGS_PCI,
};
use crate::vstate::memory::{create_guest_memory, GuestMemoryMmap, MemoryError, Sharing};
use crate::vstate::vcpu::{
    saveable_msrs, ExitHandlers, ExitReport, Vcpu, VcpuError, VcpuHandle, VmExit,
};
use crate::vstate::vm::{open_kvm, Vm, VmError};

/// Errors from building a microVM.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Invalid configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Creating or attaching the devices.
    #[error(transparent)]
    Devices(#[from] DeviceManagerError),
    /// Kernel, initrd or command line.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// KVM VM set-up.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// vCPU set-up.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// MP table.
    #[error(transparent)]
    Mptable(#[from] MptableError),
    /// ACPI tables.
    #[error(transparent)]
    Acpi(#[from] AcpiError),
    /// The VM generation ID.
    #[error(transparent)]
    Generation(#[from] GenerationError),
    /// Boot page tables and GDT.
    #[error(transparent)]
    Regs(#[from] RegsError),
    /// The PCI root bus.
    #[error(transparent)]
    Pci(#[from] PciError),
    /// The restored MSI routes could not be applied.
    #[error("PCI: cannot apply the restored GSI routes: {0}")]
    PciRoutes(String),
    /// The saved PCI state does not restore.
    #[error(transparent)]
    PciState(#[from] crate::devices::pci::persist::PciPersistError),
    /// A VFIO device.
    #[error(transparent)]
    Vfio(#[from] crate::devices::pci::vfio::VfioError),
}

/// How guest memory is backed, which decides how a snapshot finds the pages to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Anonymous memory filled at boot or by an eager restore: untouched pages are absent.
    Anonymous,
    /// A private mapping of a snapshot's memory file (copy-on-write restore).
    FileBacked,
    /// Anonymous memory filled on demand by the userfaultfd page server.
    Lazy,
}

/// Guest memory's backing and snapshot lineage.
pub struct MemoryBacking {
    /// The backing kind.
    pub kind: MemoryKind,
    /// Layers of the last snapshot taken or restored: the parent of the next diff snapshot.
    pub layers: Vec<MemoryLayer>,
    /// The page server of a lazy restore.
    pub page_server: Option<PageServer>,
}

/// A running microVM.
pub struct MicroVm {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// vCPU threads (dropped before the VM, which stops them).
    pub vcpus: Vec<VcpuHandle>,
    /// COM1, the i8042 and the virtio devices.
    pub devices: DeviceManager,
    /// Exit reports from vCPU threads.
    pub exit_rx: Receiver<ExitReport>,
    /// Events for the event loop.
    pub events: VmEvents,
    /// The KVM VM.
    pub vm: Vm,
    /// Whether the vCPUs are paused.
    pub paused: bool,
    /// /dev/kvm, for vCPU state queries.
    pub kvm: Kvm,
    /// vCPUs and memory.
    pub machine: MachineConfig,
    /// Memory backing and snapshot lineage.
    pub memory: MemoryBacking,
    /// The VM generation counter the guest reads.
    pub generation: Arc<AtomicU64>,
    /// The ACPI Generic Event Device's interrupt (announces a new VM generation ID).
    pub ged_interrupt: Arc<EventFd>,
    /// Threads serving block queues; paused with the vCPUs.
    pub queue_workers: Vec<crate::devices::virtio::block::QueueWorker>,
    /// The PCI bus, with `--pci`.
    pub pci: Option<PciMachine>,
}

impl MicroVm {
    /// Pauses every vCPU, then every queue worker between two requests; if a vCPU does not
    /// pause in time, resumes the others and fails.
    pub fn pause(&mut self) -> Result<(), VcpuError> {
        for vcpu in &self.vcpus {
            if let Err(e) = vcpu.pause() {
                for vcpu in &self.vcpus {
                    vcpu.resume();
                }
                return Err(e);
            }
        }
        for worker in &self.queue_workers {
            worker.pause();
        }
        self.paused = true;
        Ok(())
    }

    /// Resumes the queue workers and every vCPU.
    pub fn resume(&mut self) {
        for worker in &self.queue_workers {
            worker.resume();
        }
        for vcpu in &self.vcpus {
            vcpu.resume();
        }
        self.paused = false;
    }
}

impl Drop for MicroVm {
    fn drop(&mut self) {
        // A vCPU blocked on a fault the page server could not serve leaves KVM_RUN only once
        // the userfaultfd is gone.
        if let Some(server) = &self.memory.page_server {
            if server.failure().is_some() {
                self.memory.page_server.take();
            }
        }
        for vcpu in &mut self.vcpus {
            vcpu.stop();
        }
        // The page server saves the recorded working set when it stops.
        self.memory.page_server.take();
    }
}

/// How guest memory must be mapped for `resources`: in huge pages when asked for (shared,
/// so a vhost-user backend can map it too), else shared when a vhost-user backend maps it.
pub fn memory_sharing(resources: &VmResources) -> Sharing {
    if resources.machine.huge_pages.as_deref() == Some("2M") {
        Sharing::HugeMemfd
    } else if resources.fs.is_empty() {
        Sharing::Private
    } else {
        Sharing::Memfd
    }
}

/// Creates the KVM VM with `mem` registered (before the irqchip, which is much cheaper here).
pub fn create_vm(kvm: &Kvm, mem: &GuestMemoryMmap, dirty_log: bool) -> Result<Vm, BuildError> {
    let vm = Vm::new(kvm)?;
    vm.register_memory(mem, dirty_log)?;
    vm.setup_irqchip()?;
    Ok(vm)
}

/// Starts vCPU threads and assembles the microVM.
pub fn assemble(parts: Assembly, vcpus: Vec<Vcpu>, paused: bool) -> Result<MicroVm, BuildError> {
    let Assembly {
        kvm,
        vm,
        mem,
        attached,
        machine,
        memory,
        pci,
    } = parts;
    let (exit_tx, exit_rx) = channel();
    let handlers = ExitHandlers {
        pio: Arc::new(attached.pio),
        mmio: Arc::new(attached.mmio),
        exits: exit_tx,
        exit_evt: Arc::clone(&attached.events.exit),
    };
    if let Some(server) = &memory.page_server {
        server.on_failure(page_server_failure_hook(&handlers));
    }
    crate::vstate::vcpu::install_kick_handler()?;
    let mut handles = Vec::new();
    for vcpu in vcpus {
        handles.push(vcpu.start(handlers.clone(), paused)?);
    }
    Ok(MicroVm {
        mem,
        vcpus: handles,
        devices: attached.devices,
        exit_rx,
        events: attached.events,
        vm,
        paused,
        kvm,
        machine,
        memory,
        generation: attached.generation,
        ged_interrupt: attached.ged_interrupt,
        queue_workers: Vec::new(),
        pci,
    })
}

/// How long the VMM may take to stop after the page server failed before it is ended anyway:
/// a vCPU blocked on the unserved fault may never leave KVM_RUN.
const PAGE_SERVER_EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Ends the VM with the page server's reason, like a vCPU crash; if the VMM has not exited
/// after [`PAGE_SERVER_EXIT_GRACE`], exits the process with status 1.
fn page_server_failure_hook(handlers: &ExitHandlers) -> snapshot::uffd::FailureHook {
    let exits = handlers.exits.clone();
    let exit_evt = Arc::clone(&handlers.exit_evt);
    Box::new(move |why| {
        let exit = VmExit::Error(format!("page server: {why}"));
        if exits.send(ExitReport { vcpu: 0, exit }).is_err() || exit_evt.write(1).is_err() {
            log::error!("page server failed and the VMM is not listening: {why}");
        }
        std::thread::spawn(move || {
            std::thread::sleep(PAGE_SERVER_EXIT_GRACE);
            eprintln!("rollbox-vmm: page server: {why}; the VMM did not stop within {PAGE_SERVER_EXIT_GRACE:?}, exiting");
            std::process::exit(1);
        });
    })
}

/// Everything but the vCPUs of a microVM being built.
pub struct Assembly {
    /// /dev/kvm.
    pub kvm: Kvm,
    /// The VM.
    pub vm: Vm,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// Devices.
    pub attached: Attached,
    /// vCPUs and memory size.
    pub machine: MachineConfig,
    /// Memory backing.
    pub memory: MemoryBacking,
    /// The PCI bus, with `--pci`.
    pub pci: Option<PciMachine>,
}

/// Builds and starts a microVM that boots a kernel.
pub fn build_microvm(resources: &VmResources) -> Result<MicroVm, BuildError> {
    // Everything that can fail on user input is checked before KVM work starts.
    let boot = resources.boot_source.clone().ok_or(ConfigError::NoKernel)?;
    detect_kernel_format(&boot.kernel_image_path)?;
    let devices = create_devices(resources).map_err(DeviceManagerError::from)?;
    let console = console_out(&resources.console)?;
    for path in &resources.machine.rollbox.vfio {
        crate::devices::pci::vfio::check_device(path)?;
    }

    let mem_bytes = resources.machine.mem_size_mib << 20;
    let vcpu_count = resources.machine.vcpu_count as u8;
    let kvm = open_kvm()?;
    let mem = create_guest_memory(mem_bytes, memory_sharing(resources))?;
    let vm = create_vm(&kvm, &mem, resources.machine.track_dirty_pages)?;
    let generation = GenerationView {
        counter: 0,
        offer_wall_clock: true,
    };
    let mut attached = attach_devices(&vm, &mem, devices, console, None, generation)?;
    let pci = if resources.machine.rollbox.has_pci() {
        let router = Arc::new(Mutex::new(MsiRouter::for_kvm(&kvm)));
        let vfio = crate::devices::pci::vfio::open_devices(
            &vm.shared_fd(),
            &mem,
            &resources.machine.rollbox.vfio,
            &router,
        )?;
        let mut root = PciRoot::new();
        for device in &vfio.devices {
            root.add(Arc::clone(device) as crate::devices::pci::bus::SharedPciDevice)
                .map_err(PciError::from)?;
        }
        let placed = crate::devices::pci::attach(
            root,
            &mut attached.pio,
            &mut attached.mmio,
            mem_bytes,
            host_phys_bits(),
        )?;
        for device in &vfio.devices {
            crate::vstate::bus::lock(device).enable_decoding();
        }
        for p in &placed.placements {
            log::info!(
                "PCI 00:{:02x}.0 BAR {} at {:#x} ({:#x} bytes)",
                p.slot,
                p.bar,
                p.addr,
                p.size
            );
        }
        Some((placed, vfio, router))
    } else {
        None
    };

    let default_args = if pci.is_some() {
        DEFAULT_BOOT_ARGS_PCI
    } else {
        DEFAULT_BOOT_ARGS
    };
    let user_args = boot.boot_args.as_deref().unwrap_or(default_args);
    let has_arg = |want: &str| user_args.split_whitespace().any(|arg| arg == want);
    // With ACPI the DSDT names the virtio devices (Linux numbers their interrupts itself on a
    // hardware-reduced platform); with `acpi=off` the MP table and the command line do.
    let acpi = !has_arg("acpi=off");
    let mut extra_args = Vec::new();
    if let Some(root) = resources.root_args() {
        extra_args.push(root);
    }
    if !acpi {
        extra_args.extend(attached.mmio_args.iter().cloned());
    }
    // kvm-clock is the guest's clocksource (CPUID offers no invariant TSC) and KVM keeps the
    // vCPUs' TSCs in step, so the guest need not test them: without this an AMD guest with
    // several vCPUs marks its TSC unstable, and the clocksource watchdog checks it under load.
    if !user_args
        .split_whitespace()
        .any(|arg| arg.starts_with("tsc="))
    {
        extra_args.push("tsc=reliable".into());
    }
    let cmdline = build_cmdline(user_args, &extra_args)?;
    setup_mptable(&mem, vcpu_count)?;
    let rsdp = if acpi {
        Some(setup_acpi(
            &mem,
            &AcpiConfig {
                vcpus: vcpu_count,
                ioapic_id: ioapic_id(vcpu_count),
                virtio_mmio: attached
                    .devices
                    .virtio
                    .iter()
                    .map(|v| (v.base, v.irq))
                    .collect(),
                pci: pci.as_ref().map(|(p, _, _)| p.acpi),
            },
        )?)
    } else {
        None
    };
    let boot_info = load_boot_payload(
        &mem,
        mem_bytes,
        &boot.kernel_image_path,
        boot.initrd_path.as_deref(),
        &cmdline,
        rsdp,
    )?;
    write_generation_id(&mem, random_generation_id())?;
    write_boot_tables(&mem)?;

    let mut vcpus = Vec::new();
    let msrs = saveable_msrs(&kvm)?;
    for index in 0..vcpu_count {
        let vcpu = Vcpu::new(vm.fd(), index, Arc::clone(&msrs))?;
        vcpu.configure_cpuid(&kvm, vcpu_count, resources.machine.deterministic)?;
        vcpu.configure_msrs(&kvm)?;
        vcpu.configure_boot_state(boot_info.entry)?;
        vcpus.push(vcpu);
    }
    let memory = MemoryBacking {
        kind: MemoryKind::Anonymous,
        layers: Vec::new(),
        page_server: None,
    };
    let parts = Assembly {
        kvm,
        vm,
        mem,
        attached,
        machine: resources.machine.clone(),
        memory,
        pci: pci.map(|(p, vfio, router)| PciMachine {
            root: p.root,
            placements: p.placements,
            vfio,
            router,
            config_io: p.config_io,
        }),
    };
    assemble(parts, vcpus, false)
}

/// Rebuilds the PCI bus of a restored microVM without VFIO: a fresh root (the host bridge)
/// on `attached`'s buses, its saved configuration space, CF8 latch and MSI routes put back,
/// and the GSI routing table applied to `vm`.
pub fn restore_pci(
    kvm: &Kvm,
    vm: &Vm,
    attached: &mut Attached,
    mem_bytes: u64,
    state: &crate::devices::pci::persist::PciPersistState,
) -> Result<PciMachine, BuildError> {
    use snapshot::Persist;
    state.check()?;
    let placed = crate::devices::pci::attach(
        PciRoot::new(),
        &mut attached.pio,
        &mut attached.mmio,
        mem_bytes,
        host_phys_bits(),
    )?;
    let args = crate::devices::pci::persist::PciRestoreArgs {
        root: placed.root,
        placements: placed.placements,
        config_io: placed.config_io,
        router: Arc::new(Mutex::new(MsiRouter::for_kvm(kvm))),
    };
    let pci = PciMachine::restore(args, state)?;
    crate::vstate::bus::lock(&pci.router)
        .apply(vm.fd())
        .map_err(|e| BuildError::PciRoutes(e.to_string()))?;
    Ok(pci)
}
