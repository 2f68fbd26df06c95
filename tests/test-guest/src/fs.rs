//! virtio-fs driver: a FUSE client just big enough to append records to files on a shared
//! volume (FUSE_INIT, FUSE_CREATE with O_APPEND, FUSE_WRITE, FUSE_RELEASE), one request in
//! flight on the first request queue.
//!
//! A request waits for its answer by halting, not spinning (every spin is emulated on PVM
//! hosts, and 65 guests spinning starve their virtiofsd processes): look at the used ring,
//! `sti; hlt` until the device's interrupt or, at the latest, the PIT's one-shot about 55 ms
//! on, acknowledge at the device, look again, until the answer or the TSC deadline. FUSE_INIT
//! is polled; halting starts only once its answer showed that the device's line reaches the
//! PIC (it is latched there) and the timer probe saw the PIT pulse, so a guest whose
//! interrupts do not arrive polls as before instead of sleeping for good.

use crate::io::{hex_digit, pause, Deadline};
use crate::irq::{self, Line};
use crate::virtio::{Queue, RingPage, Transport, DESC_F_NEXT, DESC_F_WRITE, INTERRUPT_USED_RING};

pub const DEVICE_ID: u32 = 26;

const FUSE_WRITE: u32 = 16;
const FUSE_RELEASE: u32 = 18;
const FUSE_INIT: u32 = 26;
const FUSE_CREATE: u32 = 35;
const FUSE_KERNEL_VERSION: u32 = 7;
const FUSE_MINOR_VERSION: u32 = 31;
const ROOT_NODE: u64 = 1;
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
/// fuse_entry_out (128 bytes) then fuse_open_out (16): FUSE_CREATE's answer.
const ENTRY_OUT: usize = 128;
/// fuse_write_in: fh, offset, size, write_flags, lock_owner, flags, padding.
const WRITE_IN: usize = 40;

const O_WRONLY: u32 = 0o1;
const O_CREAT: u32 = 0o100;
const O_APPEND: u32 = 0o2000;

/// One fixed-form record: 16 hex digits of the writer's VM generation, a space, a
/// 6-digit sequence number, a newline.
pub const RECORD_LEN: usize = 24;
/// Where a record's six sequence digits start.
const SEQ_AT: usize = 17;
const REQUEST_TIMEOUT_MS: u64 = 10_000;

/// The rings and the one request and answer buffer, shared with the device.
#[repr(C, align(4096))]
pub struct FsDma {
    hiprio: RingPage,
    requests: RingPage,
    request: [u8; 4096],
    answer: [u8; 4096],
}

impl FsDma {
    pub const ZERO: FsDma = FsDma {
        hiprio: RingPage::ZERO,
        requests: RingPage::ZERO,
        request: [0; 4096],
        answer: [0; 4096],
    };
}

/// A file opened by FUSE_CREATE.
#[derive(Clone, Copy)]
struct Open {
    node: u64,
    handle: u64,
}

pub struct Fs {
    transport: Transport,
    /// The device's interrupt (GSI), from the command line.
    irq: u64,
    ready: bool,
    /// Requests wait in `hlt` (see the module's doc); else they poll.
    halts: bool,
    hiprio: Queue,
    queue: Queue,
    unique: u64,
}

impl Fs {
    pub const fn new(base: usize, irq: u64) -> Fs {
        Fs {
            transport: Transport { base },
            irq,
            ready: false,
            halts: false,
            hiprio: Queue::empty(),
            queue: Queue::empty(),
            unique: 0,
        }
    }

