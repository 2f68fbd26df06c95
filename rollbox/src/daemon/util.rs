//! Small helpers the services share: the clock, random ids, removing a directory, and the two
//! lookups most actions start with.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use super::api::{ApiError, Reply, Sandbox};
use super::store::Db;
use crate::images::digest::to_hex;

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// 16 random hex digits from the kernel.
pub fn random_hex() -> String {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if usize::try_from(n).ok() != Some(bytes.len()) {
        // Not reached on Linux >= 3.17; the time and pid still make a unique-enough id.
        bytes = (now_ms() ^ (u64::from(std::process::id()) << 40)).to_le_bytes();
    }
    to_hex(&bytes)
}

/// Removes a directory and what it holds; one that is not there is fine.
pub fn remove_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

pub fn ms_since(start: std::time::Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}

/// A failure of the daemon's own (a 500 with its text).
pub fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal(e.to_string())
}

/// Records an API call on the sandbox and returns it.
pub fn touch(db: &Db, id: &str) -> Result<Sandbox, ApiError> {
    let store = db.lock();
    store.touch(id, now_ms()).map_err(internal)?;
    store
        .sandbox(id)
        .map_err(internal)?
        .ok_or_else(|| ApiError::NotFound(format!("no sandbox {id}")))
}

/// The sandbox as an answer (200).
pub fn sandbox_reply(db: &Db, id: &str) -> Result<Reply, ApiError> {
    match db.lock().sandbox(id).map_err(internal)? {
        Some(sandbox) => Ok(Reply::Sandbox {
            created: false,
            sandbox,
        }),
        None => Err(ApiError::NotFound(format!("no sandbox {id}"))),
    }
}
