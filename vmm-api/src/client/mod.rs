//! The one blocking client of the per-VM API: HTTP/1.1 over the VMM's Unix socket, one
//! request per connection. Typed calls for what the daemon, the benches and the tests ask, and
//! [`Client::request`] for raw (also hostile) bodies. Every call has one deadline, and an
//! answer's head and body are capped as the VMM caps requests. Beside it: what a call gets back
//! and its errors (`answer.rs`), the bytes of one call (`exchange.rs`) and its connect
//! (`connect.rs`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

mod answer;
mod connect;
mod exchange;
#[cfg(test)]
mod test_server;

use crate::route::Route;
use crate::{
    ActionBody, ActionType, BootSourceConfig, CreateExtension, CreateSnapshotParams, DriveConfig,
    FsConfig, LoadSnapshotParams, MachineConfig, NetworkInterfaceConfig, ResumedSnapshot,
    VfioDevice, VmInfo, VmState, VmStateBody, VsockConfig,
};
pub use answer::{ClientError, Response, MAX_BODY, MAX_HEAD};
use exchange::Exchange;

/// A call's deadline unless [`Client::with_timeout`] sets another.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A client of one VMM's API socket. Cheap to clone; it connects afresh for each call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    sock: PathBuf,
    timeout: Duration,
}

impl Client {
    /// A client of the socket at `sock`, with [`DEFAULT_TIMEOUT`] per call.
    pub fn new(sock: impl Into<PathBuf>) -> Client {
        Client {
            sock: sock.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The same client with another deadline per call (connect, send and the whole answer).
    /// [`Duration::MAX`] means none.
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// `GET /`: the instance description; answers once the VM has started.
    pub fn vm_info(&self) -> Result<VmInfo, ClientError> {
        self.query(Route::GetVmInfo)
    }

    /// `GET /machine-config`.
    pub fn machine_config(&self) -> Result<MachineConfig, ClientError> {
        self.query(Route::GetMachineConfig)
    }

    /// `PUT /boot-source`.
    pub fn put_boot_source(&self, boot: &BootSourceConfig) -> Result<(), ClientError> {
        self.call(Route::PutBootSource, boot)
    }

    /// `PUT /machine-config`.
    pub fn put_machine_config(&self, machine: &MachineConfig) -> Result<(), ClientError> {
        self.call(Route::PutMachineConfig, machine)
    }

    /// `PUT /drives/{drive_id}`.
    pub fn put_drive(&self, drive: &DriveConfig) -> Result<(), ClientError> {
        self.call(Route::PutDrive(&drive.drive_id), drive)
    }

    /// `PUT /vsock`.
    pub fn put_vsock(&self, vsock: &VsockConfig) -> Result<(), ClientError> {
        self.call(Route::PutVsock, vsock)
    }

    /// `PUT /network-interfaces/{iface_id}`.
    pub fn put_network_interface(&self, iface: &NetworkInterfaceConfig) -> Result<(), ClientError> {
        self.call(Route::PutNetworkInterface(&iface.iface_id), iface)
    }

    /// `PUT /fs/{tag}` (rollbox extension).
    pub fn put_fs(&self, fs: &FsConfig) -> Result<(), ClientError> {
        self.call(Route::PutFs(&fs.tag), fs)
    }

    /// `PUT /vfio` (rollbox extension).
    pub fn put_vfio(&self, device: &VfioDevice) -> Result<(), ClientError> {
        self.call(Route::PutVfio, device)
    }

    /// `PUT /actions {"action_type": ...}`.
    pub fn action(&self, action: ActionType) -> Result<(), ClientError> {
        self.call(Route::PutActions, &ActionBody::new(action))
    }

    /// `PATCH /vm {"state": ...}`.
    pub fn set_state(&self, state: VmState) -> Result<(), ClientError> {
        self.call(Route::PatchVm, &VmStateBody::new(state))
    }

    /// `PATCH /vm {"state":"Paused"}`.
    pub fn pause(&self) -> Result<(), ClientError> {
        self.set_state(VmState::Paused)
    }

    /// `PATCH /vm {"state":"Resumed"}`.
    pub fn resume(&self) -> Result<(), ClientError> {
        self.set_state(VmState::Resumed)
    }

    /// `PUT /snapshot/create`; the VM must be paused.
    pub fn create_snapshot(&self, params: &CreateSnapshotParams) -> Result<(), ClientError> {
        self.call(Route::PutSnapshotCreate, params)
    }

    /// `PUT /snapshot/create` of a Full snapshot with `"rollbox": {"resume_vm": true}` (set
    /// here): the paused VM runs again once its memory is imaged; answers once the memory
    /// file is written, with how long the VM was paused.
    pub fn create_snapshot_resuming(
        &self,
        params: &CreateSnapshotParams,
    ) -> Result<ResumedSnapshot, ClientError> {
        let mut params = params.clone();
        params.rollbox = Some(CreateExtension { resume_vm: true });
        let answer = self.send(Route::PutSnapshotCreate, Some(&params))?;
        self.decode(&Route::PutSnapshotCreate.call(), &answer)
    }

    /// `PUT /snapshot/load`, into a VMM that has not started a VM.
    pub fn load_snapshot(&self, params: &LoadSnapshotParams) -> Result<(), ClientError> {
        self.call(Route::PutSnapshotLoad, params)
    }

    /// One raw request: any method, path and body (sent as it is, with its Content-Length).
    /// Every status comes back as a [`Response`]; only what stops an answer is an error.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<Response, ClientError> {
        let call = format!("{method} {path}");
        let bad = |detail: &str| ClientError::BadRequest {
            sock: self.sock.clone(),
            call: call.clone(),
            detail: detail.into(),
        };
        let breaks_the_line =
            |s: &str| s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control());
        if breaks_the_line(method) {
            return Err(bad(
                "the method is empty or has spaces or control characters",
            ));
        }
        if breaks_the_line(path) {
            return Err(bad("the path is empty or has spaces or control characters"));
        }
        let body = body.unwrap_or_default();
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(body);
        let response = Exchange::new(&self.sock, &call, self.timeout).run(&request)?;
        log::debug!(
            "VMM API {}: {call}: {}",
            self.sock.display(),
            response.status
        );
        Ok(response)
    }

