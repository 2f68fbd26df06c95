//! Microvm snapshots: saving every vCPU, the VM and the devices into a state file next to a
//! sparse memory file, and restoring them in a new process with a chosen memory backend.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use snapshot::format::{read_state_file, write_state_file, FormatError};
use snapshot::memory::{
    apply_layer, fill_full, open_layer, random_id, relative_to, resolve_in, write_diff, write_full,
    FullMemoryFile, HostRegion, MemoryFileError, MemoryLayer, Sparseness, PAGE_SIZE,
};
use snapshot::uffd::{PageServer, PageServerOptions, UffdError};
use vm_memory::bitmap::{AtomicBitmap, Bitmap, NewBitmap};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap, MmapRegion,
};

use crate::background_snapshot::{
    BackgroundSnapshotError, DumpJob, ImageKind, PendingMemory, StartedDump,
};
use crate::builder::{
    assemble, create_vm, Assembly, BuildError, MemoryBacking, MemoryKind, MicroVm,
};
use crate::config::{host_memory_mib, ConsoleConfig, MachineConfig};
use crate::device_manager::persist::{check_overrides, rebuild_devices};
use crate::device_manager::{
    attach_devices, console_out, DeviceManagerError, DeviceOverrides, GenerationView, SavedDevices,
    VirtioPersistState,
};
use crate::devices::legacy::generation::{announce_new_generation, GenerationError};
use crate::devices::legacy::i8042::I8042PersistState;
use crate::devices::legacy::serial::SerialPersistState;
use crate::devices::pci::persist::{PciPersistError, PciPersistState};
use crate::devices::virtio::net::NetOverride;
use crate::vstate::memory::GuestMemoryMmap;
use crate::vstate::memory::{create_guest_memory, Sharing};
use crate::vstate::vcpu::{saveable_msrs, Vcpu, VcpuError, VcpuRestoreArgs, VcpuState};
use crate::vstate::vm::{open_kvm, Vm, VmState, VmStateError};
use kvm_ioctls::Kvm;
use snapshot::Persist;

