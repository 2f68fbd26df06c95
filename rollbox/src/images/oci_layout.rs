//! OCI image layout directories: `oci-layout`, `index.json` and `blobs/sha256/<hex>`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::digest::{Digest, DigestError};
use super::source::{
    choose_image, BlobLocation, ChoiceError, LayerBlob, ResolvedImage, SourceKind,
};
use super::spec::{self, Descriptor, ImageConfigFile, Index, Manifest};

const MAX_JSON_BYTES: u64 = 64 * 1024 * 1024;
/// Indexes may nest (an index entry pointing at a per-platform index); bound the depth.
const MAX_INDEX_DEPTH: usize = 4;
const REF_NAME: &str = "org.opencontainers.image.ref.name";
const CONTAINERD_NAME: &str = "io.containerd.image.name";

#[derive(Debug, thiserror::Error)]
pub enum OciLayoutError {
    #[error("OCI layout {path}: directory not found")]
    NotFound { path: String },
    #[error("OCI layout {path}: not an OCI image layout (no oci-layout file)")]
    NotALayout { path: String },
    #[error("OCI layout {path}: cannot read {file}: {source}")]
    Read {
        path: String,
        file: String,
        source: io::Error,
    },
    #[error("OCI layout {path}: {file} is not valid: {reason}")]
    Invalid {
        path: String,
        file: String,
        reason: String,
    },
    #[error("OCI layout {path}: blob {digest} does not match its digest (got {actual})")]
    BlobDigest {
        path: String,
        digest: String,
        actual: String,
    },
    #[error("OCI layout {path}: no image matches {reference:?}; it holds: {available}")]
    NoSuchImage {
        path: String,
        reference: String,
        available: String,
    },
    #[error("OCI layout {path}: index.json lists {count} images ({available}); name one as the image reference")]
    Ambiguous {
        path: String,
        count: usize,
        available: String,
    },
    #[error("OCI layout {path}: no linux/{arch} image in index {digest}")]
    NoPlatform {
        path: String,
        arch: String,
        digest: String,
    },
    #[error("OCI layout {path}: {source}")]
    Digest { path: String, source: DigestError },
}

struct Layout<'a> {
    dir: &'a Path,
}

impl Layout<'_> {
    fn path(&self) -> String {
        self.dir.display().to_string()
    }

    fn read_file(&self, rel: &Path) -> Result<Vec<u8>, OciLayoutError> {
        let full = self.dir.join(rel);
        let read_error = |source| OciLayoutError::Read {
            path: self.path(),
            file: rel.display().to_string(),
            source,
        };
        let len = fs::metadata(&full).map_err(read_error)?.len();
        if len > MAX_JSON_BYTES {
            return Err(OciLayoutError::Invalid {
                path: self.path(),
                file: rel.display().to_string(),
                reason: format!("{len} bytes is too large for metadata"),
            });
        }
        fs::read(&full).map_err(read_error)
    }

    fn blob_rel(digest: &Digest) -> PathBuf {
        Path::new("blobs/sha256").join(digest.hex())
    }

    fn parse_digest(&self, value: &str) -> Result<Digest, OciLayoutError> {
        Digest::parse(value).map_err(|source| OciLayoutError::Digest {
            path: self.path(),
            source,
        })
    }

    /// Reads a small blob and checks its digest.
    fn read_blob(&self, digest: &Digest) -> Result<Vec<u8>, OciLayoutError> {
        let bytes = self.read_file(&Self::blob_rel(digest))?;
        let actual = Digest::of_bytes(&bytes);
        if &actual != digest {
            return Err(OciLayoutError::BlobDigest {
                path: self.path(),
                digest: digest.to_string(),
                actual: actual.to_string(),
            });
        }
        Ok(bytes)
    }

    fn parse_json<T: serde::de::DeserializeOwned>(
        &self,
        file: &str,
        bytes: &[u8],
    ) -> Result<T, OciLayoutError> {
        serde_json::from_slice(bytes).map_err(|e| OciLayoutError::Invalid {
            path: self.path(),
            file: file.to_string(),
            reason: e.to_string(),
        })
    }
}

fn names_of(descriptor: &Descriptor) -> Vec<&str> {
    [REF_NAME, CONTAINERD_NAME]
        .iter()
        .filter_map(|key| descriptor.annotations.get(*key).map(String::as_str))
        .collect()
}

/// Does an index entry carry the name the user asked for? Layouts often store only the tag.
fn matches_reference(descriptor: &Descriptor, reference: &str) -> bool {
    let tag = reference
        .rsplit_once(':')
        .filter(|(_, tag)| !tag.contains('/'))
        .map(|(_, tag)| tag);
    names_of(descriptor)
        .iter()
        .any(|name| *name == reference || Some(*name) == tag)
}

