//! virtio-blk over a raw image file: read, write, flush and GET_ID, read-write or read-only.

mod device;
mod request;
pub mod worker;

pub use device::{Block, BlockConfig, BlockError};
pub use worker::{QueueWorker, WorkerError};
