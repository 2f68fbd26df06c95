//! Images: any Docker/OCI image becomes an ext4 root filesystem for a sandbox.
//!
//! An image comes from a registry, a `docker save` tarball or an OCI layout directory. Its
//! layers are checked (sha256 of every blob), applied in order onto a staging directory
//! (whiteouts, ownership, links and device nodes kept, path traversal refused), the guest
//! agent is installed as `/.rollbox/rollbox-agent` (the sandbox's init), and
//! `mkfs.ext4 -d` turns the tree into an image. Results are cached by image digest, agent
//! hash and builder version, so building the same thing again is a cache lookup. With
//! `share_layers`, images that start with the same layers share a base disk (shared.rs).

pub mod account;
pub mod agent;
pub mod auth;
pub mod cache;
pub mod compression;
pub mod digest;
pub mod docker_archive;
pub mod ext4;
pub mod layer;
pub mod metadata;
pub mod oci_layout;
pub mod progress;
pub mod registry;
pub mod shared;
pub mod source;
pub mod spec;
pub mod staging;
mod sys;
pub mod upper;

use std::cell::Cell;
use std::fs::{self, Permissions};
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use account::AccountError;
use agent::{Agent, AgentError};
use cache::{Cache, CacheError, METADATA_FILE, ROOTFS_FILE};
use digest::{Digest, HashingReader};
use docker_archive::DockerArchiveError;
use ext4::Ext4Error;
use layer::{LayerError, RootfsBuilder};
use metadata::{BaseInfo, ImageMetadata, BUILDER_VERSION};
use oci_layout::OciLayoutError;
use progress::Progress;
use registry::{RegistryError, RegistrySession};
use shared::{SharedError, Split};
use source::{LayerBlob, ResolvedImage};
use upper::{Snapshot, UpperError};

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    DockerArchive(#[from] DockerArchiveError),
    #[error(transparent)]
    OciLayout(#[from] OciLayoutError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("E2B's account `user`: {0}")]
    Account(#[from] AccountError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Shared(#[from] SharedError),
    #[error(transparent)]
    Upper(#[from] UpperError),
    #[error("layer {index}/{count} of {image}: {source}")]
    Layer {
        image: String,
        index: usize,
        count: usize,
        source: Box<LayerError>,
    },
    #[error("layer {index}/{count} of {image} ({layer}): {what} passes the cap of {limit} {unit} ({flag}); the build stopped there")]
    LayerCap {
        image: String,
        index: usize,
        count: usize,
        layer: String,
        what: &'static str,
        limit: u64,
        unit: &'static str,
        flag: &'static str,
    },
    #[error("cannot isolate the build's staging tree (a private mount namespace, a nosuid,nodev bind mount): {0}")]
    Isolate(io::Error),
    #[error("layer {index}/{count} of {image} is corrupt: {mismatch}")]
    LayerDigest {
        image: String,
        index: usize,
        count: usize,
        mismatch: Box<DigestMismatch>,
    },
    #[error("layer {index}/{count} of {image}: cannot read {location}: {source}")]
    LayerRead {
        image: String,
        index: usize,
        count: usize,
        location: String,
        source: io::Error,
    },
    #[error("{0}")]
    Ext4(#[from] Ext4Error),
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: String,
        source: io::Error,
    },
    #[error(
        "building an image needs root: it reproduces file ownership, set-id bits and device nodes"
    )]
    NotRoot,
    #[error("output directory {path} does not exist")]
    OutputDir { path: String },
    #[error("output {path} is a directory; give a file name such as {path}/rootfs.ext4")]
    OutputIsDir { path: String },
    #[error("a registry image needs a reference such as 127.0.0.1:5000/busybox:latest")]
    MissingReference,
}

impl ImageError {
    /// True when the build failed because a disk filled up.
    pub fn is_no_space(&self) -> bool {
        let os_error = match self {
            ImageError::Layer { source, .. } => source.io_source(),
            ImageError::LayerRead { source, .. } | ImageError::Io { source, .. } => Some(source),
            ImageError::Ext4(Ext4Error::NoSpace { .. }) => return true,
            ImageError::Ext4(Ext4Error::Copy { source, .. }) => Some(source),
            ImageError::Cache(CacheError::Io { source, .. }) => Some(source),
            ImageError::Account(AccountError::Io { source, .. }) => Some(source),
            ImageError::Registry(RegistryError::WriteBlob { source, .. }) => Some(source),
            ImageError::Upper(UpperError::Io { source, .. })
            | ImageError::Shared(SharedError::Upper(UpperError::Io { source, .. }))
            | ImageError::Shared(SharedError::Io { source, .. })
            | ImageError::Shared(SharedError::Cache(CacheError::Io { source, .. })) => Some(source),
            ImageError::Shared(SharedError::Base { source, .. }) => {
                return matches!(source, Ext4Error::NoSpace { .. })
            }
            _ => None,
        };
        os_error.and_then(io::Error::raw_os_error) == Some(libc::ENOSPC)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{what} mismatch: expected {expected}, got {actual} ({location})")]
pub struct DigestMismatch {
    what: &'static str,
    expected: String,
    actual: String,
    location: String,
}

/// Where the image comes from.
#[derive(Debug, Clone)]
pub enum SourceSpec {
    /// A registry, with the credentials `auth` has for it.
    Registry {
        insecure: bool,
        auth: auth::Auth,
    },
    DockerArchive(PathBuf),
    OciLayout(PathBuf),
}

/// Caps on what one build unpacks: uncompressed bytes (the tar streams, padding included) and
/// tar entries, per layer and for the whole image. A layer that passes one stops there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildLimits {
    pub layer_bytes: u64,
    pub layer_entries: u64,
    pub image_bytes: u64,
    pub image_entries: u64,
}

impl Default for BuildLimits {
    /// 16 GiB and 2,000,000 entries, per layer and per image.
    fn default() -> Self {
        BuildLimits {
            layer_bytes: 16 << 30,
            layer_entries: 2_000_000,
            image_bytes: 16 << 30,
            image_entries: 2_000_000,
        }
    }
}

#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// Registry reference; for archives and layouts, picks one of several images.
    pub reference: Option<String>,
    pub source: SourceSpec,
    pub agent: PathBuf,
    pub cache_dir: PathBuf,
    /// Copy the result here (and its metadata beside it) instead of only caching it.
    pub output: Option<PathBuf>,
    /// Image size; by default the content plus room to write.
    pub size_mib: Option<u64>,
    pub progress: Progress,
    pub limits: BuildLimits,
    /// Split the image over a shared base when an earlier build with this on had the same
    /// first layers (shared.rs); the first image of its kind is built whole.
    pub share_layers: bool,
}

#[derive(Debug, Clone)]
pub struct BuildOutput {
    pub rootfs: PathBuf,
    pub metadata: PathBuf,
    pub size_bytes: u64,
    pub image_digest: String,
    /// True when the rootfs came from the cache.
    pub cached: bool,
    /// Set when the agent is a dynamically linked binary (it needs this loader in the guest).
    pub agent_interpreter: Option<String>,
    /// For a split build: the shared base (read-only, in the cache) that `rootfs`, the top
    /// disk, lies over. None for a whole image.
    pub base: Option<PathBuf>,
    /// How many of the image's first layers the base holds (0 without a base).
    pub base_layers: usize,
}

/// The cache directory used when none is given: `$XDG_CACHE_HOME/rollbox`, else
/// `/var/cache/rollbox/images`.
pub fn default_cache_dir() -> PathBuf {
    match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("rollbox"),
        _ => PathBuf::from("/var/cache/rollbox/images"),
    }
}

