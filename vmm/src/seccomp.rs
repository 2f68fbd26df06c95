//! Per-thread seccomp filters: each kind of thread gets its own allow-list, installed by the
//! thread itself when it starts (the main thread's just before its event loop runs).
//!
//! A syscall outside the list traps (SIGSYS). The handler writes the syscall and the thread
//! kind to stderr (and the log file), then makes the same forbidden call again with SIGSYS
//! blocked, so the kernel kills the process with SIGSYS: the death is visible to whoever
//! waits for the process, and the log says why.
//!
//! Threads created by a filtered thread inherit its filter, and any filter they install is
//! added to it (a syscall must pass both). Processes inherit filters across `execve` too, so
//! child processes (fork clones, virtiofsd) are started by threads created before any filter
//! is installed: [`Spawner`] and the fork launcher. Those threads stay unfiltered; see
//! docs/security.md for what that leaves open.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, OnceLock};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Errors from building or installing the filters.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// The custom filter file could not be read.
    #[error("seccomp filter file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The custom filter file is not a valid filter.
    #[error("seccomp filter file {path}: {source}")]
    Compile {
        /// The file.
        path: PathBuf,
        /// What seccompiler found wrong.
        source: seccompiler::Error,
    },
    /// The custom filter file has no filter for a thread kind.
    #[error("seccomp filter file {path}: no filter for thread kind {kind:?} (it needs one for each of {known})")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The missing kind.
        kind: &'static str,
        /// The kinds it needs.
        known: String,
    },
    /// The custom filter file names a thread kind rollbox-vmm does not have.
    #[error(
        "seccomp filter file {path}: unknown thread kind {kind:?} (rollbox-vmm's are {known})"
    )]
    Unknown {
        /// The file.
        path: PathBuf,
        /// The unknown key.
        kind: String,
        /// The kinds it has.
        known: String,
    },
    /// A built-in filter did not compile (a bug).
    #[error("built-in seccomp filter for {kind}: {source}")]
    BuiltIn {
        /// The thread kind.
        kind: &'static str,
        /// What seccompiler found wrong.
        source: seccompiler::Error,
    },
    /// The filters were configured twice.
    #[error("seccomp filters are already configured")]
    AlreadyConfigured,
}

/// The kinds of threads that get a filter of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ThreadKind {
    /// The main thread (event loop, device set-up, snapshots, restores, forks) and the helper
    /// threads it starts (console writer, fork reapers, slow API answers).
    Vmm,
    /// The API socket's listener and its connection threads.
    Api,
    /// A vCPU: KVM_RUN and the device emulation it exits to.
    Vcpu,
    /// A virtio-blk I/O worker.
    Block,
    /// The userfaultfd page server of a lazy restore.
    PageServer,
}

impl ThreadKind {
    /// Every kind, in the order summaries print them.
    pub const ALL: [ThreadKind; 5] = [
        ThreadKind::Vmm,
        ThreadKind::Api,
        ThreadKind::Vcpu,
        ThreadKind::Block,
        ThreadKind::PageServer,
    ];

    /// The kind's key in a filter file.
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Api => "api",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Block => "block",
            ThreadKind::PageServer => "page_server",
        }
    }

    fn code(self) -> u8 {
        self as u8 + 1
    }

    fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    fn known() -> String {
        Self::ALL.map(Self::name).join(", ")
    }
}

/// Where the filters come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// rollbox-vmm's own allow-lists.
    BuiltIn,
    /// A Firecracker-format JSON file with a filter for each thread kind.
    File(PathBuf),
    /// No filters (`--no-seccomp`).
    Off,
}

type Programs = HashMap<ThreadKind, BpfProgram>;

/// The compiled filters; unset or `None` when seccomp is off.
static FILTERS: OnceLock<Option<Programs>> = OnceLock::new();
/// The log file's descriptor, for the SIGSYS handler (-1: stderr only).
static LOG_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

thread_local! {
    /// This thread's kind (its code; 0 before it installs a filter), for the SIGSYS handler.
    static KIND: Cell<u8> = const { Cell::new(0) };
    /// This thread's name, NUL-padded, once it installs a filter, for the SIGSYS handler.
    static NAME: Cell<[u8; 16]> = const { Cell::new([0; 16]) };
}

/// Whether the built-in filters are in force (they let the SIGSYS handler ask the kernel for
/// the name of a thread that inherited its filter; a custom filter may not).
static BUILT_IN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The mode [`configure`] was given, for the processes this one starts (fork clones).
static MODE: OnceLock<Mode> = OnceLock::new();

