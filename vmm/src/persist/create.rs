//! Taking snapshots of a paused microVM: Full and Diff, and a Full one whose memory a child
//! process writes while the VM runs on.

use std::fs::File;
use std::path::Path;
use std::time::Instant;

use snapshot::memory::{
    fill_full, random_id, write_diff, write_full, FullMemoryFile, MemoryLayer, Sparseness,
};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::memory::{give_back_dirty, guest_len, host_regions, layer_at, take_dirty};
use super::state::{record_layers, write_state};
use super::{PersistError, SnapshotReport, SnapshotType};
use crate::background_snapshot::{
    BackgroundSnapshotError, DumpJob, ImageKind, PendingMemory, StartedDump,
};
use crate::builder::{MemoryKind, MicroVm};

/// Whether a snapshot becomes the base of the VM's next Diff snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Base {
    /// It does (`PUT /snapshot/create`): the dirty pages it holds are cleared.
    Becomes,
    /// It does not (a background snapshot): the diff base and the dirty pages stay as they were.
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

/// A Full snapshot that leaves the VM's diff base and dirty pages alone.
fn create_detached_snapshot(
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

/// How [`create_background_snapshot`] wrote the memory file.
pub enum SnapshotMemory {
    /// Written while the VM was paused.
    Written,
    /// Being written by a child process from the image of the pause; wait for it before the
    /// snapshot is used.
    Background(PendingMemory),
}

/// A Full snapshot of the paused `vm` that leaves its diff base and dirty pages alone, and
/// whose private guest memory is imaged by fork(2) (`start_dump` forks, from a thread that
/// may) and written by the child while the VM runs on. The state file is written now and
/// names the memory file's identity in advance. Shared (virtio-fs) and lazily served memory
/// are written while paused.
pub fn create_background_snapshot(
    vm: &mut MicroVm,
    state_path: &Path,
    mem_path: &Path,
    start_dump: impl FnOnce(DumpJob) -> Result<StartedDump, BackgroundSnapshotError>,
) -> Result<SnapshotMemory, PersistError> {
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
        return Ok(SnapshotMemory::Written);
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
            Ok(started) => Ok(SnapshotMemory::Background(PendingMemory::new(
                memory, mem_path, id, started,
            ))),
            Err(e) => {
                log::warn!("background snapshot: {e}; writing memory while paused");
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
                Ok(SnapshotMemory::Written)
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