pub fn resolve(dir: &Path, reference: Option<&str>) -> Result<ResolvedImage, OciLayoutError> {
    let layout = Layout { dir };
    if !dir.is_dir() {
        return Err(OciLayoutError::NotFound {
            path: layout.path(),
        });
    }
    if !dir.join("oci-layout").is_file() {
        return Err(OciLayoutError::NotALayout {
            path: layout.path(),
        });
    }
    let index: Index =
        layout.parse_json("index.json", &layout.read_file(Path::new("index.json"))?)?;
    let chosen = choose_image(
        &index.manifests,
        reference,
        |d| names_of(d).into_iter().map(str::to_string).collect(),
        |d| d.digest.clone(),
        |d| reference.is_some_and(|r| matches_reference(d, r)),
    )
    .map_err(|e| match e {
        ChoiceError::NoSuchImage { available } => OciLayoutError::NoSuchImage {
            path: layout.path(),
            reference: reference.unwrap_or_default().to_string(),
            available,
        },
        ChoiceError::Empty => OciLayoutError::Invalid {
            path: layout.path(),
            file: "index.json".to_string(),
            reason: "lists no manifests".to_string(),
        },
        ChoiceError::Ambiguous { count, available } => OciLayoutError::Ambiguous {
            path: layout.path(),
            count,
            available,
        },
    })?;

    // Follow indexes down to one image manifest.
    let mut descriptor = chosen.clone();
    let mut depth = 0;
    let (manifest_digest, manifest) = loop {
        let digest = layout.parse_digest(&descriptor.digest)?;
        let bytes = layout.read_blob(&digest)?;
        let file = format!("blob {digest}");
        let value: serde_json::Value = layout.parse_json(&file, &bytes)?;
        let media_type = value.get("mediaType").and_then(|v| v.as_str());
        let is_index = spec::is_index(Some(descriptor.media_type.as_str()))
            || spec::is_index(media_type)
            || value.get("manifests").is_some();
        if !is_index {
            break (digest, layout.parse_json::<Manifest>(&file, &bytes)?);
        }
        depth += 1;
        if depth > MAX_INDEX_DEPTH {
            return Err(OciLayoutError::Invalid {
                path: layout.path(),
                file,
                reason: format!("indexes nest deeper than {MAX_INDEX_DEPTH}"),
            });
        }
        let nested: Index = layout.parse_json(&file, &bytes)?;
        descriptor = spec::pick_platform(&nested.manifests)
            .ok_or_else(|| OciLayoutError::NoPlatform {
                path: layout.path(),
                arch: std::env::consts::ARCH.to_string(),
                digest: digest.to_string(),
            })?
            .clone();
    };

    let config_digest = layout.parse_digest(&manifest.config.digest)?;
    let config_bytes = layout.read_blob(&config_digest)?;
    let config: ImageConfigFile =
        layout.parse_json(&format!("config {config_digest}"), &config_bytes)?;
    let diff_ids = config
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    let mut layers = Vec::with_capacity(manifest.layers.len());
    for (i, layer) in manifest.layers.iter().enumerate() {
        let digest = layout.parse_digest(&layer.digest)?;
        let diff_id = diff_ids
            .get(i)
            .map(|d| layout.parse_digest(d))
            .transpose()?;
        let file = dir.join(Layout::blob_rel(&digest));
        let size = fs::metadata(&file)
            .map_err(|source| OciLayoutError::Read {
                path: layout.path(),
                file: Layout::blob_rel(&digest).display().to_string(),
                source,
            })?
            .len();
        layers.push(LayerBlob {
            digest: Some(digest),
            diff_id,
            size,
            location: BlobLocation::File(file),
        });
    }
    Ok(ResolvedImage {
        kind: SourceKind::OciLayout,
        name: reference
            .map(str::to_string)
            .unwrap_or_else(|| layout.path()),
        image_digest: manifest_digest.clone(),
        manifest_digest: Some(manifest_digest),
        config_digest,
        config,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_matching_uses_full_name_or_tag() {
        let descriptor: Descriptor = serde_json::from_str(
            r#"{"digest":"sha256:00","annotations":{"org.opencontainers.image.ref.name":"v1"}}"#,
        )
        .unwrap();
        assert!(matches_reference(&descriptor, "127.0.0.1:5000/tiny:v1"));
        assert!(matches_reference(&descriptor, "v1"));
        assert!(!matches_reference(&descriptor, "127.0.0.1:5000/tiny"));
        assert!(!matches_reference(&descriptor, "tiny:v2"));
    }

    #[test]
    fn missing_and_non_layout_directories() {
        let err = resolve(Path::new("/nonexistent/layout"), None).unwrap_err();
        assert!(matches!(err, OciLayoutError::NotFound { .. }), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let err = resolve(dir.path(), None).unwrap_err();
        assert!(matches!(err, OciLayoutError::NotALayout { .. }), "{err}");
    }
}
