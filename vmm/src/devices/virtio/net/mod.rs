//! virtio-net over a host tap device.

pub mod device;
pub mod tap;

pub use device::{Net, NetConfig, NetError};

/// Bytes of the virtio 1.x net header in front of every frame (`num_buffers` included).
pub const VNET_HDR_LEN: usize = 12;