/// The metadata file written beside an `--output` image: `NAME.ext4` gets `NAME.image.json`.
pub fn metadata_path_for(output: &Path) -> PathBuf {
    output.with_extension(METADATA_FILE)
}

fn cache_key(image_digest: &Digest, agent: &Digest, size_mib: Option<u64>) -> String {
    let size = size_mib.map_or_else(|| "auto".to_string(), |mib| format!("{mib}MiB"));
    let text = format!("{BUILDER_VERSION}\nimage {image_digest}\nagent {agent}\nsize {size}\n");
    Digest::of_bytes(text.as_bytes()).hex().to_string()
}

pub fn build(options: &BuildOptions) -> Result<BuildOutput, ImageError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(ImageError::NotRoot);
    }
    if let Some(output) = &options.output {
        check_output_dir(output)?;
    }
    let agent = Agent::load(&options.agent)?;
    let cache = Cache::open(&options.cache_dir)?;

    let mut session = None;
    let mut image = match &options.source {
        SourceSpec::Registry { insecure, auth } => {
            let reference = options
                .reference
                .as_deref()
                .ok_or(ImageError::MissingReference)?;
            let connected = RegistrySession::connect(reference, *insecure, auth)?;
            let image = connected.resolve()?;
            session = Some(connected);
            image
        }
        SourceSpec::DockerArchive(path) => {
            docker_archive::resolve(path, options.reference.as_deref())?
        }
        SourceSpec::OciLayout(path) => oci_layout::resolve(path, options.reference.as_deref())?,
    };

    let full_key = cache_key(&image.image_digest, &agent.digest, options.size_mib);
    let chains = options
        .share_layers
        .then(|| shared::chains(&image))
        .flatten();
    let (hit, split) = shared::lookup(&cache, &full_key, chains.as_deref());
    let key = split
        .as_ref()
        .map_or_else(|| full_key.clone(), |s| shared::top_key(&full_key, s));
    let (entry, cached) = match hit {
        Some(entry) => (entry, true),
        None => {
            if let Some(session) = &session {
                session.fetch_layers(&mut image, &cache, options.progress)?;
            }
            let built = staging::isolated(
                || build_into_cache(&image, &agent, &cache, &key, split.as_ref(), options),
                |e| Err(ImageError::Isolate(e)),
            )?;
            (built, false)
        }
    };
    if let Some(chains) = &chains {
        shared::mark_chains(&cache, chains)?;
    }
    let base = split.as_ref().and_then(|s| cache.lookup_base(&s.base_key));

    let (rootfs, metadata) = match &options.output {
        Some(output) => copy_out(&entry.rootfs, &entry.metadata, output)?,
        None => (entry.rootfs, entry.metadata),
    };
    let size_bytes = fs::metadata(&rootfs)
        .map_err(io_error("inspect", &rootfs))?
        .len();
    Ok(BuildOutput {
        rootfs,
        metadata,
        size_bytes,
        image_digest: image.image_digest.to_string(),
        cached,
        agent_interpreter: agent.interpreter,
        base_layers: split.map_or(0, |s| s.layers),
        base,
    })
}

