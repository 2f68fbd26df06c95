//! Where virtiofsd is: the one search both rollbox-vmm (a virtiofsd per volume it serves) and
//! the daemon (a virtiofsd per sandbox and volume) use.

use std::path::{Path, PathBuf};

/// The version `scripts/virtiofsd.sh` installs by default, and its cache.
pub const CACHED_VIRTIOFSD: &str = "/var/cache/rollbox/virtiofsd/1.14.0/bin/virtiofsd";
/// The environment variable naming the virtiofsd binary.
pub const VIRTIOFSD_ENV: &str = "ROLLBOX_VIRTIOFSD";

/// No virtiofsd where it was looked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocateError {
    /// The binary `--virtiofsd` names is not a file.
    #[error("--virtiofsd {0} does not exist")]
    Explicit(PathBuf),
    /// The binary `$ROLLBOX_VIRTIOFSD` names is not a file.
    #[error("{VIRTIOFSD_ENV}={0} does not exist")]
    Env(PathBuf),
    /// None in any place searched.
    #[error("no virtiofsd: not in --virtiofsd, {VIRTIOFSD_ENV}, PATH, /usr/libexec or {CACHED_VIRTIOFSD}")]
    NotFound,
}

/// Finds virtiofsd: `explicit` (`--virtiofsd`), then `$ROLLBOX_VIRTIOFSD`, then `virtiofsd`
/// on PATH, then Debian's `/usr/libexec/virtiofsd`, then the cache of `scripts/virtiofsd.sh`.
pub fn locate(explicit: Option<&Path>) -> Result<PathBuf, LocateError> {
    if let Some(path) = explicit {
        return path
            .is_file()
            .then(|| path.to_path_buf())
            .ok_or_else(|| LocateError::Explicit(path.to_path_buf()));
    }
    if let Some(path) = std::env::var_os(VIRTIOFSD_ENV).map(PathBuf::from) {
        return if path.is_file() {
            Ok(path)
        } else {
            Err(LocateError::Env(path))
        };
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("virtiofsd"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([
            PathBuf::from("/usr/libexec/virtiofsd"),
            PathBuf::from(CACHED_VIRTIOFSD),
        ])
        .find(|p| p.is_file())
        .ok_or(LocateError::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_binary_must_exist() {
        let e = locate(Some(Path::new("/nonexistent/virtiofsd"))).expect_err("missing");
        assert_eq!(
            e.to_string(),
            "--virtiofsd /nonexistent/virtiofsd does not exist"
        );
        let here = tempfile::NamedTempFile::new().expect("a file");
        assert_eq!(locate(Some(here.path())), Ok(here.path().to_path_buf()));
    }
}
