//! What the fs device needs of a volume's configuration: a tag that fits its config space and
//! the guest's `mount -t virtiofs TAG` line, and either a shared directory (rollbox-vmm starts
//! virtiofsd on it) or, when the caller started virtiofsd (`socket`), that socket and no
//! virtiofsd options. The shared directory of a socket's volume is that virtiofsd's: it may not
//! be visible to rollbox-vmm at all (a jailed VMM), so it is not checked then.

use std::path::PathBuf;

use vmm_api::{FsCache, FsConfig};

use super::device::TAG_LEN;

/// A volume configuration the fs device cannot serve; each names the tag.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VolumeError {
    /// An empty or oversized tag, or one with characters a mount line cannot carry.
    #[error("virtio-fs tag {0:?} is invalid: use 1-{TAG_LEN} bytes, without ',', ':', '=' or whitespace")]
    Tag(String),
    /// The shared directory is missing or not a directory.
    #[error("volume {tag}: shared directory {path}: {detail}")]
    SharedDir {
        /// The tag.
        tag: String,
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// The caller's vhost-user socket does not exist.
    #[error("volume {tag}: socket {path} does not exist")]
    Socket {
        /// The tag.
        tag: String,
        /// The socket path.
        path: PathBuf,
    },
    /// virtiofsd options (readonly, cache) given with a socket: they belong to that virtiofsd.
    #[error("volume {0}: readonly and cache are options of the virtiofsd on its socket")]
    SocketOptions(String),
}

/// Checks the tag of `config`, then its socket when it has one, else its shared directory.
pub fn check_volume(config: &FsConfig) -> Result<(), VolumeError> {
    let tag = &config.tag;
    let tag_ok = !tag.is_empty()
        && tag.len() <= TAG_LEN
        && !tag
            .chars()
            .any(|c| c == ',' || c == ':' || c == '=' || c.is_whitespace() || c.is_control());
    if !tag_ok {
        return Err(VolumeError::Tag(tag.clone()));
    }
    if let Some(socket) = &config.socket {
        if config.readonly || config.cache != FsCache::Auto {
            return Err(VolumeError::SocketOptions(tag.clone()));
        }
        if !socket.exists() {
            return Err(VolumeError::Socket {
                tag: tag.clone(),
                path: socket.clone(),
            });
        }
        return Ok(());
    }
    let dir_err = |detail: String| VolumeError::SharedDir {
        tag: tag.clone(),
        path: config.shared_dir.clone(),
        detail,
    };
    let meta = std::fs::metadata(&config.shared_dir).map_err(|e| dir_err(e.to_string()))?;
    if !meta.is_dir() {
        return Err(dir_err("not a directory".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(dir: &std::path::Path, socket: Option<PathBuf>) -> FsConfig {
        FsConfig {
            tag: "data".into(),
            shared_dir: dir.to_path_buf(),
            readonly: false,
            cache: FsCache::Auto,
            socket,
        }
    }

    #[test]
    fn without_a_socket_the_shared_directory_must_be_a_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(check_volume(&volume(dir.path(), None)), Ok(()));
        let absent = dir.path().join("absent");
        assert!(matches!(
            check_volume(&volume(&absent, None)),
            Err(VolumeError::SharedDir { path, .. }) if path == absent
        ));
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").expect("file");
        assert!(matches!(
            check_volume(&volume(&file, None)),
            Err(VolumeError::SharedDir { detail, .. }) if detail == "not a directory"
        ));
        let bad_tag = FsConfig {
            tag: "a b".into(),
            ..volume(dir.path(), None)
        };
        assert_eq!(check_volume(&bad_tag), Err(VolumeError::Tag("a b".into())));
    }

    #[test]
    fn with_a_socket_the_shared_directory_is_the_backends_and_is_not_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("fs.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        // Not visible here (a jailed VMM): still a volume.
        let elsewhere = dir.path().join("not-here");
        assert_eq!(
            check_volume(&volume(&elsewhere, Some(socket.clone()))),
            Ok(())
        );
        let gone = dir.path().join("gone.sock");
        assert_eq!(
            check_volume(&volume(&elsewhere, Some(gone.clone()))),
            Err(VolumeError::Socket {
                tag: "data".into(),
                path: gone
            })
        );
        let readonly = FsConfig {
            readonly: true,
            ..volume(&elsewhere, Some(socket.clone()))
        };
        assert_eq!(
            check_volume(&readonly),
            Err(VolumeError::SocketOptions("data".into()))
        );
        let cached = FsConfig {
            cache: FsCache::Never,
            ..volume(&elsewhere, Some(socket.clone()))
        };
        assert_eq!(
            check_volume(&cached),
            Err(VolumeError::SocketOptions("data".into()))
        );
        let bad_tag = FsConfig {
            tag: String::new(),
            ..volume(&elsewhere, Some(socket))
        };
        assert_eq!(check_volume(&bad_tag), Err(VolumeError::Tag(String::new())));
    }
}
