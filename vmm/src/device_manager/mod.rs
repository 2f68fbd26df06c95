//! The device manager: attaches the VM's devices (the legacy ones on the port bus; each
//! virtio device in its MMIO window, with its interrupt line and queue-notify ioeventfds),
//! keeps the list of them, and saves and restores them all (`persist.rs`). The kinds of virtio
//! device rollbox has are listed once, in `kinds.rs`: how each is created from the
//! configuration, saved and restored. A new device adds its lines there.

pub mod kinds;
pub mod persist;

use std::fs::OpenOptions;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use kvm_ioctls::IoEventAddress;
use snapshot::Persist;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch::layout::{
    GED_IRQ, I8042_IRQ, I8042_PORT, IRQ_BASE, PVPANIC_PORT, SERIAL_IRQ, SERIAL_PORT,
    SLEEP_CONTROL_PORT, VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START,
};
use crate::devices::legacy::generation::{Generation, GENERATION_PORT, GENERATION_PORT_LEN};
use crate::devices::legacy::i8042::I8042;
use crate::devices::legacy::poweroff::PowerOff;
use crate::devices::legacy::pvpanic::PvPanic;
use crate::devices::legacy::serial::{ConsoleOut, SerialArgs, SerialDevice};
use crate::devices::legacy::EventTrigger;
use crate::devices::virtio::mmio::{MmioTransport, REG_QUEUE_NOTIFY};
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::vmm_config::ConsoleConfig;
use crate::vstate::bus::{lock, Bus, BusError};
use crate::vstate::memory::GuestMemoryMmap;
use crate::vstate::vm::Vm;

pub use kinds::{create_devices, CreateError, DeviceOverrides, DevicePersistKind};
pub use persist::{DeviceStates, SavedDevices, VirtioPersistState};

/// Errors from creating, attaching, saving and restoring devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    /// A device could not be created.
    #[error(transparent)]
    Create(#[from] CreateError),
    /// Device bus layout.
    #[error("device bus: {0}")]
    Bus(#[from] BusError),
    /// The console file could not be opened.
    #[error("console {path}: {source}")]
    Console {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An eventfd, irqfd or ioeventfd could not be set up, or a saved state does not fit.
    #[error("{what}: {source}")]
    Event {
        /// What was being set up.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A device could not be saved or rebuilt.
    #[error("device {device}: {detail}")]
    Device {
        /// The device.
        device: String,
        /// What failed.
        detail: String,
    },
    /// A restore's overrides do not fit the snapshot.
    #[error("{0}")]
    Mismatch(String),
}

fn event_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DeviceManagerError {
    let what = what.into();
    move |source| DeviceManagerError::Event { what, source }
}

fn kvm_event_err(what: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> DeviceManagerError {
    let what = what.into();
    move |e| DeviceManagerError::Event {
        what,
        source: std::io::Error::from_raw_os_error(e.errno()),
    }
}

fn new_eventfd(what: &str) -> Result<Arc<EventFd>, DeviceManagerError> {
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

/// The VM's devices once attached.
pub struct DeviceManager {
    /// COM1.
    pub serial: Arc<Mutex<SerialDevice>>,
    /// The i8042 controller.
    pub i8042: Arc<Mutex<I8042>>,
    /// Virtio devices, in MMIO order.
    pub virtio: Vec<VirtioSlot>,
}

impl DeviceManager {
    /// The name of the first virtio device whose backend maps guest memory itself.
    pub fn memory_mapper(&self) -> Option<String> {
        self.virtio.iter().find_map(|slot| {
            let transport = lock(&slot.transport);
            let device = transport.device();
            device.maps_guest_memory().then(|| device.name())
        })
    }

    /// What a snapshot would record of each virtio device now, in MMIO order.
    pub fn virtio_kinds(&self) -> Result<Vec<DevicePersistKind>, DeviceManagerError> {
        self.virtio
            .iter()
            .map(|slot| DevicePersistKind::save(lock(&slot.transport).device()))
            .collect()
    }

    /// Before a snapshot of the paused VM: every device served by an outside backend stops
    /// its rings and saves the backend's state. Stops at the first that fails.
    pub fn save_backends(&self) -> Result<(), DeviceManagerError> {
        for slot in &self.virtio {
            let mut transport = lock(&slot.transport);
            if let Err(detail) = transport.save_backend() {
                return Err(DeviceManagerError::Device {
                    device: transport.device().name(),
                    detail,
                });
            }
        }
        Ok(())
    }

    /// After a snapshot (taken or failed): the rings [`DeviceManager::save_backends`] stopped
    /// start again.
    pub fn resume_backends(&self) {
        for slot in &self.virtio {
            lock(&slot.transport).resume_backend();
        }
    }

    /// After a restore: every device serves its queues once.
    pub fn kick_after_restore(&self) {
        for slot in &self.virtio {
            lock(&slot.transport).kick_after_restore();
        }
    }
}

/// Opens the console sink.
pub fn console_out(console: &ConsoleConfig) -> Result<ConsoleOut, DeviceManagerError> {
    Ok(match console {
        ConsoleConfig::Stdout => ConsoleOut::stdout(),
        ConsoleConfig::File { path, max_bytes } => {
            let failed = |source| DeviceManagerError::Console {
                path: path.clone(),
                source,
            };
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(failed)?;
            // A restore of the same sandbox appends: what is there counts against the cap.
            let size = file.metadata().map_err(failed)?.len();
            ConsoleOut::capped_file(file, size, *max_bytes)
        }
    })
}

/// Devices, buses and events attached to a VM.
pub struct Attached {
    /// Port I/O bus.
    pub pio: Bus,
    /// MMIO bus.
    pub mmio: Bus,
    /// The devices.
    pub devices: DeviceManager,
    /// Event-loop events.
    pub events: VmEvents,
    /// `virtio_mmio.device=` kernel arguments.
    pub mmio_args: Vec<String>,
    /// The generation counter.
    pub generation: Arc<AtomicU64>,
    /// The ACPI Generic Event Device's interrupt.
    pub ged_interrupt: Arc<EventFd>,
}

fn restore_err(what: impl Into<String>) -> DeviceManagerError {
    DeviceManagerError::Event {
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
) -> Result<Attached, DeviceManagerError> {
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

    let (mmio, virtio, mmio_args) = attach_virtio(vm, mem, devices, saved.map(|s| s.virtio))?;
    Ok(Attached {
        pio,
        mmio,
        devices: DeviceManager {
            serial,
            i8042,
            virtio,
        },
        events,
        mmio_args,
        generation: counter,
        ged_interrupt,
    })
}

/// Gives each virtio device its MMIO window, interrupt line and queue-notify ioeventfds, in
/// order; with `saved`, each transport comes back from the slot state of the same index.
fn attach_virtio(
    vm: &Vm,
    mem: &GuestMemoryMmap,
    devices: Vec<Box<dyn VirtioDevice>>,
    saved: Option<&[VirtioPersistState]>,
) -> Result<(Bus, Vec<VirtioSlot>, Vec<String>), DeviceManagerError> {
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
        let transport = match saved.map(|s| s.get(i)) {
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
    Ok((mmio, virtio, mmio_args))
}
