//! The per-VM control API. Where rollbox-vmm and Firecracker share an operation it speaks
//! Firecracker's REST API: same paths, same bodies. The bodies and the route table are
//! [`vmm_api`]'s (re-exported here); this module turns a request into one typed
//! [`VmmAction`], with the VMM's own refusals. The HTTP layer ([`http`], [`server`]) only
//! moves bytes.
//!
//! The parsing stays here rather than in `vmm_api`: a [`VmmAction`] is the VMM's command
//! set, answered with [`VmmData`] (the VMM's answers) or
//! an [`ActionError`] (the VMM's words and status codes); a client needs only the routes and
//! the bodies.

pub mod http;
pub mod server;

use vmm_api::{ActionBody, ActionType, Route, VmState, VmStateBody};
pub use vmm_api::{
    CreateExtension, CreateSnapshotParams, LoadSnapshotParams, MemBackend, NetworkOverride,
    RestoreExtension, ResumedSnapshot, VfioDevice, VmInfo, VsockOverride,
};

use crate::vmm_config::{
    BootSourceConfig, DriveConfig, FsConfig, MachineConfig, NetworkInterfaceConfig, VsockConfig,
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
    /// `PUT /snapshot/create` body with `"rollbox": {"resume_vm": true}`.
    ResumedSnapshot(ResumedSnapshot),
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
    let Some(route) = Route::parse(method, path) else {
        if path == "/fork" || path == "/fork-pool" {
            return Err(ActionError::bad_request(format!(
                "{method} {path}: rollbox-vmm's own fork was removed; snapshot with PUT /snapshot/create and \"rollbox\": {{\"resume_vm\": true}}, then load that snapshot into new VMMs (what the daemon's POST /sandboxes/{{id}}/fork does)"
            )));
        }
        return Err(ActionError::bad_request(format!(
            "invalid request method and/or path: {method} {path}"
        )));
    };
    match route {
        Route::GetVmInfo => Ok(VmmAction::GetVmInfo),
        Route::GetMachineConfig => Ok(VmmAction::GetMachineConfig),
        Route::PutBootSource => Ok(VmmAction::PutBootSource(body(bytes)?)),
        Route::PutMachineConfig => Ok(VmmAction::PutMachineConfig(body(bytes)?)),
        Route::PutDrive(id) => {
            let drive: DriveConfig = body(bytes)?;
            if drive.drive_id != id {
                return Err(ActionError::bad_request(format!(
                    "drive_id {:?} in the body does not match {:?} in the path",
                    drive.drive_id, id
                )));
            }
            Ok(VmmAction::PutDrive(drive))
        }
        Route::PutVsock => Ok(VmmAction::PutVsock(body(bytes)?)),
        Route::PutNetworkInterface(id) => {
            let iface: NetworkInterfaceConfig = body(bytes)?;
            if iface.iface_id != id {
                return Err(ActionError::bad_request(format!(
                    "iface_id {:?} in the body does not match {:?} in the path",
                    iface.iface_id, id
                )));
            }
            Ok(VmmAction::PutNetworkInterface(iface))
        }
        Route::PatchNetworkInterface(id) => Err(ActionError::bad_request(format!(
            "PATCH /network-interfaces/{id}: rate limiters are not supported by rollbox-vmm"
        ))),
        Route::PutFs(tag) => {
            let fs: FsConfig = body(bytes)?;
            if fs.tag != tag {
                return Err(ActionError::bad_request(format!(
                    "tag {:?} in the body does not match {:?} in the path",
                    fs.tag, tag
                )));
            }
            Ok(VmmAction::PutFs(fs))
        }
        Route::PutVfio => Ok(VmmAction::PutVfio(body(bytes)?)),
        Route::PutActions => {
            let action: ActionBody = body(bytes)?;
            match ActionType::from_name(&action.action_type) {
                Some(ActionType::InstanceStart) => Ok(VmmAction::InstanceStart),
                Some(ActionType::SendCtrlAltDel) => Ok(VmmAction::SendCtrlAltDel),
                Some(ActionType::FlushMetrics) => Ok(VmmAction::FlushMetrics),
                None => Err(ActionError::bad_request(format!(
                    "unknown action_type {:?}: expected InstanceStart, SendCtrlAltDel or FlushMetrics",
                    action.action_type
                ))),
            }
        }
        Route::PatchVm => {
            let state: VmStateBody = body(bytes)?;
            match VmState::from_name(&state.state) {
                Some(VmState::Paused) => Ok(VmmAction::Pause),
                Some(VmState::Resumed) => Ok(VmmAction::Resume),
                None => Err(ActionError::bad_request(format!(
                    "unknown state {:?}: expected Paused or Resumed",
                    state.state
                ))),
            }
        }
        Route::PutSnapshotCreate => Ok(VmmAction::CreateSnapshot(body(bytes)?)),
        Route::PutSnapshotLoad => Ok(VmmAction::LoadSnapshot(body(bytes)?)),
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
    fn the_load_extension_takes_fs_overrides_and_sockets() {
        let body = br#"{"snapshot_path":"/s/vmstate","rollbox":{"fs_overrides":{"data":"/srv/copy"},"fs_sockets":{"logs":"/run/logs.sock"}}}"#;
        let action = parse_request("PUT", "/snapshot/load", body).expect("load");
        let VmmAction::LoadSnapshot(params) = action else {
            panic!("not a load: {action:?}");
        };
        let extension = params.rollbox.expect("extension");
        assert_eq!(
            extension.fs_overrides.get("data"),
            Some(&std::path::PathBuf::from("/srv/copy"))
        );
        assert_eq!(
            extension.fs_sockets.get("logs"),
            Some(&std::path::PathBuf::from("/run/logs.sock"))
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

    #[test]
    fn refusals_keep_their_words() {
        let refusal = |method, path, body: &[u8]| {
            parse_request(method, path, body)
                .expect_err("refused")
                .message
        };
        assert_eq!(
            refusal("PUT", "/actions", br#"{"action_type":"Reboot"}"#),
            r#"unknown action_type "Reboot": expected InstanceStart, SendCtrlAltDel or FlushMetrics"#
        );
        assert_eq!(
            refusal("PATCH", "/vm", br#"{"state":"paused"}"#),
            r#"unknown state "paused": expected Paused or Resumed"#
        );
        assert_eq!(
            refusal("PATCH", "/network-interfaces/eth0", b""),
            "PATCH /network-interfaces/eth0: rate limiters are not supported by rollbox-vmm"
        );
        assert_eq!(
            refusal("GET", "/nowhere?x=1", b""),
            "invalid request method and/or path: GET /nowhere"
        );
        let fork = refusal("POST", "/fork", br#"{"count":2}"#);
        assert!(
            fork.starts_with("POST /fork: rollbox-vmm's own fork was removed; snapshot with PUT /snapshot/create and \"rollbox\": {\"resume_vm\": true}"),
            "{fork}"
        );
        assert!(refusal("GET", "/fork-pool", b"")
            .starts_with("GET /fork-pool: rollbox-vmm's own fork was removed"));
        assert_eq!(
            refusal("PUT", "/boot-source", b""),
            "the request needs a JSON body"
        );
    }
}
