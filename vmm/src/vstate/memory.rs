//! Guest memory: anonymous private mappings laid out around the MMIO gap, or, when a
//! vhost-user backend must map it too (virtio-fs), one memfd mapped shared; with huge pages
//! (`huge_pages: "2M"`), one hugetlb memfd mapped shared.

use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{FileOffset, GuestAddress};

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
    /// The memfd for shared guest memory could not be created or sized.
    #[error("cannot create a {mib} MiB memfd for shared guest memory: {source}")]
    Memfd {
        /// Requested size.
        mib: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// The host has not that many free 2 MiB huge pages.
    #[error("cannot back {mib} MiB of guest memory with 2 MiB huge pages ({detail}); reserve them with `echo N > /proc/sys/vm/nr_hugepages`, or drop huge_pages")]
    HugePages {
        /// Requested size.
        mib: u64,
        /// What failed.
        detail: String,
    },
}

/// How guest memory is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// Anonymous and private to the VMM (the default).
    Private,
    /// One memfd, mapped `MAP_SHARED`, each region at its offset in the file, so a vhost-user
    /// backend can map the same pages from the region's fd.
    Memfd,
    /// As [`Sharing::Memfd`], of 2 MiB huge pages (hugetlb, reserved by the host:
    /// `/proc/sys/vm/nr_hugepages`): fewer pages for the TLB and for VFIO to pin and map.
    HugeMemfd,
}

/// Creates guest memory of `mem_bytes` bytes.
pub fn create_guest_memory(
    mem_bytes: u64,
    sharing: Sharing,
) -> Result<GuestMemoryMmap, MemoryError> {
    let mib = mem_bytes >> 20;
    let regions = ram_regions(mem_bytes);
    let ranges: Vec<(GuestAddress, usize, Option<FileOffset>)> = match sharing {
        Sharing::Private => regions
            .into_iter()
            .map(|(start, size)| (GuestAddress(start), size as usize, None))
            .collect(),
        Sharing::Memfd | Sharing::HugeMemfd => {
            let file = if sharing == Sharing::HugeMemfd {
                huge_memfd(mem_bytes).map_err(|e| MemoryError::HugePages {
                    mib,
                    detail: e.to_string(),
                })?
            } else {
                memfd(c"rollbox-guest-memory", mem_bytes)
                    .map_err(|source| MemoryError::Memfd { mib, source })?
            };
            let file = std::sync::Arc::new(file);
            let mut offset = 0;
            regions
                .into_iter()
                .map(|(start, size)| {
                    let range = (
                        GuestAddress(start),
                        size as usize,
                        Some(FileOffset::from_arc(std::sync::Arc::clone(&file), offset)),
                    );
                    offset += size;
                    range
                })
                .collect()
        }
    };
    GuestMemoryMmap::from_ranges_with_files(&ranges).map_err(|source| match sharing {
        // hugetlb reserves the pages when it is mapped: too few free fail here.
        Sharing::HugeMemfd => MemoryError::HugePages {
            mib,
            detail: source.to_string(),
        },
        _ => MemoryError::Allocate { mib, source },
    })
}

/// A hugetlb memfd of `len` bytes (a multiple of 2 MiB) in 2 MiB pages.
fn huge_memfd(len: u64) -> std::io::Result<File> {
    if !len.is_multiple_of(2 << 20) {
        return Err(std::io::Error::other(format!(
            "{len} bytes is not a whole number of 2 MiB pages"
        )));
    }
    // SAFETY: the name is NUL-terminated; memfd_create only reads it.
    let fd = unsafe {
        libc::memfd_create(
            c"rollbox-guest-memory-2m".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    // Every page now: too few free fail here, not as a SIGBUS when the guest first touches
    // one (the mapping does not reserve them).
    let len = libc::off_t::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: fallocate on a descriptor we own; it touches no memory of ours.
    if unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// A memfd named `name` of `len` bytes (sparse: pages are allocated when first touched).
pub fn memfd(name: &std::ffi::CStr, len: u64) -> std::io::Result<File> {
    // SAFETY: `name` is NUL-terminated; memfd_create only reads it.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    Ok(file)
}

/// Whether guest memory is file-backed and mapped shared (a backend can map it).
pub fn is_shared(mem: &GuestMemoryMmap) -> bool {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    mem.iter().all(|r| r.file_offset().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};

    #[test]
    fn huge_page_memory_is_whole_pages_and_says_how_to_reserve_them() {
        let err = huge_memfd(3 << 20).expect_err("not whole pages");
        assert!(err.to_string().contains("2 MiB pages"), "{err}");
        // With none reserved (a machine's default), the mapping is refused by name; with
        // some, it is one shared file.
        match create_guest_memory(4 << 20, Sharing::HugeMemfd) {
            Ok(mem) => assert!(is_shared(&mem)),
            Err(e) => assert!(e.to_string().contains("nr_hugepages"), "{e}"),
        }
    }

    #[test]
    fn memfd_memory_is_one_file_at_offsets() {
        let mem = create_guest_memory(64 << 20, Sharing::Memfd).expect("memory");
        assert!(is_shared(&mem));
        let mut expect = 0;
        for region in mem.iter() {
            let fo = region.file_offset().expect("file offset");
            assert_eq!(fo.start(), expect);
            expect += region.len();
        }
        mem.write_obj(0xabcdu32, GuestAddress(0x1000))
            .expect("write");
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x1000)).expect("read"),
            0xabcd
        );
    }

    #[test]
    fn private_memory_has_no_file() {
        let mem = create_guest_memory(16 << 20, Sharing::Private).expect("memory");
        assert!(!is_shared(&mem));
    }
}
