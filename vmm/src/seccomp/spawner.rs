//! The spawner: one long-lived thread, started before any filter exists, that creates the
//! processes this one needs, so that they do not inherit a filtered thread's filter: child
//! processes (virtiofsd) and the writers of background memory snapshots (a fork(2) of this
//! process). It runs under the spawners' filter (`exec.rs`): only the binary in the virtiofsd
//! slot may be executed.

use std::process::{Child, Command};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

use crate::background_snapshot::{BackgroundSnapshotError, DumpJob, StartedDump};

/// Work for the spawner thread: the processes it creates.
enum SpawnRequest {
    /// A child process (virtiofsd).
    Command(Command, Sender<std::io::Result<Child>>),
    /// A background memory snapshot's writer.
    Dump(
        DumpJob,
        Sender<Result<StartedDump, BackgroundSnapshotError>>,
    ),
}

/// Creates processes from one long-lived thread. Children inherit their parent thread's
/// filters across `execve`, and PR_SET_PDEATHSIG follows the thread that created a child, so
/// one thread that lives as long as the process does it. Started by [`super::configure`],
/// before any filter exists.
pub struct Spawner {
    requests: Mutex<Option<Sender<SpawnRequest>>>,
}

/// The process's spawner (started on first use; [`super::configure`] uses it first).
pub fn spawner() -> &'static Spawner {
    static SPAWNER: OnceLock<Spawner> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (requests, incoming) = channel::<SpawnRequest>();
        let started = std::thread::Builder::new()
            .name("spawner".into())
            .spawn(move || {
                let filtered = super::apply_spawner_filter();
                for request in incoming {
                    match request {
                        SpawnRequest::Command(mut command, reply) => {
                            let child = if filtered {
                                super::spawn_from_slot(command, super::VIRTIOFSD_SLOT)
                            } else {
                                command.spawn()
                            };
                            let _ = reply.send(child);
                        }
                        SpawnRequest::Dump(job, reply) => {
                            let _ = reply.send(job.start());
                        }
                    }
                }
            });
        if let Err(e) = &started {
            log::warn!("no spawner thread ({e}): child processes start from their caller");
        }
        Spawner {
            requests: Mutex::new(started.ok().map(|_| requests)),
        }
    })
}

impl Spawner {
    fn sender(&self) -> Option<Sender<SpawnRequest>> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Starts `command` from the spawner thread (from the caller if there is none).
    pub fn spawn(&self, mut command: Command) -> std::io::Result<Child> {
        let Some(requests) = self.sender() else {
            return command.spawn();
        };
        let ended = || std::io::Error::other("the spawner thread has ended");
        let (reply, answer) = channel();
        requests
            .send(SpawnRequest::Command(command, reply))
            .map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }

    /// Forks the writer of a background memory snapshot from the spawner thread, which no
    /// filter keeps from creating processes. Without that thread it is an error, not a fork
    /// from the caller (a filtered thread's fork(2) would end the process with SIGSYS): the
    /// snapshot then writes its memory while the VM is paused.
    pub fn start_dump(&self, job: DumpJob) -> Result<StartedDump, BackgroundSnapshotError> {
        let path = job.path().to_path_buf();
        let unavailable = |why: &str| BackgroundSnapshotError::Fork {
            path: path.clone(),
            source: std::io::Error::other(why.to_string()),
        };
        let Some(requests) = self.sender() else {
            return Err(unavailable("there is no spawner thread"));
        };
        let ended = || unavailable("the spawner thread has ended");
        let (reply, answer) = channel();
        requests
            .send(SpawnRequest::Dump(job, reply))
            .map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }
}
