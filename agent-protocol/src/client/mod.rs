//! Async host-side client. One connection carries many requests at once:
//! a reader task routes each incoming frame to its request by id.
//!
//! Backpressure: each request has a bounded queue of [`REQUEST_FRAMES`] frames, and the
//! reader task waits for room before it reads the next frame. A caller that stops reading its
//! request therefore stops the reader, the reader stops reading the socket, and the agent is
//! held back by the stream (vsock credit through the VMM, or the Unix socket's buffer): memory
//! on this side stays bounded however fast the guest writes.
//!
//! Because one stalled request stops the whole connection, a request whose queue stays full
//! for [`ClientOptions::stall_timeout`] is dropped (its caller gets an error saying so, and
//! the agent gets a `Cancel` for it), so other requests on a shared connection cannot be
//! starved for ever. Callers that want pure backpressure (no drop, however slow the reader)
//! set no stall timeout and give every concurrent reader its own connection, as the daemon
//! does.
//!
//! Deadlines ([`ClientOptions`]): connecting and the hybrid-vsock handshake are bounded by
//! `connect_timeout`; every call that has no timeout of its own by `call_timeout` (unary
//! calls whole, transfers per frame, a run or `docker_ensure` past the timeout it carries).
//! A process's events, watch events and raw requests wait as long as the caller does.

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

mod exec;

pub use exec::{ExecEvent, ExecHandle, ExecOutput};

/// Frames one request may have queued for its caller before the reader waits for room.
/// Up to about 6 MiB with the largest frames (64 KiB chunks, base64).
pub const REQUEST_FRAMES: usize = 64;
/// The default [`ClientOptions::stall_timeout`].
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A connection's deadlines and its policy for a request whose caller stops reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOptions {
    /// Bounds connecting to the socket and the hybrid-vsock handshake. None: no bound.
    pub connect_timeout: Option<Duration>,
    /// Bounds every call without a timeout of its own (see the module doc). None: no bound.
    pub call_timeout: Option<Duration>,
    /// How long the reader waits for a request's caller to make room in its queue before the
    /// request is dropped and cancelled in the agent. None: wait for ever (then one stalled
    /// request stops every other request on the connection: use one connection per reader).
    pub stall_timeout: Option<Duration>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: None,
            call_timeout: None,
            stall_timeout: Some(DEFAULT_STALL_TIMEOUT),
        }
    }
}

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
    #[error("the agent did not answer {what} within {} s", seconds(*.after))]
    Timeout { what: String, after: Duration },
}

/// A duration in seconds for messages (fractions for the short deadlines tests use).
fn seconds(after: Duration) -> String {
    if after.subsec_millis() == 0 {
        after.as_secs().to_string()
    } else {
        format!("{:.1}", after.as_secs_f64())
    }
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
    open: HashMap<u64, mpsc::Sender<ServerMessage>>,
    /// Requests dropped because their caller stopped reading, with why; taken by their
    /// `RawRequest`.
    dropped: HashMap<u64, String>,
    /// Set once the reader stops; says why.
    closed: Option<String>,
}

