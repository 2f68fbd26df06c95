//! The parts of the OCI image spec (and Docker's equivalents) that the builder reads.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: i64,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
}

/// An image index (OCI) or manifest list (Docker), as found in an OCI layout's index.json.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    #[serde(default)]
    pub media_type: Option<String>,
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
}

/// An image manifest (OCI or Docker schema 2).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    #[serde(default)]
    pub media_type: Option<String>,
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

/// One image in a `docker save` tarball's manifest.json.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct DockerArchiveImage {
    pub config: String,
    #[serde(default)]
    pub repo_tags: Option<Vec<String>>,
    pub layers: Vec<String>,
}

/// The image configuration blob; only what the sandbox needs.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ImageConfigFile {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub config: Option<RuntimeConfig>,
    #[serde(default)]
    pub rootfs: Option<RootfsSection>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct RuntimeConfig {
    #[serde(rename = "Entrypoint", default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    pub cmd: Option<Vec<String>>,
    #[serde(rename = "Env", default)]
    pub env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    pub working_dir: Option<String>,
    #[serde(rename = "User", default)]
    pub user: Option<String>,
    #[serde(rename = "ExposedPorts", default)]
    pub exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(rename = "Labels", default)]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(rename = "StopSignal", default)]
    pub stop_signal: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct RootfsSection {
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

pub fn is_index(media_type: Option<&str>) -> bool {
    matches!(media_type, Some(MEDIA_OCI_INDEX | MEDIA_DOCKER_LIST))
}

/// Picks the linux/amd64 entry of an index (or the only one, when there is a single entry).
pub fn pick_platform(manifests: &[Descriptor]) -> Option<&Descriptor> {
    let wanted_arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    manifests
        .iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == wanted_arch)
        })
        .or_else(|| {
            if manifests.len() == 1 {
                manifests.first()
            } else {
                None
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_docker_config_fields() {
        let config: ImageConfigFile = serde_json::from_str(
            r#"{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"],
               "Env":["PATH=/bin"],"WorkingDir":"/srv","User":"1000:1000","Labels":{"a":"b"}},
               "rootfs":{"type":"layers","diff_ids":["sha256:aa"]},"history":[]}"#,
        )
        .unwrap();
        let runtime = config.config.unwrap();
        assert_eq!(runtime.entrypoint.unwrap(), ["/bin/sh", "-c"]);
        assert_eq!(runtime.cmd.unwrap(), ["echo hi"]);
        assert_eq!(runtime.working_dir.as_deref(), Some("/srv"));
        assert_eq!(runtime.user.as_deref(), Some("1000:1000"));
        assert_eq!(config.rootfs.unwrap().diff_ids, ["sha256:aa"]);
    }

    #[test]
    fn picks_linux_amd64_or_single() {
        let index: Index = serde_json::from_str(
            r#"{"manifests":[{"digest":"sha256:1","platform":{"os":"linux","architecture":"arm64"}},
                             {"digest":"sha256:2","platform":{"os":"linux","architecture":"amd64"}}]}"#,
        )
        .unwrap();
        if std::env::consts::ARCH == "x86_64" {
            assert_eq!(pick_platform(&index.manifests).unwrap().digest, "sha256:2");
        }
        assert!(pick_platform(&[]).is_none());
    }
}
