//! Split builds (`BuildOptions::share_layers`): images that start with the same layers share
//! one read-only base disk, and each gets a small top disk holding only what differs.
//!
//! Every prefix of an image's layers has a chain id: chain_1 = H(id_1),
//! chain_i = H(chain_{i-1} "\n" id_i), the id being the layer's diff_id, else its blob digest.
//! A build with sharing on marks every prefix chain it saw (`<cache>/chains/<hex>`). The next
//! such build reuses a cached result for the same image if there is one (the whole image, or
//! a top disk over any marked prefix); otherwise it splits at the longest prefix marked: layers 1..k make the base
//! (`<cache>/bases/<key>/base.ext4`, key = H(builder version, chain_k)), built once; the top
//! disk holds, under `/.rollbox/upper`, what layers k+1..n, E2B's account and the agent add
//! or change (see [`super::upper`]). Top disk layout, which the guest agent relies on:
//! ```text
//! /.rollbox/rollbox-agent   the agent (the kernel's init)
//! /.rollbox/upper/          overlayfs upperdir
//! /.rollbox/work/           overlayfs workdir
//! /.rollbox/lower/          mount point for the base
//! /.rollbox/root/           mount point for the merged root
//! /dev/  /proc/
//! ```

use std::fs::{self, Permissions};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::agent::{AGENT_DIR, AGENT_NAME};
use super::cache::{Cache, CacheError, CachedRootfs, BASE_FILE};
use super::digest::Digest;
use super::ext4::{self, Ext4Error};
use super::metadata::BUILDER_VERSION;
use super::progress::Progress;
use super::source::ResolvedImage;
use super::upper::{self, Snapshot, UpperError, UpperStats};

#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("the shared base of layers 1..{layers} ({chain}): {source}")]
    Base {
        layers: usize,
        chain: String,
        source: Ext4Error,
    },
    #[error(transparent)]
    Upper(#[from] UpperError),
    #[error("top disk: cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: String,
        source: io::Error,
    },
}

fn io_error<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> SharedError + 'a {
    move |source| SharedError::Io {
        action,
        path: path.display().to_string(),
        source,
    }
}

/// Where a build splits: layers 1..=`layers` come from the base.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub layers: usize,
    pub chain: Digest,
    /// bases/<base_key> in the cache.
    pub base_key: String,
}

/// The chain id of every prefix of the image's layers; None when a layer has no id.
pub fn chains(image: &ResolvedImage) -> Option<Vec<Digest>> {
    let mut out: Vec<Digest> = Vec::with_capacity(image.layers.len());
    for layer in &image.layers {
        let id = layer.diff_id.as_ref().or(layer.digest.as_ref())?;
        let text = match out.last() {
            Some(previous) => format!("{previous}\n{id}"),
            None => id.to_string(),
        };
        out.push(Digest::of_bytes(text.as_bytes()));
    }
    Some(out)
}

/// Every prefix whose chain a previous build marked, longest first: a build splits at the
/// first (the longest); a cached top disk of any of them is as good.
pub fn marked_splits(cache: &Cache, chains: &[Digest]) -> Vec<Split> {
    let marked = chains.iter().enumerate().rev();
    marked
        .filter(|(_, c)| cache.has_chain(c))
        .map(|(i, chain)| Split {
            layers: i + 1,
            chain: chain.clone(),
            base_key: base_key(chain),
        })
        .collect()
}

/// A cached result for the image whose whole build has the cache key `full_key`: the whole
/// image, or a top disk over any prefix marked in `chains` whose base is cached. Then the
/// split the build uses: that hit's, else the longest marked prefix (None: a whole image).
pub fn lookup(
    cache: &Cache,
    full_key: &str,
    chains: Option<&[Digest]>,
) -> (Option<CachedRootfs>, Option<Split>) {
    let marked = chains.map_or_else(Vec::new, |c| marked_splits(cache, c));
    let candidates = std::iter::once(None).chain(marked.iter().map(Some));
    for split in candidates {
        let key = split.map_or_else(|| full_key.to_string(), |s| top_key(full_key, s));
        let base_cached = split.is_none_or(|s| cache.lookup_base(&s.base_key).is_some());
        if let Some(entry) = cache.lookup_rootfs(&key).filter(|_| base_cached) {
            return (Some(entry), split.cloned());
        }
    }
    (None, marked.into_iter().next())
}

pub fn base_key(chain: &Digest) -> String {
    let text = format!("{BUILDER_VERSION}\nbase {chain}\n");
    Digest::of_bytes(text.as_bytes()).hex().to_string()
}

