//! A small `log` backend: one line per record to stderr or a log file.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

struct Logger {
    sink: Mutex<Option<File>>,
    level: log::LevelFilter,
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.level
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let line = format!("rollbox-vmm [{}] {}\n", record.level(), record.args());
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let written = match sink.as_mut() {
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
    let logger = Box::leak(Box::new(Logger {
        sink: Mutex::new(file),
        level,
    }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
    Ok(())
}