    /// Initialises the device and the FUSE session; the FUSE minor version the device speaks.
    /// Then decides how later requests wait ([`Fs::halts`]).
    pub fn init(&mut self, dma: &mut FsDma, tpm: u64) -> Result<u32, &'static str> {
        // Before the first request: programming the PICs clears what they latched.
        irq::init();
        self.halts = false;
        self.transport.begin_init(
            tpm,
            DEVICE_ID,
            0,
            &mut [&mut self.hiprio, &mut self.queue],
            &mut [&mut dma.hiprio, &mut dma.requests],
        )?;
        self.transport.finish_init()?;
        self.ready = true;
        let mut init = [0u8; 16];
        init[0..4].copy_from_slice(&FUSE_KERNEL_VERSION.to_le_bytes());
        init[4..8].copy_from_slice(&FUSE_MINOR_VERSION.to_le_bytes());
        let answer = self.call(dma, tpm, FUSE_INIT, 0, &[&init], 64)?;
        if read_u32(answer, 0) != FUSE_KERNEL_VERSION {
            return Err("fuse-major-version");
        }
        let minor = read_u32(answer, 4);
        self.halts = self.interrupts_arrive(tpm);
        Ok(minor)
    }

    /// Whether requests wait by halting (else by polling).
    pub fn halts(&self) -> bool {
        self.halts
    }

    /// Whether the device's answer to FUSE_INIT pulsed its line at the PIC and the PIT
    /// pulses too; then both lines are unmasked for halting.
    fn interrupts_arrive(&self, tpm: u64) -> bool {
        let Some(line) = Line::of(self.irq) else {
            return false;
        };
        if !irq::latches(line, tpm) || !irq::timer_works(tpm) {
            return false;
        }
        irq::unmask(line);
        irq::unmask(Line::TIMER);
        true
    }

    /// Appends `count` records to `<generation>.log` and then `count` to `common`, both
    /// opened with O_APPEND, and closes them.
    pub fn append(
        &mut self,
        dma: &mut FsDma,
        tpm: u64,
        generation: u64,
        count: u64,
    ) -> Result<(), &'static str> {
        if !self.ready {
            return Err("fs-not-initialised");
        }
        let mut name = [0u8; 21];
        hex16(generation, &mut name[..16]);
        name[16..20].copy_from_slice(b".log");
        let own = self.create(dma, tpm, &name)?;
        let common = self.create(dma, tpm, b"common\0")?;
        for file in [own, common] {
            self.write_records(dma, tpm, file, generation, count)?;
        }
        self.release(dma, tpm, own)?;
        self.release(dma, tpm, common)
    }

    /// FUSE_CREATE of `name` (NUL-terminated) in the root, write-only, appending.
    fn create(&mut self, dma: &mut FsDma, tpm: u64, name: &[u8]) -> Result<Open, &'static str> {
        let mut create = [0u8; 16];
        create[0..4].copy_from_slice(&(O_WRONLY | O_CREAT | O_APPEND).to_le_bytes());
        create[4..8].copy_from_slice(&0o100644u32.to_le_bytes());
        let answer = self.call(
            dma,
            tpm,
            FUSE_CREATE,
            ROOT_NODE,
            &[&create, name],
            ENTRY_OUT + 16,
        )?;
        if answer.len() < ENTRY_OUT + 8 {
            return Err("short-create-answer");
        }
        Ok(Open {
            node: read_u64(answer, 0),
            handle: read_u64(answer, ENTRY_OUT),
        })
    }

    /// Appends `count` records to `file`, one FUSE_WRITE each. The request is built once;
    /// between writes only its `unique` and the record's digits change (every instruction of
    /// this guest is emulated on PVM hosts, so this is most of the work saved).
    fn write_records(
        &mut self,
        dma: &mut FsDma,
        tpm: u64,
        file: Open,
        generation: u64,
        count: u64,
    ) -> Result<(), &'static str> {
        let mut write = [0u8; WRITE_IN];
        write[0..8].copy_from_slice(&file.handle.to_le_bytes());
        // The offset is ignored: the file is open with O_APPEND.
        write[16..20].copy_from_slice(&(RECORD_LEN as u32).to_le_bytes());
        write[32..36].copy_from_slice(&(O_WRONLY | O_APPEND).to_le_bytes());
        let len = self.prepare(
            dma,
            FUSE_WRITE,
            file.node,
            &[&write, &first_record(generation)],
        )?;
        for _ in 0..count {
            let answer = self.send(dma, tpm, len, 8)?;
            if read_u32(answer, 0) as usize != RECORD_LEN {
                return Err("short-write");
            }
            const DIGITS: usize = IN_HEADER + WRITE_IN + SEQ_AT;
            increment_decimal(&mut dma.request[DIGITS..DIGITS + 6]);
        }
        Ok(())
    }

    fn release(&mut self, dma: &mut FsDma, tpm: u64, file: Open) -> Result<(), &'static str> {
        let mut release = [0u8; 24];
        release[0..8].copy_from_slice(&file.handle.to_le_bytes());
        release[8..12].copy_from_slice(&(O_WRONLY | O_APPEND).to_le_bytes());
        self.call(dma, tpm, FUSE_RELEASE, file.node, &[&release], 0)?;
        Ok(())
    }

    /// Sends one FUSE request (header, then `args`) and waits for its answer; the answer's
    /// body (after the out header) on success, the errno as an error name otherwise.
    fn call<'a>(
        &mut self,
        dma: &'a mut FsDma,
        tpm: u64,
        opcode: u32,
        node: u64,
        args: &[&[u8]],
        answer_room: usize,
    ) -> Result<&'a [u8], &'static str> {
        let len = self.prepare(dma, opcode, node, args)?;
        self.send(dma, tpm, len, answer_room)
    }

    /// Writes a request's header (`send` sets its `unique`) and arguments; its length.
    fn prepare(
        &mut self,
        dma: &mut FsDma,
        opcode: u32,
        node: u64,
        args: &[&[u8]],
    ) -> Result<usize, &'static str> {
        let len = IN_HEADER + args.iter().map(|a| a.len()).sum::<usize>();
        if len > dma.request.len() {
            return Err("request-too-large");
        }
        let header = &mut dma.request[..IN_HEADER];
        header.fill(0);
        header[0..4].copy_from_slice(&(len as u32).to_le_bytes());
        header[4..8].copy_from_slice(&opcode.to_le_bytes());
        header[16..24].copy_from_slice(&node.to_le_bytes());
        // Byte by byte: slicing by run-time lengths would bring in the panic formatter.
        let mut slots = dma.request.iter_mut().skip(IN_HEADER);
        for (slot, byte) in (&mut slots).zip(args.iter().flat_map(|a| a.iter())) {
            *slot = *byte;
        }
        Ok(len)
    }

    /// Sends the prepared request of `len` bytes under a new `unique` and waits for its
    /// answer, as [`Fs::call`] does.
    fn send<'a>(
        &mut self,
        dma: &'a mut FsDma,
        tpm: u64,
        len: usize,
        answer_room: usize,
    ) -> Result<&'a [u8], &'static str> {
        if OUT_HEADER + answer_room > dma.answer.len() {
            return Err("request-too-large");
        }
        self.unique = self.unique.wrapping_add(2);
        dma.request[8..16].copy_from_slice(&self.unique.to_le_bytes());
        let q = &mut self.queue;
        q.set_desc(0, dma.request.as_ptr() as u64, len as u32, DESC_F_NEXT, 1);
        q.set_desc(
            1,
            dma.answer.as_ptr() as u64,
            (OUT_HEADER + answer_room) as u32,
            DESC_F_WRITE,
            0,
        );
        q.push(0);
        self.transport.notify(&self.queue);
        let deadline = Deadline::after_ms(tpm, REQUEST_TIMEOUT_MS);
        let mut polls = 0u32;
        let written = loop {
            if let Some((id, written)) = self.queue.pop_used() {
                if id != 0 {
                    return Err("unexpected-used-id");
                }
                break written as usize;
            }
            // The clock after every halt, else only now and then: reading it may exit to the
            // hypervisor.
            polls = polls.wrapping_add(1);
            if (self.halts || polls.is_multiple_of(256)) && deadline.passed() {
                self.ready = false;
                return Err("timeout");
            }
            if self.halts {
                // Woken by the device, the timer or another unmasked line: the ring says which.
                irq::halt_bounded();
                self.transport.ack_interrupt(INTERRUPT_USED_RING);
            } else {
                pause();
            }
        };
        // SAFETY: the device has finished with the answer buffer; volatile reads see its
        // writes rather than values the compiler kept from before the request.
        let out_len = unsafe { core::ptr::read_volatile(dma.answer.as_ptr() as *const u32) };
        if written < OUT_HEADER || (out_len as usize) < OUT_HEADER {
            return Err("short-answer");
        }
        let answer = dma
            .answer
            .get(..(out_len as usize).min(written))
            .unwrap_or(&[]);
        if read_u64(answer, 8) != self.unique {
            return Err("answer-for-another-request");
        }
        match read_u32(answer, 4) as i32 {
            0 => Ok(answer.get(OUT_HEADER..).unwrap_or(&[])),
            -2 => Err("ENOENT"),
            -13 => Err("EACCES"),
            -30 => Err("EROFS"),
            -28 => Err("ENOSPC"),
            _ => Err("fuse-error"),
        }
    }
}

