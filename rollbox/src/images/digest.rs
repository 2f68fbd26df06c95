//! sha256 content digests (`sha256:<64 hex>`) and a reader that hashes what passes through it.

use std::fmt;
use std::io::{self, Read};
use std::path::Path;

use sha2::{Digest as _, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    #[error("malformed digest {value:?}: expected sha256:<64 lowercase hex digits>")]
    Malformed { value: String },
    #[error("cannot read {path} to hash it: {source}")]
    Read { path: String, source: io::Error },
}

/// A validated `sha256:<hex>` digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    hex: String,
}

impl Digest {
    pub fn parse(value: &str) -> Result<Self, DigestError> {
        let malformed = || DigestError::Malformed {
            value: value.to_string(),
        };
        let hex = value.strip_prefix("sha256:").ok_or_else(malformed)?;
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(malformed());
        }
        Ok(Self {
            hex: hex.to_string(),
        })
    }

    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self::from_hasher(Sha256::new_with_prefix(bytes))
    }

    pub fn of_file(path: &Path) -> Result<Self, DigestError> {
        let read_error = |source| DigestError::Read {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read_error)?;
        let mut reader = HashingReader::new(file);
        io::copy(&mut reader, &mut io::sink()).map_err(read_error)?;
        Ok(reader.digest())
    }

    fn from_hasher(hasher: Sha256) -> Self {
        Self {
            hex: to_hex(&hasher.finalize()),
        }
    }

    /// The 64 hex digits, without the algorithm prefix (used as a file name).
    pub fn hex(&self) -> &str {
        &self.hex
    }

    /// A short form for messages and progress bars.
    pub fn short(&self) -> &str {
        self.hex.get(..12).unwrap_or(&self.hex)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

pub fn to_hex(bytes: &[u8]) -> String {
    use fmt::Write as _;
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        // Writing into a String cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// Passes reads through and hashes every byte; also counts them.
pub struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    pub fn bytes_read(&self) -> u64 {
        self.bytes
    }

    /// Reads the rest of the stream so the digest covers all of it.
    pub fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(|_| ())
    }

    pub fn digest(&self) -> Digest {
        Digest::from_hasher(self.hasher.clone())
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(read) = buf.get(..n) {
            self.hasher.update(read);
        }
        self.bytes += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let empty = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(Digest::of_bytes(b"").to_string(), empty);
        assert_eq!(Digest::parse(empty).unwrap().short(), "e3b0c44298fc");
        for bad in [
            "",
            "sha256:",
            "sha512:00",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:../../etc/passwd",
        ] {
            assert!(Digest::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn hashing_reader_covers_drained_bytes() {
        let mut reader = HashingReader::new(&b"hello world"[..]);
        let mut first = [0u8; 5];
        reader.read_exact(&mut first).unwrap();
        reader.drain().unwrap();
        assert_eq!(reader.bytes_read(), 11);
        assert_eq!(reader.digest(), Digest::of_bytes(b"hello world"));
    }
}
