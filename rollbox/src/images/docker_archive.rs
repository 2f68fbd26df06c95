//! `docker save` tarballs: manifest.json names the config and the layer tars. Both the
//! legacy layout (`<id>/layer.tar`, `<hex>.json`) and the OCI-style one (`blobs/sha256/<hex>`)
//! are read in place, by offset, without unpacking the tarball.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::digest::{Digest, DigestError};
use super::source::{
    choose_image, BlobLocation, ChoiceError, LayerBlob, ResolvedImage, SourceKind,
};
use super::spec::{DockerArchiveImage, ImageConfigFile};

/// Refuse to read metadata members larger than this into memory.
const MAX_JSON_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DockerArchiveError {
    #[error("docker archive {path}: file not found")]
    NotFound { path: String },
    #[error("docker archive {path}: cannot read: {source}")]
    Read { path: String, source: io::Error },
    #[error("docker archive {path}: not a valid `docker save` tarball: {reason}")]
    Invalid { path: String, reason: String },
    #[error("docker archive {path}: member {member} is missing")]
    MissingMember { path: String, member: String },
    #[error("docker archive {path}: no image matches {reference:?}; it holds: {available}")]
    NoSuchImage {
        path: String,
        reference: String,
        available: String,
    },
    #[error("docker archive {path}: it holds {count} images ({available}); name one as the image reference")]
    Ambiguous {
        path: String,
        count: usize,
        available: String,
    },
    #[error("docker archive {path}: config {member} does not match its digest: expected {expected}, got {actual}")]
    ConfigDigest {
        path: String,
        member: String,
        expected: String,
        actual: String,
    },
    #[error("docker archive {path}: {source}")]
    Digest { path: String, source: DigestError },
}

/// Where each member's data lies in the tarball.
struct Members {
    entries: HashMap<String, (u64, u64)>,
}

fn member_name(raw: &Path) -> String {
    let text = raw.to_string_lossy();
    text.trim_start_matches("./").to_string()
}

impl Members {
    fn index(path: &Path) -> Result<Self, DockerArchiveError> {
        let read_error = |source| DockerArchiveError::Read {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                DockerArchiveError::NotFound {
                    path: path.display().to_string(),
                }
            } else {
                read_error(e)
            }
        })?;
        let mut archive = tar::Archive::new(file);
        let mut entries = HashMap::new();
        for entry in archive.entries_with_seek().map_err(read_error)? {
            let entry = entry.map_err(read_error)?;
            let name = member_name(&entry.path().map_err(read_error)?);
            if entry.header().entry_type().is_file() {
                entries.insert(name, (entry.raw_file_position(), entry.size()));
            }
        }
        Ok(Self { entries })
    }

    fn get(&self, path: &Path, member: &str) -> Result<(u64, u64), DockerArchiveError> {
        self.entries
            .get(member.trim_start_matches("./"))
            .copied()
            .ok_or_else(|| DockerArchiveError::MissingMember {
                path: path.display().to_string(),
                member: member.to_string(),
            })
    }

    fn read(&self, path: &Path, member: &str) -> Result<Vec<u8>, DockerArchiveError> {
        let (offset, len) = self.get(path, member)?;
        let invalid = |reason: String| DockerArchiveError::Invalid {
            path: path.display().to_string(),
            reason,
        };
        if len > MAX_JSON_BYTES {
            return Err(invalid(format!(
                "{member} is {len} bytes, too large for metadata"
            )));
        }
        let read = || -> io::Result<Vec<u8>> {
            let mut file = File::open(path)?;
            file.seek(SeekFrom::Start(offset))?;
            let mut bytes = Vec::new();
            file.take(len).read_to_end(&mut bytes)?;
            Ok(bytes)
        };
        read().map_err(|source| DockerArchiveError::Read {
            path: path.display().to_string(),
            source,
        })
    }
}

/// `busybox` names `busybox:latest`; `docker.io/library/` prefixes are dropped for matching.
fn normalize_tag(reference: &str) -> String {
    let short = reference
        .strip_prefix("docker.io/library/")
        .or_else(|| reference.strip_prefix("docker.io/"))
        .unwrap_or(reference);
    let last_segment = short.rsplit('/').next().unwrap_or(short);
    if last_segment.contains(':') || short.contains('@') {
        short.to_string()
    } else {
        format!("{short}:latest")
    }
}

