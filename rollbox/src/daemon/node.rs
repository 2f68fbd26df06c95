//! This daemon as one node of a fleet: its id, what `GET /node` reports, admission against
//! `--max-sandboxes` and `--memory-budget-mib` (429 naming the limit), and drain (503 for new
//! sandboxes until undrained; with a deadline, the core ends what is left then). The probes
//! `/livez` and `/readyz` read [`Node::ready`].

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sha2::{Digest, Sha256};

use super::api::{
    ApiError, CpuFingerprint, NodeInfo, NodeMemory, NodeSlots, NodeStatus, NodeTemplate, State,
    MAX_NODE_ID,
};
use super::store::Db;
use super::util::{internal, now_ms, random_hex};
use crate::images::digest::to_hex;

/// The file in the state directory that keeps a made-up node id across restarts.
const NODE_ID_FILE: &str = "node-id";

/// Why the node could not be set up; each names its input.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("--node-id {0:?}: want 1 to 24 of a-z 0-9 -, starting with a letter or digit (it ends every sandbox id)")]
    BadId(String),
    #[error("{path}: {source}")]
    IdFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// `rollbox serve`'s node flags.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    /// `--node-id`; None: made once and kept in the state directory.
    pub node_id: Option<String>,
    /// `--max-sandboxes`: live sandboxes (creating, running, paused) at most.
    pub max_sandboxes: Option<u64>,
    /// `--memory-budget-mib`: guest memory of the live sandboxes at most.
    pub memory_budget_mib: Option<u64>,
}

/// A drain in progress.
#[derive(Debug, Clone, Copy)]
struct Drain {
    deadline_ms: Option<u64>,
    /// Tells a drain from the one before it, for the deadline task.
    generation: u64,
}

/// The node.
pub struct Node {
    db: Arc<Db>,
    id: String,
    max_sandboxes: Option<u64>,
    memory_budget_mib: Option<u64>,
    cpu: CpuFingerprint,
    /// Held from an admission check to the sandbox's insert, so two creates cannot both take
    /// the last slot.
    admission: Mutex<()>,
    drain: Mutex<(Option<Drain>, u64)>,
}

fn check_node_id(id: &str) -> Result<String, NodeError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_NODE_ID
        && id
            .bytes()
            .enumerate()
            .all(|(i, b)| b.is_ascii_lowercase() || b.is_ascii_digit() || (i > 0 && b == b'-'));
    ok.then(|| id.to_string())
        .ok_or_else(|| NodeError::BadId(id.to_string()))
}

/// The node id: `--node-id`, else the one kept in `state_dir`, else a new one kept there.
fn node_id(given: Option<&str>, state_dir: &Path) -> Result<String, NodeError> {
    if let Some(id) = given {
        return check_node_id(id);
    }
    let path = state_dir.join(NODE_ID_FILE);
    let io = |source| NodeError::IdFile {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => check_node_id(text.trim()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Short: it ends every sandbox id made here (socket paths, host labels).
            let id = format!("node-{}", &random_hex()[..8]);
            std::fs::write(&path, format!("{id}\n")).map_err(io)?;
            Ok(id)
        }
        Err(e) => Err(io(e)),
    }
}

