//! rollbox test guest: a freestanding x86-64 program booted by rollbox-vmm through the
//! Linux 64-bit boot protocol. It answers the serial protocol of `../PROTOCOL.md`.
//!
//! It runs in CPL0 under KVM's instruction emulator on the build machines, so it uses
//! polled I/O, takes no exception and interrupts only inside one `sti; hlt` (COM1's in `idle`
//! mode, the virtio-fs device's and the PIT's while a FUSE request waits; see irq.rs), and
//! uses general registers only (`cargo xtask test-guest` rejects the ELF if objdump finds an
//! SSE register).

// Host unit tests (`cargo xtask test-guest --check`) build the pure logic with std.
#![cfg_attr(not(test), no_std)]
#![cfg_attr(not(test), no_main)]
#![cfg_attr(test, allow(dead_code))]

mod blk;
mod boot;
mod fs;
mod idle;
mod io;
mod irq;
mod mem;
mod smp;
mod snap;
mod virtio;
mod vsock;
mod work;

use core::arch::asm;
#[cfg(not(test))]
use core::arch::global_asm;
#[cfg(not(test))]
use core::panic::PanicInfo;

use blk::{Blk, BlkDma};
use boot::BootInfo;
use fs::{Fs, FsDma};
use io::{parse_u64, put_dec, put_hex, put_hex16, put_hex_bytes, puts, split_word, try_getc};
use virtio::Hostile;
use vsock::{ConnectError, Vsock, VsockDma, VsockHostile};

const STACK_SIZE: usize = 64 * 1024;
const MAX_BLK: usize = 8;
/// Longest command line accepted (a 512-byte `blk-write` needs 1024 hex digits + the rest).
const LINE_MAX: usize = 2048;
const CONNECT_TIMEOUT_MS: u64 = 5000;
const MAX_SUM_SECTORS: u64 = 2048;
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

#[repr(C, align(16))]
struct Stack([u8; STACK_SIZE]);

#[cfg_attr(not(test), no_mangle)]
static mut GUEST_STACK: Stack = Stack([0; STACK_SIZE]);
static mut BLK_DMA: [BlkDma; MAX_BLK] = [const { BlkDma::ZERO }; MAX_BLK];
static mut VSOCK_DMA: VsockDma = VsockDma::ZERO;
static mut BLKS: [Blk; MAX_BLK] = [const { Blk::new(0) }; MAX_BLK];
static mut VSOCK: Vsock = Vsock::new(0);
static mut FS: Fs = Fs::new(0, 0);
static mut FS_DMA: FsDma = FsDma::ZERO;

// Entry from the VMM: long mode, identity map, RSI = boot_params.
#[cfg(not(test))]
global_asm!(
    ".section .text._start, \"ax\"",
    ".global _start",
    "_start:",
    "cli",
    "cld",
    "lea rsp, [rip + {stack} + {size}]",
    "mov rdi, rsi",
    "call {main}",
    "2:",
    "pause",
    "jmp 2b",
    stack = sym GUEST_STACK,
    size = const STACK_SIZE,
    main = sym guest_main,
);

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &PanicInfo) -> ! {
    puts(b"\nrollbox-test-guest: panic\n");
    io::spin_forever()
}

/// Everything a command may touch.
struct Guest {
    boot: BootInfo,
    ticks_per_ms: u64,
    blks: &'static mut [Blk; MAX_BLK],
    blk_dma: &'static mut [BlkDma; MAX_BLK],
    blk_count: usize,
    vsock: Option<&'static mut Vsock>,
    vsock_dma: &'static mut VsockDma,
    /// The first virtio-fs device.
    fs: Option<&'static mut Fs>,
    fs_dma: &'static mut FsDma,
    /// `idle` was given: halt between commands instead of polling.
    idle: bool,
}

