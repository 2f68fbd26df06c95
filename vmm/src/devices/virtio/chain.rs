//! The descriptor-chain validator that virtio devices share: a chain from a hostile guest
//! either becomes a list of checked buffers or a [`ChainError`] that names what is wrong.

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, GuestAddress, GuestMemoryBackend};

/// Why a descriptor chain was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    /// The head index is beyond the queue, or the descriptor table is unreadable.
    #[error("head index {head} is beyond the queue of {size} or its descriptor is unreadable")]
    HeadBeyondQueue {
        /// Head index.
        head: u16,
        /// Queue size.
        size: u16,
    },
    /// A descriptor names a next index beyond the queue.
    #[error("a descriptor names next index {next}, beyond the queue of {size}")]
    NextBeyondQueue {
        /// The bad index.
        next: u16,
        /// Queue size.
        size: u16,
    },
    /// The chain has no end: it comes back to a descriptor it already passed.
    #[error("the chain has no end: it loops after {count} descriptor(s), descriptor {from} linking back to descriptor {to}")]
    Loops {
        /// Distinct descriptors before the chain comes back.
        count: usize,
        /// The descriptor whose next index closes the loop.
        from: u16,
        /// The descriptor it links back to.
        to: u16,
    },
    /// The chain ended early for another reason (an indirect table, or a next index the
    /// device could not follow).
    #[error("the chain stops after {count} descriptor(s) without an end: the last names next index {next}, which could not be read")]
    Unterminated {
        /// Descriptors read.
        count: usize,
        /// The last descriptor's next index.
        next: u16,
    },
    /// A buffer lies outside guest memory.
    #[error("buffer {addr:#x}+{len:#x} lies outside guest memory")]
    OutOfMemory {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// A device-readable buffer follows a device-writable one.
    #[error("device-readable buffer {addr:#x}+{len:#x} follows a device-writable one")]
    ReadableAfterWritable {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// The chain holds buffers of a direction the queue does not take.
    #[error("the chain has {0}; this queue takes {1}")]
    WrongDirection(&'static str, &'static str),
    /// The chain's buffers add up to more than the device accepts.
    #[error("the chain's {direction} buffers hold more than {limit} bytes")]
    TooLong {
        /// "device-readable" or "device-writable".
        direction: &'static str,
        /// The limit.
        limit: u64,
    },
}

/// A checked chain: every buffer lies in guest memory; device-readable buffers come first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Head index, to return the chain.
    pub head: u16,
    /// Device-readable buffers (guest address, length).
    pub readable: Vec<(GuestAddress, u32)>,
    /// Device-writable buffers (guest address, length).
    pub writable: Vec<(GuestAddress, u32)>,
}

/// What a queue accepts.
#[derive(Debug, Clone, Copy)]
pub struct ChainRules {
    /// The queue's size (a chain never has more descriptors).
    pub queue_size: u16,
    /// Most bytes in device-readable buffers; 0 refuses any.
    pub max_readable: u64,
    /// Most bytes in device-writable buffers; 0 refuses any.
    pub max_writable: u64,
}

impl Chain {
    /// Total length of the device-readable buffers.
    pub fn readable_len(&self) -> u64 {
        self.readable.iter().map(|(_, len)| u64::from(*len)).sum()
    }

    /// Total length of the device-writable buffers.
    pub fn writable_len(&self) -> u64 {
        self.writable.iter().map(|(_, len)| u64::from(*len)).sum()
    }

    /// Validates `chain` against guest memory and `rules`.
    pub fn validate(
        mem: &GuestMemoryMmap,
        chain: DescriptorChain<&GuestMemoryMmap>,
        rules: &ChainRules,
    ) -> Result<Chain, ChainError> {
        let head = chain.head_index();
        let descriptors: Vec<Descriptor> = chain.collect();
        check_termination(head, &descriptors, rules.queue_size)?;
        let mut out = Chain {
            head,
            readable: Vec::new(),
            writable: Vec::new(),
        };
        for desc in &descriptors {
            let (addr, len) = (desc.addr(), desc.len());
            check_range(mem, addr, len)?;
            if desc.is_write_only() {
                out.writable.push((addr, len));
            } else if !out.writable.is_empty() {
                return Err(ChainError::ReadableAfterWritable {
                    addr: addr.raw_value(),
                    len,
                });
            } else {
                out.readable.push((addr, len));
            }
        }
        check_direction(&out, rules)?;
        Ok(out)
    }
}

/// Checks that a collected chain (the descriptors a `DescriptorChain` yielded from `head`
/// in a queue of `size`) ends: the reason it does not, named.
pub fn check_termination(
    head: u16,
    descriptors: &[Descriptor],
    size: u16,
) -> Result<(), ChainError> {
    let Some(last) = descriptors.last() else {
        return Err(ChainError::HeadBeyondQueue { head, size });
    };
    if !last.has_next() {
        return Ok(());
    }
    if let Some(looped) = find_loop(head, descriptors) {
        return Err(looped);
    }
    if last.next() >= size {
        return Err(ChainError::NextBeyondQueue {
            next: last.next(),
            size,
        });
    }
    Err(ChainError::Unterminated {
        count: descriptors.len(),
        next: last.next(),
    })
}

