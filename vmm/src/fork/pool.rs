//! The warm pool: shells started ahead of a fork (`--fork-pool N`).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cleanup::{remove_dir_all_quietly, shm_dir};
use super::error::ForkError;
use super::launcher::Launcher;
use super::shell::{spawn_shell, Shell};
use crate::builder::MicroVm;

/// The most shells a warm pool may keep: each is a process with an empty VM.
pub const MAX_POOL: usize = 64;

/// How far a pool's shells are (`GET /fork-pool`): the API's own type.
pub use vmm_api::ForkPoolStatus;

/// Clone processes started ahead of a fork (opt-in: `--fork-pool N`, at most [`MAX_POOL`]).
/// Unused shells die with the pool, with the launcher's thread, or with the process.
pub struct ForkPool {
    launcher: Arc<Launcher>,
    dir: PathBuf,
    shells: Vec<Shell>,
    next: u32,
    target: usize,
}

impl ForkPool {
    /// A pool keeping `target` shells (0: none, every fork starts its clones) once filled.
    pub fn new(launcher: Arc<Launcher>, target: usize) -> Result<Self, ForkError> {
        if target > MAX_POOL {
            return Err(ForkError::PoolTooLarge {
                shells: target,
                max: MAX_POOL,
            });
        }
        Ok(Self {
            launcher,
            dir: shm_dir("pool"),
            shells: Vec::new(),
            next: 0,
            target,
        })
    }

    /// The launcher that starts this pool's shells and every fork's clones.
    pub fn launcher(&self) -> &Arc<Launcher> {
        &self.launcher
    }

    /// Starts shells of `vm`'s shape until the target is reached.
    pub fn refill(&mut self, vm: &MicroVm) {
        self.shells.retain_mut(|shell| {
            let alive = shell.alive();
            if !alive {
                remove_dir_all_quietly(&shell.dir);
            }
            alive
        });
        while self.shells.len() < self.target {
            let dir = self.dir.join(format!("shell-{}", self.next));
            self.next += 1;
            match spawn_shell(&self.launcher, &dir, &vm.machine) {
                Ok(shell) => self.shells.push(shell),
                Err(e) => {
                    log::warn!("fork pool: {e}");
                    return;
                }
            }
        }
    }

    pub(super) fn take(&mut self) -> Option<Shell> {
        while let Some(mut shell) = self.shells.pop() {
            if shell.alive() {
                return Some(shell);
            }
            remove_dir_all_quietly(&shell.dir);
        }
        None
    }

    /// A wait, for any thread, until every shell now in the pool has built its VM (or ended),
    /// up to `timeout`.
    pub fn ready_waiter(
        &self,
        timeout: Duration,
    ) -> impl FnOnce() -> ForkPoolStatus + Send + 'static {
        let target = self.target;
        let already = self.shells.iter().filter(|s| s.ready).count();
        let pending: Vec<UnixStream> = self
            .shells
            .iter()
            .filter(|s| !s.ready)
            .filter_map(|s| s.control.get_ref().try_clone().ok())
            .collect();
        move || ForkPoolStatus {
            target,
            ready: already + wait_readable(&pending, timeout),
        }
    }
}

/// Waits until every stream has something to read (or closed), up to `timeout`; returns how
/// many have data.
fn wait_readable(streams: &[UnixStream], timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    let mut fds: Vec<libc::pollfd> = streams
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut done = 0;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        fds.retain(|fd| fd.revents == 0);
        if fds.is_empty() {
            break;
        }
        let millis = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: polls `fds.len()` pollfd entries that live in `fds` for the whole call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        // A shell that wrote `ready` and ended since is readable and hung up: not ready.
        done += fds
            .iter()
            .filter(|fd| fd.revents & libc::POLLIN != 0 && fd.revents & libc::POLLHUP == 0)
            .count();
    }
    done
}

impl Drop for ForkPool {
    /// Closes the unused shells' control sockets (they exit and remove their files), then
    /// makes sure they ended.
    fn drop(&mut self) {
        for shell in &mut self.shells {
            let _ = shell.control.get_ref().shutdown(std::net::Shutdown::Both);
        }
        for shell in &mut self.shells {
            shell.kill();
            remove_dir_all_quietly(&shell.dir);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_larger_than_the_limit_is_refused() {
        let launcher = Launcher::new(PathBuf::from("/nonexistent/rollbox-vmm")).expect("launcher");
        let error = ForkPool::new(Arc::clone(&launcher), MAX_POOL + 1)
            .err()
            .expect("refused");
        assert_eq!(
            error.to_string(),
            "a fork pool of 65 shells is too large: at most 64"
        );
        assert!(ForkPool::new(launcher, MAX_POOL).is_ok());
    }
}
