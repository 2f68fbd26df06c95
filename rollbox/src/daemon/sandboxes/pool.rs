//! The warm pool (`rollbox serve --warm-pool MIB=N`, `--warm-pool templates=N`): jailed VMM
//! shells started ahead ([`Shell`]), so that a create restoring a snapshot loads it into one
//! instead of starting and jailing a VMM while the caller waits. `MIB=N` keeps N shells for
//! guests of MIB MiB (no shared base, a disk no larger than the memory);
//! `templates=N` keeps N for each template with a boot snapshot, made for its memory, disk and
//! shared base (`rollbox serve` asks for [`DEFAULT_PER_TEMPLATE`] unless told). A create takes a shell and the pool starts another in the background, one at a
//! time; a shell whose VMM died is logged and replaced; a shell serves one sandbox, whose id it
//! was started with. Shells hold no guest memory until taken (each is one VMM process, about
//! 2 MiB) and are not sandboxes (`GET /node` and `/metrics` show them), but they count against
//! the node's limits beside the live sandboxes: the pool fills only the room those leave, and
//! ends the shells past it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::super::api::WarmPoolShape;
use super::super::supervisor::{Shell, ShellShape, Supervisor};

/// How long the refill waits after a shell failed to start (a broken VMM path, a full disk)
/// before it tries again.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(5);
/// How often ready shells are checked for a VMM that died, and templates for new ones.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// One `--warm-pool` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolSpec {
    /// `MIB=N`.
    Memory { memory_mib: u32, count: usize },
    /// `templates=N`.
    Templates { count: usize },
}