/// The first descriptor whose next index leads back into the chain, if any.
fn find_loop(head: u16, descriptors: &[Descriptor]) -> Option<ChainError> {
    let mut seen = vec![head];
    for desc in descriptors {
        if !desc.has_next() {
            return None;
        }
        let next = desc.next();
        if seen.contains(&next) {
            return Some(ChainError::Loops {
                count: seen.len(),
                from: seen.last().copied().unwrap_or(head),
                to: next,
            });
        }
        seen.push(next);
    }
    None
}

/// Checks that `len` bytes at `addr` lie in guest memory (a zero length always does).
pub(crate) fn check_range(
    mem: &GuestMemoryMmap,
    addr: GuestAddress,
    len: u32,
) -> Result<(), ChainError> {
    if len == 0 {
        return Ok(());
    }
    let err = ChainError::OutOfMemory {
        addr: addr.raw_value(),
        len,
    };
    addr.checked_add(u64::from(len) - 1).ok_or(err.clone())?;
    if !mem.check_range(addr, len as usize) {
        return Err(err);
    }
    Ok(())
}

fn check_direction(chain: &Chain, rules: &ChainRules) -> Result<(), ChainError> {
    const READABLE: &str = "device-readable buffers";
    const WRITABLE: &str = "device-writable buffers";
    if rules.max_readable == 0 && !chain.readable.is_empty() {
        return Err(ChainError::WrongDirection(READABLE, WRITABLE));
    }
    if rules.max_writable == 0 && !chain.writable.is_empty() {
        return Err(ChainError::WrongDirection(WRITABLE, READABLE));
    }
    if chain.readable_len() > rules.max_readable {
        return Err(ChainError::TooLong {
            direction: "device-readable",
            limit: rules.max_readable,
        });
    }
    if chain.writable_len() > rules.max_writable {
        return Err(ChainError::TooLong {
            direction: "device-writable",
            limit: rules.max_writable,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::{Queue, QueueT};
    use vm_memory::Bytes;

    const SIZE: u16 = 8;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const RULES: ChainRules = ChainRules {
        queue_size: SIZE,
        max_readable: 4096,
        max_writable: 4096,
    };

    /// A descriptor: address, length, flags, next.
    type Desc = (u64, u32, u16, u16);

    fn rig(descs: &[Desc]) -> (GuestMemoryMmap, Queue) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("mem");
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
        (mem, q)
    }

    fn check(descs: &[Desc], rules: &ChainRules) -> Result<Chain, ChainError> {
        let (mem, mut q) = rig(descs);
        let chain = q.pop_descriptor_chain(&mem).expect("a chain");
        Chain::validate(&mem, chain, rules)
    }

    #[test]
    fn good_chain_splits_by_direction() {
        let chain = check(
            &[(0x8000, 12, F_NEXT, 1), (0x9000, 100, F_WRITE, 0)],
            &RULES,
        )
        .expect("valid");
        assert_eq!(chain.readable, vec![(GuestAddress(0x8000), 12)]);
        assert_eq!(chain.writable_len(), 100);
    }

    #[test]
    fn hostile_chains_are_named() {
        let cases: [(&[Desc], &str); 6] = [
            (
                &[(0x8000, 12, F_NEXT, 9)],
                "next index 9, beyond the queue of 8",
            ),
            (
                &[(0x8000, 12, F_NEXT, 0)],
                "loops after 1 descriptor(s), descriptor 0 linking back to descriptor 0",
            ),
            (
                &[
                    (0x8000, 12, F_NEXT, 1),
                    (0x9000, 12, F_NEXT, 2),
                    (0xa000, 4, F_NEXT, 1),
                ],
                "loops after 3 descriptor(s), descriptor 2 linking back to descriptor 1",
            ),
            (&[(1 << 40, 12, 0, 0)], "lies outside guest memory"),
            (
                &[(0x8000, 12, F_WRITE | F_NEXT, 1), (0x9000, 12, 0, 0)],
                "follows a device-writable one",
            ),
            (&[(0xf_fff0, 0x20, 0, 0)], "lies outside guest memory"),
        ];
        for (descs, want) in cases {
            let err = check(descs, &RULES).expect_err("must fail");
            assert!(err.to_string().contains(want), "{err} lacks {want:?}");
        }
    }

    #[test]
    fn direction_and_length_limits() {
        let tx = ChainRules {
            max_writable: 0,
            ..RULES
        };
        let err = check(&[(0x8000, 12, F_WRITE, 0)], &tx).expect_err("writable on TX");
        assert_eq!(
            err.to_string(),
            "the chain has device-writable buffers; this queue takes device-readable buffers"
        );
        let err = check(&[(0x8000, 5000, 0, 0)], &RULES).expect_err("too long");
        assert!(err.to_string().contains("more than 4096 bytes"), "{err}");
    }
}
