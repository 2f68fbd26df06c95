//! Builds a running microVM from [`VmResources`].

use std::fs::OpenOptions;
use std::os::fd::RawFd;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};

use crate::vstate::memory::GuestMemoryMmap;
use kvm_ioctls::{IoEventAddress, Kvm};
use snapshot::memory::MemoryLayer;
use snapshot::uffd::PageServer;
use std::sync::atomic::AtomicU64;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch::acpi::{setup_acpi, AcpiConfig, AcpiError};
use crate::arch::boot::{build_cmdline, detect_kernel_format, load_boot_payload, BootError};
use crate::arch::layout::{
    GED_IRQ, I8042_IRQ, I8042_PORT, IRQ_BASE, IRQ_MAX, PVPANIC_PORT, SERIAL_IRQ, SERIAL_PORT,
    SLEEP_CONTROL_PORT, VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START,
};
use crate::arch::mptable::{ioapic_id, setup_mptable, MptableError};
use crate::arch::regs::{write_boot_tables, RegsError};
use crate::config::{
    ConfigError, ConsoleConfig, MachineConfig, VmResources, DEFAULT_BOOT_ARGS,
    DEFAULT_BOOT_ARGS_PCI,
};
use crate::devices::legacy::generation::{
    random_generation_id, write_generation_id, Generation, GenerationError, GENERATION_PORT,
    GENERATION_PORT_LEN,
};
use crate::devices::legacy::i8042::I8042PersistState;
use crate::devices::legacy::i8042::I8042;
use crate::devices::legacy::poweroff::PowerOff;
use crate::devices::legacy::pvpanic::PvPanic;
use crate::devices::legacy::serial::{ConsoleOut, SerialDevice};
use crate::devices::legacy::serial::{SerialArgs, SerialPersistState};
use crate::devices::legacy::EventTrigger;
use crate::devices::pci::bus::PciRoot;
use crate::devices::pci::router::MsiRouter;
use crate::devices::pci::{host_phys_bits, PciError, PciMachine};
use crate::devices::virtio::block::{Block, BlockConfig, BlockError};
use crate::devices::virtio::fs::{Daemon, Fs, FsError};
use crate::devices::virtio::mmio::{MmioTransport, REG_QUEUE_NOTIFY};
use crate::devices::virtio::net::{Net, NetConfig, NetError};
use crate::devices::virtio::persist::VirtioPersistState;
use crate::devices::virtio::vsock::{Vsock, VsockError};
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::vstate::bus::{Bus, BusError};
use crate::vstate::memory::{create_guest_memory, MemoryError, Sharing};
use crate::vstate::vcpu::{
    saveable_msrs, ExitHandlers, ExitReport, Vcpu, VcpuError, VcpuHandle, VmExit,
};
use crate::vstate::vm::{open_kvm, Vm, VmError};
use snapshot::Persist;

