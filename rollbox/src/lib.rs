//! rollbox: sandboxes for RL rollouts. This crate holds the user-facing CLI and
//! the daemon (`rollbox serve`).
pub mod daemon;
pub mod exec;
pub mod images;
pub mod lease;
pub mod net;
