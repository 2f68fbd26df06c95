//! Snapshot state of a drive: its ID, image and mode. A restore reopens the image, or the one
//! `drive_overrides` names (a fork clone's copy).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use snapshot::Persist;

use super::{Block, BlockConfig, BlockError};

/// What a snapshot records of a drive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockPersistState {
    /// Drive ID.
    pub id: String,
    /// Image path at snapshot time.
    pub path: PathBuf,
    /// Read-only for the guest.
    pub read_only: bool,
}

/// What a restore may change about a drive.
#[derive(Debug, Clone, Default)]
pub struct BlockRestoreArgs {
    /// Another image (`drive_overrides`), else the recorded one.
    pub path: Option<PathBuf>,
}

impl Persist for Block {
    type State = BlockPersistState;
    type ConstructorArgs = BlockRestoreArgs;
    type Error = BlockError;

    fn save(&self) -> Result<BlockPersistState, BlockError> {
        Ok(BlockPersistState {
            id: self.config.id.clone(),
            path: self.config.path.clone(),
            read_only: self.config.read_only,
        })
    }

    fn restore(args: BlockRestoreArgs, state: &BlockPersistState) -> Result<Self, BlockError> {
        Block::new(BlockConfig {
            id: state.id.clone(),
            path: args.path.unwrap_or_else(|| state.path.clone()),
            read_only: state.read_only,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restore_opens_the_override_image_else_the_recorded_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let recorded = dir.path().join("disk.img");
        let copy = dir.path().join("copy.img");
        std::fs::write(&recorded, vec![0u8; 4096]).expect("image");
        std::fs::write(&copy, vec![0u8; 8192]).expect("copy");
        let state = BlockPersistState {
            id: "rootfs".into(),
            path: recorded.clone(),
            read_only: true,
        };
        let same = Block::restore(BlockRestoreArgs::default(), &state).expect("restore");
        assert_eq!(same.save().expect("save"), state);
        let args = BlockRestoreArgs {
            path: Some(copy.clone()),
        };
        let moved = Block::restore(args, &state).expect("restore onto the copy");
        assert_eq!(moved.save().expect("save").path, copy);
        let gone = BlockRestoreArgs {
            path: Some(dir.path().join("gone.img")),
        };
        let err = Block::restore(gone, &state).err().expect("a missing image");
        assert!(err.to_string().contains("gone.img"), "{err}");
    }
}
