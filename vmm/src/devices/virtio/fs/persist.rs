//! Snapshot state of a virtio-fs volume: its configuration, the virtiofsd that served it, and
//! virtiofsd's own state (inodes and open files the guest holds), which the backend hands over
//! through vhost-user device-state transfer. The blob lives inside the CRC-checked state file.
//! A restore starts a virtiofsd of its own for the volume (on the directory `fs_overrides`
//! names, if any), or connects to one the caller started (`fs_sockets`), and hands it the blob.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use snapshot::Persist;
use vmm_api::FsConfig;

use super::{Fs, FsError};

/// Why a volume cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum FsRestoreError {
    /// The saved volume does not fit this host (no backend state, no shared directory).
    #[error("{0}")]
    Volume(String),
    /// Its virtiofsd could not be started or reached.
    #[error(transparent)]
    Start(FsError),
    /// virtiofsd refused the saved state.
    #[error(transparent)]
    Load(FsError),
}

/// What a snapshot records for one volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsPersistState {
    /// Tag, shared directory and options as the VM had them (`socket` is not reused: a
    /// restore starts a virtiofsd of its own, or connects to the one `fs_sockets` names).
    pub config: FsConfig,
    /// The virtiofsd binary that served it, tried on restore when none is named.
    #[serde(default)]
    pub virtiofsd: Option<PathBuf>,
    /// virtiofsd's serialized state (SET_DEVICE_STATE_FD, direction save); empty when the
    /// device state was not saved.
    #[serde(default)]
    pub backend_state: Vec<u8>,
}

impl FsPersistState {
    /// The state for a restore: checks there is a backend state and applies an override of
    /// the shared directory (`fs_overrides`, `--fs-override`), or the socket of a virtiofsd
    /// the caller started (`fs_sockets`, `--fs-socket`), whose shared directory is its own and
    /// is not checked (a jailed VMM may not see it).
    pub fn for_restore(
        &self,
        shared_dir: Option<&PathBuf>,
        socket: Option<&PathBuf>,
    ) -> Result<FsConfig, String> {
        let tag = &self.config.tag;
        if self.backend_state.is_empty() {
            return Err(format!(
                "volume {tag}: the snapshot holds no virtiofsd state (it was not saved through vhost-user device-state transfer), so open files and lookups in the guest could not be restored"
            ));
        }
        let mut config = self.config.clone();
        if let Some(socket) = socket {
            if shared_dir.is_some() {
                return Err(fs_socket_and_override(tag));
            }
            config.socket = Some(socket.clone());
            return Ok(config);
        }
        config.socket = None;
        if let Some(dir) = shared_dir {
            config.shared_dir = dir.clone();
        }
        if !config.shared_dir.is_dir() {
            return Err(format!(
                "volume {}: shared directory {} is not a directory (give another with fs_overrides or --fs-override {}=DIR)",
                config.tag,
                config.shared_dir.display(),
                config.tag
            ));
        }
        Ok(config)
    }
}

/// Why a volume cannot take both a directory override and a socket: the directory is then the
/// socket's virtiofsd's.
pub fn fs_socket_and_override(tag: &str) -> String {
    format!(
        "volume {tag}: fs_sockets and fs_overrides both name it; the shared directory is the one the virtiofsd on the socket serves, so give one"
    )
}

/// What a restore chooses for a volume.
#[derive(Debug, Clone, Default)]
pub struct FsRestoreArgs {
    /// A number no other device of the VM has (it names virtiofsd's directory).
    pub index: usize,
    /// Another shared directory (`fs_overrides`), else the recorded one.
    pub shared_dir: Option<PathBuf>,
    /// The vhost-user socket of a virtiofsd the caller started (`fs_sockets`): no virtiofsd
    /// is started, and the saved state is loaded into that one.
    pub socket: Option<PathBuf>,
    /// The virtiofsd binary named now (`--virtiofsd`), else the one that served the VM if it
    /// is still there, then the usual search.
    pub virtiofsd: Option<PathBuf>,
}