fn read_u32(bytes: &[u8], at: usize) -> u32 {
    bytes
        .get(at..at.saturating_add(4))
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, u32::from_le_bytes)
}

/// The little-endian u64 at `at`, or 0 past the end.
fn read_u64(bytes: &[u8], at: usize) -> u64 {
    bytes
        .get(at..at.saturating_add(8))
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes)
}

/// Exactly 16 lower-case hex digits of `value` into `out`.
fn hex16(value: u64, out: &mut [u8]) {
    for (i, slot) in out.iter_mut().take(16).enumerate() {
        *slot = hex_digit(((value >> ((15 - i) * 4)) & 0xf) as u8);
    }
}

/// Adds one to the ASCII decimal number in `digits` (wrapping to zeros).
fn increment_decimal(digits: &mut [u8]) {
    for digit in digits.iter_mut().rev() {
        if *digit == b'9' {
            *digit = b'0';
        } else {
            *digit += 1;
            return;
        }
    }
}

/// Record 0 of the writer with `generation`; later ones count up its digits at [`SEQ_AT`].
fn first_record(generation: u64) -> [u8; RECORD_LEN] {
    let mut record = *b"0000000000000000 000000\n";
    hex16(generation, &mut record[..16]);
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_fixed_form() {
        let mut record = first_record(0xab);
        for _ in 0..42 {
            increment_decimal(&mut record[SEQ_AT..SEQ_AT + 6]);
        }
        assert_eq!(&record, b"00000000000000ab 000042\n");
    }

    #[test]
    fn decimal_counters_carry() {
        let mut digits = *b"000199";
        increment_decimal(&mut digits);
        assert_eq!(&digits, b"000200");
        let mut all = *b"999999";
        increment_decimal(&mut all);
        assert_eq!(&all, b"000000");
    }
}
