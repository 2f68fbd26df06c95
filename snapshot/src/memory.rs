//! Memory files: guest memory laid out linearly (region after region), sparse where the guest
//! never wrote, exactly guest-sized as Firecracker's are. Each file's random identity is in a
//! side file `<memory file>.id` that the state file's layer list names by id. A snapshot's
//! memory is a list of layers: one full file, then diff files holding only dirty pages.
//! Files written before the side file existed carry the identity in a 4 KiB trailer after
//! guest memory; they still load.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::format::{AtomicFile, FormatError};

/// Page size used for residency, dirty tracking and the page server.
pub const PAGE_SIZE: u64 = 4096;
/// Bytes after guest memory holding the identity in memory files of older snapshots.
pub const TRAILER_LEN: u64 = PAGE_SIZE;
const ID_MAGIC: [u8; 8] = *b"RBXMEM\0\0";
const ID_LEN: usize = 24;
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
    /// The file's size fits neither guest memory nor guest memory plus an old trailer.
    #[error(
        "memory file {path} has {actual} bytes; this snapshot needs {expected} (its guest memory)"
    )]
    WrongSize {
        /// The file.
        path: PathBuf,
        /// Bytes expected.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// The identity belongs to another snapshot.
    #[error("memory file {path} does not belong to this snapshot (its identity {found:#x} in {id_file}, expected {expected:#x})")]
    WrongFile {
        /// The file.
        path: PathBuf,
        /// Where the identity was read.
        id_file: PathBuf,
        /// Expected id.
        expected: u64,
        /// Id found.
        found: u64,
    },
    /// The identity side file is missing or damaged.
    #[error("memory file {path}: cannot read its identity file {id_file}: {detail}")]
    NoIdentity {
        /// The memory file.
        path: PathBuf,
        /// The side file.
        id_file: PathBuf,
        /// What is wrong.
        detail: String,
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

/// The side file holding a memory file's identity: `<memory file>.id`.
pub fn id_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".id");
    PathBuf::from(name)
}

fn encode_id(guest_len: u64, id: u64) -> [u8; ID_LEN] {
    let mut out = [0u8; ID_LEN];
    out[..8].copy_from_slice(&ID_MAGIC);
    out[8..16].copy_from_slice(&id.to_le_bytes());
    out[16..24].copy_from_slice(&guest_len.to_le_bytes());
    out
}

/// The id in an identity record (side file or old trailer), if it has the magic.
fn decode_id(record: &[u8]) -> Option<u64> {
    let id = record.get(8..16)?;
    (record.get(..8)? == ID_MAGIC).then(|| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(id);
        u64::from_le_bytes(bytes)
    })
}

/// Commits a memory file written into `out` and gives it a new identity. The old side file
/// goes first, so a crash in between leaves a memory file without identity (refused), never
/// a new memory file beside an old identity.
fn commit_memory(out: AtomicFile, path: &Path, guest_len: u64) -> Result<u64, MemoryFileError> {
    commit_memory_as(out, path, guest_len, random_id())
}

/// [`commit_memory`] with an identity chosen beforehand.
fn commit_memory_as(
    out: AtomicFile,
    path: &Path,
    guest_len: u64,
    id: u64,
) -> Result<u64, MemoryFileError> {
    let id_file = id_path(path);
    match std::fs::remove_file(&id_file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&id_file)(e)),
        _ => {}
    }
    out.commit()?;
    let side = AtomicFile::create(&id_file)?;
    side.file()
        .write_all(&encode_id(guest_len, id))
        .map_err(io_err(side.tmp_path()))?;
    side.commit()?;
    Ok(id)
}

/// Opens a layer's file and checks its size and identity: a guest-sized file and its side
/// file, or an older snapshot's file with the identity in a trailer.
pub fn open_layer(layer: &MemoryLayer, guest_len: u64) -> Result<File, MemoryFileError> {
    let path = &layer.path;
    let file = File::open(path).map_err(io_err(path))?;
    let actual = file.metadata().map_err(io_err(path))?.len();
    let (found, id_file) = if actual == guest_len {
        let id_file = id_path(path);
        let no_identity = |detail: String| MemoryFileError::NoIdentity {
            path: path.clone(),
            id_file: id_file.clone(),
            detail,
        };
        let record = std::fs::read(&id_file).map_err(|e| no_identity(e.to_string()))?;
        let id = decode_id(&record)
            .filter(|_| record.len() == ID_LEN)
            .ok_or_else(|| no_identity("not a rollbox memory identity".into()))?;
        (id, id_file)
    } else if actual == guest_len + TRAILER_LEN {
        let mut trailer = [0u8; ID_LEN];
        file.read_exact_at(&mut trailer, guest_len)
            .map_err(io_err(path))?;
        (decode_id(&trailer).unwrap_or(0), path.clone())
    } else {
        return Err(MemoryFileError::WrongSize {
            path: path.clone(),
            expected: guest_len,
            actual,
        });
    };
    if found != layer.id {
        return Err(MemoryFileError::WrongFile {
            path: path.clone(),
            id_file,
            expected: layer.id,
            found,
        });
    }
    Ok(file)
}

