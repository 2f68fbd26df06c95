//! The virtio-blk device model.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

use super::request::{
    collect_chain, parse, status_of, Request, SECTOR_SIZE, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use crate::devices::virtio::mmio::read_config_bytes;
use crate::devices::virtio::{pop_checked, QueueContext, VirtioDevice, TYPE_BLOCK};

const VIRTIO_BLK_F_RO: u64 = 1 << 5;
const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
const VIRTIO_BLK_S_OK: u8 = 0;
const VIRTIO_BLK_S_IOERR: u8 = 1;
const VIRTIO_BLK_S_UNSUPP: u8 = 2;
const QUEUE_SIZE: u16 = 256;
/// Largest single transfer we bounce through host memory.
const MAX_TRANSFER: u64 = 1 << 20;

/// Errors from opening a drive.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image could not be opened.
    #[error("drive {path}: {source}")]
    Open {
        /// The image path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// A drive as configured by the user.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockConfig {
    /// The drive ID, answered to VIRTIO_BLK_T_GET_ID (first 20 bytes).
    pub id: String,
    /// The raw image file.
    pub path: PathBuf,
    /// Whether the guest may only read.
    pub read_only: bool,
}

/// A virtio-blk device backed by a raw image.
pub struct Block {
    pub(super) config: BlockConfig,
    file: File,
    capacity_sectors: u64,
    queue_sizes: [u16; 1],
}

impl Block {
    /// Opens the image of `config`.
    pub fn new(config: BlockConfig) -> Result<Self, BlockError> {
        let open_err = |source| BlockError::Open {
            path: config.path.clone(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(!config.read_only)
            .open(&config.path)
            .map_err(open_err)?;
        let len = file.metadata().map_err(open_err)?.len();
        Ok(Self {
            config,
            file,
            capacity_sectors: len / SECTOR_SIZE,
            queue_sizes: [QUEUE_SIZE],
        })
    }

    fn execute(&mut self, mem: &GuestMemoryMmap, request: &Request) -> Result<u32, (u8, String)> {
        let io_err = |what: &str, e: std::io::Error| (VIRTIO_BLK_S_IOERR, format!("{what}: {e}"));
        match request.request_type {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let sectors = request.data_len() / SECTOR_SIZE;
                let end = request.sector.checked_add(sectors);
                if end.is_none_or(|end| end > self.capacity_sectors) {
                    return Err((
                        VIRTIO_BLK_S_IOERR,
                        format!(
                            "sectors {}+{sectors} beyond capacity {}",
                            request.sector, self.capacity_sectors
                        ),
                    ));
                }
                if request.request_type == VIRTIO_BLK_T_OUT && self.config.read_only {
                    return Err((VIRTIO_BLK_S_IOERR, "write to a read-only drive".into()));
                }
                let mut offset = request.sector * SECTOR_SIZE;
                let mut written = 0u32;
                for &(addr, len) in &request.data {
                    let mut done = 0u64;
                    while done < u64::from(len) {
                        let chunk = (u64::from(len) - done).min(MAX_TRANSFER) as usize;
                        let mut buf = vec![0u8; chunk];
                        let guest = GuestAddress(addr.0 + done);
                        if request.request_type == VIRTIO_BLK_T_IN {
                            self.file
                                .read_exact_at(&mut buf, offset)
                                .map_err(|e| io_err("read", e))?;
                            mem.write_slice(&buf, guest)
                                .map_err(|e| (VIRTIO_BLK_S_IOERR, format!("guest memory: {e}")))?;
                            written += chunk as u32;
                        } else {
                            mem.read_slice(&mut buf, guest)
                                .map_err(|e| (VIRTIO_BLK_S_IOERR, format!("guest memory: {e}")))?;
                            self.file
                                .write_all_at(&buf, offset)
                                .map_err(|e| io_err("write", e))?;
                        }
                        offset += chunk as u64;
                        done += chunk as u64;
                    }
                }
                Ok(written)
            }
            VIRTIO_BLK_T_FLUSH => {
                if !self.config.read_only {
                    self.file.sync_all().map_err(|e| io_err("flush", e))?;
                }
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
                let bytes = self.config.id.as_bytes();
                let n = bytes.len().min(id.len());
                id[..n].copy_from_slice(&bytes[..n]);
                let Some(&(addr, len)) = request.data.first() else {
                    return Err((VIRTIO_BLK_S_IOERR, "GET_ID without a buffer".into()));
                };
                let n = (len as usize).min(id.len());
                mem.write_slice(&id[..n], addr)
                    .map_err(|e| (VIRTIO_BLK_S_IOERR, format!("guest memory: {e}")))?;
                Ok(n as u32)
            }
            other => Err((
                VIRTIO_BLK_S_UNSUPP,
                format!("unsupported request type {other}"),
            )),
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn avail_features(&self) -> u64 {
        let ro = if self.config.read_only {
            VIRTIO_BLK_F_RO
        } else {
            0
        };
        VIRTIO_BLK_F_FLUSH | ro
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.capacity_sectors.to_le_bytes(), offset, data);
    }

    fn process_queue(&mut self, queue_index: usize, ctx: &mut QueueContext<'_>) {
        let mem = ctx.mem;
        let name = self.name();
        let Some(queue) = ctx.queues.get_mut(queue_index) else {
            return;
        };
        let mut used_any = false;
        loop {
            let chain = match pop_checked(queue, mem) {
                Ok(Some(chain)) => chain,
                Ok(None) => break,
                Err(e) => {
                    log::warn!("{name}: {e}; ignoring the queue until reset");
                    ctx.interrupt.signal_needs_reset();
                    break;
                }
            };
            let head = chain.head_index();
            let (status_addr, status, len) = match collect_chain(chain) {
                Err(e) => {
                    log::warn!("{name}: refused descriptor chain at head {head}: {e}");
                    (None, VIRTIO_BLK_S_IOERR, 0)
                }
                Ok(descriptors) => match parse(mem, &descriptors) {
                    Err(e) => {
                        log::warn!("{name}: refused descriptor chain at head {head}: {e}");
                        let status = status_of(mem, &descriptors);
                        (status, VIRTIO_BLK_S_IOERR, u32::from(status.is_some()))
                    }
                    Ok(request) => match self.execute(mem, &request) {
                        Ok(written) => (Some(request.status), VIRTIO_BLK_S_OK, written + 1),
                        Err((status, reason)) => {
                            log::warn!(
                                "{name}: request type {} at sector {} failed: {reason}",
                                request.request_type,
                                request.sector
                            );
                            (Some(request.status), status, 1)
                        }
                    },
                },
            };
            if let Some(addr) = status_addr {
                if let Err(e) = mem.write_obj(status, addr) {
                    log::warn!("{name}: cannot write the status byte: {e}");
                }
            }
            if let Err(e) = queue.add_used(mem, head, len) {
                log::warn!("{name}: cannot return head {head} to the used ring: {e}");
                break;
            }
            used_any = true;
        }
        if used_any {
            ctx.interrupt.signal_used_ring();
        }
    }

    fn name(&self) -> String {
        format!("virtio-blk {}", self.config.id)
    }
}
