//! virtio-vsock whose host side is a Unix socket, with Firecracker's protocol:
//! the host connects to `uds_path` and sends `CONNECT <port>\n` (answered `OK <host port>\n`
//! once the guest accepts), and guest connections to host port P arrive on `<uds_path>_P`.
//! Its snapshot state is in `persist.rs`.

mod conn;
mod device;
mod packet;
pub mod persist;
mod unix;

pub use device::{Vsock, VsockError};
pub use packet::{PacketHeader, HEADER_LEN};
/// The host side alone, for the fuzz targets (fuzz/).
#[doc(hidden)]
pub use unix::UnixMuxer;
