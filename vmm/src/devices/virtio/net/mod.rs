//! virtio-net over a host tap device (`tap.rs`, which checks tap names); the guest's MAC
//! (`mac.rs`); its snapshot state in `persist.rs`.

pub mod device;
pub mod mac;
pub mod persist;
pub mod tap;

pub use device::{Net, NetConfig, NetError};
pub use mac::{parse_mac, MacError};
pub use persist::NetOverride;

/// Bytes of the virtio 1.x net header in front of every frame (`num_buffers` included).
pub const VNET_HDR_LEN: usize = 12;
