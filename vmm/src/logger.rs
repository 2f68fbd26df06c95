//! A small `log` backend: one line per record to stderr or a log file. Warnings and info
//! lines are rate-limited per call site, so a guest that repeats a bad access cannot flood the
//! log; the next line from a site says how many of its lines were dropped.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines one call site may log per [`RATE_WINDOW`] before its lines are dropped.
pub const RATE_BURST: u32 = 32;
/// The window of [`RATE_BURST`].
pub const RATE_WINDOW: Duration = Duration::from_secs(10);

static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Log lines dropped by the rate limit since the process started.
pub fn dropped_lines() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// A call site: source file and line.
type Site = (&'static str, u32);

struct SiteState {
    window_start: Instant,
    emitted: u32,
    dropped: u64,
}

/// Per-call-site rate limit: up to `burst` lines per `window`, the rest counted.
pub struct SiteLimiter {
    burst: u32,
    window: Duration,
    sites: HashMap<Site, SiteState>,
}

impl SiteLimiter {
    /// A limiter letting `burst` lines per `window` through from each site.
    pub fn new(burst: u32, window: Duration) -> Self {
        Self {
            burst,
            window,
            sites: HashMap::new(),
        }
    }

    /// Whether a line from `site` at `now` may be written: `Some(n)` with the lines of that
    /// site dropped since its last written one, or `None` (counted) to drop it.
    pub fn admit(&mut self, site: Site, now: Instant) -> Option<u64> {
        let state = self.sites.entry(site).or_insert(SiteState {
            window_start: now,
            emitted: 0,
            dropped: 0,
        });
        if now.duration_since(state.window_start) >= self.window {
            state.window_start = now;
            state.emitted = 0;
        }
        if state.emitted >= self.burst {
            state.dropped += 1;
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        state.emitted += 1;
        Some(std::mem::take(&mut state.dropped))
    }
}

struct Sink {
    file: Option<File>,
    limiter: SiteLimiter,
}

struct Logger {
    sink: Mutex<Sink>,
    level: log::LevelFilter,
}

/// Whether records of `level` are rate-limited: errors always get through, and debug and
/// trace lines were asked for.
fn limited(level: log::Level) -> bool {
    matches!(level, log::Level::Warn | log::Level::Info)
}

/// The line written for `record`, noting `dropped` earlier lines from its site.
fn format_line(record: &log::Record<'_>, dropped: u64) -> String {
    if dropped == 0 {
        format!("rollbox-vmm [{}] {}\n", record.level(), record.args())
    } else {
        format!(
            "rollbox-vmm [{}] {} ({dropped} more like this dropped by the rate limit)\n",
            record.level(),
            record.args()
        )
    }
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.level
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let mut dropped = 0;
        if limited(record.level()) {
            let site = (
                record.file_static().unwrap_or("?"),
                record.line().unwrap_or(0),
            );
            match sink.limiter.admit(site, Instant::now()) {
                Some(n) => dropped = n,
                None => return,
            }
        }
        let line = format_line(record, dropped);
        let written = match sink.file.as_mut() {
            Some(file) => file.write_all(line.as_bytes()),
            None => std::io::stderr().write_all(line.as_bytes()),
        };
        drop(written);
    }

    fn flush(&self) {}
}

/// Errors from setting up logging.
#[derive(Debug, thiserror::Error)]
pub enum LoggerError {
    /// Unknown level name.
    #[error("unknown log level {0:?}: use Error, Warning, Info, Debug, Trace or Off")]
    Level(String),
    /// The log file could not be opened.
    #[error("log file {path}: {source}")]
    File {
        /// The path.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Parses Firecracker's level names (and the usual lowercase ones).
pub fn parse_level(name: &str) -> Result<log::LevelFilter, LoggerError> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "error" => log::LevelFilter::Error,
        "warning" | "warn" => log::LevelFilter::Warn,
        "info" => log::LevelFilter::Info,
        "debug" => log::LevelFilter::Debug,
        "trace" => log::LevelFilter::Trace,
        "off" => log::LevelFilter::Off,
        _ => return Err(LoggerError::Level(name.to_string())),
    })
}

/// The log file's descriptor, once [`init`] opened one (it stays open for the process).
pub fn file_fd() -> Option<std::os::fd::RawFd> {
    LOG_FILE_FD.get().copied()
}

static LOG_FILE_FD: std::sync::OnceLock<std::os::fd::RawFd> = std::sync::OnceLock::new();

/// Installs the logger.
pub fn init(path: Option<&Path>, level: log::LevelFilter) -> Result<(), LoggerError> {
    let file = match path {
        Some(path) => Some(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| LoggerError::File {
                    path: path.to_path_buf(),
                    source,
                })?,
        ),
        None => None,
    };
    if let Some(file) = &file {
        let _ = LOG_FILE_FD.set(std::os::fd::AsRawFd::as_raw_fd(file));
    }
    let logger = Box::leak(Box::new(Logger {
        sink: Mutex::new(Sink {
            file,
            limiter: SiteLimiter::new(RATE_BURST, RATE_WINDOW),
        }),
        level,
    }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_site_gets_its_burst_then_counts_what_it_drops() {
        let mut limiter = SiteLimiter::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let a = ("mmio.rs", 10);
        let b = ("vsock.rs", 20);
        let admitted: Vec<Option<u64>> = (0..5).map(|_| limiter.admit(a, t0)).collect();
        assert_eq!(admitted, [Some(0), Some(0), Some(0), None, None]);
        // Another site has its own burst.
        assert_eq!(limiter.admit(b, t0), Some(0));
        // A new window lets the site through again and reports the two dropped lines once.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(limiter.admit(a, later), Some(2));
        assert_eq!(limiter.admit(a, later), Some(0));
        assert!(dropped_lines() >= 2);
    }

    #[test]
    fn a_line_after_drops_says_how_many() {
        let line = |dropped| {
            format_line(
                &log::Record::builder()
                    .level(log::Level::Warn)
                    .args(format_args!("odd read"))
                    .build(),
                dropped,
            )
        };
        assert_eq!(line(0), "rollbox-vmm [WARN] odd read\n");
        assert_eq!(
            line(7),
            "rollbox-vmm [WARN] odd read (7 more like this dropped by the rate limit)\n"
        );
        assert!(limited(log::Level::Warn) && !limited(log::Level::Error));
    }
}
