//! The guest agent binary that becomes the sandbox's init, and how it is put into a rootfs.

use std::fs::{self, Permissions};
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::digest::{Digest, DigestError};

/// Where the agent lives inside every rootfs; the kernel is booted with `init=` this path.
pub const AGENT_DIR: &str = ".rollbox";
pub const AGENT_NAME: &str = "rollbox-agent";
pub const AGENT_PATH_IN_ROOTFS: &str = "/.rollbox/rollbox-agent";
pub const METADATA_PATH_IN_ROOTFS: &str = "/.rollbox/image.json";

/// Mount points the agent needs as PID 1; created (empty) when the image lacks them.
const MOUNT_POINTS: &[(&str, u32)] = &[
    ("proc", 0o555),
    ("sys", 0o555),
    ("dev", 0o755),
    ("tmp", 0o1777),
    ("run", 0o755),
];

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent binary {path} not found (build the guest agent, or pass --agent PATH / set ROLLBOX_AGENT)")]
    NotFound { path: String },
    #[error("agent binary {path} is not a regular file")]
    NotAFile { path: String },
    #[error("agent binary {path} is not executable (mode {mode:o})")]
    NotExecutable { path: String, mode: u32 },
    #[error("agent binary {path} is empty")]
    Empty { path: String },
    #[error("cannot read agent binary {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("agent binary: {source}")]
    Hash { source: DigestError },
    #[error("cannot install the agent into the rootfs at {path}: {source}")]
    Install { path: String, source: io::Error },
}

#[derive(Debug, Clone)]
pub struct Agent {
    pub path: PathBuf,
    pub digest: Digest,
    /// Set when the binary is a dynamically linked ELF: as PID 1 it needs that loader.
    pub interpreter: Option<String>,
}

impl Agent {
    pub fn load(path: &Path) -> Result<Self, AgentError> {
        let name = path.display().to_string();
        let meta = fs::metadata(path).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                AgentError::NotFound { path: name.clone() }
            } else {
                AgentError::Read {
                    path: name.clone(),
                    source: e,
                }
            }
        })?;
        if !meta.is_file() {
            return Err(AgentError::NotAFile { path: name });
        }
        let mode = meta.permissions().mode();
        if mode & 0o111 == 0 {
            return Err(AgentError::NotExecutable { path: name, mode });
        }
        if meta.len() == 0 {
            return Err(AgentError::Empty { path: name });
        }
        let digest = Digest::of_file(path).map_err(|source| AgentError::Hash { source })?;
        let interpreter =
            elf_interpreter(path).map_err(|source| AgentError::Read { path: name, source })?;
        Ok(Self {
            path: path.to_path_buf(),
            digest,
            interpreter,
        })
    }

    /// Puts the agent at /.rollbox/rollbox-agent (root-owned, 0755), replacing anything the
    /// image had at /.rollbox, and makes sure the usual mount points exist.
    pub fn install(&self, root: &Path, metadata_json: &[u8]) -> Result<(), AgentError> {
        let install_error = |path: &Path| {
            let path = path.display().to_string();
            move |source| AgentError::Install { path, source }
        };
        let dir = root.join(AGENT_DIR);
        match fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(&dir).map_err(install_error(&dir))?,
            Ok(_) => fs::remove_file(&dir).map_err(install_error(&dir))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(install_error(&dir)(e)),
        }
        fs::create_dir(&dir).map_err(install_error(&dir))?;
        fs::set_permissions(&dir, Permissions::from_mode(0o755)).map_err(install_error(&dir))?;
        std::os::unix::fs::lchown(&dir, Some(0), Some(0)).map_err(install_error(&dir))?;

        let binary = dir.join(AGENT_NAME);
        fs::copy(&self.path, &binary).map_err(install_error(&binary))?;
        std::os::unix::fs::lchown(&binary, Some(0), Some(0)).map_err(install_error(&binary))?;
        fs::set_permissions(&binary, Permissions::from_mode(0o755))
            .map_err(install_error(&binary))?;

        let metadata = dir.join("image.json");
        fs::write(&metadata, metadata_json).map_err(install_error(&metadata))?;
        fs::set_permissions(&metadata, Permissions::from_mode(0o644))
            .map_err(install_error(&metadata))?;

        for (name, mode) in MOUNT_POINTS {
            let path = root.join(name);
            match fs::symlink_metadata(&path) {
                // Whatever the image has there (a directory, or a symlink such as /run) stays.
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::create_dir(&path).map_err(install_error(&path))?;
                    fs::set_permissions(&path, Permissions::from_mode(*mode))
                        .map_err(install_error(&path))?;
                }
                Err(e) => return Err(install_error(&path)(e)),
            }
        }
        Ok(())
    }
}