/// `blobs/sha256/<hex>` or `<hex>.json` names carry their own digest.
fn digest_in_name(member: &str) -> Option<Digest> {
    let hex = member
        .strip_prefix("blobs/sha256/")
        .or_else(|| member.strip_suffix(".json"))?;
    Digest::parse(&format!("sha256:{hex}")).ok()
}

pub fn resolve(path: &Path, reference: Option<&str>) -> Result<ResolvedImage, DockerArchiveError> {
    let members = Members::index(path)?;
    let invalid = |reason: String| DockerArchiveError::Invalid {
        path: path.display().to_string(),
        reason,
    };
    let manifest_bytes = members.read(path, "manifest.json")?;
    let images: Vec<DockerArchiveImage> = serde_json::from_slice(&manifest_bytes)
        .map_err(|e| invalid(format!("manifest.json: {e}")))?;
    let wanted = reference.map(normalize_tag);
    let image = choose_image(
        &images,
        reference,
        |i| i.repo_tags.clone().unwrap_or_default(),
        |i| i.config.clone(),
        |i| {
            i.repo_tags
                .iter()
                .flatten()
                .any(|t| Some(normalize_tag(t)) == wanted)
        },
    )
    .map_err(|e| match e {
        ChoiceError::NoSuchImage { available } => DockerArchiveError::NoSuchImage {
            path: path.display().to_string(),
            reference: reference.unwrap_or_default().to_string(),
            available,
        },
        ChoiceError::Empty => invalid("manifest.json lists no images".to_string()),
        ChoiceError::Ambiguous { count, available } => DockerArchiveError::Ambiguous {
            path: path.display().to_string(),
            count,
            available,
        },
    })?;

    let config_bytes = members.read(path, &image.config)?;
    let config_digest = Digest::of_bytes(&config_bytes);
    if let Some(expected) = digest_in_name(&image.config) {
        if expected != config_digest {
            return Err(DockerArchiveError::ConfigDigest {
                path: path.display().to_string(),
                member: image.config.clone(),
                expected: expected.to_string(),
                actual: config_digest.to_string(),
            });
        }
    }
    let config: ImageConfigFile = serde_json::from_slice(&config_bytes)
        .map_err(|e| invalid(format!("config {}: {e}", image.config)))?;
    let diff_ids = config
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    if diff_ids.len() != image.layers.len() {
        return Err(invalid(format!(
            "config lists {} layer diff_ids but manifest.json lists {} layers",
            diff_ids.len(),
            image.layers.len()
        )));
    }
    let mut layers = Vec::with_capacity(image.layers.len());
    for (member, diff_id) in image.layers.iter().zip(&diff_ids) {
        let (offset, len) = members.get(path, member)?;
        let diff_id = Digest::parse(diff_id).map_err(|source| DockerArchiveError::Digest {
            path: path.display().to_string(),
            source,
        })?;
        layers.push(LayerBlob {
            digest: digest_in_name(member),
            diff_id: Some(diff_id),
            size: len,
            location: BlobLocation::Range {
                file: PathBuf::from(path),
                offset,
                len,
            },
        });
    }
    Ok(ResolvedImage {
        kind: SourceKind::DockerArchive,
        name: reference
            .map(str::to_string)
            .unwrap_or_else(|| path.display().to_string()),
        image_digest: config_digest.clone(),
        manifest_digest: None,
        config_digest,
        config,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_matching() {
        assert_eq!(normalize_tag("busybox"), "busybox:latest");
        assert_eq!(
            normalize_tag("docker.io/library/busybox:1.36"),
            "busybox:1.36"
        );
        assert_eq!(
            normalize_tag("127.0.0.1:5000/tiny"),
            "127.0.0.1:5000/tiny:latest"
        );
        assert_eq!(
            normalize_tag("127.0.0.1:5000/tiny:v1"),
            "127.0.0.1:5000/tiny:v1"
        );
    }

    #[test]
    fn digests_from_member_names() {
        let hex = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert!(digest_in_name(&format!("blobs/sha256/{hex}")).is_some());
        assert!(digest_in_name(&format!("{hex}.json")).is_some());
        assert!(digest_in_name("abc/layer.tar").is_none());
    }

    #[test]
    fn missing_file_is_named() {
        let err = resolve(Path::new("/nonexistent/image.tar"), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "docker archive /nonexistent/image.tar: file not found"
        );
    }
}
