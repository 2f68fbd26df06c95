//! envd's data plane, translated to the rollbox agent: `process.Process` and
//! `filesystem.Filesystem` Connect RPCs (JSON codec), `/files`, `/health` and `/envs`.
//!
//! Each process started through `Start` has its own agent connection, owned by a task here, so
//! it outlives the HTTP stream that started it (the agent ends a connection's processes with
//! the connection). Its events fan out to the `Start` stream and to any `Connect` stream; a
//! client that goes away only unsubscribes. An ended process keeps its end event for
//! [`KEEP_ENDED`], so a late `Connect` still gets start + end. A process started with `pty`
//! runs on a terminal in the agent: its output is `data.pty`, `SendInput`/`StreamInput` type
//! into it and `Update` resizes it. Directory watches are in watch.rs.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use base64::Engine as _;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rollbox_agent_protocol::client::{AgentClient, ClientError, ExecEvent};
use rollbox_agent_protocol::messages::{
    ClientMessage, ExecRequest, ExitStatus, FileInfo, FileKind, OutputStream, PtySize,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::api::Chunk;
use super::super::api::Reply;
use super::super::api::{Action, ApiError, FileOp, Sandbox, MAX_BODY, MAX_UPLOAD};
use super::super::http::Out;
use super::connect::{self, Code, RpcError};
use super::watch::{AgentWatch, Next, Watcher};
use super::{json, no_content, query_pairs, rfc3339, E2b, Target, ENVD_PORT, ENV_VARS_KEY};

/// How long an ended process's end event stays for `Connect`.
const KEEP_ENDED: Duration = Duration::from_secs(600);
/// envd's default keepalive interval when the client asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);
/// Deepest `ListDir` recursion.
const MAX_DEPTH: u32 = 32;

/// Processes started through envd: (sandbox id, pid) → the process.
pub(super) type Processes = HashMap<(String, u32), Arc<Process>>;

pub(super) struct Process {
    /// `ProcessConfig` as `List` shows it.
    config: Value,
    tag: Option<String>,
    stdin: bool,
    /// Runs on a terminal (`Start` with `pty`).
    pty: bool,
    client: AgentClient,
    /// The exec's request id on `client`: where the agent takes stdin and signals.
    request: u64,
    state: Mutex<Watchers>,
}

#[derive(Default)]
struct Watchers {
    subscribers: Vec<mpsc::UnboundedSender<Value>>,
    /// The `end` event, once the process ended, and when.
    ended: Option<(Value, Instant)>,
}

impl Process {
    fn watchers(&self) -> MutexGuard<'_, Watchers> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl E2b {
    /// Drops the process table entries and stops the watchers of a sandbox that ended.
    pub(super) fn forget_processes(&self, id: &str) {
        self.processes().retain(|(sandbox, _), _| sandbox != id);
        self.watchers().retain(|_, watcher| {
            let keep = watcher.sandbox != id;
            if !keep {
                watcher.stop();
            }
            keep
        });
    }
}

/// A data-plane request for a sandbox that is not there (the texts the SDK keys on).
fn proxy_error(id: &str, message: String) -> Response<Out> {
    json(
        502,
        &json!({ "sandboxId": id, "message": message, "code": 502 }),
    )
}

pub(super) async fn respond(
    e2b: &Arc<E2b>,
    target: Target,
    request: Request<Incoming>,
) -> Response<Out> {
    let id = target.id.clone();
    let sandbox = match e2b.core.handle(Action::GetSandbox(id.clone())).await {
        Ok(Reply::Sandbox { sandbox, .. }) if sandbox.state.is_live() => sandbox,
        _ => return proxy_error(&id, format!("The sandbox {id} was not found")),
    };
    // Other ports are the guest's own services, reached through the agent: envd's access token
    // is not theirs to check (the code interpreter SDK sends it on /execute but not /contexts).
    match target.port {
        Some(ENVD_PORT) => {}
        Some(port) => return forward_port(e2b, &id, port, request).await,
        None => return proxy_error(&id, format!("sandbox {id}: port is not open (no port)")),
    }
    let path = request.uri().path().to_string();
    let method = request.method().as_str().to_string();
    if method == "GET" && path == "/health" {
        return no_content();
    }
    let token_ok = super::header(&request, "x-access-token")
        .is_some_and(|t| t.trim() == e2b.access_token(&id));
    let rpc = path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/");
    if !token_ok {
        let message = format!("sandbox {id}: missing or wrong X-Access-Token (the envdAccessToken of the create answer)");
        return if rpc {
            unary_error(&RpcError::new(Code::Unauthenticated, message))
        } else {
            json(401, &json!({ "code": 401, "message": message }))
        };
    }
    let user = basic_user(&request);
    let call = Call {
        e2b: Arc::clone(e2b),
        sandbox,
        user,
    };
    match (method.as_str(), path.as_str()) {
        ("GET", "/envs") => json(200, &json!(call.env_vars())),
        ("GET", "/files") => call.download(request).await,
        ("POST", "/files") => call.upload(request).await,
        ("POST", "/process.Process/Start") => call.streaming(request, Stream::Start).await,
        ("POST", "/process.Process/Connect") => call.streaming(request, Stream::Connect).await,
        ("POST", "/process.Process/StreamInput") => call.stream_input(request).await,
        ("POST", "/filesystem.Filesystem/WatchDir") => call.watch_dir(request).await,
        ("POST", rpc_path) if rpc => call.unary(request, rpc_path).await,
        _ => json(
            404,
            &json!({ "code": 404, "message": format!("envd has no route {method} {path}") }),
        ),
    }
}

/// A request for guest `port`, forwarded through the agent; 502 "port is not open" when
/// nothing listens there (the text the SDK keys on).
async fn forward_port(
    e2b: &Arc<E2b>,
    id: &str,
    port: u16,
    request: Request<Incoming>,
) -> Response<Out> {
    let not_open = |why: String| proxy_error(id, format!("sandbox {id}: port is not open ({why})"));
    match e2b.core.guest_tcp(id, port).await {
        Ok(pipe) => super::forward::forward(pipe, port, request)
            .await
            .unwrap_or_else(not_open),
        Err(e) => not_open(e.to_string()),
    }
}

/// The user of `Authorization: Basic base64("user:")`.
fn basic_user(request: &Request<Incoming>) -> Option<String> {
    let encoded = super::header(request, "authorization")?.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let user = text.split(':').next().unwrap_or("");
    (!user.is_empty()).then(|| user.to_string())
}

fn unary_error(error: &RpcError) -> Response<Out> {
    json(error.code.http_status(), &error.body())
}

/// An agent failure as a Connect error.
fn rpc_error(id: &str, error: ClientError) -> RpcError {
    match error {
        ClientError::Agent(info) => {
            let code = match info.code.as_str() {
                "ENOENT" => Code::NotFound,
                "EEXIST" | "ENOTEMPTY" => Code::AlreadyExists,
                "EACCES" | "EPERM" => Code::PermissionDenied,
                "bad_request" | "EINVAL" | "EISDIR" | "ENOTDIR" | "ENAMETOOLONG" | "ELOOP" => {
                    Code::InvalidArgument
                }
                _ => Code::Internal,
            };
            RpcError::new(code, info.message)
        }
        other => RpcError::new(
            Code::Unavailable,
            format!("sandbox {id}: the agent: {other}"),
        ),
    }
}

/// A daemon refusal as a Connect error.
fn api_rpc_error(error: ApiError) -> RpcError {
    let code = match error.status() {
        400 => Code::InvalidArgument,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        503 => Code::Unavailable,
        _ => Code::Internal,
    };
    RpcError::new(code, error.to_string())
}

#[derive(Clone, Copy)]
enum Stream {
    Start,
    Connect,
}

/// One data-plane request: the sandbox and the envd user it runs as.
struct Call {
    e2b: Arc<E2b>,
    sandbox: Sandbox,
    user: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ProcessConfig {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// envd's `PTY` message.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Pty {
    size: Option<TermSize>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct TermSize {
    rows: u32,
    cols: u32,
}

impl Pty {
    /// The agent's terminal size; envd's `size` is required and each side 1..=65535.
    fn size(&self) -> Result<PtySize, RpcError> {
        let Some(size) = &self.size else {
            return Err(RpcError::new(Code::InvalidArgument, "pty.size: required"));
        };
        match (u16::try_from(size.rows), u16::try_from(size.cols)) {
            (Ok(rows @ 1..), Ok(cols @ 1..)) => Ok(PtySize { rows, cols }),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "pty.size: rows {} and cols {} must each be 1..=65535",
                    size.rows, size.cols
                ),
            )),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize)]
struct SelectorRequest {
    #[serde(default)]
    process: Selector,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    signal: Option<Value>,
    #[serde(default)]
    pty: Option<Pty>,
}

#[derive(Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, rename = "includeEntry", alias = "include_entry")]
    include_entry: bool,
    #[serde(default, rename = "watcherId", alias = "watcher_id")]
    watcher_id: String,
    #[serde(default)]
    depth: Option<u32>,
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

fn decode<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> Result<T, RpcError> {
    let body = if body.is_empty() { &b"{}"[..] } else { body };
    serde_json::from_slice(body)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("{what}: {e}")))
}

