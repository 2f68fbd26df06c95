//! The per-VM control API. Where rollbox-vmm and Firecracker share an operation it speaks
//! Firecracker's REST API: same paths, same bodies. Requests become one typed [`VmmAction`];
//! the HTTP layer ([`http`], [`server`]) only moves bytes.

pub mod http;
pub mod server;

use serde::{Deserialize, Serialize};

use crate::config::FsConfig;
use crate::config::{
    BootSourceConfig, DriveConfig, MachineConfig, NetworkInterfaceConfig, VsockConfig,
};

/// Everything the API can ask of the VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmAction {
    /// `GET /`
    GetVmInfo,
    /// `GET /machine-config`
    GetMachineConfig,
    /// `PUT /boot-source`
    PutBootSource(BootSourceConfig),
    /// `PUT /machine-config`
    PutMachineConfig(MachineConfig),
    /// `PUT /drives/{id}`
    PutDrive(DriveConfig),
    /// `PUT /vsock`
    PutVsock(VsockConfig),
    /// `PUT /network-interfaces/{iface_id}`
    PutNetworkInterface(NetworkInterfaceConfig),
    /// rollbox extension: `PUT /fs/{tag}`, a shared volume over virtio-fs.
    PutFs(FsConfig),
    /// rollbox extension: `PUT /vfio {"path": "/sys/bus/pci/devices/..."}`, a host PCI device
    /// bound to vfio-pci passed through (implies a PCI bus).
    PutVfio(VfioDevice),
    /// `PUT /actions {"action_type": "InstanceStart"}`
    InstanceStart,
    /// `PUT /actions {"action_type": "SendCtrlAltDel"}`
    SendCtrlAltDel,
    /// `PUT /actions {"action_type": "FlushMetrics"}` (accepted; rollbox-vmm keeps no metrics file)
    FlushMetrics,
    /// `PATCH /vm {"state": "Paused"}`
    Pause,
    /// `PATCH /vm {"state": "Resumed"}`
    Resume,
    /// `PUT /snapshot/create`
    CreateSnapshot(CreateSnapshotParams),
    /// `PUT /snapshot/load`
    LoadSnapshot(LoadSnapshotParams),
    /// rollbox extension: `POST /fork {"count": N}`
    Fork(ForkParams),
    /// rollbox extension: `GET /fork-pool`, answered once the pool's shells are ready.
    GetForkPool,
}

/// `PUT /vfio` body (a rollbox extension).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VfioDevice {
    /// The device's sysfs path, `/sys/bus/pci/devices/DDDD:BB:DD.F`.
    pub path: std::path::PathBuf,
}

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
}

fn default_snapshot_type() -> String {
    "Full".into()
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

/// `POST /fork` body (rollbox extension).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkParams {
    /// Number of clones (1-256).
    pub count: u32,
    /// Directory for the snapshot and the clones' files (default: under /dev/shm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<std::path::PathBuf>,
    /// Give each clone a new generation counter value (default true); false makes every
    /// clone bit-identical to the parent.
    #[serde(default = "default_true")]
    pub new_generation: bool,
    /// Memory backend of the clones (default "cow").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_backend: Option<String>,
    /// Host taps of each clone, one list per clone (clones cannot share a tap); required
    /// when the VM has network interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_overrides: Vec<Vec<NetworkOverride>>,
}

fn default_true() -> bool {
    true
}

/// One clone of a fork.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CloneInfo {
    /// Index among the clones.
    pub index: u32,
    /// Process ID, when it started.
    pub pid: Option<u32>,
    /// The clone's API socket.
    pub api_sock: std::path::PathBuf,
    /// The clone's vsock socket, if the VM has vsock.
    pub vsock_uds: Option<std::path::PathBuf>,
    /// The clone's console log.
    pub console: std::path::PathBuf,
    /// Why the clone failed, if it did.
    pub error: Option<String>,
}

/// `POST /fork` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkResult {
    /// The snapshot the clones restored.
    pub snapshot_dir: std::path::PathBuf,
    /// How long the parent was paused, in milliseconds.
    pub paused_ms: f64,
    /// Total time until every clone was up or had failed, in milliseconds.
    pub elapsed_ms: f64,
    /// The clones.
    pub clones: Vec<CloneInfo>,
}

