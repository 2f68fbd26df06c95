//! The API socket thread: accepts connections, parses requests into [`VmmAction`]s, hands
//! them to the VMM's event loop and writes the answers back.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::http::{write_response, HttpError, RequestReader};
use super::{parse_request, ActionError, ActionResult, VmmAction, VmmData};

/// A request for the VMM thread, with where to send the answer.
pub type ApiRequest = (VmmAction, Sender<ActionResult>);

/// Errors from starting the API server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket path exists.
    #[error("API socket {0} already exists (in use, or left over: remove it)")]
    PathInUse(PathBuf),
    /// Binding failed.
    #[error("API socket {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The thread could not start.
    #[error("cannot start the API thread: {0}")]
    Thread(std::io::Error),
}

/// Removes the socket file when dropped.
pub struct SocketGuard(PathBuf);

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.0) {
            log::debug!("removing {}: {e}", self.0.display());
        }
    }
}

/// Binds the API socket (refusing an existing path) and serves it on a thread.
pub fn start(
    path: &Path,
    to_vmm: Sender<ApiRequest>,
    wake: Arc<EventFd>,
) -> Result<SocketGuard, ServerError> {
    if path.symlink_metadata().is_ok() {
        return Err(ServerError::PathInUse(path.to_path_buf()));
    }
    let listener = UnixListener::bind(path).map_err(|source| ServerError::Bind {
        path: path.to_path_buf(),
        source,
    })?;
    let guard = SocketGuard(path.to_path_buf());
    crate::seccomp::spawn_filtered("api".into(), crate::seccomp::ThreadKind::Api, move || {
        for stream in listener.incoming() {
            match stream {
                Ok(stream) => {
                    let to_vmm = to_vmm.clone();
                    let wake = Arc::clone(&wake);
                    let spawned = std::thread::Builder::new()
                        .name("api-conn".into())
                        .spawn(move || serve_connection(stream, &to_vmm, &wake));
                    if let Err(e) = spawned {
                        log::error!("API: cannot start a connection thread: {e}");
                    }
                }
                Err(e) => log::warn!("API: accept failed: {e}"),
            }
        }
    })
    .map_err(ServerError::Thread)?;
    Ok(guard)
}

fn serve_connection(stream: UnixStream, to_vmm: &Sender<ApiRequest>, wake: &EventFd) {
    let mut out = match stream.try_clone() {
        Ok(out) => out,
        Err(e) => {
            log::warn!("API: cannot clone a connection: {e}");
            return;
        }
    };
    let mut reader = RequestReader::new(stream);
    loop {
        let request = match reader.next_request() {
            Ok(r) => r,
            Err(HttpError::Closed) => return,
            Err(e) => {
                let _ = respond(&mut out, Err(ActionError::bad_request(e.to_string())));
                return;
            }
        };
        let result = match parse_request(&request.method, &request.path, &request.body) {
            Ok(action) => dispatch(action, to_vmm, wake),
            Err(e) => Err(e),
        };
        if let Err(e) = &result {
            log::info!(
                "API: {} {} refused: {}",
                request.method,
                request.path,
                e.message
            );
        }
        if respond(&mut out, result).is_err() {
            return;
        }
    }
}

fn dispatch(action: VmmAction, to_vmm: &Sender<ApiRequest>, wake: &EventFd) -> ActionResult {
    let (reply_tx, reply_rx) = channel();
    let gone = || ActionError {
        status: 500,
        message: "the VMM is shutting down".into(),
    };
    to_vmm.send((action, reply_tx)).map_err(|_| gone())?;
    wake.write(1).map_err(|_| gone())?;
    reply_rx.recv().map_err(|_| gone())?
}

fn respond(out: &mut impl Write, result: ActionResult) -> std::io::Result<()> {
    match result {
        Ok(VmmData::Empty) => write_response(out, 204, None),
        Ok(VmmData::VmInfo(info)) => write_response(out, 200, Some(&json(&info))),
        Ok(VmmData::MachineConfig(m)) => write_response(out, 200, Some(&json(&m))),
        Ok(VmmData::ResumedSnapshot(r)) => write_response(out, 200, Some(&json(&r))),
        Err(e) => write_response(
            out,
            e.status,
            Some(&json(&vmm_api::ErrorBody {
                fault_message: e.message,
            })),
        ),
    }
}

fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value)
        .unwrap_or_else(|e| format!("{{\"fault_message\":\"serialization: {e}\"}}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::VmInfo;

    fn answer(result: ActionResult) -> String {
        let mut out = Vec::new();
        respond(&mut out, result).expect("write");
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn answers_carry_vmm_api_bodies() {
        assert_eq!(
            answer(Err(ActionError::bad_request("no kernel"))),
            "HTTP/1.1 400 Bad Request\r\nServer: rollbox-vmm\r\nContent-Type: application/json\r\nContent-Length: 29\r\n\r\n{\"fault_message\":\"no kernel\"}"
        );
        assert_eq!(
            answer(Ok(VmmData::Empty)),
            "HTTP/1.1 204 No Content\r\nServer: rollbox-vmm\r\nContent-Length: 0\r\n\r\n"
        );
        // The VM's information goes out as vmm_api's JSON.
        let info = VmInfo {
            id: "anonymous-instance".into(),
            state: "Paused".into(),
            vmm_version: "0.1.0".into(),
            app_name: "rollbox-vmm".into(),
        };
        let answered = answer(Ok(VmmData::VmInfo(info.clone())));
        let body = answered.split("\r\n\r\n").nth(1).expect("body");
        let read: VmInfo = serde_json::from_str(body).expect("vmm_api type");
        assert_eq!(read, info);
    }
}
