//! Memory files: guest memory laid out linearly (region after region), sparse where the guest
//! never wrote, followed by a 4 KiB trailer carrying the file's random identity. A snapshot's
//! memory is a list of layers: one full file, then diff files holding only dirty pages.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::format::{AtomicFile, FormatError};

/// Page size used for residency, dirty tracking and the page server.
pub const PAGE_SIZE: u64 = 4096;
/// Bytes after guest memory holding the trailer.
pub const TRAILER_LEN: u64 = PAGE_SIZE;
const TRAILER_MAGIC: [u8; 8] = *b"RBXMEM\0\0";
/// Largest run written or read with one system call.
const IO_CHUNK: u64 = 8 << 20;

/// Errors on memory files.
#[derive(Debug, thiserror::Error)]
pub enum MemoryFileError {
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A temporary file or rename failed.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The file is too short for the guest memory it should hold.
    #[error("memory file {path} has {actual} bytes; this snapshot needs {expected} (guest memory plus trailer)")]
    WrongSize {
        /// The file.
        path: PathBuf,
        /// Bytes expected.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// The trailer is missing or belongs to another snapshot.
    #[error("memory file {path} does not belong to this snapshot (trailer id {found:#x}, expected {expected:#x})")]
    WrongFile {
        /// The file.
        path: PathBuf,
        /// Expected id.
        expected: u64,
        /// Id found.
        found: u64,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MemoryFileError + '_ {
    move |source| MemoryFileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One layer of a snapshot's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryLayer {
    /// The memory file.
    pub path: PathBuf,
    /// Random identity, also in the file's trailer.
    pub id: u64,
    /// Byte ranges (offset, length) this layer holds; `None` for a full layer.
    #[serde(default)]
    pub dirty: Option<Vec<(u64, u64)>>,
}

/// A guest memory region as the host maps it.
#[derive(Debug, Clone, Copy)]
pub struct HostRegion {
    /// Start of the host mapping.
    pub host: *mut u8,
    /// Length in bytes.
    pub len: u64,
    /// Offset of this region in the memory file.
    pub file_offset: u64,
}

/// A random 64-bit identifier from the kernel.
pub fn random_id() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return nanos ^ (u64::from(std::process::id()) << 32);
    }
    u64::from_le_bytes(bytes)
}

fn write_trailer(file: &File, path: &Path, guest_len: u64, id: u64) -> Result<(), MemoryFileError> {
    let mut trailer = vec![0u8; TRAILER_LEN as usize];
    trailer[..8].copy_from_slice(&TRAILER_MAGIC);
    trailer[8..16].copy_from_slice(&id.to_le_bytes());
    trailer[16..24].copy_from_slice(&guest_len.to_le_bytes());
    file.write_all_at(&trailer, guest_len).map_err(io_err(path))
}

/// Opens a layer's file and checks its size and identity.
pub fn open_layer(layer: &MemoryLayer, guest_len: u64) -> Result<File, MemoryFileError> {
    let file = File::open(&layer.path).map_err(io_err(&layer.path))?;
    let actual = file.metadata().map_err(io_err(&layer.path))?.len();
    let expected = guest_len + TRAILER_LEN;
    if actual != expected {
        return Err(MemoryFileError::WrongSize {
            path: layer.path.clone(),
            expected,
            actual,
        });
    }
    let mut trailer = [0u8; 24];
    file.read_exact_at(&mut trailer, guest_len)
        .map_err(io_err(&layer.path))?;
    let mut id = [0u8; 8];
    id.copy_from_slice(&trailer[8..16]);
    let found = if trailer[..8] == TRAILER_MAGIC {
        u64::from_le_bytes(id)
    } else {
        0
    };
    if found != layer.id {
        return Err(MemoryFileError::WrongFile {
            path: layer.path.clone(),
            expected: layer.id,
            found,
        });
    }
    Ok(file)
}

/// Which way [`host_io`] moves bytes.
#[derive(Clone, Copy)]
enum Transfer {
    /// Guest memory to the file (pwrite).
    ToFile,
    /// The file to guest memory (pread).
    FromFile,
}

