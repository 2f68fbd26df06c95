//! Guest memory for snapshots and restores: the host regions a memory file mirrors, the dirty
//! pages a Diff writes, and the backends a restore maps memory with (cow, uffd, copy).

use std::fs::File;
use std::path::Path;

use serde::{Deserialize, Serialize};
use snapshot::memory::{HostRegion, MemoryLayer, PAGE_SIZE};
use vm_memory::bitmap::{AtomicBitmap, Bitmap, NewBitmap};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap, MmapRegion,
};

use super::PersistError;
use crate::builder::MicroVm;
use crate::vstate::memory::{create_guest_memory, GuestMemoryMmap, Sharing};

pub(super) fn host_regions(mem: &GuestMemoryMmap) -> Vec<HostRegion> {
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

pub(super) fn guest_len(regions: &[(u64, u64)]) -> u64 {
    regions.iter().map(|(_, len)| len).sum()
}

/// Dirty pages per region since the last call: KVM's log (guest writes) or'ed with the VMM's
/// bitmap (device writes). Both are cleared.
pub(super) fn take_dirty(vm: &MicroVm) -> Result<Vec<Vec<u64>>, PersistError> {
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
pub(super) fn give_back_dirty(vm: &MicroVm, dirty: &[Vec<u64>]) {
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

/// Which layer of `layers`, if any, is the file at `path` (same device and inode).
pub(super) fn layer_at(layers: &[MemoryLayer], path: &Path) -> Option<usize> {
    use std::os::unix::fs::MetadataExt;
    let target = std::fs::metadata(path).ok()?;
    layers.iter().position(|layer| {
        std::fs::metadata(&layer.path)
            .is_ok_and(|m| m.dev() == target.dev() && m.ino() == target.ino())
    })
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

pub(super) fn map_cow_region(
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

/// Maps the memory file privately over a registered region (KVM follows the change).
pub(super) fn map_file_over(
    file: &File,
    path: &Path,
    region: &HostRegion,
) -> Result<(), PersistError> {
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
pub(super) fn fresh_memory(
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
pub(super) fn shared_memory(
    regions: &[(u64, u64)],
    path: &Path,
) -> Result<GuestMemoryMmap, PersistError> {
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
