//! Polled virtio-blk driver: one request in flight, three-descriptor chains
//! (header, data, status), plus the deliberately malformed chains of `hostile`.

use crate::io::{pause, Deadline};
use crate::virtio::{
    Buf, Hostile, Queue, RingPage, Transport, DESC_F_NEXT, DESC_F_WRITE,
};

pub const DEVICE_ID: u32 = 2;
pub const SECTOR: usize = 512;
/// Sectors per request for the bulk commands; also the data buffer size.
pub const MAX_SECTORS_PER_REQUEST: usize = 8;
pub const DATA_SIZE: usize = SECTOR * MAX_SECTORS_PER_REQUEST;

const F_RO: u64 = 1 << 5;
const F_FLUSH: u64 = 1 << 9;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
pub const ID_BYTES: usize = 20;

const REQUEST_TIMEOUT_MS: u64 = 5000;

/// Header, status and data buffers of one block device, shared with the device.
#[repr(C, align(4096))]
pub struct BlkDma {
    pub ring: RingPage,
    pub data: [u8; DATA_SIZE],
    header: [u8; 16],
    status: [u8; 16],
}

impl BlkDma {
    pub const ZERO: BlkDma = BlkDma {
        ring: RingPage::ZERO,
        data: [0; DATA_SIZE],
        header: [0; 16],
        status: [0; 16],
    };
}

pub struct Blk {
    transport: Transport,
    ready: bool,
    /// A request posted by `blk-post` and not yet completed.
    posted: bool,
    features: u64,
    queue: Queue,
}

/// Outcome of one request: the device's status byte (0 = OK) or a driver-side failure.
pub type Status = Result<u8, &'static str>;

impl Blk {
    pub const fn new(base: usize) -> Blk {
        Blk {
            transport: Transport { base },
            ready: false,
            posted: false,
            features: 0,
            queue: Queue::empty(),
        }
    }

