//! `rollbox serve`: the daemon. Two sibling [`frontend`]s, the native HTTP/JSON API and the
//! E2B-compatible one, parse requests into [`api::Action`]s for the one action interface,
//! `core::Core`, which runs each on its service and answers an [`api::Reply`]. `serve.rs`
//! builds it all.
//!
//! The services: [`sandboxes`] (create, end, reap, recover), the [`supervisor`] (the
//! `rollbox-vmm` processes, their jails and host cgroups), [`snapshots`] (snapshots, fork,
//! reset, and export and import between nodes), [`templates`] (from files or built from an image, with an optional boot snapshot)
//! and [`guest`] (exec, files and ports through the guest agent); [`usage`] has usage and
//! metrics, [`retention`] the snapshot retention rules, [`store`] the SQLite state, and
//! `keys` the API keys (admin and tenant) each request is checked against, and `node` this
//! daemon as a node of a fleet (its id, admission limits, drain).

pub mod api;
pub mod client;
mod core;
pub mod frontend;
mod gpus;
mod guest;
mod keys;
mod networks;
mod node;
mod retention;
mod sandboxes;
mod serve;
mod snapshots;
pub mod store;
mod supervisor;
mod templates;
pub mod usage;
mod util;
mod volumes;

pub use frontend::conn::ConnLimits;
pub use frontend::e2b;
pub use frontend::transport::Listen;
pub use networks::{host_dns, host_resolver, NetworkOptions};
pub use node::NodeOptions;
/// The host's cgroups (`rollbox_jailer::cgroup`), where the daemon's tools and tests find them.
pub use rollbox_jailer::cgroup;
pub use sandboxes::{parse_shape as parse_warm_pool, warm_pool_with_default};
pub use serve::{serve, DaemonError, ServeOptions, WarmPoolSpec};
/// The archive snapshots move between nodes in (its reader is fuzzed).
pub use snapshots::archive as snapshot_archive;
pub use supervisor::{vm, JailerOptions};
