//! The snapshot bodies: `PUT /snapshot/create` and `PUT /snapshot/load` (Firecracker's, plus
//! rollbox's `"rollbox"` restore extension), and the overrides a restore takes.

use serde::{Deserialize, Serialize};

/// `PUT /snapshot/create` body (Firecracker's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotParams {
    /// "Full" (default) or "Diff".
    #[serde(default = "default_snapshot_type")]
    pub snapshot_type: String,
    /// Where the state file goes.
    pub snapshot_path: std::path::PathBuf,
    /// Where the memory file goes.
    pub mem_file_path: std::path::PathBuf,
    /// Deprecated Firecracker field, accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// rollbox extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollbox: Option<CreateExtension>,
}

/// rollbox's snapshot extension, under `"rollbox"` in the create body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateExtension {
    /// Full only: resume the VM as soon as its memory is imaged (a fork(2) of the VMM), while
    /// a child process writes the memory file; the answer comes once that file is complete.
    /// The snapshot leaves the VM's diff base and dirty pages alone. Memory shared with a
    /// backend (virtio-fs) or served lazily is written before the VM resumes.
    #[serde(default)]
    pub resume_vm: bool,
}

fn default_snapshot_type() -> String {
    "Full".into()
}

/// `PUT /snapshot/create`'s answer (200) when `"rollbox": {"resume_vm": true}` asked for it;
/// without it the answer is Firecracker's 204.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumedSnapshot {
    /// From the request until the VM ran again, in milliseconds.
    pub paused_ms: f64,
    /// From the request until the memory file was written, in milliseconds.
    pub elapsed_ms: f64,
}

/// Firecracker's `mem_backend`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemBackend {
    /// "File" (the memory file; rollbox maps it copy-on-write) or "Uffd".
    pub backend_type: String,
    /// The memory file (File), or an external handler's socket (Uffd).
    pub backend_path: std::path::PathBuf,
}

/// Firecracker's `vsock_override`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockOverride {
    /// New host-side socket.
    pub uds_path: std::path::PathBuf,
}

/// Firecracker's `network_overrides` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkOverride {
    /// The interface, as in the snapshot.
    pub iface_id: String,
    /// Its new host tap.
    pub host_dev_name: String,
    /// rollbox extension: a new MAC for the device (a clone's; the agent applies it in the
    /// guest with `configure_network`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
}

/// rollbox's restore extension, under `"rollbox"` in the load body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreExtension {
    /// "cow" (default), "uffd" (in-VMM page server) or "copy".
    #[serde(default)]
    pub restore_backend: Option<String>,
    /// uffd: prefetch the recorded working set.
    #[serde(default)]
    pub prefetch: bool,
    /// uffd: record the pages the guest touches.
    #[serde(default)]
    pub record_working_set: bool,
    /// Tell the guest it is a clone (new generation counter value).
    #[serde(default)]
    pub new_generation: bool,
    /// Deterministic reset: guest time and generation exactly as in the snapshot.
    #[serde(default)]
    pub deterministic: bool,
    /// New image paths by drive ID.
    #[serde(default)]
    pub drive_overrides: std::collections::HashMap<String, std::path::PathBuf>,
    /// New shared directories by volume tag (virtio-fs).
    #[serde(default)]
    pub fs_overrides: std::collections::HashMap<String, std::path::PathBuf>,
    /// vhost-user sockets of virtiofsd the caller started, by volume tag (virtio-fs): the
    /// volume connects to it instead of starting one, and its saved state is loaded into it.
    /// Not with `fs_overrides` for the same tag (the directory is that virtiofsd's).
    #[serde(default, skip_serializing_if = "std::collections::HashMap::is_empty")]
    pub fs_sockets: std::collections::HashMap<String, std::path::PathBuf>,
    /// New memory files by layer index (0 = the full base, then the diffs).
    #[serde(default)]
    pub layer_overrides: std::collections::HashMap<usize, std::path::PathBuf>,
}

