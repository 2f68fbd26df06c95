//! Guest access: requests that go through the sandbox's guest agent, over its vsock Unix
//! socket (`CONNECT 1024`), one agent connection per request: exec (`exec.rs`), files
//! (`files.rs`), guest TCP ports, and the commands a template runs after a boot (`boot.rs`).
//! The agent's types stop here: what goes back is the API's.
//!
//! Deadlines: connecting, the handshake and every call without a timeout of its own end after
//! the daemon's agent timeout (`--agent-timeout`) with an error naming the sandbox; a user's
//! exec is bounded by its own `timeout_ms` only. Backpressure: each request has its own
//! connection, so the client runs without a stall timeout: a caller that stops reading stops
//! that connection's reader, and the guest is held back by vsock credit, nothing else waits.

mod boot;
mod exec;
mod files;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rollbox_agent_protocol::client::{AgentClient, ClientError, ClientOptions};
use rollbox_agent_protocol::DEFAULT_PORT;

use super::api::{ApiError, BodyTooLarge, ExitInfo, FileInfo, FileKind, State, MAX_UPLOAD};
use super::store::Db;
use super::supervisor::jaildir::SocketPath;
use super::supervisor::vm;
use super::util::touch;

/// Processes of running streaming execs: (sandbox id, pid) → the agent connection, the
/// exec's request id (where the agent takes signals and stdin for it), and whether its stdin
/// is open for writes.
type Processes = HashMap<(String, u32), (AgentClient, u64, bool)>;

/// The sandboxes' guest agents.
pub struct Guest {
    db: Arc<Db>,
    /// Test-only (`--test-agent-socket`): every sandbox's agent traffic goes here.
    test_agent_socket: Option<PathBuf>,
    processes: Arc<Mutex<Processes>>,
    /// `--agent-timeout`.
    timeout: Duration,
}

/// The agent's exit status as the API shows it.
fn exit_info(status: &rollbox_agent_protocol::messages::ExitStatus) -> ExitInfo {
    ExitInfo {
        exit_code: status.code,
        signal: status.signal,
        timed_out: status.timed_out,
        oom: status.oom_killed,
        truncated: status.truncated,
        duration_ms: status.duration_ms,
    }
}

/// The agent's file info as the API shows it.
fn file_info(info: rollbox_agent_protocol::messages::FileInfo) -> FileInfo {
    use rollbox_agent_protocol::messages::FileKind as Agent;
    FileInfo {
        name: info.name,
        path: info.path,
        kind: match info.kind {
            Agent::File => FileKind::File,
            Agent::Dir => FileKind::Dir,
            Agent::Symlink => FileKind::Symlink,
            Agent::Other => FileKind::Other,
        },
        size: info.size,
        mode: info.mode,
        uid: info.uid,
        gid: info.gid,
        mtime_ns: info.mtime_ns,
        link_target: info.link_target,
    }
}

/// An agent failure as an API error: the agent's errno decides the status.
fn agent_error(id: &str, error: ClientError) -> ApiError {
    match error {
        ClientError::Agent(info) => match info.code.as_str() {
            "ENOENT" => ApiError::NotFound(info.message),
            "EEXIST" | "ENOTEMPTY" => ApiError::Conflict(info.message),
            "bad_request" | "EINVAL" | "EISDIR" | "ENOTDIR" | "ENAMETOOLONG" | "EACCES"
            | "EPERM" | "ELOOP" | "unknown_request" => ApiError::BadRequest(info.message),
            _ => ApiError::Internal(format!("sandbox {id}: {}", info.message)),
        },
        ClientError::Source(io) if io.get_ref().is_some_and(|inner| inner.is::<BodyTooLarge>()) => {
            ApiError::TooLarge(MAX_UPLOAD)
        }
        ClientError::Source(io) => ApiError::BadRequest(format!("reading the request body: {io}")),
        ClientError::Timeout { what, after } => ApiError::Unavailable(format!(
            "sandbox {id}: the agent did not answer {what} within {} s",
            seconds(after)
        )),
        other => ApiError::Unavailable(format!("sandbox {id}: the agent: {other}")),
    }
}

/// A duration in seconds for messages (fractions for the short timeouts tests use).
fn seconds(after: Duration) -> String {
    if after.subsec_millis() == 0 {
        after.as_secs().to_string()
    } else {
        format!("{:.1}", after.as_secs_f64())
    }
}

impl Guest {
    pub fn new(db: Arc<Db>, test_agent_socket: Option<PathBuf>, timeout: Duration) -> Guest {
        Guest {
            db,
            test_agent_socket,
            processes: Arc::new(Mutex::new(HashMap::new())),
            timeout,
        }
    }

    /// The agent connections' deadlines; no stall timeout (one connection per request).
    pub(super) fn client_options(&self) -> ClientOptions {
        ClientOptions {
            connect_timeout: Some(self.timeout),
            call_timeout: Some(self.timeout),
            stall_timeout: None,
        }
    }

    /// The agent socket of a running sandbox (through a checked descriptor: see
    /// `supervisor::jaildir`).
    pub fn agent_socket(&self, id: &str) -> Result<SocketPath, ApiError> {
        let sandbox = touch(&self.db, id)?;
        match sandbox.state {
            State::Running => {}
            State::Paused => {
                return Err(ApiError::Conflict(format!(
                    "sandbox {id} is paused; resume it first"
                )))
            }
            other => {
                return Err(ApiError::Conflict(format!(
                    "sandbox {id} is {}, not running",
                    other.as_str()
                )))
            }
        }
        match &self.test_agent_socket {
            Some(path) => Ok(SocketPath::host(path.clone())),
            None => vm::agent_socket(&sandbox.dir)
                .map_err(|e| ApiError::Unavailable(format!("sandbox {id}: {e}"))),
        }
    }

    /// A connection to the sandbox's agent, retried until the agent timeout.
    pub async fn agent(&self, id: &str) -> Result<AgentClient, ApiError> {
        let path = self.agent_socket(id)?;
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let options = ClientOptions {
                connect_timeout: Some(left),
                ..self.client_options()
            };
            match AgentClient::connect_unix_with(&path, DEFAULT_PORT, options).await {
                Ok(client) => return Ok(client),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(self.no_answer(id, &path, &e.to_string()))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    fn no_answer(&self, id: &str, path: &SocketPath, last: &str) -> ApiError {
        ApiError::Unavailable(format!(
            "sandbox {id}: the agent did not answer on {} within {} s ({last})",
            path.display(),
            seconds(self.timeout)
        ))
    }

    /// A byte pipe to TCP `port` on the guest's loopback: a connection of its own to the
    /// agent, which dials the port and then carries the bytes (the agent's `tcp_connect`).
    /// Nothing listening there is an error naming the port.
    pub async fn guest_tcp(&self, id: &str, port: u16) -> Result<tokio::net::UnixStream, ApiError> {
        let path = self.agent_socket(id)?;
        let host = rollbox_agent_protocol::DEFAULT_TCP_HOST;
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let options = ClientOptions {
                connect_timeout: Some(left),
                ..self.client_options()
            };
            let connect = rollbox_agent_protocol::client::connect_unix_tcp_with;
            match connect(&path, DEFAULT_PORT, host, port, options).await {
                Ok(stream) => return Ok(stream),
                Err(ClientError::Agent(info)) => {
                    return Err(ApiError::BadGateway(format!(
                        "sandbox {id}: guest port {port}: {}",
                        info.message
                    )))
                }
                Err(e @ ClientError::Timeout { .. }) => return Err(agent_error(id, e)),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(self.no_answer(id, &path, &e.to_string()))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}