/// The flags that give a child `rollbox-vmm` (a fork clone) this process's filters.
pub fn child_args() -> Vec<std::ffi::OsString> {
    match MODE.get() {
        Some(Mode::Off) => vec!["--no-seccomp".into()],
        Some(Mode::File(path)) => vec!["--seccomp-filter".into(), path.clone().into()],
        Some(Mode::BuiltIn) | None => Vec::new(),
    }
}

/// Compiles the filters for `mode` and installs the SIGSYS handler; call once, early in
/// `main`, before any thread that must run unfiltered (the spawner) is needed. Errors name
/// the filter file and what is wrong with it.
pub fn configure(mode: &Mode, log_fd: Option<RawFd>) -> Result<(), SeccompError> {
    let programs = match mode {
        Mode::Off => None,
        Mode::BuiltIn => Some(built_in_programs()?),
        Mode::File(path) => Some(programs_from_file(path)?),
    };
    if let Some(fd) = log_fd {
        LOG_FD.store(fd, std::sync::atomic::Ordering::SeqCst);
    }
    let on = programs.is_some();
    let absolute = match mode {
        Mode::File(path) => Mode::File(std::path::absolute(path).unwrap_or_else(|_| path.clone())),
        other => other.clone(),
    };
    let _ = MODE.set(absolute);
    BUILT_IN.store(*mode == Mode::BuiltIn, std::sync::atomic::Ordering::SeqCst);
    FILTERS
        .set(programs)
        .map_err(|_| SeccompError::AlreadyConfigured)?;
    spawner();
    if on {
        fix_malloc_arena_limit();
        install_sigsys_handler();
        snapshot::uffd::set_page_server_start_hook(|| apply(ThreadKind::PageServer));
        match mode {
            Mode::File(path) => log::info!(
                "seccomp: filters from {} for threads {}",
                path.display(),
                ThreadKind::known()
            ),
            _ => log::info!(
                "seccomp: built-in filters for threads {}",
                ThreadKind::known()
            ),
        }
    } else {
        log::info!("seccomp: off (--no-seccomp)");
    }
    Ok(())
}

/// Fixes glibc's malloc arena limit now (its default, 8 per CPU): otherwise glibc reads
/// /sys/devices/system/cpu/online once a process has more than 8 arenas, from whichever
/// thread needs the next one, and a vCPU or block worker must not need `openat` for that.
fn fix_malloc_arena_limit() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let arenas = libc::c_int::try_from(8 * cpus).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt takes two integers and only changes malloc's tuning.
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) } != 1 {
        log::debug!("seccomp: mallopt(M_ARENA_MAX, {arenas}) failed");
    }
}

/// Whether filters are installed by [`apply`].
pub fn enabled() -> bool {
    matches!(FILTERS.get(), Some(Some(_)))
}

/// Installs `kind`'s filter on the calling thread (nothing when seccomp is off). A thread
/// that cannot install its filter must not run unfiltered: the process ends.
pub fn apply(kind: ThreadKind) {
    let Some(Some(programs)) = FILTERS.get() else {
        return;
    };
    let Some(program) = programs.get(&kind) else {
        return;
    };
    KIND.with(|k| k.set(kind.code()));
    let mut name = [0u8; 16];
    if let Some(own) = std::thread::current().name() {
        for (dst, src) in name.iter_mut().take(15).zip(own.bytes()) {
            *dst = src;
        }
    }
    NAME.with(|n| n.set(name));
    if let Err(e) = seccompiler::apply_filter(program) {
        let message = format!(
            "rollbox-vmm: cannot install the {} seccomp filter: {e}; exiting rather than run unfiltered",
            kind.name()
        );
        log::error!("{message}");
        eprintln!("{message}");
        std::process::exit(1);
    }
    log::debug!("seccomp: {} filter installed", kind.name());
}

/// Starts a thread named `name` that runs `body` under `kind`'s filter, and returns once the
/// thread has its name and filter. Between `clone` and the filter a new thread carries its
/// parent's name and filter; waiting here means nothing after the call (another thread of
/// the VMM, or anyone reading /proc) sees it in that state. The new thread says so with an
/// atomic store, not a syscall: its first syscall under the filter is its body's own.
pub fn spawn_filtered<F, T>(
    name: String,
    kind: ThreadKind,
    body: F,
) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let filtered = Arc::new(AtomicBool::new(false));
    let theirs = Arc::clone(&filtered);
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        apply(kind);
        theirs.store(true, Ordering::Release);
        let result = body();
        drop(theirs);
        result
    })?;
    // `apply` either installs the filter or ends the process, so the flag comes.
    let mut polls = 0u32;
    while !filtered.load(Ordering::Acquire) {
        polls += 1;
        if polls < 100 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
    Ok(handle)
}