/// Moves `len` bytes between host address `host` and `file` at `offset`, in chunks, retrying
/// interrupted calls.
fn host_io(
    file: &File,
    path: &Path,
    host: *mut u8,
    len: u64,
    offset: u64,
    transfer: Transfer,
) -> Result<(), MemoryFileError> {
    let mut done = 0u64;
    while done < len {
        let chunk = (len - done).min(IO_CHUNK) as usize;
        let at = (offset + done) as libc::off_t;
        // SAFETY: `host..host+len` lies inside a live guest memory mapping (the callers'
        // contract): pwrite only reads it, and pread writes it only before any vCPU runs.
        let n = unsafe {
            let buf = host.add(done as usize);
            match transfer {
                Transfer::ToFile => libc::pwrite(file.as_raw_fd(), buf.cast(), chunk, at),
                Transfer::FromFile => libc::pread(file.as_raw_fd(), buf.cast(), chunk, at),
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(MemoryFileError::Io {
                path: path.to_path_buf(),
                source: e,
            });
        }
        if n == 0 {
            let kind = match transfer {
                Transfer::ToFile => std::io::ErrorKind::WriteZero,
                Transfer::FromFile => std::io::ErrorKind::UnexpectedEof,
            };
            return Err(MemoryFileError::Io {
                path: path.to_path_buf(),
                source: kind.into(),
            });
        }
        done += n as u64;
    }
    Ok(())
}

/// Which pages of an anonymous mapping are resident (never-touched pages read as zero).
fn resident_pages(host: *mut u8, len: u64) -> Option<Vec<u8>> {
    let pages = len.div_ceil(PAGE_SIZE) as usize;
    let mut vec = vec![0u8; pages];
    // SAFETY: `host..host+len` is a mapping owned by the caller; mincore writes one byte per
    // page into a vector of exactly that many bytes.
    let rc = unsafe { libc::mincore(host.cast(), len as usize, vec.as_mut_ptr()) };
    (rc == 0).then_some(vec)
}

fn page_is_zero(host: *const u8) -> bool {
    // SAFETY: the caller passes the start of a page inside a live mapping.
    let words = unsafe { std::slice::from_raw_parts(host.cast::<u64>(), (PAGE_SIZE / 8) as usize) };
    words.iter().all(|w| *w == 0)
}

/// How [`write_full`] finds the pages worth writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sparseness {
    /// Anonymous memory: pages that were never touched are not resident and are zero.
    SkipNonResident,
    /// File-backed memory: write every page that is not all zeros.
    SkipZeroPages,
}

/// Writes every region into a new full memory file at `path`.
pub fn write_full(
    path: &Path,
    regions: &[HostRegion],
    guest_len: u64,
    sparseness: Sparseness,
) -> Result<MemoryLayer, MemoryFileError> {
    let out = AtomicFile::create(path)?;
    let tmp = out.tmp_path().to_path_buf();
    let file = out.file();
    file.set_len(guest_len + TRAILER_LEN)
        .map_err(io_err(&tmp))?;
    for region in regions {
        let residency = match sparseness {
            Sparseness::SkipNonResident => resident_pages(region.host, region.len),
            Sparseness::SkipZeroPages => None,
        };
        let pages = region.len / PAGE_SIZE;
        let mut page = 0u64;
        while page < pages {
            let wanted = |p: u64| match &residency {
                Some(map) => map.get(p as usize).is_some_and(|b| b & 1 == 1),
                // SAFETY: page `p` lies inside the region.
                None => !page_is_zero(unsafe { region.host.add((p * PAGE_SIZE) as usize) }),
            };
            if !wanted(page) {
                page += 1;
                continue;
            }
            let start = page;
            while page < pages && wanted(page) {
                page += 1;
            }
            // SAFETY: the run lies inside the region.
            let src = unsafe { region.host.add((start * PAGE_SIZE) as usize) };
            host_io(
                file,
                &tmp,
                src,
                (page - start) * PAGE_SIZE,
                region.file_offset + start * PAGE_SIZE,
                Transfer::ToFile,
            )?;
        }
    }
    let id = random_id();
    write_trailer(file, &tmp, guest_len, id)?;
    out.commit()?;
    Ok(MemoryLayer {
        path: path.to_path_buf(),
        id,
        dirty: None,
    })
}