    /// Sends a typed call; anything but 2xx is [`ClientError::Refused`].
    fn send<B: Serialize>(&self, route: Route, body: Option<&B>) -> Result<Response, ClientError> {
        let call = route.call();
        let body =
            body.map(serde_json::to_vec)
                .transpose()
                .map_err(|source| ClientError::Encode {
                    sock: self.sock.clone(),
                    call: call.clone(),
                    source,
                })?;
        let response = self.request(route.method(), &route.path(), body.as_deref())?;
        if !response.is_success() {
            return Err(ClientError::Refused {
                sock: self.sock.clone(),
                call,
                status: response.status,
                message: response.fault_message(),
            });
        }
        Ok(response)
    }

    /// A call without a body whose answer is a `T`.
    fn query<T: DeserializeOwned>(&self, route: Route) -> Result<T, ClientError> {
        let answer = self.send::<()>(route, None)?;
        self.decode(&route.call(), &answer)
    }

    /// A call with a body whose answer has none.
    fn call<B: Serialize>(&self, route: Route, body: &B) -> Result<(), ClientError> {
        self.send(route, Some(body)).map(drop)
    }

    fn decode<T: DeserializeOwned>(&self, call: &str, answer: &Response) -> Result<T, ClientError> {
        serde_json::from_slice(&answer.body).map_err(|source| ClientError::Decode {
            sock: self.sock.clone(),
            call: call.into(),
            body: answer.text(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::test_server::{joined, reply, serve};
    use super::*;

    #[test]
    fn a_typed_put_sends_todays_bytes_and_takes_a_204() {
        let server = serve(reply(
            "HTTP/1.1 204 No Content\r\nServer: rollbox-vmm\r\nContent-Length: 0\r\n\r\n",
        ));
        let drive = DriveConfig {
            is_root_device: true,
            ..DriveConfig::new("rootfs", "/r.img")
        };
        Client::new(&server.sock).put_drive(&drive).expect("put");
        let body = r#"{"drive_id":"rootfs","path_on_host":"/r.img","is_root_device":true,"is_read_only":false}"#;
        assert_eq!(
            joined(server),
            format!(
                "PUT /drives/rootfs HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        );
    }

    #[test]
    fn pause_and_a_typed_answer() {
        let server = serve(reply(
            "HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
        ));
        Client::new(&server.sock).pause().expect("pause");
        assert!(joined(server).starts_with("PATCH /vm HTTP/1.1\r\n"));
        let body = r#"{"id":"anonymous-instance","state":"Running","vmm_version":"0.1.0","app_name":"rollbox-vmm"}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\nServer: rollbox-vmm\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let server = serve(move |stream, _| stream.write_all(answer.as_bytes()).expect("write"));
        let info = Client::new(&server.sock).vm_info().expect("info");
        assert_eq!(info.state, "Running");
        assert!(joined(server).starts_with("GET / HTTP/1.1\r\n"));
    }

    #[test]
    fn a_refusal_names_the_socket_the_call_and_the_fault() {
        let server = serve(reply(
            "HTTP/1.1 400 Bad Request\r\nContent-Length: 37\r\n\r\n{\"fault_message\":\"no kernel, no VM.\"}",
        ));
        let err = Client::new(&server.sock)
            .action(ActionType::InstanceStart)
            .expect_err("refused");
        assert_eq!(err.status(), Some(400));
        let text = err.to_string();
        assert!(text.contains(&server.sock.display().to_string()), "{text}");
        assert!(
            text.contains("PUT /actions: 400 no kernel, no VM."),
            "{text}"
        );
        assert!(joined(server).ends_with(r#"{"action_type":"InstanceStart"}"#));
    }

    #[test]
    fn raw_requests_send_any_body_and_return_any_status() {
        let server = serve(reply(
            "HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}",
        ));
        let response = Client::new(&server.sock)
            .request("PUT", "/actions", Some(b"{\xff"))
            .expect("answer");
        assert_eq!(
            (response.status, response.body.as_slice()),
            (400, &b"{}"[..])
        );
        let sent = server.thread.join().expect("server");
        assert!(
            sent.ends_with(b"Content-Length: 2\r\n\r\n{\xff"),
            "{sent:?}"
        );
        let err = Client::new("/nonexistent/api.sock")
            .request("GET", "/ x", None)
            .expect_err("space in the path");
        assert!(matches!(err, ClientError::BadRequest { .. }), "{err}");
        let err = Client::new("/nonexistent/api.sock")
            .request("GET", "/\r\nX: 1", None)
            .expect_err("CRLF in the path");
        assert!(matches!(err, ClientError::BadRequest { .. }), "{err}");
    }

    #[test]
    fn nothing_listening_is_a_connect_error_naming_the_socket() {
        let err = Client::new("/nonexistent/api.sock")
            .vm_info()
            .expect_err("no socket");
        assert!(err.is_connect(), "{err}");
        assert!(
            err.to_string()
                .contains("/nonexistent/api.sock: GET /: cannot connect"),
            "{err}"
        );
    }
}