fn programs_from_file(path: &Path) -> Result<Programs, SeccompError> {
    let file = std::fs::File::open(path).map_err(|source| SeccompError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let compiled = seccompiler::compile_from_json(std::io::BufReader::new(file), arch()).map_err(
        |source| SeccompError::Compile {
            path: path.to_path_buf(),
            source,
        },
    )?;
    let mut programs = Programs::new();
    for (name, program) in compiled {
        let kind = ThreadKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| SeccompError::Unknown {
                path: path.to_path_buf(),
                kind: name.clone(),
                known: ThreadKind::known(),
            })?;
        programs.insert(kind, program);
    }
    if let Some(kind) = ThreadKind::ALL
        .into_iter()
        .find(|k| !programs.contains_key(k))
    {
        return Err(SeccompError::Missing {
            path: path.to_path_buf(),
            kind: kind.name(),
            known: ThreadKind::known(),
        });
    }
    Ok(programs)
}

fn arch() -> TargetArch {
    TargetArch::x86_64
}

fn built_in_programs() -> Result<Programs, SeccompError> {
    ThreadKind::ALL
        .into_iter()
        .map(|kind| {
            let filter = rules(kind)
                .and_then(|rules| {
                    SeccompFilter::new(rules, SeccompAction::Trap, SeccompAction::Allow, arch())
                })
                .and_then(BpfProgram::try_from)
                .map_err(|source| SeccompError::BuiltIn {
                    kind: kind.name(),
                    source: seccompiler::Error::Backend(source),
                })?;
            Ok((kind, filter))
        })
        .collect()
}

/// Syscalls allowed per thread kind by the built-in filters, by name (for the summary).
pub fn built_in_summary() -> Result<Vec<(ThreadKind, Vec<&'static str>)>, SeccompError> {
    ThreadKind::ALL
        .into_iter()
        .map(|kind| {
            let rules = rules(kind).map_err(|source| SeccompError::BuiltIn {
                kind: kind.name(),
                source: seccompiler::Error::Backend(source),
            })?;
            let mut names: Vec<&'static str> = rules
                .keys()
                .map(|nr| syscall_name(*nr).unwrap_or("?"))
                .collect();
            names.sort_unstable();
            Ok((kind, names))
        })
        .collect()
}

// ---- the SIGSYS handler ----

fn install_sigsys_handler() {
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
    } else if BUILT_IN.load(std::sync::atomic::Ordering::Relaxed) {
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
    line.push(b"); killing the process with SIGSYS\n");
    let log_fd = LOG_FD.load(std::sync::atomic::Ordering::Relaxed);
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

// ---- the spawner ----

type SpawnRequest = (Command, Sender<std::io::Result<Child>>);

/// Starts child processes from one long-lived thread that never installs a filter (children
/// inherit their parent thread's filters across `execve`). Started by [`configure`], before
/// any filter exists.
pub struct Spawner {
    requests: Mutex<Option<Sender<SpawnRequest>>>,
}

/// The process's spawner (started on first use; [`configure`] uses it first).
pub fn spawner() -> &'static Spawner {
    static SPAWNER: OnceLock<Spawner> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (requests, incoming) = channel::<SpawnRequest>();
        let started = std::thread::Builder::new()
            .name("spawner".into())
            .spawn(move || {
                for (mut command, reply) in incoming {
                    let _ = reply.send(command.spawn());
                }
            });
        if let Err(e) = &started {
            log::warn!("no spawner thread ({e}): child processes start from their caller");
        }
        Spawner {
            requests: Mutex::new(started.ok().map(|_| requests)),
        }
    })
}

impl Spawner {
    /// Starts `command` from the spawner thread (from the caller if there is none).
    pub fn spawn(&self, mut command: Command) -> std::io::Result<Child> {
        let requests = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(requests) = requests else {
            return command.spawn();
        };
        let ended = || std::io::Error::other("the spawner thread has ended");
        let (reply, answer) = channel();
        requests.send((command, reply)).map_err(|_| ended())?;
        answer.recv().map_err(|_| ended())?
    }
}

/// Prints the built-in allow-lists: per thread kind, the count and the names.
pub fn print_summary(out: &mut impl std::io::Write) -> std::io::Result<()> {
    let summary = built_in_summary().map_err(std::io::Error::other)?;
    writeln!(
        out,
        "syscalls allowed per thread kind (built-in filters, x86_64):"
    )?;
    for (kind, names) in &summary {
        writeln!(
            out,
            "{:<12} {:>3}  {}",
            kind.name(),
            names.len(),
            names.join(" ")
        )?;
    }
    writeln!(
        out,
        "unfiltered   threads that start child processes (spawner, fork-launcher): see docs/security.md"
    )
}

