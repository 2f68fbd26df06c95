//! A running process's side of the client: its events, its stdin and signals, and its
//! collected output.

use super::{unexpected, ClientError, RawRequest};
use crate::messages::*;
use crate::CHUNK_BYTES;

/// Everything a finished process produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
}

/// One event of a running process.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecEvent {
    Started {
        pid: u32,
    },
    Output {
        stream: OutputStream,
        seq: u64,
        data: Vec<u8>,
    },
    Exited(ExitStatus),
    /// The agent refused a stream input (e.g. a bad signal number).
    Notice(String),
}

/// A running process (Exec or DockerRun).
#[derive(Debug)]
pub struct ExecHandle {
    raw: RawRequest,
    pid: Option<u32>,
    done: bool,
    next_seq: u64,
}

impl ExecHandle {
    pub(super) fn new(raw: RawRequest) -> Self {
        Self {
            raw,
            pid: None,
            done: false,
            next_seq: 0,
        }
    }

    pub fn id(&self) -> u64 {
        self.raw.id
    }

    /// The pid, once `Started` was seen.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// The next event; `Ok(None)` after `Exited`.
    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>, ClientError> {
        if self.done {
            return Ok(None);
        }
        let event = match self.raw.recv().await {
            Ok(message) => message,
            Err(err) => {
                self.done = true;
                return Err(err);
            }
        };
        match event {
            ServerMessage::Started { pid } => {
                self.pid = Some(pid);
                Ok(Some(ExecEvent::Started { pid }))
            }
            ServerMessage::Output { stream, seq, data } => {
                if seq != self.next_seq {
                    self.done = true;
                    return Err(ClientError::Unexpected {
                        expected: "output chunks in sequence",
                        got: format!("seq {seq} where {} was due", self.next_seq),
                    });
                }
                self.next_seq += 1;
                Ok(Some(ExecEvent::Output { stream, seq, data }))
            }
            ServerMessage::Exited(status) => {
                self.done = true;
                Ok(Some(ExecEvent::Exited(status)))
            }
            ServerMessage::Notice { message } => Ok(Some(ExecEvent::Notice(message))),
            other => {
                self.done = true;
                Err(unexpected("started, output or exited", &other))
            }
        }
    }

    /// Wait for `Started` and return the pid.
    pub async fn started(&mut self) -> Result<u32, ClientError> {
        if let Some(pid) = self.pid {
            return Ok(pid);
        }
        match self.next_event().await? {
            Some(ExecEvent::Started { pid }) => Ok(pid),
            other => Err(ClientError::Unexpected {
                expected: "started",
                got: format!("{other:?}"),
            }),
        }
    }

    /// Send bytes to the process's stdin (in chunks of at most `CHUNK_BYTES`).
    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), ClientError> {
        for chunk in data.chunks(CHUNK_BYTES) {
            self.raw
                .send(ClientMessage::Stdin {
                    data: chunk.to_vec(),
                })
                .await?;
        }
        Ok(())
    }

    /// Resize the terminal of a `pty` exec.
    pub async fn resize(&self, size: PtySize) -> Result<(), ClientError> {
        self.raw.send(ClientMessage::Resize(size)).await
    }

    pub async fn close_stdin(&self) -> Result<(), ClientError> {
        self.raw.send(ClientMessage::StdinClose).await
    }

    /// Signal the process (`group`: its whole process group).
    pub async fn signal(&self, signal: i32, group: bool) -> Result<(), ClientError> {
        self.raw.send(ClientMessage::Signal { signal, group }).await
    }

    /// Kill the process group now.
    pub async fn cancel(&self) -> Result<(), ClientError> {
        self.raw.send(ClientMessage::Cancel).await
    }

    /// Read all remaining events (output `seq` numbers are checked gap-free).
    pub async fn collect(mut self) -> Result<ExecOutput, ClientError> {
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        while let Some(event) = self.next_event().await? {
            match event {
                ExecEvent::Started { .. } | ExecEvent::Notice(_) => {}
                ExecEvent::Output { stream, data, .. } => match stream {
                    OutputStream::Stdout | OutputStream::Pty => stdout.extend_from_slice(&data),
                    OutputStream::Stderr => stderr.extend_from_slice(&data),
                },
                ExecEvent::Exited(status) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        status,
                    })
                }
            }
        }
        Err(ClientError::Unexpected {
            expected: "exited",
            got: "end of events".into(),
        })
    }
}