/// The CPUID leaves a restore depends on, hashed (x86-64: vendor, signature, the feature
/// leaves and the xsave layout).
pub fn cpu_fingerprint() -> CpuFingerprint {
    use core::arch::x86_64::{__cpuid, __cpuid_count};
    let leaf0 = __cpuid(0);
    let mut vendor = Vec::with_capacity(12);
    for word in [leaf0.ebx, leaf0.edx, leaf0.ecx] {
        vendor.extend_from_slice(&word.to_le_bytes());
    }
    let vendor = String::from_utf8_lossy(&vendor).into_owned();
    let max_leaf = leaf0.eax;
    let max_ext = __cpuid(0x8000_0000).eax;
    let signature = __cpuid(1).eax;
    let base_family = (signature >> 8) & 0xf;
    let family = if base_family == 0xf {
        base_family + ((signature >> 20) & 0xff)
    } else {
        base_family
    };
    let model = if base_family == 0x6 || base_family == 0xf {
        ((signature >> 4) & 0xf) | (((signature >> 16) & 0xf) << 4)
    } else {
        (signature >> 4) & 0xf
    };
    let mut hash = Sha256::new();
    hash.update(vendor.as_bytes());
    // Leaf 1's ebx holds the APIC id of the CPU this runs on: only its eax, ecx and edx count.
    let one = __cpuid(1);
    let mut words = vec![one.eax, one.ecx, one.edx];
    for (leaf, sub, max) in [
        (7, 0, max_leaf),
        (0xd, 0, max_leaf),
        (0xd, 1, max_leaf),
        (0x8000_0001, 0, max_ext),
    ] {
        if leaf <= max {
            let r = __cpuid_count(leaf, sub);
            words.extend([r.eax, r.ebx, r.ecx, r.edx]);
        }
    }
    for word in words {
        hash.update(word.to_le_bytes());
    }
    let digest = hash.finalize();
    let id = to_hex(&digest[..8]);
    CpuFingerprint {
        vendor,
        family,
        model,
        stepping: signature & 0xf,
        id,
    }
}

/// The host's `MemAvailable` in MiB (0 when /proc/meminfo says nothing).
fn host_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("MemAvailable:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        })
        .map_or(0, |kib| kib / 1024)
}

impl Node {
    pub fn new(db: Arc<Db>, options: &NodeOptions, state_dir: &Path) -> Result<Node, NodeError> {
        Ok(Node {
            db,
            id: node_id(options.node_id.as_deref(), state_dir)?,
            max_sandboxes: options.max_sandboxes,
            memory_budget_mib: options.memory_budget_mib,
            cpu: cpu_fingerprint(),
            admission: Mutex::new(()),
            drain: Mutex::new((None, 0)),
        })
    }

    fn drain_state(&self) -> MutexGuard<'_, (Option<Drain>, u64)> {
        self.drain.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The node id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The id of a sandbox made here from 16 random hex digits: `sb-HEX-NODE`, so that a
    /// client holding many nodes routes by id alone.
    pub fn sandbox_id(&self, hex: &str) -> String {
        format!("sb-{hex}-{}", self.id)
    }

    /// This host's CPU fingerprint.
    pub fn cpu(&self) -> &CpuFingerprint {
        &self.cpu
    }

    /// Whether the node takes new sandboxes (`/readyz`).
    pub fn ready(&self) -> bool {
        self.drain_state().0.is_none()
    }

    fn refuse_if_draining(&self) -> Result<(), ApiError> {
        match self.drain_state().0 {
            None => Ok(()),
            Some(_) => Err(ApiError::Unavailable(format!(
                "draining: node {} takes no new sandboxes (DELETE /node/drain undoes it)",
                self.id
            ))),
        }
    }

    /// Refuses `count` more sandboxes of `memory_mib` each when they do not fit now: the
    /// up-front check of a batch or a fork (each create is checked again as it is inserted).
    pub fn check_room(&self, count: u64, memory_mib: u64) -> Result<(), ApiError> {
        self.refuse_if_draining()?;
        self.fits(count, memory_mib.saturating_mul(count))
    }

    /// Whether `count` more sandboxes holding `memory_mib` in all fit the limits (the store is
    /// read only when there is a limit).
    fn fits(&self, count: u64, memory_mib: u64) -> Result<(), ApiError> {
        if self.max_sandboxes.is_none() && self.memory_budget_mib.is_none() {
            return Ok(());
        }
        let (used, committed) = self.db.lock().live_totals().map_err(internal)?;
        if let Some(max) = self.max_sandboxes {
            if used.saturating_add(count) > max {
                return Err(ApiError::Full {
                    limit: "max_sandboxes",
                    message: format!(
                        "max_sandboxes: node {} has {used} of its {max} sandboxes (--max-sandboxes); {count} more do not fit, retry later",
                        self.id
                    ),
                });
            }
        }
        if let Some(budget) = self.memory_budget_mib {
            if committed.saturating_add(memory_mib) > budget {
                return Err(ApiError::Full {
                    limit: "memory_budget_mib",
                    message: format!(
                        "memory_budget_mib: node {} holds {committed} of its {budget} MiB of guest memory (--memory-budget-mib); {memory_mib} MiB more do not fit, retry later",
                        self.id
                    ),
                });
            }
        }
        Ok(())
    }

