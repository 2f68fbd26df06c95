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
//! child processes (virtiofsd, a background snapshot's writer) are started by a thread created
//! before any filter is installed: [`Spawner`]. That thread gets a filter of its own that
//! allows what its children need but runs only the binary in one descriptor slot (`exec.rs`).
//!
//! Here: the filters' set-up and installation, and the threads that start filtered. Beside
//! it: the thread kinds (`thread_kind.rs`), the allow-lists (`rules.rs`), the syscall name
//! table (`syscalls.rs`), the ioctl requests (`ioctls.rs`), the SIGSYS reporter
//! (`sigsys.rs`), the process spawner (`spawner.rs`) and what it may run (`exec.rs`).

mod exec;
mod ioctls;
mod rules;
mod sigsys;
mod spawner;
mod syscalls;
mod thread_kind;

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

pub use exec::{fill_slot, spawn_from_slot, SlotError, VIRTIOFSD_SLOT};
pub use spawner::{spawner, Spawner};
pub use syscalls::syscall_name;
pub use thread_kind::ThreadKind;

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
        sigsys::set_log_fd(fd);
    }
    let on = programs.is_some();
    sigsys::set_built_in(*mode == Mode::BuiltIn);
    FILTERS
        .set(programs)
        .map_err(|_| SeccompError::AlreadyConfigured)?;
    spawner();
    if on {
        fix_malloc_arena_limit();
        sigsys::install_sigsys_handler();
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

/// Installs the spawning thread's filter on the calling thread (the spawner's) when seccomp
/// is on: `execve` refused, `execveat` only of a slot's binary
/// ([`spawn_from_slot`]); everything else allowed, for their children. Returns whether it is
/// on; a thread that cannot install it ends the process.
pub fn apply_spawner_filter() -> bool {
    if !enabled() {
        return false;
    }
    let installed = exec::spawner_program()
        .map_err(|e| e.to_string())
        .and_then(|program| seccompiler::apply_filter(&program).map_err(|e| e.to_string()));
    if let Err(e) = installed {
        let message = format!(
            "rollbox-vmm: cannot install the spawners' seccomp filter: {e}; exiting rather than run unfiltered"
        );
        log::error!("{message}");
        eprintln!("{message}");
        std::process::exit(1);
    }
    log::debug!("seccomp: spawner filter installed");
    true
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
    sigsys::remember_thread(kind);
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
/// atomic store, not a syscall: its first syscall under the filter is its body's own. A thread
/// of its spawner's own kind has that filter from `clone` on: the call returns at once, and
/// the thread takes its name as it starts.
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
    // A thread of the spawning thread's own kind inherits that filter with `clone`: installing
    // the same program again would only stack a copy, and waiting for it to start would only
    // wait for its name (together about 0.3 ms of every restore's console thread on the
    // build machines).
    let inherits = enabled() && sigsys::is_thread(kind);
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        if inherits {
            sigsys::remember_thread(kind);
        } else {
            apply(kind);
        }
        theirs.store(true, Ordering::Release);
        let result = body();
        drop(theirs);
        result
    })?;
    // `apply` either installs the filter or ends the process, so the flag comes.
    let mut polls = 0u32;
    while !inherits && !filtered.load(Ordering::Acquire) {
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
            let filter = rules::for_kind(kind)
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
            let rules = rules::for_kind(kind).map_err(|source| SeccompError::BuiltIn {
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
        "spawner: everything but execve, and execveat only of descriptor {VIRTIOFSD_SLOT} (virtiofsd) with AT_EMPTY_PATH"
    )
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
}
