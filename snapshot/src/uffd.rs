//! Lazy restore: guest memory is anonymous and filled on demand by a userfaultfd page server
//! thread inside the VMM, from the snapshot's memory layers. It can record the pages a restored
//! guest touches (its working set) and prefetch them on the next restore, as REAP does.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use userfaultfd::{Event, Uffd, UffdBuilder};

use crate::format::AtomicFile;
use crate::memory::{HostRegion, MemoryLayer, PAGE_SIZE};

/// Errors of the page server.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// userfaultfd could not be created or registered.
    #[error("userfaultfd: {0}")]
    Uffd(String),
    /// A memory layer could not be opened for the server.
    #[error("cannot open memory layer {path}: {source}")]
    Map {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The working-set file is unreadable.
    #[error("working set {path}: {detail}")]
    WorkingSet {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The server thread could not start.
    #[error("cannot start the page server thread: {0}")]
    Thread(std::io::Error),
}

const WS_MAGIC: [u8; 8] = *b"RBXWSET\0";

/// One layer's file, read with pread: a file truncated or failing under the server gives an
/// error naming it, where a mapping would kill the VMM with SIGBUS.
struct Source {
    file: File,
    path: PathBuf,
    ranges: Option<Vec<(u64, u64)>>,
}

fn open_source(layer: &MemoryLayer, file: &File) -> Result<Source, UffdError> {
    let file = file.try_clone().map_err(|source| UffdError::Map {
        path: layer.path.clone(),
        source,
    })?;
    Ok(Source {
        file,
        path: layer.path.clone(),
        ranges: layer.dirty.clone(),
    })
}

/// Tries of a UFFDIO_COPY or UFFDIO_ZEROPAGE that the kernel answers EAGAIN (the guest's
/// memory map is changing) before the fault counts as unserved.
const EAGAIN_TRIES: u32 = 1000;

/// A fault installs the aligned block of this size around the faulting page, with one copy.
pub const FAULT_BLOCK: u64 = 64 * 1024;

/// The longest stretch of the working set prefetched with one read and one copy.
const PREFETCH_RUN: u64 = 2 * 1024 * 1024;

/// Sorted, deduplicated runs (file offset, length) of the pages `pages`, each at most `max`
/// bytes long.
fn coalesce(pages: &[u64], max: u64) -> Vec<(u64, u64)> {
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for page in sorted {
        match runs.last_mut() {
            Some((start, len)) if *start + *len == page && *len < max => *len += PAGE_SIZE,
            _ => runs.push((page, PAGE_SIZE)),
        }
    }
    runs
}

fn is_zero(bytes: &[u8]) -> bool {
    bytes.iter().all(|b| *b == 0)
}

/// Run first by each page server thread (the VMM installs the thread's seccomp filter).
static PAGE_SERVER_START_HOOK: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets what each page server thread runs first (once per process; later calls are ignored).
pub fn set_page_server_start_hook(hook: fn()) {
    let _ = PAGE_SERVER_START_HOOK.set(hook);
}

/// Called once with the reason when the server meets a fault it cannot serve.
pub type FailureHook = Box<dyn FnOnce(String) + Send>;

struct Shared {
    regions: Vec<HostRegion>,
    sources: Vec<Source>,
    uffd: Uffd,
    faults: AtomicU64,
    prefetched: AtomicU64,
    installs: AtomicU64,
    recorded: Mutex<Vec<u64>>,
    recording: bool,
    stop: AtomicBool,
    /// Faults not served after the first failure.
    unserved: AtomicU64,
    /// The first fault that could not be served, and who to tell.
    failure: Mutex<(Option<String>, Option<FailureHook>)>,
}

// SAFETY: HostRegion holds raw pointers into guest memory that outlives the server; the server
// only passes them to UFFDIO ioctls.
unsafe impl Send for Shared {}
// SAFETY: see above; mutable state is atomic or behind a mutex.
unsafe impl Sync for Shared {}

impl Shared {
    /// The topmost layer index holding file offset `offset`.
    fn source_index(&self, offset: u64) -> Option<usize> {
        self.sources.iter().rposition(|s| match &s.ranges {
            None => true,
            Some(ranges) => ranges
                .iter()
                .any(|(start, len)| offset >= *start && offset < start + len),
        })
    }

    /// Fills `len` bytes at `dst` (file offset `offset`, page-aligned) from the layers: one
    /// pread per stretch held by one layer, one UFFDIO_COPY per run of non-zero pages and one
    /// UFFDIO_ZEROPAGE per run of zero pages. `buf` is reused and grows to `len`.
    fn fill(&self, offset: u64, dst: *mut u8, len: u64, buf: &mut Vec<u8>) -> Result<(), String> {
        if buf.len() < len as usize {
            buf.resize(len as usize, 0);
        }
        let mut done = 0;
        while done < len {
            let at = offset + done;
            let index = self
                .source_index(at)
                .ok_or_else(|| format!("no memory layer holds offset {at:#x}"))?;
            let mut stretch = PAGE_SIZE;
            while done + stretch < len && self.source_index(at + stretch) == Some(index) {
                stretch += PAGE_SIZE;
            }
            let src = &self.sources[index];
            let data = &mut buf[done as usize..(done + stretch) as usize];
            read_at(src, at, data)?;
            let mut page = 0;
            while page < stretch {
                let zero = is_zero(&data[page as usize..(page + PAGE_SIZE) as usize]);
                let mut run = PAGE_SIZE;
                while page + run < stretch
                    && is_zero(&data[(page + run) as usize..(page + run + PAGE_SIZE) as usize])
                        == zero
                {
                    run += PAGE_SIZE;
                }
                // SAFETY: `dst + done + page` starts a run inside the range the caller located.
                let to = unsafe { dst.add((done + page) as usize) };
                let from = (!zero).then(|| &data[page as usize..(page + run) as usize]);
                self.install(to, from, run).map_err(|e| {
                    format!(
                        "placing {run:#x} bytes at offset {:#x} of {}: {e}",
                        at + page,
                        src.path.display()
                    )
                })?;
                page += run;
            }
            done += stretch;
        }
        Ok(())
    }

    /// Installs `len` bytes at the guest pages `to`: a copy of `data`, or zero pages. Pages
    /// already present (EEXIST: the prefetch or the fault server got there first) are woken and
    /// skipped; EAGAIN (the guest's memory map is changing) is retried.
    fn install(&self, to: *mut u8, data: Option<&[u8]>, len: u64) -> Result<(), String> {
        let mut done = 0u64;
        let mut tries = 0;
        // After a partial UFFDIO_ZEROPAGE (the kernel does not say how far it got) go page by
        // page.
        let mut zero_step = len;
        while done < len {
            if tries >= EAGAIN_TRIES {
                return Err(format!("the kernel answered EAGAIN {EAGAIN_TRIES} times"));
            }
            // SAFETY: `to + done` stays inside the run.
            let at = unsafe { to.add(done as usize) };
            let step = match data {
                Some(_) => len - done,
                None => zero_step.min(len - done),
            };
            // SAFETY: `at..at + step` are registered guest pages; `data` holds `len` bytes.
            let result = unsafe {
                match data {
                    Some(data) => self.uffd.copy(
                        data[done as usize..].as_ptr().cast(),
                        at.cast(),
                        step as usize,
                        true,
                    ),
                    None => self.uffd.zeropage(at.cast(), step as usize, true),
                }
            };
            self.installs.fetch_add(1, Ordering::Relaxed);
            match result {
                Ok(n) if n > 0 => done += n as u64,
                Ok(_) => tries += 1,
                Err(userfaultfd::Error::CopyFailed(e))
                | Err(userfaultfd::Error::ZeropageFailed(e))
                    if e as i32 == libc::EEXIST =>
                {
                    let _ = self.uffd.wake(at.cast(), PAGE_SIZE as usize);
                    done += PAGE_SIZE;
                }
                // The count is negative (-EAGAIN) when nothing was copied.
                Err(userfaultfd::Error::PartiallyCopied(n)) => {
                    if (n as i64) > 0 {
                        done += n as u64;
                    } else {
                        tries += 1;
                        std::thread::yield_now();
                    }
                }
                Err(userfaultfd::Error::ZeropageFailed(e)) if e as i32 == libc::EAGAIN => {
                    if zero_step > PAGE_SIZE {
                        zero_step = PAGE_SIZE;
                    } else {
                        tries += 1;
                        std::thread::yield_now();
                    }
                }
                Err(e) => return Err(format!("{e:?}")),
            }
        }
        Ok(())
    }

    /// The aligned block of at most [`FAULT_BLOCK`] bytes around guest address `addr`, clipped
    /// to its region: (file offset, host address, length, file offset of the faulting page).
    fn block_around(&self, addr: u64) -> Option<(u64, *mut u8, u64, u64)> {
        self.regions.iter().find_map(|r| {
            let start = r.host as u64;
            (addr >= start && addr < start + r.len).then(|| {
                let page = (addr - start) & !(PAGE_SIZE - 1);
                let first = page & !(FAULT_BLOCK - 1);
                let len = FAULT_BLOCK.min(r.len - first);
                // SAFETY: `first` lies inside the region.
                let host = unsafe { r.host.add(first as usize) };
                (r.file_offset + first, host, len, r.file_offset + page)
            })
        })
    }

    /// Serves the fault on the page at file offset `page`: the whole block around it, or the
    /// page alone when the block cannot be read (so a short file is named at the page).
    fn serve_fault(&self, addr: u64, buf: &mut Vec<u8>) -> Result<(), String> {
        let (offset, host, len, page) = self
            .block_around(addr)
            .ok_or_else(|| format!("fault at {addr:#x} outside guest memory"))?;
        self.faults.fetch_add(1, Ordering::Relaxed);
        if self.fill(offset, host, len, buf).is_ok() {
            if self.recording {
                let mut recorded = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
                recorded.push(page);
                recorded.extend((0..len / PAGE_SIZE).map(|i| offset + i * PAGE_SIZE));
            }
            return Ok(());
        }
        // SAFETY: `page - offset` lies inside the block.
        let dst = unsafe { host.add((page - offset) as usize) };
        self.fill(page, dst, PAGE_SIZE, buf)?;
        if self.recording {
            self.recorded
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(page);
        }
        Ok(())
    }

    /// Prefetches `pages` (file offsets): sorted, coalesced into contiguous runs of at most
    /// [`PREFETCH_RUN`] bytes, each installed with one read and one copy.
    fn prefetch(&self, pages: &[u64], buf: &mut Vec<u8>) -> Result<(), String> {
        for (mut offset, mut len) in coalesce(pages, PREFETCH_RUN) {
            while len > 0 && !self.stop.load(Ordering::Relaxed) {
                let Some(region) = self
                    .regions
                    .iter()
                    .find(|r| offset >= r.file_offset && offset < r.file_offset + r.len)
                else {
                    offset += PAGE_SIZE;
                    len -= PAGE_SIZE;
                    continue;
                };
                let part = len.min(region.file_offset + region.len - offset);
                // SAFETY: the offset lies inside this region.
                let dst = unsafe { region.host.add((offset - region.file_offset) as usize) };
                self.fill(offset, dst, part, buf)?;
                self.prefetched
                    .fetch_add(part / PAGE_SIZE, Ordering::Relaxed);
                offset += part;
                len -= part;
            }
        }
        Ok(())
    }

    /// Records the first unserved fault, logs it and tells the hook, if one is set; later
    /// ones (the same fault, retried) are only counted.
    fn fail(&self, why: String) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if failure.0.is_some() {
            self.unserved.fetch_add(1, Ordering::Relaxed);
            return;
        }
        log::error!("page server: {why}");
        failure.0 = Some(why.clone());
        if let Some(hook) = failure.1.take() {
            hook(why);
        }
    }

    fn serve(&self, buf: &mut Vec<u8>) {
        let fd = self.uffd.as_raw_fd();
        while !self.stop.load(Ordering::Relaxed) {
            let mut poll = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: polls one valid fd with a 50 ms timeout.
            let n = unsafe { libc::poll(&mut poll, 1, 50) };
            if n <= 0 {
                continue;
            }
            loop {
                match self.uffd.read_event() {
                    Ok(Some(Event::Pagefault { addr, .. })) => {
                        if let Err(e) = self.serve_fault(addr as u64, buf) {
                            // Waking the thread would only fault again: it stays blocked and
                            // the owner ends the VM.
                            self.fail(format!("cannot serve a guest page fault: {e}"));
                        }
                    }
                    Ok(Some(other)) => log::debug!("page server: ignored event {other:?}"),
                    Ok(None) => break,
                    Err(e) => {
                        log::error!("page server: reading events: {e:?}");
                        break;
                    }
                }
            }
        }
    }
}

