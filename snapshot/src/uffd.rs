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
    /// The topmost layer holding file offset `offset`.
    fn source_for(&self, offset: u64) -> Option<&Source> {
        self.sources.iter().rev().find(|s| match &s.ranges {
            None => true,
            Some(ranges) => ranges
                .iter()
                .any(|(start, len)| offset >= *start && offset < start + len),
        })
    }

    fn locate(&self, addr: u64) -> Option<(u64, *mut u8)> {
        self.regions.iter().find_map(|r| {
            let start = r.host as u64;
            (addr >= start && addr < start + r.len).then(|| {
                let page = (addr - start) & !(PAGE_SIZE - 1);
                // SAFETY: `page` lies inside the region.
                (r.file_offset + page, unsafe { r.host.add(page as usize) })
            })
        })
    }

    /// Fills `len` bytes at `dst` (file offset `offset`) from the layers.
    fn fill(&self, offset: u64, dst: *mut u8, len: u64) -> Result<(), String> {
        let mut page = vec![0u8; PAGE_SIZE as usize];
        let mut done = 0;
        while done < len {
            let at = offset + done;
            // SAFETY: `dst + done` stays inside the run the caller located.
            let to = unsafe { dst.add(done as usize) };
            let src = self
                .source_for(at)
                .ok_or_else(|| format!("no memory layer holds offset {at:#x}"))?;
            read_page(src, at, &mut page)?;
            let zero = page.iter().all(|b| *b == 0);
            self.place(to, &page, zero).map_err(|e| {
                format!(
                    "placing the page at offset {at:#x} of {}: {e}",
                    src.path.display()
                )
            })?;
            done += PAGE_SIZE;
        }
        Ok(())
    }

    /// Copies `page` (or a zero page) to the guest page `to`, retrying while the kernel
    /// answers EAGAIN.
    fn place(&self, to: *mut u8, page: &[u8], zero: bool) -> Result<(), String> {
        for _ in 0..EAGAIN_TRIES {
            // SAFETY: `to` is a registered, page-aligned guest page; `page` holds a page.
            let result = unsafe {
                if zero {
                    self.uffd.zeropage(to.cast(), PAGE_SIZE as usize, true)
                } else {
                    self.uffd
                        .copy(page.as_ptr().cast(), to.cast(), PAGE_SIZE as usize, true)
                }
            };
            match result {
                Ok(_) => return Ok(()),
                Err(userfaultfd::Error::CopyFailed(e))
                | Err(userfaultfd::Error::ZeropageFailed(e))
                    if e as i32 == libc::EEXIST =>
                {
                    let _ = self.uffd.wake(to.cast(), PAGE_SIZE as usize);
                    return Ok(());
                }
                Err(userfaultfd::Error::PartiallyCopied(_)) => std::thread::yield_now(),
                Err(userfaultfd::Error::ZeropageFailed(e)) if e as i32 == libc::EAGAIN => {
                    std::thread::yield_now()
                }
                Err(e) => return Err(format!("{e:?}")),
            }
        }
        Err(format!("the kernel answered EAGAIN {EAGAIN_TRIES} times"))
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

    fn serve(&self) {
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
                        let Some((offset, dst)) = self.locate(addr as u64) else {
                            self.fail(format!("fault at {addr:?} outside guest memory"));
                            continue;
                        };
                        self.faults.fetch_add(1, Ordering::Relaxed);
                        if self.recording {
                            self.recorded
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(offset);
                        }
                        if let Err(e) = self.fill(offset, dst, PAGE_SIZE) {
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
    /// Record the pages the guest faults in, written here when the server stops.
    pub record_to: Option<PathBuf>,
}

/// Figures of a running page server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageServerStats {
    /// Pages served on demand.
    pub faults: u64,
    /// Pages prefetched from the working set.
    pub prefetched: u64,
}

/// The running page server.
pub struct PageServer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
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
            recorded: Mutex::new(Vec::new()),
            recording: options.record_to.is_some(),
            stop: AtomicBool::new(false),
            unserved: AtomicU64::new(0),
            failure: Mutex::new((None, None)),
        });
        if let Some(ws) = &options.prefetch_from {
            let mut pages = read_working_set(ws)?;
            pages.sort_unstable();
            pages.dedup();
            for offset in pages {
                if offset >= guest_len {
                    continue;
                }
                let Some((_, dst)) = shared.regions.iter().find_map(|r| {
                    (offset >= r.file_offset && offset < r.file_offset + r.len)
                        // SAFETY: the offset lies inside this region.
                        .then(|| ((), unsafe { r.host.add((offset - r.file_offset) as usize) }))
                }) else {
                    continue;
                };
                shared
                    .fill(offset, dst, PAGE_SIZE)
                    .map_err(UffdError::Uffd)?;
                shared.prefetched.fetch_add(1, Ordering::Relaxed);
            }
        }
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("page-server".into())
            .spawn(move || {
                if let Some(hook) = PAGE_SERVER_START_HOOK.get() {
                    hook();
                }
                worker.serve()
            })
            .map_err(UffdError::Thread)?;
        Ok(Self {
            shared,
            thread: Some(thread),
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

    /// Current figures.
    pub fn stats(&self) -> PageServerStats {
        PageServerStats {
            faults: self.shared.faults.load(Ordering::Relaxed),
            prefetched: self.shared.prefetched.load(Ordering::Relaxed),
        }
    }

    /// Writes the recorded working set now (it is also written when the server stops).
    pub fn save_working_set(&self) -> Result<(), String> {
        let Some(path) = &self.record_to else {
            return Ok(());
        };
        let pages = self
            .shared
            .recorded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        write_working_set(path, &pages)
    }
}

/// Reads the page at `offset` of `src`: a short file or an I/O error is named.
fn read_page(src: &Source, offset: u64, page: &mut [u8]) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    src.file.read_exact_at(page, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!(
                "memory file {} ends before offset {:#x} (truncated or replaced after the restore started)",
                src.path.display(),
                offset + PAGE_SIZE
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
            assert_eq!(server.stats().faults, 3);
        }
        let recorded = read_working_set(&ws).expect("ws");
        assert_eq!(recorded, vec![3 * PAGE_SIZE, 20 * PAGE_SIZE, 7 * PAGE_SIZE]);

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
            },
        )
        .expect("start");
        assert_eq!(server.stats().prefetched, 3);
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
}