extern "C" fn guest_main(boot_params: usize) -> ! {
    // First of all: a snapshot taken at any later point of the boot (a template's boot
    // snapshot) resumes in its clones with this already read.
    snap::record_boot_generation();
    let ticks_per_ms = io::tsc_per_ms();
    let boot = BootInfo::read(boot_params);
    // SAFETY: guest_main runs once, on the only CPU, and these are its only references
    // to the statics. (`&mut *&raw mut` avoids a direct reference to a `static mut`.)
    #[allow(clippy::deref_addrof)]
    let (blks, blk_dma, vsock, vsock_dma, fs, fs_dma) = unsafe {
        (
            &mut *(&raw mut BLKS),
            &mut *(&raw mut BLK_DMA),
            &mut *(&raw mut VSOCK),
            &mut *(&raw mut VSOCK_DMA),
            &mut *(&raw mut FS),
            &mut *(&raw mut FS_DMA),
        )
    };
    let mut guest = Guest {
        boot,
        ticks_per_ms,
        blks,
        blk_dma,
        blk_count: 0,
        vsock: None,
        vsock_dma,
        fs: None,
        fs_dma,
        idle: false,
    };
    let mut vsock_slot = Some(vsock);
    let mut fs_slot = Some(fs);
    for dev in guest.boot.devices.iter().take(guest.boot.device_count) {
        match dev.device_id {
            Some(blk::DEVICE_ID) => {
                if let Some(b) = guest.blks.get_mut(guest.blk_count) {
                    *b = Blk::new(dev.addr as usize);
                    guest.blk_count += 1;
                }
            }
            Some(vsock::DEVICE_ID) => {
                if let Some(v) = vsock_slot.take() {
                    *v = Vsock::new(dev.addr as usize);
                    guest.vsock = Some(v);
                }
            }
            Some(fs::DEVICE_ID) => {
                if let Some(f) = fs_slot.take() {
                    *f = Fs::new(dev.addr as usize, dev.irq);
                    guest.fs = Some(f);
                }
            }
            _ => {}
        }
    }

    puts(b"rollbox-test-guest: ready\n");
    let mut line = [0u8; LINE_MAX];
    // `rollbox.test.run=CMD1;CMD2;...`: each as if its line had come on the serial port.
    let mut commands = boot::run_commands(guest.boot.cmdline);
    while let Some((len, rest)) = boot::next_run_command(commands, &mut line) {
        commands = rest;
        match len {
            Some(len) => guest.command(line.get(..len).unwrap_or(&[])),
            None => puts(b"ERR line-too-long\n"),
        }
    }
    let mut len = 0;
    let mut too_long = false;
    loop {
        match try_getc() {
            Some(b'\n') => {
                if too_long {
                    puts(b"ERR line-too-long\n");
                } else {
                    guest.command(line.get(..len).unwrap_or(&[]));
                }
                len = 0;
                too_long = false;
            }
            Some(b'\r') => {}
            Some(byte) => match line.get_mut(len) {
                Some(slot) => {
                    *slot = byte;
                    len += 1;
                }
                None => too_long = true,
            },
            None if guest.idle => idle::wait(),
            None => {
                if let Some(v) = guest.vsock.as_deref_mut() {
                    v.poll(guest.vsock_dma);
                }
                io::pause();
            }
        }
    }
}

/// `OK` + newline.
fn ok() {
    puts(b"OK\n");
}

fn err(reason: &[u8]) {
    puts(b"ERR ");
    puts(reason);
    puts(b"\n");
}

fn err_status(status: blk::Status) {
    match status {
        Ok(0) => ok(),
        Ok(code) => {
            puts(b"ERR status=");
            put_dec(code as u64);
            puts(b"\n");
        }
        Err(reason) => err(reason.as_bytes()),
    }
}

/// A guest-physical address that is not guest memory: a GiB above the end of the e820 map
/// rounded up to a GiB.
fn beyond_memory(boot: &BootInfo) -> u64 {
    const GIB: u64 = 1 << 30;
    (boot.memory_end().div_ceil(GIB) + 1) * GIB
}

/// The answer to `hostile` and `vsock-hostile`.
fn survived(result: Result<(), &'static str>) {
    match result {
        Ok(()) => puts(b"OK survived\n"),
        Err(reason) => {
            puts(b"ERR reinit-failed ");
            puts(reason.as_bytes());
            puts(b"\n");
        }
    }
}

/// Parses `count` space-separated numbers from `args`; the rest is returned too.
fn numbers<const N: usize>(mut args: &[u8]) -> Option<([u64; N], &[u8])> {
    let mut out = [0u64; N];
    for slot in out.iter_mut() {
        let (word, rest) = split_word(args);
        *slot = parse_u64(word)?;
        args = rest;
    }
    Some((out, args))
}

