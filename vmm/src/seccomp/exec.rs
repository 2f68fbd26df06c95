//! What the thread that starts child processes (the spawner) may run: the binary in one fixed
//! descriptor slot (virtiofsd), and nothing else.
//!
//! seccomp cannot read a path, so those threads' filter refuses `execve` outright and allows
//! `execveat` only on the slot's descriptor with `AT_EMPTY_PATH`; a child started from there
//! runs the slot's binary through `execveat(slot, "", ...)` (see [`spawn_from_slot`]).
//! Children inherit the filter.
//!
//! What it leaves: seccomp cannot see `execveat`'s path either, and an absolute path ignores
//! the descriptor; a thread whose control flow an attacker holds can still run any file its
//! jail can see. It stops the easier route: a request on the spawner's channel naming
//! another program.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};

use seccompiler::{BpfProgram, SeccompAction, SeccompCmpOp, SeccompFilter, SeccompRule};

use super::rules::{arg, arg32, BackendResult, Rules};

/// The descriptor slot of the virtiofsd binary.
pub const VIRTIOFSD_SLOT: RawFd = 961;

/// Errors filling a slot.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    /// The binary could not be opened.
    #[error("cannot open {path} to start it later: {source}")]
    Open {
        /// The binary.
        path: std::path::PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The slot's number is taken by another descriptor.
    #[error("descriptor {slot} (the slot of {path}) is in use; it cannot hold the binary")]
    Taken {
        /// The binary.
        path: std::path::PathBuf,
        /// The slot.
        slot: RawFd,
    },
    /// The slot holds another file.
    #[error("descriptor slot {slot} holds another file than {path} (a rollbox-vmm runs one virtiofsd binary)")]
    Other {
        /// The binary asked for.
        path: std::path::PathBuf,
        /// The slot.
        slot: RawFd,
    },
}

