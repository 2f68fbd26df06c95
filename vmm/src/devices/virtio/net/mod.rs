//! virtio-net over a host tap device; its snapshot state in `persist.rs`.

pub mod device;
pub mod persist;
pub mod tap;

pub use device::{Net, NetConfig, NetError};
pub use persist::NetOverride;

/// Bytes of the virtio 1.x net header in front of every frame (`num_buffers` included).
pub const VNET_HDR_LEN: usize = 12;
