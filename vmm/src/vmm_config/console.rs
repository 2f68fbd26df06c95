//! The guest console: the VMM's stdout or a file.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Where the guest console goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ConsoleConfig {
    /// The VMM's stdout (input from its stdin).
    #[default]
    Stdout,
    /// Appended to a file.
    File(PathBuf),
}

impl ConsoleConfig {
    /// Parses the `--console` value.
    pub fn parse(value: &str) -> Self {
        if value == "stdout" {
            ConsoleConfig::Stdout
        } else {
            ConsoleConfig::File(PathBuf::from(value))
        }
    }
}