    /// Whether `count` more VMMs holding `memory_mib` in all fit beside the live sandboxes (the
    /// warm pool's room: its shells count against the limits, and never refuse a create).
    pub fn has_room_for(&self, count: u64, memory_mib: u64) -> bool {
        self.fits(count, memory_mib).is_ok()
    }

    /// Runs `insert` (one sandbox's row) only if a sandbox of `memory_mib` fits, with no other
    /// admission in between.
    pub fn admit<T>(
        &self,
        memory_mib: u64,
        insert: impl FnOnce() -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let _one_at_a_time = self
            .admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.refuse_if_draining()?;
        self.fits(1, memory_mib)?;
        insert()
    }

    /// Starts (or changes) a drain; answers its generation, which [`Node::drain_expired`]
    /// takes at the deadline.
    pub fn start_drain(&self, deadline_s: Option<u64>) -> u64 {
        let mut state = self.drain_state();
        state.1 += 1;
        let generation = state.1;
        state.0 = Some(Drain {
            deadline_ms: deadline_s.map(|s| now_ms().saturating_add(s.saturating_mul(1000))),
            generation,
        });
        log::info!(
            "node {}: draining{}",
            self.id,
            deadline_s.map_or(String::new(), |s| format!(", what is left ends in {s} s"))
        );
        generation
    }

    /// Ends the drain.
    pub fn undrain(&self) {
        let mut state = self.drain_state();
        if state.0.take().is_some() {
            log::info!("node {}: ready again", self.id);
        }
    }

    /// Whether the drain of `generation` is still on (its deadline's task then ends what is
    /// left).
    pub fn drain_expired(&self, generation: u64) -> bool {
        self.drain_state()
            .0
            .is_some_and(|d| d.generation == generation)
    }

    /// GET /node.
    pub fn info(&self) -> Result<NodeInfo, ApiError> {
        let (status, drain_deadline_ms) = match self.drain_state().0 {
            None => (NodeStatus::Ready, None),
            Some(d) => (NodeStatus::Draining, d.deadline_ms),
        };
        let store = self.db.lock();
        let (used, committed) = store.live_totals().map_err(internal)?;
        let pending = store
            .state_counts()
            .map_err(internal)?
            .into_iter()
            .find_map(|(state, n)| (state == State::Creating).then_some(n))
            .unwrap_or(0);
        let templates = store
            .templates()
            .map_err(internal)?
            .into_iter()
            .map(|t| NodeTemplate {
                name: t.name,
                image: t.image,
                boot_snapshot: t.boot_snapshot.is_some(),
            })
            .collect();
        let snapshots = store
            .snapshots(None)
            .map_err(internal)?
            .into_iter()
            .map(|s| s.id)
            .collect();
        Ok(NodeInfo {
            node_id: self.id.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            status,
            drain_deadline_ms,
            slots: NodeSlots {
                total: self.max_sandboxes,
                used,
                pending,
            },
            memory_mib: NodeMemory {
                budget: self.memory_budget_mib,
                committed,
                host_available: host_available_mib(),
            },
            cpu: self.cpu.clone(),
            templates,
            snapshots,
            warm_pool: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_checked_made_once_and_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(node_id(Some("gpu-7"), dir.path()).expect("given"), "gpu-7");
        for bad in ["", "-a", "A", "a_b", &"a".repeat(64)] {
            assert!(node_id(Some(bad), dir.path()).is_err(), "{bad:?}");
        }
        let made = node_id(None, dir.path()).expect("made");
        assert!(made.starts_with("node-"), "{made}");
        assert_eq!(node_id(None, dir.path()).expect("kept"), made);
        std::fs::write(dir.path().join(NODE_ID_FILE), "Bad Id\n").expect("write");
        assert!(node_id(None, dir.path()).is_err());
    }

    #[test]
    fn the_cpu_fingerprint_is_stable_and_names_the_vendor() {
        let a = cpu_fingerprint();
        assert_eq!(a, cpu_fingerprint());
        assert!(!a.vendor.is_empty() && a.id.len() == 16, "{a:?}");
    }
}