// ---- the allow-lists ----

/// `(name, number)` of each `SYS_` constant given.
macro_rules! syscalls {
    ($($sys:ident),* $(,)?) => {
        &[$((stringify!($sys), libc::$sys)),*]
    };
}

/// Every syscall the built-in filters name, and forbidden ones worth naming in a SIGSYS
/// message.
const SYSCALLS: &[(&str, i64)] = syscalls![
    SYS_accept4,
    SYS_brk,
    SYS_clock_gettime,
    SYS_clock_nanosleep,
    SYS_clone,
    SYS_clone3,
    SYS_close,
    SYS_connect,
    SYS_dup,
    SYS_epoll_create1,
    SYS_epoll_ctl,
    SYS_epoll_pwait,
    SYS_epoll_wait,
    SYS_eventfd2,
    SYS_execve,
    SYS_execveat,
    SYS_exit,
    SYS_exit_group,
    SYS_fallocate,
    SYS_fcntl,
    SYS_fdatasync,
    SYS_fork,
    SYS_fstat,
    SYS_fsync,
    SYS_ftruncate,
    SYS_futex,
    SYS_getdents64,
    SYS_getpid,
    SYS_getrandom,
    SYS_gettid,
    SYS_ioctl,
    SYS_kill,
    SYS_lseek,
    SYS_madvise,
    SYS_memfd_create,
    SYS_mkdirat,
    SYS_mmap,
    SYS_mprotect,
    SYS_mremap,
    SYS_munmap,
    SYS_nanosleep,
    SYS_newfstatat,
    SYS_openat,
    SYS_pipe2,
    SYS_poll,
    SYS_ppoll,
    SYS_prctl,
    SYS_pread64,
    SYS_preadv,
    SYS_ptrace,
    SYS_pwrite64,
    SYS_pwritev,
    SYS_read,
    SYS_readlink,
    SYS_readv,
    SYS_recvfrom,
    SYS_recvmsg,
    SYS_renameat2,
    SYS_rt_sigaction,
    SYS_rt_sigprocmask,
    SYS_rt_sigreturn,
    SYS_sched_yield,
    SYS_sendmsg,
    SYS_sendto,
    SYS_setsockopt,
    SYS_shutdown,
    SYS_sigaltstack,
    SYS_socket,
    SYS_socketpair,
    SYS_statx,
    SYS_tgkill,
    SYS_unlinkat,
    SYS_vfork,
    SYS_wait4,
    SYS_write,
    SYS_writev,
    SYS_bind,
    SYS_listen,
    SYS_getsockopt,
    SYS_fchmod,
    SYS_symlinkat,
    SYS_linkat,
    SYS_readlinkat,
    SYS_fstatfs,
    SYS_statfs,
    SYS_sched_getaffinity,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_getuid,
    SYS_geteuid,
    SYS_getppid,
    SYS_restart_syscall,
    SYS_access,
    SYS_faccessat,
    SYS_faccessat2,
    SYS_fchown,
    SYS_copy_file_range,
    SYS_sendfile,
    SYS_getcwd,
    SYS_prlimit64,
    SYS_sysinfo,
    SYS_rseq,
    SYS_set_robust_list,
    SYS_mount,
    SYS_umount2,
    SYS_unshare,
    SYS_setns,
    SYS_pivot_root,
    SYS_chroot,
    SYS_setuid,
    SYS_init_module,
    SYS_finit_module,
    SYS_bpf,
    SYS_perf_event_open,
    SYS_process_vm_writev,
    SYS_process_vm_readv,
    SYS_userfaultfd,
    SYS_seccomp,
    SYS_membarrier,
    SYS_getsockname,
    SYS_getpeername,
    SYS_uname,
    SYS_fdatasync,
    SYS_mincore,
    SYS_msync,
    SYS_waitid,
    SYS_pidfd_open,
    SYS_pidfd_send_signal,
    SYS_close_range,
    SYS_dup3,
    SYS_fchdir,
    SYS_chdir,
    SYS_flock,
    SYS_setsid,
    SYS_setpgid,
    SYS_gettimeofday,
    SYS_time,
    SYS_mkdir,
    SYS_rmdir,
    SYS_unlink,
    SYS_rename,
    SYS_renameat,
];

/// The name of syscall `nr`, if the table has it.
pub fn syscall_name(nr: i64) -> Option<&'static str> {
    SYSCALLS
        .iter()
        .find(|(_, n)| *n == nr)
        .map(|(name, _)| name.trim_start_matches("SYS_"))
}

