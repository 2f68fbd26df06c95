//! VMM processes in /proc: a process known again by (pid, start time), ended with its process
//! group, and the VMMs (or jailers) that run under a sandboxes directory.

use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// /proc/PID/stat field 22 (start time in clock ticks since boot), or None when there is no
/// such process or it is a zombie.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); field 22 is index 19.
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Whether the process `pid` is alive and is the one that started at `start`.
pub fn is_ours(pid: u32, start: u64) -> bool {
    start_time(pid) == Some(start)
}

/// SIGKILLs the process group of `pid` if `pid` is still the process that started at `start`,
/// then waits up to `timeout` for it to be gone. True once it is gone.
pub fn kill(pid: u32, start: u64, timeout: Duration) -> bool {
    if !is_ours(pid, start) {
        return true;
    }
    let Ok(pgid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: killpg only sends a signal; pgid is the VMM's own group (it was spawned with
    // process_group(0), so its pid is its group id), checked alive by start time just above.
    unsafe { libc::killpg(pgid, libc::SIGKILL) };
    wait_gone(pgid, start, timeout)
}

/// Waits up to `timeout` for the process `pid` that started at `start` to end. Its pidfd
/// becomes readable the moment it does; without one (a kernel before 5.3) /proc is polled.
fn wait_gone(pid: libc::pid_t, start: u64, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    // SAFETY: pidfd_open takes a pid and no flags, and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let Ok(fd) = std::os::fd::RawFd::try_from(fd) else {
        return poll_gone(pid, start, deadline);
    };
    if fd < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            || poll_gone(pid, start, deadline);
    }
    // SAFETY: the descriptor was just opened and is owned by nothing else.
    let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // The pid may have been reused since the kill: the descriptor is the process's only if
    // that pid still has its start time.
    if !is_ours(pid.unsigned_abs(), start) {
        return true;
    }
    let mut ready = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let left_ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: polls one pollfd on the stack, for a descriptor held open above.
        match unsafe { libc::poll(&mut ready, 1, left_ms) } {
            n if n > 0 => return true,
            0 => return !is_ours(pid.unsigned_abs(), start),
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return poll_gone(pid, start, deadline),
        }
    }
}

/// [`wait_gone`] without a pidfd: /proc every 5 ms.
fn poll_gone(pid: libc::pid_t, start: u64, deadline: Instant) -> bool {
    while is_ours(pid.unsigned_abs(), start) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A VMM process found in /proc whose API socket lies under `sandboxes_dir`.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub pid: u32,
    pub start_time: u64,
    /// The sandbox directory's name (the sandbox id).
    pub id: String,
}

/// Every process whose command line has `--api-sock SANDBOXES_DIR/ID/...`, and every
/// `rollbox-jailer` with `--chroot-base SANDBOXES_DIR --id ID`.
pub fn find_vmms(sandboxes_dir: &Path) -> Vec<Found> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let sock = args
            .windows(2)
            .find(|w| w[0] == b"--api-sock")
            .map(|w| Path::new(std::ffi::OsStr::from_bytes(w[1])));
        let value = |flag: &[u8]| {
            args.windows(2)
                .find(|w| w[0] == flag)
                .map(|w| std::ffi::OsStr::from_bytes(w[1]))
        };
        // The jailer, not its child (PID 1 of the jail, same command line, another PID
        // namespace).
        let jailed = value(b"--chroot-base")
            .filter(|base| Path::new(base) == sandboxes_dir)
            .filter(|_| {
                let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
                ns(&pid.to_string()).is_some_and(|theirs| ns("self") == Some(theirs))
            })
            .and_then(|_| value(b"--id"))
            .and_then(|id| id.to_str());
        let Some(id) = sock
            .and_then(|s| s.strip_prefix(sandboxes_dir).ok())
            .and_then(|rel| rel.components().next())
            .and_then(|c| c.as_os_str().to_str())
            .or(jailed)
        else {
            continue;
        };
        if let Some(start_time) = start_time(pid) {
            found.push(Found {
                pid,
                start_time,
                id: id.to_string(),
            });
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    #[test]
    fn kill_ends_a_process_group_and_sees_it_gone() {
        let mut child = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("spawn sleep");
        let start = start_time(child.id()).expect("start time");
        assert!(kill(child.id(), start, Duration::from_secs(10)));
        // Gone once it is a zombie, before anyone reaps it.
        assert!(!is_ours(child.id(), start));
        let status = child.wait().expect("wait");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        // Gone already (or another process's pid): nothing to do.
        assert!(kill(child.id(), start, Duration::from_secs(1)));
        assert!(wait_gone(libc::pid_t::MAX, 0, Duration::from_millis(10)));
    }

    #[test]
    fn find_vmms_knows_a_jailer_by_its_chroot_base_and_id() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().display().to_string();
        finds_then_kills(
            dir.path(),
            &["--id", "sb-00000000000000aa", "--chroot-base", &base],
            "sb-00000000000000aa",
        );
    }

    /// Starts `sh` with a VMM-like command line `args`, checks that [`find_vmms`] under `dir`
    /// names it as sandbox `id`, then ends it with [`kill`].
    fn finds_then_kills(dir: &Path, args: &[&str], id: &str) {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg("sleep 30; true")
            .args(args)
            .process_group(0)
            .spawn()
            .expect("spawn sh");
        let pid = child.id();
        // Until the child has exec'd, its command line is still the test's.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut found = find_vmms(dir);
        while found.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            found = find_vmms(dir);
        }
        assert!(
            found.iter().any(|f| f.pid == pid && f.id == id),
            "{found:?}"
        );
        let start = start_time(pid).expect("start time");
        // kill() waits for the process to be gone; the reaping here is the test's job.
        let waiter = std::thread::spawn(move || child.wait());
        assert!(kill(pid, start, Duration::from_secs(5)));
        let _ = waiter.join();
    }

    #[test]
    fn start_time_of_self_and_of_nobody() {
        let me = std::process::id();
        let start = start_time(me).expect("own start time");
        assert!(is_ours(me, start));
        assert!(!is_ours(me, start + 1));
        assert_eq!(start_time(u32::MAX), None);
    }

    #[test]
    fn finds_a_process_by_its_api_sock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("sb-0123456789abcdef/api.sock");
        let sock = sock.display().to_string();
        finds_then_kills(dir.path(), &["--api-sock", &sock], "sb-0123456789abcdef");
    }
}
