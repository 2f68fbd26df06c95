//! Async host-side client. One connection carries many requests at once:
//! a reader task routes each incoming frame to its request by id.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::{mpsc, oneshot};

use crate::frame::{self, FrameError};
use crate::hybrid::{self, HandshakeError};
use crate::messages::*;
use crate::CHUNK_BYTES;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect to agent socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("hybrid vsock handshake with {path}: {source}")]
    Handshake {
        path: String,
        source: HandshakeError,
    },
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("connection to the agent is closed: {0}")]
    Disconnected(String),
    #[error("agent error: {0}")]
    Agent(ErrorInfo),
    #[error("unexpected reply from the agent: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
    #[error("reading upload source: {0}")]
    Source(std::io::Error),
}

impl ClientError {
    /// The agent's error, if that is what this is.
    pub fn agent_error(&self) -> Option<&ErrorInfo> {
        match self {
            Self::Agent(info) => Some(info),
            _ => None,
        }
    }
}

type Writer = Box<dyn AsyncWrite + Send + Unpin>;

struct Routes {
    open: HashMap<u64, mpsc::UnboundedSender<ServerMessage>>,
    /// Set once the reader stops; says why.
    closed: Option<String>,
}

struct Shared {
    writer: tokio::sync::Mutex<Writer>,
    routes: Mutex<Routes>,
    next_id: AtomicU64,
    /// Dropped with the last client handle; that stops the reader task, and
    /// with both halves gone the connection closes.
    _reader_stop: oneshot::Sender<()>,
}

/// A connection to one agent. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct AgentClient {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient").finish_non_exhaustive()
    }
}

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

/// Outcome of a post-restore fixup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub applied: bool,
    pub detail: String,
}

impl AgentClient {
    /// Connect to a Unix socket that speaks the hybrid vsock preamble (the
    /// VMM's vsock socket, or an agent started with `--listen-unix`).
    pub async fn connect_unix(path: impl AsRef<Path>, port: u32) -> Result<Self, ClientError> {
        Ok(Self::from_stream(unix_stream(path.as_ref(), port).await?))
    }

