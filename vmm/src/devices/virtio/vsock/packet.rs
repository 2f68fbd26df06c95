//! The virtio-vsock packet header and moving packets through guest descriptor chains.

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

/// Size of the packet header.
pub const HEADER_LEN: usize = 44;
/// Size of an event (`struct virtio_vsock_event`: a u32 id).
pub const EVENT_LEN: u32 = 4;
/// Stream sockets, the only type offered.
pub const TYPE_STREAM: u16 = 1;

/// Packet operations.
pub mod op {
    /// Connect.
    pub const REQUEST: u16 = 1;
    /// Accept.
    pub const RESPONSE: u16 = 2;
    /// Reset / refuse.
    pub const RST: u16 = 3;
    /// Half or full close.
    pub const SHUTDOWN: u16 = 4;
    /// Data.
    pub const RW: u16 = 5;
    /// Credit information.
    pub const CREDIT_UPDATE: u16 = 6;
    /// Ask for credit information.
    pub const CREDIT_REQUEST: u16 = 7;
}

/// SHUTDOWN flag: the sender will receive no more.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more.
pub const SHUTDOWN_SEND: u32 = 2;

/// The 44-byte little-endian packet header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketHeader {
    /// Source CID.
    pub src_cid: u64,
    /// Destination CID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type.
    pub type_: u16,
    /// Operation.
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// Sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed.
    pub fwd_cnt: u32,
}

