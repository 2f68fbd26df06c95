//! Parsing and validation of virtio-blk descriptor chains from an untrusted guest.

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress};

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
    /// The chain has no end (the shared validator says why).
    #[error("descriptor chain: {0}")]
    Unterminated(crate::devices::virtio::chain::ChainError),
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
    crate::devices::virtio::chain::check_range(mem, desc.addr(), desc.len()).map_err(|_| {
        ChainError::OutOfMemory {
            addr: desc.addr().raw_value(),
            len: desc.len(),
        }
    })
}

/// Collects a chain's descriptors, refusing chains that do not terminate.
pub fn collect_chain(
    chain: DescriptorChain<&GuestMemoryMmap>,
) -> Result<Vec<Descriptor>, ChainError> {
    let head = chain.head_index();
    let descriptors: Vec<Descriptor> = chain.collect();
    if descriptors.is_empty() {
        return Err(ChainError::Empty);
    }
    // The queue size is not at hand: the iterator already stopped at it, so a next index it
    // could not follow is reported as such.
    crate::devices::virtio::chain::check_termination(head, &descriptors, u16::MAX)
        .map_err(ChainError::Unterminated)?;
    Ok(descriptors)
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

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::{Queue, QueueT};

    const SIZE: u16 = 16;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const HDR: u64 = 0x8000;
    const DATA: u64 = 0x9000;
    const STATUS: u64 = 0xa000;

    /// A descriptor: address, length, flags, next.
    type Desc = (u64, u32, u16, u16);

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("mem")
    }

    /// Collects the chain of `descs` (head 0) from a queue in `mem`.
    fn collect(mem: &GuestMemoryMmap, descs: &[Desc]) -> Result<Vec<Descriptor>, ChainError> {
        let mut q = Queue::new(SIZE).expect("queue");
        q.set_desc_table_address(Some(0x1000), Some(0));
        q.set_avail_ring_address(Some(0x2000), Some(0));
        q.set_used_ring_address(Some(0x3000), Some(0));
        q.set_ready(true);
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            mem.write_obj(
                Descriptor::new(addr, len, flags, next),
                GuestAddress(0x1000 + 16 * i as u64),
            )
            .expect("desc");
        }
        mem.write_obj(0u16, GuestAddress(0x2004)).expect("ring");
        mem.write_obj(1u16, GuestAddress(0x2002)).expect("idx");
        let chain = q.pop_descriptor_chain(mem).expect("a chain");
        collect_chain(chain)
    }

    /// A request header of `request_type` for `sector` at HDR.
    fn header(mem: &GuestMemoryMmap, request_type: u32, sector: u64) {
        mem.write_obj(request_type, GuestAddress(HDR))
            .expect("type");
        mem.write_obj(sector, GuestAddress(HDR + 8))
            .expect("sector");
    }

    fn parse_chain(request_type: u32, descs: &[Desc]) -> Result<Request, ChainError> {
        let mem = mem();
        header(&mem, request_type, 7);
        let descriptors = collect(&mem, descs)?;
        parse(&mem, &descriptors)
    }

    #[test]
    fn reads_writes_flushes_and_id_requests_parse() {
        let read = parse_chain(
            VIRTIO_BLK_T_IN,
            &[
                (HDR, 16, F_NEXT, 1),
                (DATA, 1024, F_WRITE | F_NEXT, 2),
                (STATUS, 1, F_WRITE, 0),
            ],
        )
        .expect("read");
        assert_eq!(read.sector, 7);
        assert_eq!(read.data, vec![(GuestAddress(DATA), 1024)]);
        assert_eq!(read.status, GuestAddress(STATUS));
        let write = parse_chain(
            VIRTIO_BLK_T_OUT,
            &[
                (HDR, 16, F_NEXT, 1),
                (DATA, 512, F_NEXT, 2),
                (DATA + 512, 512, F_NEXT, 3),
                (STATUS, 1, F_WRITE, 0),
            ],
        )
        .expect("write");
        assert_eq!(write.data_len(), 1024);
        let flush = parse_chain(
            VIRTIO_BLK_T_FLUSH,
            &[(HDR, 16, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)],
        )
        .expect("flush");
        assert!(flush.data.is_empty());
        let id = parse_chain(
            VIRTIO_BLK_T_GET_ID,
            &[
                (HDR, 16, F_NEXT, 1),
                (DATA, VIRTIO_BLK_ID_BYTES, F_WRITE | F_NEXT, 2),
                (STATUS, 1, F_WRITE, 0),
            ],
        )
        .expect("get id");
        assert_eq!(id.data_len(), u64::from(VIRTIO_BLK_ID_BYTES));
    }

    #[test]
    fn each_bad_request_is_refused_with_its_own_message() {
        let cases: [(u32, &[Desc], &str); 8] = [
            (
                VIRTIO_BLK_T_IN,
                &[(HDR, 16, F_WRITE, 0)],
                "has 1 descriptor(s); a request needs a header and a status",
            ),
            (
                VIRTIO_BLK_T_IN,
                &[(HDR, 16, F_WRITE | F_NEXT, 1), (STATUS, 1, F_WRITE, 0)],
                "request header must be a device-readable buffer of at least 16 bytes (got len 16, write-only true)",
            ),
            (
                VIRTIO_BLK_T_IN,
                &[(HDR, 8, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)],
                "(got len 8, write-only false)",
            ),
            (
                VIRTIO_BLK_T_FLUSH,
                &[(HDR, 16, F_NEXT, 1), (STATUS, 1, 0, 0)],
                "status must be a device-writable buffer of at least 1 byte (got len 1, write-only false)",
            ),
            (
                VIRTIO_BLK_T_IN,
                &[(HDR, 16, F_NEXT, 1), (DATA, 512, F_NEXT, 2), (STATUS, 1, F_WRITE, 0)],
                "data buffer 0x9000+0x200 has the wrong direction for request type 0",
            ),
            (
                VIRTIO_BLK_T_OUT,
                &[(HDR, 16, F_NEXT, 1), (DATA, 100, F_NEXT, 2), (STATUS, 1, F_WRITE, 0)],
                "data length 100 is not a multiple of 512",
            ),
            (
                VIRTIO_BLK_T_OUT,
                &[(HDR, 16, F_NEXT, 1), (1 << 40, 512, F_NEXT, 2), (STATUS, 1, F_WRITE, 0)],
                "buffer 0x10000000000+0x200 lies outside guest memory",
            ),
            (
                VIRTIO_BLK_T_IN,
                &[(HDR, 16, F_NEXT, 1), (0xf_ff00, 0x200, F_WRITE | F_NEXT, 2), (STATUS, 1, F_WRITE, 0)],
                "buffer 0xfff00+0x200 lies outside guest memory",
            ),
        ];
        for (request_type, descs, want) in cases {
            let err = parse_chain(request_type, descs).expect_err(want);
            assert!(err.to_string().contains(want), "{err} lacks {want:?}");
        }
    }

    #[test]
    fn unterminated_chains_are_named_apart() {
        let mem = mem();
        let looped = collect(
            &mem,
            &[(HDR, 16, F_NEXT, 1), (STATUS, 1, F_WRITE | F_NEXT, 0)],
        )
        .expect_err("loop");
        assert_eq!(
            looped.to_string(),
            "descriptor chain: the chain has no end: it loops after 2 descriptor(s), descriptor 1 linking back to descriptor 0"
        );
        let long: Vec<Desc> = (0..SIZE)
            .map(|i| (HDR, 16, F_NEXT, (i + 1) % SIZE))
            .collect();
        let err = collect(&mem, &long).expect_err("long");
        assert!(
            err.to_string().contains(
                "loops after 16 descriptor(s), descriptor 15 linking back to descriptor 0"
            ),
            "{err}"
        );
        let err = collect(
            &mem,
            &[
                (HDR, 16, F_NEXT, 1),
                (STATUS, 1, F_WRITE | F_NEXT, SIZE + 5),
            ],
        )
        .expect_err("bad next");
        assert!(
            err.to_string().contains(
                "stops after 2 descriptor(s) without an end: the last names next index 21"
            ),
            "{err}"
        );
        // A status buffer for the error answer is found only when the last descriptor can take it.
        let ok = collect(&mem, &[(HDR, 16, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)]).expect("chain");
        assert_eq!(status_of(&mem, &ok), Some(GuestAddress(STATUS)));
        let ro = collect(&mem, &[(HDR, 16, F_NEXT, 1), (STATUS, 1, 0, 0)]).expect("chain");
        assert_eq!(status_of(&mem, &ro), None);
    }
}