async fn read_body(request: Request<Incoming>, limit: usize) -> Result<Bytes, String> {
    Limited::new(request.into_body(), limit)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                format!("the request body is over {limit} bytes")
            } else {
                format!("cannot read the request body: {e}")
            }
        })
}

impl Call {
    fn id(&self) -> &str {
        &self.sandbox.id
    }

    /// The sandbox's env; sandboxes made before E2B envVars became the daemon's env kept
    /// them as JSON in metadata [`ENV_VARS_KEY`].
    fn env_vars(&self) -> BTreeMap<String, String> {
        let mut env: BTreeMap<String, String> = self
            .sandbox
            .metadata
            .get(ENV_VARS_KEY)
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        env.extend(self.sandbox.env.clone());
        env
    }

    /// The user's home: where relative paths and `~` resolve.
    fn home(&self) -> String {
        match self.user.as_deref() {
            None | Some("root") => "/root".to_string(),
            Some(user) => format!("/home/{user}"),
        }
    }

    fn resolve(&self, path: &str) -> String {
        let home = self.home();
        if path.is_empty() || path == "~" {
            home
        } else if let Some(rest) = path.strip_prefix("~/") {
            format!("{home}/{rest}")
        } else if path.starts_with('/') {
            path.to_string()
        } else {
            format!("{home}/{path}")
        }
    }

    async fn agent(&self) -> Result<AgentClient, RpcError> {
        self.e2b.core.agent(self.id()).await.map_err(api_rpc_error)
    }

    async fn unary(&self, request: Request<Incoming>, path: &str) -> Response<Out> {
        let body = match read_body(request, MAX_BODY).await {
            Ok(body) => body,
            Err(e) => return unary_error(&RpcError::new(Code::InvalidArgument, e)),
        };
        let method = path.rsplit('/').next().unwrap_or("");
        let result = if path.starts_with("/process.Process/") {
            self.process_call(method, &body).await
        } else {
            self.filesystem_call(method, &body).await
        };
        match result {
            Ok(value) => json(200, &value),
            Err(e) => unary_error(&e),
        }
    }

