//! MSI routing through KVM: GSIs for MSI and MSI-X vectors, the GSI routing table, irqfds.
//!
//! `KVM_SET_GSI_ROUTING` replaces the whole table, including the routes to the PIC and
//! IOAPIC that `KVM_CREATE_IRQCHIP` installs, so every table this router sets starts with
//! those (the same as KVM's default) and the legacy interrupt lines keep working.

use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_irq_routing_entry, kvm_msi, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use vmm_sys_util::eventfd::EventFd;

use super::msix::MsiMessage;
use crate::arch::layout::{IOAPIC_LAST_PIN, MSI_GSI_BASE};

/// Legacy GSIs the PIC pair also serves.
const PIC_PINS: u32 = 16;
/// Routes in KVM's default table: one IOAPIC route per pin plus one PIC route per PIC pin.
const DEFAULT_ROUTES: u32 = IOAPIC_LAST_PIN + 1 + PIC_PINS;

/// Errors from MSI routing; each names the GSI or the ioctl.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// Every MSI GSI is in use.
    #[error("no free MSI GSI: {in_use} of {capacity} in use")]
    Exhausted {
        /// GSIs in use.
        in_use: usize,
        /// How many MSI routes KVM's table has room for.
        capacity: usize,
    },
    /// A GSI this router did not hand out.
    #[error("GSI {0} is not an MSI GSI of this router")]
    UnknownGsi(u32),
    /// A saved GSI outside this KVM's MSI range, or given twice.
    #[error("saved MSI GSI {gsi} is outside {MSI_GSI_BASE}..{max} or given twice")]
    Restore {
        /// The GSI.
        gsi: u32,
        /// This KVM's GSI limit.
        max: u32,
    },
    /// KVM_SET_GSI_ROUTING failed.
    #[error("KVM_SET_GSI_ROUTING with {routes} routes failed: {source}")]
    SetRouting {
        /// Routes in the table.
        routes: usize,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// The routing table could not be built.
    #[error("cannot build a routing table of {0} routes")]
    Table(usize),
    /// An irqfd could not be created or registered.
    #[error("irqfd for GSI {gsi}: {source}")]
    Irqfd {
        /// The GSI.
        gsi: u32,
        /// The error.
        source: std::io::Error,
    },
    /// KVM_SIGNAL_MSI failed.
    #[error("KVM_SIGNAL_MSI to {address:#x} data {data:#x} failed: {source}")]
    SignalMsi {
        /// Message address.
        address: u64,
        /// Message data.
        data: u32,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// Owns the MSI GSIs and the VM's GSI routing table.
pub struct MsiRouter {
    /// KVM's limit on GSIs and on routes in one table.
    max_routes: u32,
    /// Allocated GSIs and their message; `None` while the vector is masked or unset.
    routes: BTreeMap<u32, Option<MsiMessage>>,
}

fn irqchip_route(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    entry.u.irqchip.irqchip = chip;
    entry.u.irqchip.pin = pin;
    entry
}

fn msi_route(gsi: u32, message: MsiMessage) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    entry.u.msi.address_lo = message.address as u32;
    entry.u.msi.address_hi = (message.address >> 32) as u32;
    entry.u.msi.data = message.data;
    entry
}

/// KVM's default routes: GSI n to IOAPIC pin n (0-23) and to PIC pin n % 8 (0-15).
fn default_routes() -> Vec<kvm_irq_routing_entry> {
    let mut routes = Vec::with_capacity(DEFAULT_ROUTES as usize);
    for gsi in 0..=IOAPIC_LAST_PIN {
        routes.push(irqchip_route(gsi, KVM_IRQCHIP_IOAPIC, gsi));
        if gsi < PIC_PINS {
            let chip = if gsi < 8 {
                KVM_IRQCHIP_PIC_MASTER
            } else {
                KVM_IRQCHIP_PIC_SLAVE
            };
            routes.push(irqchip_route(gsi, chip, gsi % 8));
        }
    }
    routes
}

impl MsiRouter {
    /// A router for a KVM that takes up to `max_routes` routes (and GSIs below that).
    pub fn new(max_routes: u32) -> Self {
        Self {
            max_routes,
            routes: BTreeMap::new(),
        }
    }

    /// A router sized by what this KVM reports (`KVM_CAP_IRQ_ROUTING`).
    pub fn for_kvm(kvm: &Kvm) -> Self {
        Self::new(kvm.check_extension_int(Cap::IrqRouting).max(0) as u32)
    }

    /// How many MSI routes fit next to the default ones.
    pub fn capacity(&self) -> usize {
        let by_count = self.max_routes.saturating_sub(DEFAULT_ROUTES);
        let by_number = self.max_routes.saturating_sub(MSI_GSI_BASE);
        by_count.min(by_number) as usize
    }

    /// Hands out the lowest free MSI GSI, with no route yet.
    pub fn allocate(&mut self) -> Result<u32, RouterError> {
        let capacity = self.capacity();
        let in_use = self.routes.len();
        let exhausted = RouterError::Exhausted { in_use, capacity };
        if in_use >= capacity {
            return Err(exhausted);
        }
        let gsi = (MSI_GSI_BASE..self.max_routes)
            .find(|gsi| !self.routes.contains_key(gsi))
            .ok_or(exhausted)?;
        self.routes.insert(gsi, None);
        Ok(gsi)
    }

    /// Gives `gsi` back; its route goes at the next [`MsiRouter::apply`].
    pub fn release(&mut self, gsi: u32) -> Result<(), RouterError> {
        self.routes
            .remove(&gsi)
            .map(|_| ())
            .ok_or(RouterError::UnknownGsi(gsi))
    }

    /// Points `gsi` at `message`, or at nothing (`None`: a masked vector; KVM drops its
    /// signals). Takes effect at the next [`MsiRouter::apply`].
    pub fn set_route(&mut self, gsi: u32, message: Option<MsiMessage>) -> Result<(), RouterError> {
        let route = self
            .routes
            .get_mut(&gsi)
            .ok_or(RouterError::UnknownGsi(gsi))?;
        *route = message;
        Ok(())
    }

    /// Every allocated GSI with its message (`None`: no route now).
    pub fn routes(&self) -> Vec<(u32, Option<MsiMessage>)> {
        self.routes.iter().map(|(&gsi, &m)| (gsi, m)).collect()
    }

    /// Takes `gsi` again with `message`, as a saved VM had it (a restore).
    pub fn restore_route(
        &mut self,
        gsi: u32,
        message: Option<MsiMessage>,
    ) -> Result<(), RouterError> {
        let capacity = self.capacity();
        if !(MSI_GSI_BASE..self.max_routes).contains(&gsi) || self.routes.contains_key(&gsi) {
            return Err(RouterError::Restore {
                gsi,
                max: self.max_routes,
            });
        }
        if self.routes.len() >= capacity {
            return Err(RouterError::Exhausted {
                in_use: self.routes.len(),
                capacity,
            });
        }
        self.routes.insert(gsi, message);
        Ok(())
    }

    /// The whole routing table: the default irqchip routes, then one per routed MSI GSI.
    pub fn entries(&self) -> Vec<kvm_irq_routing_entry> {
        let mut entries = default_routes();
        entries.extend(
            self.routes
                .iter()
                .filter_map(|(&gsi, message)| message.map(|m| msi_route(gsi, m))),
        );
        entries
    }

    /// Installs the table with KVM_SET_GSI_ROUTING.
    pub fn apply(&self, vm: &VmFd) -> Result<(), RouterError> {
        let entries = self.entries();
        let table =
            KvmIrqRouting::from_entries(&entries).map_err(|_| RouterError::Table(entries.len()))?;
        vm.set_gsi_routing(&table)
            .map_err(|source| RouterError::SetRouting {
                routes: entries.len(),
                source,
            })
    }

    /// A new eventfd registered as an irqfd on `gsi`: writing it raises the GSI's route.
    pub fn irqfd(&self, vm: &VmFd, gsi: u32) -> Result<EventFd, RouterError> {
        if !self.routes.contains_key(&gsi) {
            return Err(RouterError::UnknownGsi(gsi));
        }
        let fd =
            EventFd::new(libc::EFD_NONBLOCK).map_err(|e| RouterError::Irqfd { gsi, source: e })?;
        vm.register_irqfd(&fd, gsi)
            .map_err(|e| RouterError::Irqfd {
                gsi,
                source: std::io::Error::from_raw_os_error(e.errno()),
            })?;
        Ok(fd)
    }

    /// Delivers `message` once without a route (KVM_SIGNAL_MSI), for an emulated device.
    pub fn signal(vm: &VmFd, message: MsiMessage) -> Result<(), RouterError> {
        let msi = kvm_msi {
            address_lo: message.address as u32,
            address_hi: (message.address >> 32) as u32,
            data: message.data,
            ..Default::default()
        };
        vm.signal_msi(msi)
            .map(|_| ())
            .map_err(|source| RouterError::SignalMsi {
                address: message.address,
                data: message.data,
                source,
            })
    }
}

/// One vector of a device that signals through an eventfd (VFIO): while the vector is
/// unmasked the eventfd is a KVM irqfd on its GSI; while it is masked the irqfd is taken away,
/// so signals stay counted in the eventfd (the vector's pending bit) instead of being dropped
/// by a GSI without a route.
pub struct VectorIrq {
    gsi: u32,
    fd: EventFd,
    registered: bool,
}

impl VectorIrq {
    /// A new eventfd on `gsi` (allocated from `router`), registered as an irqfd.
    pub fn new(router: &MsiRouter, vm: &VmFd, gsi: u32) -> Result<Self, RouterError> {
        let fd = router.irqfd(vm, gsi)?;
        Ok(Self {
            gsi,
            fd,
            registered: true,
        })
    }

    /// The GSI.
    pub fn gsi(&self) -> u32 {
        self.gsi
    }

    /// The eventfd the device signals.
    pub fn fd(&self) -> &EventFd {
        &self.fd
    }

    /// Whether KVM consumes the eventfd now (the vector is unmasked).
    pub fn registered(&self) -> bool {
        self.registered
    }

    /// Masks: KVM stops consuming the eventfd, so later signals stay pending in it.
    pub fn mask(&mut self, vm: &VmFd) -> Result<(), RouterError> {
        if self.registered {
            vm.unregister_irqfd(&self.fd, self.gsi)
                .map_err(|e| RouterError::Irqfd {
                    gsi: self.gsi,
                    source: std::io::Error::from_raw_os_error(e.errno()),
                })?;
            self.registered = false;
        }
        Ok(())
    }

    /// Unmasks (the GSI's route must be applied first): KVM consumes the eventfd again and
    /// delivers a signal counted while masked at once; `pending` (a pending bit the VMM took
    /// from the eventfd earlier, see [`VectorIrq::take_pending`]) is delivered too.
    pub fn unmask(&mut self, vm: &VmFd, pending: bool) -> Result<(), RouterError> {
        let irqfd_err = |gsi, e: std::io::Error| RouterError::Irqfd { gsi, source: e };
        if !self.registered {
            vm.register_irqfd(&self.fd, self.gsi)
                .map_err(|e| irqfd_err(self.gsi, std::io::Error::from_raw_os_error(e.errno())))?;
            self.registered = true;
        }
        if pending {
            self.fd.write(1).map_err(|e| irqfd_err(self.gsi, e))?;
        }
        Ok(())
    }

    /// While masked: whether signals arrived since the last call (they are taken from the
    /// eventfd; the caller keeps them as the pending bit). Always false while unmasked.
    pub fn take_pending(&mut self) -> bool {
        // A non-blocking eventfd reads its count and resets it, or fails when it is zero.
        !self.registered && self.fd.read().is_ok_and(|count| count > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_keeps_kvms_default_irqchip_routes() {
        let router = MsiRouter::new(4096);
        let entries = router.entries();
        assert_eq!(entries.len(), DEFAULT_ROUTES as usize);
        let find = |gsi, chip| {
            entries.iter().find(|e| {
                // SAFETY: every entry here is an irqchip route (checked below).
                e.gsi == gsi && unsafe { e.u.irqchip.irqchip } == chip
            })
        };
        for e in &entries {
            assert_eq!(e.type_, KVM_IRQ_ROUTING_IRQCHIP);
        }
        for gsi in 0..24 {
            let route = find(gsi, KVM_IRQCHIP_IOAPIC).expect("IOAPIC route");
            // SAFETY: an irqchip route.
            assert_eq!(unsafe { route.u.irqchip.pin }, gsi);
        }
        // SAFETY: irqchip routes.
        unsafe {
            assert_eq!(
                find(4, KVM_IRQCHIP_PIC_MASTER).expect("COM1").u.irqchip.pin,
                4
            );
            assert_eq!(
                find(12, KVM_IRQCHIP_PIC_SLAVE).expect("PIC").u.irqchip.pin,
                4
            );
        }
        assert!(find(16, KVM_IRQCHIP_PIC_MASTER).is_none());
        assert!(find(16, KVM_IRQCHIP_PIC_SLAVE).is_none());
    }

    #[test]
    fn gsis_start_above_the_ioapic_and_are_reused() {
        let mut router = MsiRouter::new(4096);
        let a = router.allocate().expect("a");
        let b = router.allocate().expect("b");
        assert_eq!((a, b), (24, 25));
        router.release(a).expect("release");
        assert_eq!(router.allocate().expect("again"), 24);
        assert!(matches!(
            router.release(99),
            Err(RouterError::UnknownGsi(99))
        ));
        assert!(matches!(
            router.set_route(3, None),
            Err(RouterError::UnknownGsi(3))
        ));
    }

    #[test]
    fn only_routed_gsis_enter_the_table() {
        let mut router = MsiRouter::new(4096);
        let a = router.allocate().expect("a");
        let b = router.allocate().expect("b");
        let message = MsiMessage {
            address: 0x1_fee0_1000,
            data: 0x45,
        };
        router.set_route(b, Some(message)).expect("route");
        let entries = router.entries();
        assert_eq!(entries.len(), DEFAULT_ROUTES as usize + 1);
        let last = entries.last().expect("msi route");
        assert_eq!((last.gsi, last.type_), (b, KVM_IRQ_ROUTING_MSI));
        // SAFETY: an MSI route.
        let msi = unsafe { last.u.msi };
        assert_eq!(
            (msi.address_lo, msi.address_hi, msi.data),
            (0xfee0_1000, 1, 0x45)
        );
        assert!(entries.iter().all(|e| e.gsi != a));
        router.set_route(b, None).expect("unroute");
        assert_eq!(router.entries().len(), DEFAULT_ROUTES as usize);
    }

    #[test]
    fn allocation_stops_where_kvms_table_is_full() {
        // 64 routes: 40 default ones leave 24 for MSI.
        let mut router = MsiRouter::new(64);
        assert_eq!(router.capacity(), 24);
        for _ in 0..24 {
            router.allocate().expect("fits");
        }
        assert!(matches!(
            router.allocate(),
            Err(RouterError::Exhausted {
                in_use: 24,
                capacity: 24
            })
        ));
        // The real limit: 4096 routes, GSIs below 4096.
        let router = MsiRouter::new(4096);
        assert_eq!(router.capacity(), 4096 - 40);
        assert!(MsiRouter::new(10).capacity() == 0);
    }

    #[test]
    fn a_masked_vector_keeps_its_signals_as_pending() {
        let fd = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        let mut vector = VectorIrq {
            gsi: 24,
            fd,
            registered: false,
        };
        assert!(!vector.take_pending(), "nothing signalled yet");
        vector.fd().write(1).expect("signal");
        vector.fd().write(1).expect("signal again");
        assert!(vector.take_pending(), "two signals: pending");
        assert!(!vector.take_pending(), "taken: the bit is the caller's now");
        vector.fd().write(1).expect("signal");
        vector.registered = true;
        assert!(
            !vector.take_pending(),
            "KVM consumes an unmasked vector's eventfd"
        );
    }
}
