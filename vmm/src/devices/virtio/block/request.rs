//! Parsing and validation of virtio-blk descriptor chains from an untrusted guest.

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

/// virtio-blk request types.
pub const VIRTIO_BLK_T_IN: u32 = 0;
/// Write.
pub const VIRTIO_BLK_T_OUT: u32 = 1;
/// Flush.
pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
/// Device ID.
pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
/// Length of the device ID answer.
pub const VIRTIO_BLK_ID_BYTES: u32 = 20;
/// Sector size.
pub const SECTOR_SIZE: u64 = 512;
const HEADER_LEN: u32 = 16;

/// Why a descriptor chain was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    /// No descriptor at all (head index beyond the queue, or unreadable table).
    #[error("empty descriptor chain (head index beyond the queue or descriptor table unreadable)")]
    Empty,
    /// The chain did not end where it said it would.
    #[error(
        "descriptor chain loops, is longer than the queue, or names a next index beyond the queue"
    )]
    Unterminated,
    /// Too few descriptors.
    #[error("descriptor chain has {0} descriptor(s); a request needs a header and a status")]
    TooShort(usize),
    /// The header is device-writable or too short.
    #[error("request header must be a device-readable buffer of at least 16 bytes (got len {len}, write-only {write_only})")]
    BadHeader {
        /// Its length.
        len: u32,
        /// Its direction.
        write_only: bool,
    },
    /// The status is device-readable or empty.
    #[error("status must be a device-writable buffer of at least 1 byte (got len {len}, write-only {write_only})")]
    BadStatus {
        /// Its length.
        len: u32,
        /// Its direction.
        write_only: bool,
    },
    /// A buffer lies outside guest memory.
    #[error("buffer {addr:#x}+{len:#x} lies outside guest memory")]
    OutOfMemory {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// A data buffer has the wrong direction for the request.
    #[error(
        "data buffer {addr:#x}+{len:#x} has the wrong direction for request type {request_type}"
    )]
    WrongDirection {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u32,
        /// Request type.
        request_type: u32,
    },
    /// The data length is not a whole number of sectors.
    #[error("data length {0} is not a multiple of 512")]
    PartialSector(u64),
    /// The header could not be read.
    #[error("cannot read the request header at {0:#x}")]
    HeaderUnreadable(u64),
}

/// A validated request.
#[derive(Debug)]
pub struct Request {
    /// Request type.
    pub request_type: u32,
    /// First sector.
    pub sector: u64,
    /// Data buffers (guest address, length), all checked against guest memory.
    pub data: Vec<(GuestAddress, u32)>,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

impl Request {
    /// Total data length.
    pub fn data_len(&self) -> u64 {
        self.data.iter().map(|(_, len)| u64::from(*len)).sum()
    }
}

fn check_range(mem: &GuestMemoryMmap, desc: &Descriptor) -> Result<(), ChainError> {
    let err = ChainError::OutOfMemory {
        addr: desc.addr().raw_value(),
        len: desc.len(),
    };
    if desc.len() == 0 {
        return Ok(());
    }
    desc.addr()
        .checked_add(u64::from(desc.len()) - 1)
        .ok_or_else(|| err.clone())?;
    if !mem.check_range(desc.addr(), desc.len() as usize) {
        return Err(err);
    }
    Ok(())
}

/// Collects a chain's descriptors, refusing chains that do not terminate.
pub fn collect_chain(
    chain: DescriptorChain<&GuestMemoryMmap>,
) -> Result<Vec<Descriptor>, ChainError> {
    let descriptors: Vec<Descriptor> = chain.collect();
    match descriptors.last() {
        None => Err(ChainError::Empty),
        Some(last) if last.has_next() => Err(ChainError::Unterminated),
        Some(_) => Ok(descriptors),
    }
}

/// The status buffer of a chain, if its last descriptor can take one: used to report an
/// error for a chain that failed validation.
pub fn status_of(mem: &GuestMemoryMmap, descriptors: &[Descriptor]) -> Option<GuestAddress> {
    let last = descriptors.last()?;
    (last.is_write_only() && last.len() >= 1 && check_range(mem, last).is_ok()).then(|| last.addr())
}

/// Validates a collected chain as a virtio-blk request.
pub fn parse(mem: &GuestMemoryMmap, descriptors: &[Descriptor]) -> Result<Request, ChainError> {
    if descriptors.len() < 2 {
        return Err(ChainError::TooShort(descriptors.len()));
    }
    let header = &descriptors[0];
    let status = &descriptors[descriptors.len() - 1];
    if header.is_write_only() || header.len() < HEADER_LEN {
        return Err(ChainError::BadHeader {
            len: header.len(),
            write_only: header.is_write_only(),
        });
    }
    if !status.is_write_only() || status.len() < 1 {
        return Err(ChainError::BadStatus {
            len: status.len(),
            write_only: status.is_write_only(),
        });
    }
    check_range(mem, header)?;
    check_range(mem, status)?;
    let request_type: u32 = mem
        .read_obj(header.addr())
        .map_err(|_| ChainError::HeaderUnreadable(header.addr().raw_value()))?;
    let sector: u64 = mem
        .read_obj(header.addr().unchecked_add(8))
        .map_err(|_| ChainError::HeaderUnreadable(header.addr().raw_value()))?;
    let mut data = Vec::new();
    for desc in &descriptors[1..descriptors.len() - 1] {
        check_range(mem, desc)?;
        let must_write = matches!(request_type, VIRTIO_BLK_T_IN | VIRTIO_BLK_T_GET_ID);
        let must_read = request_type == VIRTIO_BLK_T_OUT;
        if (must_write && !desc.is_write_only()) || (must_read && desc.is_write_only()) {
            return Err(ChainError::WrongDirection {
                addr: desc.addr().raw_value(),
                len: desc.len(),
                request_type,
            });
        }
        data.push((desc.addr(), desc.len()));
    }
    let request = Request {
        request_type,
        sector,
        data,
        status: status.addr(),
    };
    if matches!(request_type, VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT)
        && !request.data_len().is_multiple_of(SECTOR_SIZE)
    {
        return Err(ChainError::PartialSector(request.data_len()));
    }
    Ok(request)
}