/// `--warm-pool` shells by shape: a shape is a memory size, or a template.
pub struct WarmPool {
    /// The `MIB=N` shapes.
    fixed: BTreeMap<u32, usize>,
    /// `templates=N`'s N (0: none).
    per_template: usize,
    /// What the refill keeps, by shape: the fixed ones and the templates' of its last pass.
    targets: Mutex<Vec<(ShellShape, usize)>>,
    ready: Mutex<Vec<Shell>>,
    /// Shells taken by creates whose row is not in yet (count, guest MiB): until it is, they
    /// still take their room. Also the pool's accounting lock, taken before `ready`: the refill
    /// holds it across a room check, and a create across its row's insert
    /// ([`WarmPool::insert_for`]), so no shell is counted twice or missed.
    taken: Mutex<(u64, u64)>,
    /// Taken shells wake the refill, and so does the daemon's stop.
    wake: tokio::sync::Notify,
    /// Set when the daemon stops: the refill ends after the shell it is starting, if any (a
    /// refill cut off mid-start would leave that shell's VMM running).
    closing: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl WarmPool {
    /// A pool of `specs`; None when they ask for nothing.
    pub fn new(specs: &[PoolSpec]) -> Option<WarmPool> {
        let mut fixed = BTreeMap::new();
        let mut per_template = 0;
        for spec in specs {
            match *spec {
                PoolSpec::Memory { memory_mib, count } => {
                    fixed.insert(memory_mib, count);
                }
                PoolSpec::Templates { count } => per_template = count,
            }
        }
        if fixed.is_empty() && per_template == 0 {
            return None;
        }
        Some(WarmPool {
            targets: Mutex::new(fixed_targets(&fixed)),
            fixed,
            per_template,
            ready: Mutex::new(Vec::new()),
            taken: Mutex::new((0, 0)),
            wake: tokio::sync::Notify::new(),
            closing: AtomicBool::new(false),
        })
    }

    /// A ready shell whose VMM still runs for a restore of `template`, `memory_mib` and a
    /// disk of `disk_bytes` over `base`: one kept for that template, else one of its size.
    pub fn take(
        &self,
        template: &str,
        memory_mib: u32,
        disk_bytes: u64,
        base: Option<&std::path::Path>,
    ) -> Option<Shell> {
        let taken = {
            let mut taken = lock(&self.taken);
            let mut ready = lock(&self.ready);
            let fits = |shell: &Shell| shell.shape.fits(memory_mib, disk_bytes, base);
            let position = ready
                .iter_mut()
                .rposition(|s| {
                    s.shape.template.as_deref() == Some(template) && fits(s) && s.alive()
                })
                .or_else(|| {
                    ready
                        .iter_mut()
                        .rposition(|s| s.shape.template.is_none() && fits(s) && s.alive())
                })?;
            let shell = ready.remove(position);
            count_taken(&mut taken, &shell, true);
            shell
        };
        self.wake.notify_one();
        Some(taken)
    }

    /// A shell taken but not used (its create was refused before its VMM got anything).
    pub fn put_back(&self, shell: Shell) {
        let mut taken = lock(&self.taken);
        count_taken(&mut taken, &shell, false);
        lock(&self.ready).push(shell);
    }

    /// Runs `insert` (the row of the sandbox `shell` was taken for) under the pool's
    /// accounting lock; when it made the row (`made`), the row counts from then on, not the
    /// shell.
    pub fn insert_for<T, E>(
        &self,
        shell: &Shell,
        insert: impl FnOnce() -> Result<T, E>,
        made: impl FnOnce(&T) -> bool,
    ) -> Result<T, E> {
        let mut taken = lock(&self.taken);
        let inserted = insert()?;
        if made(&inserted) {
            count_taken(&mut taken, shell, false);
        }
        Ok(inserted)
    }

    fn ready_of(&self, shape: &ShellShape) -> usize {
        lock(&self.ready)
            .iter()
            .filter(|shell| &shell.shape == shape)
            .count()
    }

    /// Each shape's target and ready shells.
    pub fn status(&self) -> Vec<WarmPoolShape> {
        lock(&self.targets)
            .iter()
            .map(|(shape, target)| WarmPoolShape {
                memory_mib: shape.memory_mib,
                template: shape.template.clone(),
                target: *target as u64,
                ready: self.ready_of(shape) as u64,
            })
            .collect()
    }

    fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Keeps every shape at its target until [`WarmPool::stop_refill`], within the node's
    /// room: `room(count, memory_mib)` says whether that many VMMs holding that much guest
    /// memory fit beside the live sandboxes (`--max-sandboxes`, `--memory-budget-mib`), and
    /// shells past it end. `new_id` names each shell's future sandbox, `templates` gives the
    /// shape of each template with a boot snapshot (asked on every pass when `templates=N`).
    pub async fn refill(
        self: Arc<Self>,
        supervisor: Arc<Supervisor>,
        new_id: impl Fn() -> String + Send + Sync,
        templates: impl Fn() -> Vec<ShellShape> + Send + Sync,
        room: impl Fn(u64, u64) -> bool + Send + Sync,
    ) {
        while !self.is_closing() {
            if self.per_template > 0 {
                self.retarget(templates());
            }
            for shell in self.remove_unwanted() {
                log::warn!(
                    "warm shell {} (pid {}, {} MiB{}) {}",
                    shell.id,
                    shell.pid(),
                    shell.shape.memory_mib,
                    shell
                        .shape
                        .template
                        .as_deref()
                        .map(|t| format!(", template {t}"))
                        .unwrap_or_default(),
                    if self.wanted(&shell.shape) {
                        "died; replacing it"
                    } else {
                        "is for a template gone or changed; ending it"
                    }
                );
                supervisor.discard_shell(shell).await;
            }
            for shell in self.remove_past(&room) {
                log::info!(
                    "warm shell {} ({} MiB) ended: beside the node's sandboxes it would pass --max-sandboxes or --memory-budget-mib",
                    shell.id,
                    shell.shape.memory_mib
                );
                supervisor.discard_shell(shell).await;
            }
            let mut failed = false;
            let targets = lock(&self.targets).clone();
            for (shape, target) in targets {
                while !self.is_closing() && self.ready_of(&shape) < target {
                    if !self.has_room_for(&room, shape.memory_mib) {
                        break;
                    }
                    match supervisor.start_shell(new_id(), shape.clone()).await {
                        Ok(shell) => lock(&self.ready).push(shell),
                        Err(e) => {
                            log::error!(
                                "warm pool: a {} MiB shell did not start: {e}",
                                shape.memory_mib
                            );
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

    /// The fixed shapes and one per template of `templates`.
    fn retarget(&self, templates: Vec<ShellShape>) {
        let mut targets = fixed_targets(&self.fixed);
        targets.extend(
            templates
                .into_iter()
                .map(|shape| (shape, self.per_template)),
        );
        *lock(&self.targets) = targets;
    }

    fn wanted(&self, shape: &ShellShape) -> bool {
        lock(&self.targets).iter().any(|(s, _)| s == shape)
    }

    /// The ready shells whose VMM ended, or whose shape no target has any more (a template
    /// deleted, or rebuilt with another memory size, disk or base), taken out of the pool.
    fn remove_unwanted(&self) -> Vec<Shell> {
        let targets = lock(&self.targets).clone();
        let mut ready = lock(&self.ready);
        let mut gone = Vec::new();
        let mut index = 0;
        while index < ready.len() {
            let shell = &mut ready[index];
            let wanted = targets.iter().any(|(shape, _)| *shape == shell.shape);
            if wanted && shell.alive() {
                index += 1;
            } else {
                gone.push(ready.remove(index));
            }
        }
        gone
    }

    /// The shells the pool holds (ready, and `taken` by creates whose row is not in yet)
    /// and the guest memory they are for; `taken` is the accounting lock's guard.
    fn held(&self, taken: &(u64, u64)) -> (u64, u64) {
        let ready = lock(&self.ready);
        let memory_mib: u64 = ready.iter().map(|s| u64::from(s.shape.memory_mib)).sum();
        (ready.len() as u64 + taken.0, memory_mib + taken.1)
    }

    /// Whether one more shell for `memory_mib` fits `room` beside what the pool holds.
    fn has_room_for(&self, room: &impl Fn(u64, u64) -> bool, memory_mib: u32) -> bool {
        let taken = lock(&self.taken);
        let (count, held_mib) = self.held(&taken);
        room(count + 1, held_mib + u64::from(memory_mib))
    }

    /// The newest ready shells that do not fit `room` beside the live sandboxes (sandboxes
    /// took their place), taken out of the pool.
    fn remove_past(&self, room: &impl Fn(u64, u64) -> bool) -> Vec<Shell> {
        let taken = lock(&self.taken);
        let mut gone = Vec::new();
        loop {
            let (count, memory_mib) = self.held(&taken);
            if count == 0 || room(count, memory_mib) {
                return gone;
            }
            match lock(&self.ready).pop() {
                Some(shell) => gone.push(shell),
                None => return gone,
            }
        }
    }

    /// Stops the refill: it ends once the shell it may be starting is in the pool.
    pub fn stop_refill(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Ends every ready shell (the daemon stops, its refill ended).
    pub async fn close(&self, supervisor: &Supervisor) {
        let all: Vec<Shell> = std::mem::take(&mut *lock(&self.ready));
        for shell in all {
            supervisor.discard_shell(shell).await;
        }
    }
}

/// Counts `shell` into (`taken`) or out of the shells taken by creates not yet admitted.
fn count_taken(taken: &mut (u64, u64), shell: &Shell, into: bool) {
    let memory_mib = u64::from(shell.shape.memory_mib);
    *taken = if into {
        (taken.0 + 1, taken.1 + memory_mib)
    } else {
        (
            taken.0.saturating_sub(1),
            taken.1.saturating_sub(memory_mib),
        )
    };
}

/// The `MIB=N` targets.
fn fixed_targets(fixed: &BTreeMap<u32, usize>) -> Vec<(ShellShape, usize)> {
    fixed
        .iter()
        .map(|(&memory_mib, &count)| (memory_shape(memory_mib), count))
        .collect()
}

/// The shape of `MIB=N`'s shells: any restore of that size with no shared base and a disk
/// no larger than its memory; their empty VMs have one vCPU (a snapshot with more loads
/// without it).
fn memory_shape(memory_mib: u32) -> ShellShape {
    ShellShape {
        memory_mib,
        vcpus: 1,
        disk_bytes: u64::from(memory_mib) << 20,
        base: None,
        template: None,
    }
}

/// Shells kept for each template with a boot snapshot when `rollbox serve` is given no
/// `--warm-pool templates=N` (and no `--no-warm-pool`).
pub const DEFAULT_PER_TEMPLATE: usize = 2;

/// `rollbox serve`'s pool: none with `--no-warm-pool`, else `given` with
/// [`DEFAULT_PER_TEMPLATE`] shells per boot-snapshot template unless `given` says
/// `templates=N` itself.
pub fn with_default(given: Vec<PoolSpec>, off: bool) -> Vec<PoolSpec> {
    if off {
        return Vec::new();
    }
    let mut specs = given;
    if !specs
        .iter()
        .any(|s| matches!(s, PoolSpec::Templates { .. }))
    {
        specs.push(PoolSpec::Templates {
            count: DEFAULT_PER_TEMPLATE,
        });
    }
    specs
}

/// Parses one `--warm-pool` value: `MIB=N` (N shells for guests of MIB MiB) or `templates=N`
/// (N for each template with a boot snapshot; 0 for none).
pub fn parse_shape(value: &str) -> Result<PoolSpec, String> {
    let refuse = || {
        format!(
            "--warm-pool {value:?}: expected MIB=N (e.g. 256=8: 8 shells for 256 MiB guests) or templates=N (N for each template with a boot snapshot)"
        )
    };
    let (what, count) = value.split_once('=').ok_or_else(refuse)?;
    let count: usize = count.trim().parse().map_err(|_| refuse())?;
    if what.trim() == "templates" {
        if count > 256 {
            return Err(format!("--warm-pool {value:?}: the count must be 0 to 256"));
        }
        return Ok(PoolSpec::Templates { count });
    }
    if count == 0 || count > 256 {
        return Err(format!("--warm-pool {value:?}: the count must be 1 to 256"));
    }
    let memory_mib: u32 = what.trim().parse().map_err(|_| refuse())?;
    if memory_mib == 0 {
        return Err(format!("--warm-pool {value:?}: memory must be above 0 MiB"));
    }
    Ok(PoolSpec::Memory { memory_mib, count })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_name_the_flag() {
        assert_eq!(
            parse_shape("256=8"),
            Ok(PoolSpec::Memory {
                memory_mib: 256,
                count: 8
            })
        );
        assert_eq!(
            parse_shape(" 32 = 2 "),
            Ok(PoolSpec::Memory {
                memory_mib: 32,
                count: 2
            })
        );
        assert_eq!(
            parse_shape("templates=4"),
            Ok(PoolSpec::Templates { count: 4 })
        );
        for bad in [
            "256",
            "x=1",
            "256=y",
            "0=1",
            "256=0",
            "256=1000",
            "=",
            "",
            "templates=257",
        ] {
            let e = parse_shape(bad).unwrap_err();
            assert!(e.contains("--warm-pool"), "{bad}: {e}");
        }
        assert_eq!(
            parse_shape("templates=0"),
            Ok(PoolSpec::Templates { count: 0 })
        );
    }

    #[test]
    fn templates_get_shells_unless_told_otherwise() {
        let default = PoolSpec::Templates {
            count: DEFAULT_PER_TEMPLATE,
        };
        let sized = PoolSpec::Memory {
            memory_mib: 256,
            count: 8,
        };
        assert_eq!(with_default(Vec::new(), false), vec![default]);
        assert_eq!(with_default(vec![sized], false), vec![sized, default]);
        let none = PoolSpec::Templates { count: 0 };
        assert_eq!(with_default(vec![none], false), vec![none]);
        assert!(WarmPool::new(&with_default(vec![none], false)).is_none());
        assert_eq!(with_default(vec![sized], true), Vec::new());
    }

    #[test]
    fn a_shape_fits_its_memory_base_and_disks_up_to_its_own() {
        let base = std::path::PathBuf::from("/state/images/base.ext4");
        let shape = ShellShape {
            memory_mib: 256,
            vcpus: 2,
            disk_bytes: 1 << 30,
            base: Some(base.clone()),
            template: Some("python".into()),
        };
        assert!(shape.fits(256, 1 << 30, Some(&base)));
        assert!(shape.fits(256, 0, Some(&base)));
        assert!(
            !shape.fits(512, 1 << 30, Some(&base)),
            "another memory size"
        );
        assert!(
            !shape.fits(256, (1 << 30) + 1, Some(&base)),
            "a larger disk"
        );
        assert!(!shape.fits(256, 1 << 30, None), "no base");
        let plain = memory_shape(32);
        assert!(plain.fits(32, 0, None));
        assert!(plain.fits(32, 32 << 20, None));
        assert!(
            !plain.fits(32, (32 << 20) + 1, None),
            "a disk larger than the memory"
        );
    }
}
