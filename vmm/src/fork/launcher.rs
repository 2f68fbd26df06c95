//! The launcher: one long-lived thread that starts clone processes (PR_SET_PDEATHSIG follows
//! the thread that started a child) and forks the writers of background memory snapshots.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use super::error::ForkError;
use crate::background_snapshot::{BackgroundSnapshotError, DumpJob, StartedDump};

/// Work for the launcher thread: the processes it creates.
enum LauncherRequest {
    /// A clone shell.
    Spawn(Command, Sender<std::io::Result<Child>>),
    /// A background memory snapshot's writer (fork(2) of this process).
    Dump(
        DumpJob,
        Sender<Result<StartedDump, BackgroundSnapshotError>>,
    ),
}

/// Starts clone processes from one long-lived thread. PR_SET_PDEATHSIG fires when the *thread*
/// that started a child ends, so shells started from a caller's short-lived thread would die
/// early; these die when the last handle to the launcher is dropped (or the process ends).
pub struct Launcher {
    binary: PathBuf,
    /// The clones' `--console-max-bytes` (None: their default).
    console_max_bytes: Option<u64>,
    requests: Sender<LauncherRequest>,
}

impl Launcher {
    /// A launcher that runs `binary` (a `rollbox-vmm`) for each clone.
    pub fn new(binary: PathBuf) -> Result<Arc<Self>, ForkError> {
        Self::with_console_max_bytes(binary, None)
    }

    /// A launcher whose clones' console files are capped at `console_max_bytes` (None: the
    /// clones' default).
    pub fn with_console_max_bytes(
        binary: PathBuf,
        console_max_bytes: Option<u64>,
    ) -> Result<Arc<Self>, ForkError> {
        let (requests, incoming) = channel::<LauncherRequest>();
        std::thread::Builder::new()
            .name("fork-launcher".into())
            .spawn(move || {
                // Clones run rollbox-vmm from its slot, and nothing else runs from here.
                let filtered = crate::seccomp::apply_spawner_filter();
                for request in incoming {
                    match request {
                        LauncherRequest::Spawn(mut command, reply) => {
                            let child = if filtered {
                                crate::seccomp::spawn_from_slot(command, crate::seccomp::VMM_SLOT)
                            } else {
                                command.spawn()
                            };
                            let _ = reply.send(child);
                        }
                        LauncherRequest::Dump(job, reply) => {
                            let _ = reply.send(job.start());
                        }
                    }
                }
            })
            .map_err(ForkError::Launcher)?;
        Ok(Arc::new(Self {
            binary,
            console_max_bytes,
            requests,
        }))
    }

    /// The `rollbox-vmm` binary clones run.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The clones' console cap, if set.
    pub fn console_max_bytes(&self) -> Option<u64> {
        self.console_max_bytes
    }

    pub(super) fn spawn(&self, command: Command) -> std::io::Result<Child> {
        let ended = || std::io::Error::other("the fork launcher thread has ended");
        let (reply, answer) = channel();
        self.requests
            .send(LauncherRequest::Spawn(command, reply))
            .map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }

    /// Forks the writer of a background memory snapshot from the launcher thread, which no
    /// seccomp filter keeps from creating processes.
    pub(super) fn start_dump(&self, job: DumpJob) -> Result<StartedDump, BackgroundSnapshotError> {
        let path = job.path().to_path_buf();
        let ended = || BackgroundSnapshotError::Fork {
            path: path.clone(),
            source: std::io::Error::other("the fork launcher thread has ended"),
        };
        let (reply, answer) = channel();
        self.requests
            .send(LauncherRequest::Dump(job, reply))
            .map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }
}
