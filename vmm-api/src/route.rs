//! The route table of the per-VM API: which method and path a request has, and so which body
//! it carries. The VMM's server parses requests with [`Route::parse`] and the client builds
//! them with [`Route::method`] and [`Route::path`], so the two cannot disagree.

/// One route. The body each takes (or answers with) is named on the variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'a> {
    /// `GET /`: answers [`crate::VmInfo`].
    GetVmInfo,
    /// `GET /machine-config`: answers [`crate::MachineConfig`].
    GetMachineConfig,
    /// `PUT /boot-source` with [`crate::BootSourceConfig`].
    PutBootSource,
    /// `PUT /machine-config` with [`crate::MachineConfig`].
    PutMachineConfig,
    /// `PUT /drives/{drive_id}` with [`crate::DriveConfig`] (the same `drive_id`).
    PutDrive(&'a str),
    /// `PUT /vsock` with [`crate::VsockConfig`].
    PutVsock,
    /// `PUT /network-interfaces/{iface_id}` with [`crate::NetworkInterfaceConfig`].
    PutNetworkInterface(&'a str),
    /// `PATCH /network-interfaces/{iface_id}` (Firecracker's rate limiters; refused).
    PatchNetworkInterface(&'a str),
    /// `PUT /fs/{tag}` with [`crate::FsConfig`] (rollbox extension).
    PutFs(&'a str),
    /// `PUT /vfio` with [`crate::VfioDevice`] (rollbox extension).
    PutVfio,
    /// `PUT /actions` with [`crate::ActionBody`].
    PutActions,
    /// `PATCH /vm` with [`crate::VmStateBody`].
    PatchVm,
    /// `PUT /snapshot/create` with [`crate::CreateSnapshotParams`].
    PutSnapshotCreate,
    /// `PUT /snapshot/load` with [`crate::LoadSnapshotParams`].
    PutSnapshotLoad,
}

impl<'a> Route<'a> {
    /// The route of a request, if it has one. A query string is ignored, and so are empty
    /// path segments (`//drives/a/` is `/drives/a`).
    pub fn parse(method: &str, path: &'a str) -> Option<Route<'a>> {
        let path = path.split('?').next().unwrap_or(path);
        let segments: Vec<&'a str> = path
            .trim_matches('/')
            .split('/')
            .filter(|s| !s.is_empty())
            .collect();
        Some(match (method, segments.as_slice()) {
            ("GET", []) => Route::GetVmInfo,
            ("GET", ["machine-config"]) => Route::GetMachineConfig,
            ("PUT", ["boot-source"]) => Route::PutBootSource,
            ("PUT", ["machine-config"]) => Route::PutMachineConfig,
            ("PUT", ["drives", id]) => Route::PutDrive(id),
            ("PUT", ["vsock"]) => Route::PutVsock,
            ("PUT", ["network-interfaces", id]) => Route::PutNetworkInterface(id),
            ("PATCH", ["network-interfaces", id]) => Route::PatchNetworkInterface(id),
            ("PUT", ["fs", tag]) => Route::PutFs(tag),
            ("PUT", ["vfio"]) => Route::PutVfio,
            ("PUT", ["actions"]) => Route::PutActions,
            ("PATCH", ["vm"]) => Route::PatchVm,
            ("PUT", ["snapshot", "create"]) => Route::PutSnapshotCreate,
            ("PUT", ["snapshot", "load"]) => Route::PutSnapshotLoad,
            _ => return None,
        })
    }

    /// The request method.
    pub fn method(&self) -> &'static str {
        match self {
            Route::GetVmInfo | Route::GetMachineConfig => "GET",
            Route::PatchNetworkInterface(_) | Route::PatchVm => "PATCH",
            Route::PutBootSource
            | Route::PutMachineConfig
            | Route::PutDrive(_)
            | Route::PutVsock
            | Route::PutNetworkInterface(_)
            | Route::PutFs(_)
            | Route::PutVfio
            | Route::PutActions
            | Route::PutSnapshotCreate
            | Route::PutSnapshotLoad => "PUT",
        }
    }

    /// The request path (an ID is put in as it is: the client refuses paths that would
    /// break the request line).
    pub fn path(&self) -> String {
        match self {
            Route::GetVmInfo => "/".into(),
            Route::GetMachineConfig | Route::PutMachineConfig => "/machine-config".into(),
            Route::PutBootSource => "/boot-source".into(),
            Route::PutDrive(id) => format!("/drives/{id}"),
            Route::PutVsock => "/vsock".into(),
            Route::PutNetworkInterface(id) | Route::PatchNetworkInterface(id) => {
                format!("/network-interfaces/{id}")
            }
            Route::PutFs(tag) => format!("/fs/{tag}"),
            Route::PutVfio => "/vfio".into(),
            Route::PutActions => "/actions".into(),
            Route::PatchVm => "/vm".into(),
            Route::PutSnapshotCreate => "/snapshot/create".into(),
            Route::PutSnapshotLoad => "/snapshot/load".into(),
        }
    }

    /// `METHOD /path`, as errors name a call.
    pub fn call(&self) -> String {
        format!("{} {}", self.method(), self.path())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Route<'static>; 14] = [
        Route::GetVmInfo,
        Route::GetMachineConfig,
        Route::PutBootSource,
        Route::PutMachineConfig,
        Route::PutDrive("rootfs"),
        Route::PutVsock,
        Route::PutNetworkInterface("eth0"),
        Route::PatchNetworkInterface("eth0"),
        Route::PutFs("data"),
        Route::PutVfio,
        Route::PutActions,
        Route::PatchVm,
        Route::PutSnapshotCreate,
        Route::PutSnapshotLoad,
    ];

    #[test]
    fn every_route_parses_back_from_its_method_and_path() {
        for route in ALL {
            let path = route.path();
            assert_eq!(Route::parse(route.method(), &path), Some(route), "{path}");
        }
    }

    #[test]
    fn paths_are_firecrackers() {
        let calls: Vec<String> = ALL.iter().map(Route::call).collect();
        assert_eq!(
            calls,
            [
                "GET /",
                "GET /machine-config",
                "PUT /boot-source",
                "PUT /machine-config",
                "PUT /drives/rootfs",
                "PUT /vsock",
                "PUT /network-interfaces/eth0",
                "PATCH /network-interfaces/eth0",
                "PUT /fs/data",
                "PUT /vfio",
                "PUT /actions",
                "PATCH /vm",
                "PUT /snapshot/create",
                "PUT /snapshot/load",
            ]
        );
    }

    #[test]
    fn queries_and_empty_segments_are_ignored_and_the_rest_is_refused() {
        assert_eq!(
            Route::parse("PUT", "//drives//a/?x=1"),
            Some(Route::PutDrive("a"))
        );
        assert_eq!(Route::parse("GET", "?"), Some(Route::GetVmInfo));
        for (method, path) in [
            ("DELETE", "/vm"),
            ("GET", "/vm"),
            ("PUT", "/drives"),
            ("PUT", "/drives/a/b"),
            ("put", "/actions"),
            ("POST", "/snapshot/other"),
            ("POST", "/fork"),
        ] {
            assert_eq!(Route::parse(method, path), None, "{method} {path}");
        }
    }
}
