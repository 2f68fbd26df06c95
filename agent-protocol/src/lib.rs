//! The protocol between the rollbox host side and `rollbox-agent`, and an
//! async host client. See README.md for the wire format.

pub mod b64;
pub mod client;
pub mod frame;
pub mod hybrid;
pub mod messages;

pub use client::{
    AgentClient, Applied, ClientError, ExecEvent, ExecHandle, ExecOutput, RawRequest,
};
pub use frame::{FrameError, MAX_FRAME_BYTES};
pub use messages::*;

/// Bumped on incompatible wire changes.
pub const PROTOCOL_VERSION: u32 = 1;
/// The vsock port the agent listens on by default.
pub const DEFAULT_PORT: u32 = 1024;
/// Payload bytes per `Data`/`Output` chunk (before base64).
pub const CHUNK_BYTES: usize = 64 << 10;
