//! What the VMM hands over: the Linux `boot_params` zero page (command line, e820 map)
//! and the virtio-mmio devices announced on the command line.

use crate::io::{parse_u64, split_word};
use crate::virtio::{mmio_read32, REG_DEVICE_ID, REG_MAGIC, VIRTIO_MAGIC};

const E820_ENTRIES_OFFSET: usize = 0x1e8;
const CMD_LINE_PTR_OFFSET: usize = 0x228;
const CMDLINE_SIZE_OFFSET: usize = 0x238;
const E820_TABLE_OFFSET: usize = 0x2d0;
const E820_ENTRY_SIZE: usize = 20;
const E820_MAX_ENTRIES: usize = 128;
/// The guest reads at most this much of the command line.
const CMDLINE_MAX: usize = 4096;

pub const MAX_DEVICES: usize = 16;

#[derive(Clone, Copy)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

#[derive(Clone, Copy)]
pub struct MmioDevice {
    pub addr: u64,
    pub irq: u64,
    /// `None` when the window's magic value is not "virt".
    pub device_id: Option<u32>,
}

pub struct BootInfo {
    params: usize,
    pub cmdline: &'static [u8],
    pub devices: [MmioDevice; MAX_DEVICES],
    pub device_count: usize,
}

fn read_u8(addr: usize) -> u8 {
    // SAFETY: `addr` lies in the zero page or a buffer the VMM described; the VMM's
    // identity map covers it.
    unsafe { core::ptr::read_volatile(addr as *const u8) }
}

fn read_u32(addr: usize) -> u32 {
    // SAFETY: as for `read_u8`; unaligned reads are fine on x86.
    unsafe { core::ptr::read_unaligned(addr as *const u32) }
}

fn read_u64(addr: usize) -> u64 {
    // SAFETY: as for `read_u8`.
    unsafe { core::ptr::read_unaligned(addr as *const u64) }
}

impl BootInfo {
    /// Reads the zero page at `params` (the RSI the VMM passed) and probes the devices
    /// named on the command line.
    pub fn read(params: usize) -> BootInfo {
        let cmdline = read_cmdline(params);
        let mut info = BootInfo {
            params,
            cmdline,
            devices: [MmioDevice {
                addr: 0,
                irq: 0,
                device_id: None,
            }; MAX_DEVICES],
            device_count: 0,
        };
        let mut rest = cmdline;
        while !rest.is_empty() {
            let (word, tail) = split_word(rest);
            rest = tail;
            if let Some((addr, irq)) = parse_virtio_mmio_arg(word) {
                if let Some(slot) = info.devices.get_mut(info.device_count) {
                    *slot = probe(addr, irq);
                    info.device_count += 1;
                }
            }
        }
        info
    }

    pub fn e820_count(&self) -> usize {
        (read_u8(self.params + E820_ENTRIES_OFFSET) as usize).min(E820_MAX_ENTRIES)
    }

    pub fn e820(&self, index: usize) -> E820Entry {
        let at = self.params + E820_TABLE_OFFSET + index * E820_ENTRY_SIZE;
        E820Entry {
            addr: read_u64(at),
            size: read_u64(at + 8),
            kind: read_u32(at + 16),
        }
    }

    pub fn devices(&self) -> &[MmioDevice] {
        self.devices.get(..self.device_count).unwrap_or(&[])
    }

    /// Whether usable RAM (e820 type 1) covers `start..end`, as one contiguous run of
    /// entries.
    pub fn ram_covers(&self, start: u64, end: u64) -> bool {
        let count = self.e820_count();
        ram_covers(|i| (i < count).then(|| self.e820(i)), start, end)
    }

    /// The end of the highest e820 range: used to aim a buffer past guest memory.
    pub fn memory_end(&self) -> u64 {
        (0..self.e820_count())
            .map(|i| {
                let e = self.e820(i);
                e.addr.saturating_add(e.size)
            })
            .max()
            .unwrap_or(0)
    }
}

fn read_cmdline(params: usize) -> &'static [u8] {
    let ptr = read_u32(params + CMD_LINE_PTR_OFFSET) as usize;
    let size = (read_u32(params + CMDLINE_SIZE_OFFSET) as usize).min(CMDLINE_MAX);
    if ptr == 0 {
        return &[];
    }
    let mut len = 0;
    while len < size && read_u8(ptr + len) != 0 {
        len += 1;
    }
    // SAFETY: the bytes ptr..ptr+len were just read, lie in identity-mapped guest
    // memory, and nothing writes the command line after boot.
    unsafe { core::slice::from_raw_parts(ptr as *const u8, len) }
}

