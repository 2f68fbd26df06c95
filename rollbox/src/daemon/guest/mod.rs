//! Guest access: requests that go through the sandbox's guest agent, over its vsock Unix
//! socket (`CONNECT 1024`), one agent connection per request: exec (`exec.rs`), files
//! (`files.rs`), guest TCP ports, and the commands a template runs after a boot (`boot.rs`).
//! The agent's types stop here: what goes back is the API's.

mod boot;
mod exec;
mod files;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rollbox_agent_protocol::client::{AgentClient, ClientError};
use rollbox_agent_protocol::DEFAULT_PORT;

use super::api::{ApiError, BodyTooLarge, ExitInfo, FileInfo, FileKind, State, MAX_UPLOAD};
use super::store::Db;
use super::supervisor::jaildir::SocketPath;
use super::supervisor::vm;
use super::util::touch;

/// How long a request waits for the agent to accept a connection (the guest may still boot).
const AGENT_WAIT: Duration = Duration::from_secs(10);

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
        other => ApiError::Unavailable(format!("sandbox {id}: the agent: {other}")),
    }
}

impl Guest {
    pub fn new(db: Arc<Db>, test_agent_socket: Option<PathBuf>) -> Guest {
        Guest {
            db,
            test_agent_socket,
            processes: Arc::new(Mutex::new(HashMap::new())),
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

    pub async fn agent(&self, id: &str) -> Result<AgentClient, ApiError> {
        let path = self.agent_socket(id)?;
        let deadline = tokio::time::Instant::now() + AGENT_WAIT;
        loop {
            match AgentClient::connect_unix(&path, DEFAULT_PORT).await {
                Ok(client) => return Ok(client),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(ApiError::Unavailable(format!(
                        "sandbox {id}: no agent answers on {} within {} s: {e}",
                        path.display(),
                        AGENT_WAIT.as_secs()
                    )))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// A byte pipe to TCP `port` on the guest's loopback: a connection of its own to the
    /// agent, which dials the port and then carries the bytes (the agent's `tcp_connect`).
    /// Nothing listening there is an error naming the port.
    pub async fn guest_tcp(&self, id: &str, port: u16) -> Result<tokio::net::UnixStream, ApiError> {
        let path = self.agent_socket(id)?;
        let host = rollbox_agent_protocol::DEFAULT_TCP_HOST;
        let deadline = tokio::time::Instant::now() + AGENT_WAIT;
        loop {
            match rollbox_agent_protocol::client::connect_unix_tcp(&path, DEFAULT_PORT, host, port)
                .await
            {
                Ok(stream) => return Ok(stream),
                Err(ClientError::Agent(info)) => {
                    return Err(ApiError::BadGateway(format!(
                        "sandbox {id}: guest port {port}: {}",
                        info.message
                    )))
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(ApiError::Unavailable(format!(
                        "sandbox {id}: no agent answers on {} within {} s: {e}",
                        path.display(),
                        AGENT_WAIT.as_secs()
                    )))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}
