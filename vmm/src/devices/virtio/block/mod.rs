//! virtio-blk over a raw image file: read, write, flush and GET_ID, read-write or read-only;
//! its snapshot state in `persist.rs`.

mod device;
pub mod persist;
mod request;
pub mod worker;

pub use device::{Block, BlockConfig, BlockError};
pub use worker::{QueueWorker, WorkerError};