type Rules = BTreeMap<i64, Vec<SeccompRule>>;
type BackendResult<T> = Result<T, seccompiler::BackendError>;

fn allow(rules: &mut Rules, syscalls: &[i64]) {
    for nr in syscalls {
        rules.insert(*nr, Vec::new());
    }
}

fn arg(index: u8, op: SeccompCmpOp, value: u64) -> BackendResult<SeccompCondition> {
    SeccompCondition::new(index, SeccompCmpArgLen::Qword, op, value)
}

fn arg32(index: u8, op: SeccompCmpOp, value: u64) -> BackendResult<SeccompCondition> {
    SeccompCondition::new(index, SeccompCmpArgLen::Dword, op, value)
}

/// `nr` with `arg index == value` for each of `values`.
fn allow_values(rules: &mut Rules, nr: i64, index: u8, values: &[u64]) -> BackendResult<()> {
    let list = values
        .iter()
        .map(|v| SeccompRule::new(vec![arg32(index, SeccompCmpOp::Eq, *v)?]))
        .collect::<BackendResult<Vec<_>>>()?;
    rules.entry(nr).or_default().extend(list);
    Ok(())
}

/// ioctl request numbers: `_IO`, `_IOR`, `_IOW`, `_IOWR` of type `ty`, number `nr`, with an
/// argument of `size` bytes.
const fn ioc(dir: u64, ty: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (ty << 8) | nr
}
const KVMIO: u64 = 0xAE;
const IOW: u64 = 1;
const KVM_RUN: u64 = ioc(0, KVMIO, 0x80, 0);
// PCI config and MSI/MSI-X writes are emulated on the vCPU thread: they move BARs, route MSIs
// and (for VFIO) switch the device's interrupts.
const KVM_SET_USER_MEMORY_REGION: u64 = ioc(IOW, KVMIO, 0x46, 32);
const KVM_SET_GSI_ROUTING: u64 = ioc(IOW, KVMIO, 0x6a, 8);
const KVM_IRQFD: u64 = ioc(IOW, KVMIO, 0x76, 32);
const KVM_IOEVENTFD: u64 = ioc(IOW, KVMIO, 0x79, 64);
const KVM_SIGNAL_MSI: u64 = ioc(IOW, KVMIO, 0xa5, 32);
const VFIO_DEVICE_SET_IRQS: u64 = ioc(0, b';' as u64, 100 + 10, 0);
// A crash exit reports the vCPU's registers from its own thread.
const IOR: u64 = 2;
const KVM_GET_REGS: u64 = ioc(IOR, KVMIO, 0x81, 144);
const KVM_GET_SREGS: u64 = ioc(IOR, KVMIO, 0x83, 312);
// virtio-net's activation (DRIVER_OK, written by the guest) sets the tap's offloads.
const TUNSETOFFLOAD: u64 = ioc(IOW, b'T' as u64, 208, 4);
const VCPU_IOCTLS: [u64; 10] = [
    KVM_RUN,
    KVM_GET_REGS,
    KVM_GET_SREGS,
    KVM_SET_USER_MEMORY_REGION,
    KVM_SET_GSI_ROUTING,
    KVM_IRQFD,
    KVM_IOEVENTFD,
    KVM_SIGNAL_MSI,
    VFIO_DEVICE_SET_IRQS,
    TUNSETOFFLOAD,
];
/// The ioctl "types" (the request's second byte) the main thread may use: KVM, VFIO, tun,
/// userfaultfd, and 'T' also holds FIONBIO/FIOCLEX and the tty ones std uses.
const VMM_IOCTL_TYPES: [u64; 4] = [KVMIO, b';' as u64, b'T' as u64, 0xAA];

/// mmap and mprotect without PROT_EXEC.
fn allow_memory_no_exec(rules: &mut Rules) -> BackendResult<()> {
    for nr in [libc::SYS_mmap, libc::SYS_mprotect] {
        rules.insert(
            nr,
            vec![SeccompRule::new(vec![arg(
                2,
                SeccompCmpOp::MaskedEq(libc::PROT_EXEC as u64),
                0,
            )?])?],
        );
    }
    Ok(())
}

