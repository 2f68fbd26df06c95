//! What the fs device needs of a volume's configuration: a tag that fits its config space and
//! the guest's `mount -t virtiofs TAG` line, a shared directory, and, when the caller started
//! virtiofsd (`socket`), that socket and no virtiofsd options.

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

/// Checks the tag, the shared directory and the socket of `config`.
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
    let dir_err = |detail: String| VolumeError::SharedDir {
        tag: tag.clone(),
        path: config.shared_dir.clone(),
        detail,
    };
    let meta = std::fs::metadata(&config.shared_dir).map_err(|e| dir_err(e.to_string()))?;
    if !meta.is_dir() {
        return Err(dir_err("not a directory".into()));
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
    }
    Ok(())
}
