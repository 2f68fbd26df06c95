//! `rollbox-fuzz`: a stable-toolchain fuzz driver for every parser a guest or a client can
//! reach. See docs/fuzzing.md for why it is coverage-free and how to run it.

mod mutate;
mod targets;

use std::collections::HashSet;
use std::ffi::CString;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mutate::{mutate, Rng};
use targets::Target;

/// Errors of the driver itself (a target's panic is a finding, not an error).
#[derive(Debug, thiserror::Error)]
enum DriverError {
    #[error("unknown target {0:?}; `rollbox-fuzz list` names them")]
    UnknownTarget(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Usage(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DriverError + '_ {
    move |source| DriverError::Io {
        path: path.to_path_buf(),
        source,
    }
}

const USAGE: &str = "usage:
  rollbox-fuzz list
  rollbox-fuzz run TARGET [--seconds N] [--corpus DIR] [--artifacts DIR] [--seed N] [--rss-limit-mb N]
  rollbox-fuzz replay TARGET FILE...
  rollbox-fuzz seeds TARGET DIR      (writes the built-in seeds of TARGET into DIR)";

fn main() {
    match run_cli() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("rollbox-fuzz: {e}");
            std::process::exit(2);
        }
    }
}

fn run_cli() -> Result<i32, DriverError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(command) = args.first() else {
        return Err(DriverError::Usage(USAGE.into()));
    };
    match command.as_str() {
        "list" => {
            for t in targets::ALL {
                println!("{:<16} {}", t.name, t.about);
            }
            Ok(0)
        }
        "run" => {
            let target = find(args.get(1))?;
            let mut options = RunOptions {
                seconds: 60,
                corpus: PathBuf::from("fuzz/corpus").join(target.name),
                artifacts: PathBuf::from("fuzz/artifacts").join(target.name),
                seed: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1),
                rss_limit_mb: 4096,
            };
            let mut rest = args[2..].iter();
            while let Some(flag) = rest.next() {
                let value = rest
                    .next()
                    .ok_or_else(|| DriverError::Usage(format!("{flag} needs a value\n{USAGE}")))?;
                let number = || {
                    value.parse::<u64>().map_err(|_| {
                        DriverError::Usage(format!("{flag}: {value:?} is not a number"))
                    })
                };
                match flag.as_str() {
                    "--seconds" => options.seconds = number()?,
                    "--seed" => options.seed = number()?,
                    "--rss-limit-mb" => options.rss_limit_mb = number()?,
                    "--corpus" => options.corpus = PathBuf::from(value),
                    "--artifacts" => options.artifacts = PathBuf::from(value),
                    _ => return Err(DriverError::Usage(format!("unknown flag {flag}\n{USAGE}"))),
                }
            }
            fuzz(target, &options)
        }
        "replay" => {
            let target = find(args.get(1))?;
            let mut failed = 0;
            quiet_panics();
            for file in &args[2..] {
                let path = Path::new(file);
                let data = std::fs::read(path).map_err(io_err(path))?;
                match run_one(target, &data) {
                    Ok(_) => println!("{file}: ok"),
                    Err(message) => {
                        println!("{file}: PANIC {message}");
                        failed += 1;
                    }
                }
            }
            Ok(i32::from(failed > 0))
        }
        "seeds" => {
            let target = find(args.get(1))?;
            let dir = PathBuf::from(
                args.get(2)
                    .ok_or_else(|| DriverError::Usage(USAGE.into()))?,
            );
            std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
            for (name, bytes) in (target.seeds)() {
                let path = dir.join(name);
                std::fs::write(&path, bytes).map_err(io_err(&path))?;
            }
            Ok(0)
        }
        _ => Err(DriverError::Usage(USAGE.into())),
    }
}

fn find(name: Option<&String>) -> Result<&'static Target, DriverError> {
    let name = name.ok_or_else(|| DriverError::Usage(USAGE.into()))?;
    targets::ALL
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| DriverError::UnknownTarget(name.clone()))
}

struct RunOptions {
    seconds: u64,
    corpus: PathBuf,
    artifacts: PathBuf,
    seed: u64,
    rss_limit_mb: u64,
}