    /// Use an already connected stream (handshake done, if any).
    /// Must be called inside a tokio runtime: it spawns the reader task.
    pub fn from_stream<S>(stream: S) -> Self
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (reader, writer): (ReadHalf<S>, WriteHalf<S>) = tokio::io::split(stream);
        let (stop_tx, stop_rx) = oneshot::channel();
        let shared = Arc::new(Shared {
            writer: tokio::sync::Mutex::new(Box::new(writer)),
            routes: Mutex::new(Routes {
                open: HashMap::new(),
                closed: None,
            }),
            next_id: AtomicU64::new(1),
            _reader_stop: stop_tx,
        });
        tokio::spawn(read_loop(reader, Arc::downgrade(&shared), stop_rx));
        Self { shared }
    }

    /// Open a request: returns its id and the receiver of its replies.
    pub async fn open(&self, body: ClientMessage) -> Result<RawRequest, ClientError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut routes = lock_routes(&self.shared);
            if let Some(reason) = &routes.closed {
                return Err(ClientError::Disconnected(reason.clone()));
            }
            routes.open.insert(id, tx);
        }
        if let Err(err) = self.send(id, body).await {
            lock_routes(&self.shared).open.remove(&id);
            return Err(err);
        }
        Ok(RawRequest {
            client: self.clone(),
            id,
            rx,
        })
    }

    /// Send one frame with a given id (stream input to an open request).
    pub async fn send(&self, id: u64, body: ClientMessage) -> Result<(), ClientError> {
        let frame = ClientFrame { id, body };
        let mut writer = self.shared.writer.lock().await;
        frame::write_frame(&mut *writer, &frame)
            .await
            .map_err(|err| match err {
                FrameError::Io(io) => ClientError::Disconnected(format!("write failed: {io}")),
                other => ClientError::Frame(other),
            })
    }

    /// Close the sending side. The agent then ends this connection's
    /// requests (running processes are killed, uploads dropped).
    pub async fn close(&self) -> Result<(), ClientError> {
        let mut writer = self.shared.writer.lock().await;
        writer
            .shutdown()
            .await
            .map_err(|err| ClientError::Disconnected(format!("shutdown failed: {err}")))
    }

    /// Send a request and wait for its single (terminal) reply.
    pub async fn request(&self, body: ClientMessage) -> Result<ServerMessage, ClientError> {
        let mut request = self.open(body).await?;
        request.recv().await
    }

    pub async fn hello(&self) -> Result<(String, u32), ClientError> {
        match self.request(ClientMessage::Hello).await? {
            ServerMessage::Hello {
                agent_version,
                protocol_version,
            } => Ok((agent_version, protocol_version)),
            other => Err(unexpected("hello", &other)),
        }
    }

    /// Start a process; read its events from the handle.
    pub async fn exec(&self, request: ExecRequest) -> Result<ExecHandle, ClientError> {
        let raw = self.open(ClientMessage::Exec(request)).await?;
        Ok(ExecHandle::new(raw))
    }

    /// Run a process to completion (the unary form).
    pub async fn run(&self, request: ExecRequest) -> Result<ExecOutput, ClientError> {
        match self.request(ClientMessage::Run(request)).await? {
            ServerMessage::RunResult {
                stdout,
                stderr,
                status,
            } => Ok(ExecOutput {
                stdout,
                stderr,
                status,
            }),
            other => Err(unexpected("run_result", &other)),
        }
    }

    /// Run a shell command to completion.
    pub async fn sh(&self, script: &str) -> Result<ExecOutput, ClientError> {
        self.run(ExecRequest::shell(script)).await
    }

    pub async fn read_file(&self, path: &str) -> Result<Vec<u8>, ClientError> {
        self.read_file_range(path, 0, None).await
    }

    pub async fn read_file_range(
        &self,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        self.download(
            ClientMessage::ReadFile {
                path: path.to_owned(),
                offset,
                length,
            },
            &mut out,
        )
        .await?;
        Ok(out)
    }

    /// Stream a file into `sink`; returns the byte count.
    pub async fn read_file_to<W: AsyncWrite + Unpin>(
        &self,
        path: &str,
        sink: &mut W,
    ) -> Result<u64, ClientError> {
        self.download(
            ClientMessage::ReadFile {
                path: path.to_owned(),
                offset: 0,
                length: None,
            },
            sink,
        )
        .await
    }

    /// Write a whole file (atomic by default).
    pub async fn write_file(&self, path: &str, data: &[u8]) -> Result<u64, ClientError> {
        self.write_file_from(WriteFileRequest::new(path), data)
            .await
    }

    /// Stream a file from `source` with explicit options.
    pub async fn write_file_from<R: AsyncRead + Unpin>(
        &self,
        request: WriteFileRequest,
        source: R,
    ) -> Result<u64, ClientError> {
        self.upload(ClientMessage::WriteFile(request), source).await
    }

    pub async fn stat(&self, path: &str) -> Result<FileInfo, ClientError> {
        self.stat_with(path, true).await
    }

    /// Like `stat`, but describes a final symlink itself.
    pub async fn lstat(&self, path: &str) -> Result<FileInfo, ClientError> {
        self.stat_with(path, false).await
    }

    async fn stat_with(&self, path: &str, follow_symlinks: bool) -> Result<FileInfo, ClientError> {
        match self
            .request(ClientMessage::Stat {
                path: path.to_owned(),
                follow_symlinks,
            })
            .await?
        {
            ServerMessage::Stat(info) => Ok(info),
            other => Err(unexpected("stat", &other)),
        }
    }

    /// The guest's account `name` (`LookupUser`); an agent error `ENOENT` when it has none.
    pub async fn lookup_user(&self, name: &str) -> Result<Account, ClientError> {
        match self
            .request(ClientMessage::LookupUser {
                name: name.to_owned(),
            })
            .await?
        {
            ServerMessage::Account(account) => Ok(account),
            other => Err(unexpected("lookup_user", &other)),
        }
    }

    pub async fn list(&self, path: &str) -> Result<Vec<FileInfo>, ClientError> {
        match self
            .request(ClientMessage::List {
                path: path.to_owned(),
            })
            .await?
        {
            ServerMessage::List { entries } => Ok(entries),
            other => Err(unexpected("list", &other)),
        }
    }

    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<(), ClientError> {
        self.mkdir_owned(path, parents, None).await
    }

    /// `mkdir`, with what it creates given to `owner` (a user name or uid) when one is named.
    pub async fn mkdir_owned(
        &self,
        path: &str,
        parents: bool,
        owner: Option<&str>,
    ) -> Result<(), ClientError> {
        self.expect_ok(ClientMessage::Mkdir {
            path: path.to_owned(),
            parents,
            mode: None,
            owner: owner.map(str::to_owned),
        })
        .await
    }

    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.expect_ok(ClientMessage::Remove {
            path: path.to_owned(),
            recursive,
        })
        .await
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<(), ClientError> {
        self.expect_ok(ClientMessage::Move {
            from: from.to_owned(),
            to: to.to_owned(),
        })
        .await
    }

    /// A tar archive of `path` (a directory's contents, or one file).
    pub async fn tar_download(&self, path: &str) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        self.download(
            ClientMessage::TarDownload {
                path: path.to_owned(),
            },
            &mut out,
        )
        .await?;
        Ok(out)
    }

    /// Unpack a tar archive into directory `path`.
    pub async fn tar_upload<R: AsyncRead + Unpin>(
        &self,
        path: &str,
        archive: R,
    ) -> Result<u64, ClientError> {
        self.upload(
            ClientMessage::TarUpload {
                path: path.to_owned(),
            },
            archive,
        )
        .await
    }

    pub async fn set_time(&self, time: SystemTime) -> Result<Applied, ClientError> {
        let since = time.duration_since(UNIX_EPOCH).map_err(|_| {
            ClientError::Source(std::io::Error::other("time before the Unix epoch"))
        })?;
        let unix_seconds = i64::try_from(since.as_secs()).map_err(|_| {
            ClientError::Source(std::io::Error::other("time too far in the future"))
        })?;
        self.applied(ClientMessage::SetTime {
            unix_seconds,
            nanos: since.subsec_nanos(),
        })
        .await
    }

    pub async fn reseed(&self, seed: &[u8]) -> Result<Applied, ClientError> {
        self.applied(ClientMessage::Reseed {
            seed: seed.to_vec(),
        })
        .await
    }

    /// Powers the guest off (or reboots it); the agent answers before the machine goes.
    pub async fn power_off(&self, reboot: bool) -> Result<Applied, ClientError> {
        self.applied(ClientMessage::PowerOff { reboot }).await
    }

    pub async fn set_identity(
        &self,
        hostname: Option<&str>,
        machine_id: Option<&str>,
    ) -> Result<Applied, ClientError> {
        self.applied(ClientMessage::SetIdentity {
            hostname: hostname.map(str::to_owned),
            machine_id: machine_id.map(str::to_owned),
        })
        .await
    }

    /// (Re)addresses a guest interface (after a fork, say).
    pub async fn configure_network(
        &self,
        config: &crate::NetworkConfig,
    ) -> Result<Applied, ClientError> {
        self.applied(ClientMessage::ConfigureNetwork(config.clone()))
            .await
    }

    pub async fn health(&self) -> Result<Health, ClientError> {
        match self.request(ClientMessage::Health).await? {
            ServerMessage::Health(health) => Ok(health),
            other => Err(unexpected("health", &other)),
        }
    }

    /// Make sure dockerd answers; returns whether this call started it.
    pub async fn docker_ensure(&self, timeout: Option<Duration>) -> Result<bool, ClientError> {
        let timeout_ms = timeout.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        match self
            .request(ClientMessage::DockerEnsure {
                timeout_ms,
                extra_args: Vec::new(),
            })
            .await?
        {
            ServerMessage::DockerReady { started, .. } => Ok(started),
            other => Err(unexpected("docker_ready", &other)),
        }
    }

    /// Watch a directory. Once the agent answers `Watching`, read `FsEvents` (and `Notice`s of
    /// lost events) from the request until `WatchEnded`; send `Cancel` to stop it.
    pub async fn watch(&self, request: WatchRequest) -> Result<RawRequest, ClientError> {
        let mut raw = self.open(ClientMessage::Watch(request)).await?;
        match raw.recv().await? {
            ServerMessage::Watching => Ok(raw),
            other => Err(unexpected("watching", &other)),
        }
    }

    /// Run a container; events as for `exec`.
    pub async fn docker_run(&self, request: DockerRunRequest) -> Result<ExecHandle, ClientError> {
        let raw = self.open(ClientMessage::DockerRun(request)).await?;
        Ok(ExecHandle::new(raw))
    }

    async fn applied(&self, body: ClientMessage) -> Result<Applied, ClientError> {
        match self.request(body).await? {
            ServerMessage::Applied { applied, detail } => Ok(Applied { applied, detail }),
            other => Err(unexpected("applied", &other)),
        }
    }

    async fn expect_ok(&self, body: ClientMessage) -> Result<(), ClientError> {
        match self.request(body).await? {
            ServerMessage::Ok => Ok(()),
            other => Err(unexpected("ok", &other)),
        }
    }

    async fn download<W: AsyncWrite + Unpin>(
        &self,
        body: ClientMessage,
        sink: &mut W,
    ) -> Result<u64, ClientError> {
        let mut request = self.open(body).await?;
        let mut received = 0u64;
        loop {
            match request.recv().await? {
                ServerMessage::Data { data, .. } => {
                    received += data.len() as u64;
                    if let Err(err) = sink.write_all(&data).await {
                        let _ = self.send(request.id, ClientMessage::Cancel).await;
                        return Err(ClientError::Source(err));
                    }
                }
                ServerMessage::End { bytes } => {
                    sink.flush().await.map_err(ClientError::Source)?;
                    if bytes != received {
                        return Err(ClientError::Unexpected {
                            expected: "end with the received byte count",
                            got: format!("end of {bytes} bytes after receiving {received}"),
                        });
                    }
                    return Ok(received);
                }
                other => return Err(unexpected("data or end", &other)),
            }
        }
    }

    async fn upload<R: AsyncRead + Unpin>(
        &self,
        body: ClientMessage,
        mut source: R,
    ) -> Result<u64, ClientError> {
        let mut request = self.open(body).await?;
        match request.recv().await? {
            ServerMessage::Ready => {}
            other => return Err(unexpected("ready", &other)),
        }
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            // The agent may have failed mid-upload (e.g. disk full): stop early.
            if let Some(reply) = request.try_recv() {
                return match reply {
                    ServerMessage::Error(info) => Err(ClientError::Agent(info)),
                    other => Err(unexpected("nothing before the end of the upload", &other)),
                };
            }
            let n = match source.read(&mut buf).await {
                Ok(n) => n,
                Err(err) => {
                    let _ = self.send(request.id, ClientMessage::Cancel).await;
                    return Err(ClientError::Source(err));
                }
            };
            if n == 0 {
                break;
            }
            self.send(
                request.id,
                ClientMessage::Data {
                    data: buf[..n].to_vec(),
                },
            )
            .await?;
        }
        self.send(request.id, ClientMessage::End).await?;
        match request.recv().await? {
            ServerMessage::Written { bytes } => Ok(bytes),
            other => Err(unexpected("written", &other)),
        }
    }
}