struct Shared {
    writer: tokio::sync::Mutex<Writer>,
    routes: Mutex<Routes>,
    next_id: AtomicU64,
    options: ClientOptions,
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
        Self::connect_unix_with(path, port, ClientOptions::default()).await
    }

    /// [`connect_unix`](Self::connect_unix) with explicit deadlines and stall policy.
    pub async fn connect_unix_with(
        path: impl AsRef<Path>,
        port: u32,
        options: ClientOptions,
    ) -> Result<Self, ClientError> {
        let stream = unix_stream(path.as_ref(), port, options.connect_timeout).await?;
        Ok(Self::from_stream_with(stream, options))
    }

    /// Use an already connected stream (handshake done, if any).
    /// Must be called inside a tokio runtime: it spawns the reader task.
    pub fn from_stream<S>(stream: S) -> Self
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        Self::from_stream_with(stream, ClientOptions::default())
    }

    /// [`from_stream`](Self::from_stream) with explicit deadlines and stall policy.
    pub fn from_stream_with<S>(stream: S, options: ClientOptions) -> Self
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (reader, writer): (ReadHalf<S>, WriteHalf<S>) = tokio::io::split(stream);
        let (stop_tx, stop_rx) = oneshot::channel();
        let shared = Arc::new(Shared {
            writer: tokio::sync::Mutex::new(Box::new(writer)),
            routes: Mutex::new(Routes {
                open: HashMap::new(),
                dropped: HashMap::new(),
                closed: None,
            }),
            next_id: AtomicU64::new(1),
            options,
            _reader_stop: stop_tx,
        });
        tokio::spawn(read_loop(
            reader,
            Arc::downgrade(&shared),
            stop_rx,
            options.stall_timeout,
        ));
        Self { shared }
    }

    /// This connection's options.
    pub fn options(&self) -> ClientOptions {
        self.shared.options
    }

    /// Runs `call` within the call timeout (plus `own`, a timeout the call carries itself,
    /// when there is one); a timeout is [`ClientError::Timeout`] naming `what`.
    async fn within<T>(
        &self,
        what: &str,
        own: Option<Duration>,
        call: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        let Some(limit) = self.shared.options.call_timeout else {
            return call.await;
        };
        let after = limit.saturating_add(own.unwrap_or_default());
        match tokio::time::timeout(after, call).await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Timeout {
                what: what.to_owned(),
                after,
            }),
        }
    }

    /// Open a request: returns its id and the receiver of its replies.
    pub async fn open(&self, body: ClientMessage) -> Result<RawRequest, ClientError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(REQUEST_FRAMES);
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

    /// Send a request and wait for its single (terminal) reply, within the call timeout.
    pub async fn request(&self, body: ClientMessage) -> Result<ServerMessage, ClientError> {
        let what = message_name(&body);
        self.within(&what, None, async {
            let mut request = self.open(body).await?;
            request.recv().await
        })
        .await
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
    /// Bounded by the call timeout past the run's own `timeout_ms`; not at all without one.
    pub async fn run(&self, request: ExecRequest) -> Result<ExecOutput, ClientError> {
        let reply = match request.timeout_ms {
            Some(ms) => {
                let what = "run";
                let own = Some(Duration::from_millis(ms));
                self.within(what, own, async {
                    let mut raw = self.open(ClientMessage::Run(request)).await?;
                    raw.recv().await
                })
                .await?
            }
            None => {
                let mut raw = self.open(ClientMessage::Run(request)).await?;
                raw.recv().await?
            }
        };
        match reply {
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
        let body = ClientMessage::DockerEnsure {
            timeout_ms,
            extra_args: Vec::new(),
        };
        let reply = self
            .within("docker_ensure", timeout, async {
                let mut raw = self.open(body).await?;
                raw.recv().await
            })
            .await?;
        match reply {
            ServerMessage::DockerReady { started, .. } => Ok(started),
            other => Err(unexpected("docker_ready", &other)),
        }
    }

    /// Watch a directory. Once the agent answers `Watching`, read `FsEvents` (and `Notice`s of
    /// lost events) from the request until `WatchEnded`; send `Cancel` to stop it.
    pub async fn watch(&self, request: WatchRequest) -> Result<RawRequest, ClientError> {
        let mut raw = self.open(ClientMessage::Watch(request)).await?;
        match self.within("watch", None, raw.recv()).await? {
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
        let what = message_name(&body);
        let mut request = self.within(&what, None, self.open(body)).await?;
        let mut received = 0u64;
        loop {
            match self.within(&what, None, request.recv()).await? {
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
        let what = message_name(&body);
        let mut request = self.within(&what, None, self.open(body)).await?;
        match self.within(&what, None, request.recv()).await? {
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
            let data = ClientMessage::Data {
                data: buf[..n].to_vec(),
            };
            self.within(&what, None, self.send(request.id, data))
                .await?;
        }
        self.within(&what, None, self.send(request.id, ClientMessage::End))
            .await?;
        match self.within(&what, None, request.recv()).await? {
            ServerMessage::Written { bytes } => Ok(bytes),
            other => Err(unexpected("written", &other)),
        }
    }
}

/// A Unix socket connection past the hybrid vsock preamble, within `limit` when given.
async fn unix_stream(
    path: &Path,
    port: u32,
    limit: Option<Duration>,
) -> Result<tokio::net::UnixStream, ClientError> {
    let path_text = path.display().to_string();
    let connect = async {
        let mut stream = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|source| ClientError::Connect {
                path: path_text.clone(),
                source,
            })?;
        hybrid::client_handshake(&mut stream, port)
            .await
            .map_err(|source| ClientError::Handshake {
                path: path_text.clone(),
                source,
            })?;
        Ok(stream)
    };
    let Some(after) = limit else {
        return connect.await;
    };
    tokio::time::timeout(after, connect)
        .await
        .unwrap_or_else(|_| {
            Err(ClientError::Timeout {
                what: format!("the connection and handshake on {path_text}"),
                after,
            })
        })
}

/// `tcp_connect` over a new connection to the agent socket at `path` (see [`tcp_connect`]).
pub async fn connect_unix_tcp(
    path: impl AsRef<Path>,
    vsock_port: u32,
    host: &str,
    port: u16,
) -> Result<tokio::net::UnixStream, ClientError> {
    connect_unix_tcp_with(path, vsock_port, host, port, ClientOptions::default()).await
}

/// [`connect_unix_tcp`] with deadlines: `connect_timeout` for the connection and handshake,
/// `call_timeout` for the agent's answer to `tcp_connect`.
pub async fn connect_unix_tcp_with(
    path: impl AsRef<Path>,
    vsock_port: u32,
    host: &str,
    port: u16,
    options: ClientOptions,
) -> Result<tokio::net::UnixStream, ClientError> {
    let stream = unix_stream(path.as_ref(), vsock_port, options.connect_timeout).await?;
    let Some(after) = options.call_timeout else {
        return tcp_connect(stream, host, port).await;
    };
    tokio::time::timeout(after, tcp_connect(stream, host, port))
        .await
        .unwrap_or_else(|_| {
            Err(ClientError::Timeout {
                what: format!("tcp_connect {host}:{port}"),
                after,
            })
        })
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

/// A request's name for messages: its `op` (`stat`, `read_file`, ...).
fn message_name(body: &ClientMessage) -> String {
    serde_json::to_value(body)
        .ok()
        .and_then(|value| value.get("op")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "a request".to_owned())
}

/// What became of one frame handed to its request.
enum Delivery {
    /// Queued, or nobody waits for the request any more.
    Done,
    /// The caller took nothing for the stall timeout.
    Stalled(Duration),
    /// Every client handle is gone.
    Stop,
}

/// Hands `body` to its request, waiting for room in its queue (the backpressure), for at most
/// `stall` when given.
async fn deliver(
    route: &mpsc::Sender<ServerMessage>,
    body: ServerMessage,
    stall: Option<Duration>,
    stop: &mut oneshot::Receiver<()>,
) -> Delivery {
    let send = async {
        match stall {
            // A closed queue just means nobody waits for this request any more.
            None => {
                let _ = route.send(body).await;
                Delivery::Done
            }
            Some(after) => match tokio::time::timeout(after, route.send(body)).await {
                Ok(_) => Delivery::Done,
                Err(_) => Delivery::Stalled(after),
            },
        }
    };
    tokio::select! {
        delivery = send => delivery,
        _ = stop => Delivery::Stop,
    }
}

async fn read_loop<R: AsyncRead>(
    reader: ReadHalf<R>,
    shared: Weak<Shared>,
    mut stop: oneshot::Receiver<()>,
    stall: Option<Duration>,
) {
    let mut reader = reader;
    let reason = loop {
        let next = tokio::select! {
            next = frame::read_frame::<_, ServerFrame>(&mut reader) => next,
            // Every client handle is gone.
            _ = &mut stop => return,
        };
        let frame = match next {
            Ok(Some(frame)) => frame,
            Ok(None) => break "the agent closed the connection".to_owned(),
            Err(err) => break err.to_string(),
        };
        // No strong handle is held while waiting below: dropping the last client stops us.
        let route = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let mut routes = lock_routes(&shared);
            let route = routes.open.get(&frame.id).cloned();
            if frame.body.is_terminal() {
                routes.open.remove(&frame.id);
            }
            route
        };
        let Some(route) = route else {
            continue;
        };
        match deliver(&route, frame.body, stall, &mut stop).await {
            Delivery::Done => {}
            Delivery::Stop => return,
            Delivery::Stalled(after) => {
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                let reason = format!(
                    "request {} dropped: its caller took no reply for {} s while the agent kept sending",
                    frame.id,
                    seconds(after)
                );
                {
                    let mut routes = lock_routes(&shared);
                    routes.open.remove(&frame.id);
                    routes.dropped.insert(frame.id, reason);
                }
                // The agent stops the work; sent from a task so this reader goes on reading.
                let client = AgentClient { shared };
                let id = frame.id;
                tokio::spawn(async move {
                    let _ = client.send(id, ClientMessage::Cancel).await;
                });
            }
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
    rx: mpsc::Receiver<ServerMessage>,
}

impl Drop for RawRequest {
    /// The route goes at once, so frames still coming for it are dropped without waiting.
    fn drop(&mut self) {
        let mut routes = lock_routes(&self.client.shared);
        routes.open.remove(&self.id);
        routes.dropped.remove(&self.id);
    }
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
                let routes = lock_routes(&self.client.shared);
                let reason = routes
                    .dropped
                    .get(&self.id)
                    .or(routes.closed.as_ref())
                    .cloned()
                    .unwrap_or_else(|| "the request already ended".to_owned());
                Err(ClientError::Disconnected(reason))
            }
        }
    }

    pub(crate) fn try_recv(&mut self) -> Option<ServerMessage> {
        self.rx.try_recv().ok()
    }

    /// Send stream input to this request.
    pub async fn send(&self, body: ClientMessage) -> Result<(), ClientError> {
        self.client.send(self.id, body).await
    }
}

#[cfg(test)]
mod tests;
