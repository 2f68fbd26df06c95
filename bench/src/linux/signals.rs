//! SIGINT, SIGTERM and SIGHUP during a Linux-guest run: the handler only sets a flag, which
//! the waits check.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by SIGINT, SIGTERM or SIGHUP; the waits then end through the error path.
pub(super) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// A signal ends the run through the normal error path, so the guards stop every VMM and
/// remove the work directory.
pub(crate) fn catch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, note_signal as *const () as libc::sighandler_t) };
    }
}