/// The top disk's cache key: the full build's key, the split point and its chain.
pub fn top_key(full_key: &str, split: &Split) -> String {
    let text = format!("{full_key}\nsplit {} {}\n", split.layers, split.chain);
    Digest::of_bytes(text.as_bytes()).hex().to_string()
}

pub fn mark_chains(cache: &Cache, chains: &[Digest]) -> Result<(), SharedError> {
    for chain in chains {
        cache.mark_chain(chain)?;
    }
    Ok(())
}

/// The cached base for `split`, made from `tree` (holding exactly layers 1..k) if absent.
pub fn ensure_base(
    cache: &Cache,
    split: &Split,
    tree: &Path,
    progress: Progress,
) -> Result<PathBuf, SharedError> {
    if let Some(found) = cache.lookup_base(&split.base_key) {
        return Ok(found);
    }
    let staging = cache.staging("base");
    let dir = staging.path();
    fs::create_dir(dir).map_err(io_error("create", dir))?;
    let file = dir.join(BASE_FILE);
    let spinner = progress.spinner(format!("making the shared base ({} layers)", split.layers));
    let made = ext4::make_read_only(tree, &file);
    spinner.finish_and_clear();
    let size_bytes = made.map_err(|source| SharedError::Base {
        layers: split.layers,
        chain: split.chain.to_string(),
        source,
    })?;
    let meta = serde_json::json!({
        "builder_version": BUILDER_VERSION,
        "chain_id": split.chain.to_string(),
        "layers": split.layers,
        "size_bytes": size_bytes,
    });
    let meta_file = dir.join("base.json");
    let text = serde_json::to_vec_pretty(&meta).unwrap_or_default();
    fs::write(&meta_file, text).map_err(io_error("write", &meta_file))?;
    Ok(cache.commit_base(staging, &split.base_key)?)
}

/// Makes the top disk's tree at `top` (which must not exist; beside `tree`, on the same file
/// system): the layout above, the upper directory hard-linked from `tree`.
pub fn assemble_top(
    tree: &Path,
    snapshot: &Snapshot,
    top: &Path,
) -> Result<UpperStats, SharedError> {
    let dir = top.join(AGENT_DIR);
    let mkdir = |path: &Path, mode: u32| -> Result<(), SharedError> {
        fs::create_dir(path).map_err(io_error("create", path))?;
        fs::set_permissions(path, Permissions::from_mode(mode)).map_err(io_error("chmod", path))
    };
    mkdir(top, 0o755)?;
    mkdir(&dir, 0o755)?;
    let stats = upper::write_upper(tree, snapshot, &dir.join("upper"))?;
    for name in ["work", "lower", "root"] {
        mkdir(&dir.join(name), 0o755)?;
    }
    mkdir(&top.join("dev"), 0o755)?;
    mkdir(&top.join("proc"), 0o555)?;
    let agent = dir.join(AGENT_NAME);
    fs::hard_link(tree.join(AGENT_DIR).join(AGENT_NAME), &agent)
        .map_err(io_error("link the agent to", &agent))?;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::source::{BlobLocation, LayerBlob, SourceKind};
    use crate::images::spec::ImageConfigFile;

    fn image(ids: &[&[u8]]) -> ResolvedImage {
        ResolvedImage {
            kind: SourceKind::OciLayout,
            name: "x".to_string(),
            image_digest: Digest::of_bytes(b"m"),
            manifest_digest: None,
            config_digest: Digest::of_bytes(b"c"),
            config: ImageConfigFile {
                architecture: "amd64".to_string(),
                os: "linux".to_string(),
                config: None,
                rootfs: None,
            },
            layers: ids
                .iter()
                .map(|id| LayerBlob {
                    digest: None,
                    diff_id: Some(Digest::of_bytes(id)),
                    size: 0,
                    location: BlobLocation::File(PathBuf::from("/nonexistent")),
                })
                .collect(),
        }
    }

    #[test]
    fn chains_identify_prefixes_and_the_longest_marked_one_splits() {
        let a = chains(&image(&[b"1", b"2", b"3"])).unwrap();
        let b = chains(&image(&[b"1", b"2", b"4"])).unwrap();
        let c = chains(&image(&[b"2", b"1"])).unwrap();
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);

        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path()).unwrap();
        assert_eq!(marked_splits(&cache, &b), []);
        mark_chains(&cache, &a).unwrap();
        let splits = marked_splits(&cache, &b);
        assert_eq!(splits.iter().map(|s| s.layers).collect::<Vec<_>>(), [2, 1]);
        let split = &splits[0];
        assert_eq!((split.layers, &split.chain), (2, &a[1]));
        assert_eq!(split.base_key, base_key(&a[1]));
        assert_eq!(marked_splits(&cache, &a)[0].layers, 3);
        assert_ne!(top_key("k", split), top_key("k2", split));
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
    }
}
