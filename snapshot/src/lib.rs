//! rollbox snapshots: the versioned, checksummed state file ([`format`]), sparse memory files
//! with full and diff layers ([`memory`]), and lazy restore through a userfaultfd page server
//! with working-set prefetch ([`uffd`]). The VMM's vCPUs and devices implement [`Persist`].

pub mod format;
pub mod memory;
pub mod uffd;

/// Save and restore of a component's state, Firecracker style: `save` captures what the
/// component needs, `restore` rebuilds it from that state plus the live resources it needs.
pub trait Persist: Sized {
    /// The serializable state.
    type State;
    /// What restore needs besides the state (guest memory, file overrides...).
    type ConstructorArgs;
    /// Why a save or restore can fail.
    type Error;

    /// Captures the current state.
    fn save(&self) -> Result<Self::State, Self::Error>;
    /// Rebuilds the component.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
