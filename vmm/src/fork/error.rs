//! The errors of a fork as a whole, and how the API answers them.

use std::path::PathBuf;

use crate::api::ActionError;

/// Errors of a fork as a whole (a failing clone is reported in its
/// [`CloneInfo`](crate::api::CloneInfo) instead).
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// The fork directory could not be created.
    #[error("fork directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// An unknown memory backend for the clones.
    #[error("restore_backend {name:?}: {reason}")]
    Backend {
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: String,
    },
    /// Network overrides that do not give every clone its own taps.
    #[error("network_overrides: {0}")]
    NetworkOverrides(String),
    /// The parent's snapshot failed.
    #[error("fork snapshot into {path}: {reason}")]
    Snapshot {
        /// The snapshot directory.
        path: PathBuf,
        /// The failure.
        reason: String,
    },
    /// A microVM that cannot be forked (a PCI bus whose state is not saved).
    #[error("fork: {0}")]
    Refused(String),
    /// A pool larger than [`MAX_POOL`](super::MAX_POOL).
    #[error("a fork pool of {shells} shells is too large: at most {max}")]
    PoolTooLarge {
        /// The size asked for.
        shells: usize,
        /// The largest pool.
        max: usize,
    },
    /// The launcher thread could not start.
    #[error("cannot start the fork launcher thread: {0}")]
    Launcher(std::io::Error),
}

impl From<ForkError> for ActionError {
    fn from(e: ForkError) -> Self {
        ActionError::bad_request(e.to_string())
    }
}
