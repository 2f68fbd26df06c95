//! The initramfs the Linux benches boot (busybox, the static agent, a tiny `/init`), as a
//! newc cpio archive; the fixtures file that names the lab's kernel and rootfs; the work
//! directory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::config::LinuxBenchConfig;
use super::error::{io_err, LinuxBenchError};

/// What the initramfs's `/init` prints first.
pub const INIT_MARKER: &str = "rollbox-bench: /init running";

/// `KEY=value` lines of a fixtures.env (blank lines and `#` comments skipped).
pub fn parse_env(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

pub(crate) fn fixture(
    config: &LinuxBenchConfig,
    given: &Option<PathBuf>,
    key: &'static str,
    what: &'static str,
    flag: &'static str,
) -> Result<PathBuf, LinuxBenchError> {
    if let Some(path) = given {
        return Ok(path.clone());
    }
    let Some(file) = &config.fixtures else {
        return Err(LinuxBenchError::NoPath { what, flag });
    };
    let text = std::fs::read_to_string(file).map_err(|source| LinuxBenchError::Fixtures {
        path: file.clone(),
        source,
    })?;
    parse_env(&text)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| PathBuf::from(v))
        .ok_or(LinuxBenchError::FixtureKey {
            path: file.clone(),
            key,
        })
}

pub(crate) fn must_exist(
    what: &'static str,
    path: &Path,
    hint: &'static str,
) -> Result<(), LinuxBenchError> {
    if path.is_file() {
        Ok(())
    } else {
        Err(LinuxBenchError::Missing {
            what,
            path: path.to_path_buf(),
            hint,
        })
    }
}

/// One entry of a newc cpio archive.
pub enum CpioEntry<'a> {
    Dir(&'a str),
    File {
        name: &'a str,
        mode: u32,
        data: &'a [u8],
    },
    Symlink {
        name: &'a str,
        target: &'a str,
    },
    CharDev {
        name: &'a str,
        major: u32,
        minor: u32,
    },
}

/// Writes `entries` as an uncompressed newc ("070701") cpio archive, the format the kernel
/// unpacks as an initramfs.
pub fn write_cpio<W: Write>(out: &mut W, entries: &[CpioEntry<'_>]) -> std::io::Result<()> {
    let mut ino = 1u32;
    let mut record = |out: &mut W,
                      name: &str,
                      mode: u32,
                      data: &[u8],
                      rdev: (u32, u32)|
     -> std::io::Result<()> {
        let namesize = name.len() + 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
            0,
            0,
            if mode & 0o170000 == 0o040000 { 2 } else { 1 },
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            0
        );
        ino += 1;
        out.write_all(header.as_bytes())?;
        out.write_all(name.as_bytes())?;
        out.write_all(&[0])?;
        out.write_all(&[0; 3][..(4 - (header.len() + namesize) % 4) % 4])?;
        out.write_all(data)?;
        out.write_all(&[0; 3][..(4 - data.len() % 4) % 4])?;
        Ok(())
    };
    for entry in entries {
        match entry {
            CpioEntry::Dir(name) => record(out, name, 0o040755, &[], (0, 0))?,
            CpioEntry::File { name, mode, data } => {
                record(out, name, 0o100000 | (mode & 0o7777), data, (0, 0))?
            }
            CpioEntry::Symlink { name, target } => {
                record(out, name, 0o120777, target.as_bytes(), (0, 0))?
            }
            CpioEntry::CharDev { name, major, minor } => {
                record(out, name, 0o020600, &[], (*major, *minor))?
            }
        }
    }
    record(out, "TRAILER!!!", 0, &[], (0, 0))
}

/// The initramfs's `/init`: prints the marker, then hands PID 1 to the agent.
fn init_script() -> String {
    format!("#!/bin/busybox sh\necho \"{INIT_MARKER}\"\nexec /.rollbox/rollbox-agent\n")
}

