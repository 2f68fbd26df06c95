//! Snapshot state of the PCI root: every function's configuration space (header, BAR
//! addresses, MSI registers with their mask and pending bits), emulated MSI-X tables with
//! their pending bits, the CF8 address latch and the MSI GSI routes.
//!
//! The state carries its own version and CRC-32 (on top of the state file's), so a PCI state
//! this build cannot read, or one damaged after it was written, is refused by name.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use snapshot::Persist;

use super::bus::{PciConfigIo, PciRoot, Placement};
use super::config::{reg, CONFIG_SPACE_SIZE};
use super::msix::MsiMessage;
use super::router::MsiRouter;
use super::vfio::VfioSet;
use super::PciMachine;
use crate::vstate::bus::lock;

/// The PCI state layout this build writes and reads.
pub const PCI_STATE_VERSION: u32 = 1;

/// Errors saving or restoring PCI state; each names the function, GSI or field.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciPersistError {
    /// A version this build does not read.
    #[error(
        "the snapshot's PCI state is version {found}; this build reads version {PCI_STATE_VERSION}"
    )]
    Version {
        /// The version found.
        found: u32,
    },
    /// The state's own checksum does not match.
    #[error("the snapshot's PCI state is damaged: CRC-32 {actual:#010x} does not match the stored {expected:#010x}")]
    Crc {
        /// Stored CRC.
        expected: u32,
        /// Computed CRC.
        actual: u32,
    },
    /// A configuration space of the wrong size.
    #[error("the snapshot's PCI state for 00:{slot:02x}.0 has {len} bytes of configuration space, not {CONFIG_SPACE_SIZE}")]
    ConfigLength {
        /// The slot.
        slot: u8,
        /// Bytes saved.
        len: usize,
    },
    /// A saved function this VM does not have.
    #[error(
        "the snapshot has a PCI function at 00:{slot:02x}.0 ({id}) that this microVM does not have"
    )]
    NoFunction {
        /// The slot.
        slot: u8,
        /// Its saved vendor:device.
        id: String,
    },
    /// A function that is something else now.
    #[error("PCI function 00:{slot:02x}.0 is {found} here but {saved} in the snapshot")]
    Identity {
        /// The slot.
        slot: u8,
        /// Saved vendor:device class.
        saved: String,
        /// This VM's.
        found: String,
    },
    /// A function of this VM the snapshot does not have.
    #[error(
        "PCI function 00:{slot:02x}.0 of this microVM is missing from the snapshot's PCI state"
    )]
    Missing {
        /// The slot.
        slot: u8,
    },
    /// A slot given twice.
    #[error("the snapshot's PCI state lists 00:{slot:02x}.0 twice")]
    Duplicate {
        /// The slot.
        slot: u8,
    },
    /// MSI-X state that does not fit the function.
    #[error("PCI function 00:{slot:02x}.0: MSI-X state: {detail}")]
    Msix {
        /// The slot.
        slot: u8,
        /// What is wrong.
        detail: String,
    },
    /// A GSI route that cannot be taken again.
    #[error("PCI MSI route of GSI {gsi}: {detail}")]
    Route {
        /// The GSI.
        gsi: u32,
        /// What is wrong.
        detail: String,
    },
    /// Passed-through devices have state only the device holds.
    #[error("a microVM with VFIO device(s) {0} cannot be saved: a passed-through device's state cannot be saved without the device's help")]
    Vfio(String),
}

/// MSI-X vectors of an emulated function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixPersistState {
    /// Per vector: address low, address high, data, vector control (the mask bit).
    pub table: Vec<[u32; 4]>,
    /// Pending bits, 64 vectors a word.
    pub pending: Vec<u64>,
    /// MSI-X enable.
    pub enabled: bool,
    /// Function mask.
    pub function_masked: bool,
}

/// One PCI function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciFunctionState {
    /// Its slot on bus 0.
    pub slot: u8,
    /// Its 4 KiB configuration space as the guest reads it.
    pub config: Vec<u8>,
    /// Its MSI-X vectors, if the VMM emulates MSI-X for it.
    #[serde(default)]
    pub msix: Option<MsixPersistState>,
}