/// Options of a lazy restore.
#[derive(Debug, Clone, Default)]
pub struct PageServerOptions {
    /// Prefetch the pages listed in this working-set file before the guest runs.
    pub prefetch_from: Option<PathBuf>,
    /// Record the pages the guest faults in, written here when the server stops. Each fault
    /// records its page, then the pages of the block installed around it.
    pub record_to: Option<PathBuf>,
    /// Prefetch on a thread of its own, so the guest can start before the prefetch ends
    /// (faults on pages not yet prefetched are served as usual).
    pub background_prefetch: bool,
}

/// Figures of a running page server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageServerStats {
    /// Pages served on demand.
    pub faults: u64,
    /// Pages of the working set the prefetch covered (some may have been present already).
    pub prefetched: u64,
    /// UFFDIO_COPY and UFFDIO_ZEROPAGE calls made.
    pub installs: u64,
}

/// The running page server.
pub struct PageServer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    prefetcher: Option<JoinHandle<()>>,
    record_to: Option<PathBuf>,
}

/// Reads a working-set file: page offsets in first-touch order.
pub fn read_working_set(path: &Path) -> Result<Vec<u64>, UffdError> {
    let err = |detail: String| UffdError::WorkingSet {
        path: path.to_path_buf(),
        detail,
    };
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    if bytes.len() < 16 || bytes[..8] != WS_MAGIC {
        return Err(err("not a working-set file".into()));
    }
    let mut count = [0u8; 8];
    count.copy_from_slice(&bytes[8..16]);
    let count = u64::from_le_bytes(count) as usize;
    let body = &bytes[16..];
    if body.len() != count * 8 {
        return Err(err(format!(
            "truncated: {count} entries promised, {} bytes present",
            body.len()
        )));
    }
    Ok(body
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect())
}

