//! Snapshot state of a network interface: its ID, tap and MAC. A restore reopens the tap, or
//! the one `network_overrides` names, with that override's MAC if it gives one.

use serde::{Deserialize, Serialize};
use snapshot::Persist;

use super::mac::parse_mac;
use super::tap::{check_name, AttachedTaps};
use super::{Net, NetConfig, NetError};

/// What a snapshot records of a network interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetPersistState {
    /// Interface ID.
    pub iface_id: String,
    /// Host tap at snapshot time.
    pub host_dev_name: String,
    /// The MAC the guest was told.
    pub guest_mac: Option<[u8; 6]>,
}

/// A network interface's new host side at restore time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetOverride {
    /// The tap.
    pub host_dev_name: String,
    /// A new MAC for the device to report (a clone's; the guest's agent applies it).
    pub guest_mac: Option<[u8; 6]>,
}

impl NetOverride {
    /// Checks the tap name and the MAC, if any.
    pub fn new(host_dev_name: &str, guest_mac: Option<&str>) -> Result<Self, String> {
        check_name(host_dev_name).map_err(|e| e.to_string())?;
        let guest_mac = guest_mac
            .map(parse_mac)
            .transpose()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            host_dev_name: host_dev_name.into(),
            guest_mac,
        })
    }

    /// Parses `TAP[,mac=MAC]` (the `--net-override ID=` value).
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut parts = value.split(',');
        let tap = parts.next().unwrap_or_default();
        let mut guest_mac = None;
        for part in parts {
            match part.split_once('=') {
                Some(("mac", mac)) => guest_mac = Some(mac),
                _ => return Err(format!("{part:?}: expected mac=MAC")),
            }
        }
        Self::new(tap, guest_mac)
    }
}

/// What a restore may change about a network interface.
#[derive(Debug, Clone, Default)]
pub struct NetRestoreArgs {
    /// Another tap (and maybe MAC), else the recorded ones.
    pub host: Option<NetOverride>,
    /// Taps the caller attached already ([`AttachedTaps`]).
    pub taps: AttachedTaps,
}

impl Persist for Net {
    type State = NetPersistState;
    type ConstructorArgs = NetRestoreArgs;
    type Error = NetError;

    fn save(&self) -> Result<NetPersistState, NetError> {
        Ok(NetPersistState {
            iface_id: self.config.iface_id.clone(),
            host_dev_name: self.config.host_dev_name.clone(),
            guest_mac: self.config.guest_mac,
        })
    }

    fn restore(args: NetRestoreArgs, state: &NetPersistState) -> Result<Self, NetError> {
        let taps = args.taps.clone();
        Net::new(restore_config(args, state), &taps)
    }
}

/// The interface a restore opens: the override's tap and MAC over the recorded ones.
fn restore_config(args: NetRestoreArgs, state: &NetPersistState) -> NetConfig {
    let over = args.host;
    NetConfig {
        iface_id: state.iface_id.clone(),
        host_dev_name: over
            .as_ref()
            .map(|o| o.host_dev_name.clone())
            .unwrap_or_else(|| state.host_dev_name.clone()),
        guest_mac: over.and_then(|o| o.guest_mac).or(state.guest_mac),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_override_gives_the_tap_and_the_mac_it_names() {
        let state = NetPersistState {
            iface_id: "eth0".into(),
            host_dev_name: "tap0".into(),
            guest_mac: Some([2, 0, 0, 0, 0, 1]),
        };
        let same = restore_config(NetRestoreArgs::default(), &state);
        assert_eq!(
            (same.host_dev_name.as_str(), same.guest_mac),
            ("tap0", state.guest_mac)
        );
        let tap_only = NetRestoreArgs {
            host: Some(NetOverride::parse("tap1").expect("tap")),
            ..Default::default()
        };
        let moved = restore_config(tap_only, &state);
        assert_eq!(
            (moved.host_dev_name.as_str(), moved.guest_mac),
            ("tap1", state.guest_mac)
        );
        let both = NetRestoreArgs {
            host: Some(NetOverride::parse("tap2,mac=02:00:00:00:00:09").expect("tap and mac")),
            ..Default::default()
        };
        let clone = restore_config(both, &state);
        assert_eq!(
            (clone.iface_id.as_str(), clone.guest_mac),
            ("eth0", Some([2, 0, 0, 0, 0, 9]))
        );
        assert!(NetOverride::parse("tap3,ip=1").is_err());
    }
}
