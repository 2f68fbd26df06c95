//! Memory snapshots written in the background: while the VM is paused, fork(2) gives a child
//! process a copy-on-write image of guest memory; the VM resumes at once and the child writes
//! the image into the memory file. A snapshot's pause then costs the fork(2), not the write
//! (`PUT /snapshot/create` with `"rollbox": {"resume_vm": true}`, which the daemon's fork uses).
//!
//! Only private memory can be imaged this way: memory shared with a backend (virtio-fs) keeps
//! changing under the child, and lazily served memory reads as zeros in it (the page server's
//! userfaultfd does not follow a fork(2)). [`crate::persist::create_background_snapshot`] decides.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use snapshot::memory::{fill_full, FullMemoryFile, HostRegion, MemoryLayer, Sparseness};

/// Errors of a background memory snapshot.
#[derive(Debug, thiserror::Error)]
pub enum BackgroundSnapshotError {
    /// The pipe for the child's error text.
    #[error("background snapshot of {path}: pipe: {source}")]
    Pipe {
        /// The memory file.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// fork(2) failed.
    #[error("background snapshot of {path}: fork: {source}")]
    Fork {
        /// The memory file.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// Waiting for the child failed.
    #[error("background snapshot of {path}: waiting for writer process {pid}: {source}")]
    Wait {
        /// The memory file.
        path: PathBuf,
        /// The child.
        pid: libc::pid_t,
        /// The failure.
        source: std::io::Error,
    },
    /// The child could not write the memory file.
    #[error("background snapshot of {path}: writer process {pid} failed: {reason}")]
    Child {
        /// The memory file.
        path: PathBuf,
        /// The child.
        pid: libc::pid_t,
        /// Its error text, or how it ended.
        reason: String,
    },
    /// The written file could not be committed.
    #[error("background snapshot of {path}: {detail}")]
    Commit {
        /// The memory file.
        path: PathBuf,
        /// The failure.
        detail: String,
    },
}

/// Where the child looks for data to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// Private anonymous memory: pagemap says which pages were touched.
    PrivateAnonymous,
    /// A private mapping of a memory file: every page is read.
    PrivateFile,
}

/// What the child process needs: plain data and descriptors, nothing that takes a lock.
pub struct DumpJob {
    regions: Vec<HostRegion>,
    kind: ImageKind,
    file: RawFd,
    tmp: PathBuf,
    path: PathBuf,
    errors_read: OwnedFd,
    errors_write: OwnedFd,
}

// SAFETY: the raw pointers in `regions` are only dereferenced in the forked child, which has its
// own (copy-on-write) address space; the thread that forks only carries them.
unsafe impl Send for DumpJob {}

/// A started child: its pid and the read end of its error pipe.
pub struct StartedDump {
    pid: libc::pid_t,
    errors: File,
}

impl DumpJob {
    /// A job that writes `regions` into `memory`'s temporary file.
    pub fn new(
        memory: &FullMemoryFile,
        path: &Path,
        regions: Vec<HostRegion>,
        kind: ImageKind,
    ) -> Result<Self, BackgroundSnapshotError> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into the array on success.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(BackgroundSnapshotError::Pipe {
                path: path.to_path_buf(),
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: both descriptors were just created and are owned by nothing else.
        let (errors_read, errors_write) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Self {
            regions,
            kind,
            file: memory.file().as_raw_fd(),
            tmp: memory.tmp_path().to_path_buf(),
            path: path.to_path_buf(),
            errors_read,
            errors_write,
        })
    }

    /// The memory file the job writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Forks the writer. Call it from a thread that may create processes (no seccomp filter
    /// forbids fork) while every vCPU and device is stopped; the image is the memory of now.
    pub fn start(self) -> Result<StartedDump, BackgroundSnapshotError> {
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the child only runs `write_image`, which takes no lock another thread could
        // hold (glibc's malloc is fork-safe), and ends with _exit without running destructors.
        match unsafe { libc::fork() } {
            -1 => Err(BackgroundSnapshotError::Fork {
                path: self.path,
                source: std::io::Error::last_os_error(),
            }),
            0 => self.write_image(parent),
            pid => Ok(StartedDump {
                pid,
                errors: File::from(self.errors_read),
            }),
        }
    }

