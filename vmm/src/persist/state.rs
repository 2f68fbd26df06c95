//! The state file: what a snapshot holds besides guest memory (machine, memory layers, VM,
//! vCPUs, devices, generation, PCI), how it is written and how a restore finds and checks it.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use snapshot::format::write_state_file;
use snapshot::memory::{relative_to, resolve_in, MemoryLayer};
use snapshot::Persist;

use super::PersistError;
use crate::builder::MicroVm;
use crate::device_manager::VirtioPersistState;
use crate::devices::legacy::i8042::I8042PersistState;
use crate::devices::legacy::serial::SerialPersistState;
use crate::devices::pci::persist::PciPersistState;
use crate::vmm_config::MachineConfig;
use crate::vstate::vcpu::VcpuState;
use crate::vstate::vm::VmState;

/// Everything a restore needs besides the memory file.
#[derive(Debug, Serialize, Deserialize)]
pub struct MicroVmState {
    /// vCPUs and memory size.
    pub machine: MachineConfig,
    /// Guest memory regions (guest address, length), in memory-file order.
    pub regions: Vec<(u64, u64)>,
    /// Memory layers: a full base, then diffs.
    pub memory_layers: Vec<MemoryLayer>,
    /// Irqchips, PIT, clock.
    pub vm: VmState,
    /// Every vCPU.
    pub vcpus: Vec<VcpuState>,
    /// COM1.
    pub serial: SerialPersistState,
    /// i8042.
    pub i8042: I8042PersistState,
    /// Virtio devices in MMIO order.
    pub devices: Vec<VirtioPersistState>,
    /// The VM generation counter.
    #[serde(default)]
    pub generation: u64,
    /// The PCI bus of a VM booted with `--pci` (absent without one, as in older snapshots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci: Option<PciPersistState>,
}

/// The directory a state file's relative layer paths start from, made absolute.
pub(super) fn state_dir(state_path: &Path) -> PathBuf {
    let dir = match state_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => dir.to_path_buf(),
        None => PathBuf::from("."),
    };
    std::fs::canonicalize(&dir).unwrap_or(dir)
}

/// The layers as a state file at `state_path` records them: relative to its directory, so the
/// snapshot can move. `layers` become absolute.
pub(super) fn record_layers(
    state_path: &Path,
    layers: &mut [MemoryLayer],
) -> Result<Vec<MemoryLayer>, PersistError> {
    let dir = state_dir(state_path);
    let mut recorded = layers.to_vec();
    for (layer, stored) in layers.iter_mut().zip(&mut recorded) {
        stored.path = relative_to(&dir, &layer.path).map_err(|e| PersistError::Missing {
            path: layer.path.clone(),
            detail: e.to_string(),
        })?;
        layer.path = resolve_in(&dir, &stored.path);
    }
    Ok(recorded)
}

/// Saves every vCPU, the VM and the devices into the state file at `state_path`.
pub(super) fn write_state(
    vm: &MicroVm,
    state_path: &Path,
    regions: Vec<(u64, u64)>,
    recorded: Vec<MemoryLayer>,
) -> Result<(), PersistError> {
    let mut vcpus = Vec::new();
    for vcpu in &vm.vcpus {
        vcpus.push(vcpu.vcpu().save()?);
    }
    // In the state file's order: the VM, then the devices.
    let vm_state = vm.vm.save()?;
    let devices = vm.devices.save()?;
    let state = MicroVmState {
        machine: vm.machine.clone(),
        regions,
        memory_layers: recorded,
        vm: vm_state,
        vcpus,
        serial: devices.serial,
        i8042: devices.i8042,
        devices: devices.virtio,
        generation: vm.generation.load(Ordering::SeqCst),
        pci: vm.pci.as_ref().map(|p| p.save()).transpose()?,
    };
    write_state_file(state_path, &state)?;
    Ok(())
}

/// Resolves `--restore PATH`: a directory holding `vmstate`, or the state file itself.
pub fn state_path_of(path: &Path) -> Result<PathBuf, PersistError> {
    let meta = std::fs::metadata(path).map_err(|e| PersistError::Missing {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    if meta.is_dir() {
        let state = path.join("vmstate");
        if !state.exists() {
            return Err(PersistError::Missing {
                path: path.to_path_buf(),
                detail: "the directory has no vmstate file".into(),
            });
        }
        return Ok(state);
    }
    Ok(path.to_path_buf())
}

/// Refuses a snapshot whose PCI state does not match its machine, or is damaged.
pub(super) fn check_pci_state(state_path: &Path, state: &MicroVmState) -> Result<(), PersistError> {
    let rollbox = &state.machine.rollbox;
    match &state.pci {
        Some(_) if !rollbox.vfio.is_empty() => Err(PersistError::Mismatch(format!(
            "{}: the snapshot's microVM has VFIO devices, which cannot be restored",
            state_path.display()
        ))),
        Some(_) if !rollbox.has_pci() => Err(PersistError::Mismatch(format!(
            "{}: the snapshot holds PCI state but its microVM has no PCI bus (--pci); it was not written by rollbox-vmm or was altered",
            state_path.display()
        ))),
        Some(pci) => pci.check().map_err(|e| {
            PersistError::Mismatch(format!("{}: {e}", state_path.display()))
        }),
        None if rollbox.has_pci() => Err(PersistError::Mismatch(format!(
            "{}: the snapshot's microVM has a PCI bus (--pci) but the snapshot holds no PCI state",
            state_path.display()
        ))),
        None => Ok(()),
    }
}
