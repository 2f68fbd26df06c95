//! Snapshot state of the vsock device: the guest's CID and the host-side socket. Connections
//! do not survive a snapshot; a restore binds the socket again, or the one `vsock_override`
//! names (clones must not share one).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use snapshot::Persist;

use super::{Vsock, VsockError};

/// What a snapshot records of the vsock device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockPersistState {
    /// Guest CID.
    pub guest_cid: u64,
    /// Host-side socket at snapshot time.
    pub uds_path: PathBuf,
}

/// What a restore may change about the vsock device.
#[derive(Debug, Clone, Default)]
pub struct VsockRestoreArgs {
    /// Another host-side socket, else the recorded one.
    pub uds_path: Option<PathBuf>,
}

impl Persist for Vsock {
    type State = VsockPersistState;
    type ConstructorArgs = VsockRestoreArgs;
    type Error = VsockError;

    fn save(&self) -> Result<VsockPersistState, VsockError> {
        Ok(VsockPersistState {
            guest_cid: self.guest_cid,
            uds_path: self.muxer.uds_path().to_path_buf(),
        })
    }

    fn restore(args: VsockRestoreArgs, state: &VsockPersistState) -> Result<Self, VsockError> {
        let uds = args.uds_path.unwrap_or_else(|| state.uds_path.clone());
        Vsock::new(state.guest_cid, &uds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restore_binds_the_override_socket_else_the_recorded_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = VsockPersistState {
            guest_cid: 3,
            uds_path: dir.path().join("v.sock"),
        };
        let same = Vsock::restore(VsockRestoreArgs::default(), &state).expect("restore");
        assert_eq!(same.save().expect("save"), state);
        let clone = dir.path().join("clone.sock");
        let args = VsockRestoreArgs {
            uds_path: Some(clone.clone()),
        };
        let moved = Vsock::restore(args, &state).expect("restore onto another socket");
        assert_eq!(moved.save().expect("save").uds_path, clone);
        assert!(clone.exists(), "the override socket is bound");
    }
}
