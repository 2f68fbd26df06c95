//! The built-in allow-lists: what each kind of thread may call, with the ioctl numbers and
//! argument conditions that narrow them.

use std::collections::BTreeMap;

use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

use super::ioctls;
use super::thread_kind::ThreadKind;

pub(super) type Rules = BTreeMap<i64, Vec<SeccompRule>>;
pub(super) type BackendResult<T> = Result<T, seccompiler::BackendError>;

fn allow(rules: &mut Rules, syscalls: &[i64]) {
    for nr in syscalls {
        rules.insert(*nr, Vec::new());
    }
}

pub(super) fn arg(index: u8, op: SeccompCmpOp, value: u64) -> BackendResult<SeccompCondition> {
    SeccompCondition::new(index, SeccompCmpArgLen::Qword, op, value)
}

pub(super) fn arg32(index: u8, op: SeccompCmpOp, value: u64) -> BackendResult<SeccompCondition> {
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
pub(super) fn for_kind(kind: ThreadKind) -> BackendResult<Rules> {
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
            allow_values(&mut rules, libc::SYS_ioctl, 1, ioctls::VCPU)?;
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
            allow_values(&mut rules, libc::SYS_ioctl, 1, ioctls::PAGE_SERVER)?;
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
            // sockets: vsock's host side, vhost-user
            libc::SYS_connect,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_accept4,
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
    // ioctl: each request by its full number (see ioctls.rs).
    allow_values(rules, libc::SYS_ioctl, 1, ioctls::VMM)?;
    // prctl: no new privileges, for the filters (besides the common ones).
    add_rule(
        rules,
        libc::SYS_prctl,
        vec![
            arg32(0, SeccompCmpOp::Eq, libc::PR_SET_NO_NEW_PRIVS as u64)?,
            arg(1, SeccompCmpOp::Eq, 1)?,
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `kind`'s rules allow ioctl `request` (one Eq condition on argument 1 per rule).
    fn allows_ioctl(kind: ThreadKind, request: u64) -> bool {
        let rules = for_kind(kind).expect("rules");
        let Some(list) = rules.get(&libc::SYS_ioctl) else {
            return false;
        };
        let wanted =
            SeccompRule::new(vec![arg32(1, SeccompCmpOp::Eq, request).expect("condition")])
                .expect("rule");
        list.contains(&wanted)
    }

    #[test]
    fn ioctls_are_allowed_by_full_number_only() {
        use super::ioctls::*;
        assert!(allows_ioctl(ThreadKind::Vmm, KVM_CREATE_VM));
        assert!(allows_ioctl(ThreadKind::Vmm, UFFDIO_REGISTER));
        assert!(allows_ioctl(ThreadKind::Vcpu, KVM_RUN));
        assert!(allows_ioctl(ThreadKind::PageServer, UFFDIO_COPY));
        // The right type byte, another number or size: refused.
        for request in [
            0xae06,      // KVM's type, a number rollbox-vmm does not use
            0x4008_ae7d, // a KVMIO write of 8 bytes rollbox-vmm does not make
            0xaea0,      // KVM_SET_PIT2's number without its size
            0x5401,      // TCGETS ('T', like FIONBIO)
            0x4004_54cb, // 'T' 203, beside TUNSETIFF
            0x3b76,      // VFIO type, number 118
            0xc018_aa01, // UFFDIO type, UNREGISTER's number with API's size
        ] {
            for kind in ThreadKind::ALL {
                assert!(!allows_ioctl(kind, request), "{kind:?} allows {request:#x}");
            }
        }
        assert!(!allows_ioctl(ThreadKind::Vcpu, KVM_CREATE_VM));
        assert!(!allows_ioctl(ThreadKind::PageServer, UFFDIO_REGISTER));
        assert!(!allows_ioctl(ThreadKind::Api, FIONBIO));
        assert!(!allows_ioctl(ThreadKind::Block, KVM_RUN));
    }
}