/// A Unix socket connection past the hybrid vsock preamble.
async fn unix_stream(path: &Path, port: u32) -> Result<tokio::net::UnixStream, ClientError> {
    let path_text = path.display().to_string();
    let mut stream = tokio::net::UnixStream::connect(path)
        .await
        .map_err(|source| ClientError::Connect {
            path: path_text.clone(),
            source,
        })?;
    hybrid::client_handshake(&mut stream, port)
        .await
        .map_err(|source| ClientError::Handshake {
            path: path_text,
            source,
        })?;
    Ok(stream)
}

/// `tcp_connect` over a new connection to the agent socket at `path` (see [`tcp_connect`]).
pub async fn connect_unix_tcp(
    path: impl AsRef<Path>,
    vsock_port: u32,
    host: &str,
    port: u16,
) -> Result<tokio::net::UnixStream, ClientError> {
    tcp_connect(unix_stream(path.as_ref(), vsock_port).await?, host, port).await
}

/// Asks the agent on `stream`, a fresh connection (handshake done, nothing else sent), to open
/// a TCP connection to `host:port` inside the guest, and returns `stream`, which from then on
/// is a raw byte pipe to that socket: what is written reaches it, what it sends is read, and
/// closing `stream` closes it. Not an [`AgentClient`] method because the pipe needs the stream
/// itself, which a client shares between its requests.
pub async fn tcp_connect<S>(mut stream: S, host: &str, port: u16) -> Result<S, ClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let id = 1;
    let request = ClientFrame {
        id,
        body: ClientMessage::TcpConnect {
            host: host.to_owned(),
            port,
        },
    };
    frame::write_frame(&mut stream, &request)
        .await
        .map_err(|err| match err {
            FrameError::Io(io) => ClientError::Disconnected(format!("write failed: {io}")),
            other => ClientError::Frame(other),
        })?;
    // The agent reads no further than this frame, and writes nothing after it but pipe bytes.
    let reply: Option<ServerFrame> = frame::read_frame(&mut stream).await?;
    match reply {
        Some(ServerFrame {
            id: got,
            body: ServerMessage::TcpConnected { .. },
        }) if got == id => Ok(stream),
        Some(ServerFrame {
            id: got,
            body: ServerMessage::Error(info),
        }) if got == id => Err(ClientError::Agent(info)),
        Some(ServerFrame { body, .. }) => Err(unexpected("tcp_connected", &body)),
        None => Err(ClientError::Disconnected(format!(
            "the agent closed the connection before answering tcp_connect {host}:{port}"
        ))),
    }
}

