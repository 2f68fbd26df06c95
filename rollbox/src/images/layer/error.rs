//! What stops a layer from being applied: one error per kind of bad entry, each naming the
//! layer and the entry.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("layer {layer}: corrupt or unreadable layer data: {source}")]
    Read { layer: String, source: io::Error },
    #[error("layer {layer}: entry {entry:?} has an absolute path; layer entries must be relative to the root")]
    AbsolutePath { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?} contains a `..` component (path traversal)")]
    Traversal { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?} would be written through the symlink /{link} (path escapes via symlink)")]
    ThroughSymlink {
        layer: String,
        entry: String,
        link: String,
    },
    #[error("layer {layer}: entry {entry:?} needs /{parent} to be a directory, but it is not")]
    ParentNotDirectory {
        layer: String,
        entry: String,
        parent: String,
    },
    #[error("layer {layer}: hardlink {entry:?} points outside the root: {target:?}")]
    HardlinkOutside {
        layer: String,
        entry: String,
        target: String,
    },
    #[error("layer {layer}: hardlink {entry:?} points to {target:?}, which does not exist (or is a directory)")]
    HardlinkTarget {
        layer: String,
        entry: String,
        target: String,
    },
    #[error("layer {layer}: more than {limit} entries")]
    TooManyEntries { layer: String, limit: u64 },
    #[error("layer {layer}: whiteout {entry:?} names no file")]
    BadWhiteout { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?} has unsupported tar entry type {kind}")]
    Unsupported {
        layer: String,
        entry: String,
        kind: String,
    },
    #[error("layer {layer}: entry {entry:?}: cannot {action} {path}: {source}")]
    Io {
        layer: String,
        entry: String,
        action: &'static str,
        path: String,
        source: io::Error,
    },
}

impl LayerError {
    /// The underlying OS error, where the failure was a filesystem operation.
    pub fn io_source(&self) -> Option<&io::Error> {
        match self {
            LayerError::Io { source, .. } | LayerError::Read { source, .. } => Some(source),
            _ => None,
        }
    }
}
