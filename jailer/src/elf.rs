//! The files a dynamically linked program needs in a jail: its ELF interpreter (the loader)
//! and the shared libraries it and they name (`DT_NEEDED`), found where the loader inside the
//! jail will look: the object's `DT_RUNPATH` (or `DT_RPATH`), then the system directories.
//! The jail has no /etc/ld.so.cache, so the host's cache is not consulted either. This reads
//! a few headers of each file instead of running `ldd` (a shell script and four processes,
//! about 10 ms of every jailed start). A static program (no interpreter) needs nothing.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

/// Where the loader looks after an object's run path (Debian's and Fedora's x86-64 layouts).
const SYSTEM_DIRS: [&str; 6] = [
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;
const DT_STRSZ: u64 = 10;
const DT_RPATH: u64 = 15;
const DT_RUNPATH: u64 = 29;
/// More program headers or dynamic entries than any real object has: a corrupt file.
const MAX_ENTRIES: u64 = 4096;

/// Why the files a program needs could not be listed; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a 64-bit little-endian ELF file")]
    NotElf { path: PathBuf },
    #[error("{path}: {what}")]
    Corrupt { path: PathBuf, what: &'static str },
    #[error("{name} (needed by {by}): not found in its run path or {SYSTEM_DIRS:?}")]
    NotFound { name: String, by: PathBuf },
}

/// The loader and every library `exec` loads, each once; empty for a static program.
pub fn shared_libraries(exec: &Path) -> Result<Vec<PathBuf>, ElfError> {
    let program = Object::read(exec)?;
    let Some(interpreter) = program.interpreter.clone() else {
        return Ok(Vec::new());
    };
    // The loader matches a needed name against what it has loaded (the interpreter too, which
    // libc names), so each name is looked up once.
    let mut loaded: BTreeSet<String> = interpreter
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .into_iter()
        .collect();
    let mut found = vec![interpreter];
    let mut pending = vec![(exec.to_path_buf(), program)];
    while let Some((path, object)) = pending.pop() {
        for name in &object.needed {
            if loaded.insert(name.clone()) {
                let library = object.locate(&path, name)?;
                let next = Object::read(&library)?;
                found.push(library.clone());
                pending.push((library, next));
            }
        }
    }
    Ok(found)
}

/// What one ELF file asks of the loader.
#[derive(Debug, Default)]
struct Object {
    interpreter: Option<PathBuf>,
    needed: Vec<String>,
    /// `DT_RUNPATH`, else `DT_RPATH`: colon-separated, `$ORIGIN` not yet expanded.
    run_path: Option<String>,
}

/// One `PT_LOAD`: where a virtual address range lies in the file.
struct Load {
    vaddr: u64,
    offset: u64,
    filesz: u64,
}

impl Object {
    fn read(path: &Path) -> Result<Object, ElfError> {
        let file = File::open(path).map_err(|source| ElfError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let reader = Reader { file: &file, path };
        let len = file
            .metadata()
            .map_err(|source| ElfError::Read {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        let header = reader.bytes(0, len.min(64))?;
        if !header.starts_with(b"\x7fELF\x02\x01") {
            return Err(ElfError::NotElf {
                path: path.to_path_buf(),
            });
        }
        if header.len() < 64 {
            return Err(reader.corrupt("shorter than an ELF header"));
        }
        let phoff = u64_at(&header, 0x20);
        let phentsize = u64::from(u16_at(&header, 0x36));
        let phnum = u64::from(u16_at(&header, 0x38));
        if phentsize < 56 || phnum > MAX_ENTRIES {
            return Err(reader.corrupt("program headers"));
        }
        let mut object = Object::default();
        let mut loads = Vec::new();
        let mut dynamic = None;
        for i in 0..phnum {
            let at = phoff
                .checked_add(i * phentsize)
                .ok_or_else(|| reader.corrupt("program header offset"))?;
            let ph = reader.bytes(at, 56)?;
            let (kind, offset, vaddr, filesz) = (
                u32_at(&ph, 0),
                u64_at(&ph, 8),
                u64_at(&ph, 16),
                u64_at(&ph, 32),
            );
            match kind {
                PT_LOAD => loads.push(Load {
                    vaddr,
                    offset,
                    filesz,
                }),
                PT_DYNAMIC => dynamic = Some((offset, filesz)),
                PT_INTERP => {
                    let text = reader.bytes(offset, filesz)?;
                    object.interpreter = Some(PathBuf::from(reader.string(&text, 0)?));
                }
                _ => {}
            }
        }
        let Some((offset, size)) = dynamic else {
            return Ok(object);
        };
        if size / 16 > MAX_ENTRIES {
            return Err(reader.corrupt("dynamic section"));
        }
        let entries = reader.bytes(offset, size - size % 16)?;
        let (mut strtab, mut strsz) = (None, None);
        let (mut needed, mut runpath, mut rpath) = (Vec::new(), None, None);
        for entry in entries.chunks_exact(16) {
            let (tag, value) = (u64_at(entry, 0), u64_at(entry, 8));
            match tag {
                DT_NULL => break,
                DT_NEEDED => needed.push(value),
                DT_STRTAB => strtab = Some(value),
                DT_STRSZ => strsz = Some(value),
                DT_RUNPATH => runpath = Some(value),
                DT_RPATH => rpath = Some(value),
                _ => {}
            }
        }
        if needed.is_empty() && runpath.is_none() && rpath.is_none() {
            return Ok(object);
        }
        let (Some(strtab), Some(strsz)) = (strtab, strsz) else {
            return Err(reader.corrupt("no string table"));
        };
        let strtab = loads
            .iter()
            .find(|l| strtab >= l.vaddr && strtab - l.vaddr < l.filesz)
            .map(|l| strtab - l.vaddr + l.offset)
            .ok_or_else(|| reader.corrupt("string table outside the file"))?;
        let strings = reader.bytes(strtab, strsz)?;
        for offset in needed {
            object.needed.push(reader.string(&strings, offset)?);
        }
        if let Some(offset) = runpath.or(rpath) {
            object.run_path = Some(reader.string(&strings, offset)?);
        }
        Ok(object)
    }

    /// Where the loader finds `name`, needed by this object at `path`.
    fn locate(&self, path: &Path, name: &str) -> Result<PathBuf, ElfError> {
        if name.contains('/') {
            return Ok(PathBuf::from(name));
        }
        let origin = path.parent().unwrap_or(Path::new("/")).to_string_lossy();
        let run_path = self.run_path.as_deref().unwrap_or("");
        let own = run_path
            .split(':')
            .filter(|dir| !dir.is_empty())
            .map(|dir| {
                dir.replace("${ORIGIN}", &origin)
                    .replace("$ORIGIN", &origin)
            });
        own.chain(SYSTEM_DIRS.iter().map(|dir| dir.to_string()))
            .map(|dir| Path::new(&dir).join(name))
            .find(|candidate| candidate.is_file())
            .ok_or_else(|| ElfError::NotFound {
                name: name.to_string(),
                by: path.to_path_buf(),
            })
    }
}

/// Reads parts of one file, naming it in every error.
struct Reader<'a> {
    file: &'a File,
    path: &'a Path,
}

impl Reader<'_> {
    fn bytes(&self, offset: u64, len: u64) -> Result<Vec<u8>, ElfError> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len <= 1 << 24)
            .ok_or_else(|| self.corrupt("oversized header field"))?;
        let mut buf = vec![0u8; len];
        self.file
            .read_exact_at(&mut buf, offset)
            .map_err(|source| ElfError::Read {
                path: self.path.to_path_buf(),
                source,
            })?;
        Ok(buf)
    }

    /// The NUL-terminated string at `offset` of `table`.
    fn string(&self, table: &[u8], offset: u64) -> Result<String, ElfError> {
        let rest = usize::try_from(offset)
            .ok()
            .and_then(|at| table.get(at..))
            .ok_or_else(|| self.corrupt("string outside its table"))?;
        let end = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.corrupt("unterminated string"))?;
        String::from_utf8(rest[..end].to_vec()).map_err(|_| self.corrupt("string is not UTF-8"))
    }

    fn corrupt(&self, what: &'static str) -> ElfError {
        ElfError::Corrupt {
            path: self.path.to_path_buf(),
            what,
        }
    }
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paths `ldd` prints for `exec` (the reference this module replaces).
    fn ldd(exec: &Path) -> BTreeSet<PathBuf> {
        let output = std::process::Command::new("ldd")
            .arg(exec)
            .output()
            .expect("run ldd");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            })
            .filter(|path| path.starts_with('/'))
            .map(PathBuf::from)
            .collect()
    }

    #[test]
    fn a_dynamic_program_needs_what_ldd_names() {
        let exec = std::env::current_exe().expect("test binary");
        let ours: BTreeSet<PathBuf> = shared_libraries(&exec)
            .expect("libraries")
            .into_iter()
            .collect();
        assert!(ours.iter().any(|p| p.ends_with("libc.so.6")), "{ours:?}");
        assert_eq!(ours, ldd(&exec));
        for system in ["/bin/sh", "/usr/bin/env"] {
            let ours: BTreeSet<PathBuf> = shared_libraries(Path::new(system))
                .expect("libraries")
                .into_iter()
                .collect();
            assert_eq!(ours, ldd(Path::new(system)), "{system}");
        }
    }

    /// A minimal ELF64 header with `phnum` program headers at offset 64.
    fn header(phnum: u16) -> Vec<u8> {
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&phnum.to_le_bytes());
        elf
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write");
        path
    }

    #[test]
    fn a_static_program_needs_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(dir.path(), "static", &header(0));
        assert!(shared_libraries(&path).expect("static").is_empty());
    }

    #[test]
    fn bad_files_are_refused_naming_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = write(dir.path(), "script", b"#!/bin/sh\necho hi\n");
        let err = shared_libraries(&script).expect_err("not ELF").to_string();
        assert!(
            err.contains("script") && err.contains("not a 64-bit"),
            "{err}"
        );

        let short = write(dir.path(), "short", b"\x7fELF\x02\x01");
        let err = shared_libraries(&short).expect_err("truncated").to_string();
        assert!(err.contains("short"), "{err}");

        // One program header that points past the end of the file.
        let mut far = header(1);
        let mut ph = vec![0u8; 56];
        ph[..4].copy_from_slice(&PT_INTERP.to_le_bytes());
        ph[8..16].copy_from_slice(&(1u64 << 20).to_le_bytes());
        ph[32..40].copy_from_slice(&16u64.to_le_bytes());
        far.extend(ph);
        let path = write(dir.path(), "far", &far);
        let err = shared_libraries(&path).expect_err("outside").to_string();
        assert!(err.contains("far"), "{err}");

        let missing = shared_libraries(&dir.path().join("missing")).expect_err("missing");
        assert!(missing.to_string().contains("missing"), "{missing}");
    }

    #[test]
    fn a_missing_library_is_named_with_who_needs_it() {
        let object = Object {
            interpreter: None,
            needed: vec!["librollbox-nowhere.so.9".into()],
            run_path: Some("$ORIGIN/lib".into()),
        };
        let err = object
            .locate(Path::new("/opt/x/bin/tool"), "librollbox-nowhere.so.9")
            .expect_err("not found")
            .to_string();
        assert!(
            err.contains("librollbox-nowhere.so.9") && err.contains("/opt/x/bin/tool"),
            "{err}"
        );
    }

    #[test]
    fn run_paths_expand_origin_and_come_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("lib")).expect("mkdir");
        let library = write(&dir.path().join("lib"), "libc.so.6", b"");
        let object = Object {
            interpreter: None,
            needed: Vec::new(),
            run_path: Some("${ORIGIN}/lib".into()),
        };
        let found = object
            .locate(&dir.path().join("tool"), "libc.so.6")
            .expect("found");
        assert_eq!(found, library);
    }
}
