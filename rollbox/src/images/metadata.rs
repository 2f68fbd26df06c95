//! `image.json`: what a sandbox needs to start the image's process, written inside the rootfs
//! (`/.rollbox/image.json`) and beside the ext4 file.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::agent::{Agent, AGENT_PATH_IN_ROOTFS};
use super::source::ResolvedImage;

/// Bumped whenever the builder's output for the same input changes; part of the cache key.
pub const BUILDER_VERSION: &str = concat!("rollbox-images/2 (", env!("CARGO_PKG_VERSION"), ")");

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImageMetadata {
    pub builder_version: String,
    /// registry, docker-archive or oci-layout.
    pub source: String,
    /// The reference or path the image was built from.
    pub name: String,
    pub image_digest: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_digest: Option<String>,
    pub config_digest: String,
    /// Uncompressed layer digests (diff ids), bottom first.
    pub layers: Vec<String>,
    pub architecture: String,
    pub os: String,
    /// The image's process, as Docker would run it.
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// entrypoint followed by cmd: the argv to exec.
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: String,
    pub user: String,
    #[serde(default)]
    pub exposed_ports: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<String>,
    /// The guest agent: PID 1 of the sandbox.
    pub init: String,
    /// What the kernel command line must carry to start it.
    pub kernel_cmdline: String,
    pub agent_sha256: String,
    /// Size of the ext4 image; only in the copy beside the image (unknown inside it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs_size_bytes: Option<u64>,
    /// Set for a split build: the rootfs is a top disk over this shared base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<BaseInfo>,
}

/// The shared base under a split build's top disk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BaseInfo {
    /// Chain id of the base's layers (images.md).
    pub chain_id: String,
    /// How many of the image's layers (the first ones) the base holds.
    pub layers: usize,
}

impl ImageMetadata {
    pub fn new(image: &ResolvedImage, agent: &Agent) -> Self {
        let runtime = image.config.config.clone().unwrap_or_default();
        let entrypoint = runtime.entrypoint.unwrap_or_default();
        let cmd = runtime.cmd.unwrap_or_default();
        let argv = entrypoint.iter().chain(cmd.iter()).cloned().collect();
        let layers = image
            .layers
            .iter()
            .map(|l| {
                l.diff_id
                    .as_ref()
                    .or(l.digest.as_ref())
                    .map(ToString::to_string)
                    .unwrap_or_default()
            })
            .collect();
        Self {
            builder_version: BUILDER_VERSION.to_string(),
            source: image.kind.name().to_string(),
            name: image.name.clone(),
            image_digest: image.image_digest.to_string(),
            manifest_digest: image.manifest_digest.as_ref().map(ToString::to_string),
            config_digest: image.config_digest.to_string(),
            layers,
            architecture: image.config.architecture.clone(),
            os: image.config.os.clone(),
            entrypoint,
            cmd,
            argv,
            env: runtime.env.unwrap_or_default(),
            working_dir: runtime
                .working_dir
                .filter(|w| !w.is_empty())
                .unwrap_or_else(|| "/".to_string()),
            user: runtime.user.unwrap_or_default(),
            exposed_ports: runtime
                .exposed_ports
                .unwrap_or_default()
                .into_keys()
                .collect(),
            labels: runtime.labels.unwrap_or_default(),
            stop_signal: runtime.stop_signal.filter(|s| !s.is_empty()),
            init: AGENT_PATH_IN_ROOTFS.to_string(),
            kernel_cmdline: format!("init={AGENT_PATH_IN_ROOTFS}"),
            agent_sha256: agent.digest.to_string(),
            rootfs_size_bytes: None,
            base: None,
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::digest::Digest;
    use crate::images::source::SourceKind;
    use crate::images::spec::{ImageConfigFile, RuntimeConfig};
    use std::path::Path;

    #[test]
    fn keeps_the_image_process_and_points_init_at_the_agent() {
        let image = ResolvedImage {
            kind: SourceKind::Registry,
            name: "127.0.0.1:5000/tiny:latest".to_string(),
            image_digest: Digest::of_bytes(b"manifest"),
            manifest_digest: Some(Digest::of_bytes(b"manifest")),
            config_digest: Digest::of_bytes(b"config"),
            config: ImageConfigFile {
                architecture: "amd64".to_string(),
                os: "linux".to_string(),
                config: Some(RuntimeConfig {
                    entrypoint: Some(vec!["/bin/sh".into(), "-c".into()]),
                    cmd: Some(vec!["echo hi".into()]),
                    env: Some(vec!["PATH=/usr/bin:/bin".into(), "A=b c".into()]),
                    working_dir: Some(String::new()),
                    user: Some("1000:1000".into()),
                    ..Default::default()
                }),
                rootfs: None,
            },
            layers: Vec::new(),
        };
        let agent = Agent::load(Path::new("/bin/sh")).unwrap();
        let meta = ImageMetadata::new(&image, &agent);
        assert_eq!(meta.argv, ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(meta.working_dir, "/");
        assert_eq!(meta.user, "1000:1000");
        assert_eq!(meta.env[1], "A=b c");
        assert_eq!(meta.kernel_cmdline, "init=/.rollbox/rollbox-agent");
        let back: ImageMetadata = serde_json::from_slice(&meta.to_json()).unwrap();
        assert_eq!(back, meta);
        assert!(!String::from_utf8(meta.to_json())
            .unwrap()
            .contains("rootfs_size_bytes"));
    }
}
