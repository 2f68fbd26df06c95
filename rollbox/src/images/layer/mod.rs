//! Applies image layers (tar streams) onto a root directory, the way a container runtime
//! stacks them: later layers overwrite, `.wh.<name>` deletes `<name>` from lower layers and
//! `.wh..wh..opq` hides everything lower layers put in its directory.
//!
//! Safety rules, checked for every entry: no absolute paths, no `..` components, never
//! write or delete through a symlink that leaves the root (an absolute symlink or one that
//! climbs above the root in a parent component is an error; relative ones that stay inside
//! are followed; an existing symlink at the target path itself is replaced, not followed),
//! and hardlinks only to entries inside the root. Modes, ownership, times, xattrs, symlinks, hardlinks and
//! device nodes are reproduced (the caller must be root).
//!
//! `builder.rs` holds the apply loop ([`RootfsBuilder`]), `whiteout.rs` the whiteouts,
//! `entry.rs` the entry kinds, `path.rs` the path checks, `meta.rs` the metadata, `sys.rs`
//! the libc calls, `context.rs` the per-layer context and `error.rs` [`LayerError`].

mod builder;
mod context;
mod entry;
mod error;
mod meta;
mod path;
#[cfg(test)]
mod test_tar;
mod whiteout;

pub use builder::{LayerStats, RootfsBuilder};
pub use error::LayerError;