const E820_RAM: u32 = 1;

/// Whether the RAM entries produced by `entry(0)`, `entry(1)`, ... (until `None`) cover
/// `start..end` without a gap.
fn ram_covers(entry: impl Fn(usize) -> Option<E820Entry>, start: u64, end: u64) -> bool {
    let mut covered = start;
    // Each pass extends the covered prefix by one entry; entries may come in any order.
    loop {
        if covered >= end {
            return true;
        }
        let mut extended = covered;
        let mut i = 0;
        while let Some(e) = entry(i) {
            let e_end = e.addr.saturating_add(e.size);
            if e.kind == E820_RAM && e.addr <= covered && e_end > extended {
                extended = e_end;
            }
            i += 1;
        }
        if extended == covered {
            return false;
        }
        covered = extended;
    }
}

/// The command-line argument whose value lists the boot commands.
const RUN_ARG: &[u8] = b"rollbox.test.run=";

/// The value of the command line's `rollbox.test.run=CMD1;CMD2;...` (the last one given), or
/// nothing: the commands the guest runs at boot, before it reads the serial port.
pub fn run_commands(cmdline: &[u8]) -> &[u8] {
    let mut found: &[u8] = &[];
    let mut rest = cmdline;
    while !rest.is_empty() {
        let (word, tail) = split_word(rest);
        rest = tail;
        if let Some(value) = word.strip_prefix(RUN_ARG) {
            found = value;
        }
    }
    found
}

/// The next boot command of `commands` (a `run_commands` value, `;`-separated), copied into
/// `line` with each `:` made a space, so that it reads as the serial line it stands for; and
/// the commands after it. Its length is `None` when it does not fit `line`. Empty commands
/// are skipped; `None` when none is left.
pub fn next_run_command<'a>(
    mut commands: &'a [u8],
    line: &mut [u8],
) -> Option<(Option<usize>, &'a [u8])> {
    loop {
        let (command, rest) = match commands.iter().position(|&c| c == b';') {
            Some(at) => match commands.split_at_checked(at) {
                Some((command, rest)) => (command, rest.get(1..).unwrap_or(&[])),
                None => (commands, &[][..]),
            },
            None => (commands, &[][..]),
        };
        if command.is_empty() {
            if rest.is_empty() {
                return None;
            }
            commands = rest;
            continue;
        }
        let Some(out) = line.get_mut(..command.len()) else {
            return Some((None, rest));
        };
        for (to, &from) in out.iter_mut().zip(command) {
            *to = if from == b':' { b' ' } else { from };
        }
        return Some((Some(command.len()), rest));
    }
}

/// `virtio_mmio.device=<size>@<addr>:<irq>[:<id>]` → (addr, irq).
fn parse_virtio_mmio_arg(word: &[u8]) -> Option<(u64, u64)> {
    let value = word.strip_prefix(b"virtio_mmio.device=")?;
    let at = value.iter().position(|&c| c == b'@')?;
    let (size, rest) = value.split_at_checked(at)?;
    parse_size(size)?;
    let rest = rest.get(1..)?;
    let colon = rest.iter().position(|&c| c == b':')?;
    let (addr, rest) = rest.split_at_checked(colon)?;
    let rest = rest.get(1..)?;
    let irq = match rest.iter().position(|&c| c == b':') {
        Some(end) => rest.get(..end)?,
        None => rest,
    };
    Some((parse_u64(addr)?, parse_u64(irq)?))
}

/// `4K`, `0x1000`, `1M`...
fn parse_size(text: &[u8]) -> Option<u64> {
    let (digits, shift) = match text {
        [head @ .., b'k' | b'K'] => (head, 10),
        [head @ .., b'm' | b'M'] => (head, 20),
        [head @ .., b'g' | b'G'] => (head, 30),
        _ => (text, 0),
    };
    parse_u64(digits)?.checked_mul(1u64 << shift)
}

