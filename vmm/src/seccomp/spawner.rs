//! The spawner: one long-lived thread, started before any filter exists, that starts child
//! processes (virtiofsd) so that they do not inherit a filtered thread's filter. It runs
//! under the spawners' filter (`exec.rs`): only the binary in the virtiofsd slot.

use std::process::{Child, Command};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

type SpawnRequest = (Command, Sender<std::io::Result<Child>>);

/// Starts child processes from one long-lived thread that never installs a filter (children
/// inherit their parent thread's filters across `execve`). Started by [`super::configure`], before
/// any filter exists.
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
                for (mut command, reply) in incoming {
                    let child = if filtered {
                        super::spawn_from_slot(command, super::VIRTIOFSD_SLOT)
                    } else {
                        command.spawn()
                    };
                    let _ = reply.send(child);
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
    /// Starts `command` from the spawner thread (from the caller if there is none).
    pub fn spawn(&self, mut command: Command) -> std::io::Result<Child> {
        let requests = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(requests) = requests else {
            return command.spawn();
        };
        let ended = || std::io::Error::other("the spawner thread has ended");
        let (reply, answer) = channel();
        requests.send((command, reply)).map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }
}