/// Puts `path` in descriptor `slot` (close-on-exec, opened `O_PATH`), unless the slot holds it
/// already; an error if the slot holds something else or its number is taken.
pub fn fill_slot(slot: RawFd, path: &Path) -> Result<(), SlotError> {
    let wanted = std::fs::metadata(path).map_err(|source| SlotError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    if let Some((dev, ino)) = slot_identity(slot) {
        if (dev, ino) == (wanted.dev(), wanted.ino()) {
            return Ok(());
        }
        return Err(SlotError::Other {
            path: path.to_path_buf(),
            slot,
        });
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(path)
        .map_err(|source| SlotError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    // F_DUPFD_CLOEXEC takes the lowest free number from `slot` on: the slot itself, or a
    // higher one when the slot's number is in use (then nothing is clobbered).
    // SAFETY: fcntl on a descriptor we own; it only creates a new descriptor.
    let fd = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::F_DUPFD_CLOEXEC,
            slot,
        )
    };
    if fd < 0 {
        return Err(SlotError::Open {
            path: path.to_path_buf(),
            source: io::Error::last_os_error(),
        });
    }
    if fd != slot {
        // SAFETY: closes the duplicate just made, which nothing else knows.
        unsafe { libc::close(fd) };
        return Err(SlotError::Taken {
            path: path.to_path_buf(),
            slot,
        });
    }
    Ok(())
}

/// The (device, inode) of what `slot` holds, if it is open.
fn slot_identity(slot: RawFd) -> Option<(u64, u64)> {
    // SAFETY: fstat writes into a zeroed stat on our stack; a closed slot gives EBADF.
    let mut stat = unsafe { std::mem::zeroed::<libc::stat>() };
    // SAFETY: as above.
    if unsafe { libc::fstat(slot, &mut stat) } != 0 {
        return None;
    }
    Some((stat.st_dev, stat.st_ino))
}

/// The rules of the spawning threads' filter, whose matches are refused with EPERM (all else
/// is allowed: their children inherit the filter and need what rollbox-vmm and virtiofsd need).
pub(super) fn refused_rules() -> BackendResult<Rules> {
    let mut rules = Rules::new();
    // execve: never.
    rules.insert(libc::SYS_execve, Vec::new());
    // execveat: refused outside the slot, or without AT_EMPTY_PATH.
    rules.insert(
        libc::SYS_execveat,
        vec![
            SeccompRule::new(vec![arg32(0, SeccompCmpOp::Ne, VIRTIOFSD_SLOT as u64)?])?,
            SeccompRule::new(vec![arg(
                4,
                SeccompCmpOp::MaskedEq(libc::AT_EMPTY_PATH as u64),
                0,
            )?])?,
        ],
    );
    Ok(rules)
}

/// The spawning threads' filter: execve refused, execveat only on a slot, with EPERM.
pub(super) fn spawner_program() -> Result<BpfProgram, seccompiler::BackendError> {
    let filter = SeccompFilter::new(
        refused_rules()?,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        seccompiler::TargetArch::x86_64,
    )?;
    BpfProgram::try_from(filter)
}

/// Starts `command` (its arguments, stdio, process group and pre-exec steps) with the binary
/// in `slot` instead of its program: `execveat(slot, "", argv, envp, AT_EMPTY_PATH)` as the
/// child's last pre-exec step. The child gets this process's environment (rollbox-vmm sets
/// none of its own on these commands).
pub fn spawn_from_slot(mut command: Command, slot: RawFd) -> io::Result<Child> {
    if slot_identity(slot).is_none() {
        return Err(io::Error::other(format!(
            "descriptor slot {slot} holds no binary (the log says why it could not be filled)"
        )));
    }
    let c_string = |s: &OsStr| {
        CString::new(s.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let mut argv = vec![c_string(command.get_program())?];
    for arg in command.get_args() {
        argv.push(c_string(arg)?);
    }
    let mut envp = Vec::new();
    for (key, value) in std::env::vars_os() {
        let mut pair = key.into_encoded_bytes();
        pair.push(b'=');
        pair.extend_from_slice(value.as_encoded_bytes());
        envp.push(CString::new(pair).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?);
    }
    // Built here: the child must not allocate between fork and exec.
    let pointers = |list: &[CString]| {
        list.iter()
            .map(|s| s.as_ptr() as usize)
            .chain([0])
            .collect::<Vec<usize>>()
    };
    let (argv_ptrs, envp_ptrs) = (pointers(&argv), pointers(&envp));
    let empty = c"";
    // SAFETY: between fork and exec the closure calls only execveat, which is async-signal-
    // safe, with NULL-terminated arrays of pointers into `argv` and `envp`, which the closure
    // owns and which outlive the call.
    unsafe {
        command.pre_exec(move || {
            let _owned = (&argv, &envp);
            libc::syscall(
                libc::SYS_execveat,
                slot,
                empty.as_ptr(),
                argv_ptrs.as_ptr(),
                envp_ptrs.as_ptr(),
                libc::AT_EMPTY_PATH,
            );
            Err(io::Error::last_os_error())
        });
    }
    command.spawn()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `body` on a new thread under the spawning threads' filter.
    fn filtered<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            let program = spawner_program().expect("filter");
            seccompiler::apply_filter(&program).expect("install");
            body()
        })
        .join()
        .expect("thread")
    }

    #[test]
    fn a_spawning_thread_runs_only_the_binary_in_its_slot() {
        // The test process's own slot numbers: free, or this test's from an earlier run.
        let true_bin = Path::new("/bin/true");
        fill_slot(VIRTIOFSD_SLOT, true_bin).expect("slot");
        // Filling it again with the same binary is fine; with another, an error naming it.
        fill_slot(VIRTIOFSD_SLOT, true_bin).expect("same binary");
        let err = fill_slot(VIRTIOFSD_SLOT, Path::new("/bin/sh")).expect_err("other binary");
        assert!(err.to_string().contains("/bin/sh"), "{err}");
        // A shell in a descriptor outside the slots.
        let shell = std::fs::File::open("/bin/sh").expect("open /bin/sh");
        let shell_fd = std::os::fd::AsRawFd::as_raw_fd(&shell);
        assert!(shell_fd < VIRTIOFSD_SLOT);
        let (plain, by_slot, shell_by_slot_path) = filtered(move || {
            let plain = Command::new("/bin/sh").args(["-c", "exit 0"]).spawn();
            let by_slot = spawn_from_slot(Command::new("virtiofsd"), VIRTIOFSD_SLOT)
                .and_then(|mut child| child.wait());
            let outside = spawn_from_slot(Command::new("sh"), shell_fd);
            (plain.map(|_| ()), by_slot, outside.map(|_| ()))
        });
        drop(shell);
        let err = plain.expect_err("execve of /bin/sh from a spawning thread");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        assert!(by_slot.expect("the slot's binary runs").success());
        let err = shell_by_slot_path.expect_err("a descriptor outside the slots");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    }
}