    fn find(&self, selector: &Selector) -> Result<Arc<Process>, RpcError> {
        let processes = self.e2b.processes();
        let found = match (selector.pid, &selector.tag) {
            (Some(pid), _) => processes.get(&(self.id().to_string(), pid)).cloned(),
            (None, Some(tag)) => processes
                .iter()
                .find(|((sandbox, _), p)| sandbox == self.id() && p.tag.as_ref() == Some(tag))
                .map(|(_, p)| Arc::clone(p)),
            (None, None) => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "process: give a pid or a tag",
                ))
            }
        };
        found.ok_or_else(|| {
            RpcError::new(
                Code::NotFound,
                format!(
                    "process {}: not found in sandbox {} (only processes started through envd are known)",
                    selector.pid.map_or_else(|| format!("{:?}", selector.tag), |p| p.to_string()),
                    self.id()
                ),
            )
        })
    }

    /// A running process (stdin and signals need one).
    fn running(&self, selector: &Selector) -> Result<Arc<Process>, RpcError> {
        let process = self.find(selector)?;
        if process.watchers().ended.is_some() {
            return Err(RpcError::new(
                Code::NotFound,
                format!("process {:?}: it has ended", selector.pid),
            ));
        }
        Ok(process)
    }

    async fn process_call(&self, method: &str, body: &[u8]) -> Result<Value, RpcError> {
        match method {
            "List" => {
                let processes: Vec<Value> = self
                    .e2b
                    .processes()
                    .iter()
                    .filter(|((sandbox, _), p)| {
                        sandbox == self.id() && p.watchers().ended.is_none()
                    })
                    .map(|((_, pid), p)| json!({ "config": p.config, "pid": pid, "tag": p.tag }))
                    .collect();
                Ok(json!({ "processes": processes }))
            }
            "Update" => {
                let request: SelectorRequest = decode(body, method)?;
                let process = self.running(&request.process)?;
                // Nothing but the terminal size can be updated; without one there is nothing to do.
                let Some(pty) = &request.pty else {
                    return Ok(json!({}));
                };
                let size = pty.size()?;
                if !process.pty {
                    return Err(RpcError::new(
                        Code::FailedPrecondition,
                        format!("pty: process {:?} was started without a PTY, so it has no terminal to resize", request.process.pid),
                    ));
                }
                process
                    .client
                    .send(process.request, ClientMessage::Resize(size))
                    .await
                    .map_err(|e| rpc_error(self.id(), e))?;
                Ok(json!({}))
            }
            "SendInput" | "CloseStdin" | "SendSignal" => {
                let request: SelectorRequest = decode(body, method)?;
                let process = self.running(&request.process)?;
                let message = match method {
                    "SendInput" => input_message(&process, request.input.as_ref())?,
                    "CloseStdin" if process.pty => {
                        return Err(RpcError::new(
                            Code::FailedPrecondition,
                            "process runs on a PTY, whose input cannot be closed alone: send \\x04 (Ctrl-D) for end-of-file",
                        ))
                    }
                    "CloseStdin" => ClientMessage::StdinClose,
                    _ => ClientMessage::Signal {
                        signal: signal_number(request.signal.as_ref())?,
                        group: true,
                    },
                };
                process
                    .client
                    .send(process.request, message)
                    .await
                    .map_err(|e| rpc_error(self.id(), e))?;
                Ok(json!({}))
            }
            "StreamInput" => Err(RpcError::new(
                Code::InvalidArgument,
                "process.Process/StreamInput is a client stream: send it as application/connect+json",
            )),
            other => Err(RpcError::new(
                Code::Unimplemented,
                format!("process.Process/{other}: no such method"),
            )),
        }
    }

    async fn filesystem_call(&self, method: &str, body: &[u8]) -> Result<Value, RpcError> {
        let request: PathRequest = decode(body, method)?;
        match method {
            "CreateWatcher" => return self.create_watcher(&request).await,
            "GetWatcherEvents" => {
                let watcher = self.watcher(&request.watcher_id)?;
                let taken = watcher.take();
                if taken.is_err() {
                    // The end is told once; the watcher is gone after it.
                    self.e2b.watchers().remove(&request.watcher_id);
                }
                return taken.map(|events| json!({ "events": events }));
            }
            "RemoveWatcher" => {
                let watcher = self.watcher(&request.watcher_id)?;
                watcher.stop();
                self.e2b.watchers().remove(&request.watcher_id);
                return Ok(json!({}));
            }
            "WatchDir" => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "filesystem.Filesystem/WatchDir is a server stream: send it as application/connect+json",
                ))
            }
            _ => {}
        }
        let client = self.agent().await?;
        let fail = |e| rpc_error(self.id(), e);
        let result = match method {
            "Stat" => {
                let info = client
                    .lstat(&self.resolve(&request.path))
                    .await
                    .map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "ListDir" => {
                let depth = request.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
                let mut entries = Vec::new();
                let mut dirs = vec![(self.resolve(&request.path), 1)];
                while let Some((dir, level)) = dirs.pop() {
                    for info in client.list(&dir).await.map_err(fail)? {
                        if info.kind == FileKind::Dir && level < depth {
                            dirs.push((info.path.clone(), level + 1));
                        }
                        entries.push(entry(&info));
                    }
                }
                Ok(json!({ "entries": entries }))
            }
            "MakeDir" => {
                let path = self.resolve(&request.path);
                if client.lstat(&path).await.is_ok() {
                    return Err(RpcError::new(
                        Code::AlreadyExists,
                        format!("path: {path} already exists"),
                    ));
                }
                client.mkdir(&path, true).await.map_err(fail)?;
                let info = client.lstat(&path).await.map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "Move" => {
                let (from, to) = (
                    self.resolve(&request.source),
                    self.resolve(&request.destination),
                );
                client.rename(&from, &to).await.map_err(fail)?;
                let info = client.lstat(&to).await.map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "Remove" => {
                client
                    .remove(&self.resolve(&request.path), true)
                    .await
                    .map_err(fail)?;
                Ok(json!({}))
            }
            other => Err(RpcError::new(
                Code::Unimplemented,
                format!("filesystem.Filesystem/{other}: no such method"),
            )),
        };
        let _ = client.close().await;
        result
    }

    /// `Start` and `Connect`: a stream of envelopes, errors in the end envelope.
    async fn streaming(&self, request: Request<Incoming>, kind: Stream) -> Response<Out> {
        let keepalive = keepalive_of(&request);
        let timeout_ms = connect::timeout_ms(super::header(&request, "connect-timeout-ms"));
        let (tx, rx) = mpsc::channel::<Chunk>(16);
        let subscribed = match read_body(request, MAX_BODY).await {
            Err(e) => Err(RpcError::new(Code::InvalidArgument, e)),
            Ok(body) => match connect::first_message(&body) {
                Err(e) => Err(RpcError::new(Code::InvalidArgument, e.to_string())),
                Ok(message) => match kind {
                    Stream::Start => self.start(message, timeout_ms).await,
                    Stream::Connect => self.connect(message),
                },
            },
        };
        match subscribed {
            Ok((pid, events)) => {
                tokio::spawn(forward(pid, events, tx, keepalive));
            }
            Err(error) => {
                let _ = tx.try_send(Ok(Bytes::from(connect::end_stream(Some(&error)))));
            }
        }
        connect_stream_response(Out::Stream(rx))
    }

    async fn start(
        &self,
        message: &[u8],
        timeout_ms: Option<u64>,
    ) -> Result<(u32, mpsc::UnboundedReceiver<Value>), RpcError> {
        let request: StartRequest = decode(message, "StartRequest")?;
        let pty = request.pty.as_ref().map(Pty::size).transpose()?;
        let config = &request.process;
        if config.cmd.is_empty() {
            return Err(RpcError::new(Code::InvalidArgument, "process.cmd: empty"));
        }
        // A terminal always takes input.
        let stdin = pty.is_some() || request.stdin.unwrap_or(true);
        let mut argv = vec![config.cmd.clone()];
        argv.extend(config.args.iter().cloned());
        let mut exec = ExecRequest::argv(argv);
        let mut env = self.env_vars();
        env.extend(config.envs.clone());
        exec.env = env;
        exec.cwd = config
            .cwd
            .as_deref()
            .filter(|c| !c.is_empty())
            .map(|c| self.resolve(c));
        exec.user = self.user.clone();
        exec.timeout_ms = timeout_ms;
        exec.stdin = stdin;
        exec.pty = pty;
        let client = self.agent().await?;
        let mut handle = client
            .exec(exec)
            .await
            .map_err(|e| rpc_error(self.id(), e))?;
        let pid = handle
            .started()
            .await
            .map_err(|e| rpc_error(self.id(), e))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let process = Arc::new(Process {
            config: json!({ "cmd": config.cmd, "args": config.args, "envs": config.envs, "cwd": config.cwd }),
            tag: request.tag,
            stdin,
            pty: pty.is_some(),
            client: client.clone(),
            request: handle.id(),
            state: Mutex::new(Watchers {
                subscribers: vec![tx],
                ended: None,
            }),
        });
        let key = (self.id().to_string(), pid);
        {
            let mut processes = self.e2b.processes();
            processes.retain(|_, p| {
                p.watchers()
                    .ended
                    .as_ref()
                    .is_none_or(|(_, at)| at.elapsed() < KEEP_ENDED)
            });
            processes.insert(key, Arc::clone(&process));
        }
        // The pump: owns the agent connection until the process ends, whoever listens.
        tokio::spawn(async move {
            loop {
                let (event, last) = match handle.next_event().await {
                    Ok(Some(ExecEvent::Output { stream, data, .. })) => {
                        let data = base64::engine::general_purpose::STANDARD.encode(&data);
                        let field = match stream {
                            OutputStream::Stdout => "stdout",
                            OutputStream::Stderr => "stderr",
                            OutputStream::Pty => "pty",
                        };
                        (json!({ "data": { field: data } }), false)
                    }
                    Ok(Some(ExecEvent::Exited(status))) => (end_event(&status), true),
                    Ok(Some(ExecEvent::Started { .. } | ExecEvent::Notice(_))) => continue,
                    Ok(None) => (
                        lost_event("the agent ended the stream without an exit"),
                        true,
                    ),
                    Err(e) => (
                        lost_event(&format!("the agent connection broke: {e}")),
                        true,
                    ),
                };
                let mut watchers = process.watchers();
                watchers
                    .subscribers
                    .retain(|s| s.send(event.clone()).is_ok());
                if last {
                    watchers.ended = Some((event, Instant::now()));
                    watchers.subscribers.clear();
                    break;
                }
            }
            let _ = client.close().await;
        });
        Ok((pid, rx))
    }

    fn connect(&self, message: &[u8]) -> Result<(u32, mpsc::UnboundedReceiver<Value>), RpcError> {
        #[derive(Deserialize)]
        struct ConnectRequest {
            #[serde(default)]
            process: Selector,
        }
        let request: ConnectRequest = decode(message, "ConnectRequest")?;
        let process = self.find(&request.process)?;
        let pid = self
            .e2b
            .processes()
            .iter()
            .find(|(_, p)| Arc::ptr_eq(p, &process))
            .map(|((_, pid), _)| *pid)
            .unwrap_or_default();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut watchers = process.watchers();
        match &watchers.ended {
            Some((end, _)) => {
                let _ = tx.send(end.clone());
            }
            None => watchers.subscribers.push(tx),
        }
        Ok((pid, rx))
    }

    /// `StreamInput`, a client stream: a `start` naming the process, then `data` inputs (and
    /// `keepalive`s), each passed to the agent as it arrives; answered when the body ends.
    async fn stream_input(&self, request: Request<Incoming>) -> Response<Out> {
        let body = match self.take_input_stream(request.into_body()).await {
            Ok(()) => [connect::message(&json!({})), connect::end_stream(None)].concat(),
            Err(error) => connect::end_stream(Some(&error)),
        };
        connect_stream_response(Out::Full(Some(Bytes::from(body))))
    }

    async fn take_input_stream(&self, mut body: Incoming) -> Result<(), RpcError> {
        #[derive(Deserialize)]
        struct StreamInputRequest {
            #[serde(default)]
            start: Option<StartEvent>,
            #[serde(default)]
            data: Option<DataEvent>,
            #[serde(default)]
            keepalive: Option<Value>,
        }
        #[derive(Deserialize)]
        struct StartEvent {
            #[serde(default)]
            process: Selector,
        }
        #[derive(Deserialize)]
        struct DataEvent {
            #[serde(default)]
            input: Option<Value>,
        }
        let mut buffer: Vec<u8> = Vec::new();
        let mut process: Option<Arc<Process>> = None;
        let mut body_done = false;
        loop {
            while let Some(envelope) = connect::next_envelope(&buffer)
                .map_err(|e| RpcError::new(Code::InvalidArgument, e.to_string()))?
            {
                let event: StreamInputRequest = decode(envelope.payload, "StreamInputRequest")?;
                let taken = envelope.taken;
                match (event.start, event.data, &process) {
                    (Some(start), None, None) => process = Some(self.running(&start.process)?),
                    (Some(_), _, Some(_)) => {
                        return Err(RpcError::new(
                            Code::InvalidArgument,
                            "StreamInput: a second start event (one stream feeds one process)",
                        ))
                    }
                    (None, Some(data), Some(process)) => {
                        let message = input_message(process, data.input.as_ref())?;
                        process
                            .client
                            .send(process.request, message)
                            .await
                            .map_err(|e| rpc_error(self.id(), e))?;
                    }
                    (None, Some(_), None) => {
                        return Err(RpcError::new(
                            Code::InvalidArgument,
                            "StreamInput: data before the start event that names the process",
                        ))
                    }
                    (None, None, _) if event.keepalive.is_some() => {}
                    _ => {
                        return Err(RpcError::new(
                            Code::InvalidArgument,
                            "StreamInput: an event is none of start, data or keepalive",
                        ))
                    }
                }
                buffer.drain(..taken);
            }
            if body_done {
                break;
            }
            match body.frame().await {
                None => body_done = true,
                Some(Err(e)) => {
                    return Err(RpcError::new(
                        Code::InvalidArgument,
                        format!("StreamInput: cannot read the request body: {e}"),
                    ))
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buffer.extend_from_slice(&data);
                    }
                    if buffer.len() > MAX_BODY {
                        return Err(RpcError::new(
                            Code::ResourceExhausted,
                            format!("StreamInput: one envelope is over {MAX_BODY} bytes"),
                        ));
                    }
                }
            }
        }
        if !buffer.is_empty() {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "StreamInput: the body ends inside a Connect envelope ({} bytes left over)",
                    buffer.len()
                ),
            ));
        }
        match process {
            Some(_) => Ok(()),
            None => Err(RpcError::new(
                Code::InvalidArgument,
                "StreamInput: the stream has no start event naming the process",
            )),
        }
    }

    /// Starts a watch of `request.path` on a new agent connection.
    async fn open_watch(&self, request: &PathRequest) -> Result<(String, AgentWatch), RpcError> {
        let path = self.resolve(&request.path);
        let client = self.agent().await?;
        let watch = AgentWatch::start(
            client,
            path.clone(),
            request.recursive,
            request.include_entry,
        )
        .await
        .map_err(|e| rpc_error(self.id(), e))?;
        Ok((path, watch))
    }

    /// `WatchDir`: `start`, then `filesystem` events (and `keepalive`s) until the client goes
    /// or the watch ends, which the end envelope reports.
    async fn watch_dir(&self, request: Request<Incoming>) -> Response<Out> {
        let keepalive = keepalive_of(&request);
        let (tx, rx) = mpsc::channel::<Chunk>(16);
        let opened = match read_body(request, MAX_BODY).await {
            Err(e) => Err(RpcError::new(Code::InvalidArgument, e)),
            Ok(body) => match connect::first_message(&body) {
                Err(e) => Err(RpcError::new(Code::InvalidArgument, e.to_string())),
                Ok(message) => match decode::<PathRequest>(message, "WatchDirRequest") {
                    Ok(request) => self.open_watch(&request).await,
                    Err(e) => Err(e),
                },
            },
        };
        match opened {
            Ok((_, watch)) => {
                tokio::spawn(forward_watch(watch.pump(), tx, keepalive));
            }
            Err(error) => {
                let _ = tx.try_send(Ok(Bytes::from(connect::end_stream(Some(&error)))));
            }
        }
        connect_stream_response(Out::Stream(rx))
    }

    async fn create_watcher(&self, request: &PathRequest) -> Result<Value, RpcError> {
        let (_, watch) = self.open_watch(request).await?;
        let number = self
            .e2b
            .next_watcher
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}-watcher-{number}", self.id());
        let watcher = Watcher::spawn(id.clone(), self.id().to_string(), watch);
        let mut watchers = self.e2b.watchers();
        watchers.retain(|_, w| !w.expired());
        watchers.insert(id.clone(), watcher);
        Ok(json!({ "watcherId": id }))
    }

    fn watcher(&self, id: &str) -> Result<Arc<Watcher>, RpcError> {
        self.e2b
            .watchers()
            .get(id)
            .filter(|w| w.sandbox == self.id())
            .cloned()
            .ok_or_else(|| {
                RpcError::new(
                    Code::NotFound,
                    format!(
                        "watcher {id:?}: not found in sandbox {} (removed, ended and collected, or never made)",
                        self.id()
                    ),
                )
            })
    }

    async fn download(&self, request: Request<Incoming>) -> Response<Out> {
        let query = request.uri().query().unwrap_or("").to_string();
        let call = self.with_query_user(&query);
        let Some(path) = query_value(&query, "path") else {
            return files_error(400, "path: required".to_string());
        };
        let path = call.resolve(&path);
        let read = Action::File {
            id: self.id().to_string(),
            op: FileOp::Read { path: path.clone() },
        };
        match self.e2b.core.handle(read).await {
            Ok(Reply::Stream { body, .. }) => {
                let mut response = Response::new(Out::Stream(body));
                response.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/octet-stream"),
                );
                response
            }
            Ok(other) => files_error(500, format!("path {path}: the read answered {other:?}")),
            Err(e) => files_error(e.status(), format!("path {path}: {e}")),
        }
    }

    /// The same call as the `?username=` user, when the query names one.
    fn with_query_user(&self, query: &str) -> Call {
        Call {
            e2b: Arc::clone(&self.e2b),
            sandbox: self.sandbox.clone(),
            user: query_value(query, "username")
                .filter(|u| !u.is_empty())
                .or_else(|| self.user.clone()),
        }
    }

    async fn upload(&self, request: Request<Incoming>) -> Response<Out> {
        let query = request.uri().query().unwrap_or("").to_string();
        let call = self.with_query_user(&query);
        let content_type = super::header(&request, "content-type")
            .unwrap_or("")
            .to_string();
        let gzip = super::header(&request, "content-encoding")
            .is_some_and(|e| e.trim().eq_ignore_ascii_case("gzip"));
        let body = match read_body(request, MAX_UPLOAD).await {
            Ok(body) => body,
            Err(e) if e.contains("over") => return files_error(413, e),
            Err(e) => return files_error(400, e),
        };
        let body = if gzip {
            let mut out = Vec::new();
            let mut decoder = flate2::read::GzDecoder::new(&body[..]).take(MAX_UPLOAD as u64 + 1);
            if let Err(e) = std::io::Read::read_to_end(&mut decoder, &mut out) {
                return files_error(400, format!("the gzip body does not decode: {e}"));
            }
            if out.len() > MAX_UPLOAD {
                return files_error(413, format!("the decoded body is over {MAX_UPLOAD} bytes"));
            }
            Bytes::from(out)
        } else {
            body
        };
        let query_path = query_value(&query, "path").filter(|p| !p.is_empty());
        let files: Vec<(String, Bytes)> = if content_type.starts_with("multipart/form-data") {
            let parts = match multipart(&content_type, &body) {
                Ok(parts) => parts,
                Err(e) => return files_error(400, e),
            };
            let single = parts.len() == 1;
            let mut files = Vec::new();
            for (filename, data) in parts {
                let path = match (&query_path, filename) {
                    (Some(path), _) if single => path.clone(),
                    (_, Some(name)) if !name.is_empty() => name,
                    _ => {
                        return files_error(
                            400,
                            "path: a part has no filename and the query no path".to_string(),
                        )
                    }
                };
                files.push((path, data));
            }
            files
        } else {
            match query_path {
                Some(path) => vec![(path, body)],
                None => {
                    return files_error(400, "path: required for an octet-stream upload".into())
                }
            }
        };
        if files.is_empty() {
            return files_error(400, "the multipart body has no file part".into());
        }
        let mut written = Vec::new();
        for (path, data) in files {
            let path = call.resolve(&path);
            let op = FileOp::Write {
                path: path.clone(),
                mode: None,
                parents: true,
            };
            if let Err(e) = self.e2b.core.upload(self.id(), op, &data[..]).await {
                return files_error(e.status(), format!("path {path}: {e}"));
            }
            let name = path.rsplit('/').next().unwrap_or("").to_string();
            written.push(json!({ "path": path, "name": name, "type": "file" }));
        }
        json(200, &Value::Array(written))
    }
}

