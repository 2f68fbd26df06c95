//! Guest memory: anonymous private mappings laid out around the MMIO gap.

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::GuestAddress;

/// Guest memory, with a dirty bitmap that records the VMM's own writes (device DMA) for
/// diff snapshots; KVM's dirty log records the guest's.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>;

use crate::arch::layout::ram_regions;

/// Errors from creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The mapping could not be created.
    #[error("cannot allocate {mib} MiB of guest memory: {source}")]
    Allocate {
        /// Requested size.
        mib: u64,
        /// The vm-memory error.
        source: vm_memory::mmap::FromRangesError,
    },
}

/// Creates anonymous guest memory of `mem_bytes` bytes.
pub fn create_guest_memory(mem_bytes: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let ranges: Vec<(GuestAddress, usize)> = ram_regions(mem_bytes)
        .into_iter()
        .map(|(start, size)| (GuestAddress(start), size as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Allocate {
        mib: mem_bytes >> 20,
        source,
    })
}