/// Builds the initramfs (busybox, the static agent, a tiny `/init`) at `path`.
pub(crate) fn build_initramfs(
    config: &LinuxBenchConfig,
    path: &Path,
) -> Result<u64, LinuxBenchError> {
    let busybox = std::fs::read(&config.busybox).map_err(io_err("reading", &config.busybox))?;
    let agent = std::fs::read(&config.agent).map_err(io_err("reading", &config.agent))?;
    let init = init_script();
    let mut entries = vec![];
    for dir in [
        "bin", "dev", "proc", "sys", "run", "tmp", "etc", "root", ".rollbox",
    ] {
        entries.push(CpioEntry::Dir(dir));
    }
    entries.extend([
        CpioEntry::CharDev {
            name: "dev/console",
            major: 5,
            minor: 1,
        },
        CpioEntry::File {
            name: "bin/busybox",
            mode: 0o755,
            data: &busybox,
        },
        CpioEntry::Symlink {
            name: "bin/sh",
            target: "busybox",
        },
        CpioEntry::File {
            name: ".rollbox/rollbox-agent",
            mode: 0o755,
            data: &agent,
        },
        CpioEntry::File {
            name: "init",
            mode: 0o755,
            data: init.as_bytes(),
        },
    ]);
    let file = File::create(path).map_err(io_err("creating", path))?;
    let mut out = BufWriter::new(file);
    write_cpio(&mut out, &entries)
        .and_then(|()| out.flush())
        .map_err(io_err("writing", path))?;
    let len = std::fs::metadata(path)
        .map_err(io_err("reading", path))?
        .len();
    Ok(len)
}

/// The work directory; removed with everything in it when dropped.
pub(crate) struct WorkDir(pub(crate) PathBuf);

impl WorkDir {
    pub(crate) fn create(parent: &Path) -> Result<Self, LinuxBenchError> {
        let path = parent.join(format!("rollbox-bench-linux.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).map_err(io_err("creating work directory", &path))?;
        Ok(Self(path))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// name, mode, data, (rdev major, minor)
    type Entry = (String, u32, Vec<u8>, (u32, u32));

    /// Parses a newc archive back into its entries.
    fn parse_cpio(bytes: &[u8]) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut at = 0;
        let field = |b: &[u8], i: usize| {
            let hex = std::str::from_utf8(&b[6 + i * 8..14 + i * 8]).expect("ASCII header");
            u32::from_str_radix(hex, 16).expect("hex field")
        };
        loop {
            let header = &bytes[at..at + 110];
            assert_eq!(&header[..6], b"070701");
            let mode = field(header, 1);
            let size = field(header, 6) as usize;
            let rdev = (field(header, 9), field(header, 10));
            let namesize = field(header, 11) as usize;
            let name = std::str::from_utf8(&bytes[at + 110..at + 110 + namesize - 1])
                .expect("UTF-8 name")
                .to_string();
            at = (at + 110 + namesize).div_ceil(4) * 4;
            let data = bytes[at..at + size].to_vec();
            at = (at + size).div_ceil(4) * 4;
            if name == "TRAILER!!!" {
                assert_eq!(at, bytes.len());
                return out;
            }
            out.push((name, mode, data, rdev));
        }
    }

    #[test]
    fn cpio_round_trips() {
        let mut bytes = Vec::new();
        write_cpio(
            &mut bytes,
            &[
                CpioEntry::Dir("dev"),
                CpioEntry::CharDev {
                    name: "dev/console",
                    major: 5,
                    minor: 1,
                },
                CpioEntry::File {
                    name: "init",
                    mode: 0o755,
                    data: b"#!/bin/sh\n",
                },
                CpioEntry::Symlink {
                    name: "bin/sh",
                    target: "busybox",
                },
                CpioEntry::File {
                    name: "odd",
                    mode: 0o644,
                    data: b"12345",
                },
            ],
        )
        .expect("writes to a Vec");
        let entries = parse_cpio(&bytes);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["dev", "dev/console", "init", "bin/sh", "odd"]);
        assert_eq!(entries[0].1, 0o040755);
        assert_eq!((entries[1].1, entries[1].3), (0o020600, (5, 1)));
        assert_eq!(
            (entries[2].1, entries[2].2.as_slice()),
            (0o100755, &b"#!/bin/sh\n"[..])
        );
        assert_eq!(
            (entries[3].1, entries[3].2.as_slice()),
            (0o120777, &b"busybox"[..])
        );
        assert_eq!(entries[4].2, b"12345");
    }

    #[test]
    fn init_prints_the_marker_then_execs_the_agent() {
        let script = init_script();
        assert!(script.starts_with("#!/bin/busybox sh\n"));
        assert!(script.contains(INIT_MARKER));
        assert!(script.trim_end().ends_with("exec /.rollbox/rollbox-agent"));
    }

    #[test]
    fn fixtures_env_lines() {
        let env = parse_env("# c\nOUR_VMLINUX=/k/vmlinux\n\nBUSYBOX_ROOTFS = /f/b.ext4\nnoise\n");
        assert_eq!(
            env,
            vec![
                ("OUR_VMLINUX".to_string(), "/k/vmlinux".to_string()),
                ("BUSYBOX_ROOTFS".to_string(), "/f/b.ext4".to_string()),
            ]
        );
    }
}
