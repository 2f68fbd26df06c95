//! State shared by all connections of one agent process.

use std::path::PathBuf;

use crate::cgroup::CgroupBase;
use crate::generation::Watcher;

#[derive(Debug, Clone)]
pub struct Config {
    /// Apply SetTime (off in host-mode tests, which must not move the host clock).
    pub set_clock: bool,
    /// Where SetIdentity writes the machine id.
    pub machine_id_path: PathBuf,
    /// Where users and groups are looked up (passwd, group).
    pub etc_dir: PathBuf,
    /// dockerd's API socket.
    pub docker_socket: PathBuf,
    /// Where a dockerd started by the agent logs.
    pub dockerd_log: PathBuf,
    /// The agent does init duties (PID 1).
    pub is_init: bool,
}

#[derive(Debug)]
pub struct Agent {
    pub config: Config,
    pub cgroups: Option<CgroupBase>,
    /// Serialises DockerEnsure so only one dockerd is started.
    pub docker_lock: tokio::sync::Mutex<()>,
    /// Re-identifies the guest after a clone; None when the counter is not watched.
    pub generation: Option<Watcher>,
}

impl Agent {
    pub fn new(config: Config, generation: Option<Watcher>) -> Self {
        let cgroups = match crate::cgroup::detect() {
            Ok(base) => {
                log::info!(
                    "per-exec cgroups under {} ({:?})",
                    base.dir.display(),
                    base.version
                );
                Some(base)
            }
            Err(reason) => {
                log::info!("no per-exec cgroups: {reason}");
                None
            }
        };
        Self {
            config,
            cgroups,
            docker_lock: tokio::sync::Mutex::new(()),
            generation,
        }
    }
}