/// Writes the dirty pages of every region into a new diff memory file at `path`.
/// `dirty[i]` is a bitmap with one bit per page of `regions[i]`.
pub fn write_diff(
    path: &Path,
    regions: &[HostRegion],
    dirty: &[Vec<u64>],
    guest_len: u64,
) -> Result<MemoryLayer, MemoryFileError> {
    let out = AtomicFile::create(path)?;
    let tmp = out.tmp_path().to_path_buf();
    let file = out.file();
    file.set_len(guest_len + TRAILER_LEN)
        .map_err(io_err(&tmp))?;
    let mut ranges = Vec::new();
    for (region, bitmap) in regions.iter().zip(dirty) {
        let pages = region.len / PAGE_SIZE;
        let is_dirty = |p: u64| {
            bitmap
                .get((p / 64) as usize)
                .is_some_and(|w| w & (1 << (p % 64)) != 0)
        };
        let mut page = 0;
        while page < pages {
            if !is_dirty(page) {
                page += 1;
                continue;
            }
            let start = page;
            while page < pages && is_dirty(page) {
                page += 1;
            }
            let offset = region.file_offset + start * PAGE_SIZE;
            let len = (page - start) * PAGE_SIZE;
            // SAFETY: the run lies inside the region.
            let src = unsafe { region.host.add((start * PAGE_SIZE) as usize) };
            host_io(file, &tmp, src, len, offset, Transfer::ToFile)?;
            ranges.push((offset, len));
        }
    }
    let id = random_id();
    write_trailer(file, &tmp, guest_len, id)?;
    out.commit()?;
    Ok(MemoryLayer {
        path: path.to_path_buf(),
        id,
        dirty: Some(ranges),
    })
}

/// Copies a layer into guest memory: all of it, or only its dirty ranges. Holes in a full
/// layer are skipped (the destination must be zero-filled).
pub fn apply_layer(
    layer: &MemoryLayer,
    file: &File,
    regions: &[HostRegion],
) -> Result<(), MemoryFileError> {
    let ranges: Vec<(u64, u64)> = match &layer.dirty {
        Some(ranges) => ranges.clone(),
        None => data_ranges(
            file,
            &layer.path,
            regions
                .iter()
                .map(|r| r.file_offset + r.len)
                .max()
                .unwrap_or(0),
        )?,
    };
    for (offset, len) in ranges {
        let mut done = 0;
        while done < len {
            let at = offset + done;
            let Some(region) = regions
                .iter()
                .find(|r| at >= r.file_offset && at < r.file_offset + r.len)
            else {
                break;
            };
            let n = (len - done).min(region.file_offset + region.len - at);
            // SAFETY: `at..at+n` lies inside `region`.
            let dst = unsafe { region.host.add((at - region.file_offset) as usize) };
            host_io(file, &layer.path, dst, n, at, Transfer::FromFile)?;
            done += n;
        }
    }
    Ok(())
}

/// The data (non-hole) ranges of `file` below `end`, via SEEK_DATA / SEEK_HOLE.
pub fn data_ranges(file: &File, path: &Path, end: u64) -> Result<Vec<(u64, u64)>, MemoryFileError> {
    let mut ranges = Vec::new();
    let mut offset = 0i64;
    let fd = file.as_raw_fd();
    while (offset as u64) < end {
        // SAFETY: lseek on an owned fd.
        let data = unsafe { libc::lseek(fd, offset, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(MemoryFileError::Io {
                path: path.to_path_buf(),
                source: e,
            });
        }
        if data as u64 >= end {
            break;
        }
        // SAFETY: lseek on an owned fd.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(MemoryFileError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::last_os_error(),
            });
        }
        let stop = (hole as u64).min(end);
        ranges.push((data as u64, stop - data as u64));
        offset = hole;
    }
    Ok(ranges)
}