/// Errors from building a microVM.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Invalid configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Kernel, initrd or command line.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// A drive.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The vsock device.
    #[error(transparent)]
    Vsock(#[from] VsockError),
    /// A network interface.
    #[error(transparent)]
    Net(#[from] NetError),
    /// A shared volume (virtio-fs).
    #[error(transparent)]
    Fs(#[from] FsError),
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
    /// Device bus layout.
    #[error("device bus: {0}")]
    Bus(#[from] BusError),
    /// The console file could not be opened.
    #[error("console {path}: {source}")]
    Console {
        /// The path.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An eventfd, irqfd or ioeventfd could not be set up.
    #[error("{what}: {source}")]
    Event {
        /// What was being set up.
        what: String,
        /// The error.
        source: std::io::Error,
    },
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
    /// More virtio devices than interrupt lines.
    #[error("too many virtio devices ({0}); at most {max} fit", max = IRQ_MAX - IRQ_BASE + 1)]
    TooManyDevices(usize),
}

fn event_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BuildError {
    let what = what.into();
    move |source| BuildError::Event { what, source }
}

fn kvm_event_err(what: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> BuildError {
    let what = what.into();
    move |e| BuildError::Event {
        what,
        source: std::io::Error::from_raw_os_error(e.errno()),
    }
}

fn new_eventfd(what: &str) -> Result<Arc<EventFd>, BuildError> {
    EventFd::new(EFD_NONBLOCK)
        .map(Arc::new)
        .map_err(event_err(format!("eventfd for {what}")))
}

/// Eventfds the VMM's event loop watches for the microVM.
pub struct VmEvents {
    /// A vCPU reported the VM's end.
    pub exit: Arc<EventFd>,
    /// i8042 CPU reset.
    pub reset: Arc<EventFd>,
    /// Power-off register.
    pub poweroff: Arc<EventFd>,
    /// pvpanic: the guest kernel panicked.
    pub panic: Arc<EventFd>,
    /// The serial receive FIFO has room.
    pub serial_room: Arc<EventFd>,
}

/// One virtio-mmio device slot.
pub struct VirtioSlot {
    /// The transport and device.
    pub transport: Arc<Mutex<MmioTransport>>,
    /// QueueNotify ioeventfds, one per queue.
    pub notify: Vec<EventFd>,
    /// MMIO base address.
    pub base: u64,
    /// Interrupt line.
    pub irq: u32,
    /// Backend fd the event loop watches, if any.
    pub backend_fd: Option<RawFd>,
    /// Whether the event loop polls `notify`; not when a vhost-user backend gets them.
    pub notify_polled: bool,
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
    /// COM1.
    pub serial: Arc<Mutex<SerialDevice>>,
    /// The i8042 controller.
    pub i8042: Arc<Mutex<I8042>>,
    /// Virtio devices, in MMIO order.
    pub virtio: Vec<VirtioSlot>,
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

/// Opens the console sink.
pub fn console_out(console: &ConsoleConfig) -> Result<ConsoleOut, BuildError> {
    Ok(match console {
        ConsoleConfig::Stdout => ConsoleOut::stdout(),
        ConsoleConfig::File(path) => ConsoleOut::file(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| BuildError::Console {
                    path: path.clone(),
                    source,
                })?,
        ),
    })
}

/// Devices, buses and events attached to a VM.
pub struct Attached {
    /// Port I/O bus.
    pub pio: Bus,
    /// MMIO bus.
    pub mmio: Bus,
    /// COM1.
    pub serial: Arc<Mutex<SerialDevice>>,
    /// i8042.
    pub i8042: Arc<Mutex<I8042>>,
    /// Virtio slots.
    pub virtio: Vec<VirtioSlot>,
    /// Event-loop events.
    pub events: VmEvents,
    /// `virtio_mmio.device=` kernel arguments.
    pub mmio_args: Vec<String>,
    /// The generation counter.
    pub generation: Arc<AtomicU64>,
    /// The ACPI Generic Event Device's interrupt.
    pub ged_interrupt: Arc<EventFd>,
}

/// Creates the devices of `resources` (opening drives and binding the vsock socket).
pub fn create_devices(resources: &VmResources) -> Result<Vec<Box<dyn VirtioDevice>>, BuildError> {
    let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
    for drive in &resources.drives {
        devices.push(Box::new(Block::new(BlockConfig {
            id: drive.drive_id.clone(),
            path: drive.path_on_host.clone(),
            read_only: drive.is_read_only,
        })?));
    }
    if let Some(vsock) = &resources.vsock {
        devices.push(Box::new(Vsock::new(vsock.guest_cid, &vsock.uds_path)?));
    }
    for iface in &resources.net {
        devices.push(Box::new(Net::new(NetConfig {
            iface_id: iface.iface_id.clone(),
            host_dev_name: iface.host_dev_name.clone(),
            guest_mac: iface.validate()?,
        })?));
    }
    for (index, fs) in resources.fs.iter().enumerate() {
        devices.push(Box::new(create_fs(
            resources.virtiofsd.as_deref(),
            index,
            fs,
        )?));
    }
    if devices.len() > (IRQ_MAX - IRQ_BASE + 1) as usize {
        return Err(BuildError::TooManyDevices(devices.len()));
    }
    Ok(devices)
}

/// Starts virtiofsd for the `index`th volume (unless the caller gave its socket) and connects
/// to it; `virtiofsd` is the binary named by `--virtiofsd`, if any.
pub fn create_fs(
    virtiofsd: Option<&std::path::Path>,
    index: usize,
    fs: &crate::config::FsConfig,
) -> Result<Fs, BuildError> {
    if let Some(socket) = &fs.socket {
        return Ok(Fs::new(fs, socket.clone(), None)?);
    }
    let binary = crate::devices::virtio::fs::locate_virtiofsd(virtiofsd)?;
    let dir = std::env::temp_dir().join(format!("rollbox-vmm-{}-fs{index}", std::process::id()));
    let daemon = Daemon::start(&binary, fs, &dir)?;
    let socket = daemon.socket().to_path_buf();
    Ok(Fs::new(fs, socket, Some(daemon))?)
}

/// How guest memory must be mapped for `resources`: shared when a vhost-user backend maps it.
pub fn memory_sharing(resources: &VmResources) -> Sharing {
    if resources.fs.is_empty() {
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

/// Device states from a snapshot, restored through [`Persist`].
pub struct SavedDevices<'a> {
    /// COM1.
    pub serial: &'a SerialPersistState,
    /// i8042.
    pub i8042: &'a I8042PersistState,
    /// Virtio transports, in MMIO order.
    pub virtio: &'a [VirtioPersistState],
}

fn restore_err(what: impl Into<String>) -> BuildError {
    BuildError::Event {
        what: what.into(),
        source: std::io::ErrorKind::InvalidData.into(),
    }
}

/// The VM generation as the guest sees it through the generation registers.
#[derive(Debug, Clone, Copy)]
pub struct GenerationView {
    /// The counter value.
    pub counter: u64,
    /// Whether the host's wall clock is offered (not after a deterministic restore).
    pub offer_wall_clock: bool,
}

/// Wires legacy and virtio devices to the VM: buses, irqfds, ioeventfds. With `saved`, every
/// device comes back from its snapshot state.
pub fn attach_devices(
    vm: &Vm,
    mem: &GuestMemoryMmap,
    devices: Vec<Box<dyn VirtioDevice>>,
    console: ConsoleOut,
    saved: Option<&SavedDevices<'_>>,
    generation: GenerationView,
) -> Result<Attached, BuildError> {
    let events = VmEvents {
        exit: new_eventfd("vCPU exits")?,
        reset: new_eventfd("i8042 reset")?,
        poweroff: new_eventfd("power-off")?,
        panic: new_eventfd("pvpanic")?,
        serial_room: new_eventfd("serial input")?,
    };
    let ged_interrupt = new_eventfd("ACPI GED interrupt")?;
    vm.fd()
        .register_irqfd(&ged_interrupt, GED_IRQ)
        .map_err(kvm_event_err("irqfd for the ACPI GED"))?;
    let serial_irq = new_eventfd("COM1 interrupt")?;
    vm.fd()
        .register_irqfd(&serial_irq, SERIAL_IRQ)
        .map_err(kvm_event_err("irqfd for COM1"))?;
    let kbd_irq = new_eventfd("i8042 interrupt")?;
    vm.fd()
        .register_irqfd(&kbd_irq, I8042_IRQ)
        .map_err(kvm_event_err("irqfd for i8042"))?;

    let irq = EventTrigger(serial_irq);
    let room = EventTrigger(Arc::clone(&events.serial_room));
    let serial = match saved {
        Some(saved) => SerialDevice::restore(
            SerialArgs {
                irq,
                room,
                out: console,
            },
            saved.serial,
        )
        .map_err(restore_err)?,
        None => SerialDevice::new(irq, room, console),
    };
    let serial = Arc::new(Mutex::new(serial));
    let i8042_args = (
        EventTrigger(Arc::clone(&events.reset)),
        EventTrigger(kbd_irq),
    );
    let i8042 = match saved {
        Some(saved) => match I8042::restore(i8042_args, saved.i8042) {
            Ok(device) => device,
            Err(never) => match never {},
        },
        None => I8042::new(i8042_args.0, i8042_args.1),
    };
    let i8042 = Arc::new(Mutex::new(i8042));
    let counter = Arc::new(AtomicU64::new(generation.counter));
    let mut pio = Bus::default();
    pio.insert(serial.clone(), u64::from(SERIAL_PORT), 8)?;
    pio.insert(i8042.clone(), u64::from(I8042_PORT), 5)?;
    pio.insert(
        Arc::new(Mutex::new(PowerOff::new(EventTrigger(Arc::clone(
            &events.poweroff,
        ))))),
        u64::from(SLEEP_CONTROL_PORT),
        2,
    )?;
    pio.insert(
        Arc::new(Mutex::new(PvPanic::new(EventTrigger(Arc::clone(
            &events.panic,
        ))))),
        u64::from(PVPANIC_PORT),
        1,
    )?;
    pio.insert(
        Arc::new(Mutex::new(Generation::new(
            Arc::clone(&counter),
            generation.offer_wall_clock,
        ))),
        u64::from(GENERATION_PORT),
        GENERATION_PORT_LEN,
    )?;

    let mut mmio = Bus::default();
    let mut virtio = Vec::new();
    let mut mmio_args = Vec::new();
    for (i, mut device) in devices.into_iter().enumerate() {
        let base = VIRTIO_MMIO_START + i as u64 * VIRTIO_MMIO_SIZE;
        let irq = IRQ_BASE + i as u32;
        let name = device.name();
        let irqfd = new_eventfd(&format!("{name} interrupt"))?;
        vm.fd()
            .register_irqfd(&irqfd, irq)
            .map_err(kvm_event_err(format!("irqfd for {name}")))?;
        let backend_fd = device.backend_fd();
        let mut notify = Vec::new();
        for queue in 0..device.queue_max_sizes().len() {
            let evt =
                EventFd::new(EFD_NONBLOCK).map_err(event_err(format!("ioeventfd for {name}")))?;
            vm.fd()
                .register_ioevent(
                    &evt,
                    &IoEventAddress::Mmio(base + REG_QUEUE_NOTIFY),
                    queue as u32,
                )
                .map_err(kvm_event_err(format!("ioeventfd for {name} queue {queue}")))?;
            notify.push(evt);
        }
        let mut interrupt = Interrupt::new(irqfd);
        let notify_polled = !device.backend_serves_queues();
        if !notify_polled {
            let fds = notify
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()
                .map_err(event_err(format!("ioeventfds for {name}")))?;
            device.set_notify_fds(fds);
            interrupt = interrupt.with_sticky_used_ring();
        }
        let transport = match saved.map(|s| s.virtio.get(i)) {
            Some(Some(state)) => {
                MmioTransport::restore((device, mem.clone(), interrupt), &state.transport_state())
                    .map_err(restore_err)?
            }
            Some(None) => return Err(restore_err(format!("{name}: not in the snapshot"))),
            None => MmioTransport::new(device, mem.clone(), interrupt),
        };
        let transport = Arc::new(Mutex::new(transport));
        mmio.insert(transport.clone(), base, VIRTIO_MMIO_SIZE)?;
        mmio_args.push(format!("virtio_mmio.device=4K@{base:#x}:{irq}"));
        virtio.push(VirtioSlot {
            transport,
            notify,
            base,
            irq,
            backend_fd,
            notify_polled,
        });
    }
    Ok(Attached {
        pio,
        mmio,
        serial,
        i8042,
        virtio,
        events,
        mmio_args,
        generation: counter,
        ged_interrupt,
    })
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
        serial: attached.serial,
        i8042: attached.i8042,
        virtio: attached.virtio,
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
    let devices = create_devices(resources)?;
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
                virtio_mmio: attached.virtio.iter().map(|v| (v.base, v.irq)).collect(),
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
