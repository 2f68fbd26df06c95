//! The fork bodies (rollbox extensions): `POST /fork` and its answer, and `GET /fork-pool`'s.

use serde::{Deserialize, Serialize};

use crate::snapshot::NetworkOverride;

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

/// `GET /fork-pool` answer: how far a pool's shells are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPoolStatus {
    /// Shells the pool keeps.
    pub target: usize,
    /// Shells that have built their empty VM.
    pub ready: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::assert_wire;

    #[test]
    fn fork_params() {
        let minimal: ForkParams = serde_json::from_str(r#"{"count":3}"#).expect("parse");
        assert_wire(&minimal, r#"{"count":3,"new_generation":true}"#);
        let full = ForkParams {
            count: 2,
            dir: Some("/f".into()),
            new_generation: false,
            restore_backend: Some("uffd".into()),
            network_overrides: vec![
                vec![NetworkOverride {
                    iface_id: "eth0".into(),
                    host_dev_name: "tap1".into(),
                    guest_mac: None,
                }],
                vec![NetworkOverride {
                    iface_id: "eth0".into(),
                    host_dev_name: "tap2".into(),
                    guest_mac: None,
                }],
            ],
        };
        assert_wire(
            &full,
            r#"{"count":2,"dir":"/f","new_generation":false,"restore_backend":"uffd","network_overrides":[[{"iface_id":"eth0","host_dev_name":"tap1"}],[{"iface_id":"eth0","host_dev_name":"tap2"}]]}"#,
        );
        let err = serde_json::from_str::<ForkParams>(r#"{"count":1,"clones":1}"#)
            .expect_err("unknown field");
        assert!(err.to_string().contains("clones"), "{err}");
    }

    #[test]
    fn fork_answers() {
        let result = ForkResult {
            snapshot_dir: "/f".into(),
            paused_ms: 1.5,
            elapsed_ms: 20.25,
            clones: vec![
                CloneInfo {
                    index: 0,
                    pid: Some(4242),
                    api_sock: "/f/0/api.sock".into(),
                    vsock_uds: Some("/f/0/v.sock".into()),
                    console: "/f/0/console.log".into(),
                    error: None,
                },
                CloneInfo {
                    index: 1,
                    pid: None,
                    api_sock: "/f/1/api.sock".into(),
                    vsock_uds: None,
                    console: "/f/1/console.log".into(),
                    error: Some("restore failed".into()),
                },
            ],
        };
        assert_wire(
            &result,
            concat!(
                r#"{"snapshot_dir":"/f","paused_ms":1.5,"elapsed_ms":20.25,"clones":["#,
                r#"{"index":0,"pid":4242,"api_sock":"/f/0/api.sock","vsock_uds":"/f/0/v.sock","console":"/f/0/console.log","error":null},"#,
                r#"{"index":1,"pid":null,"api_sock":"/f/1/api.sock","vsock_uds":null,"console":"/f/1/console.log","error":"restore failed"}]}"#
            ),
        );
        assert_wire(
            &ForkPoolStatus {
                target: 2,
                ready: 1,
            },
            r#"{"target":2,"ready":1}"#,
        );
    }
}
