//! virtio-fs: shared host directories. The device model is a vhost-user frontend
//! ([`device::Fs`]); the file system is served by virtiofsd ([`daemon`]), which rollbox-vmm
//! starts per volume or which the caller started (`socket=PATH`); its snapshot state is in
//! [`persist`]; what it needs of a volume's configuration is checked by [`volume`].

pub mod daemon;
pub mod device;
pub mod persist;
pub mod volume;

pub use daemon::{locate_virtiofsd, Daemon};
pub use device::Fs;
pub use volume::{check_volume, VolumeError};

use std::path::PathBuf;

/// Errors of a virtio-fs volume: its virtiofsd and the vhost-user conversation with it.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// No virtiofsd binary was found.
    #[error("virtiofsd not found ({0}); scripts/virtiofsd.sh installs it, or give --virtiofsd PATH or ROLLBOX_VIRTIOFSD")]
    NoVirtiofsd(#[from] vmm_api::virtiofsd::LocateError),
    /// virtiofsd could not be started.
    #[error("volume {tag}: cannot start {binary}: {source}")]
    Spawn {
        /// The volume's tag.
        tag: String,
        /// The virtiofsd binary.
        binary: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// virtiofsd exited or never offered its socket.
    #[error("volume {tag}: virtiofsd {detail}")]
    Daemon {
        /// The volume's tag.
        tag: String,
        /// What happened.
        detail: String,
    },
    /// The vhost-user socket could not be reached.
    #[error("volume {tag}: cannot connect to the vhost-user socket {socket}: {source}")]
    Connect {
        /// The volume's tag.
        tag: String,
        /// The socket path.
        socket: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A vhost-user request failed.
    #[error("volume {tag}: vhost-user {request}: {source}")]
    VhostUser {
        /// The volume's tag.
        tag: String,
        /// The request that failed.
        request: &'static str,
        /// The vhost error.
        source: vhost::Error,
    },
    /// Saving or loading virtiofsd's state (snapshots).
    #[error("volume {tag}: device state: {detail}")]
    DeviceState {
        /// The volume's tag.
        tag: String,
        /// What failed.
        detail: String,
    },
    /// The backend lacks a feature the device needs.
    #[error("volume {tag}: the vhost-user backend does not offer {feature}")]
    MissingFeature {
        /// The volume's tag.
        tag: String,
        /// The missing feature.
        feature: &'static str,
    },
}