fn lock_routes(shared: &Shared) -> std::sync::MutexGuard<'_, Routes> {
    // A poisoned lock only means another task panicked mid-update of a plain map.
    shared
        .routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn unexpected(expected: &'static str, got: &ServerMessage) -> ClientError {
    match got {
        ServerMessage::Error(info) => ClientError::Agent(info.clone()),
        other => ClientError::Unexpected {
            expected,
            got: format!("{other:?}").chars().take(200).collect(),
        },
    }
}

async fn read_loop<R: AsyncRead>(
    reader: ReadHalf<R>,
    shared: Weak<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut reader = reader;
    let reason = loop {
        let next = tokio::select! {
            next = frame::read_frame::<_, ServerFrame>(&mut reader) => next,
            // Every client handle is gone.
            _ = &mut stop => return,
        };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match next {
            Ok(Some(frame)) => {
                let mut routes = lock_routes(&shared);
                let terminal = frame.body.is_terminal();
                if let Some(route) = routes.open.get(&frame.id) {
                    // A dropped receiver just means nobody waits for this request any more.
                    let _ = route.send(frame.body);
                }
                if terminal {
                    routes.open.remove(&frame.id);
                }
            }
            Ok(None) => break "the agent closed the connection".to_owned(),
            Err(err) => break err.to_string(),
        }
    };
    if let Some(shared) = shared.upgrade() {
        let mut routes = lock_routes(&shared);
        routes.closed = Some(reason);
        routes.open.clear();
    }
}

