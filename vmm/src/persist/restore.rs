//! Restoring a microVM from a state file: the choices a restore makes, the memory layers it
//! reads, a pre-built empty VM (shell) it may reuse, and the order it rebuilds things in.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kvm_ioctls::Kvm;
use snapshot::format::read_state_file;
use snapshot::memory::{apply_layer, open_layer, resolve_in, MemoryLayer};
use snapshot::uffd::{PageServer, PageServerOptions};
use snapshot::Persist;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::memory::{
    fresh_memory, guest_len, host_regions, map_file_over, shared_memory, RestoreBackend,
};
use super::state::{check_pci_state, state_dir, MicroVmState};
use super::PersistError;
use crate::builder::{
    assemble, create_vm, Assembly, BuildError, MemoryBacking, MemoryKind, MicroVm,
};
use crate::device_manager::persist::{check_overrides, rebuild_devices};
use crate::device_manager::{
    attach_devices, console_out, DeviceOverrides, GenerationView, SavedDevices,
};
use crate::devices::legacy::generation::announce_new_generation;
use crate::devices::virtio::net::tap::AttachedTaps;
use crate::devices::virtio::net::NetOverride;
use crate::vmm_config::{host_memory_mib, ConsoleConfig, MachineConfig};
use crate::vstate::memory::{create_guest_memory, GuestMemoryMmap, Sharing};
use crate::vstate::vcpu::{saveable_msrs, Vcpu, VcpuRestoreArgs};
use crate::vstate::vm::{open_kvm, Vm};

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
    /// vhost-user sockets of virtiofsd the caller started, by volume tag (rollbox
    /// `fs_sockets`, `--fs-socket`): those volumes start no virtiofsd, their shared directory
    /// is the backend's, and their saved state is loaded into it.
    pub fs_sockets: HashMap<String, PathBuf>,
    /// The virtiofsd binary for volumes (`--virtiofsd`); else the one the snapshot's VM used,
    /// then the usual search.
    pub virtiofsd: Option<PathBuf>,
    /// Taps the caller attached already, by name (`--tap-fd`).
    pub taps: AttachedTaps,
}

impl RestoreOptions {
    /// What the restored devices get instead of what the snapshot recorded.
    fn device_overrides(&self) -> DeviceOverrides<'_> {
        DeviceOverrides {
            drives: &self.drive_overrides,
            nets: &self.net_overrides,
            vsock_uds: self.vsock_uds.as_deref(),
            fs_dirs: &self.fs_overrides,
            fs_sockets: &self.fs_sockets,
            virtiofsd: self.virtiofsd.as_deref(),
            taps: &self.taps,
        }
    }
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