/// The PT_INTERP of a 64-bit little-endian ELF, if it has one; None for anything else.
fn elf_interpreter(path: &Path) -> io::Result<Option<String>> {
    const PT_INTERP: u32 = 3;
    let mut header = [0u8; 64];
    let mut file = fs::File::open(path)?;
    let n = file.read(&mut header)?;
    if n < 64 || &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Ok(None);
    }
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let u64_at = |b: &[u8], at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    let phoff = u64_at(&header, 32);
    let phentsize = usize::from(u16_at(&header, 54));
    let phnum = usize::from(u16_at(&header, 56));
    if phentsize < 56 || phnum > 4096 {
        return Ok(None);
    }
    let bytes = fs::read(path)?;
    for i in 0..phnum {
        let at = phoff as usize + i * phentsize;
        let Some(entry) = bytes.get(at..at + 56) else {
            return Ok(None);
        };
        if u32_at(entry, 0) == PT_INTERP {
            let offset = u64_at(entry, 8) as usize;
            let size = u64_at(entry, 32) as usize;
            let interp = bytes
                .get(offset..offset.saturating_add(size))
                .unwrap_or_default();
            let text = String::from_utf8_lossy(interp)
                .trim_end_matches('\0')
                .to_string();
            return Ok(Some(text));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn rejects_missing_and_non_executable() {
        let err = Agent::load(Path::new("/nonexistent/agent")).unwrap_err();
        assert!(matches!(err, AgentError::NotFound { .. }), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        fs::write(&plain, b"data").unwrap();
        let err = Agent::load(&plain).unwrap_err();
        assert!(matches!(err, AgentError::NotExecutable { .. }), "{err}");
    }

    #[test]
    fn detects_static_and_dynamic_binaries() {
        // /bin/sh on Debian is dynamically linked; busybox-static (when installed) is static.
        let sh = Agent::load(Path::new("/bin/sh")).unwrap();
        assert!(
            sh.interpreter
                .as_deref()
                .is_some_and(|i| i.contains("ld-linux")),
            "{sh:?}"
        );
        if Path::new("/bin/busybox").exists() {
            let busybox = Agent::load(Path::new("/bin/busybox")).unwrap();
            if busybox.interpreter.is_none() {
                assert_eq!(
                    busybox.digest,
                    Digest::of_file(Path::new("/bin/busybox")).unwrap()
                );
            }
        }
    }

    #[test]
    fn install_replaces_image_content_and_adds_mount_points() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // The image tries to own /.rollbox with a symlink out of the root.
        std::os::unix::fs::symlink("/etc", root.join(".rollbox")).unwrap();
        fs::create_dir(root.join("proc")).unwrap();
        let agent = Agent::load(Path::new("/bin/sh")).unwrap();
        agent.install(root, b"{\"x\":1}").unwrap();
        let binary = fs::symlink_metadata(root.join(".rollbox/rollbox-agent")).unwrap();
        assert!(binary.is_file());
        assert_eq!(binary.mode() & 0o7777, 0o755);
        assert_eq!(
            fs::read(root.join(".rollbox/image.json")).unwrap(),
            b"{\"x\":1}"
        );
        assert!(fs::symlink_metadata(root.join(".rollbox"))
            .unwrap()
            .is_dir());
        assert_eq!(
            fs::metadata(root.join("tmp")).unwrap().mode() & 0o7777,
            0o1777
        );
        assert!(
            root.join("sys").is_dir() && root.join("dev").is_dir() && root.join("run").is_dir()
        );
    }
}