/// Errors from creating or restoring snapshots.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The state file.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A memory file.
    #[error(transparent)]
    MemoryFile(#[from] MemoryFileError),
    /// The page server.
    #[error(transparent)]
    Uffd(#[from] UffdError),
    /// VM-wide KVM state.
    #[error(transparent)]
    VmState(#[from] VmStateError),
    /// vCPU state.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Building the restored VM.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// Announcing a new VM generation.
    #[error(transparent)]
    Generation(#[from] GenerationError),
    /// Saving or rebuilding the devices.
    #[error(transparent)]
    Devices(#[from] DeviceManagerError),
    /// A Diff snapshot with a shared volume: virtiofsd's writes to guest memory are not in
    /// any dirty log.
    #[error("a Diff snapshot of a microVM with a virtio-fs volume ({0}) is not supported: virtiofsd writes guest memory outside KVM's dirty log; take a Full snapshot")]
    FsDiff(String),
    /// A lazy restore with a shared volume.
    #[error("the uffd restore backend cannot serve a microVM with a virtio-fs volume ({0}): virtiofsd maps guest memory itself and would see pages not yet loaded; use copy (or cow, which means copy here)")]
    FsLazy(String),
    /// A microVM whose PCI state cannot be saved.
    #[error("{0}")]
    Pci(String),
    /// PCI state that cannot be saved or restored.
    #[error(transparent)]
    PciState(#[from] PciPersistError),
    /// The operation needs the VM paused.
    #[error("the microVM must be paused (PATCH /vm {{\"state\": \"Paused\"}}) before a snapshot")]
    NotPaused,
    /// A diff snapshot needs dirty tracking and a parent.
    #[error("a Diff snapshot needs {0}")]
    Diff(&'static str),
    /// The snapshot does not fit the request.
    #[error("{0}")]
    Mismatch(String),
    /// A snapshot directory or file is missing.
    #[error("snapshot {path}: {detail}")]
    Missing {
        /// The path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Guest memory could not be mapped.
    #[error("cannot map guest memory from {path}: {detail}")]
    Map {
        /// The memory file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// A device could not be rebuilt.
    #[error("device {device}: {detail}")]
    Device {
        /// The device.
        device: String,
        /// What failed.
        detail: String,
    },
}

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

/// Full or diff.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotType {
    /// All guest memory.
    Full,
    /// Pages written since the last snapshot (needs `track_dirty_pages`).
    Diff,
}

/// What a snapshot took.
#[derive(Debug, Clone)]
pub struct SnapshotReport {
    /// Bytes of guest memory data written.
    pub memory_bytes: u64,
    /// Wall time.
    pub elapsed_ms: f64,
}

fn host_regions(mem: &GuestMemoryMmap) -> Vec<HostRegion> {
    let mut offset = 0;
    mem.iter()
        .map(|r| {
            let region = HostRegion {
                host: r.as_ptr(),
                len: r.len(),
                file_offset: offset,
            };
            offset += r.len();
            region
        })
        .collect()
}

fn guest_len(regions: &[(u64, u64)]) -> u64 {
    regions.iter().map(|(_, len)| len).sum()
}

/// Dirty pages per region since the last call: KVM's log (guest writes) or'ed with the VMM's
/// bitmap (device writes). Both are cleared.
fn take_dirty(vm: &MicroVm) -> Result<Vec<Vec<u64>>, PersistError> {
    let mut out = Vec::new();
    for (slot, region) in vm.mem.iter().enumerate() {
        let mut bits = vm.vm.take_dirty_log(slot as u32, region.len() as usize)?;
        let mapping: &MmapRegion<AtomicBitmap> = region;
        let vmm_bits = mapping.bitmap().get_and_reset();
        for (word, extra) in bits.iter_mut().zip(vmm_bits) {
            *word |= extra;
        }
        out.push(bits);
    }
    Ok(out)
}

/// Puts dirty pages taken by [`take_dirty`] back (into the VMM's bitmap), after a snapshot
/// that failed: the next Diff snapshot must still see them.
fn give_back_dirty(vm: &MicroVm, dirty: &[Vec<u64>]) {
    for (region, bits) in vm.mem.iter().zip(dirty) {
        let mapping: &MmapRegion<AtomicBitmap> = region;
        for (index, word) in bits.iter().enumerate() {
            let mut word = *word;
            while word != 0 {
                let bit = word.trailing_zeros() as u64;
                word &= word - 1;
                let page = index as u64 * 64 + bit;
                mapping
                    .bitmap()
                    .mark_dirty((page * PAGE_SIZE) as usize, PAGE_SIZE as usize);
            }
        }
    }
}

/// Whether a snapshot becomes the base of the VM's next Diff snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Base {
    /// It does (`PUT /snapshot/create`): the dirty pages it holds are cleared.
    Becomes,
    /// It does not (a fork's snapshot): the diff base and the dirty pages stay as they were.
    Unchanged,
}

/// Snapshots a paused microVM: memory first, the state file last, both atomically. It becomes
/// the base of the next Diff snapshot; if it fails, the base and dirty pages stay as they were.
pub fn create_snapshot(
    vm: &mut MicroVm,
    kind: SnapshotType,
    state_path: &Path,
    mem_path: &Path,
) -> Result<SnapshotReport, PersistError> {
    snapshot_paused(vm, kind, state_path, mem_path, Base::Becomes)
}

/// A Full snapshot that leaves the VM's diff base and dirty pages alone (for a fork, whose
/// snapshot directory is the clones', not the parent's next diff base).
pub fn create_detached_snapshot(
    vm: &mut MicroVm,
    state_path: &Path,
    mem_path: &Path,
) -> Result<SnapshotReport, PersistError> {
    snapshot_paused(
        vm,
        SnapshotType::Full,
        state_path,
        mem_path,
        Base::Unchanged,
    )
}

/// How [`create_fork_snapshot`] wrote a fork's memory file.
pub enum ForkMemory {
    /// Written while the VM was paused.
    Written,
    /// Being written by a child process from the image of the pause; wait for it before the
    /// snapshot is used.
    Background(PendingMemory),
}

/// A Full snapshot for a fork of the paused `vm`, like [`create_detached_snapshot`], except
/// that private guest memory is imaged by fork(2) (`start_dump` forks, from a thread that
/// may) and written by the child while the VM runs on. The state file is written now and
/// names the memory file's identity in advance. Shared (virtio-fs) and lazily served memory
/// are written while paused.
pub fn create_fork_snapshot(
    vm: &mut MicroVm,
    state_path: &Path,
    mem_path: &Path,
    start_dump: impl FnOnce(DumpJob) -> Result<StartedDump, BackgroundSnapshotError>,
) -> Result<ForkMemory, PersistError> {
    let has_fs = vm.devices.memory_mapper().is_some();
    let image = match vm.memory.kind {
        _ if has_fs => None,
        MemoryKind::Anonymous if vm.mem.iter().all(|r| r.file_offset().is_none()) => {
            Some(ImageKind::PrivateAnonymous)
        }
        MemoryKind::FileBacked => Some(ImageKind::PrivateFile),
        MemoryKind::Anonymous | MemoryKind::Lazy => None,
    };
    let Some(image) = image else {
        create_detached_snapshot(vm, state_path, mem_path)?;
        return Ok(ForkMemory::Written);
    };
    with_backends_saved(vm, SnapshotType::Full, |vm| {
        let regions: Vec<(u64, u64)> = vm.mem.iter().map(|r| (r.start_addr().0, r.len())).collect();
        let memory = FullMemoryFile::create(mem_path, guest_len(&regions))?;
        let id = random_id();
        let mut layers = vec![MemoryLayer {
            path: mem_path.to_path_buf(),
            id,
            dirty: None,
        }];
        let recorded = record_layers(state_path, &mut layers)?;
        write_state(vm, state_path, regions, recorded)?;
        let started =
            DumpJob::new(&memory, mem_path, host_regions(&vm.mem), image).and_then(start_dump);
        match started {
            Ok(started) => Ok(ForkMemory::Background(PendingMemory::new(
                memory, mem_path, id, started,
            ))),
            Err(e) => {
                log::warn!("fork: {e}; writing memory while paused");
                let sparseness = match image {
                    ImageKind::PrivateAnonymous => Sparseness::PrivateAnonymous,
                    ImageKind::PrivateFile => Sparseness::EveryPage,
                };
                fill_full(
                    memory.file(),
                    memory.tmp_path(),
                    &host_regions(&vm.mem),
                    sparseness,
                )?;
                memory.commit(id)?;
                Ok(ForkMemory::Written)
            }
        }
    })
}

fn snapshot_paused(
    vm: &mut MicroVm,
    kind: SnapshotType,
    state_path: &Path,
    mem_path: &Path,
    base: Base,
) -> Result<SnapshotReport, PersistError> {
    let started = Instant::now();
    with_backends_saved(vm, kind, |vm| {
        write_snapshot(vm, kind, state_path, mem_path, started, base)
    })
}

/// Runs `write` on the paused VM once devices served by an outside backend (virtio-fs) have
/// stopped their rings and saved the backend's state, so guest memory is written after the
/// backend's last write; the rings start again afterwards, whether or not `write` succeeded.
fn with_backends_saved<T>(
    vm: &mut MicroVm,
    kind: SnapshotType,
    write: impl FnOnce(&mut MicroVm) -> Result<T, PersistError>,
) -> Result<T, PersistError> {
    if let Some(reason) = vm.pci.as_ref().and_then(|p| p.snapshot_refusal()) {
        return Err(PersistError::Pci(reason));
    }
    if !vm.paused {
        return Err(PersistError::NotPaused);
    }
    if kind == SnapshotType::Diff {
        if let Some(fs) = vm.devices.memory_mapper() {
            return Err(PersistError::FsDiff(fs));
        }
    }
    let result = match vm.devices.save_backends() {
        Ok(()) => write(vm),
        Err(e) => Err(e.into()),
    };
    // Rings start again whether or not the snapshot succeeded; the vCPUs are still paused.
    vm.devices.resume_backends();
    result
}

fn write_snapshot(
    vm: &mut MicroVm,
    kind: SnapshotType,
    state_path: &Path,
    mem_path: &Path,
    started: Instant,
    base: Base,
) -> Result<SnapshotReport, PersistError> {
    if kind == SnapshotType::Diff {
        if !vm.machine.track_dirty_pages {
            return Err(PersistError::Diff(
                "track_dirty_pages=true in the machine configuration",
            ));
        }
        if vm.memory.layers.is_empty() {
            return Err(PersistError::Diff(
                "an earlier Full snapshot (or a restore) to build on",
            ));
        }
        if let Some(index) = layer_at(&vm.memory.layers, mem_path) {
            return Err(PersistError::Mismatch(format!(
                "{}: this file is layer {index} of the memory chain the Diff snapshot builds on; write the diff to another file",
                mem_path.display()
            )));
        }
    }
    // Dirty pages are taken now (a Full snapshot holds them all, a Diff writes them) and
    // given back unless the state file is durable.
    let dirty = if base == Base::Becomes && vm.machine.track_dirty_pages {
        Some(take_dirty(vm)?)
    } else {
        None
    };
    let result = write_files(vm, kind, state_path, mem_path, dirty.as_deref());
    match result {
        Ok((layers, memory_bytes)) => {
            if base == Base::Becomes {
                vm.memory.layers = layers;
            }
            Ok(SnapshotReport {
                memory_bytes,
                elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
            })
        }
        Err(e) => {
            if let Some(dirty) = &dirty {
                give_back_dirty(vm, dirty);
            }
            Err(e)
        }
    }
}

/// Which layer of `layers`, if any, is the file at `path` (same device and inode).
fn layer_at(layers: &[MemoryLayer], path: &Path) -> Option<usize> {
    use std::os::unix::fs::MetadataExt;
    let target = std::fs::metadata(path).ok()?;
    layers.iter().position(|layer| {
        std::fs::metadata(&layer.path)
            .is_ok_and(|m| m.dev() == target.dev() && m.ino() == target.ino())
    })
}

/// The directory a state file's relative layer paths start from, made absolute.
fn state_dir(state_path: &Path) -> PathBuf {
    let dir = match state_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => dir.to_path_buf(),
        None => PathBuf::from("."),
    };
    std::fs::canonicalize(&dir).unwrap_or(dir)
}

/// Writes the memory file and the state file; returns the layer chain (absolute paths) and
/// the bytes of memory data written.
fn write_files(
    vm: &MicroVm,
    kind: SnapshotType,
    state_path: &Path,
    mem_path: &Path,
    dirty: Option<&[Vec<u64>]>,
) -> Result<(Vec<MemoryLayer>, u64), PersistError> {
    let regions: Vec<(u64, u64)> = vm.mem.iter().map(|r| (r.start_addr().0, r.len())).collect();
    let total = guest_len(&regions);
    let hosts = host_regions(&vm.mem);
    let (mut layers, memory_bytes) = match (kind, dirty) {
        (SnapshotType::Full, _) => {
            let shared: Vec<_> = vm
                .mem
                .iter()
                .filter_map(|r| {
                    r.file_offset()
                        .map(|f| (std::os::fd::AsFd::as_fd(f.file()), f.start()))
                })
                .collect();
            let sparseness = match vm.memory.kind {
                // Memory shared with virtiofsd is a memfd; boot memory is private.
                MemoryKind::Anonymous if shared.len() == regions.len() => {
                    Sparseness::SharedFiles(&shared)
                }
                MemoryKind::Anonymous => Sparseness::PrivateAnonymous,
                MemoryKind::FileBacked | MemoryKind::Lazy => Sparseness::EveryPage,
            };
            let layer = write_full(mem_path, &hosts, total, sparseness)?;
            let bytes = File::open(mem_path)
                .ok()
                .and_then(|f| snapshot::memory::data_ranges(&f, mem_path, total).ok())
                .map(|r| r.iter().map(|(_, l)| l).sum())
                .unwrap_or(0);
            (vec![layer], bytes)
        }
        (SnapshotType::Diff, Some(dirty)) => {
            let layer = write_diff(mem_path, &hosts, dirty, total)?;
            let bytes = layer
                .dirty
                .as_ref()
                .map(|r| r.iter().map(|(_, l)| l).sum())
                .unwrap_or(0);
            let mut layers = vm.memory.layers.clone();
            layers.push(layer);
            (layers, bytes)
        }
        (SnapshotType::Diff, None) => {
            return Err(PersistError::Diff("dirty page tracking"));
        }
    };
    let recorded = record_layers(state_path, &mut layers)?;
    write_state(vm, state_path, regions, recorded)?;
    Ok((layers, memory_bytes))
}

/// The layers as a state file at `state_path` records them: relative to its directory, so the
/// snapshot can move. `layers` become absolute.
fn record_layers(
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
fn write_state(
    vm: &MicroVm,
    state_path: &Path,
    regions: Vec<(u64, u64)>,
    recorded: Vec<MemoryLayer>,
) -> Result<(), PersistError> {
    let mut vcpus = Vec::new();
    for vcpu in &vm.vcpus {
        vcpus.push(vcpu.vcpu().save()?);
    }
    let devices = vm.devices.save()?;
    let state = MicroVmState {
        machine: vm.machine.clone(),
        regions,
        memory_layers: recorded,
        vm: vm.vm.save()?,
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

/// How a restore backs guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RestoreBackend {
    /// MAP_PRIVATE of the memory file: pages load on demand, clones share the page cache.
    #[default]
    Cow,
    /// Anonymous memory filled by the in-VMM userfaultfd page server.
    Uffd,
    /// Eager copy (the baseline).
    Copy,
}

impl std::str::FromStr for RestoreBackend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cow" => Ok(Self::Cow),
            "uffd" => Ok(Self::Uffd),
            "copy" => Ok(Self::Copy),
            other => Err(format!(
                "unknown restore backend {other:?}: use cow, uffd or copy"
            )),
        }
    }
}

/// Choices made at restore time.
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// Memory backend.
    pub backend: RestoreBackend,
    /// Use this file for the base memory layer instead of the recorded path.
    pub mem_file: Option<PathBuf>,
    /// Use these files for memory layers (by index in the chain, 0 = the full base) instead of
    /// the recorded paths.
    pub layer_overrides: HashMap<usize, PathBuf>,
    /// New host-side vsock socket (clones must not share one).
    pub vsock_uds: Option<PathBuf>,
    /// New image paths, by drive ID.
    pub drive_overrides: HashMap<String, PathBuf>,
    /// New host taps (and MACs), by interface ID (Firecracker's `network_overrides`).
    pub net_overrides: HashMap<String, NetOverride>,
    /// Give the guest a new generation counter value and VM generation ID (it was cloned).
    pub new_generation: bool,
    /// Deterministic reset: guest time and the generation stay exactly as the snapshot had them,
    /// and the host's wall clock is not offered. Needs a snapshot of a VM booted deterministic.
    pub deterministic: bool,
    /// Leave the vCPUs paused.
    pub paused: bool,
    /// Guest console.
    pub console: ConsoleConfig,
    /// uffd: record the pages the guest touches into `<memory file>.ws`.
    pub record_working_set: bool,
    /// uffd: prefetch the pages listed in `<memory file>.ws`.
    pub prefetch: bool,
    /// Refuse the snapshot unless it has exactly this much memory.
    pub expect_mem_mib: Option<u64>,
    /// Override dirty-page tracking for snapshots of the restored VM.
    pub track_dirty_pages: Option<bool>,
    /// New shared directories, by volume tag (rollbox `fs_overrides`, `--fs-override`).
    pub fs_overrides: HashMap<String, PathBuf>,
    /// The virtiofsd binary for volumes (`--virtiofsd`); else the one the snapshot's VM used,
    /// then the usual search.
    pub virtiofsd: Option<PathBuf>,
}

impl RestoreOptions {
    /// What the restored devices get instead of what the snapshot recorded.
    fn device_overrides(&self) -> DeviceOverrides<'_> {
        DeviceOverrides {
            drives: &self.drive_overrides,
            nets: &self.net_overrides,
            vsock_uds: self.vsock_uds.as_deref(),
            fs_dirs: &self.fs_overrides,
            virtiofsd: self.virtiofsd.as_deref(),
        }
    }
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

fn map_cow_region(
    file: &File,
    path: &Path,
    offset: u64,
    len: u64,
    guest_addr: u64,
) -> Result<GuestRegionMmap<AtomicBitmap>, PersistError> {
    let map_err = |detail: String| PersistError::Map {
        path: path.to_path_buf(),
        detail,
    };
    let file = file.try_clone().map_err(|e| map_err(e.to_string()))?;
    let region =
        MmapRegionBuilder::new_with_bitmap(len as usize, AtomicBitmap::with_len(len as usize))
            .with_file_offset(FileOffset::new(file, offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|e| map_err(e.to_string()))?;
    GuestRegionMmap::new(region, GuestAddress(guest_addr))
        .ok_or_else(|| map_err("region overflows".into()))
}

/// An empty VM built ahead of a restore: memory registered, irqchip and PIT created, vCPUs
/// created. KVM set-up is the slow part of a restore on these hosts (slot registration and
/// irqchip creation take milliseconds); a shell moves it off the restore path.
pub struct VmShell {
    /// /dev/kvm.
    pub kvm: Kvm,
    /// The VM.
    pub vm: Vm,
    /// Anonymous guest memory, registered and never touched.
    pub mem: GuestMemoryMmap,
    /// Created, unconfigured vCPUs.
    pub vcpus: Vec<Vcpu>,
    /// The shape it was built for.
    pub machine: MachineConfig,
}

impl VmShell {
    /// Builds a shell for `machine`.
    pub fn build(machine: &MachineConfig) -> Result<Self, PersistError> {
        let kvm = open_kvm().map_err(BuildError::from)?;
        let mem = create_guest_memory(machine.mem_size_mib << 20, Sharing::Private)
            .map_err(BuildError::from)?;
        let vm = create_vm(&kvm, &mem, machine.track_dirty_pages)?;
        let msrs = saveable_msrs(&kvm)?;
        let vcpus = (0..machine.vcpu_count as u8)
            .map(|index| Vcpu::new(vm.fd(), index, std::sync::Arc::clone(&msrs)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            kvm,
            vm,
            mem,
            vcpus,
            machine: machine.clone(),
        })
    }

    /// Whether a snapshot of this shape can be restored into the shell.
    fn fits(&self, machine: &MachineConfig, regions: &[(u64, u64)]) -> bool {
        let ours: Vec<(u64, u64)> = self
            .mem
            .iter()
            .map(|r| (r.start_addr().0, r.len()))
            .collect();
        self.machine.vcpu_count == machine.vcpu_count
            && self.machine.track_dirty_pages == machine.track_dirty_pages
            && ours == regions
    }
}

/// Maps the memory file privately over a registered region (KVM follows the change).
fn map_file_over(file: &File, path: &Path, region: &HostRegion) -> Result<(), PersistError> {
    // SAFETY: `region` is a live guest memory mapping owned by the shell, no vCPU runs yet, and
    // MAP_FIXED replaces exactly that range with a private mapping of the same length.
    let addr = unsafe {
        libc::mmap(
            region.host.cast(),
            region.len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            std::os::fd::AsRawFd::as_raw_fd(file),
            region.file_offset as libc::off_t,
        )
    };
    if addr != region.host.cast() {
        return Err(PersistError::Map {
            path: path.to_path_buf(),
            detail: std::io::Error::last_os_error().to_string(),
        });
    }
    Ok(())
}

/// Builds guest memory for a restore without a shell.
fn fresh_memory(
    regions: &[(u64, u64)],
    backend: RestoreBackend,
    base_file: &File,
    base_path: &Path,
) -> Result<GuestMemoryMmap, PersistError> {
    let map_err = |detail: String| PersistError::Map {
        path: base_path.to_path_buf(),
        detail,
    };
    let mut offset = 0;
    let mut out = Vec::new();
    for &(guest_addr, len) in regions {
        let region = match backend {
            RestoreBackend::Cow => map_cow_region(base_file, base_path, offset, len, guest_addr)?,
            RestoreBackend::Uffd | RestoreBackend::Copy => {
                let mapping = MmapRegion::<AtomicBitmap>::new(len as usize)
                    .map_err(|e| map_err(e.to_string()))?;
                GuestRegionMmap::new(mapping, GuestAddress(guest_addr))
                    .ok_or_else(|| map_err("region overflows".into()))?
            }
        };
        out.push(region);
        offset += len;
    }
    GuestMemoryMmap::from_regions(out).map_err(|e| map_err(e.to_string()))
}

/// Builds guest memory as one shared memfd in the snapshot's layout, for a VM with a volume.
fn shared_memory(regions: &[(u64, u64)], path: &Path) -> Result<GuestMemoryMmap, PersistError> {
    let map_err = |detail: String| PersistError::Map {
        path: path.to_path_buf(),
        detail,
    };
    let mem = create_guest_memory(guest_len(regions), Sharing::Memfd)
        .map_err(|e| map_err(e.to_string()))?;
    let layout: Vec<(u64, u64)> = mem.iter().map(|r| (r.start_addr().0, r.len())).collect();
    if layout != regions {
        return Err(map_err(format!(
            "the snapshot's memory layout {regions:x?} differs from this build's {layout:x?}"
        )));
    }
    Ok(mem)
}

/// The memory layers a restore reads: recorded paths resolved against the state file's
/// directory; that directory's `memory` for the top layer when it is that layer's file (a moved
/// snapshot whose state recorded absolute paths); then the overrides.
fn chosen_layers(
    state_path: &Path,
    recorded: &[MemoryLayer],
    options: &RestoreOptions,
    total: u64,
) -> Result<Vec<MemoryLayer>, PersistError> {
    let dir = state_dir(state_path);
    let mut layers: Vec<MemoryLayer> = recorded
        .iter()
        .map(|layer| MemoryLayer {
            path: resolve_in(&dir, &layer.path),
            ..layer.clone()
        })
        .collect();
    if let Some(top) = layers.last_mut() {
        let local = MemoryLayer {
            path: dir.join("memory"),
            ..top.clone()
        };
        if local.path != top.path && open_layer(&local, total).is_ok() {
            top.path = local.path;
        }
    }
    let count = layers.len();
    for (index, path) in &options.layer_overrides {
        let layer = layers.get_mut(*index).ok_or_else(|| {
            PersistError::Mismatch(format!(
                "memory layer override {index}={}: {} has {count} memory layers (0 to {})",
                path.display(),
                state_path.display(),
                count.saturating_sub(1)
            ))
        })?;
        layer.path = path.clone();
    }
    if let (Some(first), Some(path)) = (layers.first_mut(), &options.mem_file) {
        first.path = path.clone();
    }
    Ok(layers)
}

/// Refuses a snapshot whose PCI state does not match its machine, or is damaged.
fn check_pci_state(state_path: &Path, state: &MicroVmState) -> Result<(), PersistError> {
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

/// Restores a microVM from the state file at `state_path`.
pub fn restore_microvm(
    state_path: &Path,
    options: &RestoreOptions,
    shell: Option<VmShell>,
) -> Result<MicroVm, PersistError> {
    let started = Instant::now();
    let phase = |name: &str| {
        log::debug!(
            "restore: {name} done at {:.3} ms",
            started.elapsed().as_secs_f64() * 1e3
        )
    };
    let state: MicroVmState = read_state_file(state_path)?;
    phase("state file");
    let mem_mib = state.machine.mem_size_mib;
    if let Some(want) = options.expect_mem_mib {
        if want != mem_mib {
            return Err(PersistError::Mismatch(format!(
                "the snapshot has {mem_mib} MiB of guest memory; {want} MiB was requested (a restore keeps the snapshot's size)"
            )));
        }
    }
    if options.deterministic && options.new_generation {
        return Err(PersistError::Mismatch(
            "a deterministic restore keeps the generation; it cannot also ask for a new one".into(),
        ));
    }
    if options.deterministic && !state.machine.deterministic {
        return Err(PersistError::Mismatch(format!(
            "{}: a deterministic restore needs a snapshot of a VM booted with --deterministic (its guest can draw host entropy through RDRAND)",
            state_path.display()
        )));
    }
    if mem_mib > host_memory_mib() {
        return Err(PersistError::Mismatch(format!(
            "the snapshot needs {mem_mib} MiB, more than this host has"
        )));
    }
    let total = guest_len(&state.regions);
    if total != mem_mib << 20 || state.vcpus.len() as u64 != state.machine.vcpu_count {
        return Err(PersistError::Mismatch(format!(
            "{}: inconsistent state ({} bytes in regions for {mem_mib} MiB, {} vCPU states for {})",
            state_path.display(),
            total,
            state.vcpus.len(),
            state.machine.vcpu_count
        )));
    }
    check_pci_state(state_path, &state)?;
    let layers = chosen_layers(state_path, &state.memory_layers, options, total)?;
    if layers.first().is_none_or(|l| l.dirty.is_some()) {
        return Err(PersistError::Mismatch(format!(
            "{}: the memory chain has no full base layer",
            state_path.display()
        )));
    }
    let files = layers
        .iter()
        .map(|layer| open_layer(layer, total).map(|f| (layer.clone(), f)))
        .collect::<Result<Vec<_>, _>>()?;
    let overrides = options.device_overrides();
    check_overrides(&state.devices, &overrides)?;
    let volume = state.devices.iter().find_map(|d| d.kind.memory_mapper());
    if let (Some(volume), RestoreBackend::Uffd) = (&volume, options.backend) {
        return Err(PersistError::FsLazy(volume.clone()));
    }
    let devices = rebuild_devices(&state.devices, &overrides)?;
    let console = console_out(&options.console)?;
    phase("memory files and devices");

    // Guest memory: a pre-built shell of the same shape is reused (the snapshot's memory is
    // mapped over its registered slots), otherwise memory and the VM are built now.
    let (base_layer, base_file) = &files[0];
    let mut machine = state.machine.clone();
    if let Some(track) = options.track_dirty_pages {
        machine.track_dirty_pages = track;
    }
    // A volume's virtiofsd maps guest memory too: it must be one memfd, shared, so a shell's
    // private memory and copy-on-write mappings of the file do not apply; memory is copied.
    let shared = volume.is_some();
    let backend = if shared {
        if options.backend != RestoreBackend::Copy {
            log::info!("restore: guest memory is copied into a shared memfd, as a virtio-fs volume needs it");
        }
        RestoreBackend::Copy
    } else {
        options.backend
    };
    let shell = shell.filter(|s| !shared && s.fits(&machine, &state.regions));
    let reuse_shell = shell.is_some();
    let mem = match &shell {
        None if shared => shared_memory(&state.regions, &base_layer.path)?,
        Some(shell) => {
            if backend == RestoreBackend::Cow {
                for region in host_regions(&shell.mem) {
                    map_file_over(base_file, &base_layer.path, &region)?;
                }
            }
            shell.mem.clone()
        }
        None => fresh_memory(&state.regions, backend, base_file, &base_layer.path)?,
    };
    let hosts = host_regions(&mem);
    let (kind, page_server) = match backend {
        RestoreBackend::Cow => {
            for (layer, file) in &files[1..] {
                apply_layer(layer, file, &hosts)?;
            }
            (MemoryKind::FileBacked, None)
        }
        RestoreBackend::Copy => {
            for (layer, file) in &files {
                apply_layer(layer, file, &hosts)?;
            }
            (MemoryKind::Anonymous, None)
        }
        RestoreBackend::Uffd => {
            let ws = PathBuf::from(format!("{}.ws", base_layer.path.display()));
            let server_options = PageServerOptions {
                prefetch_from: (options.prefetch && ws.exists()).then(|| ws.clone()),
                record_to: options.record_working_set.then_some(ws),
                background_prefetch: true,
            };
            let server = PageServer::start(&hosts, &files, total, server_options)?;
            (MemoryKind::Lazy, Some(server))
        }
    };

    phase("guest memory");
    let (kvm, vm, mut shell_vcpus) = match shell {
        Some(shell) => (shell.kvm, shell.vm, shell.vcpus),
        None => {
            let kvm = open_kvm().map_err(BuildError::from)?;
            let vm = create_vm(&kvm, &mem, machine.track_dirty_pages)?;
            (kvm, vm, Vec::new())
        }
    };
    log::debug!("restore: pre-built shell used: {reuse_shell}");
    let vm = Vm::restore(vm, &state.vm)?;
    let generation = if options.new_generation {
        snapshot::memory::random_id()
    } else {
        state.generation
    };
    phase("VM, irqchip, PIT, clock");
    let saved = SavedDevices {
        serial: &state.serial,
        i8042: &state.i8042,
        virtio: &state.devices,
    };
    let view = GenerationView {
        counter: generation,
        offer_wall_clock: !options.deterministic,
    };
    let mut attached = attach_devices(&vm, &mem, devices, console, Some(&saved), view)?;
    let pci = match &state.pci {
        Some(pci) => Some(crate::builder::restore_pci(
            &kvm,
            &vm,
            &mut attached,
            mem_mib << 20,
            pci,
        )?),
        None => None,
    };
    phase("device wiring");
    let mut vcpus = Vec::new();
    let msrs = saveable_msrs(&kvm)?;
    shell_vcpus.reverse();
    for (index, vcpu_state) in state.vcpus.iter().enumerate() {
        let vcpu = match shell_vcpus.pop() {
            Some(vcpu) => vcpu,
            None => Vcpu::new(vm.fd(), index as u8, std::sync::Arc::clone(&msrs))?,
        };
        vcpus.push(Vcpu::restore(VcpuRestoreArgs { vcpu }, vcpu_state)?);
    }
    phase("vCPUs");
    let memory = MemoryBacking {
        kind,
        layers,
        page_server,
    };
    let parts = Assembly {
        kvm,
        vm,
        mem,
        attached,
        machine,
        memory,
        pci,
    };
    let microvm = assemble(parts, vcpus, true)?;
    microvm.devices.kick_after_restore();
    if options.new_generation {
        announce_new_generation(&microvm.mem, &microvm.ged_interrupt)?;
    }
    let mut microvm = microvm;
    if !options.paused {
        microvm.resume();
    }
    Ok(microvm)
}