fn io_error<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ImageError + 'a {
    move |source| ImageError::Io {
        action,
        path: path.display().to_string(),
        source,
    }
}

fn build_into_cache(
    image: &ResolvedImage,
    agent: &Agent,
    cache: &Cache,
    key: &str,
    split: Option<&Split>,
    options: &BuildOptions,
) -> Result<cache::CachedRootfs, ImageError> {
    // Every blob is checked before any is unpacked.
    verify_layers(image, options.progress)?;

    // The work directory is 0700 from its creation: no other uid reaches the tree in it.
    let staging = cache.staging("build");
    let work = staging.path();
    fs::DirBuilder::new()
        .mode(0o700)
        .create(work)
        .map_err(io_error("create", work))?;
    fs::set_permissions(work, Permissions::from_mode(0o700)).map_err(io_error("chmod", work))?;
    // The image's tree, and for a split build the top disk's tree beside it (hard links
    // between them): one locked mount.
    let stage = work.join("stage");
    let tree = stage.join("tree");
    for dir in [&stage, &tree] {
        fs::create_dir(dir).map_err(io_error("create", dir))?;
        fs::set_permissions(dir, Permissions::from_mode(0o755)).map_err(io_error("chmod", dir))?;
    }
    let locked = staging::LockedTree::mount(&stage).map_err(ImageError::Isolate)?;

    let count = image.layers.len();
    let final_pass_error = |source| ImageError::Layer {
        image: image.name.clone(),
        index: count,
        count,
        source: Box::new(source),
    };
    let mut rootfs = RootfsBuilder::new(&tree);
    let mut used = (0, 0);
    let below = split.map_or(count, |s| s.layers);
    apply_layers(image, &mut rootfs, options, 0..below, &mut used)?;
    let snapshot = match split {
        Some(split) => {
            rootfs.set_dir_times().map_err(final_pass_error)?;
            shared::ensure_base(cache, split, &tree, options.progress)?;
            Some(Snapshot::record(&tree)?)
        }
        None => None,
    };
    apply_layers(image, &mut rootfs, options, below..count, &mut used)?;
    account::ensure_e2b_user(&tree)?;
    let mut metadata = ImageMetadata::new(image, agent);
    metadata.base = split.map(|s| BaseInfo {
        chain_id: s.chain.to_string(),
        layers: s.layers,
    });
    agent.install(&tree, &metadata.to_json())?;
    rootfs.finish().map_err(final_pass_error)?;
    let disk_tree = match &snapshot {
        Some(snapshot) => {
            let top = stage.join("top");
            shared::assemble_top(&tree, snapshot, &top)?;
            top
        }
        None => tree,
    };

    let image_file = work.join(ROOTFS_FILE);
    let spinner = options.progress.spinner("making ext4 image".to_string());
    let made = ext4::make(&disk_tree, &image_file, options.size_mib);
    spinner.finish_and_clear();
    let size_bytes = made?;
    locked
        .unmount()
        .map_err(io_error("unmount the staging tree", &stage))?;
    fs::remove_dir_all(&stage).map_err(io_error("remove the staging tree", &stage))?;
    // Only the image and its metadata are left: the cache entry is readable again.
    fs::set_permissions(work, Permissions::from_mode(0o755)).map_err(io_error("chmod", work))?;

    metadata.rootfs_size_bytes = Some(size_bytes);
    let metadata_file = work.join(METADATA_FILE);
    fs::write(&metadata_file, metadata.to_json()).map_err(io_error("write", &metadata_file))?;
    Ok(cache.commit_rootfs(staging, key)?)
}

