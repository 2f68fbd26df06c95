//! rollbox: sandboxes for RL rollouts. This crate holds the user-facing CLI.
pub mod exec;
pub mod images;
pub mod net;