/// One MSI GSI and its route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GsiRouteState {
    /// The GSI.
    pub gsi: u32,
    /// Message address and data; `None` while the vector is masked or unset.
    pub route: Option<(u64, u32)>,
}

/// The PCI root's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciPersistState {
    /// [`PCI_STATE_VERSION`] when written.
    pub version: u32,
    /// The CF8 address latch.
    pub config_address: u32,
    /// Every function on bus 0, host bridge first.
    pub functions: Vec<PciFunctionState>,
    /// The MSI GSIs and their routes.
    pub routes: Vec<GsiRouteState>,
    /// CRC-32 of everything above ([`PciPersistState::checksum`]).
    pub crc: u32,
}

impl PciPersistState {
    /// CRC-32 over every field but `crc`, in a fixed little-endian encoding.
    pub fn checksum(&self) -> u32 {
        let mut h = crc32fast::Hasher::new();
        h.update(&self.version.to_le_bytes());
        h.update(&self.config_address.to_le_bytes());
        h.update(&(self.functions.len() as u64).to_le_bytes());
        for f in &self.functions {
            h.update(&[f.slot]);
            h.update(&(f.config.len() as u64).to_le_bytes());
            h.update(&f.config);
            match &f.msix {
                None => h.update(&[0]),
                Some(m) => {
                    h.update(&[1, u8::from(m.enabled), u8::from(m.function_masked)]);
                    h.update(&(m.table.len() as u64).to_le_bytes());
                    for word in m.table.iter().flatten() {
                        h.update(&word.to_le_bytes());
                    }
                    h.update(&(m.pending.len() as u64).to_le_bytes());
                    for word in &m.pending {
                        h.update(&word.to_le_bytes());
                    }
                }
            }
        }
        h.update(&(self.routes.len() as u64).to_le_bytes());
        for r in &self.routes {
            h.update(&r.gsi.to_le_bytes());
            match r.route {
                None => h.update(&[0]),
                Some((address, data)) => {
                    h.update(&[1]);
                    h.update(&address.to_le_bytes());
                    h.update(&data.to_le_bytes());
                }
            }
        }
        h.finalize()
    }

    /// Checks the version, the CRC and each configuration space's size, before any restore
    /// work starts.
    pub fn check(&self) -> Result<(), PciPersistError> {
        if self.version != PCI_STATE_VERSION {
            return Err(PciPersistError::Version {
                found: self.version,
            });
        }
        let actual = self.checksum();
        if actual != self.crc {
            return Err(PciPersistError::Crc {
                expected: self.crc,
                actual,
            });
        }
        for (i, f) in self.functions.iter().enumerate() {
            if f.config.len() != CONFIG_SPACE_SIZE {
                return Err(PciPersistError::ConfigLength {
                    slot: f.slot,
                    len: f.config.len(),
                });
            }
            if self.functions[..i].iter().any(|g| g.slot == f.slot) {
                return Err(PciPersistError::Duplicate { slot: f.slot });
            }
        }
        Ok(())
    }
}

/// "vendor:device class" of a configuration space.
fn identity(config: &[u8]) -> String {
    let at = |i: usize| config.get(i).copied().unwrap_or(0xff);
    format!(
        "{:02x}{:02x}:{:02x}{:02x} class {:02x}{:02x}{:02x}",
        at(reg::VENDOR_ID + 1),
        at(reg::VENDOR_ID),
        at(reg::DEVICE_ID + 1),
        at(reg::DEVICE_ID),
        at(0x0b),
        at(0x0a),
        at(0x09)
    )
}

/// A freshly attached PCI root, built the way the snapshot's VM was, to restore into.
pub struct PciRestoreArgs {
    /// The bus with its devices.
    pub root: Arc<PciRoot>,
    /// Where the BARs went when it was attached.
    pub placements: Vec<Placement>,
    /// Ports CF8-CFF.
    pub config_io: Arc<Mutex<PciConfigIo>>,
    /// A router with no GSIs taken.
    pub router: Arc<Mutex<MsiRouter>>,
}

impl Persist for PciMachine {
    type State = PciPersistState;
    type ConstructorArgs = PciRestoreArgs;
    type Error = PciPersistError;