/// Reads each layer once and checks the stored blob's digest.
fn verify_layers(image: &ResolvedImage, progress: Progress) -> Result<(), ImageError> {
    let count = image.layers.len();
    for (i, layer) in image.layers.iter().enumerate() {
        let Some(expected) = &layer.digest else {
            continue;
        };
        let read_error = |source| ImageError::LayerRead {
            image: image.name.clone(),
            index: i + 1,
            count,
            location: layer.location.describe(),
            source,
        };
        let bar = progress.bytes(
            layer.size,
            format!("verify {}/{count} {}", i + 1, expected.short()),
        );
        let mut reader =
            HashingReader::new(bar.wrap_read(layer.location.open().map_err(read_error)?));
        let drained = reader.drain();
        bar.finish_and_clear();
        drained.map_err(read_error)?;
        let actual = reader.digest();
        if &actual != expected {
            return Err(ImageError::LayerDigest {
                image: image.name.clone(),
                index: i + 1,
                count,
                mismatch: Box::new(DigestMismatch {
                    what: "blob digest",
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                    location: layer.location.describe(),
                }),
            });
        }
    }
    Ok(())
}

/// Applies the layers `range` (0-based); `used` counts the bytes and entries unpacked so far,
/// for the image's caps.
fn apply_layers(
    image: &ResolvedImage,
    rootfs: &mut RootfsBuilder,
    options: &BuildOptions,
    range: std::ops::Range<usize>,
    used: &mut (u64, u64),
) -> Result<(), ImageError> {
    let count = image.layers.len();
    let (progress, limits) = (options.progress, options.limits);
    let (bytes, entries) = used;
    for (i, layer) in image
        .layers
        .iter()
        .enumerate()
        .take(range.end)
        .skip(range.start)
    {
        let bar = progress.bytes(
            layer.size,
            format!("unpack {}/{count} {}", i + 1, short_label(layer)),
        );
        let caps = LayerCaps::new(limits, *bytes, *entries);
        rootfs.set_entry_cap(caps.entries.0);
        let result = apply_one(image, i, layer, rootfs, &bar, &caps);
        bar.finish_and_clear();
        let (layer_bytes, layer_entries) = result?;
        *bytes += layer_bytes;
        *entries += layer_entries;
    }
    Ok(())
}

