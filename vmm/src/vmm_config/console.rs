//! The guest console: the VMM's stdout or a file, and the cap on a console file's size.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Default cap on a console file (`--console-max-bytes`): 8 MiB.
pub const DEFAULT_CONSOLE_MAX_BYTES: u64 = 8 << 20;
/// Smallest cap accepted: room for some output and the line that reports the drop.
pub const MIN_CONSOLE_MAX_BYTES: u64 = 1024;

/// Where the guest console goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ConsoleConfig {
    /// The VMM's stdout (input from its stdin).
    #[default]
    Stdout,
    /// Appended to a file, which stops growing at `max_bytes` (later output is dropped and
    /// counted).
    File {
        /// The file.
        path: PathBuf,
        /// Its largest size in bytes.
        max_bytes: u64,
    },
}

impl ConsoleConfig {
    /// Parses the `--console` value; a file is capped at [`DEFAULT_CONSOLE_MAX_BYTES`].
    pub fn parse(value: &str) -> Self {
        if value == "stdout" {
            ConsoleConfig::Stdout
        } else {
            ConsoleConfig::File {
                path: PathBuf::from(value),
                max_bytes: DEFAULT_CONSOLE_MAX_BYTES,
            }
        }
    }

    /// The same console with a file's cap set to `max_bytes` (stdout has none).
    pub fn with_max_bytes(self, max_bytes: u64) -> Self {
        match self {
            ConsoleConfig::File { path, .. } => ConsoleConfig::File { path, max_bytes },
            stdout => stdout,
        }
    }
}
