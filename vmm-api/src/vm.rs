//! The instance's own bodies: `GET /` (its description), `PUT /actions`, `PATCH /vm`, and the
//! error body every refusal carries (Firecracker's `fault_message`).

use serde::{Deserialize, Serialize};

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

/// What `PUT /actions` can ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionType {
    /// Boot the configured microVM.
    InstanceStart,
    /// Press Ctrl+Alt+Del (the guest reboots, which ends the VM).
    SendCtrlAltDel,
    /// Accepted for Firecracker's sake; rollbox-vmm keeps no metrics file.
    FlushMetrics,
}

impl ActionType {
    /// Every action, in the order refusals list them.
    pub const ALL: [ActionType; 3] = [
        ActionType::InstanceStart,
        ActionType::SendCtrlAltDel,
        ActionType::FlushMetrics,
    ];

    /// The `action_type` value on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionType::InstanceStart => "InstanceStart",
            ActionType::SendCtrlAltDel => "SendCtrlAltDel",
            ActionType::FlushMetrics => "FlushMetrics",
        }
    }

    /// The action an `action_type` value names, if any.
    pub fn from_name(name: &str) -> Option<ActionType> {
        Self::ALL.into_iter().find(|a| a.as_str() == name)
    }
}

/// `PUT /actions` body. The value stays a string so that the VMM, not serde, words the
/// refusal of an unknown one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionBody {
    /// "InstanceStart", "SendCtrlAltDel" or "FlushMetrics".
    pub action_type: String,
}

impl ActionBody {
    /// The body asking for `action`.
    pub fn new(action: ActionType) -> Self {
        Self {
            action_type: action.as_str().into(),
        }
    }
}

/// The states `PATCH /vm` can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// Stop the vCPUs.
    Paused,
    /// Run them again.
    Resumed,
}

impl VmState {
    /// The `state` value on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Paused => "Paused",
            VmState::Resumed => "Resumed",
        }
    }

    /// The state a `state` value names, if any.
    pub fn from_name(name: &str) -> Option<VmState> {
        [VmState::Paused, VmState::Resumed]
            .into_iter()
            .find(|s| s.as_str() == name)
    }
}

/// `PATCH /vm` body; like [`ActionBody`], the value stays a string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStateBody {
    /// "Paused" or "Resumed".
    pub state: String,
}

impl VmStateBody {
    /// The body asking for `state`.
    pub fn new(state: VmState) -> Self {
        Self {
            state: state.as_str().into(),
        }
    }
}

/// The body of every refusal (any status but 2xx), as Firecracker words it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Why the request was refused.
    pub fault_message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_info_is_firecrackers() {
        let info = VmInfo {
            id: "anonymous-instance".into(),
            state: "Running".into(),
            vmm_version: "0.1.0".into(),
            app_name: "rollbox-vmm".into(),
        };
        let json = r#"{"id":"anonymous-instance","state":"Running","vmm_version":"0.1.0","app_name":"rollbox-vmm"}"#;
        assert_eq!(serde_json::to_string(&info).expect("json"), json);
        assert_eq!(serde_json::from_str::<VmInfo>(json).expect("parse"), info);
    }

    #[test]
    fn actions_and_states_on_the_wire() {
        for (action, json) in [
            (
                ActionType::InstanceStart,
                r#"{"action_type":"InstanceStart"}"#,
            ),
            (
                ActionType::SendCtrlAltDel,
                r#"{"action_type":"SendCtrlAltDel"}"#,
            ),
            (
                ActionType::FlushMetrics,
                r#"{"action_type":"FlushMetrics"}"#,
            ),
        ] {
            let body = ActionBody::new(action);
            assert_eq!(serde_json::to_string(&body).expect("json"), json);
            let parsed: ActionBody = serde_json::from_str(json).expect("parse");
            assert_eq!(ActionType::from_name(&parsed.action_type), Some(action));
        }
        assert_eq!(ActionType::from_name("Reboot"), None);
        for (state, json) in [
            (VmState::Paused, r#"{"state":"Paused"}"#),
            (VmState::Resumed, r#"{"state":"Resumed"}"#),
        ] {
            let body = VmStateBody::new(state);
            assert_eq!(serde_json::to_string(&body).expect("json"), json);
            let parsed: VmStateBody = serde_json::from_str(json).expect("parse");
            assert_eq!(VmState::from_name(&parsed.state), Some(state));
        }
        assert_eq!(VmState::from_name("paused"), None);
        let extra = serde_json::from_str::<VmStateBody>(r#"{"state":"Paused","x":1}"#);
        assert!(extra.is_err(), "unknown fields are refused");
    }

    #[test]
    fn the_error_body_is_a_fault_message() {
        let body = ErrorBody {
            fault_message: "no kernel configured".into(),
        };
        let json = r#"{"fault_message":"no kernel configured"}"#;
        assert_eq!(serde_json::to_string(&body).expect("json"), json);
        assert_eq!(
            serde_json::from_str::<ErrorBody>(json).expect("parse"),
            body
        );
    }
}