use std::io::Read as _;

/// The keepalive interval a stream asked for (`Keepalive-Ping-Interval`, seconds).
fn keepalive_of(request: &Request<Incoming>) -> Duration {
    super::header(request, "keepalive-ping-interval")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(DEFAULT_KEEPALIVE, Duration::from_secs)
}

/// A 200 answer of Connect envelopes.
fn connect_stream_response(body: Out) -> Response<Out> {
    let mut response = Response::new(body);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/connect+json"),
    );
    response
}

/// The agent input of a `ProcessInput` (`{stdin}` or `{pty}`, base64) for `process`.
fn input_message(process: &Process, input: Option<&Value>) -> Result<ClientMessage, RpcError> {
    let input = input.unwrap_or(&Value::Null);
    let (field, data) = match (input.get("stdin"), input.get("pty")) {
        (Some(data), None) => ("stdin", data),
        (None, Some(data)) => ("pty", data),
        _ => {
            return Err(RpcError::new(
                Code::InvalidArgument,
                "input: give exactly one of stdin or pty",
            ))
        }
    };
    if field == "pty" && !process.pty {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            "input.pty: the process was started without a PTY (send input.stdin)",
        ));
    }
    if !process.stdin {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            "process was started with stdin=false: its stdin is /dev/null",
        ));
    }
    let data = data.as_str().ok_or_else(|| {
        RpcError::new(
            Code::InvalidArgument,
            format!("input.{field}: not a base64 string"),
        )
    })?;
    let data = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("input.{field}: {e}")))?;
    Ok(ClientMessage::Stdin { data })
}