impl Guest {
    fn command(&mut self, line: &[u8]) {
        let (name, args) = split_word(line);
        match name {
            b"echo" => {
                puts(b"OK ");
                puts(args);
                puts(b"\n");
            }
            b"cmdline" => {
                puts(b"OK ");
                puts(self.boot.cmdline);
                puts(b"\n");
            }
            b"e820" => self.cmd_e820(),
            b"devices" => self.cmd_devices(),
            b"blk-info" | b"blk-id" | b"blk-read" | b"blk-sum" | b"blk-write" | b"blk-fill"
            | b"blk-flush" | b"hostile" | b"blk-post" | b"blk-complete" => self.cmd_blk(name, args),
            b"vsock-cid" => match self.vsock.as_deref() {
                Some(v) => {
                    puts(b"OK ");
                    put_dec(v.read_cid());
                    puts(b"\n");
                }
                None => err(b"no-vsock-device"),
            },
            b"generation" => snap::print_generation(),
            b"idle" => {
                idle::enable();
                self.idle = true;
                ok();
            }
            b"pci-read" => match numbers::<2>(args) {
                Some(([dev, reg], _)) if dev < 32 && reg < 256 && reg % 4 == 0 => {
                    // Configuration mechanism #1: bus 0, function 0.
                    io::outl(0xcf8, 0x8000_0000 | (dev as u32) << 11 | reg as u32);
                    puts(b"OK ");
                    put_hex(u64::from(io::inl(0xcfc)));
                    puts(b"\n");
                }
                Some(_) => err(b"out-of-range"),
                None => err(b"usage: pci-read DEV REG"),
            },
            b"mmio-read" => match numbers::<1>(args) {
                Some(([addr], _)) if addr % 4 == 0 && addr < (1 << 32) - 4 => {
                    // SAFETY: the identity map covers 0..4 GiB; an address with no RAM or
                    // device behind it exits to the VMM, which answers the read.
                    let value = unsafe { core::ptr::read_volatile(addr as *const u32) };
                    puts(b"OK ");
                    put_hex(u64::from(value));
                    puts(b"\n");
                }
                Some(_) => err(b"out-of-range"),
                None => err(b"usage: mmio-read ADDR"),
            },
            b"prng" => match numbers::<1>(args) {
                Some(([n], _)) if (1..=snap::PRNG_MAX).contains(&n) => snap::prng(n),
                Some(_) => err(b"count-out-of-range"),
                None => err(b"usage: prng N"),
            },
            b"compute" => match numbers::<1>(args) {
                Some(([n], _)) => snap::compute(n),
                None => err(b"usage: compute N"),
            },
            b"touch" | b"check" => self.cmd_workset(name, args),
            // Once restored as a clone (a new generation), `check` of what `touch` wrote
            // before the snapshot: memory that crossed a restore, or a move to another node.
            b"clone-check" => {
                snap::wait_new_generation();
                puts(b"clone ");
                self.cmd_workset(b"check", args);
            }
            b"bench-pio" | b"bench-mmio" | b"bench-loop" => {
                let Some(([n], _)) = numbers::<1>(args) else {
                    return err(b"usage: bench-pio|bench-mmio|bench-loop N");
                };
                let kind = match name {
                    b"bench-pio" => snap::BenchKind::Pio,
                    b"bench-mmio" => snap::BenchKind::Mmio,
                    _ => snap::BenchKind::Empty,
                };
                snap::bench_loop(kind, n);
                ok();
            }
            b"smp-start" => match smp::start(self.ticks_per_ms) {
                Ok(()) => ok(),
                Err(reason) => err(reason.as_bytes()),
            },
            b"smp-count" => {
                puts(b"OK ");
                put_dec(smp::count());
                puts(b"\n");
            }
            b"fs-init" | b"fs-append" | b"fs-append-clone" => self.cmd_fs(name, args),
            b"vsock-listen" => self.cmd_vsock_listen(args),
            b"vsock-connect" => self.cmd_vsock_connect(args),
            b"vsock-hostile" => self.cmd_vsock_hostile(args),
            b"reset" => {
                io::outb(0x64, 0xfe);
                io::spin_forever()
            }
            b"poweroff" => {
                io::outb(0x3c0, 0x34);
                io::spin_forever()
            }
            b"crash" => crash(),
            b"" => err(b"empty-command"),
            _ => err(b"unknown-command"),
        }
    }