/// What every filtered thread needs: memory, locks, time, signals, thread exit, writing a
/// log line, and the SIGSYS handler's prctls (its name; no core dump of guest memory).
fn common(rules: &mut Rules) -> BackendResult<()> {
    allow(
        rules,
        &[
            libc::SYS_brk,
            libc::SYS_munmap,
            libc::SYS_madvise,
            libc::SYS_mremap,
            libc::SYS_futex,
            libc::SYS_sched_yield,
            libc::SYS_clock_gettime,
            libc::SYS_gettimeofday,
            libc::SYS_clock_nanosleep,
            libc::SYS_nanosleep,
            libc::SYS_rt_sigreturn,
            libc::SYS_rt_sigprocmask,
            libc::SYS_sigaltstack,
            libc::SYS_restart_syscall,
            libc::SYS_exit,
            libc::SYS_exit_group,
            libc::SYS_write,
            libc::SYS_getpid,
            libc::SYS_gettid,
            libc::SYS_getrandom,
            libc::SYS_close,
            libc::SYS_sched_getaffinity,
        ],
    );
    allow_memory_no_exec(rules)?;
    // Descriptor flags only (std checks and duplicates descriptors; no locks, no seals).
    for cmd in [
        libc::F_GETFD,
        libc::F_SETFD,
        libc::F_GETFL,
        libc::F_SETFL,
        libc::F_DUPFD_CLOEXEC,
    ] {
        add_rule(
            rules,
            libc::SYS_fcntl,
            vec![arg32(1, SeccompCmpOp::Eq, cmd as u64)?],
        )?;
    }
    add_rule(
        rules,
        libc::SYS_prctl,
        vec![
            arg32(0, SeccompCmpOp::Eq, libc::PR_SET_DUMPABLE as u64)?,
            arg(1, SeccompCmpOp::Eq, 0)?,
        ],
    )?;
    add_rule(
        rules,
        libc::SYS_prctl,
        vec![arg32(0, SeccompCmpOp::Eq, libc::PR_GET_NAME as u64)?],
    )
}

/// Allows `nr` when all of `conditions` hold (besides its other rules).
fn add_rule(rules: &mut Rules, nr: i64, conditions: Vec<SeccompCondition>) -> BackendResult<()> {
    rules
        .entry(nr)
        .or_default()
        .push(SeccompRule::new(conditions)?);
    Ok(())
}

/// Thread creation: `clone` only with CLONE_THREAD (no new processes); `clone3`, whose
/// flags seccomp cannot see, is allowed too (see docs/security.md).
fn allow_threads(rules: &mut Rules) -> BackendResult<()> {
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![arg(
            0,
            SeccompCmpOp::MaskedEq(thread),
            thread,
        )?])?],
    );
    allow(
        rules,
        &[libc::SYS_clone3, libc::SYS_set_robust_list, libc::SYS_rseq],
    );
    // A new thread names itself.
    add_rule(
        rules,
        libc::SYS_prctl,
        vec![arg32(0, SeccompCmpOp::Eq, libc::PR_SET_NAME as u64)?],
    )
}

/// The allow-list of `kind`.
fn rules(kind: ThreadKind) -> BackendResult<Rules> {
    let mut rules = Rules::new();
    common(&mut rules)?;
    match kind {
        ThreadKind::Vcpu => {
            // Device activation and reset run here (the guest writes the status register):
            // epoll registrations, and virtio-fs's vhost-user messages to virtiofsd. read:
            // MSI-X pending eventfds; pread64/pwrite64: a VFIO device's config space and
            // unmapped BARs; eventfd2: the irqfds of VFIO MSI/MSI-X vectors the guest enables
            // (seen in the lab: edu and NVMe).
            allow(
                &mut rules,
                &[
                    libc::SYS_eventfd2,
                    libc::SYS_read,
                    libc::SYS_epoll_ctl,
                    libc::SYS_sendmsg,
                    libc::SYS_recvmsg,
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                ],
            );
            allow_values(&mut rules, libc::SYS_ioctl, 1, &VCPU_IOCTLS)?;
        }
        ThreadKind::Block => {
            allow(
                &mut rules,
                &[
                    libc::SYS_read,
                    libc::SYS_epoll_wait,
                    libc::SYS_epoll_pwait,
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                    libc::SYS_preadv,
                    libc::SYS_pwritev,
                    libc::SYS_fsync,
                    libc::SYS_fdatasync,
                    libc::SYS_lseek,
                ],
            );
        }
        ThreadKind::PageServer => {
            allow(
                &mut rules,
                &[
                    libc::SYS_read,
                    libc::SYS_poll,
                    libc::SYS_ppoll,
                    libc::SYS_pread64,
                ],
            );
            // UFFDIO_COPY, UFFDIO_ZEROPAGE, UFFDIO_WAKE (type 0xAA).
            rules.insert(
                libc::SYS_ioctl,
                vec![SeccompRule::new(vec![arg32(
                    1,
                    SeccompCmpOp::MaskedEq(0xFF00),
                    0xAA00,
                )?])?],
            );
            // Its failure hook starts a timer thread.
            allow_threads(&mut rules)?;
        }
        ThreadKind::Api => {
            allow(
                &mut rules,
                &[
                    libc::SYS_accept4,
                    libc::SYS_read,
                    libc::SYS_recvfrom,
                    libc::SYS_sendto,
                    libc::SYS_writev,
                    libc::SYS_shutdown,
                    libc::SYS_poll,
                ],
            );
            allow_threads(&mut rules)?;
        }
        ThreadKind::Vmm => vmm_rules(&mut rules)?,
    }
    Ok(rules)
}

