//! Project tasks: `cargo xtask <task>`.
//!
//! - `test-guest [--check]`: builds the freestanding test guest (`tests/test-guest`) with
//!   its own flags, rejects it if its code uses SSE/AVX registers, and places the ELF at
//!   `target/test-guest/test-guest`. `--check` first runs the guest's unit tests on the host.
//! - `check-sse ELF`: runs only the SSE check on an existing ELF.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

mod sse_check;

/// Where the inner cargo build puts its output, apart from the workspace's own builds.
const GUEST_BUILD_DIR: &str = "target/test-guest-build";
/// Where the guest's unit tests are built for the host.
const GUEST_HOST_TEST_DIR: &str = "target/test-guest-host";
/// Where the finished guest ELF is placed.
const GUEST_OUTPUT: &str = "target/test-guest/test-guest";
const GUEST_MANIFEST: &str = "tests/test-guest/Cargo.toml";
const GUEST_LINKER_SCRIPT: &str = "tests/test-guest/linker.ld";

#[derive(Debug)]
enum Error {
    Usage(String),
    Spawn {
        program: String,
        source: std::io::Error,
    },
    Failed {
        program: String,
        status: std::process::ExitStatus,
    },
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    Sse {
        elf: PathBuf,
        report: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(msg) => write!(f, "{msg}\n\n{USAGE}"),
            Error::Spawn { program, source } => write!(f, "cannot run {program}: {source}"),
            Error::Failed { program, status } => write!(f, "{program} failed: {status}"),
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Sse { elf, report } => write!(
                f,
                "{} uses SSE/AVX registers or instructions that KVM's emulator cannot run in CPL0 \
                 (see /work/shared/docs/kvm-here.md); keep the guest off core::fmt and other \
                 precompiled libcore code:\n{report}",
                elf.display()
            ),
        }
    }
}

const USAGE: &str = "usage: cargo xtask <task>
tasks:
  test-guest        build tests/test-guest, check it for SSE, place it at target/test-guest/test-guest
  test-guest --check  the same, after running the guest's unit tests on the host
  check-sse ELF     fail if `objdump -d ELF` shows SSE/AVX registers or instructions";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test-guest") if args.len() == 1 => {
            build_test_guest().map(|elf| println!("{}", elf.display()))
        }
        Some("test-guest") if args.len() == 2 && args[1] == "--check" => test_guest_unit_tests()
            .and_then(|()| build_test_guest())
            .map(|elf| println!("{}", elf.display())),
        Some("check-sse") if args.len() == 2 => {
            let elf = PathBuf::from(&args[1]);
            check_elf(&elf).map(|()| println!("{}: no SSE/AVX code", elf.display()))
        }
        Some("help" | "--help" | "-h") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(Error::Usage(format!(
            "unknown or incomplete task: {}",
            args.join(" ")
        ))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().unwrap_or(xtask_dir).to_path_buf()
}

/// The flags of the guest build: no SSE (the emulator can't run it in CPL0), static,
/// not position independent, linked at 1 MiB by the guest's linker script.
fn guest_rustflags(linker_script: &Path) -> Vec<OsString> {
    let mut flags: Vec<OsString> = [
        "-Ctarget-feature=-sse,-sse2",
        "-Crelocation-model=static",
        "-Cpanic=abort",
        "-Clink-arg=-nostdlib",
        "-Clink-arg=-static",
        "-Clink-arg=-no-pie",
        "-Clink-arg=-Wl,--gc-sections",
        "-Clink-arg=-Wl,--build-id=none",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let mut script = OsString::from("-Clink-arg=-Wl,-T,");
    script.push(linker_script);
    flags.push(script);
    flags
}

fn cargo_program() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"))
}

/// Runs the guest's pure logic (parsers, formatting, header layout, credit arithmetic,
/// memory routines) as ordinary host unit tests.
fn test_guest_unit_tests() -> Result<(), Error> {
    let root = workspace_root();
    let status = Command::new(cargo_program())
        .current_dir(&root)
        .args([
            "test",
            "--manifest-path",
            GUEST_MANIFEST,
            "--target-dir",
            GUEST_HOST_TEST_DIR,
        ])
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .map_err(|source| Error::Spawn {
            program: "cargo test (test guest)".into(),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Failed {
            program: "cargo test (test guest unit tests)".into(),
            status,
        })
    }
}

fn build_test_guest() -> Result<PathBuf, Error> {
    let root = workspace_root();
    let cargo = cargo_program();
    let flags = guest_rustflags(&root.join(GUEST_LINKER_SCRIPT));
    let encoded = flags.join(&OsString::from("\u{1f}"));
    let status = Command::new(&cargo)
        .current_dir(&root)
        .args([
            "build",
            "--release",
            "--manifest-path",
            GUEST_MANIFEST,
            "--target-dir",
            GUEST_BUILD_DIR,
        ])
        // The guest's flags replace, rather than join, any flags of the outer build.
        .env("CARGO_ENCODED_RUSTFLAGS", encoded)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .status()
        .map_err(|source| Error::Spawn {
            program: cargo.to_string_lossy().into_owned(),
            source,
        })?;
    if !status.success() {
        return Err(Error::Failed {
            program: "cargo build (test guest)".into(),
            status,
        });
    }
    let built = root.join(GUEST_BUILD_DIR).join("release/test-guest");
    check_elf(&built)?;
    let output = root.join(GUEST_OUTPUT);
    if let Some(dir) = output.parent() {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    // Copy to a temporary name and rename, so a reader never sees a half-written ELF.
    let partial = output.with_extension("partial");
    std::fs::copy(&built, &partial).map_err(|source| Error::Io {
        path: partial.clone(),
        source,
    })?;
    std::fs::rename(&partial, &output).map_err(|source| Error::Io {
        path: output.clone(),
        source,
    })?;
    Ok(output)
}

fn check_elf(elf: &Path) -> Result<(), Error> {
    let out = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn", "-C"])
        .arg(elf)
        .output()
        .map_err(|source| Error::Spawn {
            program: "objdump (apt package binutils)".into(),
            source,
        })?;
    if !out.status.success() {
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        return Err(Error::Failed {
            program: format!("objdump -d {}", elf.display()),
            status: out.status,
        });
    }
    let listing = String::from_utf8_lossy(&out.stdout);
    if !listing.contains(">:") {
        return Err(Error::Sse {
            elf: elf.to_path_buf(),
            report: "objdump found no code to check".into(),
        });
    }
    let findings = sse_check::scan(&listing);
    if findings.is_empty() {
        Ok(())
    } else {
        Err(Error::Sse {
            elf: elf.to_path_buf(),
            report: sse_check::report(&findings, 20),
        })
    }
}
