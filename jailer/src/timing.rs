//! `ROLLBOX_JAILER_TIMINGS=1`: each step of a jail's start and end as one stderr line,
//! `rollbox-jailer timing: STEP MS`, MS counted from the jailer's `main` on the monotonic clock
//! (which the jail's PID 1 and the VMM's process, forked from it, share). `rollbox-bench jailer`
//! reads these lines; without the variable nothing is printed.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Option<Instant>> = OnceLock::new();

/// Starts the clock when timings are asked for; call first thing in `main`.
pub fn start() {
    START.get_or_init(|| {
        std::env::var_os("ROLLBOX_JAILER_TIMINGS")
            .filter(|value| value == "1")
            .map(|_| Instant::now())
    });
}

/// Prints that `step` has just finished.
pub fn step(step: &str) {
    if let Some(Some(start)) = START.get() {
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        eprintln!("rollbox-jailer timing: {step} {ms:.3}");
    }
}
