//! The per-VM control API. Where rollbox-vmm and Firecracker share an operation it speaks
//! Firecracker's REST API: same paths, same bodies. Requests become one typed [`VmmAction`];
//! the HTTP layer ([`http`], [`server`]) only moves bytes.

pub mod http;
pub mod server;

use serde::{Deserialize, Serialize};

use crate::config::{BootSourceConfig, DriveConfig, MachineConfig, VsockConfig};

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
}

/// What a successful action returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmData {
    /// 204 No Content.
    Empty,
    /// `GET /` body.
    VmInfo(VmInfo),
    /// `GET /machine-config` body.
    MachineConfig(MachineConfig),
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
        let e = parse_request("DELETE", "/vm", b"").expect_err("method");
        assert!(e.message.contains("invalid request method"));
        let e = parse_request("PUT", "/actions", b"{").expect_err("json");
        assert!(e.message.contains("invalid JSON"));
    }
}