/// One layer's caps: the smaller of the layer's own and what the image has left, with the flag
/// that sets the one in force.
struct LayerCaps {
    bytes: (u64, &'static str, &'static str),
    entries: (u64, &'static str, &'static str),
}

impl LayerCaps {
    fn new(limits: BuildLimits, bytes_used: u64, entries_used: u64) -> Self {
        let pick = |layer: u64, image: u64, used: u64, per: [&'static str; 4]| {
            let left = image.saturating_sub(used);
            if layer <= left {
                (layer, per[0], per[1])
            } else {
                (left, per[2], per[3])
            }
        };
        LayerCaps {
            bytes: pick(
                limits.layer_bytes,
                limits.image_bytes,
                bytes_used,
                [
                    "--max-layer-bytes",
                    "its uncompressed data",
                    "--max-image-bytes",
                    "the image's uncompressed data",
                ],
            ),
            entries: pick(
                limits.layer_entries,
                limits.image_entries,
                entries_used,
                [
                    "--max-layer-entries",
                    "its tar entries",
                    "--max-image-entries",
                    "the image's tar entries",
                ],
            ),
        }
    }
}

/// Counts what is read through it and fails once more than `cap` bytes came.
struct CappedReader<'a, R> {
    inner: R,
    cap: u64,
    read: &'a Cell<u64>,
    hit: &'a Cell<bool>,
}

impl<R: Read> Read for CappedReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let total = self.read.get().saturating_add(n as u64);
        self.read.set(total);
        if total > self.cap {
            self.hit.set(true);
            return Err(io::Error::other(format!(
                "uncompressed data passes the cap of {} bytes",
                self.cap
            )));
        }
        Ok(n)
    }
}

fn short_label(layer: &LayerBlob) -> String {
    layer
        .digest
        .as_ref()
        .or(layer.diff_id.as_ref())
        .map(|d| d.short().to_string())
        .unwrap_or_default()
}