/// An open request: its id and its replies.
pub struct RawRequest {
    client: AgentClient,
    pub id: u64,
    rx: mpsc::UnboundedReceiver<ServerMessage>,
}

impl std::fmt::Debug for RawRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawRequest")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RawRequest {
    /// The next reply. `Error` replies come back as `Ok(ServerMessage::Error)`
    /// here only through `recv_raw`; this turns them into `ClientError::Agent`.
    pub async fn recv(&mut self) -> Result<ServerMessage, ClientError> {
        match self.recv_raw().await? {
            ServerMessage::Error(info) => Err(ClientError::Agent(info)),
            other => Ok(other),
        }
    }

    /// The next reply as it came.
    pub async fn recv_raw(&mut self) -> Result<ServerMessage, ClientError> {
        match self.rx.recv().await {
            Some(message) => Ok(message),
            None => {
                let reason = lock_routes(&self.client.shared)
                    .closed
                    .clone()
                    .unwrap_or_else(|| "the request already ended".to_owned());
                Err(ClientError::Disconnected(reason))
            }
        }
    }

    fn try_recv(&mut self) -> Option<ServerMessage> {
        self.rx.try_recv().ok()
    }

    /// Send stream input to this request.
    pub async fn send(&self, body: ClientMessage) -> Result<(), ClientError> {
        self.client.send(self.id, body).await
    }
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
    fn new(raw: RawRequest) -> Self {
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