    fn cmd_e820(&self) {
        let count = self.boot.e820_count();
        puts(b"OK ");
        put_dec(count as u64);
        for i in 0..count {
            let e = self.boot.e820(i);
            puts(b" ");
            put_hex(e.addr);
            puts(b":");
            put_hex(e.size);
            puts(b":");
            put_dec(e.kind as u64);
        }
        puts(b"\n");
    }

    fn cmd_devices(&self) {
        puts(b"OK");
        for dev in self.boot.devices() {
            puts(b" ");
            put_hex(dev.addr);
            puts(b":");
            put_dec(dev.irq);
            puts(b":");
            match dev.device_id {
                Some(id) => put_dec(id as u64),
                None => puts(b"bad-magic"),
            }
        }
        puts(b"\n");
    }

    fn cmd_blk(&mut self, name: &[u8], args: &[u8]) {
        let (index, args) = split_word(args);
        let Some(d) = parse_u64(index)
            .map(|d| d as usize)
            .filter(|&d| d < self.blk_count)
        else {
            return err(b"no-such-block-device");
        };
        let tpm = self.ticks_per_ms;
        let (Some(dev), Some(dma)) = (self.blks.get_mut(d), self.blk_dma.get_mut(d)) else {
            return err(b"no-such-block-device");
        };
        if dev.has_posted() && name != b"blk-complete" {
            return err(b"request-posted");
        }
        if let Err(reason) = dev.ensure_ready(dma, tpm) {
            return err(reason.as_bytes());
        }
        match name {
            b"blk-post" => {
                let Some(([sector], _)) = numbers::<1>(args) else {
                    return err(b"usage: blk-post D SECTOR");
                };
                dev.post_read(dma, sector);
                ok();
            }
            b"blk-complete" => match dev.complete_posted(dma, tpm) {
                Ok(0) => {
                    puts(b"OK ");
                    put_hex_bytes(dma.data.get(..blk::SECTOR).unwrap_or(&[]));
                    puts(b"\n");
                }
                other => err_status(other),
            },
            b"blk-info" => {
                puts(b"OK capacity=");
                put_dec(dev.capacity());
                puts(b" ro=");
                put_dec(dev.read_only() as u64);
                puts(b" flush=");
                put_dec(dev.has_flush() as u64);
                puts(b"\n");
            }
            b"blk-id" => match dev.get_id(dma, tpm) {
                Ok(0) => {
                    puts(b"OK");
                    for (i, &c) in dma
                        .data
                        .iter()
                        .take(blk::ID_BYTES)
                        .take_while(|&&c| c != 0)
                        .enumerate()
                    {
                        if i == 0 {
                            io::putc(b' ');
                        }
                        io::putc(if (0x21..0x7f).contains(&c) { c } else { b'?' });
                    }
                    puts(b"\n");
                }
                other => err_status(other),
            },
            b"blk-read" => {
                let Some(([sector, count], _)) = numbers::<2>(args) else {
                    return err(b"usage: blk-read D SECTOR COUNT");
                };
                if !(1..=blk::MAX_SECTORS_PER_REQUEST as u64).contains(&count) {
                    return err(b"count-out-of-range");
                }
                match dev.read(dma, tpm, sector, count as usize) {
                    Ok(0) => {
                        puts(b"OK ");
                        put_hex_bytes(dma.data.get(..count as usize * blk::SECTOR).unwrap_or(&[]));
                        puts(b"\n");
                    }
                    other => err_status(other),
                }
            }
            b"blk-sum" => {
                let Some(([sector, count], _)) = numbers::<2>(args) else {
                    return err(b"usage: blk-sum D SECTOR COUNT");
                };
                if !(1..=MAX_SUM_SECTORS).contains(&count) {
                    return err(b"count-out-of-range");
                }
                let mut hash = FNV_OFFSET;
                let mut done = 0;
                while done < count {
                    let n = (count - done).min(blk::MAX_SECTORS_PER_REQUEST as u64);
                    match dev.read(dma, tpm, sector.wrapping_add(done), n as usize) {
                        Ok(0) => {}
                        other => return err_status(other),
                    }
                    hash = fnv1a(
                        hash,
                        dma.data.get(..n as usize * blk::SECTOR).unwrap_or(&[]),
                    );
                    done += n;
                }
                puts(b"OK ");
                put_hex16(hash);
                puts(b"\n");
            }
            b"blk-write" => {
                let Some(([sector], hex)) = numbers::<1>(args) else {
                    return err(b"usage: blk-write D SECTOR HEX");
                };
                if hex.is_empty() || hex.len() % 2 != 0 || hex.len() > 2 * blk::SECTOR {
                    return err(b"bad-hex-length");
                }
                dma.data[..blk::SECTOR].fill(0);
                for (slot, pair) in dma.data.iter_mut().zip(hex.chunks_exact(2)) {
                    let (Some(hi), Some(lo)) = (
                        pair.first().and_then(|&c| io::hex_value(c)),
                        pair.get(1).and_then(|&c| io::hex_value(c)),
                    ) else {
                        return err(b"bad-hex-digit");
                    };
                    *slot = hi << 4 | lo;
                }
                err_status(dev.write(dma, tpm, sector, 1));
            }
            b"blk-fill" => {
                let Some(([sector, count, byte], _)) = numbers::<3>(args) else {
                    return err(b"usage: blk-fill D SECTOR COUNT BYTE");
                };
                if !(1..=MAX_SUM_SECTORS).contains(&count) {
                    return err(b"count-out-of-range");
                }
                if byte > 0xff {
                    return err(b"byte-out-of-range");
                }
                dma.data.fill(byte as u8);
                let mut done = 0;
                while done < count {
                    let n = (count - done).min(blk::MAX_SECTORS_PER_REQUEST as u64);
                    match dev.write(dma, tpm, sector.wrapping_add(done), n as usize) {
                        Ok(0) => {}
                        other => return err_status(other),
                    }
                    done += n;
                }
                ok();
            }
            b"blk-flush" => err_status(dev.flush(dma, tpm)),
            b"hostile" => {
                let (kind, _) = split_word(args);
                let Some(kind) = Hostile::parse(kind) else {
                    return err(b"unknown-hostile-kind");
                };
                survived(dev.hostile(dma, tpm, kind, beyond_memory(&self.boot)));
            }
            _ => err(b"unknown-command"),
        }
    }