/// Applies one layer within `caps`; the uncompressed bytes and entries it held.
fn apply_one(
    image: &ResolvedImage,
    i: usize,
    layer: &LayerBlob,
    rootfs: &mut RootfsBuilder,
    bar: &indicatif::ProgressBar,
    caps: &LayerCaps,
) -> Result<(u64, u64), ImageError> {
    let count = image.layers.len();
    let read_error = |source| ImageError::LayerRead {
        image: image.name.clone(),
        index: i + 1,
        count,
        location: layer.location.describe(),
        source,
    };
    let layer_error = |source| ImageError::Layer {
        image: image.name.clone(),
        index: i + 1,
        count,
        source: Box::new(source),
    };
    let label = layer.label();
    let mut stored = BufReader::with_capacity(
        256 * 1024,
        bar.wrap_read(layer.location.open().map_err(read_error)?),
    );
    let compression = compression::sniff(stored.fill_buf().map_err(read_error)?);
    let decoded = compression::decoder(&mut stored, compression);
    let (read, hit) = (Cell::new(0), Cell::new(false));
    let capped = CappedReader {
        inner: decoded,
        cap: caps.bytes.0,
        read: &read,
        hit: &hit,
    };
    let cap_error =
        |(limit, flag, what): (u64, &'static str, &'static str), unit| ImageError::LayerCap {
            image: image.name.clone(),
            index: i + 1,
            count,
            layer: label.clone(),
            what,
            limit,
            unit,
            flag,
        };
    let mut tar_stream = HashingReader::new(capped);
    let applied = rootfs.apply_layer(&label, &mut tar_stream);
    // The diff id covers the whole uncompressed stream, including tar's trailing padding.
    let drained = applied.and_then(|stats| {
        tar_stream
            .drain()
            .map(|()| stats)
            .map_err(|source| LayerError::Read {
                layer: label.clone(),
                source,
            })
    });
    let stats = match drained {
        _ if hit.get() => return Err(cap_error(caps.bytes, "bytes")),
        Err(LayerError::TooManyEntries { .. }) => return Err(cap_error(caps.entries, "entries")),
        other => other.map_err(layer_error)?,
    };
    if let Some(expected) = &layer.diff_id {
        let actual = tar_stream.digest();
        if &actual != expected {
            return Err(ImageError::LayerDigest {
                image: image.name.clone(),
                index: i + 1,
                count,
                mismatch: Box::new(DigestMismatch {
                    what: "uncompressed diff_id",
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                    location: layer.location.describe(),
                }),
            });
        }
    }
    Ok((read.get(), stats.entries))
}

/// Copies a cached image to `output` (and its metadata beside it), each through a temporary
/// name in the destination directory.
fn copy_out(
    rootfs: &Path,
    metadata: &Path,
    output: &Path,
) -> Result<(PathBuf, PathBuf), ImageError> {
    let metadata_out = metadata_path_for(output);
    let parent = check_output_dir(output)?;
    let file_name = output
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let tmp_image = TempOutput(parent.join(format!(".{file_name}.tmp-{}", std::process::id())));
    let tmp_meta = TempOutput(parent.join(format!(".{file_name}.json.tmp-{}", std::process::id())));
    ext4::sparse_copy(rootfs, &tmp_image.0)?;
    fs::copy(metadata, &tmp_meta.0).map_err(io_error("write", &tmp_meta.0))?;
    fs::rename(&tmp_meta.0, &metadata_out).map_err(io_error("write", &metadata_out))?;
    fs::rename(&tmp_image.0, output).map_err(io_error("write", output))?;
    Ok((output.to_path_buf(), metadata_out))
}

/// The directory `output` goes into, which must exist; `output` must not be a directory.
fn check_output_dir(output: &Path) -> Result<PathBuf, ImageError> {
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(ImageError::OutputDir {
            path: parent.display().to_string(),
        });
    }
    if output.is_dir() {
        return Err(ImageError::OutputIsDir {
            path: output.display().to_string(),
        });
    }
    Ok(parent)
}

/// Removes a temporary output file unless it was renamed into place.
struct TempOutput(PathBuf);

impl Drop for TempOutput {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_depends_on_every_input() {
        let image = Digest::of_bytes(b"image");
        let agent = Digest::of_bytes(b"agent");
        let base = cache_key(&image, &agent, None);
        assert_eq!(base.len(), 64);
        assert_eq!(base, cache_key(&image, &agent, None));
        assert_ne!(base, cache_key(&Digest::of_bytes(b"other"), &agent, None));
        assert_ne!(base, cache_key(&image, &Digest::of_bytes(b"other"), None));
        assert_ne!(base, cache_key(&image, &agent, Some(256)));
    }

    #[test]
    fn output_metadata_sits_beside_the_image() {
        assert_eq!(
            metadata_path_for(Path::new("/x/busybox.ext4")),
            Path::new("/x/busybox.image.json")
        );
        assert_eq!(
            metadata_path_for(Path::new("rootfs")),
            Path::new("rootfs.image.json")
        );
    }
}