/// `path` relative to the directory `base` (with `..` where needed), so a snapshot directory
/// can move with the files it names. Both are made absolute first; `path` itself need not
/// exist, its directory must. Falls back to the absolute path when no relative one exists.
pub fn relative_to(base: &Path, path: &Path) -> std::io::Result<PathBuf> {
    let base = std::fs::canonicalize(base)?;
    let dir = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => std::fs::canonicalize(dir)?,
        None => std::env::current_dir()?,
    };
    let target = match path.file_name() {
        Some(name) => dir.join(name),
        None => dir,
    };
    let ours: Vec<Component> = base.components().collect();
    let theirs: Vec<Component> = target.components().collect();
    let common = ours.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
    if common == 0 {
        return Ok(target);
    }
    let mut out = PathBuf::new();
    for _ in common..ours.len() {
        out.push("..");
    }
    for part in &theirs[common..] {
        out.push(part);
    }
    Ok(out)
}

/// A layer path read from a state file in `base`: relative ones are under `base`.
pub fn resolve_in(base: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
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

/// Pages of a private anonymous mapping that may hold data: those /proc/self/pagemap reports
/// present or swapped out. The rest were never touched (or were discarded) and read as zero.
/// `None` when pagemap cannot be read: then every page must be read.
fn touched_pages(host: *mut u8, len: u64) -> Option<Vec<bool>> {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    let pages = len.div_ceil(PAGE_SIZE) as usize;
    let pagemap = File::open("/proc/self/pagemap").ok()?;
    let mut entries = vec![0u8; pages * 8];
    pagemap
        .read_exact_at(&mut entries, host as u64 / PAGE_SIZE * 8)
        .ok()?;
    Some(
        entries
            .chunks_exact(8)
            .map(|e| {
                let mut word = [0u8; 8];
                word.copy_from_slice(e);
                u64::from_le_bytes(word) & (PRESENT | SWAPPED) != 0
            })
            .collect(),
    )
}

/// Pages of a region backed by a shared file at `offset` that may hold data: the file's data
/// ranges (shmem counts swapped-out pages as data, where mincore would call them absent).
fn file_pages(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<Vec<bool>, MemoryFileError> {
    let mut pages = vec![false; len.div_ceil(PAGE_SIZE) as usize];
    let path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    for (start, run) in fd_data_ranges(fd.as_raw_fd(), &path, offset, offset + len)? {
        let first = (start - offset) / PAGE_SIZE;
        let last = (start - offset + run).div_ceil(PAGE_SIZE);
        for page in &mut pages[first as usize..last as usize] {
            *page = true;
        }
    }
    Ok(pages)
}

fn page_is_zero(host: *const u8) -> bool {
    // SAFETY: the caller passes the start of a page inside a live mapping.
    let words = unsafe { std::slice::from_raw_parts(host.cast::<u64>(), (PAGE_SIZE / 8) as usize) };
    words.iter().all(|w| *w == 0)
}

/// Where [`write_full`] looks for data; it writes every page there that is not all zeros.
/// Residency (mincore) is never the test: a swapped-out page is not resident but holds data.
#[derive(Debug, Clone, Copy)]
pub enum Sparseness<'a> {
    /// Private anonymous memory: pages pagemap reports present or swapped out.
    PrivateAnonymous,
    /// Memory shared with a file (a memfd), one `(file, offset)` per region: its data ranges.
    SharedFiles(&'a [(BorrowedFd<'a>, u64)]),
    /// Anything else (a private file mapping, lazily served memory): every page.
    EveryPage,
}

