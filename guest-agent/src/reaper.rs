//! Child processes: spawned through here, reaped here. The agent may be
//! PID 1 (or a child subreaper), so it reaps every child with
//! `waitpid(-1)` and hands each exit status to whoever spawned that pid.
//! Spawning holds the same lock as reaping, so a child that exits at once
//! is never reaped before it is registered.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;

/// A raw wait status from waitpid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitStatus(pub i32);

impl WaitStatus {
    pub fn code(self) -> Option<i32> {
        libc::WIFEXITED(self.0).then(|| libc::WEXITSTATUS(self.0))
    }

    pub fn signal(self) -> Option<i32> {
        libc::WIFSIGNALED(self.0).then(|| libc::WTERMSIG(self.0))
    }
}

#[derive(Default)]
struct State {
    waiting: HashMap<i32, oneshot::Sender<WaitStatus>>,
}

#[derive(Default)]
pub struct Reaper {
    state: Mutex<State>,
}

static REAPER: OnceLock<Reaper> = OnceLock::new();

pub fn reaper() -> &'static Reaper {
    REAPER.get_or_init(Reaper::default)
}

impl Reaper {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spawn `command` and return the child (for its pipes) and a receiver
    /// of its exit status. Never call `wait` on the returned child.
    pub fn spawn(
        &self,
        command: &mut Command,
    ) -> io::Result<(Child, oneshot::Receiver<WaitStatus>)> {
        let mut state = self.lock();
        let child = command.spawn()?;
        let (tx, rx) = oneshot::channel();
        let pid =
            i32::try_from(child.id()).map_err(|_| io::Error::other("child pid out of range"))?;
        if state.waiting.insert(pid, tx).is_some() {
            // The earlier process of this pid was reaped elsewhere; its waiter now gets an
            // error (exec answers "exit status lost"), not a made-up status.
            log::error!(
                "pid {pid} spawned while an earlier process of that pid awaited its status"
            );
        }
        Ok((child, rx))
    }

    /// Reap every exited child; deliver statuses of registered ones.
    pub fn reap(&self) {
        let mut state = self.lock();
        loop {
            let mut status = 0;
            // SAFETY: waitpid writes only to `status`, a valid local.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if let Some(tx) = state.waiting.remove(&pid) {
                // The spawner may have given up waiting; nothing to do then.
                let _ = tx.send(WaitStatus(status));
            }
        }
    }

    /// Children spawned through the reaper that have not exited yet.
    pub fn running(&self) -> usize {
        self.lock().waiting.len()
    }
}

/// Reap on every SIGCHLD, and once a second in case signals were merged or missed.
pub async fn run() -> io::Result<()> {
    let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
    loop {
        tokio::select! {
            _ = sigchld.recv() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        reaper().reap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn exit_codes_and_signals_are_delivered() {
        let reaper_task = tokio::spawn(run());
        let (_child, rx) = reaper()
            .spawn(Command::new("/bin/sh").args(["-c", "exit 7"]))
            .expect("spawn");
        let status = rx.await.expect("status");
        assert_eq!(status.code(), Some(7));
        let (_child, rx) = reaper()
            .spawn(Command::new("/bin/sh").args(["-c", "kill -9 $$"]))
            .expect("spawn");
        let status = rx.await.expect("status");
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        reaper_task.abort();
    }
}
