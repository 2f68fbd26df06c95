//! The per-layer context every step gets: the layer and entry names its errors carry, and
//! what this layer created (whiteouts apply only to lower layers).

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};

use super::error::LayerError;

/// Per-layer context: names for errors, and what this layer created (whiteouts apply only to
/// lower layers).
pub(super) struct LayerCtx<'a> {
    pub(super) layer: &'a str,
    pub(super) entry: String,
    pub(super) created: HashSet<PathBuf>,
}

impl LayerCtx<'_> {
    pub(super) fn io(&self, action: &'static str, path: &Path, source: io::Error) -> LayerError {
        LayerError::Io {
            layer: self.layer.to_string(),
            entry: self.entry.clone(),
            action,
            path: path.display().to_string(),
            source,
        }
    }

    pub(super) fn read(&self, source: io::Error) -> LayerError {
        LayerError::Read {
            layer: self.layer.to_string(),
            source,
        }
    }
}

pub(super) fn unsupported(ctx: &LayerCtx<'_>, kind: &str) -> LayerError {
    LayerError::Unsupported {
        layer: ctx.layer.to_string(),
        entry: ctx.entry.clone(),
        kind: kind.to_string(),
    }
}