    /// `touch MIB SEED` / `check MIB SEED` on the RAM from 32 MiB up.
    fn cmd_workset(&self, name: &[u8], args: &[u8]) {
        let Some(([mib, seed], _)) = numbers::<2>(args) else {
            return err(b"usage: touch|check MIB SEED");
        };
        const MIB: u64 = 1 << 20;
        // The VMM's identity map ends at 4 GiB.
        let end = mib
            .checked_mul(MIB)
            .and_then(|bytes| bytes.checked_add(snap::WORKSET_BASE))
            .filter(|&end| mib > 0 && end <= 1 << 32);
        let Some(end) = end else {
            return err(b"size-out-of-range");
        };
        if !self.boot.ram_covers(snap::WORKSET_BASE, end) {
            return err(b"not-covered-by-e820-ram");
        }
        let pages = mib * (MIB / 4096);
        puts(b"OK ");
        if name == b"touch" {
            put_dec(snap::touch(pages, seed));
        } else {
            put_dec(snap::check(pages, seed));
        }
        puts(b"\n");
    }

    fn cmd_fs(&mut self, name: &[u8], args: &[u8]) {
        let tpm = self.ticks_per_ms;
        let Some(fs) = self.fs.as_deref_mut() else {
            return err(b"no-fs-device");
        };
        if name == b"fs-init" {
            match fs.init(self.fs_dma, tpm) {
                Ok(minor) => {
                    puts(b"OK 7.");
                    put_dec(minor as u64);
                    puts(if fs.halts() { b" halt\n" } else { b" poll\n" });
                }
                Err(e) => err(e.as_bytes()),
            }
            return;
        }
        let Some(([count], _)) = numbers::<1>(args).filter(|([n], _)| *n <= 999_999) else {
            return err(if name == b"fs-append-clone" {
                b"usage: fs-append-clone N (at most 999999)"
            } else {
                b"usage: fs-append N (at most 999999)"
            });
        };
        // fs-append-clone: only a clone appends, as itself (a parent spins here forever).
        let generation = if name == b"fs-append-clone" {
            snap::wait_new_generation()
        } else {
            snap::read_generation()
        };
        match fs.append(self.fs_dma, tpm, generation, count) {
            Ok(()) => {
                puts(b"OK appended ");
                put_dec(count);
                puts(b" as ");
                put_hex16(generation);
                puts(b"\n");
            }
            Err(e) => err(e.as_bytes()),
        }
    }

