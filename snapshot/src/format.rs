//! The state file: a fixed header (magic, format version, payload length, CRC-32) followed
//! by a CBOR payload. CBOR keeps field names, so state structs evolve by adding fields with
//! `#[serde(default)]`; a field's meaning never changes.
//!
//! Files are written to a temporary name in the same directory, fsynced, renamed into place,
//! and the directory is fsynced: a crash never leaves a file that looks complete.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// First bytes of every state file.
pub const MAGIC: [u8; 8] = *b"RBXSNAP\0";
/// The state file layout version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Largest state payload accepted (vCPU and device state is a few hundred KiB at most).
pub const MAX_STATE_BYTES: u64 = 64 << 20;
const HEADER_LEN: usize = 8 + 4 + 8 + 4;

/// Errors reading or writing snapshot files.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file does not start with the magic.
    #[error("{0}: not a rollbox snapshot state file (bad magic)")]
    BadMagic(PathBuf),
    /// Unsupported format version.
    #[error("{path}: snapshot format version {found} is not supported (this build reads version {FORMAT_VERSION})")]
    Version {
        /// The file.
        path: PathBuf,
        /// The version it has.
        found: u32,
    },
    /// The declared length is over the cap.
    #[error("{path}: state of {len} bytes exceeds the {MAX_STATE_BYTES}-byte cap")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Declared length.
        len: u64,
    },
    /// The file is shorter than its header says.
    #[error("{path}: truncated: header promises {expected} bytes of state, file has {actual}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Declared length.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// Checksum mismatch.
    #[error("{path}: corrupted: CRC-32 {actual:#010x} does not match the stored {expected:#010x}")]
    Crc {
        /// The file.
        path: PathBuf,
        /// Stored CRC.
        expected: u32,
        /// Computed CRC.
        actual: u32,
    },
    /// The payload does not decode.
    #[error("{path}: cannot decode the state: {detail}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// Decoder message.
        detail: String,
    },
    /// The state could not be encoded.
    #[error("cannot encode the state: {0}")]
    Encode(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FormatError + '_ {
    move |source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Encodes `state` into a complete state file image.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, FormatError> {
    let mut payload = Vec::new();
    ciborium::into_writer(state, &mut payload).map_err(|e| FormatError::Encode(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Decodes a state file image read from `path`.
pub fn decode<T: DeserializeOwned>(path: &Path, bytes: &[u8]) -> Result<T, FormatError> {
    let truncated = |expected: u64| FormatError::Truncated {
        path: path.to_path_buf(),
        expected,
        actual: bytes.len().saturating_sub(HEADER_LEN) as u64,
    };
    if bytes.len() < 8 || bytes[..8] != MAGIC {
        return Err(FormatError::BadMagic(path.to_path_buf()));
    }
    let header = bytes.get(..HEADER_LEN).ok_or_else(|| truncated(0))?;
    let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if version != FORMAT_VERSION {
        return Err(FormatError::Version {
            path: path.to_path_buf(),
            found: version,
        });
    }
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&header[12..20]);
    let len = u64::from_le_bytes(len_bytes);
    if len > MAX_STATE_BYTES {
        return Err(FormatError::TooLarge {
            path: path.to_path_buf(),
            len,
        });
    }
    let expected_crc = u32::from_le_bytes([header[20], header[21], header[22], header[23]]);
    let payload = bytes
        .get(HEADER_LEN..HEADER_LEN + len as usize)
        .ok_or_else(|| truncated(len))?;
    let actual_crc = crc32fast::hash(payload);
    if actual_crc != expected_crc {
        return Err(FormatError::Crc {
            path: path.to_path_buf(),
            expected: expected_crc,
            actual: actual_crc,
        });
    }
    ciborium::from_reader(payload).map_err(|e| FormatError::Decode {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// Reads and checks a state file.
pub fn read_state_file<T: DeserializeOwned>(path: &Path) -> Result<T, FormatError> {
    let mut file = File::open(path).map_err(io_err(path))?;
    let len = file.metadata().map_err(io_err(path))?.len();
    if len > MAX_STATE_BYTES + HEADER_LEN as u64 {
        return Err(FormatError::TooLarge {
            path: path.to_path_buf(),
            len,
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.read_to_end(&mut bytes).map_err(io_err(path))?;
    decode(path, &bytes)
}

/// A temporary file beside `path` that is renamed onto it by [`AtomicFile::commit`] and removed
/// if dropped uncommitted.
pub struct AtomicFile {
    tmp: PathBuf,
    path: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    /// Creates `.<name>.tmp-<pid>` beside `path`.
    pub fn create(path: &Path) -> Result<Self, FormatError> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let file = File::create(&tmp).map_err(io_err(&tmp))?;
        Ok(Self {
            tmp,
            path: path.to_path_buf(),
            file: Some(file),
        })
    }

    /// The open temporary file.
    pub fn file(&self) -> &File {
        // The option is only emptied by commit, which consumes self.
        self.file
            .as_ref()
            .unwrap_or_else(|| unreachable!("AtomicFile used after commit"))
    }

    /// The temporary path.
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// fsyncs the data, renames it into place and fsyncs the directory.
    pub fn commit(mut self) -> Result<(), FormatError> {
        if let Some(file) = self.file.take() {
            file.sync_all().map_err(io_err(&self.tmp))?;
        }
        std::fs::rename(&self.tmp, &self.path).map_err(io_err(&self.path))?;
        let dir = self
            .path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(dir))?;
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `state` to `path` atomically.
pub fn write_state_file<T: Serialize>(path: &Path, state: &T) -> Result<(), FormatError> {
    let bytes = encode(state)?;
    let out = AtomicFile::create(path)?;
    out.file()
        .write_all(&bytes)
        .map_err(io_err(out.tmp_path()))?;
    out.commit()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct V1 {
        a: u32,
        blob: Vec<u8>,
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct V2 {
        a: u32,
        blob: Vec<u8>,
        #[serde(default)]
        added: Option<String>,
    }

    #[test]
    fn round_trips_and_new_fields_default() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("vmstate");
        write_state_file(
            &path,
            &V1 {
                a: 7,
                blob: vec![1, 2, 3],
            },
        )
        .expect("write");
        let v2: V2 = read_state_file(&path).expect("read");
        assert_eq!(
            v2,
            V2 {
                a: 7,
                blob: vec![1, 2, 3],
                added: None
            }
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("dir").count(),
            1,
            "no temp file left"
        );
    }

    #[test]
    fn detects_corruption_truncation_version_and_magic() {
        let good = encode(&V1 {
            a: 1,
            blob: vec![9; 100],
        })
        .expect("encode");
        let p = Path::new("x");
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0xff;
        assert!(matches!(
            decode::<V1>(p, &flipped),
            Err(FormatError::Crc { .. })
        ));
        assert!(matches!(
            decode::<V1>(p, &good[..good.len() - 10]),
            Err(FormatError::Truncated { .. })
        ));
        assert!(matches!(
            decode::<V1>(p, &good[..10]),
            Err(FormatError::Truncated { .. })
        ));
        let mut version = good.clone();
        version[8] = 99;
        assert!(matches!(
            decode::<V1>(p, &version),
            Err(FormatError::Version { found: 99, .. })
        ));
        assert!(matches!(
            decode::<V1>(p, b"garbage!garbage!garbage!"),
            Err(FormatError::BadMagic(_))
        ));
        let mut huge = good;
        huge[12..20].copy_from_slice(&(MAX_STATE_BYTES + 1).to_le_bytes());
        assert!(matches!(
            decode::<V1>(p, &huge),
            Err(FormatError::TooLarge { .. })
        ));
    }

    #[test]
    fn uncommitted_file_is_removed() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("vmstate");
        {
            let f = AtomicFile::create(&path).expect("create");
            f.file().write_all(b"partial").expect("write");
        }
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    }
}
