//! Commands for snapshot and benchmark tests: the VM generation counter, a generator
//! that reseeds when the generation changes, a long resumable computation, guest RAM
//! working sets, and exit-latency loops. Their state lives in guest memory (statics),
//! so a snapshot carries it.

use core::arch::asm;
use core::ptr::{read_volatile, write_volatile};

use crate::io::{inl, pause, put_dec, put_hex, put_hex16, puts, rdtsc};
use crate::work::{reseed, stage_end, xorshift64star, Compute, PRNG_SEED};

/// The VMM's generation counter: a 32-bit read here gives the low half, at +4 the high.
const GENERATION_PORT: u16 = 0x3c8;
/// Port of the `bench-pio` loop (the POST diagnostic port; the VMM ignores it).
const BENCH_PORT: u16 = 0x80;
/// Address of the `bench-mmio` loop: in the MMIO gap, claimed by no device.
const BENCH_MMIO: usize = 0xd010_0000;
/// `touch`/`check` use guest RAM from here up (far above the guest's own image).
pub const WORKSET_BASE: u64 = 32 << 20;
const PAGE: u64 = 4096;
pub const PRNG_MAX: u64 = 64;

pub fn read_generation() -> u64 {
    let lo = inl(GENERATION_PORT) as u64;
    let hi = inl(GENERATION_PORT + 4) as u64;
    (hi << 32) | lo
}

/// The generation the guest booted with (set once, before the first command runs).
static mut BOOT_GENERATION: u64 = 0;

/// Records the generation the guest booted with.
pub fn record_boot_generation() {
    let generation = read_generation();
    // SAFETY: the guest runs on one CPU and this runs once, before any command reads it.
    unsafe { *&raw mut BOOT_GENERATION = generation };
}

/// Spins until the generation counter differs from the one the guest booted with (a restore
/// gave the VM a new generation: it is a clone, whenever its snapshot was taken), and returns
/// the new value. A value counts once two reads in a row give it: a snapshot taken between the
/// two halves of one read resumes, in the clone, with the old low half next to the new high
/// half.
pub fn wait_new_generation() -> u64 {
    // SAFETY: written once before the first command; read-only since.
    let start = unsafe { *&raw const BOOT_GENERATION };
    let mut last = read_generation();
    loop {
        let now = read_generation();
        if now != start && now == last {
            return now;
        }
        last = now;
        pause();
    }
}

struct Prng {
    state: u64,
    /// The generation the last `prng` call saw.
    generation: u64,
    seen_generation: bool,
}

static mut PRNG: Prng = Prng {
    state: PRNG_SEED,
    generation: 0,
    seen_generation: false,
};

/// `prng N`: reseeds if the generation changed since the last call, then prints N values.
pub fn prng(count: u64) {
    let generation = read_generation();
    // SAFETY: the guest runs on one CPU and nothing else refers to PRNG. (`&mut *&raw
    // mut` avoids a direct reference to a `static mut`.)
    #[allow(clippy::deref_addrof)]
    let prng = unsafe { &mut *(&raw mut PRNG) };
    if !prng.seen_generation {
        prng.seen_generation = true;
        prng.generation = generation;
    } else if prng.generation != generation {
        prng.generation = generation;
        prng.state = reseed(prng.state, generation, rdtsc());
    }
    puts(b"OK");
    for _ in 0..count {
        puts(b" ");
        put_hex16(xorshift64star(&mut prng.state));
    }
    puts(b"\n");
}

/// A `compute` run in progress, checkpointed in memory after every tenth.
#[derive(Clone, Copy)]
struct ComputeRun {
    next: u64,
    state: Compute,
}

static mut COMPUTE_RUN: ComputeRun = ComputeRun {
    next: 0,
    state: Compute::START,
};

/// `compute N`: N steps, a `progress K` line after each tenth, then the hash. The loop
/// keeps its state in registers (a memory access per step would make it several times
/// slower under the CPL0 emulator) and stores it to `COMPUTE_RUN` after each tenth; a
/// snapshot carries both the registers and memory, so a restored run continues exactly.
pub fn compute(n: u64) {
    let mut run = ComputeRun {
        next: 0,
        state: Compute::START,
    };
    for k in 1..=10 {
        let end = stage_end(n, k);
        while run.next < end {
            run.state = run.state.step(run.next);
            run.next += 1;
        }
        // SAFETY: one CPU; COMPUTE_RUN is only written here.
        unsafe { write_volatile(&raw mut COMPUTE_RUN, run) };
        puts(b"progress ");
        put_dec(k);
        puts(b"\n");
    }
    puts(b"OK ");
    put_hex16(run.state.hash);
    puts(b"\n");
}

/// Page `index` of the working set (0-based from WORKSET_BASE).
fn workset_page(index: u64) -> *mut u64 {
    (WORKSET_BASE + index * PAGE) as *mut u64
}

/// `touch`: writes `index ^ seed` at the start of every page; returns the page count.
pub fn touch(pages: u64, seed: u64) -> u64 {
    for i in 0..pages {
        // SAFETY: the caller checked that the e820 map has RAM for every page, and the
        // guest's own image, stack and buffers lie below WORKSET_BASE.
        unsafe { write_volatile(workset_page(i), i ^ seed) };
    }
    pages
}

/// `check`: counts the pages whose first word is not `index ^ seed`.
pub fn check(pages: u64, seed: u64) -> u64 {
    let mut bad = 0;
    for i in 0..pages {
        // SAFETY: as for `touch`.
        if unsafe { read_volatile(workset_page(i)) } != i ^ seed {
            bad += 1;
        }
    }
    bad
}

#[derive(Clone, Copy)]
pub enum BenchKind {
    Pio,
    Mmio,
    Empty,
}

/// `n` iterations of one port write, one MMIO read, or nothing, in loops of the same
/// shape (the body, `dec`, `jnz`), so the empty loop can be subtracted.
pub fn bench_loop(kind: BenchKind, n: u64) {
    if n == 0 {
        return;
    }
    // SAFETY: port 0x80 and the unclaimed MMIO address only exit to the VMM; the
    // loops touch no memory of the guest.
    unsafe {
        match kind {
            BenchKind::Pio => asm!(
                "2:",
                "out dx, al",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) n => _,
                in("dx") BENCH_PORT,
                in("al") 0u8,
                options(nostack),
            ),
            BenchKind::Mmio => asm!(
                "2:",
                "mov {v:e}, dword ptr [{addr}]",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) n => _,
                addr = in(reg) BENCH_MMIO,
                v = out(reg) _,
                options(nostack),
            ),
            BenchKind::Empty => asm!(
                "2:",
                "nop",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) n => _,
                options(nomem, nostack),
            ),
        }
    }
}

/// Prints `OK <generation>`.
pub fn print_generation() {
    puts(b"OK ");
    put_hex(read_generation());
    puts(b"\n");
}
