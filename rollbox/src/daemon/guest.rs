//! Exec and files: requests that go through the sandbox's guest agent, over its vsock Unix
//! socket (`CONNECT 1024`), one agent connection per request.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Bytes;
use rollbox_agent_protocol::client::{AgentClient, ClientError, ExecEvent, RawRequest};
use rollbox_agent_protocol::messages::{
    ClientMessage, ExecRequest, OutputStream, ServerMessage, WriteFileRequest,
};
use rollbox_agent_protocol::DEFAULT_PORT;
use tokio::sync::mpsc;

use super::api::{
    encode_bytes, ApiError, BodyTooLarge, Chunk, Exec, ExecCommand, ExecLine, ExecRecord,
    ExecResult, ExitInfo, FileInfo, FileKind, FileOp, Reply, State, MAX_UPLOAD,
};
use super::{internal, vm, Daemon};

/// How long a request waits for the agent to accept a connection (the guest may still boot).
const AGENT_WAIT: Duration = Duration::from_secs(10);

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

impl Daemon {
    /// The agent socket of a running sandbox.
    pub(super) fn agent_socket(&self, id: &str) -> Result<PathBuf, ApiError> {
        let sandbox = self.touch(id)?;
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
        Ok(match &self.options.test_agent_socket {
            Some(path) => path.clone(),
            None => vm::Paths::new(&sandbox.dir).vsock,
        })
    }

