//! Port I/O, the polled COM1 16550, and number formatting written without `core::fmt`
//! (the precompiled libcore uses SSE, which the KVM emulator cannot run in CPL0).

use core::arch::asm;

const COM1: u16 = 0x3f8;
const LSR: u16 = COM1 + 5;
const LSR_DATA_READY: u8 = 0x01;
const LSR_THR_EMPTY: u8 = 0x20;

pub fn outb(port: u16, value: u8) {
    // SAFETY: port I/O has no memory effects; the guest owns the whole machine.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags))
    };
}

pub fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: as for `outb`.
    unsafe {
        asm!("in al, dx", out("al") value, in("dx") port, options(nomem, nostack, preserves_flags))
    };
    value
}

/// A 32-bit port read.
pub fn inl(port: u16) -> u32 {
    let value: u32;
    // SAFETY: as for `outb`.
    unsafe {
        asm!("in eax, dx", out("eax") value, in("dx") port, options(nomem, nostack, preserves_flags))
    };
    value
}

/// A 32-bit port write.
pub fn outl(port: u16, value: u32) {
    // SAFETY: as for `outb`.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") value, options(nomem, nostack, preserves_flags))
    };
}

pub fn pause() {
    // SAFETY: `pause` is a spin-loop hint with no side effects.
    unsafe { asm!("pause", options(nomem, nostack, preserves_flags)) };
}

/// Spins forever without `hlt` (halting would end a VMM that treats HLT as the end).
pub fn spin_forever() -> ! {
    loop {
        pause();
    }
}

pub fn putc(byte: u8) {
    while inb(LSR) & LSR_THR_EMPTY == 0 {
        pause();
    }
    outb(COM1, byte);
}

pub fn puts(bytes: &[u8]) {
    for &b in bytes {
        putc(b);
    }
}

/// One byte from the serial port, if one is waiting.
pub fn try_getc() -> Option<u8> {
    if inb(LSR) & LSR_DATA_READY != 0 {
        Some(inb(COM1))
    } else {
        None
    }
}

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

pub fn hex_digit(nibble: u8) -> u8 {
    HEX_DIGITS[(nibble & 0xf) as usize]
}

pub fn put_dec(mut value: u64) {
    let mut buf = [0u8; 20];
    let mut at = buf.len();
    loop {
        at -= 1;
        if let Some(slot) = buf.get_mut(at) {
            *slot = b'0' + (value % 10) as u8;
        }
        value /= 10;
        if value == 0 || at == 0 {
            break;
        }
    }
    if let Some(digits) = buf.get(at..) {
        puts(digits);
    }
}

/// `0x` followed by the shortest hex form (`0x0` for zero).
pub fn put_hex(value: u64) {
    puts(b"0x");
    let mut started = false;
    for shift in (0..16).rev() {
        let nibble = ((value >> (shift * 4)) & 0xf) as u8;
        if nibble != 0 || started || shift == 0 {
            started = true;
            putc(hex_digit(nibble));
        }
    }
}

/// `0x` followed by exactly 16 hex digits.
pub fn put_hex16(value: u64) {
    puts(b"0x");
    for shift in (0..16).rev() {
        putc(hex_digit(((value >> (shift * 4)) & 0xf) as u8));
    }
}

pub fn put_hex_bytes(bytes: &[u8]) {
    for &b in bytes {
        putc(hex_digit(b >> 4));
        putc(hex_digit(b));
    }
}

/// Parses a decimal number, or a hex one prefixed `0x`. Rejects empty input, stray
/// characters and overflow.
pub fn parse_u64(text: &[u8]) -> Option<u64> {
    let (digits, radix) = match text {
        [b'0', b'x' | b'X', rest @ ..] => (rest, 16u64),
        _ => (text, 10u64),
    };
    if digits.is_empty() {
        return None;
    }
    let mut value: u64 = 0;
    for &c in digits {
        let d = hex_value(c)? as u64;
        if d >= radix {
            return None;
        }
        value = value.checked_mul(radix)?.checked_add(d)?;
    }
    Some(value)
}