thread_local! {
    static LAST_PANIC: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Panics are findings: keep their message and location for the report, print nothing.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(non-string panic)".into());
        let location = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("{message} at {location}")));
    }));
}

/// Runs one input: its outcome signature, or the panic message.
fn run_one(target: &Target, data: &[u8]) -> Result<u64, String> {
    match catch_unwind(AssertUnwindSafe(|| (target.run)(data))) {
        Ok(signature) => Ok(signature),
        Err(_) => Err(LAST_PANIC
            .with(|p| p.borrow_mut().take())
            .unwrap_or_else(|| "panic".into())),
    }
}

// The input being run, for the abort and hang handlers (an OOM or a stack overflow aborts
// the process; a hang is stopped by the watchdog): they write it to ABORT_PATH.
static CURRENT_PTR: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static CURRENT_LEN: AtomicUsize = AtomicUsize::new(0);
static ABORT_PATH: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());
static EXEC_STARTED_MS: AtomicU64 = AtomicU64::new(0);
static EPOCH: Mutex<Option<Instant>> = Mutex::new(None);

extern "C" fn save_current_input(_signal: libc::c_int) {
    let path = ABORT_PATH.load(Ordering::SeqCst);
    let ptr = CURRENT_PTR.load(Ordering::SeqCst);
    let len = CURRENT_LEN.load(Ordering::SeqCst);
    if path.is_null() || ptr.is_null() {
        return;
    }
    // SAFETY: `path` is a leaked NUL-terminated string; `ptr..ptr+len` is the input that
    // `fuzz` keeps alive while it runs; open, write and close are async-signal-safe.
    unsafe {
        let fd = libc::open(path, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, 0o644);
        if fd >= 0 {
            libc::write(fd, ptr.cast(), len);
            libc::close(fd);
        }
        let note = b"rollbox-fuzz: process aborting; the input is saved as crash-abort\n";
        libc::write(2, note.as_ptr().cast(), note.len());
    }
}

fn now_ms() -> u64 {
    EPOCH
        .lock()
        .ok()
        .and_then(|e| e.map(|e| e.elapsed().as_millis() as u64))
        .unwrap_or(0)
}

fn install_guards(artifacts: &Path, rss_limit_mb: u64) -> Result<(), DriverError> {
    let path = artifacts.join("crash-abort");
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| DriverError::Usage(format!("{}: NUL in path", path.display())))?;
    ABORT_PATH.store(c_path.into_raw(), Ordering::SeqCst);
    if let Ok(mut epoch) = EPOCH.lock() {
        *epoch = Some(Instant::now());
    }
    // SAFETY: installs a handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(
            libc::SIGABRT,
            save_current_input as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
    let limit = libc::rlimit {
        rlim_cur: rss_limit_mb << 20,
        rlim_max: rss_limit_mb << 20,
    };
    // SAFETY: `limit` is a valid rlimit; lowering our own address-space limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        eprintln!(
            "rollbox-fuzz: cannot set RLIMIT_AS: {}",
            std::io::Error::last_os_error()
        );
    }
    std::thread::spawn(|| loop {
        std::thread::sleep(Duration::from_secs(1));
        let started = EXEC_STARTED_MS.load(Ordering::SeqCst);
        if started != 0 && now_ms().saturating_sub(started) > 10_000 {
            eprintln!("rollbox-fuzz: one input ran over 10 s (a hang)");
            std::process::abort();
        }
    });
    Ok(())
}

