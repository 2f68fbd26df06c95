//! rollbox-vmm's per-VM API as one typed crate: every body on the wire (Firecracker's JSON
//! names, plus rollbox's extensions), the `--config FILE.json` file, the route table both
//! ends share, and the one blocking client over the VMM's Unix socket. It needs no KVM and no
//! async runtime, so the daemon, the benches and the tests use it as cheaply as the VMM does.
//!
//! - [`machine`]: the resource bodies (`boot-source`, `machine-config`, drives, network
//!   interfaces, vsock, virtio-fs, VFIO) and [`ConfigFile`];
//! - [`snapshot`]: `snapshot/create` and `snapshot/load`;
//! - [`vm`]: `GET /`, `actions`, `PATCH /vm` and the error body;
//! - [`route`]: method and path of each call;
//! - [`client`]: the one client, [`Client`].
//! - [`virtiofsd`]: where the virtiofsd binary is.

pub mod client;
pub mod machine;
pub mod route;
pub mod snapshot;
pub mod virtiofsd;
pub mod vm;

pub use client::{Client, ClientError, Response, DEFAULT_TIMEOUT, MAX_BODY, MAX_HEAD};
pub use machine::{
    BootSourceConfig, ConfigFile, DriveConfig, FsCache, FsConfig, MachineConfig, MachineExtension,
    NetworkInterfaceConfig, VfioDevice, VsockConfig,
};
pub use route::Route;
pub use snapshot::{
    CreateExtension, CreateSnapshotParams, LoadSnapshotParams, MemBackend, NetworkOverride,
    RestoreExtension, ResumedSnapshot, VsockOverride,
};
pub use vm::{ActionBody, ActionType, ErrorBody, VmInfo, VmState, VmStateBody};

#[cfg(test)]
pub(crate) mod tests {
    use std::fmt::Debug;

    use serde::de::DeserializeOwned;
    use serde::Serialize;

    /// `value` is written as exactly `json` (today's bytes on the wire) and read back from it.
    pub(crate) fn assert_wire<T>(value: &T, json: &str)
    where
        T: Serialize + DeserializeOwned + PartialEq + Debug,
    {
        assert_eq!(serde_json::to_string(value).expect("serialize"), json);
        assert_eq!(
            &serde_json::from_str::<T>(json).expect("deserialize"),
            value
        );
    }
}