fn probe(addr: u64, irq: u64) -> MmioDevice {
    let base = addr as usize;
    let device_id = if mmio_read32(base, REG_MAGIC) == VIRTIO_MAGIC {
        Some(mmio_read32(base, REG_DEVICE_ID))
    } else {
        None
    };
    MmioDevice {
        addr,
        irq,
        device_id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtio_mmio_entries_parse() {
        assert_eq!(
            parse_virtio_mmio_arg(b"virtio_mmio.device=4K@0xd0000000:5"),
            Some((0xd000_0000, 5))
        );
        assert_eq!(
            parse_virtio_mmio_arg(b"virtio_mmio.device=512@0xfeb00e00:12"),
            Some((0xfeb0_0e00, 12))
        );
        assert_eq!(
            parse_virtio_mmio_arg(b"virtio_mmio.device=0x1000@0xd0001000:6:3"),
            Some((0xd000_1000, 6))
        );
    }

    #[test]
    fn other_and_malformed_words_are_ignored() {
        for bad in [
            &b"console=ttyS0"[..],
            b"virtio_mmio.device=",
            b"virtio_mmio.device=4K",
            b"virtio_mmio.device=4K@0xd0000000",
            b"virtio_mmio.device=4Q@0xd0000000:5",
            b"virtio_mmio.device=4K@zz:5",
            b"virtio_mmio.device=4K@0xd0000000:",
        ] {
            assert_eq!(
                parse_virtio_mmio_arg(bad),
                None,
                "{:?}",
                core::str::from_utf8(bad)
            );
        }
    }

    #[test]
    fn ram_coverage_follows_the_e820_map() {
        let map = [
            E820Entry {
                addr: 0,
                size: 0x9fc00,
                kind: 1,
            },
            E820Entry {
                addr: 0x10_0000,
                size: 0x3ff0_0000,
                kind: 1,
            },
            E820Entry {
                addr: 0x4000_0000,
                size: 0x1000_0000,
                kind: 1,
            },
            E820Entry {
                addr: 0x5000_0000,
                size: 0x1000_0000,
                kind: 2,
            },
        ];
        let entry = |i: usize| map.get(i).copied();
        assert!(ram_covers(entry, 32 << 20, 64 << 20));
        // Spans two adjacent RAM entries.
        assert!(ram_covers(entry, 0x3000_0000, 0x4800_0000));
        // Runs into the reserved entry, or starts in the hole below 1 MiB.
        assert!(!ram_covers(entry, 0x4800_0000, 0x5800_0000));
        assert!(!ram_covers(entry, 0xa0000, 0x20_0000));
        assert!(!ram_covers(|_| None, 0, 1));
    }

    #[test]
    fn boot_commands_come_from_the_last_run_argument() {
        assert_eq!(run_commands(b"console=ttyS0 panic=1"), b"");
        assert_eq!(
            run_commands(b"console=ttyS0 rollbox.test.run=fs-init;fs-append-clone:1000 virtio_mmio.device=4K@0xd0000000:5"),
            b"fs-init;fs-append-clone:1000"
        );
        assert_eq!(
            run_commands(b"rollbox.test.run=echo:a rollbox.test.run=echo:b"),
            b"echo:b"
        );
    }

    #[test]
    fn boot_commands_split_on_semicolons_with_colons_as_spaces() {
        let mut line = [0u8; 20];
        let mut seen: Vec<Option<Vec<u8>>> = Vec::new();
        let mut commands: &[u8] =
            b";fs-init;;fs-append-clone:1000;echo:a:b;0123456789abcdefghijk;echo:x;";
        while let Some((len, rest)) = next_run_command(commands, &mut line) {
            seen.push(len.map(|len| line[..len].to_vec()));
            commands = rest;
        }
        assert_eq!(
            seen,
            vec![
                Some(b"fs-init".to_vec()),
                Some(b"fs-append-clone 1000".to_vec()),
                Some(b"echo a b".to_vec()),
                None,
                Some(b"echo x".to_vec()),
            ]
        );
        assert_eq!(next_run_command(b"", &mut line), None);
        assert_eq!(next_run_command(b";;", &mut line), None);
    }

    #[test]
    fn sizes_take_suffixes() {
        assert_eq!(parse_size(b"4K"), Some(4096));
        assert_eq!(parse_size(b"1m"), Some(1 << 20));
        assert_eq!(parse_size(b"2G"), Some(2 << 30));
        assert_eq!(parse_size(b"512"), Some(512));
        assert_eq!(parse_size(b"K"), None);
    }
}