pub fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Splits off the first space-separated word; the rest has its leading spaces removed.
pub fn split_word(text: &[u8]) -> (&[u8], &[u8]) {
    let text = trim_start(text);
    match text.iter().position(|&c| c == b' ') {
        Some(at) => match text.split_at_checked(at) {
            Some((word, rest)) => (word, trim_start(rest)),
            None => (text, &[]),
        },
        None => (text, &[]),
    }
}

pub fn trim_start(mut text: &[u8]) -> &[u8] {
    while let [b' ', rest @ ..] = text {
        text = rest;
    }
    text
}

/// Reads the time-stamp counter.
pub fn rdtsc() -> u64 {
    let lo: u32;
    let hi: u32;
    // SAFETY: rdtsc only reads the counter.
    unsafe {
        asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    ((hi as u64) << 32) | lo as u64
}

fn cpuid(leaf: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: cpuid only reads processor information; rbx is saved around it because
    // LLVM reserves it.
    unsafe {
        asm!(
            "mov {tmp:r}, rbx",
            "cpuid",
            "xchg {tmp:r}, rbx",
            tmp = out(reg) b,
            inout("eax") leaf => a,
            inout("ecx") 0u32 => c,
            out("edx") d,
            options(nomem, nostack, preserves_flags),
        )
    };
    [a, b, c, d]
}

/// TSC ticks per millisecond: from the hypervisor timing leaf, then the CPU's
/// TSC/crystal leaves, else a 2 GHz guess. Only used for timeouts.
pub fn tsc_per_ms() -> u64 {
    let hv = cpuid(0x4000_0000);
    if hv[0] >= 0x4000_0010 {
        let khz = cpuid(0x4000_0010)[0] as u64;
        if khz != 0 {
            return khz;
        }
    }
    let max = cpuid(0)[0];
    if max >= 0x15 {
        let [den, num, crystal_hz, _] = cpuid(0x15);
        if den != 0 && num != 0 && crystal_hz != 0 {
            return crystal_hz as u64 * num as u64 / den as u64 / 1000;
        }
    }
    if max >= 0x16 {
        let mhz = cpuid(0x16)[0] as u64 & 0xffff;
        if mhz != 0 {
            return mhz * 1000;
        }
    }
    2_000_000
}

/// A point in time some milliseconds from now.
#[derive(Clone, Copy)]
pub struct Deadline(u64);

impl Deadline {
    pub fn after_ms(ticks_per_ms: u64, ms: u64) -> Self {
        Deadline(rdtsc().wrapping_add(ticks_per_ms.saturating_mul(ms)))
    }
    pub fn at(raw: u64) -> Self {
        Deadline(raw)
    }
    pub fn raw(self) -> u64 {
        self.0
    }
    pub fn passed(self) -> bool {
        (rdtsc().wrapping_sub(self.0) as i64) >= 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_u64_takes_decimal_and_0x_hex() {
        assert_eq!(parse_u64(b"0"), Some(0));
        assert_eq!(parse_u64(b"4096"), Some(4096));
        assert_eq!(parse_u64(b"0xd0000000"), Some(0xd000_0000));
        assert_eq!(parse_u64(b"0XFF"), Some(255));
        assert_eq!(parse_u64(b"18446744073709551615"), Some(u64::MAX));
    }

    #[test]
    fn parse_u64_rejects_bad_input() {
        for bad in [
            &b""[..],
            b"0x",
            b"12a",
            b"-1",
            b" 1",
            b"18446744073709551616",
            b"0x10000000000000000",
        ] {
            assert_eq!(parse_u64(bad), None, "{:?}", core::str::from_utf8(bad));
        }
    }

    #[test]
    fn split_word_skips_spaces() {
        assert_eq!(split_word(b"blk-read 0 1"), (&b"blk-read"[..], &b"0 1"[..]));
        assert_eq!(split_word(b"  echo   a  b"), (&b"echo"[..], &b"a  b"[..]));
        assert_eq!(split_word(b"devices"), (&b"devices"[..], &b""[..]));
        assert_eq!(split_word(b""), (&b""[..], &b""[..]));
    }

    #[test]
    fn hex_digits() {
        assert_eq!(hex_digit(0), b'0');
        assert_eq!(hex_digit(0xa), b'a');
        assert_eq!(hex_digit(0x1f), b'f');
        assert_eq!(hex_value(b'F'), Some(15));
        assert_eq!(hex_value(b'g'), None);
    }
}