/// What a successful action returns.
#[derive(Debug, Clone, PartialEq)]
pub enum VmmData {
    /// 204 No Content.
    Empty,
    /// `GET /` body.
    VmInfo(VmInfo),
    /// `GET /machine-config` body.
    MachineConfig(MachineConfig),
    /// `POST /fork` body.
    Fork(ForkResult),
    /// `GET /fork-pool` body.
    ForkPool(crate::fork::ForkPoolStatus),
}

/// The instance description of `GET /`, as Firecracker returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    /// Instance ID.
    pub id: String,
    /// "Not started", "Running" or "Paused".
    pub state: String,
    /// Version of the VMM.
    pub vmm_version: String,
    /// Application name.
    pub app_name: String,
}

/// A refused action: HTTP status and the `fault_message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ActionError {
    /// HTTP status code.
    pub status: u16,
    /// Human-readable reason.
    pub message: String,
}

impl ActionError {
    /// A 400 Bad Request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
        }
    }
}

/// The result of an action.
pub type ActionResult = Result<VmmData, ActionError>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionBody {
    action_type: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VmStateBody {
    state: String,
}

fn body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ActionError> {
    if bytes.is_empty() {
        return Err(ActionError::bad_request("the request needs a JSON body"));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ActionError::bad_request(format!("invalid JSON body: {e}")))
}

/// Turns an HTTP request into an action.
pub fn parse_request(method: &str, path: &str, bytes: &[u8]) -> Result<VmmAction, ActionError> {
    let path = path.split('?').next().unwrap_or(path);
    let segments: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    match (method, segments.as_slice()) {
        ("GET", []) => Ok(VmmAction::GetVmInfo),
        ("GET", ["machine-config"]) => Ok(VmmAction::GetMachineConfig),
        ("PUT", ["boot-source"]) => Ok(VmmAction::PutBootSource(body(bytes)?)),
        ("PUT", ["machine-config"]) => Ok(VmmAction::PutMachineConfig(body(bytes)?)),
        ("PUT", ["drives", id]) => {
            let drive: DriveConfig = body(bytes)?;
            if drive.drive_id != *id {
                return Err(ActionError::bad_request(format!(
                    "drive_id {:?} in the body does not match {:?} in the path",
                    drive.drive_id, id
                )));
            }
            Ok(VmmAction::PutDrive(drive))
        }
        ("PUT", ["vsock"]) => Ok(VmmAction::PutVsock(body(bytes)?)),
        ("PUT", ["network-interfaces", id]) => {
            let iface: NetworkInterfaceConfig = body(bytes)?;
            if iface.iface_id != *id {
                return Err(ActionError::bad_request(format!(
                    "iface_id {:?} in the body does not match {:?} in the path",
                    iface.iface_id, id
                )));
            }
            Ok(VmmAction::PutNetworkInterface(iface))
        }
        ("PATCH", ["network-interfaces", id]) => Err(ActionError::bad_request(format!(
            "PATCH /network-interfaces/{id}: rate limiters are not supported by rollbox-vmm"
        ))),
        ("PUT", ["fs", tag]) => {
            let fs: FsConfig = body(bytes)?;
            if fs.tag != *tag {
                return Err(ActionError::bad_request(format!(
                    "tag {:?} in the body does not match {:?} in the path",
                    fs.tag, tag
                )));
            }
            Ok(VmmAction::PutFs(fs))
        }
        ("PUT", ["vfio"]) => Ok(VmmAction::PutVfio(body(bytes)?)),
        ("PUT", ["actions"]) => {
            let action: ActionBody = body(bytes)?;
            match action.action_type.as_str() {
                "InstanceStart" => Ok(VmmAction::InstanceStart),
                "SendCtrlAltDel" => Ok(VmmAction::SendCtrlAltDel),
                "FlushMetrics" => Ok(VmmAction::FlushMetrics),
                other => Err(ActionError::bad_request(format!(
                    "unknown action_type {other:?}: expected InstanceStart, SendCtrlAltDel or FlushMetrics"
                ))),
            }
        }
        ("PATCH", ["vm"]) => {
            let state: VmStateBody = body(bytes)?;
            match state.state.as_str() {
                "Paused" => Ok(VmmAction::Pause),
                "Resumed" => Ok(VmmAction::Resume),
                other => Err(ActionError::bad_request(format!(
                    "unknown state {other:?}: expected Paused or Resumed"
                ))),
            }
        }
        ("PUT", ["snapshot", "create"]) => Ok(VmmAction::CreateSnapshot(body(bytes)?)),
        ("PUT", ["snapshot", "load"]) => Ok(VmmAction::LoadSnapshot(body(bytes)?)),
        ("GET", ["fork-pool"]) => Ok(VmmAction::GetForkPool),
        ("POST", ["fork"]) => {
            let params: ForkParams = body(bytes)?;
            if params.count == 0 || params.count > 256 {
                return Err(ActionError::bad_request(format!(
                    "count {} is invalid: fork 1 to 256 clones",
                    params.count
                )));
            }
            Ok(VmmAction::Fork(params))
        }
        _ => Err(ActionError::bad_request(format!(
            "invalid request method and/or path: {method} {path}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_firecracker_requests() {
        assert_eq!(
            parse_request("GET", "/", b"").expect("get"),
            VmmAction::GetVmInfo
        );
        assert_eq!(
            parse_request("PUT", "/actions", br#"{"action_type":"InstanceStart"}"#).expect("start"),
            VmmAction::InstanceStart
        );
        assert_eq!(
            parse_request("PATCH", "/vm", br#"{"state":"Paused"}"#).expect("pause"),
            VmmAction::Pause
        );
        let a = parse_request(
            "PUT",
            "/machine-config",
            br#"{"vcpu_count":1,"mem_size_mib":64}"#,
        )
        .expect("mc");
        assert!(matches!(a, VmmAction::PutMachineConfig(m) if m.mem_size_mib == 64));
    }

    #[test]
    fn the_load_extension_takes_fs_overrides() {
        let body =
            br#"{"snapshot_path":"/s/vmstate","rollbox":{"fs_overrides":{"data":"/srv/copy"}}}"#;
        let action = parse_request("PUT", "/snapshot/load", body).expect("load");
        let VmmAction::LoadSnapshot(params) = action else {
            panic!("not a load: {action:?}");
        };
        let extension = params.rollbox.expect("extension");
        assert_eq!(
            extension.fs_overrides.get("data"),
            Some(&std::path::PathBuf::from("/srv/copy"))
        );
    }

    #[test]
    fn refuses_bad_requests_with_reasons() {
        let e = parse_request(
            "PUT",
            "/machine-config",
            br#"{"vcpu_count":1,"mem_size_mib":64,"x":1}"#,
        )
        .expect_err("unknown field");
        assert!(e.message.contains("unknown field `x`"), "{}", e.message);
        let e = parse_request(
            "PUT",
            "/drives/a",
            br#"{"drive_id":"b","path_on_host":"/x","is_root_device":false,"is_read_only":false}"#,
        )
        .expect_err("mismatch");
        assert!(e.message.contains("does not match"));
        let e = parse_request("PUT", "/fs/a", br#"{"tag":"b","shared_dir":"/tmp"}"#)
            .expect_err("tag mismatch");
        assert!(e.message.contains("does not match"), "{}", e.message);
        let a = parse_request(
            "PUT",
            "/fs/a",
            br#"{"tag":"a","shared_dir":"/tmp","readonly":true}"#,
        )
        .expect("fs");
        assert!(matches!(a, VmmAction::PutFs(f) if f.readonly));
        let v = parse_request(
            "PUT",
            "/vfio",
            br#"{"path":"/sys/bus/pci/devices/0000:00:04.0"}"#,
        )
        .expect("vfio");
        assert!(
            matches!(v, VmmAction::PutVfio(d) if d.path.ends_with("0000:00:04.0")),
            "PUT /vfio"
        );
        let e =
            parse_request("PUT", "/vfio", br#"{"path":"/x","bar":1}"#).expect_err("unknown field");
        assert!(e.message.contains("bar"), "{}", e.message);
        let e = parse_request("DELETE", "/vm", b"").expect_err("method");
        assert!(e.message.contains("invalid request method"));
        let e = parse_request("PUT", "/actions", b"{").expect_err("json");
        assert!(e.message.contains("invalid JSON"));
    }
}