/// Writes a watch's events to a `WatchDir` stream: `start`, `filesystem` events, `keepalive`
/// after `keepalive` of silence, then the end envelope. Returns when the client is gone
/// (dropping `events` ends the watch).
async fn forward_watch(
    mut events: mpsc::Receiver<Next>,
    tx: mpsc::Sender<Chunk>,
    keepalive: Duration,
) {
    let send = |value: Value| {
        let tx = tx.clone();
        async move {
            tx.send(Ok(Bytes::from(connect::message(&value))))
                .await
                .is_ok()
        }
    };
    if !send(json!({ "start": {} })).await {
        return;
    }
    loop {
        let next = tokio::select! {
            next = events.recv() => next,
            () = tokio::time::sleep(keepalive) => {
                if !send(json!({ "keepalive": {} })).await {
                    return;
                }
                continue;
            }
            () = tx.closed() => return,
        };
        match next {
            Some(Next::Events(batch)) => {
                for event in batch {
                    if !send(json!({ "filesystem": event })).await {
                        return;
                    }
                }
            }
            Some(Next::Ended(error)) => {
                let _ = tx
                    .send(Ok(Bytes::from(connect::end_stream(Some(&error)))))
                    .await;
                return;
            }
            None => {
                let error = RpcError::new(Code::Unavailable, "the watch's event pump stopped");
                let _ = tx
                    .send(Ok(Bytes::from(connect::end_stream(Some(&error)))))
                    .await;
                return;
            }
        }
    }
}