    fn cmd_vsock_listen(&mut self, args: &[u8]) {
        let (port, _) = split_word(args);
        let Some(port) = parse_u64(port).and_then(|p| u32::try_from(p).ok()) else {
            return err(b"usage: vsock-listen PORT");
        };
        let tpm = self.ticks_per_ms;
        let Some(v) = self.vsock.as_deref_mut() else {
            return err(b"no-vsock-device");
        };
        if let Err(reason) = v.ensure_ready(self.vsock_dma, tpm) {
            return err(reason.as_bytes());
        }
        match v.listen(port) {
            Ok(()) => ok(),
            Err(reason) => err(reason.as_bytes()),
        }
    }

    fn cmd_vsock_hostile(&mut self, args: &[u8]) {
        let (kind, _) = split_word(args);
        let Some(kind) = VsockHostile::parse(kind) else {
            return err(b"unknown-hostile-kind");
        };
        let tpm = self.ticks_per_ms;
        let beyond = beyond_memory(&self.boot);
        let Some(v) = self.vsock.as_deref_mut() else {
            return err(b"no-vsock-device");
        };
        survived(v.hostile(self.vsock_dma, tpm, kind, beyond));
    }

    fn cmd_vsock_connect(&mut self, args: &[u8]) {
        let (port, text) = split_word(args);
        let Some(port) = parse_u64(port).and_then(|p| u32::try_from(p).ok()) else {
            return err(b"usage: vsock-connect PORT TEXT");
        };
        let tpm = self.ticks_per_ms;
        let Some(v) = self.vsock.as_deref_mut() else {
            return err(b"no-vsock-device");
        };
        if let Err(reason) = v.ensure_ready(self.vsock_dma, tpm) {
            return err(reason.as_bytes());
        }
        let mut reply = [0u8; 1024];
        match v.connect_line(self.vsock_dma, port, text, &mut reply, CONNECT_TIMEOUT_MS) {
            Ok(n) => {
                puts(b"OK ");
                puts(reply.get(..n).unwrap_or(&[]));
                puts(b"\n");
            }
            Err(ConnectError::Send(reason)) => err(reason.as_bytes()),
            Err(ConnectError::NoFreeConnection) => err(b"no-free-connection"),
            Err(ConnectError::Refused) => err(b"connection-reset"),
            Err(ConnectError::Timeout) => err(b"timeout"),
        }
    }
}

/// FNV-1a, 64-bit.
fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= b as u64;
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Loads an empty IDT and executes `ud2`: with no way to deliver #UD the CPU triple
/// faults (or the emulator gives up), which must end the VMM with a failure.
fn crash() -> ! {
    let idt = [0u8; 10];
    // SAFETY: deliberately fatal; nothing runs afterwards.
    unsafe { asm!("lidt [{0}]", "ud2", in(reg) idt.as_ptr(), options(noreturn, nostack)) }
}

/// libcore's precompiled objects name a personality routine even with panic=abort;
/// nothing unwinds here, so it is never called.
#[cfg(not(test))]
#[no_mangle]
extern "C" fn rust_eh_personality() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_reference_vectors() {
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
        // Hashing in pieces equals hashing at once (blk-sum hashes per request).
        assert_eq!(
            fnv1a(fnv1a(FNV_OFFSET, b"foo"), b"bar"),
            fnv1a(FNV_OFFSET, b"foobar")
        );
    }

    #[test]
    fn numbers_parses_leading_numbers_and_returns_the_rest() {
        let (n, rest) = numbers::<2>(b"7 0x10 deadbeef").expect("two numbers");
        assert_eq!(n, [7, 16]);
        assert_eq!(rest, b"deadbeef");
        assert!(numbers::<3>(b"1 2").is_none());
        assert!(numbers::<1>(b"x").is_none());
    }
}