fn vmm_rules(rules: &mut Rules) -> BackendResult<()> {
    allow_threads(rules)?;
    allow(
        rules,
        &[
            // files: snapshots, memory layers, drives, state, sockets' paths
            libc::SYS_read,
            libc::SYS_readv,
            libc::SYS_writev,
            libc::SYS_pread64,
            libc::SYS_pwrite64,
            libc::SYS_preadv,
            libc::SYS_pwritev,
            libc::SYS_openat,
            libc::SYS_close,
            libc::SYS_close_range,
            libc::SYS_lseek,
            libc::SYS_fstat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_statfs,
            libc::SYS_fstatfs,
            libc::SYS_getdents64,
            libc::SYS_mkdir,
            libc::SYS_mkdirat,
            libc::SYS_rmdir,
            libc::SYS_unlink,
            libc::SYS_unlinkat,
            libc::SYS_rename,
            libc::SYS_renameat,
            libc::SYS_renameat2,
            libc::SYS_linkat,
            libc::SYS_symlinkat,
            libc::SYS_readlink,
            libc::SYS_readlinkat,
            libc::SYS_access,
            libc::SYS_faccessat,
            libc::SYS_faccessat2,
            libc::SYS_ftruncate,
            libc::SYS_fallocate,
            libc::SYS_fsync,
            libc::SYS_fdatasync,
            libc::SYS_fchmod,
            libc::SYS_flock,
            libc::SYS_copy_file_range,
            libc::SYS_sendfile,
            libc::SYS_getcwd,
            libc::SYS_dup,
            libc::SYS_dup3,
            libc::SYS_pipe2,
            libc::SYS_memfd_create,
            libc::SYS_mincore,
            libc::SYS_msync,
            // event loop and notifications
            libc::SYS_epoll_create1,
            libc::SYS_epoll_ctl,
            libc::SYS_epoll_wait,
            libc::SYS_epoll_pwait,
            libc::SYS_eventfd2,
            libc::SYS_poll,
            libc::SYS_ppoll,
            libc::SYS_timerfd_create,
            libc::SYS_timerfd_settime,
            // sockets: vsock's host side, vhost-user, fork control
            libc::SYS_connect,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_accept4,
            libc::SYS_socketpair,
            libc::SYS_sendmsg,
            libc::SYS_recvmsg,
            libc::SYS_sendto,
            libc::SYS_recvfrom,
            libc::SYS_shutdown,
            libc::SYS_getsockopt,
            libc::SYS_setsockopt,
            libc::SYS_getsockname,
            libc::SYS_getpeername,
            // vCPU kicks, child processes it started, lazy restores
            libc::SYS_tgkill,
            libc::SYS_kill,
            libc::SYS_wait4,
            libc::SYS_waitid,
            libc::SYS_userfaultfd,
            libc::SYS_rt_sigaction,
            libc::SYS_getuid,
            libc::SYS_geteuid,
            libc::SYS_getppid,
            libc::SYS_uname,
            libc::SYS_sysinfo,
            libc::SYS_prlimit64,
            // installing the filters of the threads it starts
            libc::SYS_seccomp,
        ],
    );
    // Every fcntl (the main thread also locks files and seals memfds).
    rules.insert(libc::SYS_fcntl, Vec::new());
    // socket(): Unix sockets only (tap devices are files; see docs/security.md).
    allow_values(rules, libc::SYS_socket, 0, &[libc::AF_UNIX as u64])?;
    let ioctls = VMM_IOCTL_TYPES
        .iter()
        .map(|ty| SeccompRule::new(vec![arg32(1, SeccompCmpOp::MaskedEq(0xFF00), ty << 8)?]))
        .collect::<BackendResult<Vec<_>>>()?;
    rules.insert(libc::SYS_ioctl, ioctls);
    // prctl: no new privileges (for the filters) and clearing a fork clone's parent-death
    // signal (besides the common ones).
    for (option, value) in [(libc::PR_SET_NO_NEW_PRIVS, 1), (libc::PR_SET_PDEATHSIG, 0)] {
        add_rule(
            rules,
            libc::SYS_prctl,
            vec![
                arg32(0, SeccompCmpOp::Eq, option as u64)?,
                arg(1, SeccompCmpOp::Eq, value)?,
            ],
        )?;
    }
    Ok(())
}

