//! The binary's logger: `rollbox serve`'s log lines (the `log` records of this crate) to
//! stderr, one line each, as `rollbox serve: MESSAGE` (`rollbox serve: debug: MESSAGE` for
//! debug records). Records of other crates (TLS, HTTP, the registry client) are not shown.

/// Where the lines go and which are shown.
struct Logger {
    /// The line prefix: the command that logs.
    prefix: &'static str,
    level: log::LevelFilter,
}

/// Whether a record comes from this crate (library or binary).
fn ours(target: &str) -> bool {
    target == "rollbox" || target.starts_with("rollbox::")
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.level && ours(metadata.target())
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        use std::io::Write as _;
        let kind = if record.level() >= log::Level::Debug {
            "debug: "
        } else {
            ""
        };
        // Not eprintln!, which panics when stderr is gone (a closed pipe, a terminal that
        // went away): a daemon whose log cannot be written keeps serving.
        let _ = writeln!(
            std::io::stderr().lock(),
            "{}: {kind}{}",
            self.prefix,
            record.args()
        );
    }

    fn flush(&self) {}
}

/// Installs the logger: info and above, debug too with `ROLLBOX_LOG=debug` (phase timings of
/// creates and stops).
pub fn init(prefix: &'static str) {
    let level = if std::env::var("ROLLBOX_LOG").is_ok_and(|v| v == "debug") {
        log::LevelFilter::Debug
    } else {
        log::LevelFilter::Info
    };
    let logger = Box::leak(Box::new(Logger { prefix, level }));
    // Fails only when a logger is set already; the first one stays.
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_crates_records_are_ours() {
        assert!(ours("rollbox"));
        assert!(ours("rollbox::daemon::sandboxes"));
        assert!(!ours("rollbox_jailer"));
        assert!(!ours("rustls::server"));
    }
}
