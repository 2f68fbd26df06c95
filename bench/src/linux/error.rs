//! What stops a Linux-guest benchmark (never a slow figure): one error enum for `linux`,
//! `linux-net` and `linux-fs`, and the I/O error that names its path.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors that stop the benchmark (never a slow figure).
#[derive(Debug, thiserror::Error)]
pub enum LinuxBenchError {
    #[error("{what} not found at {path} ({hint})")]
    Missing {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("reading fixtures file {path}: {source}")]
    Fixtures {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fixtures file {path} has no {key}= line (scripts/lab/tier4-fixtures.sh writes it)")]
    FixtureKey { path: PathBuf, key: &'static str },
    #[error("no {what}: pass {flag} or --fixtures FILE")]
    NoPath {
        what: &'static str,
        flag: &'static str,
    },
    #[error("{0}")]
    Host(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    #[error("{vm}: {what} did not come within {timeout:?}; last console lines:\n{console}\nstderr: {stderr}")]
    Timeout {
        vm: String,
        what: String,
        timeout: Duration,
        console: String,
        stderr: String,
    },
    #[error("{vm} exited ({status}) while waiting for {what}; last console lines:\n{console}\nstderr: {stderr}")]
    Exited {
        vm: String,
        what: String,
        status: String,
        console: String,
        stderr: String,
    },
    #[error("{vm}: the console never showed {what} before the agent answered")]
    NoMilestone { vm: String, what: &'static str },
    /// An API call failed (the error names the socket and the call).
    #[error(transparent)]
    Api(#[from] vmm_api::ClientError),
    #[error("{what}: no samples")]
    NoSamples { what: &'static str },
    #[error("{vm}: guest command `{script}`: {detail}")]
    Guest {
        vm: String,
        script: String,
        detail: String,
    },
    #[error("host command `{command}`: {detail}")]
    HostCommand { command: String, detail: String },
    #[error("interrupted by a signal; every VMM stopped")]
    Interrupted,
}

pub(crate) fn io_err(
    what: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> LinuxBenchError {
    let path = path.to_path_buf();
    move |source| LinuxBenchError::Io { what, path, source }
}