    /// The child's work: write the image, report any error on the pipe, and exit.
    fn write_image(&self, parent: libc::pid_t) -> ! {
        // SAFETY: prctl and getppid have no memory preconditions. The writer must not outlive
        // the VMM: it dies with the thread that forked it.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent {
                libc::_exit(2);
            }
        }
        close_all_but(&[self.file, self.errors_write.as_raw_fd()]);
        // SAFETY: the memory file's descriptor stays open in this process; ManuallyDrop keeps
        // it from being closed twice.
        let file = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(self.file) });
        let sparseness = match self.kind {
            ImageKind::PrivateAnonymous => Sparseness::PrivateAnonymous,
            ImageKind::PrivateFile => Sparseness::EveryPage,
        };
        let code = match fill_full(&file, &self.tmp, &self.regions, sparseness) {
            Ok(()) => 0,
            Err(e) => {
                let text = e.to_string();
                // SAFETY: writes the text's bytes from a live buffer; a short write only
                // shortens the report.
                unsafe {
                    libc::write(
                        self.errors_write.as_raw_fd(),
                        text.as_ptr().cast(),
                        text.len(),
                    )
                };
                1
            }
        };
        // SAFETY: ends the child without running the parent's destructors or atexit handlers.
        unsafe { libc::_exit(code) }
    }
}

/// Closes every descriptor from 3 up except `keep` (the child must not hold the VMM's sockets
/// open, or a peer waiting for end of file waits for the writer too).
fn close_all_but(keep: &[RawFd]) {
    let mut keep: Vec<u32> = keep
        .iter()
        .filter_map(|&fd| u32::try_from(fd).ok())
        .collect();
    keep.sort_unstable();
    let mut first = 3u32;
    for fd in keep.into_iter().filter(|&fd| fd >= 3) {
        if fd > first {
            // SAFETY: close_range only closes descriptors of this process.
            unsafe { libc::syscall(libc::SYS_close_range, first, fd - 1, 0) };
        }
        first = fd + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0) };
}

/// A memory file whose data a child process is writing; [`PendingMemory::wait`] commits it.
/// Dropped without waiting, it kills the child and leaves no file behind.
pub struct PendingMemory {
    memory: Option<FullMemoryFile>,
    path: PathBuf,
    id: u64,
    pid: Option<libc::pid_t>,
    errors: File,
}

impl PendingMemory {
    /// The file `memory` with identity `id`, written by the child `started`.
    pub fn new(memory: FullMemoryFile, path: &Path, id: u64, started: StartedDump) -> Self {
        Self {
            memory: Some(memory),
            path: path.to_path_buf(),
            id,
            pid: Some(started.pid),
            errors: started.errors,
        }
    }

    /// Waits for the child and commits the file under the identity the state file names.
    pub fn wait(mut self) -> Result<MemoryLayer, BackgroundSnapshotError> {
        let Some(pid) = self.pid.take() else {
            return Err(self.child_error(0, "the writer process was already reaped".into()));
        };
        let status = wait_for(pid).map_err(|source| BackgroundSnapshotError::Wait {
            path: self.path.clone(),
            pid,
            source,
        })?;
        let mut text = String::new();
        let _ = self.errors.read_to_string(&mut text);
        if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
            let memory = self
                .memory
                .take()
                .ok_or_else(|| BackgroundSnapshotError::Commit {
                    path: self.path.clone(),
                    detail: "committed twice".into(),
                })?;
            return memory
                .commit(self.id)
                .map_err(|e| BackgroundSnapshotError::Commit {
                    path: self.path.clone(),
                    detail: e.to_string(),
                });
        }
        let reason = if !text.is_empty() {
            text
        } else if libc::WIFSIGNALED(status) {
            format!("killed by signal {}", libc::WTERMSIG(status))
        } else {
            format!("exit status {}", libc::WEXITSTATUS(status))
        };
        Err(self.child_error(pid, reason))
    }

    fn child_error(&self, pid: libc::pid_t, reason: String) -> BackgroundSnapshotError {
        BackgroundSnapshotError::Child {
            path: self.path.clone(),
            pid,
            reason,
        }
    }
}