impl PacketHeader {
    /// Decodes a header.
    pub fn from_bytes(b: &[u8; HEADER_LEN]) -> Self {
        let u64_at = |o: usize| {
            u64::from_le_bytes([
                b[o],
                b[o + 1],
                b[o + 2],
                b[o + 3],
                b[o + 4],
                b[o + 5],
                b[o + 6],
                b[o + 7],
            ])
        };
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

/// Why a guest buffer was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BufferError {
    /// The chain has no descriptor or no end (the shared validator says why).
    #[error("descriptor chain: {0}")]
    Chain(#[from] crate::devices::virtio::chain::ChainError),
    /// A buffer has the wrong direction.
    #[error(
        "descriptor {addr:#x}+{len:#x} is device-{is}; this queue takes device-{needs} buffers"
    )]
    WrongDirection {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u32,
        /// Its direction: "readable" or "writable".
        is: &'static str,
        /// The direction the queue needs.
        needs: &'static str,
    },
    /// A buffer lies outside guest memory.
    #[error("descriptor {addr:#x}+{len:#x} lies outside guest memory")]
    OutOfMemory {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// Too small for a header.
    #[error("{0} bytes are too few for the {HEADER_LEN}-byte packet header")]
    TooSmall(usize),
    /// The payload is shorter than the header claims, or longer than the limit.
    #[error("packet claims {claimed} payload bytes but carries {carried} (limit {limit})")]
    BadLength {
        /// Header's len.
        claimed: u32,
        /// Bytes present.
        carried: usize,
        /// Largest accepted.
        limit: usize,
    },
    /// The chain carries more than a header and the largest payload.
    #[error("descriptor chain carries more than {limit} bytes (header and largest payload)")]
    TooLong {
        /// Largest accepted.
        limit: usize,
    },
    /// An event buffer whose first descriptor cannot hold an event.
    #[error("event buffer of {0} bytes cannot take a {EVENT_LEN}-byte event")]
    EventTooSmall(u32),
}

/// Checks one descriptor's direction and range.
fn checked(
    mem: &GuestMemoryMmap,
    desc: &Descriptor,
    writable: bool,
) -> Result<(GuestAddress, usize), BufferError> {
    let (addr, len) = (desc.addr(), desc.len());
    if desc.is_write_only() != writable {
        let direction = |w| if w { "writable" } else { "readable" };
        return Err(BufferError::WrongDirection {
            addr: addr.0,
            len,
            is: direction(!writable),
            needs: direction(writable),
        });
    }
    if len > 0 && !mem.check_range(addr, len as usize) {
        return Err(BufferError::OutOfMemory { addr: addr.0, len });
    }
    Ok((addr, len as usize))
}

/// Collects a chain's descriptors, refusing chains that do not end within the queue.
pub fn collect_chain(
    chain: DescriptorChain<&GuestMemoryMmap>,
    queue_size: u16,
) -> Result<Vec<Descriptor>, BufferError> {
    let head = chain.head_index();
    let descriptors: Vec<Descriptor> = chain.collect();
    crate::devices::virtio::chain::check_termination(head, &descriptors, queue_size)?;
    Ok(descriptors)
}

/// Reads a guest TX packet from a collected chain: header plus up to `max_payload` bytes of
/// payload.
pub fn read_packet(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
    max_payload: usize,
) -> Result<(PacketHeader, Vec<u8>), BufferError> {
    let mut bytes = Vec::new();
    for desc in descriptors {
        let (addr, len) = checked(mem, desc, false)?;
        if bytes.len() + len > HEADER_LEN + max_payload {
            return Err(BufferError::TooLong {
                limit: HEADER_LEN + max_payload,
            });
        }
        let start = bytes.len();
        bytes.resize(start + len, 0);
        mem.read_slice(&mut bytes[start..], addr)
            .map_err(|_| BufferError::OutOfMemory {
                addr: addr.0,
                len: len as u32,
            })?;
    }
    let Some(head) = bytes
        .get(..HEADER_LEN)
        .and_then(|h| <&[u8; HEADER_LEN]>::try_from(h).ok())
    else {
        return Err(BufferError::TooSmall(bytes.len()));
    };
    let header = PacketHeader::from_bytes(head);
    let carried = bytes.len() - HEADER_LEN;
    if header.len as usize > carried || header.len as usize > max_payload {
        return Err(BufferError::BadLength {
            claimed: header.len,
            carried,
            limit: max_payload,
        });
    }
    let payload = bytes[HEADER_LEN..HEADER_LEN + header.len as usize].to_vec();
    Ok((header, payload))
}

/// The writable space of a guest RX buffer (a collected chain).
pub fn rx_capacity(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
) -> Result<usize, BufferError> {
    let mut total = 0usize;
    for desc in descriptors {
        total += checked(mem, desc, true)?.1;
    }
    if total < HEADER_LEN {
        return Err(BufferError::TooSmall(total));
    }
    Ok(total)
}

/// Where an event goes in a guest event buffer (a collected chain): its first descriptor,
/// which must be device-writable and hold an event; the rest must be device-writable too.
pub fn event_target(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
) -> Result<GuestAddress, BufferError> {
    for desc in descriptors {
        checked(mem, desc, true)?;
    }
    match descriptors.first() {
        Some(first) if first.len() >= EVENT_LEN => Ok(first.addr()),
        first => Err(BufferError::EventTooSmall(first.map_or(0, |d| d.len()))),
    }
}

/// Writes `header` and `payload` across the RX buffer's descriptors; returns bytes written.
pub fn write_packet(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
    header: &PacketHeader,
    payload: &[u8],
) -> Result<usize, BufferError> {
    let head = header.to_bytes();
    let mut parts = [&head[..], payload];
    let mut written = 0;
    for desc in descriptors {
        let (addr, len) = checked(mem, desc, true)?;
        let mut offset = 0;
        for part in parts.iter_mut() {
            if offset == len || part.is_empty() {
                continue;
            }
            let n = part.len().min(len - offset);
            mem.write_slice(&part[..n], GuestAddress(addr.0 + offset as u64))
                .map_err(|_| BufferError::OutOfMemory {
                    addr: addr.0,
                    len: len as u32,
                })?;
            *part = &part[n..];
            offset += n;
            written += n;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = PacketHeader {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1234,
            dst_port: 52,
            len: 7,
            type_: TYPE_STREAM,
            op: op::RW,
            flags: 0,
            buf_alloc: 65536,
            fwd_cnt: 99,
        };
        assert_eq!(PacketHeader::from_bytes(&h.to_bytes()), h);
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1_0000)]).expect("mem")
    }

    #[test]
    fn an_overlong_chain_is_refused_for_its_size_not_a_claimed_length() {
        let mem = mem();
        let header = PacketHeader {
            len: 8,
            ..PacketHeader::default()
        };
        mem.write_slice(&header.to_bytes(), GuestAddress(0))
            .expect("header");
        let chain = [
            Descriptor::new(0, HEADER_LEN as u32, 1, 1),
            Descriptor::new(0x1000, 100, 0, 0),
        ];
        assert_eq!(
            read_packet(&mem, &chain, 64),
            Err(BufferError::TooLong {
                limit: HEADER_LEN + 64
            })
        );
        assert!(read_packet(&mem, &chain, 100).is_ok());
    }

    #[test]
    fn event_buffers_must_be_writable_and_hold_an_event() {
        let mem = mem();
        let writable = Descriptor::new(0x100, EVENT_LEN, 2, 0);
        assert_eq!(event_target(&mem, &[writable]), Ok(GuestAddress(0x100)));
        assert!(matches!(
            event_target(&mem, &[Descriptor::new(0x100, EVENT_LEN, 0, 0)]),
            Err(BufferError::WrongDirection {
                is: "readable",
                needs: "writable",
                ..
            })
        ));
        assert_eq!(
            event_target(&mem, &[Descriptor::new(0x100, 2, 2, 0)]),
            Err(BufferError::EventTooSmall(2))
        );
        assert!(matches!(
            event_target(&mem, &[Descriptor::new(1 << 40, EVENT_LEN, 2, 0)]),
            Err(BufferError::OutOfMemory { .. })
        ));
    }
}