/// `PUT /snapshot/load` body (Firecracker's, plus the `rollbox` extension object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadSnapshotParams {
    /// The state file.
    pub snapshot_path: std::path::PathBuf,
    /// The memory backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_backend: Option<MemBackend>,
    /// Deprecated: the memory file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_file_path: Option<std::path::PathBuf>,
    /// Deprecated name of `track_dirty_pages`.
    #[serde(default)]
    pub enable_diff_snapshots: bool,
    /// Track dirty pages for diff snapshots of the restored VM.
    #[serde(default)]
    pub track_dirty_pages: bool,
    /// Resume the VM after loading.
    #[serde(default)]
    pub resume_vm: bool,
    /// New host-side vsock socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_override: Option<VsockOverride>,
    /// New host taps for the snapshot's network interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_overrides: Vec<NetworkOverride>,
    /// rollbox extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollbox: Option<RestoreExtension>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::assert_wire;

    #[test]
    fn create() {
        let mut params = CreateSnapshotParams {
            snapshot_type: "Full".into(),
            snapshot_path: "/s/vmstate".into(),
            mem_file_path: "/s/memory".into(),
            version: None,
            rollbox: None,
        };
        assert_wire(
            &params,
            r#"{"snapshot_type":"Full","snapshot_path":"/s/vmstate","mem_file_path":"/s/memory"}"#,
        );
        params.rollbox = Some(CreateExtension { resume_vm: true });
        assert_wire(
            &params,
            r#"{"snapshot_type":"Full","snapshot_path":"/s/vmstate","mem_file_path":"/s/memory","rollbox":{"resume_vm":true}}"#,
        );
        params.rollbox = None;
        assert_wire(
            &ResumedSnapshot {
                paused_ms: 1.5,
                elapsed_ms: 9.25,
            },
            r#"{"paused_ms":1.5,"elapsed_ms":9.25}"#,
        );
        params.snapshot_type = "Diff".into();
        params.version = Some("1.0.0".into());
        assert_wire(
            &params,
            r#"{"snapshot_type":"Diff","snapshot_path":"/s/vmstate","mem_file_path":"/s/memory","version":"1.0.0"}"#,
        );
        let defaulted: CreateSnapshotParams =
            serde_json::from_str(r#"{"snapshot_path":"/a","mem_file_path":"/b"}"#).expect("parse");
        assert_eq!(defaulted.snapshot_type, "Full");
        let err = serde_json::from_str::<CreateSnapshotParams>(
            r#"{"snapshot_path":"/a","mem_file_path":"/b","rollbox":{"resume":true}}"#,
        )
        .expect_err("unknown extension field");
        assert!(err.to_string().contains("resume"), "{err}");
    }

    #[test]
    fn load_plain() {
        let params = LoadSnapshotParams {
            snapshot_path: "/s/vmstate".into(),
            mem_backend: None,
            mem_file_path: None,
            enable_diff_snapshots: false,
            track_dirty_pages: false,
            resume_vm: false,
            vsock_override: None,
            network_overrides: Vec::new(),
            rollbox: None,
        };
        assert_wire(
            &params,
            r#"{"snapshot_path":"/s/vmstate","enable_diff_snapshots":false,"track_dirty_pages":false,"resume_vm":false}"#,
        );
        let minimal: LoadSnapshotParams =
            serde_json::from_str(r#"{"snapshot_path":"/s/vmstate"}"#).expect("parse");
        assert_eq!(minimal, params);
    }

    #[test]
    fn load_with_every_override_and_the_extension() {
        let extension = RestoreExtension {
            restore_backend: Some("uffd".into()),
            prefetch: true,
            record_working_set: true,
            new_generation: true,
            deterministic: false,
            drive_overrides: [("rootfs".to_string(), "/c/rootfs.img".into())].into(),
            fs_overrides: [("data".to_string(), "/srv/copy".into())].into(),
            fs_sockets: [("logs".to_string(), "/run/logs.sock".into())].into(),
            layer_overrides: [(0, "/c/memory".into())].into(),
        };
        let params = LoadSnapshotParams {
            snapshot_path: "/s/vmstate".into(),
            mem_backend: Some(MemBackend {
                backend_type: "File".into(),
                backend_path: "/s/memory".into(),
            }),
            mem_file_path: Some("/s/memory".into()),
            enable_diff_snapshots: false,
            track_dirty_pages: true,
            resume_vm: true,
            vsock_override: Some(VsockOverride {
                uds_path: "/c/v.sock".into(),
            }),
            network_overrides: vec![NetworkOverride {
                iface_id: "eth0".into(),
                host_dev_name: "tap1".into(),
                guest_mac: Some("06:00:ac:10:00:03".into()),
            }],
            rollbox: Some(extension),
        };
        assert_wire(
            &params,
            concat!(
                r#"{"snapshot_path":"/s/vmstate","#,
                r#""mem_backend":{"backend_type":"File","backend_path":"/s/memory"},"#,
                r#""mem_file_path":"/s/memory","#,
                r#""enable_diff_snapshots":false,"track_dirty_pages":true,"resume_vm":true,"#,
                r#""vsock_override":{"uds_path":"/c/v.sock"},"#,
                r#""network_overrides":[{"iface_id":"eth0","host_dev_name":"tap1","guest_mac":"06:00:ac:10:00:03"}],"#,
                r#""rollbox":{"restore_backend":"uffd","prefetch":true,"record_working_set":true,"#,
                r#""new_generation":true,"deterministic":false,"#,
                r#""drive_overrides":{"rootfs":"/c/rootfs.img"},"fs_overrides":{"data":"/srv/copy"},"#,
                r#""fs_sockets":{"logs":"/run/logs.sock"},"#,
                r#""layer_overrides":{"0":"/c/memory"}}}"#
            ),
        );
        assert_wire(
            &RestoreExtension::default(),
            r#"{"restore_backend":null,"prefetch":false,"record_working_set":false,"new_generation":false,"deterministic":false,"drive_overrides":{},"fs_overrides":{},"layer_overrides":{}}"#,
        );
        let err = serde_json::from_str::<LoadSnapshotParams>(
            r#"{"snapshot_path":"/s","rollbox":{"lazy":true}}"#,
        )
        .expect_err("unknown field");
        assert!(err.to_string().contains("lazy"), "{err}");
    }
}