/// Writes every region into a new full memory file at `path`.
pub fn write_full(
    path: &Path,
    regions: &[HostRegion],
    guest_len: u64,
    sparseness: Sparseness<'_>,
) -> Result<MemoryLayer, MemoryFileError> {
    let out = FullMemoryFile::create(path, guest_len)?;
    fill_full(out.file(), out.tmp_path(), regions, sparseness)?;
    out.commit(random_id())
}

/// A full memory file being written: created guest-sized at a temporary path, filled with
/// [`fill_full`] (possibly by another process holding the same file), then committed.
pub struct FullMemoryFile {
    out: AtomicFile,
    path: PathBuf,
    guest_len: u64,
}

impl FullMemoryFile {
    /// Creates the temporary file beside `path`, `guest_len` bytes of holes.
    pub fn create(path: &Path, guest_len: u64) -> Result<Self, MemoryFileError> {
        let out = AtomicFile::create(path)?;
        out.file()
            .set_len(guest_len)
            .map_err(io_err(out.tmp_path()))?;
        Ok(Self {
            out,
            path: path.to_path_buf(),
            guest_len,
        })
    }

    /// The open temporary file.
    pub fn file(&self) -> &File {
        self.out.file()
    }

    /// The temporary path.
    pub fn tmp_path(&self) -> &Path {
        self.out.tmp_path()
    }

    /// Moves the file into place with identity `id` (chosen beforehand, so that a state file
    /// naming this layer can be written before the data is).
    pub fn commit(self, id: u64) -> Result<MemoryLayer, MemoryFileError> {
        let id = commit_memory_as(self.out, &self.path, self.guest_len, id)?;
        Ok(MemoryLayer {
            path: self.path,
            id,
            dirty: None,
        })
    }
}

/// Writes every page of `regions` that is not all zeros (looking where `sparseness` says)
/// into `file`, a guest-sized file of holes at `tmp`. Takes no locks: it runs in a child
/// process started by fork(2) for a background snapshot.
pub fn fill_full(
    file: &File,
    tmp: &Path,
    regions: &[HostRegion],
    sparseness: Sparseness<'_>,
) -> Result<(), MemoryFileError> {
    for (index, region) in regions.iter().enumerate() {
        let candidates = match sparseness {
            Sparseness::PrivateAnonymous => touched_pages(region.host, region.len),
            Sparseness::SharedFiles(files) => match files.get(index) {
                Some((fd, offset)) => Some(file_pages(*fd, *offset, region.len)?),
                None => None,
            },
            Sparseness::EveryPage => None,
        };
        let pages = region.len / PAGE_SIZE;
        let mut page = 0u64;
        while page < pages {
            let wanted = |p: u64| {
                candidates
                    .as_ref()
                    .is_none_or(|c| c.get(p as usize).copied().unwrap_or(true))
                    // SAFETY: page `p` lies inside the region.
                    && !page_is_zero(unsafe { region.host.add((p * PAGE_SIZE) as usize) })
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
                tmp,
                src,
                (page - start) * PAGE_SIZE,
                region.file_offset + start * PAGE_SIZE,
                Transfer::ToFile,
            )?;
        }
    }
    Ok(())
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
    file.set_len(guest_len).map_err(io_err(&tmp))?;
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
    let id = commit_memory(out, path, guest_len)?;
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
    fd_data_ranges(file.as_raw_fd(), path, 0, end)
}