fn write_working_set(path: &Path, pages: &[u64]) -> Result<(), String> {
    use std::io::Write;
    let out = AtomicFile::create(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::with_capacity(16 + pages.len() * 8);
    bytes.extend_from_slice(&WS_MAGIC);
    bytes.extend_from_slice(&(pages.len() as u64).to_le_bytes());
    for p in pages {
        bytes.extend_from_slice(&p.to_le_bytes());
    }
    out.file().write_all(&bytes).map_err(|e| e.to_string())?;
    out.commit().map_err(|e| e.to_string())
}

impl PageServer {
    /// Registers `regions` (anonymous, untouched) with a new userfaultfd, prefetches the
    /// working set if asked, and starts serving faults from `layers` (full base first).
    pub fn start(
        regions: &[HostRegion],
        layers: &[(MemoryLayer, File)],
        guest_len: u64,
        options: PageServerOptions,
    ) -> Result<Self, UffdError> {
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .create()
            .map_err(|e| {
                UffdError::Uffd(format!(
                    "create (needs /dev/userfaultfd or CAP_SYS_PTRACE): {e:?}"
                ))
            })?;
        for r in regions {
            uffd.register(r.host.cast(), r.len as usize).map_err(|e| {
                UffdError::Uffd(format!("register {:?}+{:#x}: {e:?}", r.host, r.len))
            })?;
        }
        let sources = layers
            .iter()
            .map(|(layer, file)| open_source(layer, file))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = Arc::new(Shared {
            regions: regions.to_vec(),
            sources,
            uffd,
            faults: AtomicU64::new(0),
            prefetched: AtomicU64::new(0),
            installs: AtomicU64::new(0),
            recorded: Mutex::new(Vec::new()),
            recording: options.record_to.is_some(),
            stop: AtomicBool::new(false),
            unserved: AtomicU64::new(0),
            failure: Mutex::new((None, None)),
        });
        let pages = match &options.prefetch_from {
            Some(ws) => {
                let mut pages = read_working_set(ws)?;
                pages.retain(|p| *p < guest_len);
                pages
            }
            None => Vec::new(),
        };
        let mut prefetcher = None;
        if !pages.is_empty() {
            let mut buf = Vec::with_capacity(PREFETCH_RUN as usize);
            if options.background_prefetch {
                let worker = Arc::clone(&shared);
                prefetcher = Some(
                    std::thread::Builder::new()
                        .name("page-prefetch".into())
                        .spawn(move || {
                            if let Some(hook) = PAGE_SERVER_START_HOOK.get() {
                                hook();
                            }
                            let result = worker.prefetch(&pages, &mut buf);
                            if let (Err(e), false) = (result, worker.stop.load(Ordering::Relaxed)) {
                                worker.fail(format!("cannot prefetch the working set: {e}"));
                            }
                        })
                        .map_err(UffdError::Thread)?,
                );
            } else {
                shared.prefetch(&pages, &mut buf).map_err(UffdError::Uffd)?;
            }
        }
        let worker = Arc::clone(&shared);
        let mut buf = Vec::with_capacity(FAULT_BLOCK as usize);
        let thread = std::thread::Builder::new()
            .name("page-server".into())
            .spawn(move || {
                if let Some(hook) = PAGE_SERVER_START_HOOK.get() {
                    hook();
                }
                worker.serve(&mut buf)
            })
            .map_err(UffdError::Thread)?;
        Ok(Self {
            shared,
            thread: Some(thread),
            prefetcher,
            record_to: options.record_to,
        })
    }

    /// Sets who is told, once, about a fault the server cannot serve (at once if one already
    /// happened). The faulting thread stays blocked: the owner must end the VM.
    pub fn on_failure(&self, hook: FailureHook) {
        let mut failure = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match failure.0.clone() {
            Some(why) => {
                drop(failure);
                hook(why);
            }
            None => failure.1 = Some(hook),
        }
    }

    /// The first fault the server could not serve.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// Waits for a background prefetch to end (at once without one).
    pub fn wait_prefetch(&mut self) {
        if let Some(prefetcher) = self.prefetcher.take() {
            let _ = prefetcher.join();
        }
    }

    /// Current figures.
    pub fn stats(&self) -> PageServerStats {
        PageServerStats {
            faults: self.shared.faults.load(Ordering::Relaxed),
            prefetched: self.shared.prefetched.load(Ordering::Relaxed),
            installs: self.shared.installs.load(Ordering::Relaxed),
        }
    }

    /// Writes the recorded working set now (it is also written when the server stops).
    pub fn save_working_set(&self) -> Result<(), String> {
        let Some(path) = &self.record_to else {
            return Ok(());
        };
        let mut seen = std::collections::HashSet::new();
        let pages: Vec<u64> = self
            .shared
            .recorded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .filter(|p| seen.insert(*p))
            .collect();
        write_working_set(path, &pages)
    }
}

/// Reads `buf.len()` bytes at `offset` of `src`: a short file or an I/O error is named.
fn read_at(src: &Source, offset: u64, buf: &mut [u8]) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    src.file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!(
                "memory file {} ends before offset {:#x} (truncated or replaced after the restore started)",
                src.path.display(),
                offset + buf.len() as u64
            )
        } else {
            format!(
                "reading memory file {} at offset {offset:#x}: {e}",
                src.path.display()
            )
        }
    })
}