impl Drop for PendingMemory {
    fn drop(&mut self) {
        if let Some(pid) = self.pid.take() {
            // SAFETY: the pid is this process's unreaped child, so it names no other process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let _ = wait_for(pid);
        }
    }
}

/// waitpid, retried on EINTR; the raw status.
fn wait_for(pid: libc::pid_t) -> std::io::Result<libc::c_int> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the status into a live integer.
        if unsafe { libc::waitpid(pid, &mut status, 0) } == pid {
            return Ok(status);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use snapshot::memory::{open_layer, PAGE_SIZE};
    use std::os::unix::fs::FileExt;

    #[test]
    fn the_file_holds_memory_as_it_was_at_the_fork_not_as_it_is_after() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("memory");
        let len = 64 * PAGE_SIZE as usize;
        let mapping = vm_memory::MmapRegion::<()>::new(len).expect("mmap");
        let host = mapping.as_ptr();
        // SAFETY: the mapping is `len` bytes long and outlives `guest`.
        let guest = unsafe { std::slice::from_raw_parts_mut(host, len) };
        guest[0] = 1;
        guest[10 * PAGE_SIZE as usize] = 2;
        let memory = FullMemoryFile::create(&path, len as u64).expect("create");
        let regions = vec![HostRegion {
            host,
            len: len as u64,
            file_offset: 0,
        }];
        let job = DumpJob::new(&memory, &path, regions, ImageKind::PrivateAnonymous).expect("job");
        let started = job.start().expect("fork");
        // The "VM" runs on and changes its memory while the child writes.
        guest[0] = 9;
        guest[20 * PAGE_SIZE as usize] = 3;
        let layer = PendingMemory::new(memory, &path, 77, started)
            .wait()
            .expect("written");
        assert_eq!(layer.id, 77);
        let file = open_layer(&layer, len as u64).expect("the layer opens with its identity");
        let mut byte = [0u8; 1];
        for (offset, want) in [(0, 1u8), (10 * PAGE_SIZE, 2), (20 * PAGE_SIZE, 0)] {
            file.read_exact_at(&mut byte, offset).expect("read");
            assert_eq!(byte[0], want, "offset {offset}");
        }
    }

    #[test]
    fn a_failing_writer_names_its_error_and_no_file_is_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("memory");
        let len = 4 * PAGE_SIZE as usize;
        let mapping = vm_memory::MmapRegion::<()>::new(len).expect("mmap");
        let host = mapping.as_ptr();
        // SAFETY: the first page of the mapping.
        unsafe { *host = 5 };
        let memory = FullMemoryFile::create(&path, len as u64).expect("create");
        // The writer gets a read-only descriptor of the file, so its first write fails.
        let read_only = File::open(memory.tmp_path()).expect("reopen");
        let mut job = DumpJob::new(
            &memory,
            &path,
            vec![HostRegion {
                host,
                len: len as u64,
                file_offset: 0,
            }],
            ImageKind::PrivateAnonymous,
        )
        .expect("job");
        job.file = read_only.as_raw_fd();
        let started = job.start().expect("fork");
        let error = PendingMemory::new(memory, &path, 1, started)
            .wait()
            .expect_err("a read-only descriptor cannot be written");
        let text = error.to_string();
        assert!(text.contains("writer process"), "{text}");
        assert!(text.contains(".memory.tmp-"), "names the file: {text}");
        drop(read_only);
        assert!(!path.exists());
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert!(left.is_empty(), "the temporary file goes: {left:?}");
    }
}