/// envd's `/files` error body.
fn files_error(status: u16, message: String) -> Response<Out> {
    json(status, &json!({ "code": status, "message": message }))
}

fn query_value(query: &str, name: &str) -> Option<String> {
    query_pairs(query)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

/// The file parts of a multipart/form-data body: (filename, data).
fn multipart(content_type: &str, body: &[u8]) -> Result<Vec<(Option<String>, Bytes)>, String> {
    let boundary = content_type
        .split(';')
        .filter_map(|p| p.trim().strip_prefix("boundary="))
        .next()
        .map(|b| b.trim_matches('"').to_string())
        .ok_or_else(|| "content-type: multipart without a boundary".to_string())?;
    let delimiter = format!("--{boundary}").into_bytes();
    let mut parts = Vec::new();
    let mut rest = match find(body, &delimiter) {
        Some(at) => &body[at + delimiter.len()..],
        None => return Err("multipart: the body has no boundary line".into()),
    };
    loop {
        if rest.starts_with(b"--") {
            return Ok(parts);
        }
        let rest_after_crlf = rest.strip_prefix(b"\r\n").unwrap_or(rest);
        let headers_end = find(rest_after_crlf, b"\r\n\r\n")
            .ok_or_else(|| "multipart: a part's headers do not end".to_string())?;
        let headers = String::from_utf8_lossy(&rest_after_crlf[..headers_end]).to_string();
        let data_start = &rest_after_crlf[headers_end + 4..];
        let mut closing = b"\r\n".to_vec();
        closing.extend_from_slice(&delimiter);
        let data_end = find(data_start, &closing)
            .ok_or_else(|| "multipart: a part does not end with the boundary".to_string())?;
        let data = Bytes::copy_from_slice(&data_start[..data_end]);
        let disposition = headers
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .unwrap_or("");
        let filename = disposition.split(';').find_map(|p| {
            p.trim()
                .strip_prefix("filename=")
                .map(|f| f.trim_matches('"').to_string())
        });
        let name = disposition.split(';').find_map(|p| {
            p.trim()
                .strip_prefix("name=")
                .map(|f| f.trim_matches('"').to_string())
        });
        if name.as_deref() == Some("file") || filename.is_some() {
            parts.push((filename, data));
        }
        rest = &data_start[data_end + closing.len()..];
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The signal of a `SendSignal` request (enum name or number).
fn signal_number(signal: Option<&Value>) -> Result<i32, RpcError> {
    match signal {
        Some(Value::String(name)) => match name.as_str() {
            "SIGNAL_SIGKILL" => Ok(9),
            "SIGNAL_SIGTERM" => Ok(15),
            other => Err(RpcError::new(
                Code::InvalidArgument,
                format!("signal: {other:?} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"),
            )),
        },
        Some(Value::Number(n)) => match n.as_i64() {
            Some(9) => Ok(9),
            Some(15) => Ok(15),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!("signal: {n} is not 9 (SIGKILL) or 15 (SIGTERM)"),
            )),
        },
        _ => Err(RpcError::new(Code::InvalidArgument, "signal: required")),
    }
}

/// envd's `EndEvent` for an agent exit status (Go's ProcessState wording).
fn end_event(status: &ExitStatus) -> Value {
    let (exit_code, exited, text) = match (status.code, status.signal) {
        (Some(code), _) => (code, true, format!("exit status {code}")),
        (None, Some(9)) => (-1, false, "signal: killed".to_string()),
        (None, Some(signal)) => (-1, false, format!("signal: {signal}")),
        (None, None) => (-1, false, "unknown".to_string()),
    };
    let mut end = json!({ "exitCode": exit_code, "exited": exited, "status": text });
    if status.timed_out {
        end["error"] = json!("the command's timeout expired: its process group was killed");
    }
    json!({ "end": end })
}

fn lost_event(message: &str) -> Value {
    json!({ "end": { "exitCode": -1, "exited": false, "status": "unknown", "error": message } })
}

/// Writes a process's events to one stream: `start`, then the events, `keepalive` after
/// `keepalive` of silence, and the end-of-stream envelope after `end`.
async fn forward(
    pid: u32,
    mut events: mpsc::UnboundedReceiver<Value>,
    tx: mpsc::Sender<Chunk>,
    keepalive: Duration,
) {
    let send = |event: Value| {
        let tx = tx.clone();
        async move {
            tx.send(Ok(Bytes::from(connect::message(
                &json!({ "event": event }),
            ))))
            .await
            .is_ok()
        }
    };
    if !send(json!({ "start": { "pid": pid } })).await {
        return;
    }
    loop {
        match tokio::time::timeout(keepalive, events.recv()).await {
            Err(_) => {
                if !send(json!({ "keepalive": {} })).await {
                    return;
                }
            }
            Ok(Some(event)) => {
                let last = event.get("end").is_some();
                if !send(event).await {
                    return;
                }
                if last {
                    let _ = tx.send(Ok(Bytes::from(connect::end_stream(None)))).await;
                    return;
                }
            }
            Ok(None) => {
                let error = RpcError::new(Code::Unavailable, "the process's event stream ended");
                let _ = tx
                    .send(Ok(Bytes::from(connect::end_stream(Some(&error)))))
                    .await;
                return;
            }
        }
    }
}

/// envd's `EntryInfo`.
pub(super) fn entry(info: &FileInfo) -> Value {
    let (kind, letter) = match info.kind {
        FileKind::File => ("FILE_TYPE_FILE", '-'),
        FileKind::Dir => ("FILE_TYPE_DIRECTORY", 'd'),
        FileKind::Symlink => ("FILE_TYPE_SYMLINK", 'l'),
        FileKind::Other => ("FILE_TYPE_UNSPECIFIED", '?'),
    };
    let mut permissions = String::from(letter);
    for shift in [6, 3, 0] {
        let bits = (info.mode >> shift) & 7;
        permissions.push(if bits & 4 != 0 { 'r' } else { '-' });
        permissions.push(if bits & 2 != 0 { 'w' } else { '-' });
        permissions.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    let name_of = |id: u32| {
        if id == 0 {
            "root".to_string()
        } else {
            id.to_string()
        }
    };
    let mtime_ms = u64::try_from(info.mtime_ns / 1_000_000).unwrap_or(0);
    let mut value = json!({
        "name": info.name,
        "type": kind,
        "path": info.path,
        "size": info.size,
        "mode": info.mode,
        "permissions": permissions,
        "owner": name_of(info.uid),
        "group": name_of(info.gid),
        "modifiedTime": rfc3339(mtime_ms),
    });
    if let Some(target) = &info.link_target {
        value["symlinkTarget"] = json!(target);
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_parts_keep_full_path_filenames() {
        let body = b"--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"rel/c\"\r\n\r\n\r\n--XY--\r\n";
        let parts = multipart("multipart/form-data; boundary=XY", body).expect("parts");
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].0.as_deref(), Some("/tmp/a b.txt"));
        assert_eq!(&parts[0].1[..], b"hello");
        assert_eq!(parts[1].0.as_deref(), Some("rel/c"));
        assert!(parts[1].1.is_empty());
        assert!(multipart("multipart/form-data", body).is_err());
        assert!(multipart("multipart/form-data; boundary=XY", b"--XY\r\nno end").is_err());
    }

    #[test]
    fn pty_sizes_are_checked_by_name() {
        let pty: Pty =
            serde_json::from_value(json!({"size": {"rows": 24, "cols": 80}})).expect("pty");
        assert_eq!(pty.size(), Ok(PtySize { rows: 24, cols: 80 }));
        let missing: Pty = serde_json::from_value(json!({})).expect("pty");
        assert_eq!(
            missing.size().map_err(|e| e.message),
            Err("pty.size: required".into())
        );
        // The SDK leaves zero values out: an absent cols is 0.
        let zero: Pty = serde_json::from_value(json!({"size": {"rows": 24}})).expect("pty");
        let huge: Pty =
            serde_json::from_value(json!({"size": {"rows": 70000, "cols": 1}})).expect("pty");
        for (pty, text) in [
            (zero, "rows 24 and cols 0"),
            (huge, "rows 70000 and cols 1"),
        ] {
            let err = pty.size().expect_err("refused");
            assert_eq!(err.code, Code::InvalidArgument);
            assert!(err.message.contains(text), "{err}");
        }
    }

    #[test]
    fn end_events_use_go_wording() {
        let mut status = ExitStatus {
            code: Some(3),
            signal: None,
            timed_out: false,
            oom_killed: false,
            oom_detection: rollbox_agent_protocol::messages::OomDetection::default(),
            truncated: false,
            stdout_bytes: 0,
            stderr_bytes: 0,
            duration_ms: 1,
        };
        assert_eq!(
            end_event(&status),
            json!({"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}})
        );
        status.code = None;
        status.signal = Some(9);
        assert_eq!(end_event(&status)["end"]["status"], "signal: killed");
        assert_eq!(signal_number(Some(&json!("SIGNAL_SIGKILL"))), Ok(9));
        assert_eq!(signal_number(Some(&json!(15))), Ok(15));
        assert!(signal_number(Some(&json!("SIGHUP"))).is_err());
    }
}