/// Test-only hooks, compiled only into debug builds with the `test-hooks` feature (the
/// integration tests' build of rollbox-vmm); a release build never has them.
#[cfg(all(feature = "test-hooks", debug_assertions))]
pub mod test_hooks {
    /// With ROLLBOX_TEST_FORBIDDEN_SYSCALL=execve in its environment, vCPU 0 calls execve
    /// right after installing its filter (which forbids it).
    pub fn forbidden_syscall_on_vcpu(index: u8) {
        if index != 0
            || std::env::var_os("ROLLBOX_TEST_FORBIDDEN_SYSCALL").is_none_or(|v| v != "execve")
        {
            return;
        }
        log::error!("test hook: vCPU 0 calls execve");
        let path = c"/bin/true";
        let argv = [path.as_ptr(), std::ptr::null()];
        let envp = [std::ptr::null()];
        // SAFETY: NUL-terminated path and NULL-terminated argument and environment arrays
        // that outlive the call; the filter stops it before it runs.
        unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
        log::error!(
            "test hook: execve returned: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_filter_compiles_and_none_allows_starting_programs() {
        let programs = built_in_programs().expect("built-in filters");
        assert_eq!(programs.len(), ThreadKind::ALL.len());
        for (kind, names) in built_in_summary().expect("summary") {
            assert!(!names.contains(&"?"), "{kind:?} names an unknown syscall");
            for forbidden in ["execve", "execveat", "fork", "vfork", "ptrace", "mount"] {
                assert!(!names.contains(&forbidden), "{kind:?} allows {forbidden}");
            }
        }
    }

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        assert_eq!(KVM_RUN, 0xae80);
        assert_eq!(KVM_GET_REGS, 0x8090_ae81);
        assert_eq!(KVM_GET_SREGS, 0x8138_ae83);
        assert_eq!(std::mem::size_of::<kvm_bindings::kvm_regs>(), 144);
        assert_eq!(std::mem::size_of::<kvm_bindings::kvm_sregs>(), 312);
        assert_eq!(KVM_SET_USER_MEMORY_REGION, 0x4020_ae46);
        assert_eq!(KVM_SET_GSI_ROUTING, 0x4008_ae6a);
        assert_eq!(KVM_IRQFD, 0x4020_ae76);
        assert_eq!(KVM_IOEVENTFD, 0x4040_ae79);
        assert_eq!(KVM_SIGNAL_MSI, 0x4020_aea5);
        assert_eq!(VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(TUNSETOFFLOAD, 0x4004_54d0);
    }

    #[test]
    fn a_bad_filter_file_is_an_error_that_names_it_and_the_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.json");
        let err = programs_from_file(&missing).expect_err("missing file");
        assert!(
            err.to_string()
                .starts_with(&format!("seccomp filter file {}: ", missing.display())),
            "{err}"
        );
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "[1, 2").expect("write");
        let err = programs_from_file(&bad).expect_err("bad json");
        assert!(err.to_string().contains("bad.json"), "{err}");
        let filter = r#"{"default_action": "trap", "filter_action": "allow", "filter": [{"syscall": "read"}]}"#;
        let only_vcpu = dir.path().join("vcpu.json");
        std::fs::write(&only_vcpu, format!(r#"{{"vcpu": {filter}}}"#)).expect("write");
        let err = programs_from_file(&only_vcpu).expect_err("kinds missing");
        assert!(
            err.to_string()
                .contains("no filter for thread kind \"vmm\""),
            "{err}"
        );
        let all: Vec<String> = ThreadKind::ALL
            .iter()
            .map(|k| format!(r#""{}": {filter}"#, k.name()))
            .collect();
        let good = dir.path().join("good.json");
        std::fs::write(&good, format!("{{{}}}", all.join(","))).expect("write");
        assert_eq!(programs_from_file(&good).expect("good").len(), 5);
        let extra = dir.path().join("extra.json");
        std::fs::write(
            &extra,
            format!(r#"{{{}, "vcpus": {filter}}}"#, all.join(",")),
        )
        .expect("write");
        let err = programs_from_file(&extra).expect_err("unknown kind");
        assert!(
            err.to_string().contains("unknown thread kind \"vcpus\""),
            "{err}"
        );
    }

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
    }
}