    pub(super) async fn agent(&self, id: &str) -> Result<AgentClient, ApiError> {
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
    pub(super) async fn guest_tcp(
        &self,
        id: &str,
        port: u16,
    ) -> Result<tokio::net::UnixStream, ApiError> {
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

    pub(super) async fn exec(
        self: &Arc<Self>,
        id: &str,
        exec: Exec,
        stream: bool,
    ) -> Result<Reply, ApiError> {
        let client = self.agent(id).await?;
        let mut request = match exec.command.clone() {
            ExecCommand::Argv(argv) => ExecRequest::argv(argv),
            ExecCommand::Shell(script) => ExecRequest::shell(script),
        };
        // The sandbox's env, under the exec's own.
        let mut env = self
            .store()
            .sandbox(id)
            .map_err(internal)?
            .map(|s| s.env)
            .unwrap_or_default();
        env.extend(exec.env);
        request.env = env;
        request.cwd = exec.cwd;
        request.user = exec.user;
        request.timeout_ms = exec.timeout_ms;
        request.output_limit_bytes = Some(exec.max_output_bytes);
        if !stream {
            request.stdin_data = exec.stdin;
            let output = client.run(request).await.map_err(|e| agent_error(id, e))?;
            let (stdout, stdout_encoding) = encode_bytes(&output.stdout);
            let (stderr, stderr_encoding) = encode_bytes(&output.stderr);
            return Ok(Reply::Exec(ExecResult {
                exit: exit_info(&output.status),
                stdout,
                stdout_encoding,
                stderr,
                stderr_encoding,
            }));
        }
        request.stdin = exec.stdin.is_some() || exec.stdin_open;
        let mut handle = client.exec(request).await.map_err(|e| agent_error(id, e))?;
        // A command that cannot start is an HTTP error, not a stream.
        let pid = handle.started().await.map_err(|e| agent_error(id, e))?;
        if let Some(stdin) = &exec.stdin {
            handle
                .write_stdin(stdin)
                .await
                .map_err(|e| agent_error(id, e))?;
        }
        if exec.stdin.is_some() && !exec.stdin_open {
            handle.close_stdin().await.map_err(|e| agent_error(id, e))?;
        }
        let key = (id.to_string(), pid);
        self.processes()
            .insert(key.clone(), (client.clone(), handle.id(), exec.stdin_open));
        let (tx, rx) = mpsc::channel::<Chunk>(16);
        let daemon = Arc::clone(self);
        tokio::spawn(async move {
            let mut seq = 0u64;
            let mut send = |record: ExecRecord| {
                let line = ExecLine { seq, record };
                seq += 1;
                let mut text = serde_json::to_vec(&line).unwrap_or_default();
                text.push(b'\n');
                let tx = tx.clone();
                async move { tx.send(Ok(Bytes::from(text))).await.is_ok() }
            };
            let mut open = send(ExecRecord::Started { pid }).await;
            while open {
                let record = match handle.next_event().await {
                    Ok(Some(ExecEvent::Output { stream, data, .. })) => {
                        let (data, encoding) = encode_bytes(&data);
                        match stream {
                            OutputStream::Stdout | OutputStream::Pty => {
                                ExecRecord::Stdout { data, encoding }
                            }
                            OutputStream::Stderr => ExecRecord::Stderr { data, encoding },
                        }
                    }
                    Ok(Some(ExecEvent::Exited(status))) => ExecRecord::Exit(exit_info(&status)),
                    Ok(Some(ExecEvent::Started { .. } | ExecEvent::Notice(_))) => continue,
                    Ok(None) => break,
                    Err(e) => ExecRecord::Error {
                        message: e.to_string(),
                    },
                };
                let last = matches!(record, ExecRecord::Exit(_) | ExecRecord::Error { .. });
                open = send(record).await;
                if last {
                    break;
                }
            }
            if !open {
                // The HTTP client went away: the process goes too.
                let _ = handle.cancel().await;
            }
            daemon.processes().remove(&key);
            let _ = client.close().await;
        });
        Ok(Reply::Stream {
            content_type: "application/x-ndjson",
            body: rx,
        })
    }

    /// Signals a process that a streaming exec of this daemon started and that still runs:
    /// the agent takes signals only on the exec request that started the process.
    pub(super) async fn signal(
        &self,
        id: &str,
        pid: u32,
        signal: i32,
        group: bool,
    ) -> Result<Reply, ApiError> {
        self.touch(id)?;
        let found = self.processes().get(&(id.to_string(), pid)).cloned();
        let Some((client, request, _)) = found else {
            return Err(ApiError::NotFound(format!(
                "pid: no running process {pid} in sandbox {id} started by a streaming exec (only those can be signalled)"
            )));
        };
        client
            .send(request, ClientMessage::Signal { signal, group })
            .await
            .map_err(|e| agent_error(id, e))?;
        Ok(Reply::NoContent)
    }

    /// Writes to the stdin of a streaming exec started with `stdin_open`, then closes it when
    /// `close`.
    pub(super) async fn write_stdin(
        &self,
        id: &str,
        pid: u32,
        data: Vec<u8>,
        close: bool,
    ) -> Result<Reply, ApiError> {
        self.touch(id)?;
        let key = (id.to_string(), pid);
        let found = self.processes().get(&key).cloned();
        let Some((client, request, open)) = found else {
            return Err(ApiError::NotFound(format!(
                "pid: no running process {pid} in sandbox {id} started by a streaming exec"
            )));
        };
        if !open {
            return Err(ApiError::Conflict(format!(
                "pid: the stdin of process {pid} is closed (start it with \"stdin_open\": true to write to it)"
            )));
        }
        for chunk in data.chunks(rollbox_agent_protocol::CHUNK_BYTES) {
            client
                .send(
                    request,
                    ClientMessage::Stdin {
                        data: chunk.to_vec(),
                    },
                )
                .await
                .map_err(|e| agent_error(id, e))?;
        }
        if close {
            if let Some(entry) = self.processes().get_mut(&key) {
                entry.2 = false;
            }
            client
                .send(request, ClientMessage::StdinClose)
                .await
                .map_err(|e| agent_error(id, e))?;
        }
        Ok(Reply::NoContent)
    }

    /// A file operation without a request body.
    pub(super) async fn file(&self, id: &str, op: FileOp) -> Result<Reply, ApiError> {
        let client = self.agent(id).await?;
        let fail = |e| agent_error(id, e);
        match op {
            FileOp::Stat { path } => Ok(Reply::File(file_info(
                client.stat(&path).await.map_err(fail)?,
            ))),
            FileOp::List { path } => Ok(Reply::Files(
                client
                    .list(&path)
                    .await
                    .map_err(fail)?
                    .into_iter()
                    .map(file_info)
                    .collect(),
            )),
            FileOp::Remove { path, recursive } => {
                client.remove(&path, recursive).await.map_err(fail)?;
                Ok(Reply::NoContent)
            }
            FileOp::Read { path } => {
                let raw = client
                    .open(ClientMessage::ReadFile {
                        path,
                        offset: 0,
                        length: None,
                    })
                    .await
                    .map_err(fail)?;
                download(id, raw, "application/octet-stream").await
            }
            FileOp::TarDownload { path } => {
                let raw = client
                    .open(ClientMessage::TarDownload { path })
                    .await
                    .map_err(fail)?;
                download(id, raw, "application/x-tar").await
            }
            FileOp::Write { .. } | FileOp::TarUpload { .. } => Err(ApiError::Internal(
                "an upload reached the handler without its body".into(),
            )),
        }
    }

    /// An upload: `body` streams into the agent.
    pub(super) async fn upload<R>(&self, id: &str, op: FileOp, body: R) -> Result<Reply, ApiError>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let client = self.agent(id).await?;
        let (path, bytes) = match op {
            FileOp::Write {
                path,
                mode,
                parents,
            } => {
                let mut request = WriteFileRequest::new(path.clone());
                request.mode = mode;
                request.make_parents = parents;
                let bytes = client.write_file_from(request, body).await;
                (path, bytes)
            }
            FileOp::TarUpload { path } => {
                let bytes = client.tar_upload(&path, body).await;
                (path, bytes)
            }
            other => {
                return Err(internal(format!("{other:?} is not an upload")));
            }
        };
        let bytes = bytes.map_err(|e| agent_error(id, e))?;
        let _ = client.close().await;
        Ok(Reply::Written { path, bytes })
    }
}

/// Streams a download; its first reply decides the status (a missing file is a 404).
async fn download(
    id: &str,
    mut raw: RawRequest,
    content_type: &'static str,
) -> Result<Reply, ApiError> {
    let first = raw.recv().await.map_err(|e| agent_error(id, e))?;
    let (tx, rx) = mpsc::channel::<Chunk>(8);
    tokio::spawn(async move {
        let mut next = Ok(first);
        let mut received = 0u64;
        loop {
            let chunk = match next {
                Ok(ServerMessage::Data { data, .. }) => {
                    received += data.len() as u64;
                    Ok(Bytes::from(data))
                }
                Ok(ServerMessage::End { bytes }) if bytes == received => return,
                Ok(other) => Err(std::io::Error::other(format!(
                    "the agent broke off the download: {other:?}"
                ))),
                Err(e) => Err(std::io::Error::other(format!(
                    "the agent broke off the download: {e}"
                ))),
            };
            let failed = chunk.is_err();
            if tx.send(chunk).await.is_err() {
                let _ = raw.send(ClientMessage::Cancel).await;
                return;
            }
            if failed {
                return;
            }
            next = raw.recv().await;
        }
    });
    Ok(Reply::Stream {
        content_type,
        body: rx,
    })
}