impl Drop for PageServer {
    fn drop(&mut self) {
        // Keep serving until the owner is done with guest memory; then stop and save.
        self.shared.stop.store(true, Ordering::Relaxed);
        self.wait_prefetch();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if let Err(e) = self.save_working_set() {
            log::warn!("page server: cannot save the working set: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::anon;
    use crate::memory::{write_full, Sparseness};

    #[test]
    fn serves_faults_records_and_prefetches() {
        let dir = tempfile::tempdir().expect("tmp");
        let len = 32 * PAGE_SIZE;
        let src = anon(len as usize);
        for page in [1u64, 3, 20] {
            // SAFETY: inside the mapping.
            unsafe { *src.add((page * PAGE_SIZE) as usize + 1) = page as u8 + 100 };
        }
        let layer = write_full(
            &dir.path().join("mem"),
            &[HostRegion {
                host: src,
                len,
                file_offset: 0,
            }],
            len,
            Sparseness::PrivateAnonymous,
        )
        .expect("write");
        let file = crate::memory::open_layer(&layer, len).expect("open");
        let ws = dir.path().join("mem.ws");

        let dst = anon(len as usize);
        let regions = [HostRegion {
            host: dst,
            len,
            file_offset: 0,
        }];
        {
            let server = PageServer::start(
                &regions,
                &[(layer.clone(), file.try_clone().expect("dup"))],
                len,
                PageServerOptions {
                    prefetch_from: None,
                    record_to: Some(ws.clone()),
                    background_prefetch: false,
                },
            )
            .expect("start");
            // SAFETY: reads inside the registered mapping; the server fills them.
            unsafe {
                assert_eq!(
                    std::ptr::read_volatile(dst.add((3 * PAGE_SIZE) as usize + 1)),
                    103
                );
                assert_eq!(
                    std::ptr::read_volatile(dst.add((20 * PAGE_SIZE) as usize + 1)),
                    120
                );
                assert_eq!(
                    std::ptr::read_volatile(dst.add((7 * PAGE_SIZE) as usize)),
                    0
                );
            }
            assert_eq!(server.stats().faults, 2, "page 7 came in page 3's block");
        }
        // Each fault's page first, then the rest of the block installed around it.
        let block = FAULT_BLOCK / PAGE_SIZE;
        let expected: Vec<u64> = [3]
            .into_iter()
            .chain((0..block).filter(|p| *p != 3))
            .chain([20])
            .chain((block..2 * block).filter(|p| *p != 20))
            .map(|p| p * PAGE_SIZE)
            .collect();
        let recorded = read_working_set(&ws).expect("ws");
        assert_eq!(recorded, expected);

        let again = anon(len as usize);
        let regions = [HostRegion {
            host: again,
            len,
            file_offset: 0,
        }];
        let server = PageServer::start(
            &regions,
            &[(layer, file)],
            len,
            PageServerOptions {
                prefetch_from: Some(ws),
                record_to: None,
                background_prefetch: false,
            },
        )
        .expect("start");
        assert_eq!(server.stats().prefetched, 32);
        // SAFETY: reads inside the registered mapping.
        unsafe {
            assert_eq!(
                std::ptr::read_volatile(again.add((20 * PAGE_SIZE) as usize + 1)),
                120
            )
        };
        assert_eq!(server.stats().faults, 0, "prefetched pages must not fault");
    }

    #[test]
    fn a_truncated_memory_file_fails_the_fault_by_name_instead_of_hanging() {
        let dir = tempfile::tempdir().expect("tmp");
        let len = 8 * PAGE_SIZE;
        let src = anon(len as usize);
        // SAFETY: inside the mapping.
        unsafe { *src.add((6 * PAGE_SIZE) as usize) = 66 };
        let path = dir.path().join("mem");
        let layer = write_full(
            &path,
            &[HostRegion {
                host: src,
                len,
                file_offset: 0,
            }],
            len,
            Sparseness::PrivateAnonymous,
        )
        .expect("write");
        let file = crate::memory::open_layer(&layer, len).expect("open");
        let dst = anon(len as usize);
        let regions = [HostRegion {
            host: dst,
            len,
            file_offset: 0,
        }];
        let server = PageServer::start(
            &regions,
            &[(layer, file)],
            len,
            PageServerOptions::default(),
        )
        .expect("start");
        let (tx, rx) = std::sync::mpsc::channel();
        server.on_failure(Box::new(move |why| {
            let _ = tx.send(why);
        }));
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(2 * PAGE_SIZE))
            .expect("truncate");
        let page = dst as usize + (6 * PAGE_SIZE) as usize;
        let toucher = std::thread::spawn(move || {
            // SAFETY: reads inside the registered mapping; the fault blocks until the server
            // fills the page or goes away.
            unsafe { std::ptr::read_volatile(page as *const u8) }
        });
        let why = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the unserved fault was not reported");
        assert!(
            why.contains(&path.display().to_string()) && why.contains("ends before offset 0x7000"),
            "{why}"
        );
        assert_eq!(server.failure(), Some(why.clone()));
        // A hook set after the failure hears about it at once.
        let (tx, rx) = std::sync::mpsc::channel();
        server.on_failure(Box::new(move |why| {
            let _ = tx.send(why);
        }));
        assert_eq!(rx.try_recv().ok(), Some(why));
        assert!(
            !toucher.is_finished(),
            "the faulting thread must not run on a missing page"
        );
        // Closing the userfaultfd releases the thread (the page is then plain anonymous memory).
        drop(server);
        assert_eq!(toucher.join().expect("toucher"), 0);
    }

    /// A full memory layer of `pages` pages, page `p` holding `mark(p)` in its first byte for
    /// each `p` in `filled`; returns the layer and its open file.
    fn layer_with(
        dir: &Path,
        pages: u64,
        filled: impl IntoIterator<Item = u64>,
    ) -> (MemoryLayer, File) {
        let len = pages * PAGE_SIZE;
        let src = anon(len as usize);
        for page in filled {
            // SAFETY: inside the mapping.
            unsafe { *src.add((page * PAGE_SIZE) as usize) = mark(page) };
        }
        let layer = write_full(
            &dir.join("mem"),
            &[HostRegion {
                host: src,
                len,
                file_offset: 0,
            }],
            len,
            Sparseness::PrivateAnonymous,
        )
        .expect("write");
        let file = crate::memory::open_layer(&layer, len).expect("open");
        (layer, file)
    }

    /// A page server over a layer of `pages` pages (`filled` as in [`layer_with`]) that
    /// prefetches the working set `listed` (page numbers, in recording order); returns the
    /// guest mapping it fills and the server.
    fn prefetching_server(
        dir: &Path,
        pages: u64,
        filled: impl IntoIterator<Item = u64>,
        listed: &[u64],
        background_prefetch: bool,
    ) -> (*mut u8, PageServer) {
        let (layer, file) = layer_with(dir, pages, filled);
        let ws = dir.join("mem.ws");
        let offsets: Vec<u64> = listed.iter().map(|p| p * PAGE_SIZE).collect();
        write_working_set(&ws, &offsets).expect("ws");
        let dst = anon((pages * PAGE_SIZE) as usize);
        let regions = [HostRegion {
            host: dst,
            len: pages * PAGE_SIZE,
            file_offset: 0,
        }];
        let server = PageServer::start(
            &regions,
            &[(layer, file)],
            pages * PAGE_SIZE,
            PageServerOptions {
                prefetch_from: Some(ws),
                background_prefetch,
                ..PageServerOptions::default()
            },
        )
        .expect("start");
        (dst, server)
    }

    fn mark(page: u64) -> u8 {
        (page % 251) as u8 + 1
    }

    fn read_byte(base: *mut u8, page: u64) -> u8 {
        // SAFETY: callers pass pages inside a registered mapping; the server fills them.
        unsafe { std::ptr::read_volatile(base.add((page * PAGE_SIZE) as usize)) }
    }

    #[test]
    fn coalesce_merges_contiguous_pages_up_to_the_limit() {
        let p = |n: u64| n * PAGE_SIZE;
        assert_eq!(
            coalesce(&[p(5), p(1), p(2), p(3), p(3), p(9)], 2 * PAGE_SIZE),
            vec![(p(1), p(2)), (p(3), p(1)), (p(5), p(1)), (p(9), p(1))]
        );
        assert_eq!(
            coalesce(&[p(4), p(2), p(3)], PREFETCH_RUN),
            vec![(p(2), p(3))]
        );
        assert!(coalesce(&[], PREFETCH_RUN).is_empty());
    }

    #[test]
    fn a_contiguous_working_set_is_prefetched_with_one_copy_per_run() {
        let dir = tempfile::tempdir().expect("tmp");
        let (dst, server) = prefetching_server(
            dir.path(),
            64,
            (2..10).chain([40]),
            &[40, 9, 2, 3, 4, 5, 6, 7, 8],
            false,
        );
        let stats = server.stats();
        assert_eq!(stats.prefetched, 9);
        assert_eq!(
            stats.installs, 2,
            "pages 2-9 in one copy, page 40 in another"
        );
        for page in (2..10).chain([40]) {
            assert_eq!(read_byte(dst, page), mark(page), "page {page}");
        }
        assert_eq!(server.stats().faults, 0, "prefetched pages must not fault");
    }

    #[test]
    fn a_fault_installs_its_block_and_keeps_pages_already_present() {
        let dir = tempfile::tempdir().expect("tmp");
        let pages = 2 * FAULT_BLOCK / PAGE_SIZE;
        let (dst, server) = prefetching_server(dir.path(), pages, 0..pages, &[5, 6], false);
        // The guest changes a prefetched page before faulting next to it.
        // SAFETY: page 5 is present (prefetched) and inside the mapping.
        unsafe { std::ptr::write_volatile(dst.add((5 * PAGE_SIZE) as usize), 200) };
        assert_eq!(read_byte(dst, 3), mark(3));
        assert_eq!(server.stats().faults, 1);
        assert_eq!(
            read_byte(dst, 5),
            200,
            "a present page must not be overwritten"
        );
        let block = FAULT_BLOCK / PAGE_SIZE;
        for page in (0..block).filter(|p| *p != 5) {
            assert_eq!(read_byte(dst, page), mark(page), "page {page}");
        }
        assert_eq!(
            server.stats().faults,
            1,
            "the whole block came with the first fault"
        );
        assert_eq!(read_byte(dst, block), mark(block));
        assert_eq!(server.stats().faults, 2, "the next block faults on its own");
    }

    #[test]
    fn a_background_prefetch_races_faults_without_losing_a_page() {
        let dir = tempfile::tempdir().expect("tmp");
        let pages = 1024;
        let listed: Vec<u64> = (0..pages).rev().collect();
        let (dst, mut server) = prefetching_server(dir.path(), pages, 0..pages, &listed, true);
        // Read from the top down while the prefetch runs from the bottom up.
        for page in (0..pages).rev() {
            assert_eq!(read_byte(dst, page), mark(page), "page {page}");
        }
        server.wait_prefetch();
        assert_eq!(server.failure(), None);
        assert_eq!(server.stats().prefetched, pages);
    }
}