impl Persist for Fs {
    type State = FsPersistState;
    type ConstructorArgs = FsRestoreArgs;
    type Error = FsRestoreError;

    /// The volume with the backend state of the last [`crate::devices::virtio::VirtioDevice::save_backend`].
    fn save(&self) -> Result<FsPersistState, FsRestoreError> {
        Ok(FsPersistState {
            config: self.config.clone(),
            virtiofsd: self.daemon.as_ref().map(|d| d.binary().to_path_buf()),
            backend_state: self.backend_state.clone(),
        })
    }

    fn restore(args: FsRestoreArgs, state: &FsPersistState) -> Result<Self, FsRestoreError> {
        let config = state
            .for_restore(args.shared_dir.as_ref(), args.socket.as_ref())
            .map_err(FsRestoreError::Volume)?;
        let binary = args
            .virtiofsd
            .or_else(|| state.virtiofsd.clone().filter(|p| p.is_file()));
        let mut device = Fs::start_volume(binary.as_deref(), args.index, &config)
            .map_err(FsRestoreError::Start)?;
        device
            .load_state(&state.backend_state)
            .map_err(FsRestoreError::Load)?;
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_api::FsCache;

    fn state(dir: &std::path::Path, blob: Vec<u8>) -> FsPersistState {
        FsPersistState {
            config: FsConfig {
                tag: "data".into(),
                shared_dir: dir.to_path_buf(),
                readonly: false,
                cache: FsCache::Auto,
                socket: Some(PathBuf::from("/run/old.sock")),
            },
            virtiofsd: None,
            backend_state: blob,
        }
    }

    #[test]
    fn a_missing_backend_state_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = state(dir.path(), Vec::new())
            .for_restore(None, None)
            .expect_err("no blob");
        assert!(
            err.contains("volume data") && err.contains("no virtiofsd state"),
            "{err}"
        );
    }

    #[test]
    fn overrides_replace_the_directory_and_drop_the_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let other = tempfile::tempdir().expect("tempdir");
        let config = state(dir.path(), vec![1])
            .for_restore(Some(&other.path().to_path_buf()), None)
            .expect("restore config");
        assert_eq!(config.shared_dir, other.path());
        assert_eq!(config.socket, None);
        let gone = dir.path().join("gone");
        let err = state(&gone, vec![1])
            .for_restore(None, None)
            .expect_err("absent");
        assert!(err.contains("--fs-override data=DIR"), "{err}");
    }

    #[test]
    fn a_socket_connects_to_the_callers_virtiofsd_without_a_directory_check() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("fs.sock");
        // The recorded directory is not visible here (a jailed VMM): not checked.
        let unseen = dir.path().join("unseen");
        let saved = FsPersistState {
            config: FsConfig {
                readonly: true,
                cache: FsCache::Never,
                ..state(&unseen, vec![1]).config
            },
            ..state(&unseen, vec![1])
        };
        let config = saved
            .for_restore(None, Some(&socket))
            .expect("restore config");
        assert_eq!(config.socket, Some(socket.clone()));
        assert_eq!(config.shared_dir, unseen);
        assert_eq!((config.readonly, config.cache), (true, FsCache::Never));
        let err = saved
            .for_restore(Some(&dir.path().to_path_buf()), Some(&socket))
            .expect_err("both");
        assert!(
            err.contains("volume data") && err.contains("fs_sockets and fs_overrides"),
            "{err}"
        );
        let err = state(&unseen, Vec::new())
            .for_restore(None, Some(&socket))
            .expect_err("no blob");
        assert!(err.contains("no virtiofsd state"), "{err}");
    }

    #[test]
    fn the_state_survives_the_state_file_encoding() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vmstate");
        let saved = state(dir.path(), (0..=255).collect());
        snapshot::format::write_state_file(&path, &saved).expect("write");
        let back: FsPersistState = snapshot::format::read_state_file(&path).expect("read");
        assert_eq!(back, saved);
    }
}