/// Folds a chain of layers (full base first) into one full memory file at `out`.
pub fn fold(
    layers: &[MemoryLayer],
    guest_len: u64,
    out: &Path,
) -> Result<MemoryLayer, MemoryFileError> {
    let target = AtomicFile::create(out)?;
    let tmp = target.tmp_path().to_path_buf();
    target
        .file()
        .set_len(guest_len + TRAILER_LEN)
        .map_err(io_err(&tmp))?;
    let mut buf = vec![0u8; IO_CHUNK as usize];
    for layer in layers {
        let mut file = open_layer(layer, guest_len)?;
        let ranges = match &layer.dirty {
            Some(r) => r.clone(),
            None => data_ranges(&file, &layer.path, guest_len)?,
        };
        for (offset, len) in ranges {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(IO_CHUNK) as usize;
                file.seek(SeekFrom::Start(offset + done))
                    .map_err(io_err(&layer.path))?;
                file.read_exact(&mut buf[..n])
                    .map_err(io_err(&layer.path))?;
                target
                    .file()
                    .write_all_at(&buf[..n], offset + done)
                    .map_err(io_err(&tmp))?;
                done += n as u64;
            }
        }
    }
    let id = random_id();
    write_trailer(target.file(), &tmp, guest_len, id)?;
    target.file().flush().map_err(io_err(&tmp))?;
    target.commit()?;
    Ok(MemoryLayer {
        path: out.to_path_buf(),
        id,
        dirty: None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fresh anonymous read-write mapping, leaked for the test's life.
    pub(crate) fn anon(len: usize) -> *mut u8 {
        // SAFETY: a fresh anonymous mapping; tests never unmap it (leaked for the test's life).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    #[test]
    fn full_then_diff_then_fold() {
        let dir = tempfile::tempdir().expect("tmp");
        let len = 64 * PAGE_SIZE;
        let host = anon(len as usize);
        // SAFETY: inside the mapping.
        unsafe {
            *host.add(5 * PAGE_SIZE as usize) = 0xaa;
            *host.add(40 * PAGE_SIZE as usize + 7) = 0xbb;
        }
        let regions = [HostRegion {
            host,
            len,
            file_offset: 0,
        }];
        let base = write_full(
            &dir.path().join("base"),
            &regions,
            len,
            Sparseness::SkipNonResident,
        )
        .expect("full");
        let file = open_layer(&base, len).expect("open");
        let data = data_ranges(&file, &base.path, len).expect("ranges");
        assert!(
            data.iter().map(|r| r.1).sum::<u64>() <= 4 * PAGE_SIZE,
            "sparse: {data:?}"
        );

        // SAFETY: inside the mapping.
        unsafe { *host.add(9 * PAGE_SIZE as usize) = 0xcc };
        let mut bitmap = vec![0u64; 1];
        bitmap[0] |= 1 << 9;
        let diff = write_diff(&dir.path().join("diff"), &regions, &[bitmap], len).expect("diff");
        assert_eq!(diff.dirty, Some(vec![(9 * PAGE_SIZE, PAGE_SIZE)]));

        let folded = fold(
            &[base.clone(), diff.clone()],
            len,
            &dir.path().join("folded"),
        )
        .expect("fold");
        let restored = anon(len as usize);
        let out = [HostRegion {
            host: restored,
            len,
            file_offset: 0,
        }];
        apply_layer(&folded, &open_layer(&folded, len).expect("open"), &out).expect("apply");
        // SAFETY: inside the mapping.
        unsafe {
            assert_eq!(*restored.add(5 * PAGE_SIZE as usize), 0xaa);
            assert_eq!(*restored.add(9 * PAGE_SIZE as usize), 0xcc);
            assert_eq!(*restored.add(40 * PAGE_SIZE as usize + 7), 0xbb);
        }
    }

    #[test]
    fn refuses_wrong_size_and_foreign_files() {
        let dir = tempfile::tempdir().expect("tmp");
        let len = 16 * PAGE_SIZE;
        let host = anon(len as usize);
        let layer = write_full(
            &dir.path().join("m"),
            &[HostRegion {
                host,
                len,
                file_offset: 0,
            }],
            len,
            Sparseness::SkipZeroPages,
        )
        .expect("full");
        assert!(matches!(
            open_layer(&layer, len * 2),
            Err(MemoryFileError::WrongSize { .. })
        ));
        let other = MemoryLayer {
            id: layer.id ^ 1,
            ..layer.clone()
        };
        assert!(matches!(
            open_layer(&other, len),
            Err(MemoryFileError::WrongFile { .. })
        ));
        open_layer(&layer, len).expect("own file opens");
    }
}