    fn save(&self) -> Result<PciPersistState, PciPersistError> {
        if !self.vfio.paths.is_empty() {
            let names: Vec<String> = self
                .vfio
                .paths
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            return Err(PciPersistError::Vfio(names.join(", ")));
        }
        let functions = self
            .root
            .functions()
            .map(|(slot, device)| {
                let device = lock(device);
                PciFunctionState {
                    slot: slot as u8,
                    config: device.config().bytes().to_vec(),
                    msix: device.msix().map(|m| MsixPersistState {
                        table: m.table(),
                        pending: m.pending_words().to_vec(),
                        enabled: m.enabled(),
                        function_masked: m.function_masked(),
                    }),
                }
            })
            .collect();
        let routes = lock(&self.router)
            .routes()
            .into_iter()
            .map(|(gsi, m)| GsiRouteState {
                gsi,
                route: m.map(|m| (m.address, m.data)),
            })
            .collect();
        let mut state = PciPersistState {
            version: PCI_STATE_VERSION,
            config_address: lock(&self.config_io).address(),
            functions,
            routes,
            crc: 0,
        };
        state.crc = state.checksum();
        Ok(state)
    }

    fn restore(args: PciRestoreArgs, state: &PciPersistState) -> Result<Self, PciPersistError> {
        state.check()?;
        for (slot, _) in args.root.functions() {
            if !state.functions.iter().any(|f| usize::from(f.slot) == slot) {
                return Err(PciPersistError::Missing { slot: slot as u8 });
            }
        }
        for saved in &state.functions {
            let slot = saved.slot;
            let device = args.root.function(usize::from(slot)).ok_or_else(|| {
                PciPersistError::NoFunction {
                    slot,
                    id: identity(&saved.config),
                }
            })?;
            let mut device = lock(device);
            let found = identity(device.config().bytes());
            if found != identity(&saved.config) {
                return Err(PciPersistError::Identity {
                    slot,
                    saved: identity(&saved.config),
                    found,
                });
            }
            let mut bytes = [0u8; CONFIG_SPACE_SIZE];
            bytes.copy_from_slice(&saved.config);
            device.config_mut().restore_bytes(&bytes);
            let msix_err = |detail: String| PciPersistError::Msix { slot, detail };
            match (&saved.msix, device.msix_mut()) {
                (None, None) => {}
                (Some(m), Some(msix)) => msix
                    .restore(&m.table, &m.pending, m.enabled, m.function_masked)
                    .map_err(|e| msix_err(e.to_string()))?,
                (Some(_), None) => return Err(msix_err("saved, but the function has none".into())),
                (None, Some(_)) => {
                    return Err(msix_err("the function has MSI-X, none was saved".into()))
                }
            }
        }
        lock(&args.config_io).set_address(state.config_address);
        {
            let mut router = lock(&args.router);
            for r in &state.routes {
                let message = r.route.map(|(address, data)| MsiMessage { address, data });
                router
                    .restore_route(r.gsi, message)
                    .map_err(|e| PciPersistError::Route {
                        gsi: r.gsi,
                        detail: e.to_string(),
                    })?;
            }
        }
        Ok(PciMachine {
            root: args.root,
            placements: args.placements,
            vfio: VfioSet {
                devices: Vec::new(),
                paths: Vec::new(),
            },
            router: args.router,
            config_io: args.config_io,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::pci::bus::{PciDevice, SharedPciDevice};
    use crate::devices::pci::config::{Bar, BarKind, ConfigSpace, DeviceIdentity};
    use crate::devices::pci::msix::{Msix, Signal, CONTROL_ENABLE};
    use crate::vstate::bus::Bus;

    /// A function with a 64-bit BAR and emulated MSI-X vectors.
    struct Emulated {
        config: ConfigSpace,
        msix: Msix,
    }

    impl Emulated {
        fn shared() -> SharedPciDevice {
            let mut config = ConfigSpace::new(DeviceIdentity {
                vendor: 0x1af4,
                device: 0x1042,
                class: [0x01, 0x00, 0x00],
                ..Default::default()
            });
            let bar = Bar {
                kind: BarKind::Memory64 { prefetchable: true },
                size: 1 << 30,
            };
            config.add_bar(2, bar).expect("bar");
            let msix = Msix::new(4).expect("msix");
            Arc::new(Mutex::new(Self { config, msix }))
        }
    }

    impl PciDevice for Emulated {
        fn config(&self) -> &ConfigSpace {
            &self.config
        }
        fn config_mut(&mut self) -> &mut ConfigSpace {
            &mut self.config
        }
        fn msix(&self) -> Option<&Msix> {
            Some(&self.msix)
        }
        fn msix_mut(&mut self) -> Option<&mut Msix> {
            Some(&mut self.msix)
        }
    }

    /// A VM's PCI bus as `attach` builds it, with the emulated function at slot 1 when asked.
    fn machine(emulated: bool) -> (PciMachine, Bus) {
        let mut root = PciRoot::new();
        if emulated {
            root.add(Emulated::shared()).expect("slot");
        }
        let (mut pio, mut mmio) = (Bus::default(), Bus::default());
        let attached =
            super::super::attach(root, &mut pio, &mut mmio, 1 << 30, 46).expect("attach");
        let machine = PciMachine {
            root: attached.root,
            placements: attached.placements,
            vfio: VfioSet {
                devices: Vec::new(),
                paths: Vec::new(),
            },
            router: Arc::new(Mutex::new(MsiRouter::new(4096))),
            config_io: attached.config_io,
        };
        (machine, pio)
    }

    fn args(machine: PciMachine) -> PciRestoreArgs {
        PciRestoreArgs {
            root: machine.root,
            placements: machine.placements,
            config_io: machine.config_io,
            router: Arc::new(Mutex::new(MsiRouter::new(4096))),
        }
    }

    fn cf8(pio: &mut Bus, slot: u32, register: u32) -> u32 {
        assert!(pio.write(0xcf8, &(0x8000_0000 | slot << 11 | register).to_le_bytes()));
        let mut data = [0u8; 4];
        assert!(pio.read(0xcfc, &mut data));
        u32::from_le_bytes(data)
    }

    /// A guest-driven state: BAR moved, decoding on, vector 1 routed, vector 2 masked with a
    /// signal pending, a GSI route, and the CF8 latch left pointing at slot 1.
    fn drive(machine: &PciMachine, pio: &mut Bus) {
        let device = machine.root.function(1).expect("slot 1");
        {
            let mut device = lock(device);
            device.write_config(reg::BAR0 + 8, &0x8000_000cu32.to_le_bytes());
            device.write_config(reg::BAR0 + 12, &0x10u32.to_le_bytes());
            device.write_config(reg::COMMAND, &0x6u16.to_le_bytes());
            let msix = device.msix_mut().expect("msix");
            for vector in [1u64, 2] {
                let entry = vector * 16;
                msix.write_table(entry, &0xfee0_0000u32.to_le_bytes())
                    .expect("address");
                msix.write_table(entry + 8, &(0x40 + vector as u32).to_le_bytes())
                    .expect("data");
            }
            msix.write_table(16 + 12, &0u32.to_le_bytes())
                .expect("unmask 1");
            msix.control_written(CONTROL_ENABLE);
            assert_eq!(msix.signal(2), Ok(Signal::Pending));
        }
        let mut router = lock(&machine.router);
        let gsi = router.allocate().expect("gsi");
        router
            .set_route(
                gsi,
                Some(MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x41,
                }),
            )
            .expect("route");
        router.allocate().expect("unrouted gsi");
        drop(router);
        assert_eq!(cf8(pio, 1, 0), 0x1042_1af4);
    }

    #[test]
    fn a_saved_bus_restores_into_a_fresh_one_exactly() {
        let (parent, mut pio) = machine(true);
        drive(&parent, &mut pio);
        let saved = parent.save().expect("save");
        assert_eq!(saved.functions.len(), 2);
        assert_eq!(saved.routes.len(), 2);
        let (fresh, fresh_pio) = machine(true);
        let restored = PciMachine::restore(args(fresh), &saved).expect("restore");
        assert_eq!(restored.save().expect("save again"), saved);
        let device = restored.root.function(1).expect("slot 1");
        {
            let device = lock(device);
            assert_eq!(device.config().bar_address(2), Some(0x10_8000_0000));
            assert_eq!(device.config().command(), 0x6);
            let msix = device.msix().expect("msix");
            assert!(msix.enabled() && msix.is_pending(2) && !msix.is_pending(1));
            assert_eq!(
                msix.message(1),
                Some(MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x41
                })
            );
        }
        assert_eq!(
            lock(&restored.router).routes(),
            vec![
                (
                    24,
                    Some(MsiMessage {
                        address: 0xfee0_0000,
                        data: 0x41
                    })
                ),
                (25, None)
            ]
        );
        // The CF8 latch came back: a data read without writing CF8 reads slot 1's ID.
        let mut data = [0u8; 4];
        assert!(fresh_pio.read(0xcfc, &mut data));
        assert_eq!(u32::from_le_bytes(data), 0x1042_1af4);
        // Unmasking vector 2 after the restore delivers its pending signal.
        let mut device = lock(device);
        let msix = device.msix_mut().expect("msix");
        let delivered = msix
            .write_table(2 * 16 + 12, &0u32.to_le_bytes())
            .expect("unmask");
        assert_eq!(delivered.len(), 1);
        assert_eq!(delivered[0].0, 2);
    }

    #[test]
    fn the_state_survives_the_state_files_encoding() {
        let (parent, mut pio) = machine(true);
        drive(&parent, &mut pio);
        let saved = parent.save().expect("save");
        let bytes = snapshot::format::encode(&saved).expect("encode");
        let decoded: PciPersistState =
            snapshot::format::decode(std::path::Path::new("pci"), &bytes).expect("decode");
        assert_eq!(decoded, saved);
        decoded.check().expect("intact");
    }

    #[test]
    fn damaged_or_foreign_state_is_refused_by_name() {
        let (parent, mut pio) = machine(true);
        drive(&parent, &mut pio);
        let saved = parent.save().expect("save");

        let mut damaged = saved.clone();
        damaged.functions[1].config[0x10] ^= 0x40;
        let err = PciMachine::restore(args(machine(true).0), &damaged).err();
        assert!(matches!(err, Some(PciPersistError::Crc { .. })), "{err:?}");
        assert!(err
            .map(|e| e.to_string())
            .is_some_and(|m| m.contains("PCI state is damaged")));

        let mut newer = saved.clone();
        newer.version = 2;
        newer.crc = newer.checksum();
        assert_eq!(newer.check(), Err(PciPersistError::Version { found: 2 }));

        let mut short = saved.clone();
        short.functions[0].config.truncate(256);
        short.crc = short.checksum();
        assert_eq!(
            short.check(),
            Err(PciPersistError::ConfigLength { slot: 0, len: 256 })
        );

        // The bus has only the host bridge: slot 1 has nowhere to go.
        let err = PciMachine::restore(args(machine(false).0), &saved).err();
        assert!(
            matches!(err, Some(PciPersistError::NoFunction { slot: 1, .. })),
            "{err:?}"
        );
        // A function the snapshot lacks.
        let bare = machine(false).0.save().expect("save bare");
        let err = PciMachine::restore(args(machine(true).0), &bare).err();
        assert_eq!(err, Some(PciPersistError::Missing { slot: 1 }));

        let mut other = saved.clone();
        other.functions[1].config[0] = 0x86;
        other.functions[1].config[1] = 0x80;
        other.crc = other.checksum();
        let err = PciMachine::restore(args(machine(true).0), &other).err();
        assert!(
            matches!(err, Some(PciPersistError::Identity { slot: 1, .. })),
            "{err:?}"
        );

        let mut route = saved.clone();
        route.routes[0].gsi = 3;
        route.crc = route.checksum();
        let err = PciMachine::restore(args(machine(true).0), &route).err();
        assert!(
            matches!(err, Some(PciPersistError::Route { gsi: 3, .. })),
            "{err:?}"
        );
    }

    #[test]
    fn vfio_machines_are_not_saved() {
        let (mut parent, _) = machine(false);
        parent
            .vfio
            .paths
            .push("/sys/bus/pci/devices/0000:00:04.0".into());
        let err = parent
            .save()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("0000:00:04.0"), "{err}");
        assert!(parent.snapshot_refusal().is_some());
    }
}
