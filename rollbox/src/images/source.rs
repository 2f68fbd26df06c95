//! What every image source resolves to: a config and an ordered list of layer blobs.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::PathBuf;

use super::digest::Digest;
use super::spec::ImageConfigFile;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    Registry,
    DockerArchive,
    OciLayout,
}

impl SourceKind {
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Registry => "registry",
            SourceKind::DockerArchive => "docker-archive",
            SourceKind::OciLayout => "oci-layout",
        }
    }
}

/// An image whose manifest and config are read and checked; layers may still be remote.
#[derive(Debug, Clone)]
pub struct ResolvedImage {
    pub kind: SourceKind,
    /// What the user named (reference, or the archive/layout path when no reference was given).
    pub name: String,
    /// Identity used for the cache: the manifest digest, or for `docker save` archives
    /// (which carry no manifest) the config digest.
    pub image_digest: Digest,
    pub manifest_digest: Option<Digest>,
    pub config_digest: Digest,
    pub config: ImageConfigFile,
    pub layers: Vec<LayerBlob>,
}

#[derive(Debug, Clone)]
pub struct LayerBlob {
    /// sha256 of the bytes as stored (compressed, for registries and OCI layouts). None for
    /// legacy `docker save` layers, which are checked through `diff_id` instead.
    pub digest: Option<Digest>,
    /// sha256 of the uncompressed tar, from the image config.
    pub diff_id: Option<Digest>,
    pub size: u64,
    pub location: BlobLocation,
}

impl LayerBlob {
    /// A name for messages: the stored digest, else the diff id.
    pub fn label(&self) -> String {
        match (&self.digest, &self.diff_id) {
            (Some(d), _) | (None, Some(d)) => d.to_string(),
            (None, None) => "(unnamed layer)".to_string(),
        }
    }
}

#[derive(Debug, Clone)]
pub enum BlobLocation {
    /// A whole file (OCI layout blob, or a blob in the cache).
    File(PathBuf),
    /// A member of an uncompressed tar (a `docker save` archive).
    Range {
        file: PathBuf,
        offset: u64,
        len: u64,
    },
    /// Still in the registry; fetched into the cache before building.
    Remote,
}

impl BlobLocation {
    pub fn open(&self) -> io::Result<Box<dyn Read>> {
        match self {
            BlobLocation::File(path) => Ok(Box::new(File::open(path)?)),
            BlobLocation::Range { file, offset, len } => {
                let mut file = File::open(file)?;
                file.seek(SeekFrom::Start(*offset))?;
                Ok(Box::new(file.take(*len)))
            }
            BlobLocation::Remote => Err(io::Error::other(
                "layer has not been fetched from the registry",
            )),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            BlobLocation::File(path) => path.display().to_string(),
            BlobLocation::Range { file, offset, .. } => {
                format!("{} (at byte {offset})", file.display())
            }
            BlobLocation::Remote => "(registry)".to_string(),
        }
    }
}

/// Why [`choose_image`] found no single image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChoiceError {
    /// Nothing matched the reference; `available` lists what there is.
    NoSuchImage { available: String },
    /// The source holds no image.
    Empty,
    /// No reference and several images.
    Ambiguous { count: usize, available: String },
}

/// Picks the image of a multi-image source (a `docker save` archive, an OCI layout): the one
/// `matches` the reference, a single unnamed one whatever the reference says, or with no
/// reference the only one. `names` gives an image's names and `id` what to show without one.
pub fn choose_image<'a, T>(
    images: &'a [T],
    reference: Option<&str>,
    names: impl Fn(&T) -> Vec<String>,
    id: impl Fn(&T) -> String,
    matches: impl Fn(&T) -> bool,
) -> Result<&'a T, ChoiceError> {
    let available = || {
        images
            .iter()
            .map(|image| {
                let names = names(image);
                if names.is_empty() {
                    id(image)
                } else {
                    names.join(", ")
                }
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    match (reference, images) {
        (Some(_), _) => images
            .iter()
            .find(|image| matches(image))
            .or(match images {
                [only] if names(only).is_empty() => Some(only),
                _ => None,
            })
            .ok_or_else(|| ChoiceError::NoSuchImage {
                available: available(),
            }),
        (None, [only]) => Ok(only),
        (None, []) => Err(ChoiceError::Empty),
        (None, more) => Err(ChoiceError::Ambiguous {
            count: more.len(),
            available: available(),
        }),
    }
}

#[cfg(test)]
mod choose_tests {
    use super::*;

    fn pick<'a>(
        images: &'a [(&'a str, &'a str)],
        reference: Option<&str>,
    ) -> Result<&'a (&'a str, &'a str), ChoiceError> {
        choose_image(
            images,
            reference,
            |i| {
                if i.0.is_empty() {
                    Vec::new()
                } else {
                    vec![i.0.to_string()]
                }
            },
            |i| i.1.to_string(),
            |i| Some(i.0) == reference,
        )
    }

    #[test]
    fn picks_by_name_single_unnamed_or_only() {
        let two = [("a:1", "sha256:a"), ("b:1", "sha256:b")];
        assert_eq!(pick(&two, Some("b:1")), Ok(&two[1]));
        assert_eq!(
            pick(&two, Some("c:1")),
            Err(ChoiceError::NoSuchImage {
                available: "a:1; b:1".into()
            })
        );
        assert_eq!(
            pick(&two, None),
            Err(ChoiceError::Ambiguous {
                count: 2,
                available: "a:1; b:1".into()
            })
        );
        let unnamed = [("", "sha256:u")];
        assert_eq!(pick(&unnamed, Some("x:1")), Ok(&unnamed[0]));
        assert_eq!(pick(&unnamed, None), Ok(&unnamed[0]));
        assert_eq!(pick(&[], None), Err(ChoiceError::Empty));
    }
}