fn load_corpus(target: &Target, dir: &Path) -> Result<Vec<Vec<u8>>, DriverError> {
    let mut corpus = Vec::new();
    if dir.is_dir() {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io_err(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        paths.sort();
        for path in paths {
            corpus.push(std::fs::read(&path).map_err(io_err(&path))?);
        }
    }
    if corpus.is_empty() {
        corpus.extend((target.seeds)().into_iter().map(|(_, bytes)| bytes));
    }
    if corpus.is_empty() {
        corpus.push(Vec::new());
    }
    Ok(corpus)
}

fn hash(bytes: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

fn fuzz(target: &Target, options: &RunOptions) -> Result<i32, DriverError> {
    std::fs::create_dir_all(&options.artifacts).map_err(io_err(&options.artifacts))?;
    quiet_panics();
    install_guards(&options.artifacts, options.rss_limit_mb)?;
    if let Some(reason) = (target.available)() {
        println!("fuzz {}: SKIPPED: {reason}", target.name);
        return Ok(0);
    }
    let mut corpus = load_corpus(target, &options.corpus)?;
    let seeds = corpus.len();
    let mut rng = Rng::new(options.seed);
    let mut signatures: HashSet<u64> = HashSet::new();
    let mut crashes = 0u64;
    let mut unique: HashSet<String> = HashSet::new();
    let mut execs = 0u64;
    let started = Instant::now();
    let budget = Duration::from_secs(options.seconds);
    let exec = |data: &Vec<u8>, execs: &mut u64| -> Result<u64, String> {
        CURRENT_PTR.store(data.as_ptr().cast_mut(), Ordering::SeqCst);
        CURRENT_LEN.store(data.len(), Ordering::SeqCst);
        EXEC_STARTED_MS.store(now_ms().max(1), Ordering::SeqCst);
        let result = run_one(target, data);
        EXEC_STARTED_MS.store(0, Ordering::SeqCst);
        *execs += 1;
        result
    };
    let mut record = |data: &Vec<u8>, message: String| -> Result<(), DriverError> {
        let path = options.artifacts.join(format!("crash-{:016x}", hash(data)));
        std::fs::write(&path, data).map_err(io_err(&path))?;
        let location = message.rsplit(" at ").next().unwrap_or("").to_string();
        if unique.insert(location) {
            // The input in hex too (when short), so a crash seen only in a CI log replays.
            let hex = if data.len() <= 4096 {
                data.iter().map(|b| format!("{b:02x}")).collect::<String>()
            } else {
                format!("{} bytes, too long to print", data.len())
            };
            println!(
                "fuzz {}: CRASH {message} (input {}; hex {hex})",
                target.name,
                path.display()
            );
        }
        Ok(())
    };
    // The seeds first: each must pass.
    for data in corpus.clone() {
        match exec(&data, &mut execs) {
            Ok(signature) => {
                signatures.insert(signature);
            }
            Err(message) => {
                crashes += 1;
                record(&data, message)?;
            }
        }
    }
    let mut input = Vec::new();
    while started.elapsed() < budget {
        for _ in 0..64 {
            let base = &corpus[rng.below(corpus.len())];
            let other = &corpus[rng.below(corpus.len())];
            input.clear();
            input.extend_from_slice(base);
            mutate(&mut rng, &mut input, other, target.max_len);
            match exec(&input, &mut execs) {
                // A new outcome (another error, another device state) keeps the input as a
                // base for later mutations: a cheap stand-in for coverage feedback.
                Ok(signature) => {
                    if signatures.insert(signature) && corpus.len() < 4096 {
                        corpus.push(input.clone());
                    }
                }
                Err(message) => {
                    crashes += 1;
                    record(&input, message)?;
                }
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "fuzz {}: {secs:.0} s, {execs} execs, {:.0} exec/s, {seeds} seeds, corpus {} ({} outcomes), crashes {crashes} ({} unique)",
        target.name,
        execs as f64 / secs.max(0.001),
        corpus.len(),
        signatures.len(),
        unique.len()
    );
    Ok(i32::from(crashes > 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panics_on_x(data: &[u8]) -> u64 {
        assert!(!data.starts_with(b"x"), "input starts with x");
        7
    }

    fn no_seeds() -> Vec<(String, Vec<u8>)> {
        Vec::new()
    }

    fn always() -> Option<String> {
        None
    }

    /// A panicking input is reported with its message and location, and the next input runs.
    #[test]
    fn a_panic_is_a_finding_not_the_end() {
        quiet_panics();
        let target = Target {
            name: "test",
            about: "",
            run: panics_on_x,
            seeds: no_seeds,
            available: always,
            max_len: 8,
        };
        let err = run_one(&target, b"xyz").expect_err("a panic");
        assert!(err.contains("input starts with x"), "{err}");
        assert!(err.contains("main.rs"), "{err}");
        assert_eq!(run_one(&target, b"abc"), Ok(7));
    }
}
