//! Test layers: an in-memory tar builder (entries `tar::Builder` would refuse included), and
//! applying one, for the tests of the layer files.

use std::fs;
use std::io;
use std::path::Path;

use tar::EntryType;

use super::builder::{LayerStats, RootfsBuilder};
use super::error::LayerError;

/// Builds an in-memory tar layer.
pub(super) struct LayerTar {
    builder: tar::Builder<Vec<u8>>,
}

impl LayerTar {
    pub(super) fn new() -> Self {
        Self {
            builder: tar::Builder::new(Vec::new()),
        }
    }

    fn header(kind: EntryType, mode: u32, uid: u64, gid: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_uid(uid);
        header.set_gid(gid);
        header.set_mtime(1_600_000_000);
        header.set_size(0);
        header
    }

    pub(super) fn file(mut self, path: &str, data: &[u8], mode: u32, uid: u64, gid: u64) -> Self {
        let mut header = Self::header(EntryType::Regular, mode, uid, gid);
        header.set_size(data.len() as u64);
        self.builder.append_data(&mut header, path, data).unwrap();
        self
    }

    pub(super) fn dir(mut self, path: &str, mode: u32) -> Self {
        let mut header = Self::header(EntryType::Directory, mode, 0, 0);
        self.builder
            .append_data(&mut header, path, io::empty())
            .unwrap();
        self
    }

    pub(super) fn link(mut self, kind: EntryType, path: &str, target: &str) -> Self {
        let mut header = Self::header(kind, 0o777, 0, 0);
        self.builder.append_link(&mut header, path, target).unwrap();
        self
    }

    pub(super) fn device(mut self, kind: EntryType, path: &str, major: u32, minor: u32) -> Self {
        let mut header = Self::header(kind, 0o620, 0, 5);
        header.set_device_major(major).unwrap();
        header.set_device_minor(minor).unwrap();
        self.builder
            .append_data(&mut header, path, io::empty())
            .unwrap();
        self
    }

    /// Writes a raw name that `append_data` would refuse (absolute or `..`).
    pub(super) fn raw_file(mut self, path: &str) -> Self {
        let mut header = Self::header(EntryType::Regular, 0o644, 0, 0);
        let name = path.as_bytes();
        header.as_old_mut().name[..name.len()].copy_from_slice(name);
        header.set_cksum();
        self.builder.append(&header, io::empty()).unwrap();
        self
    }

    /// Raw hardlink with an arbitrary target.
    pub(super) fn raw_hardlink(mut self, path: &str, target: &str) -> Self {
        let mut header = Self::header(EntryType::Link, 0o644, 0, 0);
        header.set_path(path).unwrap();
        let target = target.as_bytes();
        header.as_old_mut().linkname[..target.len()].copy_from_slice(target);
        header.set_cksum();
        self.builder.append(&header, io::empty()).unwrap();
        self
    }

    pub(super) fn bytes(self) -> Vec<u8> {
        self.builder.into_inner().unwrap()
    }
}

pub(super) fn apply(
    builder: &mut RootfsBuilder,
    name: &str,
    layer: LayerTar,
) -> Result<LayerStats, LayerError> {
    builder.apply_layer(name, &layer.bytes()[..])
}

pub(super) fn exists(root: &Path, rel: &str) -> bool {
    fs::symlink_metadata(root.join(rel)).is_ok()
}
