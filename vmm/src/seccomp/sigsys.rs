//! The SIGSYS reporter: names the thread, its filter and the forbidden syscall on stderr (and
//! the log file), then lets the kernel kill the process with SIGSYS. It runs in a signal
//! handler, so it neither allocates nor locks.

use std::cell::Cell;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use super::syscalls::syscall_name;
use super::thread_kind::ThreadKind;

/// The log file's descriptor, for the SIGSYS handler (-1: stderr only).
static LOG_FD: AtomicI32 = AtomicI32::new(-1);

thread_local! {
    /// This thread's kind (its code; 0 before it installs a filter), for the SIGSYS handler.
    static KIND: Cell<u8> = const { Cell::new(0) };
    /// This thread's name, NUL-padded, once it installs a filter, for the SIGSYS handler.
    static NAME: Cell<[u8; 16]> = const { Cell::new([0; 16]) };
}

/// Whether the built-in filters are in force (they let the SIGSYS handler ask the kernel for
/// the name of a thread that inherited its filter; a custom filter may not).
static BUILT_IN: AtomicBool = AtomicBool::new(false);

/// Where the handler writes besides stderr.
pub(super) fn set_log_fd(fd: RawFd) {
    LOG_FD.store(fd, Ordering::SeqCst);
}

/// Tells the handler whether the built-in filters are in force.
pub(super) fn set_built_in(built_in: bool) {
    BUILT_IN.store(built_in, Ordering::SeqCst);
}

/// Whether the calling thread recorded `kind` (so has `kind`'s filter, or the process is
/// ending because it could not install it).
pub(super) fn is_thread(kind: ThreadKind) -> bool {
    KIND.with(Cell::get) == kind.code()
}

/// Records the calling thread's kind and name for the handler (before its filter goes on).
pub(super) fn remember_thread(kind: ThreadKind) {
    KIND.with(|k| k.set(kind.code()));
    let mut name = [0u8; 16];
    if let Some(own) = std::thread::current().name() {
        for (dst, src) in name.iter_mut().take(15).zip(own.bytes()) {
            *dst = src;
        }
    }
    NAME.with(|n| n.set(name));
}

pub(super) fn install_sigsys_handler() {
    if let Err(e) = vmm_sys_util::signal::register_signal_handler(libc::SIGSYS, on_sigsys) {
        log::warn!("seccomp: no SIGSYS handler ({e}); a forbidden syscall still kills the process, unnamed");
    }
}

/// A small line buffer for the signal handler (which must not allocate).
struct Line {
    bytes: [u8; 256],
    len: usize,
}

impl Line {
    fn push(&mut self, text: &[u8]) {
        for &b in text {
            if self.len < self.bytes.len() {
                self.bytes[self.len] = b;
                self.len += 1;
            }
        }
    }

    fn push_hex(&mut self, n: u64) {
        let mut digits = [0u8; 18];
        digits[0] = b'0';
        digits[1] = b'x';
        let mut len = 2;
        let mut started = false;
        for shift in (0..16).rev() {
            let nibble = ((n >> (shift * 4)) & 0xf) as u8;
            if nibble != 0 || started || shift == 0 {
                started = true;
                digits[len] = if nibble < 10 {
                    b'0' + nibble
                } else {
                    b'a' + nibble - 10
                };
                len += 1;
            }
        }
        self.push(&digits[..len]);
    }

    fn push_number(&mut self, mut n: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo; for SIGSYS its union holds `_sigsys`, whose
    // `_syscall` (an int) is the seventh 32-bit word (after si_signo, si_errno, si_code, the
    // padding and the 64-bit `_call_addr`).
    let nr = unsafe { *(info as *const i32).add(6) };
    let kind = KIND.with(Cell::get);
    let mut line = Line {
        bytes: [0; 256],
        len: 0,
    };
    // A thread that inherited its filter has no kind of its own: its name tells which it is.
    let mut name = [0u8; 17];
    if kind != 0 {
        name[..16].copy_from_slice(&NAME.with(Cell::get));
    } else if BUILT_IN.load(Ordering::Relaxed) {
        // SAFETY: PR_GET_NAME writes at most 16 bytes and a NUL into the 17-byte buffer.
        unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr(), 0, 0, 0) };
    }
    let name_len = name.iter().position(|b| *b == 0).unwrap_or(16);
    line.push(b"rollbox-vmm: seccomp: thread ");
    line.push(&name[..name_len]);
    line.push(b" (");
    line.push(
        ThreadKind::from_code(kind)
            .map(ThreadKind::name)
            .unwrap_or("inherited")
            .as_bytes(),
    );
    line.push(b" filter) made the forbidden syscall ");
    line.push(syscall_name(i64::from(nr)).unwrap_or("?").as_bytes());
    line.push(b" (");
    line.push_number(u64::from(nr.unsigned_abs()));
    line.push(b")");
    if i64::from(nr) == libc::SYS_ioctl {
        // SAFETY: as below: the interrupted thread's registers; RSI holds the request.
        let request = unsafe { (*(context as *const libc::ucontext_t)).uc_mcontext.gregs }
            [libc::REG_RSI as usize] as u64
            & 0xffff_ffff;
        line.push(b" request ");
        line.push_hex(request);
        if let Some(name) = super::ioctls::name(request) {
            line.push(b" ");
            line.push(name.as_bytes());
        }
    }
    line.push(b"; killing the process with SIGSYS\n");
    let log_fd = LOG_FD.load(Ordering::Relaxed);
    for fd in [libc::STDERR_FILENO, log_fd] {
        if fd >= 0 {
            // SAFETY: writes bytes from a live buffer; write is async-signal-safe.
            unsafe { libc::write(fd, line.bytes.as_ptr().cast(), line.len) };
        }
    }
    // SAFETY: prctl with integer arguments: no core dump of guest memory.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    // The same call again, with the same arguments: the filter refuses it again and, with
    // SIGSYS blocked inside this handler, the kernel kills the process with SIGSYS.
    // SAFETY: the context is the interrupted thread's; its registers hold the syscall's
    // arguments. The call cannot run: the filter that trapped it traps it again.
    unsafe {
        let regs = &(*(context as *const libc::ucontext_t)).uc_mcontext.gregs;
        libc::syscall(
            i64::from(nr),
            regs[libc::REG_RDI as usize],
            regs[libc::REG_RSI as usize],
            regs[libc::REG_RDX as usize],
            regs[libc::REG_R10 as usize],
            regs[libc::REG_R8 as usize],
            regs[libc::REG_R9 as usize],
        );
        libc::_exit(128 + libc::SIGSYS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sigsys_line_names_the_syscall() {
        assert_eq!(syscall_name(libc::SYS_execve), Some("execve"));
        assert_eq!(syscall_name(libc::SYS_ioctl), Some("ioctl"));
        assert_eq!(syscall_name(100_000), None);
        let mut line = Line {
            bytes: [0; 256],
            len: 0,
        };
        line.push(b"nr ");
        line.push_number(59);
        line.push_number(0);
        assert_eq!(&line.bytes[..line.len], b"nr 590");
        line.push(b" ");
        line.push_hex(0x4004_54d0);
        line.push(b" ");
        line.push_hex(0);
        assert_eq!(&line.bytes[..line.len], b"nr 590 0x400454d0 0x0");
    }
}