fn fd_data_ranges(
    fd: libc::c_int,
    path: &Path,
    start: u64,
    end: u64,
) -> Result<Vec<(u64, u64)>, MemoryFileError> {
    let mut ranges = Vec::new();
    let mut offset = start as i64;
    while (offset as u64) < end {
        // SAFETY: lseek on a descriptor the caller keeps open.
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
        // SAFETY: lseek on a descriptor the caller keeps open.
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
    target.file().set_len(guest_len).map_err(io_err(&tmp))?;
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
    target.file().flush().map_err(io_err(&tmp))?;
    let id = commit_memory(target, out, guest_len)?;
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
            Sparseness::PrivateAnonymous,
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
            Sparseness::EveryPage,
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

    #[test]
    fn memory_files_are_guest_sized_with_a_side_identity_and_old_trailers_still_load() {
        let dir = tempfile::tempdir().expect("tmp");
        let len = 8 * PAGE_SIZE;
        let host = anon(len as usize);
        // SAFETY: inside the mapping.
        unsafe { *host.add(3 * PAGE_SIZE as usize) = 0x5a };
        let regions = [HostRegion {
            host,
            len,
            file_offset: 0,
        }];
        let path = dir.path().join("memory");
        let layer = write_full(&path, &regions, len, Sparseness::PrivateAnonymous).expect("full");
        assert_eq!(std::fs::metadata(&path).expect("meta").len(), len);
        assert!(id_path(&path).exists());
        open_layer(&layer, len).expect("opens");

        // An older snapshot's file: guest memory, then the identity in a 4 KiB trailer.
        let old = dir.path().join("old-memory");
        let mut bytes = std::fs::read(&path).expect("read");
        let mut trailer = vec![0u8; TRAILER_LEN as usize];
        trailer[..ID_LEN].copy_from_slice(&encode_id(len, 77));
        bytes.extend_from_slice(&trailer);
        std::fs::write(&old, &bytes).expect("write");
        let old_layer = MemoryLayer {
            path: old.clone(),
            id: 77,
            dirty: None,
        };
        open_layer(&old_layer, len).expect("an old trailer still loads");

        std::fs::remove_file(id_path(&path)).expect("rm id");
        let err = open_layer(&layer, len).expect_err("no identity");
        assert!(
            matches!(err, MemoryFileError::NoIdentity { .. })
                && err.to_string().contains("memory.id"),
            "{err}"
        );
    }

    #[test]
    fn a_new_memory_file_never_sits_beside_the_old_identity() {
        let dir = tempfile::tempdir().expect("tmp");
        let len = 4 * PAGE_SIZE;
        let host = anon(len as usize);
        let regions = [HostRegion {
            host,
            len,
            file_offset: 0,
        }];
        let path = dir.path().join("memory");
        let first = write_full(&path, &regions, len, Sparseness::EveryPage).expect("first");
        let second = write_full(&path, &regions, len, Sparseness::EveryPage).expect("second");
        assert_ne!(first.id, second.id);
        assert!(matches!(
            open_layer(&first, len),
            Err(MemoryFileError::WrongFile { .. })
        ));
        open_layer(&second, len).expect("the new one opens");
    }

    #[test]
    fn layer_paths_are_stored_relative_to_the_snapshot_directory() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path();
        for sub in ["s0", "s1"] {
            std::fs::create_dir_all(root.join(sub)).expect("mkdir");
        }
        let s1 = root.join("s1");
        assert_eq!(
            relative_to(&s1, &s1.join("memory")).expect("rel"),
            Path::new("memory")
        );
        assert_eq!(
            relative_to(&s1, &root.join("s0/memory")).expect("rel"),
            Path::new("../s0/memory")
        );
        assert_eq!(
            resolve_in(&s1, Path::new("../s0/memory")),
            s1.join("../s0/memory")
        );
        assert_eq!(
            resolve_in(&s1, Path::new("/abs/memory")),
            Path::new("/abs/memory")
        );
    }

    #[test]
    fn shared_memory_is_written_from_its_files_data_ranges() {
        use std::os::fd::AsFd;
        let dir = tempfile::tempdir().expect("tmp");
        let len = 32 * PAGE_SIZE;
        // SAFETY: a new memfd with a static name.
        let fd = unsafe { libc::memfd_create(c"guest".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a new descriptor this test owns.
        let memfd = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        memfd.set_len(len).expect("size");
        // Written through the file, as virtiofsd writes through its own mapping: this
        // process's mapping has never touched these pages.
        memfd
            .write_all_at(&[0x11; 8], 2 * PAGE_SIZE)
            .expect("write");
        memfd
            .write_all_at(&[0x22; 8], 30 * PAGE_SIZE)
            .expect("write");
        // SAFETY: a shared mapping of the memfd, leaked for the test's life.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(host, libc::MAP_FAILED);
        let regions = [HostRegion {
            host: host.cast(),
            len,
            file_offset: 0,
        }];
        let files = [(memfd.as_fd(), 0)];
        let path = dir.path().join("memory");
        let layer =
            write_full(&path, &regions, len, Sparseness::SharedFiles(&files)).expect("full");
        let file = open_layer(&layer, len).expect("open");
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, 2 * PAGE_SIZE).expect("read");
        assert_eq!(byte[0], 0x11);
        file.read_exact_at(&mut byte, 30 * PAGE_SIZE).expect("read");
        assert_eq!(byte[0], 0x22);
        let data: u64 = data_ranges(&file, &path, len)
            .expect("ranges")
            .iter()
            .map(|r| r.1)
            .sum();
        assert!(
            data <= 4 * PAGE_SIZE,
            "only the two data pages: {data} bytes"
        );
    }
}
