//! The warm pool (`rollbox serve --warm-pool MIB=N`): per guest memory size, N jailed VMM
//! shells started ahead ([`Shell`]), so that a create restoring a snapshot of that size loads
//! it into one instead of starting and jailing a VMM while the caller waits. A create takes a
//! shell and the pool starts another in the background, one at a time; a shell whose VMM died
//! is logged and replaced; a shell serves one sandbox, whose id it was started with. Shells
//! hold no guest memory until taken (each is one VMM process, about 2 MiB), so they are shown
//! in `GET /node` and `/metrics` but not counted as sandboxes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::super::api::WarmPoolShape;
use super::super::supervisor::{Shell, Supervisor};

/// How long the refill waits after a shell failed to start (a broken VMM path, a full disk)
/// before it tries again.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(5);
/// How often ready shells are checked for a VMM that died.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// `--warm-pool` shells by guest memory size.
pub struct WarmPool {
    /// How many shells each memory size keeps ready.
    targets: BTreeMap<u32, usize>,
    ready: Mutex<BTreeMap<u32, Vec<Shell>>>,
    /// Taken shells wake the refill, and so does the daemon's stop.
    wake: tokio::sync::Notify,
    /// Set when the daemon stops: the refill ends after the shell it is starting, if any (a
    /// refill cut off mid-start would leave that shell's VMM running).
    closing: std::sync::atomic::AtomicBool,
}

impl WarmPool {
    pub fn new(targets: BTreeMap<u32, usize>) -> WarmPool {
        WarmPool {
            targets,
            ready: Mutex::new(BTreeMap::new()),
            wake: tokio::sync::Notify::new(),
            closing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn ready(&self) -> MutexGuard<'_, BTreeMap<u32, Vec<Shell>>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A ready shell for a guest of `memory_mib` whose VMM still runs, if there is one.
    pub fn take(&self, memory_mib: u32) -> Option<Shell> {
        if !self.targets.contains_key(&memory_mib) {
            return None;
        }
        let taken = {
            let mut ready = self.ready();
            let shells = ready.get_mut(&memory_mib)?;
            // The newest first; a dead one is left for the refill to log and replace.
            let live = shells.iter_mut().rposition(Shell::alive)?;
            shells.remove(live)
        };
        self.wake.notify_one();
        Some(taken)
    }

    /// A shell taken but not used (its create was refused before its VMM got anything).
    pub fn put_back(&self, shell: Shell) {
        self.ready()
            .entry(shell.memory_mib)
            .or_default()
            .push(shell);
    }

    /// Each memory size's target and ready shells.
    pub fn status(&self) -> Vec<WarmPoolShape> {
        let ready = self.ready();
        self.targets
            .iter()
            .map(|(&memory_mib, &target)| WarmPoolShape {
                memory_mib,
                target: target as u64,
                ready: ready.get(&memory_mib).map_or(0, Vec::len) as u64,
            })
            .collect()
    }

    fn is_closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Keeps every memory size at its target until [`WarmPool::close`]; `new_id` names each
    /// shell's future sandbox.
    pub async fn refill(
        self: Arc<Self>,
        supervisor: Arc<Supervisor>,
        new_id: impl Fn() -> String + Send + Sync,
    ) {
        while !self.is_closing() {
            let dead = self.remove_dead();
            for shell in dead {
                log::warn!(
                    "warm shell {} (pid {}, {} MiB) died; replacing it",
                    shell.id,
                    shell.pid(),
                    shell.memory_mib
                );
                supervisor.discard_shell(shell).await;
            }
            let mut failed = false;
            for (&memory_mib, &target) in &self.targets {
                while !self.is_closing()
                    && self.ready().get(&memory_mib).map_or(0, Vec::len) < target
                {
                    match supervisor.start_shell(new_id(), memory_mib).await {
                        Ok(shell) => self.put_back(shell),
                        Err(e) => {
                            log::error!("warm pool: a {memory_mib} MiB shell did not start: {e}");
                            failed = true;
                            break;
                        }
                    }
                }
            }
            let pause = if failed {
                RETRY_AFTER_FAILURE
            } else {
                CHECK_EVERY
            };
            let _ = tokio::time::timeout(pause, self.wake.notified()).await;
        }
    }

    /// The ready shells whose VMM ended, taken out of the pool.
    fn remove_dead(&self) -> Vec<Shell> {
        let mut dead = Vec::new();
        for shells in self.ready().values_mut() {
            let mut index = 0;
            while index < shells.len() {
                if shells[index].alive() {
                    index += 1;
                } else {
                    dead.push(shells.remove(index));
                }
            }
        }
        dead
    }

    /// Stops the refill: it ends once the shell it may be starting is in the pool.
    pub fn stop_refill(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Ends every ready shell (the daemon stops, its refill ended).
    pub async fn close(&self, supervisor: &Supervisor) {
        let all: Vec<Shell> = std::mem::take(&mut *self.ready())
            .into_values()
            .flatten()
            .collect();
        for shell in all {
            supervisor.discard_shell(shell).await;
        }
    }
}

/// Parses one `--warm-pool` value, `MIB=N`: N shells for guests of MIB MiB.
pub fn parse_shape(value: &str) -> Result<(u32, usize), String> {
    let refuse = || {
        format!("--warm-pool {value:?}: expected MIB=N, e.g. 256=8 (8 shells for 256 MiB guests)")
    };
    let (memory, count) = value.split_once('=').ok_or_else(refuse)?;
    let memory_mib: u32 = memory.trim().parse().map_err(|_| refuse())?;
    let count: usize = count.trim().parse().map_err(|_| refuse())?;
    if memory_mib == 0 || count == 0 || count > 256 {
        return Err(format!(
            "--warm-pool {value:?}: memory must be above 0 MiB and the count 1 to 256"
        ));
    }
    Ok((memory_mib, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_name_the_flag() {
        assert_eq!(parse_shape("256=8"), Ok((256, 8)));
        assert_eq!(parse_shape(" 32 = 2 "), Ok((32, 2)));
        for bad in ["256", "x=1", "256=y", "0=1", "256=0", "256=1000", "=", ""] {
            let e = parse_shape(bad).unwrap_err();
            assert!(e.contains("--warm-pool"), "{bad}: {e}");
        }
    }
}
