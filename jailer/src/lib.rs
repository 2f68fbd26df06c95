//! rollbox-jailer's library: the host's cgroups ([`cgroup`]), which the jailer and `rollbox
//! serve` share, the files a dynamically linked VMM needs in its jail ([`elf`]), and the
//! jailer's error.

pub mod cgroup;
pub mod elf;

use std::path::Path;

pub use cgroup::{
    all_jail_groups, existing_groups, hierarchy, remove_group, remove_jail_groups, JailGroups,
    Setting,
};

/// A failed jail step, naming the step and its input.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("{step} {input}: {source}")]
    Step {
        step: &'static str,
        input: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Usage(String),
    /// The loader and libraries of `--exec` could not be listed.
    #[error("--exec: {0}")]
    Libraries(#[from] elf::ElfError),
}

impl JailError {
    /// A failed `step` on `input`.
    pub fn step(
        step: &'static str,
        input: impl AsRef<Path>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let input = input.as_ref().display().to_string();
        move |source| JailError::Step {
            step,
            input,
            source,
        }
    }
}
