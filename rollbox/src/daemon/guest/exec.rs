//! Exec through the agent: unary (one JSON answer) or streaming (NDJSON lines as they come),
//! and the signals and stdin of a streaming exec's process.

use std::sync::{Arc, Mutex, MutexGuard};

use hyper::body::Bytes;
use rollbox_agent_protocol::client::ExecEvent;
use rollbox_agent_protocol::messages::{ClientMessage, ExecRequest, OutputStream};
use tokio::sync::mpsc;

use super::super::api::{
    encode_bytes, ApiError, Chunk, Exec, ExecCommand, ExecLine, ExecRecord, ExecResult, Reply,
};
use super::super::util::{internal, touch};
use super::{agent_error, exit_info, Guest, Processes};

fn lock(processes: &Mutex<Processes>) -> MutexGuard<'_, Processes> {
    processes.lock().unwrap_or_else(|p| p.into_inner())
}

impl Guest {
    fn processes(&self) -> MutexGuard<'_, Processes> {
        lock(&self.processes)
    }

    pub async fn exec(&self, id: &str, exec: Exec, stream: bool) -> Result<Reply, ApiError> {
        let client = self.agent(id).await?;
        let mut request = match exec.command.clone() {
            ExecCommand::Argv(argv) => ExecRequest::argv(argv),
            ExecCommand::Shell(script) => ExecRequest::shell(script),
        };
        // The sandbox's env, under the exec's own.
        let mut env = self
            .db
            .lock()
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
        let processes = Arc::clone(&self.processes);
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
            let request = handle.id();
            // Dropped first: frames still coming are then discarded instead of waiting for
            // room, so the agent can take the cancel below.
            drop(handle);
            if !open {
                // The HTTP client went away: the process goes too.
                let _ = client.send(request, ClientMessage::Cancel).await;
            }
            lock(&processes).remove(&key);
            let _ = client.close().await;
        });
        Ok(Reply::Stream {
            content_type: "application/x-ndjson",
            body: rx,
        })
    }

    /// Signals a process that a streaming exec of this daemon started and that still runs:
    /// the agent takes signals only on the exec request that started the process.
    pub async fn signal(
        &self,
        id: &str,
        pid: u32,
        signal: i32,
        group: bool,
    ) -> Result<Reply, ApiError> {
        touch(&self.db, id)?;
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
    pub async fn write_stdin(
        &self,
        id: &str,
        pid: u32,
        data: Vec<u8>,
        close: bool,
    ) -> Result<Reply, ApiError> {
        touch(&self.db, id)?;
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
}