    /// Initialises the device on first use (and again after a hostile test).
    pub fn ensure_ready(&mut self, dma: &mut BlkDma, tpm: u64) -> Result<(), &'static str> {
        if self.ready {
            return Ok(());
        }
        let features = self.transport.begin_init(
            tpm,
            DEVICE_ID,
            F_RO | F_FLUSH,
            &mut [&mut self.queue],
            &mut [&mut dma.ring],
        )?;
        self.transport.finish_init()?;
        self.posted = false;
        self.features = features;
        self.ready = true;
        Ok(())
    }

    pub fn capacity(&self) -> u64 {
        self.transport.config_u64(0)
    }
    pub fn read_only(&self) -> bool {
        self.features & F_RO != 0
    }
    pub fn has_flush(&self) -> bool {
        self.features & F_FLUSH != 0
    }

    fn write_header(dma: &mut BlkDma, kind: u32, sector: u64) {
        dma.header[0..4].copy_from_slice(&kind.to_le_bytes());
        dma.header[4..8].copy_from_slice(&0u32.to_le_bytes());
        dma.header[8..16].copy_from_slice(&sector.to_le_bytes());
        // A value the device never writes, so a missing status write is visible.
        dma.status[0] = 0xff;
    }

    /// Posts a one-sector read of `sector` into `dma.data` to the avail ring without
    /// notifying the device; `complete_posted` notifies and waits.
    pub fn post_read(&mut self, dma: &mut BlkDma, sector: u64) {
        Self::write_header(dma, T_IN, sector);
        dma.data[..SECTOR].fill(0);
        let header = dma.header.as_ptr() as u64;
        let status = dma.status.as_ptr() as u64;
        let q = &mut self.queue;
        q.set_desc(0, header, 16, DESC_F_NEXT, 1);
        q.set_desc(
            1,
            dma.data.as_ptr() as u64,
            SECTOR as u32,
            DESC_F_NEXT | DESC_F_WRITE,
            2,
        );
        q.set_desc(2, status, 1, DESC_F_WRITE, 0);
        q.push(0);
        self.posted = true;
    }

    /// Whether a request posted by `post_read` has not been completed yet.
    pub fn has_posted(&self) -> bool {
        self.posted
    }

    /// Notifies the device of the posted request and waits for its completion.
    pub fn complete_posted(&mut self, dma: &mut BlkDma, tpm: u64) -> Status {
        if !self.posted {
            return Err("nothing-posted");
        }
        self.posted = false;
        self.transport.notify(&self.queue);
        self.wait_used(dma, tpm)
    }

    /// Waits for the used element of the request with head 0 and returns its status.
    fn wait_used(&mut self, dma: &mut BlkDma, tpm: u64) -> Status {
        let deadline = Deadline::after_ms(tpm, REQUEST_TIMEOUT_MS);
        loop {
            if let Some((id, _len)) = self.queue.pop_used() {
                if id != 0 {
                    return Err("unexpected-used-id");
                }
                // SAFETY: the status byte is shared with the device, which has finished.
                return Ok(unsafe { core::ptr::read_volatile(dma.status.as_ptr()) });
            }
            if deadline.passed() {
                // The queue is now out of step with the device: start over next time.
                self.ready = false;
                return Err("timeout");
            }
            pause();
        }
    }

    /// Sends one request whose data is `data_len` bytes at the start of `dma.data`
    /// (none when 0) and waits for its completion. The guest sends what it is asked
    /// to, even to a read-only device or one without flush: the device's answer is
    /// what the tests check.
    fn request(
        &mut self,
        dma: &mut BlkDma,
        tpm: u64,
        kind: u32,
        sector: u64,
        data_len: usize,
    ) -> Status {
        Self::write_header(dma, kind, sector);
        let device_writes = kind == T_IN || kind == T_GET_ID;
        let header = dma.header.as_ptr() as u64;
        let status = dma.status.as_ptr() as u64;
        let q = &mut self.queue;
        if data_len == 0 {
            q.set_desc(0, header, 16, DESC_F_NEXT, 1);
            q.set_desc(1, status, 1, DESC_F_WRITE, 0);
        } else {
            let data_flags = DESC_F_NEXT | if device_writes { DESC_F_WRITE } else { 0 };
            q.set_desc(0, header, 16, DESC_F_NEXT, 1);
            q.set_desc(1, dma.data.as_ptr() as u64, data_len as u32, data_flags, 2);
            q.set_desc(2, status, 1, DESC_F_WRITE, 0);
        }
        q.push(0);
        self.transport.notify(&self.queue);
        self.wait_used(dma, tpm)
    }

    /// Reads `sectors` (1..=8) sectors into `dma.data`.
    pub fn read(&mut self, dma: &mut BlkDma, tpm: u64, sector: u64, sectors: usize) -> Status {
        self.request(
            dma,
            tpm,
            T_IN,
            sector,
            sectors.min(MAX_SECTORS_PER_REQUEST) * SECTOR,
        )
    }

    /// Writes the first `sectors` (1..=8) sectors of `dma.data`.
    pub fn write(&mut self, dma: &mut BlkDma, tpm: u64, sector: u64, sectors: usize) -> Status {
        self.request(
            dma,
            tpm,
            T_OUT,
            sector,
            sectors.min(MAX_SECTORS_PER_REQUEST) * SECTOR,
        )
    }

    pub fn flush(&mut self, dma: &mut BlkDma, tpm: u64) -> Status {
        self.request(dma, tpm, T_FLUSH, 0, 0)
    }

    /// Reads the device id string into the first 20 bytes of `dma.data`.
    pub fn get_id(&mut self, dma: &mut BlkDma, tpm: u64) -> Status {
        dma.data[..ID_BYTES].fill(0);
        self.request(dma, tpm, T_GET_ID, 0, ID_BYTES)
    }

    /// Posts a malformed chain, notifies, gives the device a moment, then resets the
    /// device and sets it up again.
    pub fn hostile(
        &mut self,
        dma: &mut BlkDma,
        tpm: u64,
        kind: Hostile,
        beyond_memory: u64,
    ) -> Result<(), &'static str> {
        Self::write_header(dma, T_IN, 0);
        let buf = |addr: *const u8, len: usize, writable| Buf {
            addr: addr as u64,
            len: len as u32,
            writable,
        };
        let header = buf(dma.header.as_ptr(), 16, false);
        let status = buf(dma.status.as_ptr(), 1, true);
        let q = &mut self.queue;
        match kind {
            Hostile::OutOfBounds => {
                let beyond = Buf {
                    addr: beyond_memory,
                    len: SECTOR as u32,
                    writable: true,
                };
                q.set_chain(&[header, beyond, status]);
                q.push(0);
            }
            // Loop and long chains are device-readable throughout, so that a device meets
            // the cycle itself rather than a read-after-write order error first.
            Hostile::Loop => {
                q.set_unterminated_chain(kind, header, buf(dma.data.as_ptr(), SECTOR, false));
                q.push(0);
            }
            Hostile::Long => {
                q.set_unterminated_chain(kind, header, buf(dma.data.as_ptr(), 16, false));
                q.push(0);
            }
            Hostile::BadNext => {
                q.set_unterminated_chain(kind, header, buf(dma.data.as_ptr(), SECTOR, true));
                q.push(0);
            }
            Hostile::WrongDirection => {
                q.set_chain(&[
                    buf(dma.header.as_ptr(), 16, true),
                    buf(dma.data.as_ptr(), SECTOR, true),
                    buf(dma.status.as_ptr(), 1, false),
                ]);
                q.push(0);
            }
            Hostile::BadAvail => {
                q.set_chain(&[header, buf(dma.data.as_ptr(), SECTOR, true), status]);
                q.push_jumped(0);
            }
        }
        self.transport.notify(&self.queue);
        self.transport.wait_hostile_met(&mut self.queue, tpm)?;
        self.ready = false;
        self.posted = false;
        self.ensure_ready(dma, tpm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_layout() {
        let mut dma = Box::new(BlkDma::ZERO);
        Blk::write_header(&mut dma, T_OUT, 0x0102_0304_0506_0708);
        assert_eq!(dma.header, [1, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(dma.status[0], 0xff);
    }
}
